"""Kernel bodies of the GPU (Pallas, Triton lowering) exact chunked delta family.

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

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

F32 = jnp.float32
BF16 = jnp.bfloat16
SUB = 16            # sub-block rows: the smallest tile a Triton tensor-core dot takes
NORM_EPS = 1e-6     # in-kernel L2 normalisation: x / sqrt(sum x^2 + eps), as fla's l2norm

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
    return x * lax.rsqrt(jnp.sum(x * x, axis=1, keepdims=True) + NORM_EPS)


def l2n_vjp(x, dy):
    """Cotangent of x -> x / sqrt(sum x^2 + eps) (row-wise) at raw x, for output cotangent dy."""
    rinv = lax.rsqrt(jnp.sum(x * x, axis=1, keepdims=True) + NORM_EPS)
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
            g = load_f32(r["g"], sl)
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
    G = jnp.cumsum(load_f32(r["g"], sl))
    return G, last(G)


def scalar_decay(G, inclusive):
    """D_ij = exp(G_i - G_j) on j <= i (or j < i), 0 elsewhere; masked before the exp."""
    n = G.shape[0]
    r, c = iota((n, n), 0), iota((n, n), 1)
    m = r >= c if inclusive else r > c
    return jnp.where(m, exp(jnp.where(m, G[:, None] - G[None, :], 0.0)), 0.0)


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
    bs = [load_f32(r["beta"], pl.ds(b * SUB, SUB)) for b in range(nb)]

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
                a = a * scalar_decay(jnp.cumsum(load_f32(r["g"], slice(None))), False)
            else:
                a = jnp.where(iota((C, C), 0) > iota((C, C), 1), a, 0.0)
            # The split solve has a float32 scratch buffer (its T output may be bf16); the
            # one-kernel K1 uses its float32 T buffer.
            src = r["ascr"] if "ascr" in r else r["tmat"]
            src[:, :] = load_f32(r["beta"], slice(None))[:, None] * a
            barrier(cfg)
        M = {(i, j): load_f32(src, (pl.ds(i * SUB, SUB), pl.ds(j * SUB, SUB)))
             for i in range(nb) for j in range(i + 1)}
        if src is r["tmat"]:
            barrier(cfg)      # every block is read before the inverse overwrites the buffer
    else:
        ks, vs, qs = [], [], []
        for b in range(nb):
            sl = pl.ds(b * SUB, SUB)
            ks.append(load_qk(r["k"], (sl, slice(None)), cfg, False))
            if not cfg.wide and part == "all":
                vs.append(load_f32(r["v"], (sl, slice(None))))
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

    xs, ys = [], []
    for j in range(nb):
        x = bs[j][:, None] * ks[j]
        if cfg.gate == "scalar":
            x = x * exp(Gs[j])[:, None]
        elif cfg.gate == "channel":
            x = x * exp(Gs[j])
        xs.append(x)
        ys.append(bs[j][:, None] * vs[j])
    for i in range(nb):
        sl = pl.ds(i * SUB, SUB)
        w = mm(T[i, 0], xs[0], low)
        u = mm(T[i, 0], ys[0], low)
        for j in range(1, i + 1):
            w = w + mm(T[i, j], xs[j], low)
            u = u + mm(T[i, j], ys[j], low)
        r["w"][sl, :] = w.astype(r["w"].dtype)
        r["u0"][sl, :] = u.astype(r["u0"].dtype)
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
    beta = load_f32(r["beta"], slice(None))[:, None]
    x = beta * load_qk(r["k"], all_, cfg, False)
    if cfg.gate == "scalar":
        G = jnp.cumsum(load_f32(r["g"], slice(None)))
        x = x * exp(G)[:, None]
        if cfg.pre_gates:
            r["gcum"][:] = G
    r["w"][:, :] = mm(t, x, cfg.low).astype(r["w"].dtype)
    r["u0"][:, :] = mm(t, beta * load_f32(r["v"], all_), cfg.low).astype(r["u0"].dtype)


def k_piece(cfg, block):
    """Columns per piece of a kernel's loop over K: block (capped at K), or the whole row when
    the kernel normalises q and k (the norm and its vjp need the row)."""
    return cfg.K if cfg.normalize else min(block, cfg.K)


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
    beta = load_f32(r["beta"], slice(None))
    tu = t * beta[None, :]
    tw = tu
    if cfg.gate == "scalar":
        G = jnp.cumsum(load_f32(r["g"], slice(None)))
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
    qi, ki = q_(i), k_(i)
    cols = iota((qi.shape[0], SUB), 1)
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

    lax.fori_loop(0, i, body, jnp.zeros_like(ki))


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
# K2 / K3: sequential state passes (parallel over sequences, heads and V blocks)


def _load_chunk(r, cfg, sl):
    """q, k of one chunk (q scaled, both normalised if asked) and its gate quantities for the
    state passes: (q, k, G, exp(G), exp(G_C - G), exp(G_C)); the last four None without a gate."""
    q = load_qk(r["q"], (sl, slice(None)), cfg, True)
    k = load_qk(r["k"], (sl, slice(None)), cfg, False)
    if cfg.gate == "none":
        return q, k, None, None, None, None
    g = load_f32(r["g"], sl if cfg.gate == "scalar" else (sl, slice(None)))
    G, _, gam, kdec, dec = chunk_gates(g, cfg.gate)
    return q, k, G, gam, kdec, dec


def _chunk_operators(r, cfg, sl, n):
    """Loads one chunk for the state passes: (q*Gam, k*exp(G_C-G), w, P, decay of S)."""
    C, low = cfg.C, cfg.low
    w = r["w"][sl, :]
    if cfg.gate == "channel":
        qg, kd, dec = _gated_chunk(r, cfg, sl, n)
        return qg, kd, w, load_dot(r["p"], (sl, slice(None)), cfg), dec
    q, k, G, gam, kdec, dec = _load_chunk(r, cfg, sl)
    p = mm_nt(q, k, low)
    if cfg.gate == "none":
        return q, k, w, jnp.where(iota((C, C), 0) >= iota((C, C), 1), p, 0.0), None
    return q * gam, k * kdec, w, p * scalar_decay(G, True), dec


def _chunk_range(r, cfg, nt_static):
    if cfg.varlen:
        s = pl.program_id(0)
        return r["offs"][s], r["offs"][s + 1]
    return 0, nt_static


def state_fwd_kernel(r, cfg: KernelCfg, nt_static: int):
    C, K, BV, low = cfg.C, cfg.K, cfg.block_v, cfg.low
    lo, hi = _chunk_range(r, cfg, nt_static)
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


def state_fwd_lean_kernel(r, cfg: KernelCfg, nt_static: int):
    """K2, lean: only the recurrence, two dots per chunk on the sequential path.

    Per chunk: stores h = S (the chunk's start state), U = U0 - W S ("v_new"), then
    S <- exp(G_C) S + (exp(G_C - G) k)^T U. The scalar gate scales U's rows instead of k's
    ([C, BV] products, not [C, K]; as fla's fwd_h), the channel gate's exp(G_C - G) k comes from
    K1b, and every dot operand is loaded as stored (`load_dot`). H100, B1 T16384 H16 D128 bf16,
    the scalar-gate pass alone: 0.56 ms with k gated and converted in registers, 0.33 like
    this. The output comes from `output_kernel`, in parallel over chunks.
    """
    C, K, BV, low = cfg.C, cfg.K, cfg.block_v, cfg.low
    lo, hi = _chunk_range(r, cfg, nt_static)
    s = load_f32(r["s0"], (slice(None), slice(None))) if cfg.has_s0 else jnp.zeros((K, BV), F32)

    def body(n, s):
        sl = pl.ds(n * C, C)
        r["h"][n, :, :] = s.astype(r["h"].dtype)
        u = load_f32(r["u0"], (sl, slice(None))) - mm(r["w"][sl, :], s, low)
        r["vn"][sl, :] = u.astype(r["vn"].dtype)
        if cfg.gate == "channel":
            _, kd, dec = _gated_chunk(r, cfg, sl, n, with_q=False)
            return dec * s + mm_tn(kd, u, low)
        k = qk_operand(r["k"], (sl, slice(None)), cfg)
        if cfg.gate == "none":
            return s + mm_tn(k, u, low)
        G, GC = scalar_chunk_gates(r, cfg, sl, n)
        return exp(GC) * s + mm_tn(k, u * exp(GC - G[:, None]), low)

    s = lax.fori_loop(lo, hi, body, s)
    r["sT"][:, :] = s


def _chunk_cumulative_gate(r, cfg):
    """The scalar gate's cumulative gate G of the whole chunk for the parallel kernels: K1b's
    stored one (cfg.pre_gates) or summed here from g; None for the other gates."""
    if cfg.gate != "scalar":
        return None
    if cfg.pre_gates:
        return load_f32(r["gcum"], slice(None))
    return jnp.cumsum(load_f32(r["g"], slice(None)))


def _chunk_p(r, cfg, G):
    """P of one chunk for the parallel kernels: mask(q k^T) * scale * decay (no gate, scalar
    gate with cumulative gate G; q, k as dot operands) or K1's stored P (channel gate, which
    includes the scale)."""
    all_ = (slice(None), slice(None))
    if cfg.gate == "channel":
        return load_dot(r["p"], all_, cfg)
    return _p_from_qk(qk_operand(r["q"], all_, cfg), qk_operand(r["k"], all_, cfg), cfg, G)


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
    G = _chunk_cumulative_gate(r, cfg)
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
    o = qh + mm(_chunk_p(r, cfg, G), r["vn"][:, :], low)
    r["o"][:, :] = o.astype(r["o"].dtype)


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
    lo, hi = _chunk_range(r, cfg, nt_static)
    ds = load_f32(r["dsT"], (slice(None), slice(None))) if cfg.has_dsT else jnp.zeros((K, BV), F32)
    all_k = slice(None)

    def body(i, ds):
        n = hi - 1 - i
        sl = pl.ds(n * C, C)
        r["dh"][n, :, :] = ds.astype(r["dh"].dtype)
        do = load_dot(r["do"], (sl, all_k), cfg)
        w = r["w"][sl, :]
        if cfg.gate == "channel":
            qg, kd, dec = _gated_chunk(r, cfg, sl, n)
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


def _gated_chunk(r, cfg, sl, n, with_q=True):
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


def _p_from_qk(q, k, cfg, G):
    """P = mask(q k^T) * scale (* exp(G_i - G_j)) of one chunk, from q, k as dot operands."""
    C = cfg.C
    p = mm_nt(q, k, cfg.low)
    if G is None:
        return jnp.where(iota((C, C), 0) >= iota((C, C), 1), p * cfg.scale, 0.0)
    return p * (cfg.scale * scalar_decay(G, True))


def state_bwd_kernel(r, cfg: KernelCfg, nt_static: int):
    """K3: the reverse state pass, recomputing P and P^T dO of each chunk on the way."""
    def du_local(sl, n, do, q, k, G):
        if cfg.gate == "channel":
            return mm_tn(load_dot(r["p"], (sl, slice(None)), cfg), do, cfg.low)
        return mm_tn(_p_from_qk(q, k, cfg, G), do, cfg.low)

    _reverse_state_pass(r, cfg, nt_static, du_local)


def du_local_kernel(r, cfg: KernelCfg):
    """K3a: the state-free part of dU, P^T dO, of one chunk and V block, all chunks in parallel
    (fla's dv_local). The lean reverse state pass adds (exp(G_C - G) k) dS to it."""
    all_ = (slice(None), slice(None))
    p = _chunk_p(r, cfg, _chunk_cumulative_gate(r, cfg))
    r["du"][:, :] = mm_tn(p, load_dot(r["do"], all_, cfg), cfg.low)


def state_bwd_lean_kernel(r, cfg: KernelCfg, nt_static: int):
    """K3, lean: three dots per chunk and no P on the sequential path; dU_local comes from K3a
    and dU is written over it (the same buffer)."""
    _reverse_state_pass(r, cfg, nt_static, lambda sl, n, do, q, k, G: r["du_local"][sl, :])


# ---------------------------------------------------------------------------------------------
# K4: intra-chunk backward (parallel over chunks)


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
    qi, ki = q_(i), k_(i)
    cols = iota((qi.shape[0], SUB), 1)

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

    zero = jnp.zeros_like(ki)
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
