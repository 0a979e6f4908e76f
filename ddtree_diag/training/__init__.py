"""Training a DFlash draft for a target by self-distillation (``ddtree-diag train-draft``)."""
