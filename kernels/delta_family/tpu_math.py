"""Per-chunk math of the TPU (Mosaic) delta-family kernels, on values already loaded from VMEM.

Everything here works on one chunk of C tokens of one (batch, head): 2-D arrays only, static
shapes, static Python loops, iota masks, `jnp.where`, `jnp.exp`, row/lane reductions and
`lax.dot_general` with float32 accumulation. That is the op set Mosaic lowers; the functions are
shared by the forward and backward kernels in `tpu_kernels.py`.

Layout inside a chunk (row i = token i of the chunk):
  q, k [C, K]; v [C, V]; beta [C, 1]; g [C, 1] (scalar gate) or [C, K] (channel gate): the raw
  per-token log-decays. G_i = sum_{l <= i} g_l denotes the chunk-local cumulative decay.

Decay factors exp(G_i - G_j) (j <= i) always have a non-positive exponent (for g <= 0), masked
before the exp, and every exponent is a direct segment sum of g, never a difference of two
cumulative sums (which would lose ~|G| * 6e-8 absolutely under strong gates). The scalar gate
uses the pairwise [C, C] segment sums. The channel (KDA) gate never uses exp(G_i) * exp(-G_j):
its off-diagonal sub-chunk blocks are factored through a reference row r between j and i,
exp(G_i - G_r) * exp(G_r - G_j) with both exponents <= 0, and its diagonal sub-chunk blocks use
exact pairwise masked exps, one partner row offset at a time (C * sub * K exps per chunk).
The backward returns the cotangent of the raw g directly: each decay factor's contribution is
summed only over the g_l inside its segment, so no O(1) terms cancel.
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax

F32 = jnp.float32
_NN = (((1,), (0,)), ((), ()))   # a @ b
_NT = (((1,), (1,)), ((), ()))   # a @ b.T
_TN = (((0,), (0,)), ((), ()))   # a.T @ b


def _precision(a, b):
    # float32 operands must not be truncated to one bf16 pass on the MXU; bf16 x bf16 products
    # are exact in float32 already.
    if a.dtype == F32 or b.dtype == F32:
        return lax.Precision.HIGHEST
    return None


def _dot(a, b, dims):
    if a.dtype != b.dtype:
        a, b = a.astype(F32), b.astype(F32)
    return lax.dot_general(a, b, dims, precision=_precision(a, b), preferred_element_type=F32)


def mm(a, b):
    """a @ b with float32 accumulation."""
    return _dot(a, b, _NN)


def mm_nt(a, b):
    """a @ b.T with float32 accumulation."""
    return _dot(a, b, _NT)


def mm_tn(a, b):
    """a.T @ b with float32 accumulation."""
    return _dot(a, b, _TN)


def iota(shape, axis):
    return lax.broadcasted_iota(jnp.int32, shape, axis)


def imod(x, n):
    """x mod n for non-negative int32 x (lax.rem: no sign fix-ups, unlike `%`)."""
    return lax.rem(x, jnp.int32(n))


def idiv(x, n):
    """x // n for non-negative int32 x (lax.div: no sign fix-ups, unlike `//`)."""
    return lax.div(x, jnp.int32(n))


def col_to_row(x):
    """[n, 1] -> [1, n] by a diagonal-masked sublane reduction (no transpose op needed)."""
    n = x.shape[0]
    eye = iota((n, n), 0) == iota((n, n), 1)
    return jnp.sum(jnp.where(eye, x, 0.0), axis=0, keepdims=True)


def row_to_col(x):
    """[1, n] -> [n, 1] by a diagonal-masked lane reduction."""
    n = x.shape[1]
    eye = iota((n, n), 0) == iota((n, n), 1)
    return jnp.sum(jnp.where(eye, x, 0.0), axis=1, keepdims=True)


def bcast_rows(x, m, sub):
    """Row i of the result is row (i // sub) * sub + m of x: the m-th row of i's sub-chunk."""
    c, d = x.shape
    n = c // sub
    y = x.reshape(n, sub, d)[:, m:m + 1, :]
    return jnp.broadcast_to(y, (n, sub, d)).reshape(c, d)


def _ones(mask):
    return jnp.where(mask, 1.0, 0.0).astype(F32)


def seg_sum(mask, g):
    """out[i] = sum_l mask[i, l] * g[l] for a 0/1 mask [R, C] and g [C, D], float32.

    A matmul for D > 1; for D = 1 a lane reduction (no N = 1 matmul).
    """
    if g.shape[1] == 1:
        return jnp.sum(jnp.where(mask, col_to_row(g), 0.0), axis=1, keepdims=True)
    return mm(_ones(mask), g)


