"""The degree-2 polynomial feature map's rows and the backward of the symmetric power sym_2
(`atlas_jax.features`) as Pallas GPU kernels (Triton lowering).

sym_2(x) holds x_i x_j for i ≤ j, weighted √2 off the diagonal, in the order of
``itertools.combinations_with_replacement`` (row i's monomials are the d − i consecutive features
from off_i = i·d − i(i − 1)/2). With g the cotangent of those features,

    ∂L/∂x_k = 2 g_kk x_k + √2 Σ_{j>k} g_kj x_j + √2 Σ_{i<k} g_ik x_i.

A program takes ``block_rows`` rows and ``block_i`` values of i; their shares of ∂L/∂x are summed
in XLA. (The loop over i is sequential: one program per block of rows alone gave a call of
omeganet's, 512 rows, 16 programs, and the layer ran 1.16× slower than with XLA's gather.) Since φ
runs once a super-chunk a call has 1048 rows a head, and fewer, longer programs pay: 16 rows × 32
values of i against 32 × 8, 192.1 -> 159.3 µs at 8,384 rows and 760.5 -> 609.3 at 33,536 (omeganet
at B1 / B4; H200, benchmarks/feature_rows.py, 2026-12-02; the layer not re-timed). For
each i it loads the d features from off_i − i, so that column c of the load is the monomial
(i, c) for c ≥ i (the columns below i are the previous row's and are masked), and adds
Σ_c coef_c g_ic x_c to ∂L/∂x_i and √2 g_ic x_i to ∂L/∂x_c (c > i). g is read once,
row-contiguous, and nothing of size [rows, d, d] is formed. The XLA backward it replaces (the
reference the tests hold it to) is `atlas_jax.features._symmetric_square_bwd_xla`.

Why: XLA's formulation (a gather of g into a [rows, d, d] grid and a sum) read g in the
transposed layout its producer left it in: 459 µs a call for omeganet's super-chunk at B1 H8
(524 rows a head, d 128) on an H200, 1.8 of the layer's 19.5 ms at T1024
(benchmarks/results/dual_chain_h200_2026-11-28.md).

The forward (`polynomial2_features_gpu`) writes φ(x) = [c₀, c₁ x, c₂ sym_2(x)] and the zero
features after it (FEATURE_ALIGN, `atlas_jax.forms.dual`) in one pass, in aligned tiles of
``block_rows`` × ``block_cols`` features: a table gives each feature its two factors (1 or x_m)
and its coefficient, and the factors are gathered from x's rows, which are small and stay in cache.
XLA formed these rows as a gather of two inputs per feature, then joined the blocks and padded them
(~3× the time to write them); the first kernel walked the values of i as the backward does, storing
row i's monomials at the unaligned off_i − i, masked to c ≥ i (1.2 TB/s written). Tiles: [8 heads,
1048, 8448] bf16 rows (omeganet's super-chunk at B1) 115.7 -> 76.5 µs on an H200, [32 heads, 1048,
8448] (B4) 493.4 -> 280.3 µs: 2.0 TB/s against the 3.2 TB/s XLA moves reading and writing as much
(benchmarks/feature_rows.py, 2026-12-02; 16 × 256 tiles were 4–5% faster alone, not timed in the
layer). The layer: benchmarks/results/phi_tiles_h200_2026-12-02.md.
Its backward (`features.polynomial2_features`) reads sym_2's cotangent in place from the
whole row (``column_offset``), so nothing of it is sliced out. Rows past the end of the last block
are masked, not padded (padding copied the [n, 8256] cotangent). Writing φ's rows by a kernel at
all, B1 T4096 H8 D128 bf16 fwd+bwd on an H200, interleaved in one command: omeganet 49.77 -> 47.43
ms, dla 40.02 -> 34.76.

Precision: g and x in any float dtype, every product and sum float32, the result in x's dtype
(the forward's in the dtype asked for, rounded once).
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from atlas_jax.kernels.delta_family.gpu import default_interpret
from atlas_jax.kernels.delta_family.support import check_num_warps

__all__ = ["Phi2GpuBlockSizes", "Sym2GpuBlockSizes", "polynomial2_features_gpu", "symmetric_square_backward_gpu"]

_FN = "symmetric_square_backward_gpu"
F32 = jnp.float32


def _check_powers_of_two(fn, block_sizes, names):
    """The block sizes' ``names`` are powers of two and their warps a count Triton takes."""
    for name in names:
        value = getattr(block_sizes, name)
        if not isinstance(value, int) or value < 1 or value & (value - 1):
            raise ValueError(f"{fn}: `block_sizes.{name}` must be a power of two; got {value!r}.")
    check_num_warps(fn, block_sizes, ("num_warps",))


@dataclasses.dataclass(frozen=True)
class Sym2GpuBlockSizes:
    """block_rows: rows per program; block_i: values of i per program (the grid's second axis, each
    program's share summed in XLA; None: min(d, 32)); both powers of two. num_warps: warps per
    program."""

    block_rows: int = 16
    block_i: int | None = None
    num_warps: int = 4

    def __post_init__(self):
        _check_powers_of_two(_FN, self, ("block_rows",) + (() if self.block_i is None else ("block_i",)))


