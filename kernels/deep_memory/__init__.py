"""Pallas kernels for the deep memories' sequential chunk pass (the dual form's θ-carrying part)
and, on GPU, the chunk-parallel reads that follow it.

GPU (Pallas, Triton lowering): `gpu.py` (`mlp_state_pass_gpu`, `MLPGpuBlockSizes`); the reads'
forward `gpu_reads.py` (`mlp_reads_gpu`, `MLPReadsGpuBlockSizes`, for
`atlas_jax.ops.deep_memory.mlp_reads`); both in one custom VJP `gpu_split.py`
(`mlp_state_pass_and_reads_gpu`, for `...mlp_state_pass_and_reads`). TPU (Pallas, Mosaic):
`tpu.py` (`mlp_state_pass_tpu`, `MLPTpuBlockSizes`). What both share (activations,
padding, layout, the custom VJP with its XLA reverse pass): `support.py`. The public op is
`atlas_jax.ops.deep_memory.mlp_state_pass(..., impl="pallas", kernel=None)`, which loads these
at trace time.
"""

from atlas_jax.kernels import lazy_exports

# Imported lazily: importing this package must not pull in Pallas.
_EXPORTS = {"mlp_state_pass_gpu": "gpu", "MLPGpuBlockSizes": "gpu",
            "mlp_reads_gpu": "gpu_reads", "MLPReadsGpuBlockSizes": "gpu_reads",
            "mlp_state_pass_and_reads_gpu": "gpu_split",
            "mlp_state_pass_tpu": "tpu", "MLPTpuBlockSizes": "tpu"}

__getattr__ = lazy_exports(__name__, _EXPORTS)
