"""Pallas kernels for the deep memories' sequential chunk pass (the dual form's θ-carrying part).

GPU (Pallas, Triton lowering): `gpu.py` (`mlp_state_pass_gpu`, `MLPGpuBlockSizes`). The public op
is `atlas_jax.ops.deep_memory.mlp_state_pass(..., impl="pallas")`, which loads this at trace time.
"""

# Imported lazily: importing this package must not pull in Pallas.
_EXPORTS = {"mlp_state_pass_gpu": "gpu", "MLPGpuBlockSizes": "gpu"}


def __getattr__(name):
    if name in _EXPORTS:
        import importlib
        module = importlib.import_module(f"{__name__}.{_EXPORTS[name]}")
        return getattr(module, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
