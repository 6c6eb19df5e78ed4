"""Launchers of the GPU (Pallas, Triton lowering) delta-family kernels and their custom VJP.

One launcher per kernel label of the table in `gpu.py`: each builds the BlockSpecs, grid and
output buffers of one `pallas_call` (`_call`) on the padded layout [B, Tp, H, *] (Tp a multiple
of the chunk size C); `core` ties the forward and backward launchers together with
`jax.custom_vjp`. The kernel bodies are in `gpu_fwd.py` / `gpu_bwd.py`, the knobs in
`gpu_config.py`.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from atlas_jax.kernels.delta_family import gpu_bwd, gpu_fwd, support
from atlas_jax.kernels.delta_family import gpu_math as gm
from atlas_jax.kernels.delta_family.gpu_config import GpuBlockSizes

F32 = jnp.float32


@dataclasses.dataclass(frozen=True)
class Static:
    """kc, bs: the kernels' configuration; n_seq: states (B, or N packed sequences); group:
    value heads per q/k head (grouped value heads: the grids run over the HV = group * H value
    heads, and value head h reads q/k head h // group)."""
    kc: gm.KernelCfg
    bs: GpuBlockSizes
    interpret: bool
    n_seq: int
    group: int = 1


class RawGate(NamedTuple):
    """fla's fused scalar gate (use_gate_in_kernel): the raw input g [B, Tp, HV] (padding
    -inf), A_log [HV] and dt_bias [HV] (float32); the forward kernels that read g activate it
    on load (`gpu_math.load_gate`, cfg.gate_act)."""
    g: jax.Array
    A_log: jax.Array
    dt_bias: jax.Array


def _value_heads(st, q):
    """(B, Tp, HV, K) of a call whose q is [B, Tp, H, K]: the heads the grids run over."""
    B, Tp, H, K = q.shape
    return B, Tp, H * st.group, K


# ---------------------------------------------------------------------------------------------
# pallas_call plumbing


def _shared_head(spec, group):
    """The BlockSpec of a q or k input ([B, Tp, H, K], head at block index 2) for grids over
    value heads: value head h reads q/k head h // group (fla's GVA mapping)."""
    index_map = spec.index_map

    def shared(*idx):
        out = tuple(index_map(*idx))
        return out[:2] + (out[2] // group,) + out[3:]

    return pl.BlockSpec(spec.block_shape, shared)


def _call(body, grid, ins, outs, *, name, num_warps, num_stages, interpret, aliases=None,
          group=1):
    """ins: [(name, array, BlockSpec)], outs: [(name, ShapeDtypeStruct, BlockSpec)];
    aliases: {input name: output name} written in place; group > 1: the inputs named q and k
    have H = HV / group heads and are shared by `group` consecutive value heads."""
    if group > 1:
        ins = [(n, a, _shared_head(sp, group) if n in ("q", "k") else sp) for n, a, sp in ins]
    ins = [x for n, a, sp in ins for x in _expand_raw_gate(n, a, sp)]
    names = [n for n, _, _ in ins] + [n for n, _, _ in outs]
    in_index = {n: i for i, (n, _, _) in enumerate(ins)}
    out_index = {n: i for i, (n, _, _) in enumerate(outs)}

    def kernel(*refs):
        body(dict(zip(names, refs)))

    res = pl.pallas_call(
        kernel,
        grid=grid,
        in_specs=[s for _, _, s in ins],
        out_specs=[s for _, _, s in outs],
        out_shape=[sd for _, sd, _ in outs],
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name=name,
        input_output_aliases={in_index[a]: out_index[b] for a, b in (aliases or {}).items()},
    )(*[a for _, a, _ in ins])
    return dict(zip([n for n, _, _ in outs], res))


def _expand_raw_gate(name, arr, spec):
    """An input as [(name, array, spec)]; a RawGate g becomes g plus its head's A_log and dt_bias
    as [] blocks, the head read off g's own index map (g's block index is (b, t, head[, 0]))."""
    if not isinstance(arr, RawGate):
        return [(name, arr, spec)]
    index_map = spec.index_map
    head = pl.BlockSpec((None,), lambda *idx: (index_map(*idx)[2],))
    return [(name, arr.g, spec), ("A_log", arr.A_log, head), ("dt_bias", arr.dt_bias, head)]


def _sds(shape, dtype):
    return jax.ShapeDtypeStruct(tuple(shape), jnp.dtype(dtype))


def _chunk_specs(C):
    """BlockSpecs of per-chunk kernels, grid (NT, B, H)."""
    def rows(d):
        return pl.BlockSpec((None, C, None, d), lambda n, b, h: (b, n, h, 0))
    vec = pl.BlockSpec((None, C, None), lambda n, b, h: (b, n, h))
    return rows, vec


def _token_specs(C, bh):
    """BlockSpecs of the per-token kernels (channel gate), grid (Tp, H / bh, B): block(d) the
    token's 16-row sub-block [16, bh, d] for bh heads, bvec its per-token scalars [16, bh],
    row(d) the token's own row [bh, d], rvec its scalar [bh], drow its row of the sub-block's
    diagonal 16x16 block of a [C, C] per-chunk matrix [bh, 16] and dblock that block
    [16, bh, 16]."""
    S, nb = gm.SUB, C // gm.SUB

    def block(d):
        return pl.BlockSpec((None, S, bh, d), lambda t, h, b: (b, t // S, h, 0))

    def row(d):
        return pl.BlockSpec((None, None, bh, d), lambda t, h, b: (b, t, h, 0))

    return dict(
        block=block, row=row,
        bvec=pl.BlockSpec((None, S, bh), lambda t, h, b: (b, t // S, h)),
        rvec=pl.BlockSpec((None, None, bh), lambda t, h, b: (b, t, h)),
        drow=pl.BlockSpec((None, None, bh, S), lambda t, h, b: (b, t, h, (t // S) % nb)),
        dblock=pl.BlockSpec((None, S, bh, S), lambda t, h, b: (b, t // S, h, (t // S) % nb)))


def _diag_programs(st, C, H):
    """KDA's per-token kernels (K1d, K4d): (value heads per program bh, their BlockSpecs, a
    spec maker for q and k that already maps value heads to q/k heads: launch with group=1).
    Without grouping bh = diag_heads (dividing H). With grouped value heads (G per q/k head)
    bh = gcd(G, diag_heads) value heads of one group: they share one q/k head, loaded once as a
    [1, K] row that broadcasts against the [bh, K] gate rows (bh = 1: one value head reading
    its group's q/k head, `_shared_head`'s mapping)."""
    G = st.group
    if G == 1:
        bh = math.gcd(st.bs.diag_heads, H)
        ts = _token_specs(C, bh)
        return bh, ts, ts["block"]
    bh = math.gcd(G, st.bs.diag_heads)
    ts = _token_specs(C, bh)

    def qk(d):      # program h (value heads h bh .. h bh + bh - 1) reads q/k head h bh // G
        return pl.BlockSpec((None, gm.SUB, 1, d),
                            lambda t, h, b: (b, t // gm.SUB, (h * bh) // G, 0))
    return bh, ts, qk


def _vblock_specs(C, bv):
    """BlockSpecs of the parallel kernels over chunks and V blocks, grid (V / bv, NT, B, H):
    rows(d) of one chunk, its per-token scalars and its [C, bv] V block."""
    def rows(d):
        return pl.BlockSpec((None, C, None, d), lambda j, n, b, h: (b, n, h, 0))
    vec = pl.BlockSpec((None, C, None), lambda j, n, b, h: (b, n, h))
    vrows = pl.BlockSpec((None, C, None, bv), lambda j, n, b, h: (b, n, h, j))
    return rows, vec, vrows


def _seq_specs(st, Tp, NT):
    """BlockSpecs of the sequential kernels, grid (NS, H, V / BV)."""
    kc = st.kc
    var = kc.varlen
    bv = kc.block_v

    def full(d):
        return pl.BlockSpec((None, Tp, None, d), lambda s, h, j: (0 if var else s, 0, h, 0))

    vblk = pl.BlockSpec((None, Tp, None, bv), lambda s, h, j: (0 if var else s, 0, h, j))
    vec = pl.BlockSpec((None, Tp, None), lambda s, h, j: (0 if var else s, 0, h))
    state = pl.BlockSpec((None, None, kc.K, bv), lambda s, h, j: (s, h, 0, j))
    hs = pl.BlockSpec((None, NT, None, kc.K, bv), lambda s, h, j: (0 if var else s, 0, h, 0, j))
    offs = pl.BlockSpec((st.n_seq + 1,), lambda s, h, j: (0,))
    return full, vblk, vec, state, hs, offs


def _gated_seq_ins(st, r, Tp, NT, names=("qg", "kg", "gend")):
    """K1b-stored gate operands (cfg.pre_gates) for the sequential kernels, those in `names`:
    the channel gate's Gam q, exp(G_C - G) k and exp(G_C) per chunk, or the scalar gate's
    chunk-local cumulative gate gcum."""
    K = st.kc.K
    full, _, vec = _seq_specs(st, Tp, NT)[:3]
    specs = dict(qg=full(K), kg=full(K), gcum=vec,
                 gend=pl.BlockSpec((None, NT, None, K),
                                   lambda s, h, j: (0 if st.kc.varlen else s, 0, h, 0)))
    return [(n, r[n], specs[n]) for n in names]


def _inter_dtype(bs, dtype):
    return dtype if bs.inter_dtype == "input" else F32


def _state_dtype(bs, dtype):
    return dtype if bs.state_dtype == "input" else F32


# ---------------------------------------------------------------------------------------------
# Forward and backward on the padded layout [B, Tp, H, *] (Tp a multiple of C)


def _gate_spec(kc, rows, vec):
    return vec if kc.gate == "scalar" else rows(kc.K)


def _intra_forward(st: Static, q, k, v, beta, g, save):
    """K1: per-chunk W, U0 (and T, and P for KDA), all chunks in parallel."""
    kc, bs = st.kc, st.bs
    B, Tp, H, K = _value_heads(st, q)
    V, C = kc.V, kc.C
    NT = Tp // C
    rows, vec = _chunk_specs(C)
    idt = _inter_dtype(bs, q.dtype)
    ins = [("k", k, rows(K)), ("v", v, rows(V)), ("beta", beta, vec)]
    if kc.gate != "none":
        ins.append(("g", g, _gate_spec(kc, rows, vec)))
    if kc.gate == "channel":
        ins.append(("q", q, rows(K)))
    outs = [("w", _sds((B, Tp, H, K), idt), rows(K)), ("u0", _sds((B, Tp, H, V), idt), rows(V))]
    if bs.split_intra:
        return _intra_forward_split(st, ins, outs, rows)
    if save or kc.wide:       # the wide layout also uses it as the in-kernel scratch
        outs.append(("tmat", _sds((B, Tp, H, C), F32), rows(C)))
    if kc.gate == "channel":
        outs.append(("p", _sds((B, Tp, H, C), F32), rows(C)))
    return _call(functools.partial(gpu_fwd.intra_fwd_kernel, cfg=kc, store_t=save), (NT, B, H), ins,
                 outs, name="delta_intra_fwd", num_warps=bs.num_warps_intra,
                 num_stages=bs.num_stages_intra, interpret=st.interpret, group=st.group)


def _intra_forward_split(st: Static, ins, outs, rows):
    """K1a (T, and P for KDA) then K1b (W, U0 from T); same inputs and outputs as K1."""
    kc, bs = st.kc, st.bs
    B, Tp, H, _ = outs[0][1].shape
    C, NT = kc.C, outs[0][1].shape[1] // kc.C
    # T is stored in the input dtype for bf16 inputs: its readers (K1b's W = T X, U0 = T Y and
    # K4's T^T dU) use it only as a bf16 dot operand, so no bit changes, half its traffic, and
    # they load it as stored. M (KDA) and the wide A, which the inverse reads, stay float32 in
    # their own buffer.
    tmat = ("tmat", _sds((B, Tp, H, C), jnp.bfloat16 if kc.low else F32), rows(C))
    mbuf = ("m", _sds((B, Tp, H, C), F32), rows(C))
    solve_ins = [x for x in ins if x[0] != "v"]
    if kc.gate == "channel":
        # K1d: the diagonal 16x16 blocks of M and P, one program per token; K1p: the other
        # blocks around them (in place); the solve then reads M and writes T (fuse_solve:
        # K1p forms T itself). P is stored in the inter dtype: every reader uses it as a dot
        # operand only (O, P^T dO), which rounds it to bf16 for bf16 inputs anyway, so bf16
        # storage changes no bit and lets the readers load it as stored.
        pmat = _sds((B, Tp, H, C), outs[0][1].dtype)
        bh, ts, qk_spec = _diag_programs(st, C, H)
        spec = {"q": qk_spec(kc.K), "k": qk_spec(kc.K), "beta": ts["bvec"], "g": ts["block"](kc.K)}
        d = _call(functools.partial(gpu_fwd.channel_diag_fwd_kernel, cfg=kc), (Tp, H // bh, B),
                  [(n, a, spec[n]) for n, a, _ in solve_ins],
                  [("m", mbuf[1], ts["drow"]), ("p", pmat, ts["drow"])],
                  name="delta_intra_diag", num_warps=bs.num_warps_diag, num_stages=1,
                  interpret=st.interpret, group=1)
        pair_ins = solve_ins + [("m_d", d["m"], rows(C)), ("p_d", d["p"], rows(C))]
        if kc.fuse_solve:       # T straight from the blocks: M is read, never written back
            r = _call(functools.partial(gpu_fwd.channel_pairs_kernel, cfg=kc), (NT, B, H),
                      pair_ins, [tmat, ("p", pmat, rows(C))], name="delta_intra_pairs",
                      num_warps=bs.num_warps_pairs, num_stages=bs.num_stages_pairs,
                      interpret=st.interpret, group=st.group,
                      aliases={"p_d": "p"})
        else:
            r = _call(functools.partial(gpu_fwd.channel_pairs_kernel, cfg=kc), (NT, B, H),
                      pair_ins, [mbuf, ("p", pmat, rows(C))], name="delta_intra_pairs",
                      num_warps=bs.num_warps_pairs, num_stages=bs.num_stages_pairs,
                      interpret=st.interpret, group=st.group,
                      aliases={"m_d": "m", "p_d": "p"})
            solve_ins = [x for x in ins if x[0] == "beta"] + [("m", r["m"], rows(C))]
            r.update(_call(functools.partial(gpu_fwd.intra_fwd_kernel, cfg=kc, store_t=True,
                                             part="solve"),
                           (NT, B, H), solve_ins, [tmat], name="delta_intra_solve",
                           num_warps=bs.num_warps_solve, num_stages=1, interpret=st.interpret, group=st.group))
    else:
        # The wide A goes through a float32 scratch buffer that the inverse reads back.
        # (block_kkt: A stays in registers, no scratch.)
        scratch = [("ascr", mbuf[1], rows(C))] if kc.wide and not kc.block_kkt else []
        r = _call(functools.partial(gpu_fwd.intra_fwd_kernel, cfg=kc, store_t=True, part="solve"),
                  (NT, B, H), solve_ins, [tmat] + scratch, name="delta_intra_solve",
                  num_warps=bs.num_warps_solve, num_stages=bs.num_stages_solve,
                  interpret=st.interpret, group=st.group)
    wu_ins = [x for x in ins if x[0] != "q" or kc.pre_gates] + [("tmat", r["tmat"], rows(C))]
    if kc.pre_gates and kc.gate == "scalar":
        outs = outs + [("gcum", _sds((B, Tp, H), F32), _chunk_specs(C)[1])]
    elif kc.pre_gates:
        K = kc.K
        outs = outs + [("qg", _sds((B, Tp, H, K), outs[0][1].dtype), rows(K)),
                       ("kg", _sds((B, Tp, H, K), outs[0][1].dtype), rows(K)),
                       ("gend", _sds((B, NT, H, K), F32),
                        pl.BlockSpec((None, None, None, K), lambda n, b, h: (b, n, h, 0)))]
    r.update(_call(functools.partial(gpu_fwd.intra_fwd_kernel, cfg=kc, store_t=False, part="wu"),
                   (NT, B, H), wu_ins, outs, name="delta_intra_wu",
                   num_warps=bs.num_warps_intra, num_stages=bs.num_stages_intra,
                   interpret=st.interpret, group=st.group))
    return r


def _state_forward(st: Static, q, k, v, g, s0, offs, r1, save):
    """K2 (+ K2o): o, sT and, when save (or always in the lean form), h; lean also v_new."""
    if st.bs.fuse_output:
        return _state_forward_fused(st, q, k, v, g, s0, offs, r1, save)
    if overlaps_output(st, save):
        return _state_output_overlapped(st, q, v, s0, r1)
    r2 = _state_forward_lean(st, q, k, v, g, s0, offs, r1)
    r2["o"] = _output(st, q, k, v, g, r1, r2)
    return r2


def _state_forward_lean(st: Static, q, k, v, g, s0, offs, r1):
    """K2, lean: h per chunk, v_new and the final state (no output)."""
    kc, bs = st.kc, st.bs
    B, Tp, H, K = _value_heads(st, q)
    NT = Tp // kc.C
    NS = st.n_seq
    full, vblk, svec, state, hs, ospec = _seq_specs(st, Tp, NT)
    ins = [("w", r1["w"], full(K)), ("u0", r1["u0"], vblk)]
    if kc.pre_gates and kc.gate == "channel":
        ins += _gated_seq_ins(st, r1, Tp, NT, names=("kg", "gend"))
    else:
        ins.append(("k", k, full(K)))
        if kc.pre_gates:
            ins += _gated_seq_ins(st, r1, Tp, NT, names=("gcum",))
        elif kc.gate == "scalar":
            ins.append(("g", g, svec))
        elif kc.gate == "channel":
            ins.append(("g", g, full(K)))
    if kc.has_s0:
        ins.append(("s0", s0, state))
    if kc.varlen:
        ins.append(("offs", offs, ospec))
    outs = [("sT", _sds((NS, H, K, kc.V), F32), state),
            ("h", _sds((B, NT, H, K, kc.V), _state_dtype(bs, q.dtype)), hs),
            ("vn", _sds((B, Tp, H, kc.V), q.dtype), vblk)]
    return _call(functools.partial(gpu_fwd.state_fwd_lean_kernel, cfg=kc, nt_static=NT),
                 (NS, H, kc.V // kc.block_v), ins, outs, name="delta_state_fwd_lean",
                 num_warps=bs.num_warps_state, num_stages=bs.num_stages_state,
                 interpret=st.interpret, group=st.group)


def _output(st: Static, q, k, v, g, r1, r2):
    """K2o: O = (Gam q) h + P v_new for every chunk and V block in parallel."""
    kc, bs = st.kc, st.bs
    B, Tp, H, K = _value_heads(st, q)
    V, C = kc.V, kc.C
    NT = Tp // C
    bvo = bs.block_v_out
    rows, vec, vrows = _vblock_specs(C, bvo)
    if kc.pre_gates and kc.gate == "channel":
        ins = [("qg", r1["qg"], rows(K)), ("p", r1["p"], rows(C))]
    else:
        ins = [("q", q, rows(K))]
        if kc.gate != "channel":
            ins.append(("k", k, rows(K)))
        if kc.gate == "scalar":
            ins.append(("gcum", r1["gcum"], vec) if kc.pre_gates else ("g", g, vec))
        elif kc.gate == "channel":
            ins += [("g", g, rows(K)), ("p", r1["p"], rows(C))]
    ins += [("h", r2["h"], pl.BlockSpec((None, None, None, K, bvo),
                                        lambda j, n, b, h: (b, n, h, 0, j))),
            ("vn", r2["vn"], vrows)]
    outs = [("o", _sds((B, Tp, H, V), v.dtype), vrows)]
    # V blocks vary fastest: the programs of one chunk run together and share q, k in L2.
    return _call(functools.partial(gpu_fwd.output_kernel, cfg=kc), (V // bvo, NT, B, H), ins, outs,
                 name="delta_output", num_warps=bs.num_warps_out, num_stages=bs.num_stages_out,
                 interpret=st.interpret, group=st.group)["o"]


def overlaps_output(st, save):
    """K2 and K2o in one launch (`gpu_fwd.state_out_fwd_kernel`): asked for (or the
    heuristic's), the channel gate with K1b's gate operands, no packed sequences, and no
    residuals to keep (the VJP's forward keeps the two launches: fwd+bwd at B4 T4096 H16 was
    4.86 ms with one launch against 4.77 with two, H200)."""
    kc, bs = st.kc, st.bs
    return bool(bs.overlap_output and not save and kc.gate == "channel" and kc.pre_gates
                and not kc.varlen)


def _remap(spec, fn):
    """A BlockSpec of a 1-D grid whose index map is `spec`'s at the grid ids fn(i)."""
    return pl.BlockSpec(spec.block_shape, lambda i: spec.index_map(*fn(i)))


def _state_output_overlapped(st: Static, q, v, s0, r1):
    """K2 ∥ K2o: the state programs (NS, H, V / BV) then the output programs (NT, B, H),
    chunk-major, on one 1-D grid; each input keeps its kernel's BlockSpec (the other role's
    programs see a valid block they never touch); h and U are whole-V blocks per (b, h) that
    the state programs write by columns and the output programs read by chunks."""
    bs = st.bs
    kc = dataclasses.replace(st.kc, block_v=bs.block_v_overlap)
    st = dataclasses.replace(st, kc=kc)
    B, Tp, H, K = _value_heads(st, q)
    C, NT, V, VB = kc.C, Tp // kc.C, kc.V, kc.V // kc.block_v
    n_state, n_out = B * H * VB, NT * B * H
    full, vblk, _, state, _, _ = _seq_specs(st, Tp, NT)

    def as_state(i):
        return gpu_fwd.state_program(jnp.minimum(i, n_state - 1), H, VB)

    def as_out(i):      # (V block, chunk, b, h): K2o's grid order
        return (0,) + gpu_fwd.output_program(jnp.maximum(i - n_state, 0), H, B)

    def shared(i):      # h and U of (b, h): the state program's, or the output program's
        s_, h_, _ = as_state(i)
        _, _, b2, h2 = as_out(i)
        first = i < n_state
        return jnp.where(first, s_, b2), jnp.where(first, h_, h2)

    rows, _, vrows = _vblock_specs(C, V)
    h_all = pl.BlockSpec((None, NT, None, K, V), lambda i: (*shared(i)[:1], 0, shared(i)[1], 0, 0))
    vn_all = pl.BlockSpec((None, Tp, None, V), lambda i: (shared(i)[0], 0, shared(i)[1], 0))
    ins = [("w", r1["w"], _remap(full(K), as_state)), ("u0", r1["u0"], _remap(vblk, as_state))]
    ins += [(n, a, _remap(sp, as_state)) for n, a, sp in _gated_seq_ins(st, r1, Tp, NT,
                                                                         names=("kg", "gend"))]
    if kc.has_s0:
        ins.append(("s0", s0, _remap(state, as_state)))
    ins += [("qg", r1["qg"], _remap(rows(K), as_out)), ("p", r1["p"], _remap(rows(C), as_out))]
    flags = jnp.zeros((n_out,), jnp.int32)           # one per (b, h, chunk), counted per V block
    ins.append(("flags", flags, pl.BlockSpec((n_out,), lambda i: (0,))))
    outs = [("sT", _sds((B, H, K, kc.V), F32), _remap(state, as_state)),
            ("h", _sds((B, NT, H, K, kc.V), _state_dtype(bs, q.dtype)), h_all),
            ("vn", _sds((B, Tp, H, kc.V), q.dtype), vn_all),
            ("o", _sds((B, Tp, H, kc.V), v.dtype), _remap(vrows, as_out)),
            ("flags", flags, pl.BlockSpec((n_out,), lambda i: (0,)))]
    r2 = _call(functools.partial(gpu_fwd.state_out_fwd_kernel, cfg=kc, nt_static=NT,
                                 n_state=n_state, heads=H, vblocks=VB, batch=B),
               (n_state + n_out,), ins, outs, name="delta_state_out_fwd",
               num_warps=bs.num_warps_state, num_stages=bs.num_stages_state,
               interpret=st.interpret, group=1, aliases={"flags": "flags"})
    return r2


def _state_forward_fused(st: Static, q, k, v, g, s0, offs, r1, save):
    """K2, fused: the sequential state pass over chunks with the output fused in."""
    kc, bs = st.kc, st.bs
    B, Tp, H, K = _value_heads(st, q)
    NT = Tp // kc.C
    NS = st.n_seq
    full, vblk, svec, state, hs, ospec = _seq_specs(st, Tp, NT)
    kc2 = dataclasses.replace(kc, store_h=save)
    ins = [("q", q, full(K)), ("k", k, full(K)), ("w", r1["w"], full(K)), ("u0", r1["u0"], vblk)]
    if kc.gate == "scalar":
        ins.append(("g", g, svec))
    elif kc.gate == "channel":
        ins += [("g", g, full(K)), ("p", r1["p"], full(kc.C))]
    if kc.pre_gates and kc.gate == "channel":
        ins += _gated_seq_ins(st, r1, Tp, NT)
    if kc.has_s0:
        ins.append(("s0", s0, state))
    if kc.varlen:
        ins.append(("offs", offs, ospec))
    outs = [("o", _sds((B, Tp, H, kc.V), v.dtype), vblk), ("sT", _sds((NS, H, K, kc.V), F32), state)]
    if save:
        outs.append(("h", _sds((B, NT, H, K, kc.V), _state_dtype(bs, q.dtype)), hs))
    return _call(functools.partial(gpu_fwd.state_fwd_kernel, cfg=kc2, nt_static=NT),
                 (NS, H, kc.V // kc.block_v), ins, outs, name="delta_state_fwd",
                 num_warps=bs.num_warps_state, num_stages=bs.num_stages_state,
                 interpret=st.interpret, group=st.group)


def _forward(st: Static, q, k, v, beta, g, s0, offs, save):
    r1 = _intra_forward(st, q, k, v, beta, g, save)
    r2 = _state_forward(st, q, k, v, g, s0, offs, r1, save)
    res = None
    if save:
        res = dict(w=r1["w"], u0=r1["u0"], tmat=r1["tmat"], p=r1.get("p"), h=r2["h"],
                   vn=r2.get("vn"), qg=r1.get("qg"), kg=r1.get("kg"), gend=r1.get("gend"),
                   gcum=r1.get("gcum"))
    return r2["o"], r2["sT"], res


def _du_local(st: Static, q, k, g, res, do):
    """K3a: dU_local = P^T dO for every chunk and V block in parallel (float32)."""
    kc, bs = st.kc, st.bs
    B, Tp, H, K = _value_heads(st, q)
    V, C = kc.V, kc.C
    NT = Tp // C
    bvo = bs.block_v_out
    rows, vec, vrows = _vblock_specs(C, bvo)
    ins = [("q", q, rows(K))]
    if kc.gate == "channel":
        ins.append(("p", res["p"], rows(C)))
    else:
        ins.append(("k", k, rows(K)))
        if kc.gate == "scalar":
            ins.append(("gcum", res["gcum"], vec) if kc.pre_gates else ("g", g, vec))
    ins.append(("do", do, vrows))
    outs = [("du", _sds((B, Tp, H, V), F32), vrows)]
    return _call(functools.partial(gpu_bwd.du_local_kernel, cfg=kc), (V // bvo, NT, B, H), ins, outs,
                 name="delta_du_local", num_warps=bs.num_warps_out, num_stages=1,
                 interpret=st.interpret, group=st.group)["du"]


def _state_backward(st: Static, q, k, g, offs, res, do, dsT):
    """K3: the reverse state pass: dS per chunk, dU and the initial state's gradient; with
    split_state_bwd, K3a computes dU_local first and the lean pass adds the state's part."""
    # the reverse pass tiles V by its own block (kc.block_v is the tile of the pass at hand)
    st = dataclasses.replace(st, kc=dataclasses.replace(st.kc, block_v=st.bs.block_v_state_bwd))
    kc, bs = st.kc, st.bs
    split = bs.split_state_bwd
    B, Tp, H, K = _value_heads(st, q)
    V = kc.V
    NT = Tp // kc.C
    NS = st.n_seq
    full, vblk, svec, state, hs, ospec = _seq_specs(st, Tp, NT)
    kc3 = dataclasses.replace(kc, has_dsT=dsT is not None)
    ins = [("q", q, full(K)), ("k", k, full(K)), ("w", res["w"], full(K))]
    if kc.gate == "scalar":
        ins += (_gated_seq_ins(st, res, Tp, NT, names=("gcum",)) if kc.pre_gates
                else [("g", g, svec)])
    elif kc.gate == "channel":
        ins.append(("g", g, full(K)))
        if not split:
            ins.append(("p", res["p"], full(kc.C)))
        if kc.pre_gates:
            ins += _gated_seq_ins(st, res, Tp, NT)
    ins.append(("do", do, vblk))
    if split:
        ins.append(("du_local", _du_local(st, q, k, g, res, do), vblk))
    if dsT is not None:
        ins.append(("dsT", dsT, state))
    if kc.varlen:
        ins.append(("offs", offs, ospec))
    outs = [("dh", _sds((B, NT, H, K, V), _state_dtype(bs, q.dtype)), hs),
            ("du", _sds((B, Tp, H, V), F32), vblk),
            ("ds0", _sds((NS, H, K, V), F32), state)]
    kernel = gpu_bwd.state_bwd_lean_kernel if split else gpu_bwd.state_bwd_kernel
    return _call(functools.partial(kernel, cfg=kc3, nt_static=NT),
                 (NS, H, V // kc.block_v), ins, outs,
                 name="delta_state_bwd_lean" if split else "delta_state_bwd",
                 num_warps=bs.num_warps_state, num_stages=bs.num_stages_state,
                 interpret=st.interpret, group=st.group, aliases={"du_local": "du"} if split else None)


def _intra_backward_split(st: Static, q, k, v, beta, g, res, do, r3):
    """K4q over (K pieces, chunks) then K4w over chunks: dq, dk, dv, dbeta, dg."""
    kc, bs = st.kc, st.bs
    B, Tp, H, K = _value_heads(st, q)
    V, C = kc.V, kc.C
    NT = Tp // C
    bk = gm.k_piece(kc, bs.block_k_bwd)
    NK = K // bk
    piece = pl.BlockSpec((None, C, None, bk), lambda p, n, b, h: (b, n, h, p))
    hpiece = pl.BlockSpec((None, None, None, bk, V), lambda p, n, b, h: (b, n, h, p, 0))
    vrow = pl.BlockSpec((None, C, None, V), lambda p, n, b, h: (b, n, h, 0))
    pvec = pl.BlockSpec((None, C, None), lambda p, n, b, h: (b, n, h))
    inter = _inter_dtype(bs, q.dtype)
    ins = [("q", q, piece), ("k", k, piece)]
    if kc.gate == "scalar":
        ins.append(("g", g, pvec))
    ins += [("h", res["h"], hpiece), ("dh", r3["dh"], hpiece), ("do", do, vrow),
            ("du", r3["du"], vrow), ("vn", res["vn"], vrow)]
    outs = [("dq", _sds((B, Tp, H, K), q.dtype), piece),
            ("dk_p", _sds((B, Tp, H, K), inter), piece),
            ("dw", _sds((B, Tp, H, K), inter), piece)]
    if kc.gate == "scalar":
        outs.append(("dg_p", _sds((NK, B, Tp, H), F32),
                     pl.BlockSpec((None, None, C, None), lambda p, n, b, h: (p, b, n, h))))
    # K pieces vary fastest: the programs of one chunk run together and share dO, U, dU in L2.
    rq = _call(functools.partial(gpu_bwd.intra_bwd_qk_kernel, cfg=kc), (NK, NT, B, H), ins, outs,
               name="delta_intra_bwd_qk", num_warps=bs.num_warps_bwd,
               num_stages=bs.num_stages_bwd, interpret=st.interpret, group=st.group)
    rows, vec = _chunk_specs(C)
    ins = [("k", k, rows(K)), ("v", v, rows(V)), ("beta", beta, vec)]
    if kc.gate == "scalar":
        ins += [("g", g, vec), ("dg_p", rq["dg_p"],
                                pl.BlockSpec((NK, None, C, None), lambda n, b, h: (0, b, n, h)))]
    ins += [("tmat", res["tmat"], rows(C)), ("w", res["w"], rows(K)), ("u0", res["u0"], rows(V)),
            ("du", r3["du"], rows(V)), ("dw", rq["dw"], rows(K)), ("dk_p", rq["dk_p"], rows(K))]
    outs = [("dv", _sds(v.shape, v.dtype), rows(V)),
            ("dk", _sds((B, Tp, H, K), k.dtype), rows(K)),
            ("dbeta", _sds(beta.shape, beta.dtype), vec)]
    if kc.gate == "scalar":
        outs.append(("dg", _sds(g.shape, g.dtype), vec))
    rw = _call(functools.partial(gpu_bwd.intra_bwd_wy_kernel, cfg=kc, k_pieces=NK), (NT, B, H),
               ins, outs, name="delta_intra_bwd_wy", num_warps=bs.num_warps_wy,
               num_stages=bs.num_stages_wy, interpret=st.interpret, group=st.group)
    rw["dq"] = rq["dq"]
    return rw


def _intra_backward(st: Static, q, k, v, beta, g, res, do, r3):
    """K4 (+ K4b for KDA; K4q + K4w when split): dq, dk, dv, dbeta, dg of every chunk in
    parallel."""
    if st.bs.split_intra_bwd:         # resolved: no / scalar gate, the lean K2's v_new
        return _intra_backward_split(st, q, k, v, beta, g, res, do, r3)
    kc, bs = st.kc, st.bs
    B, Tp, H, K = _value_heads(st, q)
    V, C = kc.V, kc.C
    NT = Tp // C
    rows, vec = _chunk_specs(C)
    hchunk = pl.BlockSpec((None, None, None, K, V), lambda n, b, h: (b, n, h, 0, 0))
    vn = res.get("vn")
    kc = dataclasses.replace(kc, has_vn=vn is not None)
    ins = [("q", q, rows(K)), ("k", k, rows(K)), ("v", v, rows(V)), ("beta", beta, vec)]
    if kc.gate != "none":
        ins.append(("g", g, _gate_spec(kc, rows, vec)))
    ins += [("tmat", res["tmat"], rows(C)), ("w", res["w"], rows(K)), ("u0", res["u0"], rows(V)),
            ("h", res["h"], hchunk), ("dh", r3["dh"], hchunk), ("do", do, rows(V)),
            ("du", r3["du"], rows(V))]
    if vn is not None:
        ins.append(("vn", vn, rows(V)))
    outs = [("dv", _sds(v.shape, v.dtype), rows(V))]
    if kc.gate == "channel":
        outs += [("dq_p", _sds((B, Tp, H, K), F32), rows(K)),
                 ("dk_p", _sds((B, Tp, H, K), F32), rows(K)),
                 ("dg_p", _sds((B, Tp, H, K), F32), rows(K)),
                 ("db_p", _sds((B, Tp, H), F32), vec),
                 ("dp", _sds((B, Tp, H, C), F32), rows(C)),
                 ("dm", _sds((B, Tp, H, C), F32), rows(C))]
    else:
        outs += [("dq", _sds((B, Tp, H, K), q.dtype), rows(K)),
                 ("dk", _sds((B, Tp, H, K), k.dtype), rows(K)),
                 ("dbeta", _sds(beta.shape, beta.dtype), vec)]
        if kc.gate == "scalar":
            outs.append(("dg", _sds(g.shape, g.dtype), vec))
    r4 = _call(functools.partial(gpu_bwd.intra_bwd_kernel, cfg=kc), (NT, B, H), ins, outs,
               name="delta_intra_bwd", num_warps=bs.num_warps_bwd,
               num_stages=bs.num_stages_bwd, interpret=st.interpret, group=st.group)
    if kc.gate == "channel":
        # K4d: the diagonal blocks' pairwise terms, one program per token, added in place to
        # K4's dense parts (the gate's part to its own buffer); K4b: the off-diagonal ones and
        # the gate's reverse sum.
        bh, ts, qk_spec = _diag_programs(st, C, H)
        blk, row, qkb = ts["block"](K), ts["row"](K), qk_spec(K)
        d = _call(functools.partial(gpu_bwd.channel_diag_bwd_kernel, cfg=kc), (Tp, H // bh, B),
                  [("q", q, qkb), ("k", k, qkb), ("g", g, blk), ("beta", beta, ts["bvec"]),
                   ("dp_d", r4["dp"], ts["dblock"]), ("dm_d", r4["dm"], ts["dblock"]),
                   ("dq_in", r4["dq_p"], row), ("dk_in", r4["dk_p"], row),
                   ("db_in", r4["db_p"], ts["rvec"])],
                  [("dq", _sds((B, Tp, H, K), F32), row), ("dk", _sds((B, Tp, H, K), F32), row),
                   ("db", _sds((B, Tp, H), F32), ts["rvec"]),
                   ("dgd", _sds((B, Tp, H, K), F32), row)],
                  name="delta_intra_bwd_diag", num_warps=bs.num_warps_diag, num_stages=1,
                  interpret=st.interpret, group=1,
                  aliases={"dq_in": "dq", "dk_in": "dk", "db_in": "db"})
        ins = [("q", q, rows(K)), ("k", k, rows(K)), ("beta", beta, vec), ("g", g, rows(K)),
               ("dq_p", d["dq"], rows(K)), ("dk_p", d["dk"], rows(K)),
               ("dg_p", r4["dg_p"], rows(K)), ("db_p", d["db"], vec),
               ("dp", r4["dp"], rows(C)), ("dm", r4["dm"], rows(C)),
               ("dgd", d["dgd"], rows(K))]
        outs = [("dq", _sds((B, Tp, H, K), q.dtype), rows(K)),
                ("dk", _sds((B, Tp, H, K), k.dtype), rows(K)),
                ("dg", _sds(g.shape, g.dtype), rows(K)),
                ("dbeta", _sds(beta.shape, beta.dtype), vec)]
        kc5 = dataclasses.replace(kc, block_k_pairs=bs.block_k_pairs_bwd)
        r5 = _call(functools.partial(gpu_bwd.intra_bwd_channel_kernel, cfg=kc5), (NT, B, H), ins,
                   outs, name="delta_intra_bwd_kda", num_warps=bs.num_warps_pairs_bwd,
                   num_stages=bs.num_stages_bwd, interpret=st.interpret, group=st.group)
        r4.update(r5)
    return r4


def _activations(kc, beta, g):
    """(beta, g) activated in XLA (cfg.beta_act: beta_act * sigmoid(beta); a RawGate: fla's
    -exp(A_log) softplus(g + dt_bias)), float32; unchanged otherwise."""
    if kc.beta_act:
        beta = support.fused_beta(beta, neg_eigval=kc.beta_act == 2.0)
    if isinstance(g, RawGate):
        g = support.fused_gate(g.g, g.A_log, g.dt_bias)
    return beta, g


def _without_activations(st: Static) -> Static:
    """st for kernels fed activated values (cfg.gate_act / beta_act off)."""
    return dataclasses.replace(st, kc=dataclasses.replace(st.kc, gate_act=False, beta_act=0.0))


def _backward(st: Static, q, k, v, beta, g, s0, offs, res, do, dsT):
    r3 = _state_backward(st, q, k, g, offs, res, do, dsT)
    r4 = _intra_backward(st, q, k, v, beta, g, res, do, r3)
    dg = r4.get("dg") if st.kc.gate != "none" else None
    ds0 = r3["ds0"].astype(s0.dtype) if s0 is not None else None
    dq, dk = r4["dq"], r4["dk"]
    if st.group > 1:
        # each q/k head's gradient: the sum over its group of value heads, in float32 over the
        # per-value-head parts stored in the input dtype, as the same call with q and k
        # repeated stores them (float32 parts doubled the traffic of the backward's largest
        # outputs: H200, KDA B4 T4096 HV 32, 10.02 ms against 9.63 repeated)
        B, Tp, H, K = q.shape
        dq = dq.reshape(B, Tp, H, st.group, K).astype(F32).sum(axis=3).astype(q.dtype)
        dk = dk.reshape(B, Tp, H, st.group, K).astype(F32).sum(axis=3).astype(k.dtype)
    return dq, dk, r4["dv"], r4["dbeta"], dg, ds0


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def core(st, q, k, v, beta, g, s0, offs):
    """(o, final state) on the padded layout, differentiable in every array argument."""
    o, sT, _ = _forward(st, q, k, v, beta, g, s0, offs, save=False)
    return o, sT


def _core_fwd(st, q, k, v, beta, g, s0, offs):
    # A differentiated call activates a raw gate / beta logits in XLA and its kernels read the
    # activated values, forward and backward: the program of the same call with the activations
    # outside. (A primal call's kernels activate them on load, with no XLA pass: H200, GDN B4
    # T4096 H16 D128 bf16, GPU time 379 against 380 us. Recomputing them for the backward cost
    # more than keeping them: on load in the spill-bound K4q / K4w 538 / 402 us against
    # 525 / 385; stored by K1b, K1b 100 against 92 us; an XLA pass in the backward, fwd+bwd
    # 1.587 against 1.574 ms.)
    (beta_act, g_act), act_vjp = jax.vjp(functools.partial(_activations, st.kc), beta, g)
    o, sT, res = _forward(_without_activations(st), q, k, v, beta_act, g_act, s0, offs, save=True)
    # Named so that a remat policy can keep them instead of rerunning the forward kernels in the
    # backward (see support.name_residuals).
    res = support.name_residuals(res)
    return (o, sT), (q, k, v, beta_act, g_act, act_vjp, s0, offs, res)


def _core_bwd(st, saved, cts):
    q, k, v, beta, g, act_vjp, s0, offs, res = saved
    do, dsT = cts
    dsT = dsT.astype(F32) if st.kc.has_dsT else None
    dq, dk, dv, dbeta, dg, ds0 = _backward(_without_activations(st), q, k, v, beta, g, s0, offs,
                                           res, do.astype(v.dtype), dsT)
    dbeta, dg = act_vjp((dbeta, dg))
    return dq, dk, dv, dbeta, dg, ds0, None


core.defvjp(_core_fwd, _core_bwd)
