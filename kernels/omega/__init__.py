"""Pallas kernels for the exact Omega rule on a linear memory (the chunk form's sequential pass).

GPU (Pallas, Triton lowering): `gpu.py` (`omega_state_pass_gpu`, `OmegaGpuBlockSizes`). TPU
(Mosaic): `tpu.py` (`omega_state_pass_tpu`, `OmegaTpuBlockSizes`). Shared and Pallas-free:
`support.py` (the math, argument checks, padding and the custom VJP). The public op is
`atlas_jax.ops.omega_linear(..., impl="pallas")`, which builds the chunk-parallel operands in
XLA and loads these kernels at trace time.
"""

from atlas_jax.kernels import lazy_exports

# Imported lazily: importing this package must not pull in Pallas (Triton or Mosaic).
_EXPORTS = {"omega_state_pass_gpu": "gpu", "OmegaGpuBlockSizes": "gpu",
            "omega_state_pass_tpu": "tpu", "OmegaTpuBlockSizes": "tpu"}

__getattr__ = lazy_exports(__name__, _EXPORTS)
