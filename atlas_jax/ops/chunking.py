"""What the chunked ops share: the chunk layout and the masked exponential."""
from __future__ import annotations

import jax
import jax.numpy as jnp

# f32 dots must stay f32 on GPU/TPU too, or the chunked forms stop being exact.
HIGHEST = jax.lax.Precision.HIGHEST


def to_chunks(x, n, c):
    """[B, T, H, ...] (T = n*c) -> [N, B, H, C, ...] so the chunk axis can be scanned."""
    b, _, h = x.shape[:3]
    x = x.reshape((b, n, c, h) + x.shape[3:])
    return jnp.moveaxis(jnp.moveaxis(x, 1, 0), 2, 3)


def from_chunks(x):
    """[N, B, H, C, ...] -> [B, N*C, H, ...]."""
    n, b, h, c = x.shape[:4]
    x = jnp.moveaxis(jnp.moveaxis(x, 3, 2), 0, 1)
    return x.reshape((b, n * c, h) + x.shape[4:])


def masked_exp(diff, mask):
    """exp(diff) where mask, 0 elsewhere, without ever evaluating exp off the mask.

    Off the mask the exponent has no meaning (as G_i - G_j with j > i it would be +hundreds for
    strong gates); zeroing it before exp keeps the forward and the gradient (exp' = exp) finite
    whatever the caller feeds in.
    """
    return jnp.where(mask, jnp.exp(jnp.where(mask, diff, 0.0)), 0.0)
