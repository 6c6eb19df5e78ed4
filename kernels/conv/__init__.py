"""Pallas GPU kernels (Triton lowering) of the causal depthwise short convolution + SiLU.

`gpu.py`: `causal_conv_silu_gpu` (forward and backward kernels tied by a custom VJP) and
`ConvGpuBlockSizes`. The XLA reference is `atlas_jax.models.layers.causal_conv_silu`.
"""

# Imported lazily: importing this package must not pull in Pallas (Triton).
_EXPORTS = {"causal_conv_silu_gpu": "gpu", "ConvGpuBlockSizes": "gpu"}


def __getattr__(name):
    if name in _EXPORTS:
        import importlib
        module = importlib.import_module(f"{__name__}.{_EXPORTS[name]}")
        return getattr(module, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
