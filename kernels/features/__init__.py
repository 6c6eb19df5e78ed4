"""Pallas kernels of the feature maps (`atlas_jax.features`) on a GPU: the degree-2 polynomial map's
rows (forward) and sym_2's backward."""

from atlas_jax.kernels import lazy_exports

__getattr__ = lazy_exports(__name__, {"polynomial2_features_gpu": "gpu", "symmetric_square_backward_gpu": "gpu"})
__all__ = ["polynomial2_features_gpu", "symmetric_square_backward_gpu"]