@dataclasses.dataclass(frozen=True)
class Phi2GpuBlockSizes:
    """`polynomial2_features_gpu`'s tiles: block_rows rows by block_cols features a program (powers
    of two). num_warps: warps per program."""

    block_rows: int = 32
    block_cols: int = 256
    num_warps: int = 4

    def __post_init__(self):
        _check_powers_of_two("polynomial2_features_gpu", self, ("block_rows", "block_cols"))


def _row_block(block_rows, n):
    """(the program's rows, their mask [rows, 1] for the last block's rows past n)."""
    first = pl.multiple_of(pl.program_id(0) * block_rows, block_rows)
    return pl.ds(first, block_rows), first + lax.broadcasted_iota(jnp.int32, (block_rows, 1), 0) < n


def _kernel(g_ref, x_ref, scale_ref, dx_ref, *ds_ref, n, d, offset, block_rows, block_i):
    rows, real = _row_block(block_rows, n)
    first = pl.program_id(1) * block_i
    x = plgpu.load(x_ref.at[rows, :], mask=real, other=0.0).astype(F32)   # [rows, d]
    cols = lax.broadcasted_iota(jnp.int32, (block_rows, d), 1)
    root2 = math.sqrt(2.0)

    def step(i, carry):
        start = offset + i * d - (i * (i - 1)) // 2 - i              # off_i − i: column c is monomial (i, c)
        g = plgpu.load(g_ref.at[rows, pl.ds(start, d)], mask=real, other=0.0).astype(F32)
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
    plgpu.store(dx_ref.at[pl.program_id(1), rows, :], acc * scale_ref[...].astype(F32)[None, :], mask=real)
    if ds_ref:
        plgpu.store(ds_ref[0].at[pl.program_id(1), rows, :], acc_s, mask=real)


def _check_width(fn, x):
    d = x.shape[-1]
    if d < 1 or d & (d - 1):
        raise ValueError(f"{fn}: the input width d = x.shape[-1] must be a power of two; got {d}. "
                         "Use the XLA form (atlas_jax.features) for other widths.")
    return d


def _block_i(fn, bs, d):
    block_i = min(d, 32) if bs.block_i is None else bs.block_i
    if d % block_i:
        raise ValueError(f"{fn}: `block_sizes.block_i` = {block_i} must divide d = {d}.")
    return block_i


