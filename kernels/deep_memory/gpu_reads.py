"""The dual form's reads of a depth-2 MLP memory (`atlas_jax.ops.deep_memory.reads`, its module
docstring): the forward as a Pallas GPU kernel (Triton lowering), the backward in XLA from the
values the kernel keeps.

Every chunk reads independently of the others (its start state is an input), so a program owns
a group of ``tiles_per_program`` hidden tiles j (``block_hidden`` units each) of one chunk of one
sequence·head, taken one after another, and the groups' shares of the output are summed in XLA
([P, groups, b, dv]):

    G0 = M ⊙ (q aᵀ)   (once a program)
    Z_j = P ⊙ (q W0_j) + c ⊙ (q m0_j) + G0 D_j,   Ĥ_j = σ(Z_j)
    O_g = Σ_{j in g} [P ⊙ (Ĥ_j W1_j) + c ⊙ (Ĥ_j m1_j)] + (M ⊙ Σ_{j in g} Ĥ_j H_jᵀ) E
          (+ q, group 0, with the residual)

Four tiles of 64 a program (titans' h 512: two groups a chunk) take titans' layer 0.976 at B4
T4096 and 0.979 at B1 T16384 H8 of a program a tile; all eight 0.989 / 0.990, two 0.991 / 0.992
(H200, one command; benchmarks/results/titans_reads_walk_h200_2026-11-29d.md): the group shares
G0 and E's product, and XLA sums fewer float32 shares. Against four of 64 on 4 warps (one
command): on 8 warps 1.033, tiles of 32 four or eight a program 1.021 / 1.013, tiles of 128 two a
program on 8 warps 1.031 (B4; B1 alike).

The kernel rounds each tile of the chunk's start state to bf16 where it loads it (for bf16
inputs; on the joint route, `gpu_split`, the state pass keeps them in bf16 already) and keeps
those bf16 copies, Z, q W0 and q m0 for the backward, which runs in XLA as
batched products over the P chunks (`_backward`):

    Ĥ̄ = P ⊙ (Ō W1ᵀ) + c ⊙ (Ō m1ᵀ) + (S1 ⊙ M) H,  S1 = Ō Eᵀ,   Z̄ = Ĥ̄ ⊙ σ'(Z)
    W̄1 = Ĥᵀ (P ⊙ Ō),  m̄1 = Ĥᵀ (c ⊙ Ō),  H̄ = (S1 ⊙ M)ᵀ Ĥ,  W̄0 = qᵀ (P ⊙ Z̄),  m̄0 = qᵀ (c ⊙ Z̄)
    D̄ = G0ᵀ Z̄,  S0 = Z̄ Dᵀ,  q̄ = (P ⊙ Z̄) W0ᵀ + (c ⊙ Z̄) m0ᵀ + (S0 ⊙ M) a (+ Ō),  ā = (S0 ⊙ M)ᵀ q
    Ē = (M ⊙ Ĥ Hᵀ)ᵀ Ō,  M̄ = S1 ⊙ (Ĥ Hᵀ) + S0 ⊙ (q aᵀ),  P̄ = rowsum(Ĥ ⊙ Ō W1ᵀ + Z̄ ⊙ q W0) (c̄ alike)

Measured on an H200 (2026-11-28, titans' memory layer, bf16, forward+backward, each row one
command of `benchmarks/compare_trees.py` against the layer with XLA's reads;
benchmarks/results/titans_reads_kernel_h200_2026-11-28.md): B4 T4096 H8 D128 20.55 -> 19.87 ms,
B1 T16384 24.63 -> 24.28, peak memory 5.94 -> 5.84 GiB at B4. The forward kernel takes 1.53 ms
of it at B4, where XLA's forward reads took 2.0 ms in their scope (a pass casting every chunk's
start state to bf16 among them) besides a share of ~1.5 ms of cuBLAS products. A backward kernel
(the same math per program, 17 products a tile) was slower than XLA's batched products: 4.94 ms against ~2.6, the layer 1.088x (every tile a
program) and 1.074x (a program walking a chunk's tiles); the measured variants are in the results
file.

Precision: bf16 queries and sources give every product bf16 operands (float32 accumulation), as
the dual form's reads take them with bf16 q, k, v (the kept Z, q W0, q m0 are bf16 then); float32
ones float32-accurate products (six bf16 dots of split operands in the kernel, `gpu_math._dot`;
HIGHEST precision in XLA). The Gram matrices, the coefficients and every sum are float32; with bf16
operands the backward's [P, b, h] products that feed only Ẑ's elementwise terms round their outputs
to bf16 too (`backward_parts`). Zero
padding (every size to a power of two >= 16) changes no number, for activations with σ(0) = 0
(`support` module docstring): a padded query row has P = c = 0 and a zero row of M, a padded
source a zero column of M, a padded hidden unit zero columns of W0, m0 and D and rows of W1, m1.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from atlas_jax.kernels.deep_memory.gpu import StartFactors
from atlas_jax.kernels.deep_memory.support import F32, BF16, act_and_grad, pad_to
from atlas_jax.kernels.delta_family.gpu import default_interpret
from atlas_jax.kernels.delta_family.gpu_math import load_f32, mm, mm_nt
from atlas_jax.kernels.delta_family.support import check_num_warps, is_int
from atlas_jax.kernels.omega.support import next_pow2
from atlas_jax.ops.deep_memory.state_pass import MLPSources, MLPStates

__all__ = ["MLPReadsGpuBlockSizes", "mlp_reads_gpu"]

_FN = "mlp_reads_gpu"


@dataclasses.dataclass(frozen=True)
class MLPReadsGpuBlockSizes:
    """block_hidden: hidden units of a tile (a power of two >= 16 dividing h padded to a power of
    two; None: min(h, 64)); tiles_per_program: tiles a program takes one after another (dividing
    the tile count; None: min(tiles, 4), module docstring); num_warps: warps per program. On an
    H200 (titans B4 T4096, the layer's fwd+bwd against 64 units on 4 warps, one command, a tile a
    program, before the kernel kept θ's bf16 operands): 32 units 1.021x, 128 units on 8 warps
    1.002x (results file in the module docstring)."""
    block_hidden: int | None = None
    num_warps: int = 4
    tiles_per_program: int | None = None

    def check(self, h):
        b = self.block_hidden
        if not is_int(b) or b < 16 or b & (b - 1) or h % b:
            raise ValueError(f"{_FN}: argument `block_sizes.block_hidden` must be a power of two >= 16 dividing "
                             f"the hidden width {h} (padded to a power of two); got {b!r}.")
        check_num_warps(_FN, self, ("num_warps",))


@dataclasses.dataclass(frozen=True)
class _Cfg:
    momentum: bool
    residual: bool
    activation: str
    low: bool               # bf16 operands (bf16 queries and sources)
    hidden: int             # padded
    block_hidden: int
    num_warps: int
    interpret: bool
    tiles_per_program: int = 1   # hidden tiles a program takes one after another

    @property
    def tiles(self):
        return self.hidden // self.block_hidden

    @property
    def groups(self):
        return self.tiles // self.tiles_per_program


def _names(cfg):
    return ("w0", "w1", "m0", "m1") if cfg.momentum else ("w0", "w1")


def _rows(ref, p):
    """A per-row coefficient [b] of program p as a [b, 1] column."""
    return load_f32(ref, (p, slice(None)))[:, None]


def _weight(r, cfg, name, p, cols):
    """Program p's operand tile of θ (or the momentum) ``name``; for bf16 inputs rounded to bf16
    and kept in ``name``_b for the backward (whose products would otherwise cast every chunk's
    start state once more: titans B4 T4096 H8 D128 on an H200, 0.76 ms of casts against 0.31 ms
    more in this kernel; the layer 20.35 -> 19.87 ms, one command)."""
    index = (p, slice(None), cols) if name in ("w0", "m0") else (p, cols, slice(None))
    if r[name].dtype == BF16:   # kept in bf16 by the state pass (the joint route): no copy
        return r[name][index]
    tile = load_f32(r[name], index)
    if cfg.low:
        tile = tile.astype(BF16)
        r[name + "_b"][index] = tile
    return tile


def _fwd_kernel(r, cfg: _Cfg):
    """Hidden tiles g·k ... g·k + k − 1 of chunk p (k tiles a program): their share of O, and what
    the backward keeps of them."""
    g, p, all_ = pl.program_id(0), pl.program_id(1), slice(None)
    dot = lambda f: functools.partial(f, low=cfg.low, exact=False)
    mm_, mm_nt_ = dot(mm), dot(mm_nt)
    operand = (lambda x: x.astype(BF16)) if cfg.low else (lambda x: x)
    q, a = r["q"][p, :, :], r["a"][p, :, :]
    rows = load_f32(r["rows"], (p, all_, all_))
    fs = _rows(r["fs"], p)
    sc = _rows(r["sc"], p) if cfg.momentum else None
    g0 = operand(rows * mm_nt_(q, a))   # M ⊙ (q aᵀ), shared by the program's tiles

    def tile(t, acc):
        out, g1 = acc
        j = g * cfg.tiles_per_program + t
        cols = pl.ds(pl.multiple_of(j * cfg.block_hidden, cfg.block_hidden), cfg.block_hidden)
        zw = mm_(q, _weight(r, cfg, "w0", p, cols))
        z = fs * zw + mm_(g0, r["d0"][p, :, cols])
        kept = {"z": z, "zw": zw}
        if cfg.momentum:
            kept["zm"] = mm_(q, _weight(r, cfg, "m0", p, cols))
            z = z + sc * kept["zm"]
            kept["z"] = z
        for name, value in kept.items():
            r[name][p, :, cols] = value.astype(r[name].dtype)
        hidden = operand(act_and_grad(cfg.activation, z)[0])
        out = out + fs * mm_(hidden, _weight(r, cfg, "w1", p, cols))
        if cfg.momentum:
            out = out + sc * mm_(hidden, _weight(r, cfg, "m1", p, cols))
        # Σ over the tiles of Ĥ_j H_jᵀ, taken by E once after the last
        return out, g1 + mm_nt_(hidden, r["hid"][p, :, cols])

    b, dv = r["o"].shape[-2:]
    zeros = lambda *shape: jnp.zeros(shape, F32)
    out, g1 = lax.fori_loop(0, cfg.tiles_per_program, tile, (zeros(b, dv), zeros(b, r["a"].shape[-2])))
    out = out + mm_(operand(rows * g1), operand(load_f32(r["e"], (p, all_, all_))))
    if cfg.residual:   # group 0 adds it
        out = out + (1 - jnp.minimum(g, 1)).astype(F32) * q.astype(F32)
    r["o"][p, g, :, :] = out


def forward(cfg, starts, q, a, hid, d0, e, fs, sc, rows):
    """(O [P, b, dv], {name: kept value}: Z, q W0, q m0 [P, b, h] in the inputs' dtype and, for
    bf16 inputs, θ's bf16 operands)."""
    P, b = q.shape[:2]
    dv = starts.w1.shape[-1]
    ins = dict(q=q, a=a, hid=hid, d0=d0, e=e, rows=rows, fs=fs, sc=sc, **dict(zip(("w0", "w1", "m0", "m1"), starts)))
    ins = {k: v for k, v in ins.items() if v is not None}
    kept = jax.ShapeDtypeStruct((P, b, cfg.hidden), q.dtype)
    outs = {"o": jax.ShapeDtypeStruct((P, cfg.groups, b, dv), F32), "z": kept, "zw": kept}
    if cfg.momentum:
        outs["zm"] = kept
    if cfg.low and starts.w0.dtype != BF16:
        outs.update({k + "_b": jax.ShapeDtypeStruct(ins[k].shape, BF16) for k in _names(cfg)})
    in_names, out_names = list(ins), list(outs)

    def body(*refs):
        _fwd_kernel(dict(zip(in_names + out_names, refs)), cfg)

    res = pl.pallas_call(body, grid=(cfg.groups, P), out_shape=list(outs.values()),
                         compiler_params=plgpu.CompilerParams(num_warps=cfg.num_warps, num_stages=1),
                         interpret=cfg.interpret, name="mlp_reads_gpu_fwd")(*ins.values())
    res = dict(zip(out_names, res))
    return jnp.sum(res.pop("o"), axis=1), res


def backward_parts(cfg, res, do):
    """The module docstring's backward, batched over the P chunks in XLA: (the start states'
    cotangents as their factors, a `gpu.StartFactors` [P, ...], and the other arguments'
    cotangents: q̄, ā, H̄, D̄, Ē, P̄, c̄, M̄)."""
    (starts, q, a, hid, d0, e, fs, sc, rows), kept = res
    operand = BF16 if cfg.low else F32
    precision = None if cfg.low else lax.Precision.HIGHEST

    def dot(spec, x, y, out=F32):
        return jnp.einsum(spec, x.astype(operand), y.astype(operand), preferred_element_type=out,
                          precision=precision)

    if cfg.low and "w0_b" in kept:
        w0, w1, m0, m1 = (kept.get(k + "_b") for k in ("w0", "w1", "m0", "m1"))
    else:   # float32, or kept in bf16 by the state pass
        w0, w1, m0, m1 = starts
    fs_, sc_ = fs[..., None], None if sc is None else sc[..., None]
    z, zw = kept["z"].astype(F32), kept["zw"].astype(F32)
    hidden, slope = act_and_grad(cfg.activation, z, erf=lax.erf)
    # the [P, b, h] products that feed only Ẑ's elementwise terms (Ȳ W1ᵀ, the rows' term, Ȳ m1ᵀ)
    # come out in the operands' dtype (float32 accumulation, one rounding): half the bytes XLA writes
    # and reads back (titans' layer 0.981 at B4 T4096 and 0.983 at B1 T16384 H8 of float32 outputs;
    # H200, one command)
    ow = dot("PBV,PHV->PBH", do, w1, operand).astype(F32)
    s1 = dot("PBV,PNV->PBN", do, e)
    g1_bar = s1 * rows
    h_bar = fs_ * ow + dot("PBN,PNH->PBH", g1_bar, hid, operand).astype(F32)
    if cfg.momentum:
        om = dot("PBV,PHV->PBH", do, m1, operand).astype(F32)
        h_bar = h_bar + sc_ * om
    z_bar = h_bar * slope
    d_fs = jnp.sum(hidden * ow + z_bar * zw, axis=-1)
    g1 = dot("PBH,PNH->PBN", hidden, hid)
    qa = dot("PBD,PND->PBN", q, a)
    s0 = dot("PBH,PNH->PBN", z_bar, d0)
    g0_bar = s0 * rows
    dq = dot("PBH,PDH->PBD", fs_ * z_bar, w0) + dot("PBN,PND->PBD", g0_bar, a)
    as_operand = lambda x: None if x is None else x.astype(operand)
    factors = StartFactors(as_operand(q), as_operand(fs_ * z_bar), None, as_operand(hidden), as_operand(fs_ * do), None)
    d_sc = None
    if cfg.momentum:
        d_sc = jnp.sum(hidden * om + z_bar * kept["zm"].astype(F32), axis=-1).astype(sc.dtype)
        dq = dq + dot("PBH,PDH->PBD", sc_ * z_bar, m0)
        factors = factors._replace(v0=as_operand(sc_ * z_bar), v1=as_operand(sc_ * do))
    if cfg.residual:
        dq = dq + do
    return factors, (dq.astype(q.dtype), dot("PBN,PBD->PND", g0_bar, q).astype(a.dtype),
                     dot("PBN,PBH->PNH", g1_bar, hidden).astype(hid.dtype),
                     dot("PBN,PBH->PNH", rows * qa, z_bar).astype(d0.dtype),
                     dot("PBN,PBV->PNV", rows * g1, do).astype(e.dtype), d_fs.astype(fs.dtype), d_sc,
                     (s1 * g1 + s0 * qa).astype(rows.dtype))


def _backward(cfg, res, do):
    """`backward_parts` with the start states' cotangents formed θ-sized (P products each)."""
    f, rest = backward_parts(cfg, res, do)
    outer = lambda x, y: None if y is None else jnp.einsum("PBI,PBJ->PIJ", x, y, preferred_element_type=F32,
                                                           precision=None if cfg.low else lax.Precision.HIGHEST)
    return (MLPStates(outer(f.q_w, f.u0), outer(f.h_w, f.u1), outer(f.q_w, f.v0), outer(f.h_w, f.v1)), *rest)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _core(cfg, starts, q, a, hid, d0, e, fs, sc, rows):
    return forward(cfg, starts, q, a, hid, d0, e, fs, sc, rows)[0]


def _core_fwd(cfg, *args):
    out, kept = forward(cfg, *args)
    return out, (args, kept)


_core.defvjp(_core_fwd, _backward)


def query_operands(queries, from_start, state_carry, state_rows, n_padded, d_padded):
    """The queries [B, H, N, b, d] and their coefficients (P, c [.., b], M [.., b, n]) in the
    kernel's layout: [B·H·N, b', ...], b padded to a power of two >= 16, n and d to the given
    sizes, the coefficients float32."""
    P, b = queries.shape[0] * queries.shape[1] * queries.shape[2], queries.shape[3]
    bp = next_pow2(b, least=16)
    flat = lambda x, *tail: None if x is None else pad_to(x.reshape((P,) + x.shape[3:]), (P, bp) + tail)
    f32 = lambda x: None if x is None else x.astype(F32)
    return flat(queries, d_padded), flat(f32(from_start)), flat(f32(state_carry)), flat(f32(state_rows), n_padded)


@functools.partial(jax.jit, static_argnames=("cfg",))
def _run(starts, queries, a, hidden, d0, errors, from_start, state_carry, state_rows, *, cfg):
    B, H, N, b, d = queries.shape
    n, dv = a.shape[3], starts.w1.shape[-1]
    np_, dp, vp = (next_pow2(x, least=16) for x in (n, d, dv))
    hp, P = cfg.hidden, B * H * N

    def flat(x, *tail):
        return None if x is None else pad_to(x.reshape((P,) + x.shape[3:]), (P,) + tail)

    f32 = lambda x: None if x is None else x.astype(F32)
    st = MLPStates(flat(f32(starts.w0), dp, hp), flat(f32(starts.w1), hp, vp), flat(f32(starts.m0), dp, hp),
                   flat(f32(starts.m1), hp, vp))
    q, fs, sc, m = query_operands(queries, from_start, state_carry, state_rows, np_, dp)
    out = _core(cfg, st, q, flat(a, np_, dp), flat(hidden, np_, hp), flat(d0, np_, hp), flat(f32(errors), np_, vp),
                fs, sc, m)
    return out[:, :b, :dv].reshape(B, H, N, b, dv)


def mlp_reads_gpu(starts: MLPStates, queries, a, sources: MLPSources, errors, from_start, state_carry,
                  state_rows, *, activation: str, residual: bool, interpret=None, block_sizes=None):
    """`atlas_jax.ops.deep_memory.mlp_reads` on the GPU kernel (arguments checked there); float32
    outputs [B, H, N, b, dv]. bf16 queries, a and sources take bf16 products."""
    bs = MLPReadsGpuBlockSizes() if block_sizes is None else block_sizes
    if not isinstance(bs, MLPReadsGpuBlockSizes):
        raise TypeError(f"{_FN}: argument `block_sizes` must be an MLPReadsGpuBlockSizes; got {type(bs).__name__}.")
    dtypes = {x.dtype for x in (queries, a, sources.hidden, sources.d0)}
    if len(dtypes) != 1 or not dtypes <= {jnp.dtype(F32), jnp.dtype(BF16)}:
        raise TypeError(f"{_FN}: arguments `queries`, `a`, `sources.hidden` and `sources.d0` must share one dtype, "
                        f"float32 or bfloat16; got {sorted(str(x) for x in dtypes)}.")
    cfg = reads_config(starts.w0.shape[-1], starts.m0 is not None, queries.dtype == BF16, activation=activation,
                       residual=residual, interpret=interpret, block_sizes=bs)
    return _run(starts, queries, a, sources.hidden, sources.d0, errors, from_start, state_carry, state_rows,
                cfg=cfg)


def reads_config(h, momentum, low, *, activation, residual, interpret, block_sizes):
    """The forward kernel's static config for a hidden width h."""
    bs = MLPReadsGpuBlockSizes() if block_sizes is None else block_sizes
    hp = next_pow2(h, least=16)
    if bs.block_hidden is None:
        bs = dataclasses.replace(bs, block_hidden=min(hp, 64))
    bs.check(hp)
    tiles = hp // bs.block_hidden
    per_program = min(tiles, 4) if bs.tiles_per_program is None else bs.tiles_per_program   # module docstring
    if not is_int(per_program) or per_program < 1 or tiles % per_program:
        raise ValueError(f"{_FN}: argument `block_sizes.tiles_per_program` must divide the {tiles} hidden tiles; "
                         f"got {per_program!r}.")
    return _Cfg(momentum=momentum, residual=bool(residual), activation=activation, low=low, hidden=hp,
                block_hidden=bs.block_hidden, num_warps=bs.num_warps, tiles_per_program=per_program,
                interpret=bool(default_interpret() if interpret is None else interpret))
