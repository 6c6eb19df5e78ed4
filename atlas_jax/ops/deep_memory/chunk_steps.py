"""One inner step per chunk from a segment's start: titans-pytorch's schedule, as an op.

titans-pytorch's ``NeuralMemory`` (the Titans code most people run) does not take Titans §3.2's
per-token steps, which the ``titans`` preset takes. It takes one step per chunk n of C tokens:

    G_n = Σ_{t ∈ n} β_t ∇_θ ℓ(θ_s; k_t, v_t)    the chunk's gradients, all at θ_s: the weights at the
                                                 start of the chunk's segment
    m_n = η_n m_{n−1} − G_n                      momentum, one gate per chunk
    θ_n = α_n θ_{n−1} + m_n                      decay, one gate per chunk        (θ_{−1} = θ_0)
    o_t = M_{θ_{r(t)}}(q_t),  r(t) = ⌊(t+1)/C⌋ − 1

Every token reads the weights after the chunks before it, and a chunk's last token reads the
weights after its own chunk (r = −1 reads θ_0). A segment is ``segment`` tokens, a multiple of C:
its chunks share one gradient point θ_s, the weights after the segment before.
- ``segment=None`` (titans-pytorch's default ``batch_size=None``): every gradient is taken at θ_0.
  Nothing chains chunk to chunk: the chunks' gradients are one batched call, momentum and decay
  linear recurrences over chunks, the reads one batched call. This is a much cheaper computation
  than the ``titans`` preset's, where each chunk's gradients are taken at the chunk's own start.
- ``segment=C`` (``batch_size=C``) takes each chunk's gradients at the weights after the chunk
  before, a chain of T/C steps. The chain amplifies perturbations: at B1 T4096 H8 D128 a relative
  perturbation of v moved the last output ~45× as far as without the chain. So bf16 q, k, v end
  up ~0.2 relative from float32 there (a float32 call agrees with the reference at 5e-6).

Tokens after the last complete chunk are read (with the weights after the last chunk) and not
written: titans-pytorch keeps them for its next call. The final state is therefore only returned
when T is a multiple of C.

Conventions are this library's: ℓ is an `atlas_jax.objectives` objective (ℓ2 is ½‖M(k) − v‖²;
titans-pytorch's is the mean over channels of (M(k) − v)², so its lr is β · d / 2 here), gates
are log-space (α = exp(g); titans-pytorch's decay factor is 1 − α), states are float32, and the
memory's products take q, k, v's dtype (bf16 stays bf16, accumulated in float32).

impl="recurrent" is the reference: a ``lax.scan`` over chunks that takes every token's gradient on
its own and reads every chunk as the equations above say. impl="chunk" (and "auto") is the
segment-parallel form, in plain XLA: a segment's chunk gradients in one batched call; momentum and
decay as products with [n, n] matrices of gate products over blocks of up to 64 chunks
(`_momentum_and_decay`); the reads as one batched call on every θ_{n−1}. Its memory holds one
θ-sized value per chunk (the θ_{n−1} the reads take, in q's dtype), as titans-pytorch's does.
"""

from __future__ import annotations

from functools import partial
from typing import NamedTuple

import jax
import jax.numpy as jnp

from atlas_jax.forms.common import window_gradient
from atlas_jax.memory import MemoryArch
from atlas_jax.objectives import L2, Objective

IMPLS = ("recurrent", "chunk", "auto")


class ChunkStepState(NamedTuple):
    """The weights θ and the momentum m after the last chunk; leaves [B, H, ...], float32."""

    params: dict
    momentum: dict


