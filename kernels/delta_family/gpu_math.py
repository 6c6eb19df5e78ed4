"""In-kernel math of the GPU (Pallas, Triton lowering) exact chunked delta family.

The per-kernel config `KernelCfg` and the helpers every kernel body shares (dots, gates, decays,
loads, blocked inverses, KDA pair factors, state-pass operands); the kernel bodies are in
`gpu_fwd.py` (K1*, K2, K2o) and `gpu_bwd.py` (K3*, K4*), the labels in `gpu.py`.

Everything here runs inside a `pallas_call` and touches only the op subset the Pallas Triton
lowering supports in jax 0.10 and 0.11 alike: 1-D/2-D arrays whose sizes are powers of two,
`pl.ds` loads/stores, iota masks, `jnp.where`, `jnp.exp2`, axis reductions, a forward
`jnp.cumsum`, 2-D `lax.dot_general` with float32 accumulation, static Python loops and
`lax.fori_loop` (trip counts may depend on the program id). No slicing of register values (the
Triton lowering has no `slice`): sub-blocks are loaded from memory, rows are loaded ([1, K]
blocks at a dynamic row) or extracted with masked reductions.

Per chunk of C tokens (row i = token i of the chunk), start state S [K, V] (float32), the
inclusive chunk-local cumulative log-decay G_i = sum_{l <= i} g_l (float32) and Gam = exp(G):

  M = strict_lower(diag(beta) A),  A_ij = sum_c k_ic k_jc exp(G_ic - G_jc)
  T = (I + M)^-1                  (16x16 diagonal blocks by forward substitution, then blocks)
  W = T (beta Gam k),  U0 = T (beta v),  U = U0 - W S            (U: "v_new")
  O = (Gam q) S + P U,  P_ti = sum_c q_tc k_ic exp(G_tc - G_ic)  (i <= t)
  S' = exp(G_C) S + (exp(G_C - G) k)^T U

Backward (dS' = gradient of the chunk's end state, from the reverse state pass):
  dU = exp(G_C - G) k dS' + P^T dO;  dS = exp(G_C) dS' + (Gam q)^T dO - W^T dU
and per chunk, in parallel: dq, dk, dv, dbeta and dg. The gate gradient is assembled so that
it stays accurate (1e-7 relative in float32) for gates of any strength, including padded rows:
  - every decay exp(sum_{j<l<=i} g_l) in the backward kernels is formed from a direct segment
    sum (a cumsum of a masked [C, C] matrix, block-local cumsums, running sums from the
    diagonal), never as a difference G_i - G_j of chunk cumulative sums, which loses |G| * eps
    absolutely; the one difference is the in-block suffix of KDA's factored off-diagonal pairs
    (`pair_factors`: at most 16 gates, exact on the row next to the block boundary, and its
    rounding only reaches terms that are themselves exp(-|suffix|) small);
  - a pairwise term contributes +c to its later and -c to its earlier end before one reverse
    cumsum (pairs after s cancel, pairs that cross s remain); pairs with an empty segment (the
    diagonal of P) are left out; the end-state term exp(G_C - G_i) k_i reaches dg_s for s > i
    only and is added as a direct exclusive prefix sum (with g = 0 padding rows ending a chunk,
    the +/- form would cancel O(1) terms).
Scalar gate and no gate: full [C, C] decay matrices. Channel gate (KDA): 16-row sub-blocks;
off-diagonal blocks are factored through the first row r of the later block
(exp(G_i - G_r) exp(G_r - G_j), both exponents <= 0 for g <= 0, no overflow for any strength),
diagonal blocks use exact pairwise decays, one token (and a few heads) per program (K1d, K4d;
the one-kernel K1 walks a block's columns instead).

Precision: bf16 inputs use bf16 tensor-core dots with float32 accumulation (as fla); the
triangular solve, gates, cumsums and states are float32. float32 inputs (and the solve) use
float32-accurate dots made of six bf16 tensor-core dots of split operands (see `_dot`).
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from atlas_jax.kernels.delta_family import support

F32 = jnp.float32
BF16 = jnp.bfloat16
SUB = 16            # sub-block rows: the smallest tile a Triton tensor-core dot takes

_NN = (((1,), (0,)), ((), ()))   # a @ b
_NT = (((1,), (1,)), ((), ()))   # a @ b.T
_TN = (((0,), (0,)), ((), ()))   # a.T @ b


@dataclasses.dataclass(frozen=True)
class KernelCfg:
    """Static description of one call, shared by every kernel (hashable: it keys the jit cache)."""
    C: int                 # chunk size (16, 32 or 64)
    K: int
    V: int
    gate: str              # "none" | "scalar" | "channel"
    low: bool              # bf16 matmul operands (bf16 inputs); float32 accumulation always
    scale: float
    normalize: bool        # in-kernel L2 normalisation of q and k
    block_v: int           # V block of the sequential state passes (grid axis)
    block_v_bwd: int       # V block of the loop inside the intra-chunk backward
    has_s0: bool
    has_dsT: bool
    store_h: bool          # forward state pass also writes the chunk start states
    varlen: bool           # chunk ranges per sequence come from an offsets array
    merge_dots: int = 6    # bf16 inputs, per T merge: 1 (one tf32 dot), 3 (bf16 hi/lo split)
    #                        or 6 (float32-exact bf16 dots)
    block_kkt: int = 0     # solve (no / scalar gate): K columns per piece of A = K K^T formed
    #                        as 16x16 blocks in registers; 0: the wide or 16-row layout
    wide: bool = False     # K1: A and W, U0 as whole-chunk [C, C] dots (through the T buffer)
    has_vn: bool = False   # K4: U = v_new stored by the lean state pass (else recomputed)
    interpret: bool = False  # interpret mode: no GPU barrier primitive
    diag_products: bool = False  # bf16: 16x16 diagonal inverses as a product of matmuls
    block_k_pairs: int = 64      # K columns per piece of the off-diagonal pair kernels (K1p, K4b)
    pre_gates: bool = False      # K1b stores the state passes' gate operands: the scalar
    #                              gate's cumulative gate; the channel gate's Gam q,
    #                              exp(G_C - G) k and exp(G_C)
    fuse_solve: bool = False     # channel gate: K1p also forms the inverse T (no solve kernel)
    block_k_out: int = 64        # K columns per piece of the output kernel's loop
    block_wu: int = 64           # columns per piece of K1b's W = T X, U0 = T Y (scalar/no gate)
    block_wu_channel: int = 64   # the same for the channel gate (gate operands, W, U0)
    gate_act: bool = False       # scalar gate: r["g"] is fla's raw gate input, activated on
    #                              load (`load_gate`) with the head's r["A_log"], r["dt_bias"]
    #                              (forward kernels of a primal call only)
    beta_act: float = 0.0        # > 0: r["beta"] holds logits, beta = beta_act * sigmoid(.)
    #                              (`load_beta`; 2 is fla's allow_neg_eigval; the same)


# ---------------------------------------------------------------------------------------------
# In-kernel helpers


def split3(x):
    """float32 x as hi + mid + lo, three bf16 parts that represent it to 24 bits."""
    x = x.astype(F32)
    hi = x.astype(BF16)
    r = x - hi.astype(F32)
    mid = r.astype(BF16)
    return hi, mid, (r - mid.astype(F32)).astype(BF16)


def split2(x):
    """float32 x as hi + lo, two bf16 parts (16 significant bits)."""
    x = x.astype(F32)
    hi = x.astype(BF16)
    return hi, (x - hi.astype(F32)).astype(BF16)


def _dot(a, b, dims, low, exact=False):
    """dot_general with float32 accumulation.

    low and exact == 3 (bf16 inputs, where 1e-2 is the bar): three bf16 dots of hi/lo splits,
    hi*lo + lo*hi + hi*hi (~2^-16 relative; lo*lo and the third split part are dropped).
    low and exact == 1: one tf32 dot of float32 operands (~2^-11 relative).
    low and not exact: bf16 operands on tensor cores, as fla does (bf16 inputs). Otherwise a
    float32-accurate product from six bf16 tensor-core dots of the split operands
    (hi*hi + hi*mid + mid*hi + hi*lo + mid*mid + lo*hi; the neglected terms are ~2^-24
    relative), the BF16_BF16_F32_X6 scheme. It is written out here rather than asked of the
    compiler because an IEEE float32 Triton dot runs on FMA units (slow, and it spills heavily
    at these tile sizes) and interpret mode on CPU then runs exactly the GPU arithmetic.
    """
    def d(x, y):
        return lax.dot_general(x, y, dims, precision=lax.Precision.HIGHEST,
                               preferred_element_type=F32)

    if low and not exact:
        return d(a.astype(BF16), b.astype(BF16))
    if low and exact == 1:
        # One tf32 tensor-core dot on float32 operands (10-bit mantissas, ~2^-11 relative), as
        # fla's solve merges. Interpret mode on CPU computes it in full float32.
        return lax.dot_general(a.astype(F32), b.astype(F32), dims,
                               precision=(lax.Precision.DEFAULT, lax.Precision.DEFAULT),
                               preferred_element_type=F32)
    if low and exact == 3:
        a1, a2 = split2(a)
        b1, b2 = split2(b)
        return (d(a1, b2) + d(a2, b1)) + d(a1, b1)
    a1, a2, a3 = split3(a)
    b1, b2, b3 = split3(b)
    small = (d(a1, b3) + d(a3, b1)) + d(a2, b2)
    return (small + (d(a1, b2) + d(a2, b1))) + d(a1, b1)


def mm(a, b, low, exact=False):
    return _dot(a, b, _NN, low, exact)


def mm_nt(a, b, low, exact=False):
    return _dot(a, b, _NT, low, exact)


def mm_tn(a, b, low, exact=False):
    return _dot(a, b, _TN, low, exact)


LOG2E = 1.4426950408889634


def exp(x):
    """e^x as 2^(x log2 e), the form every kernel here uses. The Triton lowering sends jnp.exp
    to libdevice's accurate __nv_expf (a range reduction of several float32 instructions around
    the MUFU ex2), jnp.exp2 straight to ex2. The product x log2 e rounds the exponent by
    |x| 2^-24: ~6e-7 relative for |x| <= 10, and beyond that only on terms already below
    e^-10; fla's kernels do the same (gates scaled by 1 / ln 2 once). H200, B4 T4096 H16 D128
    bf16, best of 4 interleaved rounds: KDA fwd 1.029 -> 0.991 ms, fwd+bwd 4.963 -> 4.872;
    GDN (few exps) unchanged within noise."""
    return jnp.exp2(x * LOG2E)


def iota(shape, dim):
    return lax.broadcasted_iota(jnp.int32, shape, dim)


def l2n(x):
    return x * lax.rsqrt(jnp.sum(x * x, axis=1, keepdims=True) + support.L2NORM_EPS)


def l2n_vjp(x, dy):
    """Cotangent of x -> x / sqrt(sum x^2 + eps) (row-wise) at raw x, for output cotangent dy."""
    rinv = lax.rsqrt(jnp.sum(x * x, axis=1, keepdims=True) + support.L2NORM_EPS)
    y = x * rinv
    return rinv * (dy - y * jnp.sum(y * dy, axis=1, keepdims=True))


def row(x, i):
    """Row i (dynamic scalar allowed) of a 2-D value, by a masked reduction."""
    return jnp.sum(jnp.where(iota(x.shape, 0) == i, x, 0.0), axis=0)


def col(x, j):
    return jnp.sum(jnp.where(iota(x.shape, 1) == j, x, 0.0), axis=1)


def last(x):
    """Last element of a 1-D value (scalar) or last row of a 2-D value."""
    if x.ndim == 1:
        return jnp.sum(jnp.where(iota(x.shape, 0) == x.shape[0] - 1, x, 0.0))
    return row(x, x.shape[0] - 1)


def inv_unit_lower_products(m):
    """(I + m)^-1 for strictly lower-triangular m [16, 16] as tensor-core matmuls: m is
    nilpotent (m^16 = 0), so (I + m)^-1 = sum_k (-m)^k = (I - m)(I + m^2)(I + m^4)(I + m^8),
    three squarings and three products instead of a serial chain of 15 row steps (each a
    cross-thread reduction). The dots are the 3-pass hi/lo splits (~2^-16 relative). Measured
    against float64: ~2e-6 relative for L2-normalised keys, up to ~2e-4 for unnormalised
    Gaussian keys, where the powers of m outgrow the inverse and cancel; so it serves bf16
    inputs only (bar 1e-2), and float32 inputs keep the substitution (~1e-7)."""
    n = m.shape[0]
    eye = jnp.where(iota((n, n), 0) == iota((n, n), 1), 1.0, 0.0).astype(F32)
    t = eye - m
    x = m
    for _ in range(3):
        x = _dot(x, x, _NN, True, 3)
        t = t + _dot(t, x, _NN, True, 3)
    return t


def inv_unit_lower_multi(ms):
    """(I + m)^-1 for each strictly lower-triangular m [n, n] (float32) by forward substitution,
    all in one loop: each is a serial chain of n - 1 row steps, and the chains interleave."""
    n = ms[0].shape[0]
    r, c = iota((n, n), 0), iota((n, n), 1)
    cv = iota((n,), 0)
    eye = jnp.where(r == c, 1.0, 0.0).astype(F32)

    def body(i, ts):
        out = []
        for m, t in zip(ms, ts):
            mi = row(m, i)
            new = jnp.where(cv == i, 1.0, 0.0) - jnp.sum(mi[:, None] * t, axis=0)
            out.append(jnp.where(r == i, new[None, :], t))
        return tuple(out)

    return list(lax.fori_loop(1, n, body, tuple(eye for _ in ms)))


def rev_cumsum_vec(x):
    """sum_{t >= s} x_t for a 1-D float32 value, as a masked reduction (no cancellation)."""
    n = x.shape[0]
    return jnp.sum(jnp.where(iota((n, n), 1) >= iota((n, n), 0), x[None, :], 0.0), axis=1)


def exact_masked_sum(mask, x):
    """mask @ x for a 0/1 mask [n, m] and float32 x [m, K], accurate to float32.

    x is split into three bf16 parts and each goes through a bf16 tensor-core dot with float32
    accumulation; products with 0/1 are exact (three dots instead of six).
    """
    m = mask.astype(BF16)
    hi, mid, lo = split3(x)
    out = lax.dot_general(m, lo, _NN, preferred_element_type=F32)
    out = out + lax.dot_general(m, mid, _NN, preferred_element_type=F32)
    return out + lax.dot_general(m, hi, _NN, preferred_element_type=F32)


def rev_cumsum_rows(x):
    """sum_{t >= s} x_t over the rows of a 2-D float32 value."""
    n = x.shape[0]
    return exact_masked_sum(iota((n, n), 1) >= iota((n, n), 0), x)


def suffix_rows(g):
    """sum_{l > i} g_l over the rows of [n, K] gates: exact segment sums (no G_C - G_i)."""
    n = g.shape[0]
    return exact_masked_sum(iota((n, n), 1) > iota((n, n), 0), g)


def seg_matrix(g):
    """seg[i, j] = sum_{j < l <= i} g_l for a 1-D gate (0 where i <= j).

    Summing each segment directly instead of differencing cumulative sums G_i - G_j keeps the
    short segments, which carry the gate gradient under strong decay, exact: G reaches hundreds,
    and G_i - G_j loses |G| * eps absolutely.
    """
    n = g.shape[0]
    x = jnp.where(iota((n, n), 0) > iota((n, n), 1), g[:, None], 0.0)
    return jnp.cumsum(x, axis=0)


def load_f32(ref, idx):
    return ref[idx].astype(F32)


def softplus(x):
    """log(1 + e^x) in float32, as jax.nn.softplus; 0 at x = -inf (a padded raw gate)."""
    return jnp.maximum(x, 0.0) + jnp.log1p(jnp.exp(-jnp.abs(x)))


def load_gate(r, cfg, idx):
    """The scalar gate g (float32) at idx. cfg.gate_act: fla's fused gate, from the raw input
    and the program's head's [] blocks: g = -exp(A_log) softplus(g_raw + dt_bias), so the
    activated [B, T, H] gate is never written to memory; a raw -inf (padding) gives 0."""
    g = load_f32(r["g"], idx)
    if cfg.gate_act:
        g = -jnp.exp(load_f32(r["A_log"], ())) * softplus(g + load_f32(r["dt_bias"], ()))
    return g


def load_beta(r, cfg, idx):
    """beta (float32) at idx: as stored, or cfg.beta_act * sigmoid(logits) (fla's
    use_beta_sigmoid_in_kernel, times 2 with allow_neg_eigval)."""
    b = load_f32(r["beta"], idx)
    if cfg.beta_act:
        b = cfg.beta_act / (1.0 + jnp.exp(-b))
    return b


def load_dot(ref, idx, cfg):
    """A dot operand as stored (bf16 for bf16 inputs; float32 values for float32 inputs, whose
    dots split them exactly). A load that feeds a dot unchanged is staged into shared memory by
    Triton's software pipeliner; a float32 round trip (load, convert, convert back) sends it
    through registers on the sequential path instead (H100, B1 T16384 H16 D128 bf16, the
    DeltaNet state pass: 0.44 ms with k converted, 0.30 ms raw)."""
    x = ref[idx]
    return x if cfg.low else x.astype(F32)


def qk_operand(ref, idx, cfg):
    """q or k as a dot operand, WITHOUT the query scale (callers apply it to the smaller side):
    as stored, or normalised in float32 when cfg.normalize."""
    if cfg.normalize:
        return l2n(ref[idx].astype(F32))
    return load_dot(ref, idx, cfg)


def load_qk(ref, idx, cfg, is_q):
    x = ref[idx].astype(F32)
    if cfg.normalize:
        x = l2n(x)
    if is_q:
        x = x * cfg.scale
    return x


def block_rows(r, cfg, b):
    """Loaders of single rows ([1, K], float32) of sub-block b of the chunk: k (normalised if
    asked) and the raw channel gate g. A dynamic row is a load from the input block (cached),
    not a masked reduction over the block in registers."""
    def k_row(j):
        return load_qk(r["k"], (pl.ds(b * SUB + j, 1), slice(None)), cfg, False)

    def g_row(j):
        return load_f32(r["g"], (pl.ds(b * SUB + j, 1), slice(None)))

    return k_row, g_row


def diag_pairs(y_row, g_row, n, K, fwd):
    """Exact pairwise terms inside one diagonal sub-block (channel gate) for the one-kernel K1,
    one loop over the columns j (descending) that shares each column's decays between terms:
    for each (x, strict) in fwd, Z [n, n] with Z_ij = sum_c x_ic y_jc exp(seg_ijc) for j < i
    (strict) or j <= i, where seg_ijc = sum_{j < l <= i} g_lc and y_j = y_row(j) ([1, K]).
    The segment sums are direct: column j's are column j + 1's plus g_{j+1} (a running sum from
    the diagonal outward, never a difference of cumulative sums), masked, so every exponent is
    <= 0 for g <= 0. (The split K1 and the backward do this per token: K1d, K4d.)
    """
    rows = iota((n, K), 0)
    cc = iota((n, n), 1)
    rv = iota((n,), 0)

    def body(t, carry):
        seg, zs = carry
        j = n - 1 - t
        seg = jnp.where(rows > j, seg + g_row(jnp.minimum(j + 1, n - 1)), 0.0)
        ye = y_row(j) * exp(seg)                            # exp = 1 on rows <= j
        new_z = []
        for (x, strict), z in zip(fwd, zs):
            c = jnp.where(rv > j if strict else rv >= j, jnp.sum(x * ye, axis=1), 0.0)
            new_z.append(jnp.where(cc == j, c[:, None], z))
        return seg, tuple(new_z)

    init = (jnp.zeros((n, K), F32), tuple(jnp.zeros((n, n), F32) for _ in fwd))
    return list(lax.fori_loop(0, n, body, init)[1])


def gate_blocks(r, cfg, nb):
    """Per SUB-row block of the chunk: raw gates and chunk-local cumulative gates (float32)."""
    gs, Gs, base = [], [], None
    for b in range(nb):
        sl = pl.ds(b * SUB, SUB)
        if cfg.gate == "scalar":
            g = load_gate(r, cfg, sl)
            G = jnp.cumsum(g)
        else:
            g = load_f32(r["g"], (sl, slice(None)))
            G = jnp.cumsum(g, axis=0)
        if base is not None:
            G = G + (base if cfg.gate == "scalar" else base[None, :])
        base = last(G)
        gs.append(g)
        Gs.append(G)
    return gs, Gs


def channel_factors(gs):
    """Factors of exp(sum_{j < l <= i} g_l) for i in block I > J containing j (channel gate).

    The product is split at the first row r of block I: fx[I] = exp(sum_{r < l <= i} g_l) and
    fy(I, J) = exp(sum_{j < l <= r} g_l); both exponents are <= 0 for g <= 0 (no overflow), and
    both are direct segment sums (block-local cumsums, exact suffix sums, block totals), never
    differences of chunk-level cumulative sums.
    """
    fx = [block_decay(g) for g in gs]
    suf = [suffix_rows(g) for g in gs]
    tot = [jnp.sum(g, axis=0) for g in gs]
    g0 = [row(g, 0) for g in gs]

    def fy(i, j):
        e = g0[i]
        for l in range(j + 1, i):
            e = e + tot[l]
        return exp(suf[j] + e[None, :])

    return fx, fy


def block_decay(g):
    """exp(sum_{r < l <= i} g_l) over the rows i of one 16-row block of [16, K] gates, r the
    block's first row: the later end's factor of a factored off-diagonal pair."""
    return exp(jnp.cumsum(jnp.where(iota(g.shape, 0) > 0, g, 0.0), axis=0))


def chunk_gates(g, gate):
    """Whole-chunk gate quantities from g [C] or [C, K] (float32).

    Returns (G, GC, gam, kdec, dec): cumulative gate, its last value, exp(G), exp(G_C - G) and
    exp(G_C), each shaped to multiply [C, K] (or [K, V] for dec) values.
    """
    if gate == "scalar":
        G = jnp.cumsum(g)
        GC = last(G)
        return G, GC, exp(G)[:, None], exp(GC - G)[:, None], exp(GC)
    G = jnp.cumsum(g, axis=0)
    GC = last(G)
    return G, GC, exp(G), exp(GC[None, :] - G), exp(GC)[:, None]


def scalar_chunk_gates(r, cfg, sl, n):
    """The scalar gate's (G [C], G_C) of chunk n (rows sl) for the sequential passes: G read
    from K1b's stored chunk-local cumulative gate (cfg.pre_gates; G_C is then its last row, a
    [1] load) or summed here from g. Both broadcast against [C, 1] and [K, BV] values."""
    if cfg.pre_gates:
        return (load_f32(r["gcum"], sl),
                load_f32(r["gcum"], pl.ds(n * cfg.C + cfg.C - 1, 1))[None, :])
    G = jnp.cumsum(load_gate(r, cfg, sl))
    return G, last(G)


def scalar_decay(G, inclusive):
    """D_ij = exp(G_i - G_j) on j <= i (or j < i), 0 elsewhere; masked before the exp."""
    n = G.shape[0]
    r, c = iota((n, n), 0), iota((n, n), 1)
    m = r >= c if inclusive else r > c
    return jnp.where(m, exp(jnp.where(m, G[:, None] - G[None, :], 0.0)), 0.0)


# ---------------------------------------------------------------------------------------------
# Shared by several kernels: K-column pieces, token rows, KDA pair factors, state-pass operands


def k_piece(cfg, block):
    """Columns per piece of a kernel's loop over K: block (capped at K), or the whole row when
    the kernel normalises q and k (the norm and its vjp need the row)."""
    return cfg.K if cfg.normalize else min(block, cfg.K)


def token_rows(r, cfg):
    """Loaders of one token's rows ([BH, K], float32; BH heads) inside a 16-row sub-block held as
    [16, BH, K] refs, at a dynamic row: q (scaled), k (both normalised if asked), raw gate g."""
    def q_(j):
        return load_qk(r["q"], (j, slice(None), slice(None)), cfg, True)

    def k_(j):
        return load_qk(r["k"], (j, slice(None), slice(None)), cfg, False)

    def g_(j):
        return load_f32(r["g"], (j, slice(None), slice(None)))

    return q_, k_, g_


def pair_factors(g, fx=True):
    """Gate quantities of one 16-row block [16, BK] for its factored off-diagonal pairs:
    (fx, suf, tot, g0) with Gx_i = sum_{0 < l <= i} g_l (a cumsum of the gates after the block's
    first row r): fx = exp(Gx), the later end's factor exp(sum_{r < l <= i} g_l); suf_j =
    sum_{l > j} g_l = Gx_15 - Gx_j, the earlier end's in-block exponent (exactly 0 on the last
    row; differences of block-local sums, so the rounding is |16 g| eps on terms that are
    themselves exp(-|suf|) small); tot = the block's gate total and g0 = g_r ([BK] each).
    Every exponent is <= 0 for g <= 0 (a rounded cumsum of non-positive terms never rises).
    fx=False skips exp(Gx) (returned as None) for a block that is never a later end."""
    g0 = row(g, 0)
    gx = jnp.cumsum(jnp.where(iota(g.shape, 0) > 0, g, 0.0), axis=0)
    end = last(gx)
    return exp(gx) if fx else None, end[None, :] - gx, end + g0, g0


def pair_exponent(facs, i, j):
    """exp argument's block part for the pair of blocks (i > j), shared by every row j' of j:
    the gates from block j's end to block i's first row, g_r(i) + the totals in between."""
    e = facs[i][3]
    for l in range(j + 1, i):
        e = e + facs[l][2]
    return e[None, :]


def qk_piece(r, name, b, kp, cfg):
    """Rows of block b, columns kp, of q (scaled) or k; with in-kernel normalisation kp is the
    whole row (callers use one piece then)."""
    return load_qk(r[name], (pl.ds(b * SUB, SUB), kp), cfg, name == "q")


def chunk_range(r, cfg, nt_static):
    if cfg.varlen:
        s = pl.program_id(0)
        return r["offs"][s], r["offs"][s + 1]
    return 0, nt_static


def gated_chunk(r, cfg, sl, n, with_q=True):
    """The channel gate's (Gam q, exp(G_C - G) k, exp(G_C)) of one chunk for the state passes:
    stored by K1b (cfg.pre_gates, loaded as dot operands) or formed here from q, k and g.
    with_q=False (the forward pass, which has no q term) returns None for Gam q, unloaded."""
    rows = (sl, slice(None))
    if cfg.pre_gates:
        qg = load_dot(r["qg"], rows, cfg) if with_q else None
        return qg, load_dot(r["kg"], rows, cfg), load_f32(r["gend"], (n, slice(None)))[:, None]
    _, _, gam, kdec, dec = chunk_gates(load_f32(r["g"], rows), "channel")
    qg = load_qk(r["q"], rows, cfg, True) * gam if with_q else None
    return qg, load_qk(r["k"], rows, cfg, False) * kdec, dec


def chunk_cumulative_gate(r, cfg):
    """The scalar gate's cumulative gate G of the whole chunk for the parallel kernels: K1b's
    stored one (cfg.pre_gates) or summed here from g; None for the other gates."""
    if cfg.gate != "scalar":
        return None
    if cfg.pre_gates:
        return load_f32(r["gcum"], slice(None))
    return jnp.cumsum(load_gate(r, cfg, slice(None)))


def chunk_p(r, cfg, G):
    """P of one chunk for the parallel kernels: mask(q k^T) * scale * decay (no gate, scalar
    gate with cumulative gate G; q, k as dot operands) or K1's stored P (channel gate, which
    includes the scale)."""
    all_ = (slice(None), slice(None))
    if cfg.gate == "channel":
        return load_dot(r["p"], all_, cfg)
    return p_from_qk(qk_operand(r["q"], all_, cfg), qk_operand(r["k"], all_, cfg), cfg, G)


def p_from_qk(q, k, cfg, G):
    """P = mask(q k^T) * scale (* exp(G_i - G_j)) of one chunk, from q, k as dot operands."""
    C = cfg.C
    p = mm_nt(q, k, cfg.low)
    if G is None:
        return jnp.where(iota((C, C), 0) >= iota((C, C), 1), p * cfg.scale, 0.0)
    return p * (cfg.scale * scalar_decay(G, True))
