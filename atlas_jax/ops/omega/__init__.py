"""The exact Omega rule on a linear memory (swla; omeganet / atlas with a linear memory):
a float32 token-by-token reference, the exact chunked (expanded WY) form, one signature, and
`omega_linear`, which picks one of them or the Pallas kernels (atlas_jax.kernels.omega) by impl=."""

from __future__ import annotations

from atlas_jax.ops.omega.api import omega_linear, omega_linear_kernel
from atlas_jax.ops.omega.chunk import omega_linear_chunk
from atlas_jax.ops.omega.naive import omega_linear_recurrent

__all__ = ["omega_linear", "omega_linear_chunk", "omega_linear_kernel", "omega_linear_recurrent"]
