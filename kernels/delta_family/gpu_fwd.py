"""Forward kernel bodies of the GPU (Pallas, Triton lowering) exact chunked delta family.

Labels as in the table of `gpu.py` (C = chunk size; math in `gpu_math.py`):
  K1   intra_fwd_kernel(part="all")    one kernel: T = (I + M)^-1, W, U0 (+ P for KDA)
  K1a  intra_fwd_kernel(part="solve")  the blocked inverse T (forming A itself for no / scalar
                                       gate; from K1d + K1p's M for the channel gate)
  K1b  intra_fwd_kernel(part="wu")     W = T X, U0 = T Y (+ the state passes' gate operands)
  K1d  channel_diag_fwd_kernel         KDA: diagonal 16x16 blocks of M and P, one token a program
  K1p  channel_pairs_kernel            KDA: the off-diagonal blocks of M and P (+ T if fused)
  K2   state_fwd_lean_kernel           sequential: h per chunk, v_new, final state
       state_fwd_kernel                sequential, fused_output: also O
  K2o  output_kernel                   parallel over chunks: O = (Gam q) h + P v_new
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from atlas_jax.kernels.delta_family.gpu_math import (
    BF16, F32, KernelCfg, SUB, block_rows, channel_factors, chunk_cumulative_gate, chunk_gates,
    chunk_p, chunk_range, diag_pairs, exp, gate_blocks, gated_chunk, inv_unit_lower_multi,
    inv_unit_lower_products, iota, k_piece, load_beta, load_dot, load_f32, load_gate, load_qk,
    mm, mm_nt, mm_tn, pair_factors, qk_operand, qk_piece, scalar_chunk_gates, scalar_decay,
    token_rows)


# ---------------------------------------------------------------------------------------------
# K1: intra-chunk forward (parallel over chunks): T, W, U0 (and P for the channel gate)




def barrier(cfg):
    """All threads of the program reach this point (and see each other's stores) before any goes
    on; used where a kernel re-reads, in other sub-blocks, what it wrote to its own output
    block. Interpret mode runs a program sequentially (and has no lowering for it)."""
    if not cfg.interpret:
        plgpu.debug_barrier()


def intra_fwd_kernel(r, cfg: KernelCfg, store_t: bool, part: str = "all"):
    """K1 (part "all"), or its two halves as separate kernels (part "solve": T into the tmat
    output, from M = diag(beta) A in the "m" input for the channel gate (K1d, K1p), else
    forming A itself; part "wu": W, U0 from the stored T as whole-chunk dots). Two layouts of
    the whole / solve kernel (cfg.wide):

    sub-blocks: A, W and U0 as 16-row sub-block dots (the tile the blocked inverse works in).
    wide:       A = K K^T as one [C, C] dot (no gate / scalar gate; the channel gate keeps its
                factored sub-blocks), masked, scaled by beta and stored in a float32 buffer
                (the split solve's "ascr" scratch, else the T output), whose 16x16 blocks the
                inverse reads back; the inverse's blocks go to the T output and W = T X,
                U0 = T Y are [C, C] x [C, K / V] dots (Hopper wgmma tiles instead of 16-row
                mma.sync ones). Barriers order the round trips.
    The 16x16 merges of the inverse use `merge_dots` bf16 dots per product for bf16 inputs
    (3: hi/lo splits, ~2^-16 relative; 6: float32-exact); float32 inputs always use 6.
    """
    if part == "wu":
        wu_from_t(r, cfg)
        return
    C, low = cfg.C, cfg.low
    nb = C // SUB
    all_ = (slice(None), slice(None))
    wide_a = cfg.wide and cfg.gate != "channel"
    bs = [load_beta(r, cfg, pl.ds(b * SUB, SUB)) for b in range(nb)]

    P = {}
    # The channel gate's split solve finds M = diag(beta) A in the "m" buffer (from K1d, K1p).
    m_given = part == "solve" and cfg.gate == "channel"
    if part == "solve" and cfg.block_kkt and not m_given:
        A = kkt_blocks(r, cfg)
        M = {key: bs[key[0]][:, None] * a for key, a in A.items()}
    elif wide_a or m_given:
        src = r["m"] if m_given else None
        if wide_a:
            k = load_qk(r["k"], all_, cfg, False)
            a = mm_nt(k, k, low)
            if cfg.gate == "scalar":
                a = a * scalar_decay(jnp.cumsum(load_gate(r, cfg, slice(None))), False)
            else:
                a = jnp.where(iota((C, C), 0) > iota((C, C), 1), a, 0.0)
            # The split solve has a float32 scratch buffer (its T output may be bf16); the
            # one-kernel K1 uses its float32 T buffer.
            src = r["ascr"] if "ascr" in r else r["tmat"]
            src[:, :] = load_beta(r, cfg, slice(None))[:, None] * a
            barrier(cfg)
        M = {(i, j): load_f32(src, (pl.ds(i * SUB, SUB), pl.ds(j * SUB, SUB)))
             for i in range(nb) for j in range(i + 1)}
        if src is r["tmat"]:
            barrier(cfg)      # every block is read before the inverse overwrites the buffer
    else:
        ks, qs = [], []
        for b in range(nb):
            sl = pl.ds(b * SUB, SUB)
            ks.append(load_qk(r["k"], (sl, slice(None)), cfg, False))
            if cfg.gate == "channel":
                qs.append(load_qk(r["q"], (sl, slice(None)), cfg, True))
        gs, Gs = gate_blocks(r, cfg, nb) if cfg.gate != "none" else (None, None)
        if cfg.gate == "channel":
            fx, fy = channel_factors(gs)

        # Strictly lower blocks of A (and of P for the channel gate).
        A = {}
        for i in range(nb):
            if cfg.gate == "channel":
                ai, aq = ks[i] * fx[i], qs[i] * fx[i]
            for j in range(i + 1):
                if cfg.gate == "channel":
                    if j < i:
                        bj = ks[j] * fy(i, j)
                        A[i, j] = mm_nt(ai, bj, low)
                        P[i, j] = mm_nt(aq, bj, low)
                    else:
                        A[i, i], P[i, i] = diag_pairs(
                            *block_rows(r, cfg, i), SUB, cfg.K,
                            fwd=((ks[i], True), (qs[i], False)))
                else:
                    A[i, j] = gated_kkt_block(mm_nt(ks[i], ks[j], low), i, j, Gs)
        M = {key: bs[key[0]][:, None] * a for key, a in A.items()}

    T = blocked_inverse(M, nb, cfg)

    def store_blocks(name, blocks):
        store_lower_blocks(r, name, blocks, nb)

    if P:
        store_blocks("p", P)

    # W = T (beta Gam k), U0 = T (beta v).
    if part == "solve":
        store_blocks("tmat", T)
        return
    if cfg.wide:
        store_blocks("tmat", T)
        barrier(cfg)
        wu_from_t(r, cfg)
        return

    xs = []
    for j in range(nb):
        x = bs[j][:, None] * ks[j]
        if cfg.gate == "scalar":
            x = x * exp(Gs[j])[:, None]
        elif cfg.gate == "channel":
            x = x * exp(Gs[j])
        xs.append(x)
    for i in range(nb):
        w = mm(T[i, 0], xs[0], low)
        for j in range(1, i + 1):
            w = w + mm(T[i, j], xs[j], low)
        r["w"][pl.ds(i * SUB, SUB), :] = w.astype(r["w"].dtype)

    # U0 in pieces of block_wu columns of V: a [16, V] row block of v never lives whole in
    # registers (V up to 512).
    bv = min(cfg.block_wu, cfg.V)

    def u_piece(p, carry):
        cs = pl.ds(p * bv, bv)
        ys = [bs[j][:, None] * load_f32(r["v"], (pl.ds(j * SUB, SUB), cs)) for j in range(nb)]
        for i in range(nb):
            u = mm(T[i, 0], ys[0], low)
            for j in range(1, i + 1):
                u = u + mm(T[i, j], ys[j], low)
            r["u0"][pl.ds(i * SUB, SUB), cs] = u.astype(r["u0"].dtype)
        return carry

    lax.fori_loop(0, cfg.V // bv, u_piece, 0)
    if store_t:
        store_blocks("tmat", T)


def kkt_blocks(r, cfg: KernelCfg):
    """The 16x16 blocks (i >= j) of the strictly lower A = K K^T of one chunk (no gate), or of
    A_ij = k_i . k_j exp(G_i - G_j) (scalar gate), accumulated in registers over pieces of
    block_kkt columns of K, as fla's fused kkt + solve kernel: only one piece of k is live, and
    A makes no round trip through memory (the wide layout's scratch buffer and barriers)."""
    nb, low = cfg.C // SUB, cfg.low
    bk = k_piece(cfg, cfg.block_kkt)
    pairs = [(i, j) for i in range(nb) for j in range(i + 1)]

    def piece(p, acc):
        kp = pl.ds(p * bk, bk)
        ks = [qk_operand(r["k"], (pl.ds(b * SUB, SUB), kp), cfg) for b in range(nb)]
        return tuple(a + mm_nt(ks[i], ks[j], low) for a, (i, j) in zip(acc, pairs))

    zero = jnp.zeros((SUB, SUB), F32)
    acc = lax.fori_loop(0, cfg.K // bk, piece, tuple(zero for _ in pairs))
    Gs = gate_blocks(r, cfg, nb)[1] if cfg.gate == "scalar" else None
    return {key: gated_kkt_block(a, *key, Gs) for key, a in zip(pairs, acc)}


def gated_kkt_block(a, i, j, Gs):
    """Block (i, j) (j <= i) of k k^T made A's block: times exp(G_i - G_j) for the scalar gate (Gs:
    per-block cumulative gates, else None; <= 0 below the diagonal, masked before the exp on
    a diagonal block) and strictly lower on the diagonal."""
    strict = iota((SUB, SUB), 0) > iota((SUB, SUB), 1)
    if Gs is not None:
        d = Gs[i][:, None] - Gs[j][None, :]
        a = a * exp(jnp.where(strict, d, 0.0) if i == j else d)
    return jnp.where(strict, a, 0.0) if i == j else a


def blocked_inverse(M, nb, cfg):
    """T = (I + M)^-1 for the unit lower-triangular chunk matrix given as 16x16 blocks M[i, j]
    (j <= i, float32): the diagonal blocks by forward substitution (one interleaved loop) or,
    for bf16 inputs with cfg.diag_products, Neumann products; then block merges with
    `merge_dots` bf16 dots per product for bf16 inputs (float32 inputs: float32-exact)."""
    low = cfg.low
    merge = cfg.merge_dots if cfg.merge_dots in (1, 3) else True
    diag = [M[i, i] for i in range(nb)]
    if cfg.diag_products and low:
        diag = [inv_unit_lower_products(d) for d in diag]
    else:
        diag = inv_unit_lower_multi(diag)
    T = {(i, i): d for i, d in enumerate(diag)}
    for i in range(nb):
        for j in range(i - 1, -1, -1):
            acc = mm(M[i, j], T[j, j], low, exact=merge)
            for l in range(j + 1, i):
                acc = acc + mm(M[i, l], T[l, j], low, exact=merge)
            T[i, j] = -mm(T[i, i], acc, low, exact=merge)
    return T


def store_lower_blocks(r, name, blocks, nb):
    """Writes 16x16 blocks (i, j <= i) of a [C, C] chunk matrix and zeros above them."""
    for i in range(nb):
        for j in range(nb):
            blk = blocks[i, j] if j <= i else jnp.zeros((SUB, SUB), F32)
            r[name][pl.ds(i * SUB, SUB), pl.ds(j * SUB, SUB)] = blk.astype(r[name].dtype)


def wu_from_t(r, cfg: KernelCfg):
    """W = T (beta Gam k), U0 = T (beta v), T read back from the tmat buffer (written by this
    program behind a barrier, or by the solve kernel). With cfg.pre_gates also the state passes'
    gate operands, so that no cumsum (nor, for the channel gate, a [C, K] exp) runs on their
    sequential paths: the scalar gate's chunk-local cumulative gate G; the channel gate's Gam q,
    exp(G_C - G) k and exp(G_C). Whole-chunk [C, C] x [C, K / V] dots, in column pieces where
    the operands allow (`_wu_columns`, `_wu_channel_pieces`)."""
    if cfg.gate == "channel":
        _wu_channel_pieces(r, cfg)
        return
    if not cfg.normalize:
        _wu_columns(r, cfg)
        return
    all_ = (slice(None), slice(None))
    t = load_dot(r["tmat"], all_, cfg)
    beta = load_beta(r, cfg, slice(None))[:, None]
    x = beta * load_qk(r["k"], all_, cfg, False)
    if cfg.gate == "scalar":
        G = jnp.cumsum(load_gate(r, cfg, slice(None)))
        x = x * exp(G)[:, None]
        if cfg.pre_gates:
            r["gcum"][:] = G
    r["w"][:, :] = mm(t, x, cfg.low).astype(r["w"].dtype)
    # U0 in pieces of block_wu columns of V (the normalisation needs whole rows of k, not of v).
    bv = min(cfg.block_wu, cfg.V)

    def u_piece(i, carry):
        cs = (slice(None), pl.ds(i * bv, bv))
        r["u0"][cs] = mm(t, beta * load_f32(r["v"], cs), cfg.low).astype(r["u0"].dtype)
        return carry

    lax.fori_loop(0, cfg.V // bv, u_piece, 0)


def _wu_channel_pieces(r, cfg: KernelCfg):
    """The channel gate's K1b in pieces of `k_piece` columns of K (and of V for U0), as fla's
    W / U kernel loops: the gate's cumsum runs down each column, so every piece is independent
    (its cumulative gate, Gam k, Gam q, exp(G_C - G) k, exp(G_C) and W's columns), and the
    pipeliner overlaps the next piece's loads with this one's dot."""
    t = load_dot(r["tmat"], (slice(None), slice(None)), cfg)
    beta = load_f32(r["beta"], slice(None))[:, None]
    bw = k_piece(cfg, cfg.block_wu_channel)

    def w_piece(i, carry):
        cs = (slice(None), pl.ds(i * bw, bw))
        _, GC, gam, kdec, _ = chunk_gates(load_f32(r["g"], cs), "channel")
        k = load_qk(r["k"], cs, cfg, False)
        if cfg.pre_gates:
            r["qg"][cs] = (load_qk(r["q"], cs, cfg, True) * gam).astype(r["qg"].dtype)
            r["kg"][cs] = (k * kdec).astype(r["kg"].dtype)
            r["gend"][pl.ds(i * bw, bw)] = exp(GC)
        r["w"][cs] = mm(t, beta * k * gam, cfg.low).astype(r["w"].dtype)
        return carry

    bv = min(bw, cfg.V)

    def u_piece(i, carry):
        cs = (slice(None), pl.ds(i * bv, bv))
        r["u0"][cs] = mm(t, beta * load_f32(r["v"], cs), cfg.low).astype(r["u0"].dtype)
        return carry

    lax.fori_loop(0, cfg.K // bw, w_piece, 0)
    lax.fori_loop(0, cfg.V // bv, u_piece, 0)


def _wu_columns(r, cfg: KernelCfg):
    """W = (T diag(beta exp(G))) k and U0 = (T diag(beta)) v (no gate or the scalar gate, q/k
    not normalised in the kernel): the per-token factors scale T's columns once, so that k and
    v are dot operands as stored, in pieces of block_wu columns as fla's W / U kernel (a loop
    the pipeliner can overlap with the next piece's loads)."""
    all_ = (slice(None), slice(None))
    t = load_f32(r["tmat"], all_)
    beta = load_beta(r, cfg, slice(None))
    tu = t * beta[None, :]
    tw = tu
    if cfg.gate == "scalar":
        G = jnp.cumsum(load_gate(r, cfg, slice(None)))
        tw = tu * exp(G)[None, :]
        if cfg.pre_gates:
            r["gcum"][:] = G
    if cfg.low:                       # the dots round them to bf16 anyway: once, here
        tw, tu = tw.astype(BF16), tu.astype(BF16)

    def pieces(out, src, tm, width):
        bw = min(cfg.block_wu, width)

        def body(i, carry):
            cs = (slice(None), pl.ds(i * bw, bw))
            r[out][cs] = mm(tm, load_dot(r[src], cs, cfg), cfg.low).astype(r[out].dtype)
            return carry

        lax.fori_loop(0, width // bw, body, 0)

    pieces("w", "k", tw, cfg.K)
    pieces("u0", "v", tu, cfg.V)


def channel_diag_fwd_kernel(r, cfg: KernelCfg):
    """K1d (channel gate): one token's row of the diagonal 16x16 blocks of M = diag(beta) A and
    of P for BH heads, grid (tokens, H / BH, B), as fla's token-parallel intra kernel.

    Row i of a diagonal block holds i + 1 pairs (j <= i); the program walks j = i - 1 down to
    the block's first row with the segment sum seg = sum_{j < l <= i} g_l grown one gate at a
    time from the diagonal outward (a direct segment sum, every exponent <= 0). Every operand
    is a [BH, K] row loaded in one layout and each pair's value a reduction over K, stored to
    its column. The one-program-per-block form this replaces ran 16 column steps on [16, K]
    tiles, each converting a row and a column between layouts (H100, B4 T4096 H16 D128:
    1.21 ms).
    """
    i = pl.program_id(0) % SUB
    q_, k_, g_ = token_rows(r, cfg)
    qi, ki = q_(i), k_(i)         # [BH, K], or [1, K] shared by a group of BH value heads
    nh = r["m"].shape[0]
    cols = iota((nh, SUB), 1)
    beta_i = load_f32(r["beta"], (i, slice(None)))
    # Each pair's value goes straight to its column (as fla's kernel stores it) rather than
    # into a [BH, 16] tile, which broadcast every reduced row across a layout change per step
    # (H100, B1 T16384 H16 D128 bf16: 0.34 -> 0.29 ms). The columns no pair reaches (M: j >= i;
    # P: j > i, and P's diagonal) are written first, by a store masked to them.
    on_or_after = cols >= i
    p_ii = jnp.where(cols == i, jnp.sum(qi * ki, axis=1)[:, None], 0.0)     # empty segment
    plgpu.store(r["m"], jnp.zeros_like(p_ii), mask=on_or_after)
    plgpu.store(r["p"], p_ii.astype(r["p"].dtype), mask=on_or_after)

    def body(t, seg):
        j = i - 1 - t
        seg = seg + g_(j + 1)
        kg = k_(j) * exp(seg)
        r["m"][:, pl.ds(j, 1)] = (beta_i * jnp.sum(ki * kg, axis=1))[:, None]
        r["p"][:, pl.ds(j, 1)] = jnp.sum(qi * kg, axis=1)[:, None].astype(r["p"].dtype)
        return seg

    lax.fori_loop(0, i, body, jnp.zeros((nh, ki.shape[1]), F32))


def channel_pairs_kernel(r, cfg: KernelCfg):
    """K1p (channel gate, split K1): the strictly lower off-diagonal blocks of M = diag(beta) A
    into the float32 m buffer and of P into p (zeros above the diagonal), written around K1d's
    diagonal blocks (both buffers are aliased in and out); with cfg.fuse_solve the inverse T
    of the whole chunk into the tmat output instead (M is then only read; no solve kernel).

    As fla's inter-block kernel: a loop over pieces of block_k_pairs columns of K, each adding
    its share of every block pair to [16, 16] accumulators (12 at C = 64), so that only one
    piece's operands are live. Off-diagonal pairs (i > j) are factored through block i's first
    row r: exp(seg_ij) = exp(sum_{r < l <= i} g_l) exp(sum_{j < l <= r} g_l), both <= 1
    (`pair_factors`); the second factor splits again into block j's in-block suffix and a row
    of the gates between the blocks, so each block takes two [16, BK] exps (its later-end and
    earlier-end factors) and each pair only a [BK] one. Blocks go in order, each pairing with
    the earlier ones, so only those blocks' decayed k stay live.
    """
    nb, low, bk = cfg.C // SUB, cfg.low, k_piece(cfg, cfg.block_k_pairs)
    pairs = [(i, j) for i in range(1, nb) for j in range(i)]

    def piece(p, acc):
        kp = pl.ds(p * bk, bk)
        acc = dict(zip(pairs, acc))
        kd, tots = [], []         # per earlier block j: k_j exp(suffix_j) and its gate total
        for i in range(nb):
            fx, suf, tot, g0 = pair_factors(load_f32(r["g"], (pl.ds(i * SUB, SUB), kp)),
                                            fx=i > 0)
            k = qk_piece(r, "k", i, kp, cfg)
            if i > 0:
                ak, aq = k * fx, qk_piece(r, "q", i, kp, cfg) * fx
                e = g0            # gates from block j's end to block i's first row
                for j in range(i - 1, -1, -1):
                    bj = kd[j] * exp(e)[None, :]
                    a, pq = acc[i, j]
                    acc[i, j] = (a + mm_nt(ak, bj, low), pq + mm_nt(aq, bj, low))
                    e = e + tots[j]
            if i < nb - 1:
                kd.append(k * exp(suf))
                tots.append(tot)
        return tuple(acc[key] for key in pairs)

    zero = jnp.zeros((SUB, SUB), F32)
    acc = lax.fori_loop(0, cfg.K // bk, piece, tuple((zero, zero) for _ in pairs))
    M, P = {}, {}
    for (i, j), (a, pq) in zip(pairs, acc):
        M[i, j] = load_f32(r["beta"], pl.ds(i * SUB, SUB))[:, None] * a
        P[i, j] = pq
    if cfg.fuse_solve:
        # As fla's inter + solve kernel: the inverse T from the blocks in registers and K1d's
        # diagonal blocks.
        for i in range(nb):
            M[i, i] = load_f32(r["m_d"], (pl.ds(i * SUB, SUB), pl.ds(i * SUB, SUB)))
        store_lower_blocks(r, "tmat", blocked_inverse(M, nb, cfg), nb)
    else:
        for (i, j) in pairs:
            r["m"][pl.ds(i * SUB, SUB), pl.ds(j * SUB, SUB)] = M[i, j]
    for i in range(nb):
        for j in range(nb):
            if j != i:
                r["p"][pl.ds(i * SUB, SUB), pl.ds(j * SUB, SUB)] = (
                    P[i, j] if j < i else zero).astype(r["p"].dtype)


# ---------------------------------------------------------------------------------------------
# K2, K2o: the sequential state pass and the parallel output




def _load_chunk(r, cfg, sl):
    """q, k of one chunk (q scaled, both normalised if asked) and its gate quantities for the
    state passes: (q, k, G, exp(G), exp(G_C - G), exp(G_C)); the last four None without a gate."""
    q = load_qk(r["q"], (sl, slice(None)), cfg, True)
    k = load_qk(r["k"], (sl, slice(None)), cfg, False)
    if cfg.gate == "none":
        return q, k, None, None, None, None
    g = (load_gate(r, cfg, sl) if cfg.gate == "scalar"
         else load_f32(r["g"], (sl, slice(None))))
    G, _, gam, kdec, dec = chunk_gates(g, cfg.gate)
    return q, k, G, gam, kdec, dec


def _chunk_operators(r, cfg, sl, n):
    """Loads one chunk for the state passes: (q*Gam, k*exp(G_C-G), w, P, decay of S)."""
    C, low = cfg.C, cfg.low
    w = r["w"][sl, :]
    if cfg.gate == "channel":
        qg, kd, dec = gated_chunk(r, cfg, sl, n)
        return qg, kd, w, load_dot(r["p"], (sl, slice(None)), cfg), dec
    q, k, G, gam, kdec, dec = _load_chunk(r, cfg, sl)
    p = mm_nt(q, k, low)
    if cfg.gate == "none":
        return q, k, w, jnp.where(iota((C, C), 0) >= iota((C, C), 1), p, 0.0), None
    return q * gam, k * kdec, w, p * scalar_decay(G, True), dec


def state_fwd_kernel(r, cfg: KernelCfg, nt_static: int):
    C, K, BV, low = cfg.C, cfg.K, cfg.block_v, cfg.low
    lo, hi = chunk_range(r, cfg, nt_static)
    s = load_f32(r["s0"], (slice(None), slice(None))) if cfg.has_s0 else jnp.zeros((K, BV), F32)

    def body(n, s):
        sl = pl.ds(n * C, C)
        qg, kd, w, p, dec = _chunk_operators(r, cfg, sl, n)
        if cfg.store_h:
            r["h"][n, :, :] = s.astype(r["h"].dtype)
        u = load_f32(r["u0"], (sl, slice(None))) - mm(w, s, low)
        o = mm(qg, s, low) + mm(p, u, low)
        r["o"][sl, :] = o.astype(r["o"].dtype)
        s = s if dec is None else dec * s
        return s + mm_tn(kd, u, low)

    s = lax.fori_loop(lo, hi, body, s)
    r["sT"][:, :] = s


def state_fwd_lean_kernel(r, cfg: KernelCfg, nt_static: int, stored=None):
    """K2, lean: only the recurrence, two dots per chunk on the sequential path.

    Per chunk: stores h = S (the chunk's start state), U = U0 - W S ("v_new"), then
    S <- exp(G_C) S + (exp(G_C - G) k)^T U. The scalar gate scales U's rows instead of k's
    ([C, BV] products, not [C, K]; as fla's fwd_h), the channel gate's exp(G_C - G) k comes from
    K1b, and every dot operand is loaded as stored (`load_dot`). H100, B1 T16384 H16 D128 bf16,
    the scalar-gate pass alone: 0.56 ms with k gated and converted in registers, 0.33 like
    this. The output comes from `output_kernel`, in parallel over chunks. stored(n): called
    once chunk n's h and U are stored (`state_out_fwd_kernel` releases the chunk's flag there).
    """
    C, K, BV, low = cfg.C, cfg.K, cfg.block_v, cfg.low
    lo, hi = chunk_range(r, cfg, nt_static)
    s = load_f32(r["s0"], (slice(None), slice(None))) if cfg.has_s0 else jnp.zeros((K, BV), F32)

    def body(n, s):
        sl = pl.ds(n * C, C)
        r["h"][n, :, :] = s.astype(r["h"].dtype)
        u = load_f32(r["u0"], (sl, slice(None))) - mm(r["w"][sl, :], s, low)
        r["vn"][sl, :] = u.astype(r["vn"].dtype)
        if stored is not None:
            stored(n)
        if cfg.gate == "channel":
            _, kd, dec = gated_chunk(r, cfg, sl, n, with_q=False)
            return dec * s + mm_tn(kd, u, low)
        k = qk_operand(r["k"], (sl, slice(None)), cfg)
        if cfg.gate == "none":
            return s + mm_tn(k, u, low)
        G, GC = scalar_chunk_gates(r, cfg, sl, n)
        return exp(GC) * s + mm_tn(k, u * exp(GC - G[:, None]), low)

    s = lax.fori_loop(lo, hi, body, s)
    r["sT"][:, :] = s


class _AtChunk:
    """A ref holding every chunk of a sequence (the state pass's block: h [NT, K, BV], U
    [Tp, BV]) seen as one chunk's block, as `output_kernel` indexes it."""

    def __init__(self, ref, n, rows=None):
        self.ref, self.n, self.rows = ref, n, rows
        self.dtype = ref.dtype
        self.shape = (rows,) + tuple(ref.shape[1:]) if rows else tuple(ref.shape[1:])

    def __getitem__(self, idx):
        if self.rows is None:
            return self.ref[(self.n,) + tuple(idx)]
        first = idx[0]
        if isinstance(first, slice):
            assert first == slice(None)
            first = pl.ds(self.n * self.rows, self.rows)
        else:
            first = pl.ds(self.n * self.rows + first.start, first.size)
        return self.ref[(first,) + tuple(idx[1:])]


class _Cols:
    """A ref holding all V columns (h [NT, K, V], U [Tp, V]) seen as one state program's V
    block of `width` columns from c0, as `state_fwd_lean_kernel` indexes its blocks."""

    def __init__(self, ref, c0, width):
        self.ref, self.c0, self.width = ref, c0, width
        self.dtype = ref.dtype
        self.shape = tuple(ref.shape[:-1]) + (width,)

    def _idx(self, idx):
        assert idx[-1] == slice(None)
        return tuple(idx[:-1]) + (pl.ds(self.c0, self.width),)

    def __getitem__(self, idx):
        return self.ref[self._idx(idx)]

    def __setitem__(self, idx, val):
        self.ref[self._idx(idx)] = val


# Polls before an output program gives up (~1 s): reached only if a state program it waits for
# never ran, which the grid order excludes; the program then writes NaN rather than hang.
SPIN_CAP = 1 << 20


def _flag(r, idx, add, interpret):
    """Atomically adds `add` to flag idx and returns its previous value (add 0: a coherent read
    of another program's count)."""
    if interpret:
        return jnp.max(plgpu.atomic_add(r["flags"], (pl.ds(idx, 1),),
                                        jnp.full((1,), add, jnp.int32)))
    return plgpu.atomic_add(r["flags"], (idx,), add)


def state_program(i, heads, vblocks):
    """(b, h, V block) of state program i of the one K2+K2o launch (grid order B, H, V / BV);
    the launcher's BlockSpecs and the kernel both decode program ids with it."""
    return i // (heads * vblocks), (i // vblocks) % heads, i % vblocks


def output_program(o, heads, batch):
    """(chunk, b, h) of output program o (counted from the first one; chunk-major, then B, H)."""
    return o // (heads * batch), (o // heads) % batch, o % heads


def state_out_fwd_kernel(r, cfg: KernelCfg, nt_static: int, n_state: int, heads: int,
                         vblocks: int, batch: int):
    """K2 and K2o in one launch: the first n_state programs run the sequential state pass (as
    `state_fwd_lean_kernel`, grid order (B, H, V / BV), each writing its V block's columns of
    the whole-V h and U) and count a flag per (b, h, chunk) up once its h and U are stored; the
    others, chunk-major, each wait until all V blocks counted their chunk's flag and run
    `output_kernel` on it (all of V), so that the outputs of the first chunks are computed
    while the state pass walks the later ones instead of after it. The state programs come
    first in the grid, so they are all placed before any output program (which only ever
    waits for them); a spin that reaches its cap (a deadlock) writes NaN. Interpret mode runs
    programs in grid order: every flag is set before it is read."""
    i = pl.program_id(0)
    nt = nt_static

    def flag_index(b, h, n):
        return (b * heads + h) * nt + n

    @pl.when(i < n_state)
    def _state():
        b, h, j = state_program(i, heads, vblocks)

        def stored(n):
            barrier(cfg)            # every thread's stores of chunk n before the release
            _flag(r, flag_index(b, h, n), 1, cfg.interpret)

        c0 = j * cfg.block_v
        view = dict(r, h=_Cols(r["h"], c0, cfg.block_v), vn=_Cols(r["vn"], c0, cfg.block_v))
        state_fwd_lean_kernel(view, cfg, nt, stored=stored)

    @pl.when(i >= n_state)
    def _output():
        n, b, h = output_program(i - n_state, heads, batch)
        idx = flag_index(b, h, n)

        def cond(s):
            return jnp.logical_and(s[0] < vblocks, s[1] < SPIN_CAP)

        def poll(s):
            return _flag(r, idx, 0, cfg.interpret), s[1] + 1

        _, spins = lax.while_loop(cond, poll, (jnp.int32(0), jnp.int32(0)))
        view = dict(r, h=_AtChunk(r["h"], n), vn=_AtChunk(r["vn"], n, cfg.C))
        output_kernel(view, cfg)

        @pl.when(spins >= SPIN_CAP)
        def _poison():
            r["o"][:, :] = jnp.full(r["o"].shape, jnp.nan, r["o"].dtype)


def out_block_k(cfg):
    """K width of the output kernel's pieces: pieces only for the channel gate's stored Gam q
    (K1b's pre_gates); the whole row otherwise."""
    pieces = cfg.gate == "channel" and cfg.pre_gates
    return k_piece(cfg, cfg.block_k_out) if pieces else cfg.K


def output_kernel(r, cfg: KernelCfg):
    """Output of one chunk (and V block), all chunks in parallel: O = (Gam q) h + P U, with h the
    chunk's start state and U = v_new from the lean state pass. The scalar gate and the query
    scale multiply the rows of q h rather than q."""
    low = cfg.low
    all_ = (slice(None), slice(None))
    G = chunk_cumulative_gate(r, cfg)
    bk = out_block_k(cfg)
    if bk < cfg.K:
        # As fla's output kernel: Gam q h in pieces of K, so that the pipeliner overlaps the
        # next piece's loads with this one's dot.
        def piece(i, qh):
            ks = pl.ds(i * bk, bk)
            return qh + mm(load_dot(r["qg"], (slice(None), ks), cfg),
                           load_dot(r["h"], (ks, slice(None)), cfg), low)

        qh = lax.fori_loop(0, cfg.K // bk, piece, jnp.zeros((cfg.C, r["h"].shape[1]), F32))
    elif cfg.gate == "channel":
        h = r["h"][:, :]
        if cfg.pre_gates:                   # Gam q from K1b
            qh = mm(load_dot(r["qg"], all_, cfg), h, low)
        else:
            q = load_qk(r["q"], all_, cfg, True)
            qh = mm(q * exp(jnp.cumsum(load_f32(r["g"], all_), axis=0)), h, low)
    else:
        qh = mm(qk_operand(r["q"], all_, cfg), r["h"][:, :], low)
        if cfg.gate == "scalar":
            qh = qh * (cfg.scale * exp(G))[:, None]
        else:
            qh = qh * cfg.scale
    o = qh + mm(chunk_p(r, cfg, G), r["vn"][:, :], low)
    r["o"][:, :] = o.astype(r["o"].dtype)
