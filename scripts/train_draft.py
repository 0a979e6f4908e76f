"""Train the embedded SmolLM2 DFlash draft: python scripts/train_draft.py --out DIR [options].

The same as ``ddtree-diag train-draft``. GPU when available; tiny settings run on CPU, e.g.
    python scripts/train_draft.py --out /tmp/draft --max-prompts 4 --max-new-tokens 24 --steps 3 \
        --batch-size 2
"""

import sys

from ddtree_diag.cli import main

if __name__ == "__main__":
    main(["train-draft", *sys.argv[1:]])