def _check(q, k, v, beta, nu, g, params, momentum, gradient_params, restarts, memory, objective, chunk_size,
           segment, impl, output_final_state):
    """Raises on bad input, naming the argument; returns θ's leaf shapes for one head."""
    where = "chunk_step_memory"
    if impl not in IMPLS:
        raise ValueError(f"{where}: impl must be one of {IMPLS}, got {impl!r}")
    if not isinstance(memory, MemoryArch):
        raise TypeError(f"{where}: memory must be an atlas_jax.memory.MemoryArch (e.g. MLPMemory(2)), "
                        f"got {type(memory).__name__}")
    if not isinstance(objective, Objective):
        raise TypeError(f"{where}: objective must be an atlas_jax.objectives.Objective, got {type(objective).__name__}")
    if not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(f"{where}: chunk_size must be a positive int, got {chunk_size!r}")
    if segment is not None and (not isinstance(segment, int) or segment < chunk_size or segment % chunk_size):
        raise ValueError(f"{where}: segment must be None (one gradient point for the whole sequence) or a "
                         f"multiple of chunk_size={chunk_size}, got {segment!r}")
    if q.ndim != 4 or k.shape != q.shape or v.shape[:3] != q.shape[:3]:
        raise ValueError(f"{where}: q, k must be [B, T, H, D] and v [B, T, H, Dv] with the same B, T, H; got "
                         f"q {q.shape}, k {k.shape}, v {v.shape}")
    B, T, H, _ = q.shape
    n_chunks = T // chunk_size
    if n_chunks < 1:
        raise ValueError(f"{where}: T={T} holds no complete chunk of chunk_size={chunk_size}; nothing would be "
                         "written to the memory — use a smaller chunk_size")
    if beta.shape != (B, T, H):
        raise ValueError(f"{where}: beta (the per-token step size) must be [B, T, H] = {(B, T, H)}, got {beta.shape}")
    for name, gate in (("nu", nu), ("g", g)):
        if gate.shape != (B, n_chunks, H):
            raise ValueError(f"{where}: {name} holds one gate per complete chunk: [B, T // chunk_size, H] = "
                             f"{(B, n_chunks, H)}, got {gate.shape}")
    if restarts is not None:
        if restarts.shape != (B, n_chunks):
            raise ValueError(f"{where}: restarts marks the complete chunks a new sequence begins at: [B, T // chunk_size] "
                             f"= {(B, n_chunks)}, got {restarts.shape}")
        if segment is not None and segment != chunk_size:
            raise ValueError(f"{where}: restarts need segment None or segment == chunk_size={chunk_size} (a restart "
                             f"would move the boundaries of longer segments), got segment={segment}")
        if gradient_params is not None:
            raise ValueError(f"{where}: restarts and gradient_params cannot be combined (a restart returns to "
                             "params); continue a sequence without restarts, or restart from params")
    if output_final_state and T % chunk_size:
        raise ValueError(f"{where}: T={T} is not a multiple of chunk_size={chunk_size}: its last {T % chunk_size} "
                         "tokens are read but not written, so there is no final state after them — pass "
                         "output_final_state=False or a whole number of chunks")
    expected = jax.eval_shape(lambda: memory.init(jax.random.PRNGKey(0), q.shape[-1], v.shape[-1]))
    for name, tree in (("params", params), ("momentum", momentum), ("gradient_params", gradient_params)):
        if tree is None:
            continue
        if jax.tree.structure(tree) != jax.tree.structure(expected):
            raise ValueError(f"{where}: {name} must have the leaves of {memory.describe()}'s θ "
                             f"({sorted(expected)}), got {jax.tree.structure(tree)}")
        for path, leaf, base in zip(jax.tree_util.tree_flatten_with_path(tree)[0], jax.tree.leaves(tree),
                                    jax.tree.leaves(expected)):
            if leaf.shape not in ((H,) + base.shape, (B, H) + base.shape):
                raise ValueError(f"{where}: {name}{jax.tree_util.keystr(path[0])} must be [H, ...] = "
                                 f"{(H,) + base.shape} or [B, H, ...] = {(B, H) + base.shape}, got {leaf.shape}")
    return expected


def _step_gradient(memory, objective, theta, k, v, beta):
    """Σ_t β_t ∇_θ ℓ(θ; k_t, v_t) over the rows of k, v (one sequence and head): the core's one-VJP
    gradient, with the targets in float32 so that the objective's gradient is taken in float32."""
    return window_gradient(memory, objective, theta, k, v.astype(jnp.float32), beta, None)


def _gates(nu, g):
    f32 = lambda x: jnp.asarray(x, jnp.float32)
    return f32(nu), jnp.exp(f32(g))


def _bh(x):
    """[B, T, H, ...] -> [B, H, T, ...]"""
    return jnp.moveaxis(x, 2, 1)