def symmetric_square_backward_gpu(x, cotangent, scale=None, *, block_sizes: Sym2GpuBlockSizes | None = None,
                                  interpret: bool | None = None, with_scale_grad: bool = False,
                                  column_offset: int = 0):
    """∂L/∂x [..., d] of scale · sym_2(x) from its cotangent (module docstring; scale a scalar,
    default 1); d a power of two. The cotangent is [..., d(d + 1)/2], or wider with sym_2's
    features from ``column_offset`` on (`polynomial2_features_gpu`'s rows: read in place, not
    sliced out). with_scale_grad: also return ⟨cotangent, sym_2(x)⟩ (the scale's gradient), formed
    from the same loads. interpret: None = interpret mode off a GPU backend."""
    bs = block_sizes or Sym2GpuBlockSizes()
    d = _check_width(_FN, x)
    width = d * (d + 1) // 2
    if column_offset < 0 or cotangent.shape[:-1] != x.shape[:-1] or cotangent.shape[-1] < column_offset + width \
            or (column_offset == 0 and cotangent.shape[-1] != width):
        raise ValueError(f"{_FN}: argument `cotangent` must have shape {x.shape[:-1] + (width,)} (x's leading "
                         f"axes and d(d + 1)/2 for d = {d}), or be wider with sym_2's features from "
                         f"`column_offset` = {column_offset} on; got {tuple(cotangent.shape)}.")
    x2 = x.reshape(-1, d)
    g2 = cotangent.reshape(-1, cotangent.shape[-1])
    n = x2.shape[0]
    block_i = _block_i(_FN, bs, d)
    interpret = default_interpret() if interpret is None else interpret
    kernel = functools.partial(_kernel, n=n, d=d, offset=column_offset, block_rows=bs.block_rows, block_i=block_i)
    scale = jnp.ones((1,), F32) if scale is None else jnp.reshape(scale, (1,)).astype(F32)
    out_shape = [jax.ShapeDtypeStruct((d // block_i, n, d), F32)]
    if with_scale_grad:
        out_shape.append(jax.ShapeDtypeStruct((d // block_i, n, 1), F32))
    parts = pl.pallas_call(
        kernel, grid=(pl.cdiv(n, bs.block_rows), d // block_i), out_shape=out_shape,
        compiler_params=plgpu.CompilerParams(num_warps=bs.num_warps, num_stages=1),
        interpret=interpret, name="symmetric_square_backward_gpu")(g2, x2, scale)
    dx = jnp.sum(parts[0], axis=0).astype(x.dtype).reshape(x.shape)
    return (dx, jnp.sum(parts[1])) if with_scale_grad else dx


@functools.lru_cache(maxsize=None)
def _feature_tables(d: int, width: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Three [width] int32 tables: for each feature of φ's row, the two factors it multiplies (0: the
    constant 1, m ≥ 1: x_{m−1}) and its kind (0 c₀, 1 c₁, 2 c₂ on sym_2's diagonal, 3 c₂·√2 off
    it, 4 a zero feature), in `polynomial2_features_gpu`'s order."""
    first, second, kind = np.zeros(width, np.int32), np.zeros(width, np.int32), np.full(width, 4, np.int32)
    kind[0] = 0
    second[1:1 + d], kind[1:1 + d] = np.arange(1, d + 1), 1
    i, j = np.triu_indices(d)   # row-major: the order of combinations_with_replacement
    pairs = slice(1 + d, 1 + d + i.size)
    first[pairs], second[pairs], kind[pairs] = i + 1, j + 1, np.where(i == j, 2, 3)
    return first, second, kind


def _features_kernel(x_ref, first_ref, second_ref, kind_ref, coeffs_ref, out_ref, *, n, width, block_rows,
                     block_cols):
    first_row = pl.program_id(0) * block_rows
    first_col = pl.multiple_of(pl.program_id(1) * block_cols, block_cols)
    row = first_row + lax.broadcasted_iota(jnp.int32, (block_rows, 1), 0)
    col = first_col + lax.broadcasted_iota(jnp.int32, (1, block_cols), 1)
    inside = col < width
    cols = pl.ds(first_col, block_cols)
    first, second, kind = (plgpu.load(ref.at[cols], mask=inside[0], other=other)[None, :]
                           for ref, other in ((first_ref, 0), (second_ref, 0), (kind_ref, 4)))
    c = lambda j: coeffs_ref[pl.ds(j, 1)].astype(F32)[None, :]   # c_j [1, 1]
    coef = jnp.where(kind == 0, c(0), jnp.where(kind == 1, c(1), jnp.where(
        kind == 2, c(2), jnp.where(kind == 3, c(2) * math.sqrt(2.0), 0.0))))
    # the factors, gathered from x's rows (small: in cache) by the tables; rows past n read row
    # n − 1 and are not stored
    source = jnp.minimum(row, n - 1)
    factor = lambda index: jnp.where(index == 0, 1.0, plgpu.load(x_ref.at[source, jnp.maximum(index - 1, 0)]
                                                                 ).astype(F32))
    value = coef * factor(first) * factor(second)
    plgpu.store(out_ref.at[pl.ds(first_row, block_rows), cols], value.astype(out_ref.dtype),
                mask=(row < n) & inside)


def polynomial2_features_gpu(x, coeffs, width: int, dtype, *, block_sizes: Phi2GpuBlockSizes | None = None,
                             interpret: bool | None = None):
    """φ(x) of the degree-2 polynomial map, [c₀, c₁ x, c₂ sym_2(x)] [..., 1 + d + d(d + 1)/2],
    followed by zero features up to ``width``, in ``dtype`` (every product float32, rounded once);
    d a power of two. One pass writing the rows in aligned tiles (module docstring). coeffs: [3]."""
    fn = "polynomial2_features_gpu"
    bs = block_sizes or Phi2GpuBlockSizes()
    if not isinstance(bs, Phi2GpuBlockSizes):
        raise TypeError(f"{fn}: argument `block_sizes` must be a Phi2GpuBlockSizes; got {type(bs).__name__}.")
    d = _check_width(fn, x)
    if coeffs.shape != (3,):
        raise ValueError(f"{fn}: argument `coeffs` must have shape (3,) (c₀, c₁, c₂); got {tuple(coeffs.shape)}.")
    if width < 1 + d + d * (d + 1) // 2:
        raise ValueError(f"{fn}: argument `width` = {width} must be at least 1 + d + d(d + 1)/2 = "
                         f"{1 + d + d * (d + 1) // 2} for d = {d}.")
    x2 = x.reshape(-1, d)
    n = x2.shape[0]
    interpret = default_interpret() if interpret is None else interpret
    kernel = functools.partial(_features_kernel, n=n, width=width, block_rows=bs.block_rows,
                               block_cols=bs.block_cols)
    out = pl.pallas_call(
        kernel, grid=(pl.cdiv(n, bs.block_rows), pl.cdiv(width, bs.block_cols)),
        out_shape=jax.ShapeDtypeStruct((n, width), dtype),
        compiler_params=plgpu.CompilerParams(num_warps=bs.num_warps, num_stages=1),
        interpret=interpret, name="polynomial2_features_gpu")(
            x2, *map(jnp.asarray, _feature_tables(d, width)), jnp.pad(coeffs.astype(F32), (0, 1)))
    return out.reshape(x.shape[:-1] + (width,))
