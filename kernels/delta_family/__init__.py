"""Pallas kernels for the exact chunked delta family (DeltaNet, Gated DeltaNet, KDA).

GPU (Hopper, Pallas Triton lowering): `gpu.py` (entry and the table of kernels), `gpu_config.py`,
`gpu_launch.py`, `gpu_fwd.py`, `gpu_bwd.py`, `gpu_math.py`. TPU (Mosaic): `tpu.py` (entry and
table), `tpu_kernels.py`, `tpu_math.py`. Shared, Pallas-free: `support.py` (supported sizes, the
normalisation epsilon and the argument checker of every delta-family call).
"""

from atlas_jax.kernels import lazy_exports

# GPU (Pallas, Triton lowering): imported lazily so that importing the package does not pull in
# jax.experimental.pallas.triton on machines that only use the TPU kernels.
__getattr__ = lazy_exports(__name__, {"chunk_delta_family_gpu": "gpu", "GpuBlockSizes": "gpu"})
