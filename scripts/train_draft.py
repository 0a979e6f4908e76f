"""Train the embedded SmolLM2 DFlash draft: python scripts/train_draft.py --out DIR [options].

Thin wrapper over ddtree_diag.draft_training.main (the same function a `ddtree-diag train-draft`
command can call). GPU when available; tiny settings run on CPU, e.g.
    python scripts/train_draft.py --out /tmp/draft --max-prompts 4 --max-new-tokens 24 --steps 3 \
        --batch-size 2
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ddtree_diag.draft_training import main

if __name__ == "__main__":
    raise SystemExit(main())
