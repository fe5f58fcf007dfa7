"""Accelerator kernels behind portable fallbacks (see `model.forward`'s `attention` argument)."""
