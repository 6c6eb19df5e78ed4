"""Delta-family linear-memory ops: a recurrent reference and the exact chunkwise form."""

from __future__ import annotations

from atlas_jax.ops.delta_family.chunk import chunk_delta_family
from atlas_jax.ops.delta_family.naive import recurrent_delta_family

__all__ = ["chunk_delta_family", "recurrent_delta_family"]
