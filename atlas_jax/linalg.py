"""Products and Gram matrices whose backward keeps their layout and precision, and unit
lower-triangular solves in plain XLA matmuls (the WY systems of the delta family).

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

import functools

import jax
import jax.numpy as jnp
from jax import lax

_HI = lax.Precision.HIGHEST

# The contracted axis of x and of y (counted from the end) of a product x·y by layout: x y, x yᵀ,
# xᵀ y, over the last two axes (the leading ones are a batch).
_LAYOUTS = {"nn": (-1, -2), "nt": (-1, -1), "tn": (-2, -2)}
# The products that give the cotangents of x and of y from the output's cotangent g, by layout:
# (layout, left operand, right operand) each.
_COTANGENTS = {"nn": (("nt", "g", "y"), ("tn", "x", "g")),
               "nt": (("nn", "g", "y"), ("tn", "g", "x")),
               "tn": (("nt", "y", "g"), ("nn", "x", "g"))}


def _dimension_numbers(layout, ndim):
    cx, cy = _LAYOUTS[layout]
    batch = tuple(range(ndim - 2))
    return ((ndim + cx,), (ndim + cy,)), (batch, batch)


AS_FORWARD = "as_forward"   # `product`'s and `gram`'s default ``backward_operands``


def _check_backward_operands(name, backward_operands):
    if isinstance(backward_operands, str) and backward_operands != AS_FORWARD:
        raise ValueError(f"{name}: argument `backward_operands` must be a dtype, None (the promoted dtype) or "
                         f"{AS_FORWARD!r} (the forward's); got {backward_operands!r}.")


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4, 5))
def product(x, y, layout: str, operands=None, backward_operands=AS_FORWARD, precision=None):
    """x·y over the last two axes in ``layout`` ("nn": x y, "nt": x yᵀ, "tn": xᵀ y; the leading axes,
    the same on both, are a batch), each cotangent formed by such a product in its operand's own
    layout.

    Why: autodiff's transpose of x @ w forms the weight's cotangent [h, d] and transposes it, a
    state-sized copy per product, which XLA keeps on a GPU (the dual form's θ [8448, 512] per head;
    B1 T1024 H8 D128 bf16 fwd+bwd on an H200, interleaved in one command: omeganet 40.33 -> 39.66
    ms, atlas 180.06 -> 179.05). ``operands``: both operands cast to that dtype, a float32 result,
    and the backward casts the cotangent too, where autodiff's transpose would multiply the float32
    cotangent with a cast operand (a float32, i.e. TF32, product). None: the promoted dtype.
    ``backward_operands``: the dtype the backward's two products take instead (`AS_FORWARD`: the
    same as the forward), for a product whose cotangent must not be rounded (`newton_schulz`).
    ``precision``: `lax.dot_general`'s, forward and backward (HIGHEST: float32 products on a GPU,
    whose default rounds float32 operands to TF32)."""
    if x.ndim != y.ndim or x.ndim < 2 or x.shape[:-2] != y.shape[:-2]:
        raise ValueError(f"product: arguments `x` and `y` must be matrices with the same leading (batch) axes; "
                         f"got shapes {tuple(x.shape)} and {tuple(y.shape)}.")
    if layout not in _LAYOUTS:
        raise ValueError(f"product: argument `layout` must be one of {tuple(_LAYOUTS)}; got {layout!r}.")
    _check_backward_operands("product", backward_operands)
    dims = _dimension_numbers(layout, x.ndim)
    if operands is None:
        dtype = jnp.promote_types(x.dtype, y.dtype)
        return lax.dot_general(x.astype(dtype), y.astype(dtype), dims, precision=precision)
    return lax.dot_general(x.astype(operands), y.astype(operands), dims, precision=precision,
                           preferred_element_type=jnp.float32)


def _product_fwd(x, y, layout, operands, backward_operands, precision):
    return product(x, y, layout, operands, backward_operands, precision), (x, y)


def _product_bwd(layout, operands, backward_operands, precision, residuals, g):
    x, y = residuals
    named = {"x": x, "y": y, "g": g}
    operands = operands if isinstance(backward_operands, str) else backward_operands
    dx, dy = (product(named[left], named[right], inner, operands, AS_FORWARD, precision)
              for inner, left, right in _COTANGENTS[layout])
    return dx.astype(x.dtype), dy.astype(y.dtype)


product.defvjp(_product_fwd, _product_bwd)


_GRAM_SIDES = ("tn", "nt")     # xᵀx, x xᵀ


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2, 3))
def gram(x, side: str, operands=None, backward_operands=AS_FORWARD):
    """The Gram matrix of x over its last two axes: xᵀx (``side`` "tn", [n, n] for x [m, n]) or x xᵀ
    ("nt", [m, m]); leading axes are a batch. ``operands``, ``backward_operands`` as in `product`.

    Why not ``product(x, x, ...)``: its backward forms the two operands' cotangents by two products
    and adds them; the Gram matrix's is one, x (g + gᵀ) (or (g + gᵀ) x), so a tall momentum's Gram
    in Newton–Schulz costs one state-sized product and no state-sized sum in the backward."""
    if side not in _GRAM_SIDES:
        raise ValueError(f"gram: argument `side` must be one of {_GRAM_SIDES}; got {side!r}.")
    if x.ndim < 2:
        raise ValueError(f"gram: argument `x` must be a matrix (with optional leading batch axes); got shape "
                         f"{tuple(x.shape)}.")
    _check_backward_operands("gram", backward_operands)
    return product(x, x, side, operands)


def _gram_fwd(x, side, operands, backward_operands):
    return gram(x, side, operands, backward_operands), x


def _gram_bwd(side, operands, backward_operands, x, g):
    operands = operands if isinstance(backward_operands, str) else backward_operands
    both = g + jnp.swapaxes(g, -1, -2)
    dx = product(x, both, "nn", operands) if side == "tn" else product(both, x, "nn", operands)
    return (dx.astype(x.dtype),)


gram.defvjp(_gram_fwd, _gram_bwd)


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