def masked_exp(x, mask):
    """exp(x) on the mask, 0 off it; the exponent is zeroed before exp off the mask."""
    return jnp.where(mask, jnp.exp(jnp.where(mask, x, 0.0)), 0.0)


def l2norm_fwd(x, eps):
    """x / sqrt(sum(x^2) + eps) per row (fla's l2norm), float32; also returns the 1/norm."""
    r = lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + eps)
    return x * r, r


def l2norm_bwd(y, r, dy):
    """Cotangent of x for y = x * r, r = (sum x^2 + eps)^(-1/2)."""
    return r * (dy - y * jnp.sum(y * dy, axis=-1, keepdims=True))


def unit_lower_inverse(ls, sub):
    """(I + ls)^{-1} for strictly lower-triangular ls [C, C], float32, by blocked substitution.

    The `sub` x `sub` diagonal blocks are inverted by forward substitution, all blocks at once
    (row m of every block per step); the blocks are then joined by block forward substitution
    X_I = Bd_I - (Bd Lo)_I X. Both are plain substitution (no power series), so it stays accurate
    for strongly correlated keys. Cost: (sub - 1) + C/sub matmuls of [C, C] x [C, C].
    """
    c = ls.shape[0]
    row, col = iota((c, c), 0), iota((c, c), 1)
    eye = (row == col).astype(F32)
    same = idiv(row, sub) == idiv(col, sub)
    l_bd = jnp.where(same, ls, 0.0)
    bd = eye
    rmod = imod(row, sub)
    for m in range(1, sub):
        bd = jnp.where(rmod == m, eye - mm(l_bd, bd), bd)
    if c == sub:
        return bd
    z = mm(bd, jnp.where(same, 0.0, ls))
    x = bd
    rblk = idiv(row, sub)
    for blk in range(1, c // sub):
        x = jnp.where(rblk == blk, bd - mm(z, x), x)
    return x


class Gate:
    """Decay factors of one chunk for mode 'none', 'scalar' (g [C, 1]) or 'channel' (g [C, K]).

    g holds the raw per-token log-decays of the chunk. Every exponent is formed as a direct
    segment sum of g (a 0/1-masked matmul or a short running sum), never as a difference
    G_i - G_j of cumulative sums: with strong gates G reaches hundreds and the difference would
    lose ~|G| * 6e-8 absolutely, ~1e-5 relative error in the factors and in dL/dg.
    """

    def __init__(self, mode, g, sub):
        self.mode = mode
        self.g = g
        self.sub = sub
        if mode == "none":
            return
        c = g.shape[0]
        row, col = iota((c, c), 0), iota((c, c), 1)
        self.eg = jnp.exp(seg_sum(col <= row, g))        # exp(G_i), G_i = sum_{l <= i} g_l
        self.e_end = jnp.exp(seg_sum(col > row, g))      # exp(G_C - G_i) = exp(sum_{l > i} g_l)
        self.d_row = jnp.exp(jnp.sum(g, axis=0, keepdims=True))   # exp(G_C)  [1, Kg]
        if mode == "scalar":
            # seg[i, j] = sum_{j < l <= i} g_l, then exp(seg) on j <= i.
            seg = mm(_ones(col <= row), jnp.where(row > col, g, 0.0))
            self.E = masked_exp(seg, row >= col)
        else:
            s = sub
            self.rs, self.cs = {}, {}
            for blk in range(1, c // s):
                r = blk * s
                rb, cb = iota((s, c), 0) + r, iota((s, c), 1)
                # rows i of sub-chunk blk against its first row r: exp(sum_{r < l <= i} g_l)
                self.rs[blk] = jnp.exp(seg_sum((cb > r) & (cb <= rb), g))
                # earlier rows j < r: exp(sum_{j < l <= r} g_l); rows j >= r are zero
                seg = seg_sum((col > row) & (col <= r), g)
                self.cs[blk] = masked_exp(seg, iota((c, 1), 0) < r)

    def diag_i_side(self):
        """Yields (m, e) for m = s-1 .. 0: e[i] = exp(sum_{p < l <= i} g_l) with p = i's sub-chunk
        start + m, on rows with i >= p (0 elsewhere). The exponent is a running sum of g."""
        c, s = self.g.shape[0], self.sub
        rmod = imod(iota((c, 1), 0), s)
        seg = jnp.zeros(self.g.shape, F32)
        for m in reversed(range(s)):
            if m < s - 1:
                seg = jnp.where(rmod > m, seg + bcast_rows(self.g, m + 1, s), 0.0)
            yield m, masked_exp(seg, rmod >= m)

    def diag_j_side(self):
        """Yields (m, e) for m = 0 .. s-1: e[j] = exp(sum_{j < l <= p} g_l) with p = j's sub-chunk
        start + m, on rows with j <= p (0 elsewhere)."""
        c, s = self.g.shape[0], self.sub
        rmod = imod(iota((c, 1), 0), s)
        seg = jnp.zeros(self.g.shape, F32)
        for m in range(s):
            if m > 0:
                seg = jnp.where(rmod < m, seg + bcast_rows(self.g, m, s), 0.0)
            yield m, masked_exp(seg, rmod <= m)

    # --- per-row scalings -----------------------------------------------------------------------
    def fwd(self, x):
        """exp(G_i) * x_i."""
        return x if self.mode == "none" else self.eg * x

    def end(self, x):
        """exp(G_C - G_i) * x_i."""
        return x if self.mode == "none" else self.e_end * x

    def d_col(self):
        """exp(G_C) as a column: [K, 1] (channel) or [1, 1] (scalar)."""
        return row_to_col(self.d_row) if self.mode == "channel" else self.d_row

    # --- the two pairwise products of a chunk ---------------------------------------------------
    def pairs_fwd(self, q, k, qs, kf, scale, normalized):
        """A = strict_lower(sum_c k_ic k_jc e^{G_ic-G_jc}), P = lower(sum_c qs_ic k_jc e^{...}).

        q, k: raw inputs (bf16 or f32) used for the MXU products of the none/scalar modes when
        not normalized (bf16 x bf16 is exact in f32); qs = scale * q_hat, kf = k_hat float32.
        """
        c = kf.shape[0]
        row, col = iota((c, c), 0), iota((c, c), 1)
        if self.mode != "channel":
            if normalized:
                qk, kk = mm_nt(qs, kf), mm_nt(kf, kf)
            else:
                qk, kk = mm_nt(q, k) * scale, mm_nt(k, k)
            if self.mode == "scalar":
                qk, kk = qk * self.E, kk * self.E
            return jnp.where(row > col, kk, 0.0), jnp.where(row >= col, qk, 0.0)
        return self._channel_pairs_fwd(qs, kf)

    def _channel_pairs_fwd(self, qs, kf):
        c, s = kf.shape[0], self.sub
        nblk = c // s
        a_blocks, p_blocks = [jnp.zeros((s, c), F32)], [jnp.zeros((s, c), F32)]
        for blk in range(1, nblk):
            sl = slice(blk * s, (blk + 1) * s)
            y = kf * self.cs[blk]
            a_blocks.append(mm_nt(kf[sl] * self.rs[blk], y))
            p_blocks.append(mm_nt(qs[sl] * self.rs[blk], y))
        a = jnp.concatenate(a_blocks, axis=0) if nblk > 1 else a_blocks[0]
        p = jnp.concatenate(p_blocks, axis=0) if nblk > 1 else p_blocks[0]
        rows = iota((c, 1), 0)
        rmod = imod(rows, s)
        rbase = rows - rmod
        colc = iota((c, c), 1)
        for m, e in self.diag_i_side():              # partner j = rbase + m <= i
            ke = bcast_rows(kf, m, s) * e
            tgt = colc == rbase + m
            a = a + jnp.where(tgt & (rmod > m), jnp.sum(kf * ke, axis=1, keepdims=True), 0.0)
            p = p + jnp.where(tgt, jnp.sum(qs * ke, axis=1, keepdims=True), 0.0)
        return a, p

    def pairs_bwd(self, ma, mp, qs, kf, a, p):
        """Cotangents of (qs, kf) and of the cumulative decays from those (ma, mp) of A and P.

        Returns (dqs [C, K], dk [C, K], dG [C, Kg] or None); dG_i is the cotangent of G_i, to be
        summed over l <= i into dg_l (the diagonal of P, which has no decay, is left out).
        """
        if self.mode != "channel":
            if self.mode == "scalar":
                ma_e, mp_e = ma * self.E, mp * self.E
            else:
                ma_e, mp_e = ma, mp
            dqs = mm(mp_e, kf)
            dk = mm(ma_e, kf) + mm_tn(ma_e, kf) + mm_tn(mp_e, qs)
            if self.mode == "none":
                return dqs, dk, None
            # dA_ij/dG_i = A_ij, dA_ij/dG_j = -A_ij. The diagonal of P carries no decay (e^0): it
            # is left out rather than added to dG_i and subtracted again (cancellation).
            c = kf.shape[0]
            x = ma * a + jnp.where(iota((c, c), 0) > iota((c, c), 1), mp * p, 0.0)
            dg = (jnp.sum(x, axis=1, keepdims=True)
                  - row_to_col(jnp.sum(x, axis=0, keepdims=True)))
            return dqs, dk, dg
        return self._channel_pairs_bwd(ma, mp, qs, kf)

    def _channel_pairs_bwd(self, ma, mp, qs, kf):
        c, d = kf.shape
        s = self.sub
        nblk = c // s
        # fa_i = sum_j ma_ij k_j e^{G_i-G_j}; fp likewise with mp; ft_j = sum_i (ma_ij k_i +
        # mp_ij qs_i) e^{G_i-G_j}.
        fa_blocks, fp_blocks = [jnp.zeros((s, d), F32)], [jnp.zeros((s, d), F32)]
        ft = jnp.zeros((c, d), F32)
        for blk in range(1, nblk):
            sl = slice(blk * s, (blk + 1) * s)
            rs, cs = self.rs[blk], self.cs[blk]
            y = kf * cs
            fa_blocks.append(rs * mm(ma[sl], y))
            fp_blocks.append(rs * mm(mp[sl], y))
            ft = ft + cs * (mm_tn(ma[sl], kf[sl] * rs) + mm_tn(mp[sl], qs[sl] * rs))
        fa = jnp.concatenate(fa_blocks, axis=0) if nblk > 1 else fa_blocks[0]
        fp = jnp.concatenate(fp_blocks, axis=0) if nblk > 1 else fp_blocks[0]
        rows = iota((c, 1), 0)
        rmod = imod(rows, s)
        rbase = rows - rmod
        rowc, colc = iota((c, c), 0), iota((c, c), 1)
        diag = rowc == colc
        for m, e in self.diag_i_side():
            # i side: partner j = rbase + m < i (the diagonal j = i is added below)
            tgt = (colc == rbase + m) & (rmod > m)
            ma_j = jnp.sum(jnp.where(tgt, ma, 0.0), axis=1, keepdims=True)
            mp_j = jnp.sum(jnp.where(tgt, mp, 0.0), axis=1, keepdims=True)
            kpe = bcast_rows(kf, m, s) * e
            fa = fa + ma_j * kpe
            fp = fp + mp_j * kpe
        for m, et in self.diag_j_side():
            # j side: partner i = rbase + m > j
            ma_i = jnp.sum(jnp.where(diag, bcast_rows(ma, m, s), 0.0), axis=1, keepdims=True)
            mp_i = jnp.sum(jnp.where(diag & (rmod < m), bcast_rows(mp, m, s), 0.0), axis=1,
                           keepdims=True)
            ft = ft + (ma_i * bcast_rows(kf, m, s) + mp_i * bcast_rows(qs, m, s)) * et
        # The diagonal of P has no decay (e^0): it enters dqs and dk but not dG, where it would
        # only be added and subtracted again (cancellation). A has a zero diagonal.
        mp_d = jnp.sum(jnp.where(diag, mp, 0.0), axis=1, keepdims=True)
        return fp + mp_d * kf, fa + ft + mp_d * qs, kf * fa + qs * fp - kf * ft


def chunk_forward(q, k, v, beta, g, *, mode, scale, normalize, eps, sub):
    """Everything the kernels need from one chunk (g: raw log-decays [C, Kg] or None), float32.

    Returns a dict with: qf (q normalised), qs (= scale * qf), kf (k normalised), rq, rk
    (1/norms or None), gate, a, p (the decayed k.k and q.k products), tinv = (I + beta a)^{-1},
    u0 = tinv beta v, w = tinv beta exp(G) k, kg = exp(G) k, qg = exp(G) qs,
    kd = exp(G_C - G) k.
    """
    qf, kf = q.astype(F32), k.astype(F32)
    rq = rk = None
    if normalize:
        qf, rq = l2norm_fwd(qf, eps)
        kf, rk = l2norm_fwd(kf, eps)
    qs = qf * scale
    gate = Gate(mode, None if g is None else g.astype(F32), sub)
    a, p = gate.pairs_fwd(q, k, qs, kf, scale, normalize)
    tinv = unit_lower_inverse(beta * a, sub)
    kg = gate.fwd(kf)
    qg = gate.fwd(qs)
    kd = gate.end(kf)
    bv = beta * v.astype(F32)
    u0 = mm(tinv, bv)
    w = mm(tinv, beta * kg)
    return dict(qf=qf, qs=qs, kf=kf, rq=rq, rk=rk, gate=gate, a=a, p=p, tinv=tinv, kg=kg,
                qg=qg, kd=kd, u0=u0, w=w)


def chunk_backward(f, v, beta, h, dh, do, *, scale, normalize):
    """Cotangents of one chunk's inputs given its start state h [K, V], the cotangent dh [K, V]
    of its end state and do [C, V] of its outputs; f = chunk_forward(...).

    Per chunk (S = h):  u = U0 - W S;  o = (Qg - P W) S + P U0;  S' = D S + Kd^T u.
    Returns (dq, dk, dv, dbeta [C, 1], dg [C, Kg] or None, dh_start [K, V]), float32; dg is the
    cotangent of the raw per-token gates g (the chunk-local cumsum is inside) and dh_start that
    of the chunk's start state: Qg^T dO - W^T (P^T dO + Kd dS') + D dS'.
    """
    gate = f["gate"]
    tinv, a, p, u0, w = f["tinv"], f["a"], f["p"], f["u0"], f["w"]
    qs, kf, kg, qg, kd = f["qs"], f["kf"], f["kg"], f["qg"], f["kd"]
    c = kf.shape[0]
    row, col = iota((c, c), 0), iota((c, c), 1)
    do = do.astype(F32)
    vf = v.astype(F32)

    # Unfolded form o = Qg S + P u (the forward's Qe = Qg - P W, O0 = P U0 is the same); it
    # keeps dP = dO u^T free of the cancellation in dO U0^T - dO S^T W^T.
    u = u0 - mm(w, h)
    dqe = mm_nt(do, h)                   # dQg
    dkd = mm_nt(u, dh)
    dp = jnp.where(row >= col, mm_nt(do, u), 0.0)
    du0 = mm(kd, dh) + mm_tn(p, do)      # du, with U0 = u + W S
    dw = -mm_nt(du0, h)
    # [U0 | W] = T [beta V | beta Kg], T = (I + beta A)^{-1}
    drv, drk = mm_tn(tinv, du0), mm_tn(tinv, dw)
    dv = beta * drv
    dkg = beta * drk
    dls = -jnp.where(row > col, mm_nt(drv, u0) + mm_nt(drk, w), 0.0)
    dbeta = (jnp.sum(drv * vf, axis=1, keepdims=True) + jnp.sum(drk * kg, axis=1, keepdims=True)
             + jnp.sum(dls * a, axis=1, keepdims=True))
    dqs, dk, dg = gate.pairs_bwd(beta * dls, dp, qs, kf, a, p)
    dqs = dqs + gate.fwd(dqe)
    dk = dk + gate.fwd(dkg) + gate.end(dkd)
    if gate.mode != "none":
        # Cotangent of the raw gates g (not of G): every decay factor is exp of a segment sum
        # of g, so each contribution is summed only over the g_l inside its segment:
        #   exp(G_i) on Qg, Kg and the pairs' i side      -> g_l, l <= i  (reverse cumsum)
        #   exp(G_C - G_i) on Kd                           -> g_l, l > i   (exclusive cumsum)
        #   exp(G_C) on the carried state                  -> every g_l of the chunk
        # Going through dG_C - dG_i instead would add and subtract O(1) terms and lose
        # ~1e-5 relative accuracy under strong gates.
        rev = qg * dqe + kg * dkg
        fwd = kd * dkd
        dd = jnp.sum(h * dh, axis=1, keepdims=True)                       # [K, 1]
        if gate.mode == "channel":
            rev = rev + dg
            every = gate.d_row * col_to_row(dd)                           # [1, K]
        else:
            rev = jnp.sum(rev, axis=1, keepdims=True) + dg
            fwd = jnp.sum(fwd, axis=1, keepdims=True)
            every = gate.d_row * jnp.sum(dd, axis=0, keepdims=True)       # [1, 1]
        l_idx, i_idx = iota((c, c), 0), iota((c, c), 1)
        dg = seg_sum(i_idx >= l_idx, rev) + seg_sum(i_idx < l_idx, fwd) + every
    dq = dqs * scale
    if normalize:
        dq = l2norm_bwd(f["qf"], f["rq"], dq)
        dk = l2norm_bwd(kf, f["rk"], dk)
    dh_start = mm_tn(qg, do) - mm_tn(w, du0)
    dh_start = dh_start + (gate.d_col() * dh if gate.mode != "none" else dh)
    return dq, dk, dv, dbeta, dg, dh_start
