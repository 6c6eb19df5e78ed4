"""Backward kernel bodies of the GPU (Pallas, Triton lowering) exact chunked delta family.

Labels as in the table of `gpu.py` (math in `gpu_math.py`):
  K3   state_bwd_kernel          sequential reverse pass: dS per chunk (dh), dU, dS0, P^T dO inside
       state_bwd_lean_kernel     the same with dU_local from K3a (split_state_bwd)
  K3a  du_local_kernel           parallel over chunks and V blocks: dU_local = P^T dO
  K4   intra_bwd_kernel          parallel over chunks: dq, dk, dv, dbeta, dg (KDA: dense part)
  K4q  intra_bwd_qk_kernel       no / scalar gate, split_intra_bwd: parallel over chunks and
                                 pieces of K: dq, dk's P and state terms, dW = -dU S^T
  K4w  intra_bwd_wy_kernel       then parallel over chunks: dv, dbeta, dk, dg (the W / U0 side)
  K4d  channel_diag_bwd_kernel   KDA: diagonal 16x16 blocks' pair terms, one token a program
  K4b  intra_bwd_channel_kernel  KDA: off-diagonal pair terms and the gate's reverse sum
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from atlas_jax.kernels.delta_family.gpu_math import (
    F32, KernelCfg, SUB, chunk_cumulative_gate, chunk_gates, chunk_p, chunk_range,
    exact_masked_sum, exp, gated_chunk, iota, k_piece, l2n, l2n_vjp, load_dot, load_f32,
    load_qk, mm, mm_nt, mm_tn, p_from_qk, pair_exponent, pair_factors, qk_operand, qk_piece,
    rev_cumsum_rows, rev_cumsum_vec, row, scalar_chunk_gates, seg_matrix, suffix_rows,
    token_rows)


# ---------------------------------------------------------------------------------------------
# K3, K3a: the reverse state pass and the parallel dU_local




def _reverse_state_pass(r, cfg: KernelCfg, nt_static: int, du_local):
    """The reverse recurrence of both K3 forms, chunks last to first: stores dh = dS (the
    gradient of the state at the chunk's end) and dU = dU_local + (exp(G_C - G) k) dS, then
    dS <- exp(G_C) dS + (Gam q)^T dO - W^T dU. Gates go on the smaller side where they can:
    the scalar gate scales the rows of k dS and of dO ([C, BV]) instead of k and q ([C, K]),
    the query scale goes on dO, and q, k, W are loaded as stored (`load_dot`); the channel
    gate's Gam q and exp(G_C - G) k come from K1b (cfg.pre_gates) or are formed here.
    `du_local(sl, n, do, q, k, G)` gives one chunk's P^T dO (q, k as dot operands, None for
    the channel gate; G the scalar gate's cumulative gate)."""
    C, K, BV, low = cfg.C, cfg.K, cfg.block_v, cfg.low
    lo, hi = chunk_range(r, cfg, nt_static)
    ds = load_f32(r["dsT"], (slice(None), slice(None))) if cfg.has_dsT else jnp.zeros((K, BV), F32)
    all_k = slice(None)

    def body(i, ds):
        n = hi - 1 - i
        sl = pl.ds(n * C, C)
        r["dh"][n, :, :] = ds.astype(r["dh"].dtype)
        do = load_dot(r["do"], (sl, all_k), cfg)
        w = r["w"][sl, :]
        if cfg.gate == "channel":
            qg, kd, dec = gated_chunk(r, cfg, sl, n)
            du = mm(kd, ds, low) + du_local(sl, n, do, None, None, None)
            r["du"][sl, :] = du
            return dec * ds + mm_tn(qg, do, low) - mm_tn(w, du, low)
        q = qk_operand(r["q"], (sl, all_k), cfg)
        k = qk_operand(r["k"], (sl, all_k), cfg)
        if cfg.gate == "none":
            du = mm(k, ds, low) + du_local(sl, n, do, q, k, None)
            r["du"][sl, :] = du
            return ds + mm_tn(q, do.astype(F32) * cfg.scale, low) - mm_tn(w, du, low)
        G, GC = scalar_chunk_gates(r, cfg, sl, n)
        du = exp(GC - G[:, None]) * mm(k, ds, low) + du_local(sl, n, do, q, k, G)
        r["du"][sl, :] = du
        dog = do.astype(F32) * (cfg.scale * exp(G))[:, None]
        return exp(GC) * ds + mm_tn(q, dog, low) - mm_tn(w, du, low)

    ds = lax.fori_loop(0, hi - lo, body, ds)
    r["ds0"][:, :] = ds


def state_bwd_kernel(r, cfg: KernelCfg, nt_static: int):
    """K3: the reverse state pass, recomputing P and P^T dO of each chunk on the way."""
    def du_local(sl, n, do, q, k, G):
        if cfg.gate == "channel":
            return mm_tn(load_dot(r["p"], (sl, slice(None)), cfg), do, cfg.low)
        return mm_tn(p_from_qk(q, k, cfg, G), do, cfg.low)

    _reverse_state_pass(r, cfg, nt_static, du_local)


def du_local_kernel(r, cfg: KernelCfg):
    """K3a: the state-free part of dU, P^T dO, of one chunk and V block, all chunks in parallel
    (fla's dv_local). The lean reverse state pass adds (exp(G_C - G) k) dS to it."""
    all_ = (slice(None), slice(None))
    p = chunk_p(r, cfg, chunk_cumulative_gate(r, cfg))
    r["du"][:, :] = mm_tn(p, load_dot(r["do"], all_, cfg), cfg.low)


def state_bwd_lean_kernel(r, cfg: KernelCfg, nt_static: int):
    """K3, lean: three dots per chunk and no P on the sequential path; dU_local comes from K3a
    and dU is written over it (the same buffer)."""
    _reverse_state_pass(r, cfg, nt_static, lambda sl, n, do, q, k, G: r["du_local"][sl, :])


# ---------------------------------------------------------------------------------------------
# K4, K4d, K4b: intra-chunk backward (parallel over chunks)




def intra_bwd_kernel(r, cfg: KernelCfg):
    """All gradients of one chunk (scalar gate / no gate); for the channel gate, the dense part.

    The state / output side runs first, in two loops over V blocks that each carry two
    accumulators (register pressure on GPU): B1 dO S^T (-> dq) and dP = dO U^T (U = v_new
    where stored), after which dq is finished and stored (no gate / scalar gate) and dP^T q
    kept; B2 U dS'^T (-> dk3) and rowsum(S . dS'). The W / U0 side (pass A) follows, carrying
    dk only: dY = T^T dU (-> dv, dbeta), dx = T^T dW = -dY S^T accumulated per V block, dM
    (-> dbeta, dk5, dk6). The [C, C] decays are recomputed from g where needed instead of
    being kept; q, k and T are reloaded where used again. Channel gate: writes dv and the
    partial dq, dk, dg (already reverse-summed), dbeta plus dP and dM for
    `intra_bwd_channel_kernel`, which adds the pairwise sub-block terms.
    """
    C, K, V, BVB, low = cfg.C, cfg.K, cfg.V, cfg.block_v_bwd, cfg.low
    rr, cc = iota((C, C), 0), iota((C, C), 1)
    all_ = (slice(None), slice(None))
    nvb = V // BVB
    gated = cfg.gate != "none"

    def vloop(f, init):
        """Loop over V blocks: a device loop (one body, fewer live registers than unrolled)."""
        return lax.fori_loop(0, nvb, f, init)

    # Operands that only feed dots inside the V loops are loaded as stored (`load_dot`), so that
    # the loop's loads can be pipelined through shared memory.
    def u_block(vs, w):
        if cfg.has_vn:
            return load_dot(r["vn"], (slice(None), vs), cfg)
        return load_f32(r["u0"], (slice(None), vs)) - mm(w, load_f32(r["h"], (slice(None), vs)),
                                                         low)

    # B1: dO S^T, dO U^T, rowsum(S * dS').
    w = None if cfg.has_vn else r["w"][:, :]
    def b1(jv, carry):
        dq, dp = carry
        vs = pl.ds(jv * BVB, BVB)
        do = r["do"][:, vs]
        dq = dq + mm_nt(do, load_dot(r["h"], (slice(None), vs), cfg), low)
        dp = dp + mm_nt(do, u_block(vs, w), low)
        return dq, dp

    dq, dp = vloop(b1, (jnp.zeros((C, K), F32), jnp.zeros((C, C), F32)))
    dp = jnp.where(rr >= cc, dp, 0.0)

    # q and k are loaded again at each use rather than kept (registers).
    def qs_():
        q_raw = load_f32(r["q"], all_)
        return (l2n(q_raw) if cfg.normalize else q_raw) * cfg.scale

    def k_():
        return load_qk(r["k"], all_, cfg, False)

    if cfg.gate == "scalar":
        g = load_f32(r["g"], slice(None))
        _, _, gam, _, dec = chunk_gates(g, "scalar")
        seg = seg_matrix(g)
        kdec = exp(row(seg, C - 1))                           # exp(sum_{l > i} g_l)
        d_i = jnp.where(rr >= cc, exp(seg), 0.0)
        e2 = dp * (mm_nt(qs_(), k_(), low) * jnp.where(rr > cc, d_i, 0.0))
        dp = dp * d_i
        dq = dq * gam                                         # dq1
        # Pairwise terms +c / -c, then one reverse cumsum at the end.
        dG = jnp.sum(e2, axis=1) - jnp.sum(e2, axis=0) + jnp.sum(qs_() * dq, axis=1)
    elif cfg.gate == "channel":
        g = load_f32(r["g"], all_)
        _, GC, gam, _, _ = chunk_gates(g, "channel")
        dq = dq * gam                                         # dq1
        dgp = rev_cumsum_rows(qs_() * dq)                     # term 1 of dg
        r["dq_p"][:, :] = dq
        r["dp"][:, :] = dp
    if cfg.gate != "channel":
        dq = (dq + mm(dp, k_(), low)) * cfg.scale
        if cfg.normalize:
            dq = l2n_vjp(load_f32(r["q"], all_), dq)
        r["dq"][:, :] = dq.astype(r["dq"].dtype)
        dk = mm_tn(dp, qs_(), low)

    # B2: U dS'^T (-> dk3).
    def b2(jv, carry):
        dkt, t4 = carry
        vs = pl.ds(jv * BVB, BVB)
        dsp = load_dot(r["dh"], (slice(None), vs), cfg)
        dkt = dkt + mm_nt(u_block(vs, w), dsp, low)
        if gated:
            t4 = t4 + jnp.sum(load_f32(r["h"], (slice(None), vs)) * dsp.astype(F32), axis=1)
        return dkt, t4

    dkt, t4 = vloop(b2, (jnp.zeros((C, K), F32), jnp.zeros((K,), F32)))
    k = k_()
    if cfg.gate == "scalar":
        dkt = dkt * kdec[:, None]                             # dk3
        t3 = jnp.sum(k * dkt, axis=1)
        # Term 3 (segment (i, C]) as a direct exclusive prefix sum; term 4 everywhere.
        dgx = jnp.sum(jnp.where(cc < rr, t3[None, :], 0.0), axis=1) + dec * jnp.sum(t4)
    elif cfg.gate == "channel":
        dkt = dkt * exp(suffix_rows(g))                       # dk3
        dgp = dgp + exact_masked_sum(cc < rr, k * dkt) + (exp(GC) * t4)[None, :]
    dk = dkt if cfg.gate == "channel" else dk + dkt

    # Pass A.
    beta = load_f32(r["beta"], slice(None))
    def pa(jv, carry):
        dx, dmy, dbeta = carry
        vs = pl.ds(jv * BVB, BVB)
        du = load_f32(r["du"], (slice(None), vs))
        dy = mm_tn(load_dot(r["tmat"], all_, cfg), du, low)     # T^T dU
        r["dv"][:, vs] = (beta[:, None] * dy).astype(r["dv"].dtype)
        dbeta = dbeta + jnp.sum(dy * load_f32(r["v"], (slice(None), vs)), axis=1)
        dmy = dmy + mm_nt(dy, load_dot(r["u0"], (slice(None), vs), cfg), low)
        dx = dx - mm_nt(dy, load_dot(r["h"], (slice(None), vs), cfg), low)
        return dx, dmy, dbeta

    # dx = T^T dW = -T^T dU S^T, dmy = dY U0^T
    dx, dmy, dbeta = vloop(pa, (jnp.zeros((C, K), F32), jnp.zeros((C, C), F32),
                                jnp.zeros((C,), F32)))
    dm = jnp.where(rr > cc, -(mm_nt(dx, r["w"][:, :], low) + dmy), 0.0)
    k = k_()
    xg = k if cfg.gate == "none" else k * gam
    dbeta = dbeta + jnp.sum(dx * xg, axis=1)
    dk5 = beta[:, None] * (dx if cfg.gate == "none" else dx * gam)
    if cfg.gate == "channel":
        r["dm"][:, :] = dm
        r["dk_p"][:, :] = dk + dk5
        r["dg_p"][:, :] = dgp + rev_cumsum_rows(k * dk5)      # + term 5
        r["db_p"][:] = dbeta
        return
    if cfg.gate == "scalar":
        dG = dG + jnp.sum(k * dk5, axis=1)
    dk = dk + dk5
    a = mm_nt(k, k, low)
    if cfg.gate == "scalar":
        d_s = jnp.where(rr > cc, exp(seg_matrix(g)), 0.0)
        a = a * d_s
    else:
        a = jnp.where(rr > cc, a, 0.0)
    dbeta = dbeta + jnp.sum(dm * a, axis=1)
    da = beta[:, None] * dm
    if cfg.gate == "scalar":
        e6 = da * a
        dG = dG + jnp.sum(e6, axis=1) - jnp.sum(e6, axis=0)
        da = da * d_s
        r["dg"][:] = (rev_cumsum_vec(dG) + dgx).astype(r["dg"].dtype)
    k = k_()
    dk = dk + mm(da, k, low) + mm_tn(da, k, low)             # + dk6
    if cfg.normalize:
        dk = l2n_vjp(load_f32(r["k"], all_), dk)
    r["dk"][:, :] = dk.astype(r["dk"].dtype)
    r["dbeta"][:] = dbeta.astype(r["dbeta"].dtype)


def intra_bwd_qk_kernel(r, cfg: KernelCfg):
    """K4q (no / scalar gate, split_intra_bwd): the state / output side of one chunk for one
    piece of BK = block_k_bwd columns of K, grid (K / BK, NT, B, H): dq (finished), the P and
    state terms of dk, dW = -dU S^T and the piece's share of the gate gradient (already
    reverse-summed). dP = dO U^T contracts V, not K, so every piece forms it whole (as fla's
    dqkwg). Pieces are whole rows when q and k are normalised in the kernel (the norm and its
    vjp need them). U = v_new as K2 stored it.
    """
    C, BVB, low = cfg.C, cfg.block_v_bwd, cfg.low
    rr, cc = iota((C, C), 0), iota((C, C), 1)
    all_ = (slice(None), slice(None))
    scalar = cfg.gate == "scalar"
    bk = r["q"].shape[1]

    def v_loop(parts, acc):
        """One loop over V blocks carrying the accumulators of `parts`: "q" (dO S^T, dO U^T,
        dU S^T) and / or "k" (U dS'^T and, gated, rowsum(S . dS'))."""
        def body(jv, acc):
            vs = pl.ds(jv * BVB, BVB)
            acc = dict(acc)
            u = load_dot(r["vn"], (slice(None), vs), cfg)
            h = load_dot(r["h"], (slice(None), vs), cfg) if "q" in parts or scalar else None
            if "q" in parts:
                do = r["do"][:, vs]
                acc["dq"] = acc["dq"] + mm_nt(do, h, low)
                acc["dp"] = acc["dp"] + mm_nt(do, u, low)
                acc["dw"] = acc["dw"] - mm_nt(r["du"][:, vs], h, low)
            if "k" in parts:
                dh = load_dot(r["dh"], (slice(None), vs), cfg)
                acc["dkt"] = acc["dkt"] + mm_nt(u, dh, low)
                if scalar:
                    acc["t4"] = acc["t4"] + jnp.sum(h.astype(F32) * dh.astype(F32), axis=1)
            return acc

        return lax.fori_loop(0, cfg.V // BVB, body, acc)

    zero = jnp.zeros((C, bk), F32)
    acc_q = dict(dq=zero, dp=jnp.zeros((C, C), F32), dw=zero)
    acc_k = dict(dkt=zero, t4=jnp.zeros((bk,), F32)) if scalar else dict(dkt=zero)
    # The scalar gate's [C, C] decays leave no room for U dS'^T's accumulator beside them (255
    # registers and 256 MB of spills at B4 T4096 H16 D128, 4 warps, H200): a second V loop.
    acc = v_loop("q", acc_q) if scalar else v_loop("qk", {**acc_q, **acc_k})
    r["dw"][:, :] = acc["dw"].astype(r["dw"].dtype)
    dq, dp = acc["dq"], jnp.where(rr >= cc, acc["dp"], 0.0)
    q_raw = load_f32(r["q"], all_)
    qs = (l2n(q_raw) if cfg.normalize else q_raw) * cfg.scale
    k = load_qk(r["k"], all_, cfg, False)
    if scalar:
        g = load_f32(r["g"], slice(None))
        _, _, gam, _, dec = chunk_gates(g, "scalar")
        d_i = jnp.where(rr >= cc, exp(seg_matrix(g)), 0.0)
        e2 = dp * (mm_nt(qs, k, low) * jnp.where(rr > cc, d_i, 0.0))
        dp = dp * d_i
        dq = dq * gam                                         # dq1
        dG = jnp.sum(e2, axis=1) - jnp.sum(e2, axis=0) + jnp.sum(qs * dq, axis=1)
    dq = (dq + mm(dp, k, low)) * cfg.scale
    if cfg.normalize:
        dq = l2n_vjp(q_raw, dq)
    r["dq"][:, :] = dq.astype(r["dq"].dtype)
    dk = mm_tn(dp, qs, low)
    if scalar:
        acc = v_loop("k", acc_k)
        # dk3: exp(sum_{l > i} g_l), a direct segment sum
        dkt = acc["dkt"] * exp(jnp.sum(jnp.where(cc > rr, g[None, :], 0.0), axis=1))[:, None]
        t3 = jnp.sum(k * dkt, axis=1)
        # term 3 as a direct exclusive prefix sum, term 4 everywhere, this piece's terms 1-2
        r["dg_p"][:] = (rev_cumsum_vec(dG) + jnp.sum(jnp.where(cc < rr, t3[None, :], 0.0), axis=1)
                        + dec * jnp.sum(acc["t4"]))
    else:
        dkt = acc["dkt"]
    r["dk_p"][:, :] = (dk + dkt).astype(r["dk_p"].dtype)


def intra_bwd_wy_kernel(r, cfg: KernelCfg, k_pieces: int):
    """K4w (no / scalar gate, split_intra_bwd): the W / U0 side of one chunk, grid (NT, B, H),
    from K4q's dW and partial dk: dY = T^T dU (-> dv, dbeta) and dY U0^T over V blocks; then
    over the same `k_pieces` pieces of K as K4q, dx = T^T dW (-> dM, dbeta, dk5) and A = k k^T;
    then dA (-> dbeta, the gate's terms 5-6) and, over the pieces again, dk = K4q's part + dk5
    + dk6 (dx formed again rather than kept: a [C, K] float32 tile less in registers). Adds
    K4q's gate shares and stores dk, dbeta, dg."""
    C, BVB, low = cfg.C, cfg.block_v_bwd, cfg.low
    bk = cfg.K // k_pieces
    rr, cc = iota((C, C), 0), iota((C, C), 1)
    all_ = (slice(None), slice(None))
    scalar = cfg.gate == "scalar"
    beta = load_f32(r["beta"], slice(None))

    def pa(jv, carry):
        dmy, dbeta = carry
        vs = pl.ds(jv * BVB, BVB)
        dy = mm_tn(load_dot(r["tmat"], all_, cfg), load_f32(r["du"], (slice(None), vs)), low)
        r["dv"][:, vs] = (beta[:, None] * dy).astype(r["dv"].dtype)
        dbeta = dbeta + jnp.sum(dy * load_f32(r["v"], (slice(None), vs)), axis=1)
        dmy = dmy + mm_nt(dy, load_dot(r["u0"], (slice(None), vs), cfg), low)
        return dmy, dbeta

    dmy, dbeta = lax.fori_loop(0, cfg.V // BVB, pa, (jnp.zeros((C, C), F32),
                                                     jnp.zeros((C,), F32)))
    if scalar:
        g = load_f32(r["g"], slice(None))
        gam = chunk_gates(g, "scalar")[2]

    def piece_dx(p):
        """(this piece's columns, T^T dW on them, k on them)."""
        ks = pl.ds(p * bk, bk)
        dx = mm_tn(load_dot(r["tmat"], all_, cfg), load_dot(r["dw"], (slice(None), ks), cfg), low)
        return ks, dx, load_qk(r["k"], (slice(None), ks), cfg, False)

    def dm_and_a(p, carry):
        dxw, a, dbeta, dG = carry
        ks, dx, k = piece_dx(p)
        dxw = dxw + mm_nt(dx, r["w"][:, ks], low)
        a = a + mm_nt(k, k, low)
        xk = jnp.sum((dx * gam if scalar else dx) * k, axis=1)
        return dxw, a, dbeta + xk, dG + beta * xk                 # dG: k . dk5

    zc = jnp.zeros((C, C), F32)
    dxw, a, dbeta, dG = lax.fori_loop(0, k_pieces, dm_and_a, (zc, zc, dbeta,
                                                                jnp.zeros((C,), F32)))
    dm = jnp.where(rr > cc, -(dxw + dmy), 0.0)
    if scalar:
        d_s = jnp.where(rr > cc, exp(seg_matrix(g)), 0.0)
        a = a * d_s
    else:
        a = jnp.where(rr > cc, a, 0.0)
    dbeta = dbeta + jnp.sum(dm * a, axis=1)
    r["dbeta"][:] = dbeta.astype(r["dbeta"].dtype)
    da = beta[:, None] * dm
    if scalar:
        e6 = da * a
        dG = dG + jnp.sum(e6, axis=1) - jnp.sum(e6, axis=0)
        da = da * d_s
        dg = rev_cumsum_vec(dG)
        for p in range(k_pieces):
            dg = dg + load_f32(r["dg_p"], (p, slice(None)))
        r["dg"][:] = dg.astype(r["dg"].dtype)

    def dk_piece(p, _):
        ks, dx, k = piece_dx(p)
        dk5 = beta[:, None] * (dx * gam if scalar else dx)
        dk = (load_f32(r["dk_p"], (slice(None), ks)) + dk5
              + mm(da, k, low) + mm_tn(da, k, low))                     # + dk5 + dk6
        if cfg.normalize:
            dk = l2n_vjp(load_f32(r["k"], all_), dk)
        r["dk"][:, ks] = dk.astype(r["dk"].dtype)
        return 0

    lax.fori_loop(0, k_pieces, dk_piece, 0)


def channel_diag_bwd_kernel(r, cfg: KernelCfg):
    """K4d (channel gate): the exact pairwise terms of the diagonal 16x16 blocks of A and P for
    one token and BH heads, grid (tokens, H / BH, B), added in place to K4's dense dq, dk and
    dbeta; the token's share of the gate gradient goes to `dgd` (K4b adds it to its block's
    before the block's reverse sum).

    Token i is the later end of the pairs (i, j < i) (a walk down from the diagonal, as in
    K1d: dq_i, the A part of dk_i and dbeta_i, with dG_i += q_i dq_i + k_i dk_i) and the earlier
    end of the pairs (l > i, i) (a walk up: dk_i += sum_l exp(seg_li) (dP_li q_l + beta_l dM_li
    k_l), with dG_i -= k_i times it). The diagonal of P (an empty segment) gives dq_i and dk_i
    their dP_ii terms and nothing to the gate.
    """
    i = pl.program_id(0) % SUB
    q_, k_, g_ = token_rows(r, cfg)
    qi, ki = q_(i), k_(i)         # [BH, K], or [1, K] shared by a group of BH value heads
    nh = r["dq"].shape[0]
    cols = iota((nh, SUB), 1)

    def at(x, j):
        return jnp.sum(jnp.where(cols == j, x, 0.0), axis=1)

    def beta_(j):
        return load_f32(r["beta"], (j, slice(None)))

    dprow, dmrow = load_f32(r["dp_d"], (i, slice(None), slice(None))), load_f32(
        r["dm_d"], (i, slice(None), slice(None)))
    bi = beta_(i)

    def later_end(t, carry):
        seg, dq, dk, db = carry
        j = i - 1 - t
        seg = seg + g_(j + 1)
        kg = k_(j) * exp(seg)
        dmj = at(dmrow, j)
        dq = dq + at(dprow, j)[:, None] * kg
        dk = dk + (bi * dmj)[:, None] * kg
        db = db + dmj * jnp.sum(ki * kg, axis=1)
        return seg, dq, dk, db

    zero = jnp.zeros((nh, ki.shape[1]), F32)
    _, dq, dk, db = lax.fori_loop(0, i, later_end, (zero, zero, zero, jnp.zeros_like(bi)))

    def earlier_end(t, carry):
        seg, dkc = carry
        l = i + 1 + t
        seg = seg + g_(l)
        dpl = at(load_f32(r["dp_d"], (l, slice(None), slice(None))), i)
        dal = beta_(l) * at(load_f32(r["dm_d"], (l, slice(None), slice(None))), i)
        return seg, dkc + exp(seg) * (dpl[:, None] * q_(l) + dal[:, None] * k_(l))

    _, dkc = lax.fori_loop(0, SUB - 1 - i, earlier_end, (zero, zero))
    dpd = at(dprow, i)[:, None]
    r["dgd"][...] = qi * dq + ki * (dk - dkc)
    r["dq"][...] = load_f32(r["dq_in"], (slice(None), slice(None))) + dq + dpd * ki
    r["dk"][...] = load_f32(r["dk_in"], (slice(None), slice(None))) + dk + dkc + dpd * qi
    r["db"][...] = load_f32(r["db_in"], slice(None)) + db


def intra_bwd_channel_kernel(r, cfg: KernelCfg):
    """K4b (channel gate): the off-diagonal pairwise terms of A and P by 16-row blocks, then
    dq, dk, dg and dbeta of the chunk, added to K4's dense parts and K4d's diagonal ones.

    A loop over pieces of block_k_pairs columns of K (as K1p); in each, one block b at a time,
    last to first: the pairs (b, j < b) give the row (later end) terms, the pairs (i > b, b)
    the column (earlier end) terms, with the factors of `pair_factors`. dbeta is linear in A,
    so each piece adds its share. dG_b starts from K4d's per-token diagonal-block part (dgd);
    dg_b = reverse cumsum of dG_b within the block + the later blocks' pairwise dG totals
    (carried) + the dense part in dg_p.
    """
    nb, low, bk = cfg.C // SUB, cfg.low, k_piece(cfg, cfg.block_k_pairs)

    def pair(name, i, j):
        return load_f32(r[name], (pl.ds(i * SUB, SUB), pl.ds(j * SUB, SUB)))

    betas = [load_f32(r["beta"], pl.ds(b * SUB, SUB))[:, None] for b in range(nb)]

    def piece(p, dbs):
        kp = pl.ds(p * bk, bk)
        k = [qk_piece(r, "k", b, kp, cfg) for b in range(nb)]
        q = [qk_piece(r, "q", b, kp, cfg) for b in range(nb)]
        facs = [pair_factors(load_f32(r["g"], (pl.ds(b * SUB, SUB), kp))) for b in range(nb)]
        # earlier-end factors exp(suffix_j), once per block; each pair adds a [BK] row exp
        esuf = [exp(facs[b][1]) for b in range(nb - 1)]
        dbs = list(dbs)
        later = None        # sum over the blocks after b of their pairwise dG rows
        for b in range(nb - 1, -1, -1):
            sb = (pl.ds(b * SUB, SUB), kp)
            dq = load_f32(r["dq_p"], sb)
            dk = load_f32(r["dk_p"], sb)
            dG = load_f32(r["dgd"], sb)
            fb = facs[b][0]
            for j in range(b):                               # row side: pairs (b, j)
                bj = k[j] * esuf[j] * exp(pair_exponent(facs, b, j))
                dm = pair("dm", b, j)
                dbs[b] = dbs[b] + jnp.sum(dm * mm_nt(k[b] * fb, bj, low), axis=1)
                dqi = mm(pair("dp", b, j), bj, low) * fb
                dki = mm(betas[b] * dm, bj, low) * fb
                dq = dq + dqi
                dk = dk + dki
                dG = dG + q[b] * dqi + k[b] * dki
            for i in range(b + 1, nb):                       # column side: pairs (i, b)
                fy = esuf[b] * exp(pair_exponent(facs, i, b))
                fi = facs[i][0]
                dkj = (mm_tn(pair("dp", i, b), q[i] * fi, low)
                       + mm_tn(betas[i] * pair("dm", i, b), k[i] * fi, low)) * fy
                dk = dk + dkj
                dG = dG - k[b] * dkj
            dg = rev_cumsum_rows(dG) + load_f32(r["dg_p"], sb)
            if later is not None:
                dg = dg + later[None, :]
            tot = jnp.sum(dG, axis=0)
            later = tot if later is None else later + tot
            dq = dq * cfg.scale
            if cfg.normalize:                                # one piece: whole rows
                dq = l2n_vjp(load_f32(r["q"], sb), dq)
                dk = l2n_vjp(load_f32(r["k"], sb), dk)
            r["dq"][sb] = dq.astype(r["dq"].dtype)
            r["dk"][sb] = dk.astype(r["dk"].dtype)
            r["dg"][sb] = dg.astype(r["dg"].dtype)
        return tuple(dbs)

    dbs = lax.fori_loop(0, cfg.K // bk, piece,
                        tuple(load_f32(r["db_p"], pl.ds(b * SUB, SUB)) for b in range(nb)))
    for b in range(nb):
        r["dbeta"][pl.ds(b * SUB, SUB)] = dbs[b].astype(r["dbeta"].dtype)
