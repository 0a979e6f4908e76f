"""Fast decode rounds (see ``decoder``): the same rounds as the eager loop, shaped for a GPU.

Modules by job: ``tree`` (the draft tree as device tensors), ``layers`` (fused projections and
layer halves, windowed attention), ``graphs`` (CUDA-graph capture and stage timing), ``decoder``
(the ``FastDecoder`` that runs the rounds).
"""

from ddtree_diag.engine.fast.decoder import FastDecoder, attention_window
from ddtree_diag.engine.fast.layers import FusedWeights
from ddtree_diag.engine.fast.tree import ancestors_from_parents, bucket_size, build_tree_tensors, tree_node_count

__all__ = [
    "FastDecoder", "FusedWeights", "ancestors_from_parents", "attention_window", "bucket_size",
    "build_tree_tensors", "tree_node_count",
]  # fmt: skip
