"""The backward of the degree-2 symmetric power sym_2 (`atlas_jax.features`) as a Pallas GPU
kernel (Triton lowering).

sym_2(x) holds x_i x_j for i ≤ j, weighted √2 off the diagonal, in the order of
``itertools.combinations_with_replacement`` (row i's monomials are the d − i consecutive features
from off_i = i·d − i(i − 1)/2). With g the cotangent of those features,

    ∂L/∂x_k = 2 g_kk x_k + √2 Σ_{j>k} g_kj x_j + √2 Σ_{i<k} g_ik x_i.

A program takes ``block_rows`` rows and ``block_i`` values of i; their shares of ∂L/∂x are summed
in XLA. (The loop over i is sequential: one program per block of rows alone gave a call of
omeganet's, 512 rows, 16 programs, and the layer ran 1.16× slower than with XLA's gather.) For
each i it loads the d features from off_i − i, so that column c of the load is the monomial
(i, c) for c ≥ i (the columns below i are the previous row's and are masked), and adds
Σ_c coef_c g_ic x_c to ∂L/∂x_i and √2 g_ic x_i to ∂L/∂x_c (c > i). g is read once,
row-contiguous, and nothing of size [rows, d, d] is formed. The XLA backward it replaces (the
reference the tests hold it to) is `atlas_jax.features._symmetric_square_bwd_xla`.

Why: XLA's formulation (a gather of g into a [rows, d, d] grid and a sum) read g in the
transposed layout its producer left it in: 459 µs a call for omeganet's super-chunk at B1 H8
(524 rows a head, d 128) on an H200, 1.8 of the layer's 19.5 ms at T1024
(benchmarks/results/dual_chain_h200_2026-11-28.md).

Precision: g and x in any float dtype, every product and sum float32, the result in x's dtype.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from atlas_jax.kernels.delta_family.gpu import default_interpret
from atlas_jax.kernels.delta_family.support import check_num_warps

__all__ = ["Sym2GpuBlockSizes", "symmetric_square_backward_gpu"]

_FN = "symmetric_square_backward_gpu"
F32 = jnp.float32


@dataclasses.dataclass(frozen=True)
class Sym2GpuBlockSizes:
    """block_rows: rows per program; block_i: values of i per program (the grid's second axis, each
    program's share summed in XLA; None: min(d, 8)); both powers of two. num_warps: warps per
    program."""

    block_rows: int = 32
    block_i: int | None = None
    num_warps: int = 4

    def __post_init__(self):
        for name in ("block_rows", "block_i"):
            value = getattr(self, name)
            if value is None and name == "block_i":
                continue
            if not isinstance(value, int) or value < 1 or value & (value - 1):
                raise ValueError(f"{_FN}: `block_sizes.{name}` must be a power of two; got {value!r}.")
        check_num_warps(_FN, self, ("num_warps",))


def _kernel(g_ref, x_ref, scale_ref, dx_ref, *ds_ref, d, block_rows, block_i):
    rows = pl.ds(pl.multiple_of(pl.program_id(0) * block_rows, block_rows), block_rows)
    first = pl.program_id(1) * block_i
    x = x_ref[rows, :].astype(F32)                                  # [rows, d]
    cols = lax.broadcasted_iota(jnp.int32, (block_rows, d), 1)
    root2 = math.sqrt(2.0)

    def step(i, carry):
        start = i * d - (i * (i - 1)) // 2 - i                       # off_i − i: column c is monomial (i, c)
        g = g_ref[rows, pl.ds(start, d)].astype(F32)
        on_i = cols == i
        coef = jnp.where(on_i, 2.0, jnp.where(cols > i, root2, 0.0))
        x_i = jnp.sum(jnp.where(on_i, x, 0.0), axis=1, keepdims=True)            # [rows, 1]
        to_i = jnp.sum(coef * g * x, axis=1, keepdims=True)                     # ∂L/∂x_i's terms of row i
        to_c = jnp.where(cols > i, root2 * g, 0.0) * x_i                         # ∂L/∂x_c, c > i
        acc, acc_s = carry
        if ds_ref:   # ⟨g, sym_2(x)⟩'s terms of row i: x_i Σ_c w_ic g_ic x_c (w: 1 on the diagonal, √2 above)
            acc_s = acc_s + x_i * jnp.sum(jnp.where(on_i, 1.0, jnp.where(cols > i, root2, 0.0)) * g * x,
                                          axis=1, keepdims=True)
        return acc + to_c + jnp.where(on_i, to_i, 0.0), acc_s

    carry = (jnp.zeros((block_rows, d), F32), jnp.zeros((block_rows, 1), F32))
    acc, acc_s = lax.fori_loop(first, first + block_i, step, carry)
    dx_ref[pl.program_id(1), rows, :] = acc * scale_ref[...].astype(F32)[None, :]
    if ds_ref:
        ds_ref[0][pl.program_id(1), rows, :] = acc_s


def symmetric_square_backward_gpu(x, cotangent, scale=None, *, block_sizes: Sym2GpuBlockSizes | None = None,
                                  interpret: bool | None = None, with_scale_grad: bool = False):
    """∂L/∂x [..., d] of scale · sym_2(x) from its cotangent [..., d(d + 1)/2] (module docstring;
    scale a scalar, default 1); d a power of two. with_scale_grad: also return ⟨cotangent,
    sym_2(x)⟩ (the scale's gradient), formed from the same loads. interpret: None = interpret mode
    off a GPU backend."""
    bs = block_sizes or Sym2GpuBlockSizes()
    d = x.shape[-1]
    width = d * (d + 1) // 2
    if d < 1 or d & (d - 1):
        raise ValueError(f"{_FN}: the input width d = x.shape[-1] must be a power of two; got {d}. "
                         "Use the XLA backward (atlas_jax.features) for other widths.")
    if cotangent.shape != x.shape[:-1] + (width,):
        raise ValueError(f"{_FN}: argument `cotangent` must have shape {x.shape[:-1] + (width,)} "
                         f"(x's leading axes and d(d + 1)/2 for d = {d}); got {tuple(cotangent.shape)}.")
    x2 = x.reshape(-1, d)
    g2 = cotangent.reshape(-1, width)
    n = x2.shape[0]
    padded = -(-n // bs.block_rows) * bs.block_rows
    if padded != n:
        x2 = jnp.pad(x2, [(0, padded - n), (0, 0)])
        g2 = jnp.pad(g2, [(0, padded - n), (0, 0)])
    block_i = min(d, 8) if bs.block_i is None else bs.block_i
    if d % block_i:
        raise ValueError(f"{_FN}: `block_sizes.block_i` = {block_i} must divide d = {d}.")
    interpret = default_interpret() if interpret is None else interpret
    kernel = functools.partial(_kernel, d=d, block_rows=bs.block_rows, block_i=block_i)
    scale = jnp.ones((1,), F32) if scale is None else jnp.reshape(scale, (1,)).astype(F32)
    out_shape = [jax.ShapeDtypeStruct((d // block_i, padded, d), F32)]
    if with_scale_grad:
        out_shape.append(jax.ShapeDtypeStruct((d // block_i, padded, 1), F32))
    parts = pl.pallas_call(
        kernel, grid=(padded // bs.block_rows, d // block_i), out_shape=out_shape,
        compiler_params=plgpu.CompilerParams(num_warps=bs.num_warps, num_stages=1),
        interpret=interpret, name="symmetric_square_backward_gpu")(g2, x2, scale)
    dx = jnp.sum(parts[0], axis=0)[:n].astype(x.dtype).reshape(x.shape)
    # padded rows are zero in x, so add nothing to the scale's gradient
    return (dx, jnp.sum(parts[1])) if with_scale_grad else dx
