"""Pallas kernels for the exact chunked delta family (DeltaNet, Gated DeltaNet, KDA).

GPU (Hopper): `gpu.py`. TPU (Mosaic): `tpu.py`.
"""

# GPU (Pallas, Triton lowering): imported lazily so that importing the package does not pull in
# jax.experimental.pallas.triton on machines that only use the TPU kernels.
_GPU_EXPORTS = ("chunk_delta_family_gpu", "GpuBlockSizes")


def __getattr__(name):
    if name in _GPU_EXPORTS:
        from atlas_jax.kernels.delta_family import gpu
        return getattr(gpu, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
