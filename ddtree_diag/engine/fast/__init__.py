"""Fast decode rounds (see ``decoder``): the same rounds as the eager loop, shaped for a GPU.

Modules by job: ``tree`` (the draft tree as device tensors), ``layers`` (fused projections and
layer halves, windowed attention), ``kernels`` + ``triton_kernels`` (fused norms, rotary and
SwiGLU), ``graphs`` (CUDA-graph capture and stage timing), ``decoder`` (the ``FastDecoder`` that
runs the rounds).
"""

from ddtree_diag.engine.fast.decoder import FastDecoder

__all__ = ["FastDecoder"]