# ---- the reference: one chunk at a time --------------------------------------------------------
def _reference(memory, objective, q, k, v, beta, nu, g, theta0, m0, point0, restarts, chunk_size, segment,
               padding_before_restarts=False):
    B, T, H, _ = q.shape
    C, N = chunk_size, T // chunk_size
    per_segment = N if segment is None else segment // C
    eta, alpha = _gates(nu, g)
    qs, ks, vs, betas = _bh(q), _bh(k), _bh(v), _bh(jnp.asarray(beta, jnp.float32))
    eta, alpha = jnp.moveaxis(eta, 2, 1), jnp.moveaxis(alpha, 2, 1)
    restarts = jnp.moveaxis(jnp.zeros((B, N, H), bool) if restarts is None else
                            jnp.broadcast_to(restarts[..., None], (B, N, H)), 2, 1)

    def one_head(qh, kh, vh, bh, eh, ah, rh, theta, m, point):
        start = theta
        def token_gradient(point, kt, vt, bt):
            return _step_gradient(memory, objective, point, kt[None], vt[None], bt[None])

        def chunk(carry, n):
            point, theta, m = carry
            # a new segment takes its gradients at the weights after the segment before (the first
            # at the point given)
            new_segment = (n % per_segment == 0) & (n > 0)
            point = jax.tree.map(lambda p, w: jnp.where(new_segment, w, p), point, theta)
            # a new sequence: θ, its gradient point and the momentum return to the call's start
            restart = rh[n]
            point, theta = (jax.tree.map(lambda x, s: jnp.where(restart, s, x), tree, start) for tree in (point, theta))
            m = jax.tree.map(lambda x: jnp.where(restart, 0.0, x), m)
            kc, vc, bc, qc = (jax.lax.dynamic_slice_in_dim(x, n * C, C) for x in (kh, vh, bh, qh))
            grads = jax.vmap(token_gradient, in_axes=(None, 0, 0, 0))(point, kc, vc, bc)
            G = jax.tree.map(lambda x: jnp.sum(x, axis=0), grads)
            before = memory.apply(theta, qc)                      # the chunk's first C − 1 tokens
            m = jax.tree.map(lambda mm, gg: eh[n] * mm - gg, m, G)
            theta = jax.tree.map(lambda w, mm: ah[n] * w + mm, theta, m)
            after = memory.apply(theta, qc[-1:])                  # its last token
            if padding_before_restarts:   # padding before the next chunk's restart: read at its start
                restarts_next = rh[jnp.minimum(n + 1, N - 1)] & (n + 1 < N)
                after = jnp.where(restarts_next, memory.apply(start, qc[-1:]), after)
            out = jnp.concatenate([before[:-1], after], axis=0)
            return (point, theta, m), out

        (_, theta, m), outs = jax.lax.scan(chunk, (point, theta, m), jnp.arange(N))
        outs = outs.reshape((N * C,) + outs.shape[2:])
        tail = memory.apply(theta, qh[N * C:])                    # read, not written
        return jnp.concatenate([outs, tail], axis=0), theta, m

    o, theta, m = jax.vmap(jax.vmap(one_head))(qs, ks, vs, betas, eta, alpha, restarts, theta0, m0, point0)
    return jnp.moveaxis(o, 1, 2), theta, m


# ---- the segment-parallel form -----------------------------------------------------------------
# A block's linear recurrence is one product with an [n, n] matrix of gate products; blocks of this
# many chunks keep that product's n² per parameter small against the parameters' own traffic.
BLOCK = 64
# jax.named_scope names of the parallel form's parts: a profile attributes its kernels to them
# (benchmarks/deep_memory.py --trace).
SCOPES = {"gradients": "chunk_steps_gradients", "momentum_decay": "chunk_steps_momentum_decay",
          "reads": "chunk_steps_reads", "restart_reads": "chunk_steps_restart_reads"}


