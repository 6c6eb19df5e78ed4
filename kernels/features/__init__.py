"""Pallas kernels of the feature maps (`atlas_jax.features`): sym_2's backward on a GPU."""

from atlas_jax.kernels import lazy_exports

__getattr__ = lazy_exports(__name__, {"symmetric_square_backward_gpu": "gpu"})
__all__ = ["symmetric_square_backward_gpu"]
