"""Unit lower-triangular solves in plain XLA matmuls (the WY systems of the delta family).

Why not `jax.scipy.linalg.solve_triangular`: on CPU it lowers to LAPACK trsm, which jaxlib
(0.10) parallelises over the batch on XLA's intra-op thread pool and then blocks the calling
pool thread until that work is done. Two solves that XLA schedules concurrently (a gradient has
independent ones) can occupy every thread of a small pool (2 CPUs) and wait on each other
forever; this project's CI hung that way (both pool threads in `ParallelBatchMap` under
`lapack_strsm_ffi`). Matmuls do not nest parallel work, so the forms here cannot deadlock.

The inverse is the recursive 2x2 block formula, level by level on all diagonal blocks at once:
    [[A, 0], [C, D]]^-1 = [[A^-1, 0], [-D^-1 C A^-1, D^-1]]
(log2 n levels of batched matmuls, the blocked inverse of the GPU kernels); the solve is then
one product. Its error matches the substitution-based inverse for these well-conditioned
systems (unit diagonal, bounded off-diagonal terms); the tests hold it to the float32 scans at
1e-5 relative.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

_HI = lax.Precision.HIGHEST


def unit_lower_inverse(a: jax.Array) -> jax.Array:
    """(I + strictly_lower(a))^-1 for a [..., n, n] (its diagonal and upper part are ignored)."""
    n = a.shape[-1]
    if a.shape[-2] != n:
        raise ValueError(f"unit_lower_inverse: a must be square in its last two axes; got {a.shape}")
    size = 1 << max(n - 1, 0).bit_length()          # next power of two; pad with the identity
    batch = a.shape[:-2]
    lower = jnp.tril(a, -1)
    if size != n:
        lower = jnp.pad(lower, [(0, 0)] * len(batch) + [(0, size - n), (0, size - n)])
    inv = jnp.ones(batch + (size, 1, 1), a.dtype)   # the 1x1 diagonal blocks' inverses
    s = 1
    while s < size:
        p = size // (2 * s)
        # The diagonal [2s, 2s] blocks of the lower part; C is the lower-left [s, s] of each.
        blocks = jnp.diagonal(lower.reshape(batch + (p, 2 * s, p, 2 * s)),
                              axis1=-4, axis2=-2)  # [..., 2s, 2s, p]
        c = jnp.moveaxis(blocks, -1, -3)[..., s:, :s]                       # [..., p, s, s]
        pair = inv.reshape(batch + (p, 2, s, s))
        a_inv, d_inv = pair[..., 0, :, :], pair[..., 1, :, :]
        off = -jnp.einsum('...IJ,...JK,...KL->...IL', d_inv, c, a_inv, precision=_HI)
        top = jnp.concatenate([a_inv, jnp.zeros_like(a_inv)], axis=-1)
        bottom = jnp.concatenate([off, d_inv], axis=-1)
        inv = jnp.concatenate([top, bottom], axis=-2)                      # [..., p, 2s, 2s]
        s *= 2
    return inv.reshape(batch + (size, size))[..., :n, :n]


def solve_unit_lower(a: jax.Array, b: jax.Array) -> jax.Array:
    """X with (I + strictly_lower(a)) X = b, for a [..., n, n] and b [..., n, m]."""
    return jnp.einsum('...IJ,...JM->...IM', unit_lower_inverse(a), b, precision=_HI)