def _over_segments(step, carry, xs, size):
    """``step(carry, xs_segment) -> (carry, ys_segment)`` over segments of ``size`` chunks along axis 2
    of every leaf of ``xs`` ([B, H, N, ...]): a scan over the whole segments, then the rest; ys
    joined on axis 2."""
    N = jax.tree.leaves(xs)[0].shape[2]
    whole, rest = divmod(N, size)
    parts = []
    if whole == 1:
        carry, ys = step(carry, jax.tree.map(lambda x: x[:, :, :size], xs))
        parts.append(ys)
    elif whole > 1:
        split = lambda x: jnp.moveaxis(x[:, :, :whole * size].reshape(x.shape[:2] + (whole, size) + x.shape[3:]), 2, 0)
        carry, ys = jax.lax.scan(step, carry, jax.tree.map(split, xs))
        parts.append(jax.tree.map(lambda y: jnp.moveaxis(y, 0, 2).reshape(y.shape[1:3] + (-1,) + y.shape[4:]), ys))
    if rest:
        carry, ys = step(carry, jax.tree.map(lambda x: x[:, :, whole * size:], xs))
        parts.append(ys)
    return carry, (parts[0] if len(parts) == 1 else jax.tree.map(lambda *y: jnp.concatenate(y, axis=2), *parts))


def _products(gates):
    """P[i, j] = Π_{j < k ≤ i} gates_k for j ≤ i, else 0 (gates [B, H, n]): products, not exp of
    log-sums, so a gate of exactly 0 is exact and has a gradient."""
    n = gates.shape[-1]
    i, j, k = (jnp.arange(n)[:, None, None], jnp.arange(n)[None, :, None], jnp.arange(n)[None, None, :])
    inside = (j < k) & (k <= i)
    full = jnp.prod(jnp.where(inside, gates[..., None, None, :], 1.0), axis=-1)
    return jnp.where(j[..., 0] <= i[..., 0], full, 0.0)


