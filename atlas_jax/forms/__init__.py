"""The forms a memory runs in: ``recurrent`` (lax.scan, exact) and ``chunked`` (chunkwise parallel).

The third form, Pallas kernels for the chunked algorithms, lives in ``atlas_jax.kernels``.
"""
from atlas_jax.forms.chunked import chunked_sequence, exact_chunked, is_exact
from atlas_jax.forms.common import MemoryState, Steps, WindowCache
from atlas_jax.forms.recurrent import inner_step, recurrent_sequence

__all__ = ["MemoryState", "Steps", "WindowCache", "recurrent_sequence", "inner_step", "chunked_sequence",
           "exact_chunked", "is_exact"]