def _blocks(n: int) -> tuple[int, int]:
    """(blocks, size): the fewest blocks of at most ``BLOCK`` chunks, all of one size; blocks·size
    may pass n by fewer than ``blocks`` chunks, which the caller pads."""
    if n <= BLOCK:
        return 1, n
    blocks = -(-n // BLOCK)
    return blocks, -(-n // blocks)


def _momentum_and_decay(eta, alpha, G, m0, theta0, dtype, restart=None, origin=None, end_row=None,
                        restarted_rows_read_origin=False):
    """m_n = η_n m_{n−1} − G_n, θ_n = α_n θ_{n−1} + m_n over the chunk axis 2 (gates [B, H, N], G
    leaves [B, H, N, ...], N = blocks·size of `_blocks`). Returns every θ_{n−1} (n = 0..N−1: what
    the reads take) in ``dtype`` and the last θ and m in float32. In a block of chunks that starts
    from (m, θ):

        m_i = E_i m − Σ_j Lη_ij G_j,    θ_i = A_i θ + Σ_l Lα_il m_l
            = A_i θ + (Lα E)_i m − Σ_j (Lα Lη)_ij G_j

    with Lη_ij = Π_{j<k≤i} η_k, E_i = Π_{k≤i} η_k (Lα, A the same of α): one product of an [n, n]
    matrix with the block's G per leaf, and no θ-sized value per chunk but the θ_{n−1} returned.
    Every block's own part is computed at once; the blocks' start states are then a short scan of
    θ-sized steps, one per block (none up to ``BLOCK`` chunks).

    ``end_row``: the chunks from it on are the caller's padding (G = 0, η = 1, so m is unchanged
    through them): the θ returned is then θ_{end_row − 1}, row ``end_row`` of the θ_{n−1}, in
    float32. ``restart`` [B, H, N] (1.0 where a new sequence begins before the chunk) returns m to
    zero and θ to ``origin`` there: η and α become η(1 − r), α(1 − r) and θ takes a source
    c_i θ_origin with c = α r, so θ_i gains Z_i θ_origin, Z = Lα c. A restarted chunk's θ_{i−1} is
    the weights before the restart (what the chunk before's last token reads), or with
    ``restarted_rows_read_origin`` θ_origin (what the restarted chunk's other tokens read)."""
    exact = jax.lax.Precision.HIGHEST
    f32 = dtype == jnp.float32
    N = eta.shape[-1]
    blocks, size = _blocks(N)
    if blocks * size != N:
        raise ValueError(f"_momentum_and_decay: {N} chunks are not {blocks} blocks of one size; pad them to "
                         f"{blocks * size} (chunk_steps._blocks)")
    lead = eta.shape[:2]
    # gates [B, H, blocks, size], G leaves [B, H, blocks, size, ...]
    split = lambda x: x.reshape(lead + (blocks, size) + x.shape[3:])
    e, a = split(eta), split(alpha)
    if restart is not None:
        r = split(restart)
        e, a, c = e * (1.0 - r), a * (1.0 - r), a * r
    L_eta, L_alpha = _products(e), _products(a)
    E, A = jnp.cumprod(e, axis=-1), jnp.cumprod(a, axis=-1)
    W = jnp.einsum("...il,...lj->...ij", L_alpha, L_eta, precision=exact)
    Wm = jnp.einsum("...il,...l->...i", L_alpha, E, precision=exact)
    # θ_{i−1}'s coefficients: rows shifted down by one; row 0 is the block's start
    W_before = jnp.concatenate([jnp.zeros_like(W[..., :1, :]), W[..., :-1, :]], axis=-2)
    Wm_before = jnp.concatenate([jnp.zeros_like(Wm[..., :1]), Wm[..., :-1]], axis=-1)
    A_before = jnp.concatenate([jnp.ones_like(A[..., :1]), A[..., :-1]], axis=-1)
    if restart is not None:
        # θ_origin's share of θ_i and of θ_{i−1} (a restarted chunk's θ_{i−1} is the sequence
        # before's last: its last token reads it; the caller reads its other tokens at θ_origin)
        Z = jnp.einsum("...il,...l->...i", L_alpha, c, precision=exact)
        Z_before = jnp.concatenate([jnp.zeros_like(Z[..., :1]), Z[..., :-1]], axis=-1)
    flat = lambda x: x.reshape(x.shape[:4] + (-1,))            # [B, H, blocks, size, P]

    # Where several blocks chain, every block's last θ and m are needed: they join θ_{i−1}'s rows in
    # one product, which reads each G once (B1 T16384 H8 D128 bf16 on an H200: 8.6 -> 7.7 ms fwd+bwd).
    # A single block's are dead unless the caller keeps the final state; apart, XLA drops them
    # (joined, B4 T4096 was 6.5 -> 6.8 ms: the backward pads their zero cotangent rows in).
    joined = blocks > 1

    def own_parts(gg):
        """The block's θ_{i−1}, θ_end and m_end from a zero start, float32."""
        gg = flat(split(gg))
        product = lambda rows: jnp.einsum("BHNij,BHNjP->BHNiP", rows.astype(dtype), gg.astype(dtype),
                                          preferred_element_type=jnp.float32, precision=exact if f32 else None)
        if joined:
            out = product(jnp.concatenate([W_before, W[..., -1:, :], L_eta[..., -1:, :]], axis=-2))
            return -out[..., :size, :], -out[..., size, :], -out[..., size + 1, :]
        theta_end = jnp.einsum("BHNj,BHNjP->BHNP", W[..., -1, :], gg.astype(jnp.float32), precision=exact)
        m_end = jnp.einsum("BHNj,BHNjP->BHNP", L_eta[..., -1, :], gg.astype(jnp.float32), precision=exact)
        return -product(W_before), -theta_end, -m_end

    parts = jax.tree.map(own_parts, G)
    before_own, theta_own, m_own = (jax.tree.map(lambda p, i=i: p[i], parts, is_leaf=lambda x: isinstance(x, tuple))
                                    for i in range(3))
    flat_state = lambda x: x.reshape(lead + (-1,))
    if restart is not None:
        flat_origin = jax.tree.map(flat_state, origin)           # [B, H, P]
        theta_own = jax.tree.map(lambda t, o: t + Z[..., -1:] * o[:, :, None, :], theta_own, flat_origin)
    m_start, theta_start = jax.tree.map(flat_state, m0), jax.tree.map(flat_state, theta0)

    def across(carry, xs):
        """One block: its start state, then its end state from the start and its own part."""
        m, theta = carry
        e_last, a_last, wm_last, t_own, m_o = xs
        col = lambda c: c[:, :, None]
        new_m = jax.tree.map(lambda mm, o: col(e_last) * mm + o, m, m_o)
        new_theta = jax.tree.map(lambda w, mm, o: col(a_last) * w + col(wm_last) * mm + o, theta, m, t_own)
        return (new_m, new_theta), (m, theta)

    block_first = lambda x: jnp.moveaxis(x, 2, 0)
    xs = (block_first(E[..., -1]), block_first(A[..., -1]), block_first(Wm[..., -1]),
          jax.tree.map(block_first, theta_own), jax.tree.map(block_first, m_own))
    if blocks == 1:
        (m_end, theta_end), starts = across((m_start, theta_start), jax.tree.map(lambda x: x[0], xs))
        starts = jax.tree.map(lambda x: x[:, :, None], starts)
    else:
        (m_end, theta_end), starts = jax.lax.scan(across, (m_start, theta_start), xs)
        starts = jax.tree.map(lambda x: jnp.moveaxis(x, 0, 2), starts)
    m_starts, theta_starts = starts                          # [B, H, blocks, P]

    # θ_{i−1} = own_i + Σ_k coefficient_ik · start_k over the block's start states (θ, m and, with
    # restarts, θ_origin); a restarted row that reads θ_origin keeps none of the rest
    coefficients = [A_before, Wm_before] + ([] if restart is None else [Z_before])
    keep = None
    if restart is not None and restarted_rows_read_origin:
        keep = 1.0 - r
        coefficients = [c * keep for c in coefficients[:2]] + [Z_before * keep + r]
    coefficients = jnp.stack(coefficients, axis=-1)                # [B, H, blocks, size, K]

    def before(own, w, mm, origin=None):
        starts = [w, mm] + ([] if origin is None else [jnp.broadcast_to(origin[:, :, None], w.shape)])
        return _rows_from_starts(own, coefficients, jnp.stack(starts, axis=3), keep)

    if restart is None:
        thetas_f32 = jax.tree.map(before, before_own, theta_starts, m_starts)
    else:
        thetas_f32 = jax.tree.map(before, before_own, theta_starts, m_starts, flat_origin)
    rows_of = lambda x, like: x.reshape(lead + (N,) + like.shape[2:])
    thetas_before = jax.tree.map(lambda x, like: rows_of(x, like).astype(dtype), thetas_f32, theta0)
    if end_row is not None:
        theta_end = jax.tree.map(lambda x, like: rows_of(x, like)[:, :, end_row], thetas_f32, theta0)
    unflat = lambda x, like: x.reshape(like.shape)
    theta_end, m_end = jax.tree.map(unflat, theta_end, theta0), jax.tree.map(unflat, m_end, m0)
    return thetas_before, theta_end, m_end


@jax.custom_vjp
def _rows_from_starts(own, coefficients, starts, keep=None):
    """keep_i · own_i + Σ_k coefficients_ik · starts_k: own [B, H, blocks, size, P], coefficients
    [B, H, blocks, size, K], starts [B, H, blocks, K, P], keep [B, H, blocks, size] or None (1),
    float32. The forward is one elementwise pass. The backward takes the starts' cotangent as one
    product with the coefficients and the coefficients' as reductions over P, where XLA's transpose
    of the broadcasts reduced the rows' cotangent once per coefficient and start. titans' layer on
    an H200, bf16 fwd+bwd, one command against the broadcasts alone: B4 T4096 8.7 against 9.4 ms,
    with 8 packed documents a row 10.5 against 11.7; the op at B1 T16384 7.9 against 7.7
    (benchmarks/results/titans_packed_layout_h200_2026-11-30.md)."""
    return _rows_from_starts_fwd(own, coefficients, starts, keep)[0]


def _rows_from_starts_fwd(own, coefficients, starts, keep):
    out = own if keep is None else keep[..., None] * own
    for j in range(starts.shape[3]):
        out = out + coefficients[..., j, None] * starts[:, :, :, None, j]
    return out, (coefficients, starts, keep)


def _rows_from_starts_bwd(residuals, d_out):
    coefficients, starts, keep = residuals
    exact = jax.lax.Precision.HIGHEST
    d_own = d_out if keep is None else keep[..., None] * d_out
    # a row's coefficients: reductions over P (as a product, K-sized tiles of a P-long contraction
    # ran 1.3 ms at B4 T4096 on an H200, against one pass over d_out as reductions)
    d_coefficients = jnp.stack([jnp.sum(d_out * starts[:, :, :, None, k], axis=-1)
                                for k in range(starts.shape[3])], axis=-1)
    d_starts = jnp.einsum("BHNik,BHNiP->BHNkP", coefficients, d_out, precision=exact)
    # keep comes of restart flags, which take no gradient
    return d_own, d_coefficients, d_starts, None if keep is None else jnp.zeros_like(keep)


_rows_from_starts.defvjp(_rows_from_starts_fwd, _rows_from_starts_bwd)


def _pad_chunks(xs, amount: int):
    """Pads the chunk axis 2 of a segment's (k, v, β, η, α[, restart]) with ``amount`` chunks that
    change nothing the caller keeps: β = 0 (no gradient), η = α = 1 (m carried), no restart."""
    def pad(x, value):
        return jnp.pad(x, [(0, 0), (0, 0), (0, amount)] + [(0, 0)] * (x.ndim - 3), constant_values=value)
    values = (0.0, 0.0, 0.0, 1.0, 1.0, 0.0)
    return tuple(pad(x, value) for x, value in zip(xs, values))


def _parallel(memory, objective, q, k, v, beta, nu, g, theta0, m0, point0, restarts, chunk_size, segment,
              padding_before_restarts=False):
    B, T, H, D = q.shape
    C, N = chunk_size, T // chunk_size
    per_segment = N if segment is None else min(segment // C, N)
    eta, alpha = (jnp.moveaxis(x, 2, 1) for x in _gates(nu, g))
    chunked = lambda x: _bh(x[:, :N * C]).reshape((B, H, N, C) + x.shape[3:])
    restart = None if restarts is None else jnp.broadcast_to(
        jnp.asarray(restarts, jnp.float32)[:, None, :], (B, H, N))
    chunks = (chunked(k), chunked(v), chunked(jnp.asarray(beta, jnp.float32)), eta, alpha)
    chunks += () if restart is None else (restart,)
    chunk_gradients = jax.vmap(jax.vmap(jax.vmap(partial(_step_gradient, memory, objective),
                                                 in_axes=(None, 0, 0, 0))))

    def one_segment(carry, xs, keep_padding=False):
        point, theta, m = carry
        n = xs[0].shape[2]
        blocks, size = _blocks(n)
        padding = blocks * size - n
        if padding:
            xs = _pad_chunks(xs, padding)
        ks_, vs_, bs_, es_, as_, *rs_ = xs
        rs_ = rs_[0] if rs_ else None
        if rs_ is not None and n == 1:
            # a segment of one chunk: a restart before it takes its gradients at θ_0
            point = jax.tree.map(lambda p, o: jnp.where(rs_[:, :, 0].reshape(p.shape[:2] + (1,) * (p.ndim - 2)) > 0,
                                                        o, p), point, theta0)
        # every chunk's gradient at θ_s, in the products' dtype (the recurrence accumulates in float32)
        with jax.named_scope(SCOPES["gradients"]):
            G = jax.tree.map(lambda x: x.astype(q.dtype), chunk_gradients(point, ks_, vs_, bs_))
        with jax.named_scope(SCOPES["momentum_decay"]):
            thetas_before, theta, m = _momentum_and_decay(
                es_, as_, G, m, theta, q.dtype, rs_, theta0, end_row=n if padding else None,
                restarted_rows_read_origin=padding_before_restarts)
        if padding and not keep_padding:
            thetas_before = jax.tree.map(lambda x: x[:, :, :n], thetas_before)
        return (theta, theta, m), thetas_before

    if per_segment == N:
        # one segment (segment None): where its blocks pad it, the θ_{n−1} it returns are every
        # read's, the last chunk's included (row N)
        (_, theta_end, m_end), thetas_before = one_segment((point0, theta0, m0), chunks, keep_padding=True)
    else:
        (_, theta_end, m_end), thetas_before = _over_segments(one_segment, (point0, theta0, m0), chunks,
                                                               per_segment)
    with jax.named_scope(SCOPES["reads"]):
        # Token t reads θ_{r(t)}, r(t) = ⌊(t+1)/C⌋ − 1: shifted by one, the queries fall into chunks
        # 0..N; chunk j < N reads θ_{j−1} (θ_{−1} = θ_0) and chunk N the last θ, which a padded
        # segment's rows hold (row N), else read on its own.
        rows = jax.tree.leaves(thetas_before)[0].shape[2]
        read_rows = max(rows, N + 1)
        shifted = jnp.pad(_bh(q), [(0, 0), (0, 0), (1, read_rows * C - T - 1), (0, 0)])
        shifted = shifted.reshape((B, H, read_rows, C, D))
        read = jax.vmap(jax.vmap(jax.vmap(memory.apply)))(thetas_before, shifted[:, :, :rows])
        if rows == N:
            last = jax.vmap(jax.vmap(memory.apply))(theta_end, shifted[:, :, N])
            read = jnp.concatenate([read, last[:, :, None]], axis=2)
        o = read.reshape((B, H, read.shape[2] * C) + read.shape[4:])[:, :, 1:T + 1]
    if restart is not None and not padding_before_restarts:
        with jax.named_scope(SCOPES["restart_reads"]):
            # a restarted chunk's tokens but its last read the sequence's start, θ_0
            from_start = jax.vmap(jax.vmap(memory.apply))(theta0, _bh(q))
            token = jnp.arange(T)
            chunk = jnp.minimum(token // C, N - 1)
            reads_start = (restart[:, :, chunk] > 0) & (token % C != C - 1) & (token < N * C)
            o = jnp.where(reads_start[..., None], from_start.astype(o.dtype), o)
    return jnp.moveaxis(o, 1, 2), theta_end, m_end


@partial(jax.jit, static_argnames=("memory", "objective", "chunk_size", "segment", "impl", "output_final_state",
                                   "padding_before_restarts"))
def chunk_step_memory(q, k, v, beta, nu, g, params, momentum=None, *, memory: MemoryArch,
                      objective: Objective = L2(), chunk_size: int = 64, segment: int | None = None,
                      gradient_params=None, restarts=None, padding_before_restarts: bool = False,
                      impl: str = "auto", output_final_state: bool = False):
    """The module docstring's memory. q, k [B, T, H, D], v [B, T, H, Dv]; ``beta`` [B, T, H] per token;
    ``nu`` (momentum gate η) and ``g`` (log decay, α = exp(g)) [B, T // chunk_size, H], one per
    complete chunk; ``params`` θ_0 and ``momentum`` m_{−1} (zeros if None) with leaves [B, H, ...] or
    [H, ...]. Segments count from the call's first chunk. ``gradient_params`` (same leaves; default
    ``params``): the first segment's gradient point θ_s, for a call that continues a sequence whose
    one segment began before it (``segment=None``: a decode step replaying its chunk passes the
    sequence's θ_0). ``restarts`` [B, T // chunk_size] (bool): a new sequence begins at the chunk's
    first token, from ``params`` with no momentum (packed documents laid out on chunk boundaries;
    segment None or chunk_size). ``padding_before_restarts``: the token before every restart (the
    chunk before's last) is padding whose output the caller drops; it is then read at ``params``
    like the restarted chunk's tokens, not at the weights before the restart, which spares a read of
    the whole sequence at ``params``. Returns (o [B, T, H, Dv] in q's dtype, `ChunkStepState` or
    None)."""
    per_head = _check(q, k, v, beta, nu, g, params, momentum, gradient_params, restarts, memory, objective,
                      chunk_size, segment, impl, output_final_state)
    if padding_before_restarts and restarts is None:
        raise ValueError("chunk_step_memory: padding_before_restarts says how the token before each restart is "
                         "read; pass restarts too (or leave it False)")
    B, _, H, _ = q.shape
    widen = lambda tree: jax.tree.map(
        lambda x, base: jnp.broadcast_to(jnp.asarray(x, jnp.float32), (B, H) + base.shape), tree, per_head)
    theta0 = widen(params)
    m0 = jax.tree.map(jnp.zeros_like, theta0) if momentum is None else widen(momentum)
    point0 = theta0 if gradient_params is None else widen(gradient_params)
    run = _reference if impl == "recurrent" else _parallel
    o, theta, m = run(memory, objective, q, k, v, beta, nu, g, theta0, m0, point0, restarts, chunk_size, segment,
                      padding_before_restarts)
    return o.astype(q.dtype), (ChunkStepState(theta, m) if output_final_state else None)
