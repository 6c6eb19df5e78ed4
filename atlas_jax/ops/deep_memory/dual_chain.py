"""The chain of a super-chunk for a depth-2 MLP memory whose first layer reads a wide input.

omeganet, dla (and atlas' first layer) read φ(k), d_φ = 8448 wide at degree 2 and D 128, so θ's
first layer W0 [d_φ, h] (and omeganet's skip map S [d_φ, dv]) is too large to carry from chunk to
chunk the way titans' state pass does. The dual form instead forms θ once per super-chunk of S
chunks (`atlas_jax.forms.dual._super_chunk`): the rows' products with the super-chunk's start θ_B
are one large matmul, and chunk k's θ_k enters only as θ_B plus the earlier chunks' low-rank
updates,

    x θ_k[W] = p_k (x θ_B[W]) + Σ_{j<k} ((x A_jᵀ) ⊙ w_kj) Δ_j          (W = W0: Δ = D, W = S: Δ = E)

with A_j chunk j's gradient sources' inputs (φ rows), D_j / E_j their first layer's / output's
cotangents, p_k the decay from the super-chunk's start and w_kj [n] the weight of chunk j's
sources in θ_k (chunk j's chunk-end rows decayed to chunk k). The Gram matrices x A_jᵀ are d wide
through φ's kernel. What is left once the base products and the Gram matrices are formed is a
chain over the S chunks of [n, h]-sized work — this op — which in XLA is hundreds of small ops a
chunk: omeganet's time does not move with S (B1 T4096 H8 D128 bf16 fwd+bwd on an H200, one command:
S 4 / 8 / 16 80.1 / 79.6 / 82.4 ms), so it is this chain, not the θ-sized products, that sets it.

Per chunk k (one sequence and head), with the second layer W1_k carried explicitly ([h, dv]):

    Z = p_k B_k[:, :h] + Σ_{j<k} (G_kj ⊙ w_kj) D_j        (sources; B_k = A_k θ_B, G_kj = A_k A_jᵀ)
    H = σ(Z),  Y = H W1_k (+ p_k B_k[:, h:] + Σ_{j<k} (G_kj ⊙ w_kj) E_j with the skip map)
    E = ∂ℓ/∂Y (ℓ2: Y − targets; dot: −targets),  D = (E W1_kᵀ) ⊙ σ'(Z)
    W1_{k+1} = P_k W1_k + Hᵀ (r_k ⊙ E)                    (P_k = from_start[k, −1], r_k = rows[k, −1])

and the reads of its b steps t, θ_t = f_t θ_k + Σ_s M[t, s] a_s δ_sᵀ (f = from_start, M = rows):

    Zq = f ⊙ (p_k Bq_k[:, :h] + Σ_{j<k} (Gq_kj ⊙ w_kj) D_j) + (M ⊙ Gq_kk) D
    o  = f ⊙ (σ(Zq) W1_k) + (M ⊙ (σ(Zq) Hᵀ)) E (+ the skip map's read, alike with E)

The super-chunk's end θ is then p_S θ_B + Σ_j A_jᵀ (w_Sj ⊙ [D_j | E_j]) for the wide weights
(``end_decay`` and ``end_weights`` of the outputs; one matmul in the caller) and W1_S from here.

Packed documents restart θ at chunk boundaries. A restart at chunk k > 0 is a decay to zero
there (p and w vanish from k on) plus θ_origin as a source of weight z_k, which then decays as θ
does: the rows read z_k (x θ_origin[W]) besides p_k (x θ_B[W]), W1 starts again from θ_origin's,
and the end θ gains z_S θ_origin (``end_origin``).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from atlas_jax.linalg import product
from atlas_jax.memory import ACTIVATIONS

OBJECTIVES = ("l2", "dot")


class ChainOutputs(NamedTuple):
    """What `dual_chain_reference` returns for one super-chunk (leading axes as its inputs')."""

    d0: jax.Array        # the first layer's output cotangents D [S, n, h]
    errors: jax.Array    # the output cotangents E [S, n, dv]
    w1_end: jax.Array    # the second layer after the super-chunk [h, dv]
    outputs: jax.Array   # the reads [S, b, dv]
    end_decay: jax.Array     # p_S: θ_B's weight in the super-chunk's end θ []
    end_weights: jax.Array   # w_S [S, n]: every source's weight in it (the wide weights' end, in the caller)
    end_origin: jax.Array    # z_S: θ_origin's weight in it [] (0 without restarts)


def chain_weights(from_start, state_rows, restarts=None):
    """(p, w): p [S + 1] the decay from the super-chunk's start to the start of chunk k (p_S: its
    end), w [S + 1, S, n] the weight of chunk j's sources in chunk k's start θ (zero for j ≥ k).
    from_start [S, b], state_rows [S, b, n] (`forms.dual.ChunkTerms`, one per chunk). Products of
    decays in log space would lose the exact zeros of a fully decayed chunk; S is small, so the
    products are formed directly.

    ``restarts`` [S] (1.0 where a new sequence starts at chunk k, k ≥ 1, from θ_origin): θ decays to
    zero there and takes θ_origin as a source, so the result is (p, w, z) with z [S + 1] θ_origin's
    weight in chunk k's start θ."""
    S = from_start.shape[0]
    decay_end, rows_end = from_start[:, -1], state_rows[:, -1]
    p = [jnp.ones((), jnp.float32)]
    w = [jnp.zeros((S,) + rows_end.shape[1:], jnp.float32)]
    z = [jnp.zeros((), jnp.float32)]
    for k in range(S):
        p.append(p[-1] * decay_end[k])
        w.append((decay_end[k] * w[-1]).at[k].set(rows_end[k]))
        z.append(z[-1] * decay_end[k])
        if restarts is not None and k + 1 < S:
            kept = 1.0 - restarts[k + 1]
            p[-1], w[-1], z[-1] = kept * p[-1], kept * w[-1], kept * z[-1] + restarts[k + 1]
    if restarts is None:
        return jnp.stack(p), jnp.stack(w)
    return jnp.stack(p), jnp.stack(w), jnp.stack(z)


def dual_chain_reference(base_sources, base_queries, gram_sources, gram_queries, w1, targets, from_start,
                         state_rows, *, activation: str = "gelu", skip: bool = False, objective: str = "l2",
                         operands=None, restarts=None, origin_sources=None, origin_queries=None,
                         w1_origin=None) -> ChainOutputs:
    """The module docstring's chain for one sequence and head, in XLA: the sources chunk after
    chunk, then every chunk's reads at once (none feeds a later chunk).

    Args: base_sources [S, n, h (+ dv with the skip map)] and base_queries [S, b, h (+ dv)]: the
    sources' and queries' products with the super-chunk's start θ_B (W0, then the skip map);
    gram_sources [S, n, S, n] and gram_queries [S, b, S, n]: Gram matrices of chunk k's rows with
    chunk j's sources (entries j > k are not read; for the sources j = k neither); w1 [h, dv];
    targets [S, n, dv]; from_start [S, b]; state_rows [S, b, n]. ``operands``: the dtype the
    products with W1 take their operands in (`forms.dual.operand_dtype`); the Gram products are
    float32. ``restarts`` [S] (packed documents: 1.0 where a new sequence starts at chunk k ≥ 1,
    from θ_origin; `chain_weights`) with ``origin_sources`` / ``origin_queries`` (the rows'
    products with θ_origin's wide weights, shaped as the base ones) and ``w1_origin`` (its W1):
    the earlier chunks' sources and θ_B weigh nothing from a restart on, θ_origin's products take
    their place and W1 starts again from ``w1_origin``. Returns `ChainOutputs`."""
    if objective not in OBJECTIVES:
        raise ValueError(f"dual_chain_reference: argument `objective` must be one of {OBJECTIVES}; got {objective!r}.")
    S, n, b, (h, dv) = targets.shape[0], targets.shape[1], from_start.shape[-1], w1.shape
    width = h + dv if skip else h
    expect = {"base_sources": (base_sources, (S, n, width)), "base_queries": (base_queries, (S, b, width)),
              "gram_sources": (gram_sources, (S, n, S, n)), "gram_queries": (gram_queries, (S, b, S, n)),
              "targets": (targets, (S, n, dv)), "from_start": (from_start, (S, b)),
              "state_rows": (state_rows, (S, b, n))}
    for name, (x, shape) in expect.items():
        if tuple(x.shape) != shape:
            raise ValueError(f"dual_chain_reference: argument `{name}` must have shape {shape} (from targets "
                             f"[S, n, dv], from_start [S, b], w1 [h, dv], skip={skip}); got {tuple(x.shape)}.")
    act = ACTIVATIONS[activation]
    f32 = lambda x: x.astype(jnp.float32)
    if restarts is None:
        (p, w), z = chain_weights(from_start, state_rows), None
    else:
        if origin_sources is None or origin_queries is None or w1_origin is None:
            raise ValueError("dual_chain_reference: restarts need `origin_sources`, `origin_queries` and `w1_origin` "
                             "(θ_origin's products and W1)")
        p, w, z = chain_weights(from_start, state_rows, restarts)
    # The sources, chunk after chunk: only they carry the chain (chunk k's D, E and W1_k need the
    # earlier chunks'). The reads need nothing of a later chunk, so they follow as batched products
    # over the S chunks, not as S more sets of small ops inside the chain (omeganet B1 T4096 H8
    # bf16 fwd+bwd on an H200, one command: 62.4 -> 60.3 ms).
    d_hist, e_hist, hidden_all, w1_all = [], [], [], []
    history = None   # [k·n, h (+ dv)]: the earlier chunks' D (and E), grown by one chunk at a time
    for k in range(S):
        src = p[k] * f32(base_sources[k])
        if z is not None and k:
            src = src + z[k] * f32(origin_sources[k])
            w1 = jnp.where(restarts[k] > 0, w1_origin, w1)
        if k:
            src = src + (f32(gram_sources[k][:, :k]) * w[k, :k]).reshape(n, k * n) @ history
        hidden, act_vjp = jax.vjp(act, src[:, :h])
        if objective == "l2":
            y = product(hidden, w1, "nn", operands)
            errors = (y + src[:, h:] if skip else y) - f32(targets[k])
        else:   # the dot objective's output cotangent does not depend on the prediction
            errors = -f32(targets[k])
        (d0,) = act_vjp(product(errors, w1, "nt", operands))
        d_hist.append(d0)
        e_hist.append(errors)
        hidden_all.append(hidden)
        w1_all.append(w1)
        new = jnp.concatenate([d0, errors], axis=1) if skip else d0
        history = new if history is None else jnp.concatenate([history, new])
        w1 = from_start[k, -1] * w1 + product(hidden, state_rows[k, -1][:, None] * errors, "tn", operands)
    d_all, e_all, hidden_all, w1_all = map(jnp.stack, (d_hist, e_hist, hidden_all, w1_all))

    # The reads of every chunk's b steps at once: one [S·b, S·n] matrix of the query Gram matrices
    # weighted by where each source stands at step t (f_t w_kj for an earlier chunk j < k, the
    # chunk's own M[t, s] for j = k, zero for j > k) times every chunk's [D | E].
    chunk_k = jnp.arange(S)[:, None, None, None]
    chunk_j = jnp.arange(S)[None, None, :, None]
    earlier = f32(gram_queries) * w[:S, None] * from_start[:, :, None, None]
    own = jnp.einsum("KBKN->KBN", f32(gram_queries)) * state_rows                    # M ⊙ Gq_kk [S, b, n]
    mixing = jnp.where(chunk_j < chunk_k, earlier, 0.0)
    mixing = jnp.where(chunk_j == chunk_k, own[:, :, None, :], mixing).reshape(S * b, S * n)
    start_products = p[:S, None, None] * f32(base_queries)
    if z is not None:
        start_products = start_products + z[:S, None, None] * f32(origin_queries)
    pre = from_start[..., None] * start_products + (mixing @ history).reshape(S, b, -1)
    hidden_q = act(pre[..., :h])
    outputs = (from_start[..., None] * product(hidden_q, w1_all, "nn", operands)
               + jnp.einsum("KBN,KNV->KBV", state_rows * jnp.einsum("KBH,KNH->KBN", hidden_q, hidden_all), e_all))
    if skip:
        outputs = outputs + pre[..., h:]
    return ChainOutputs(d_all, e_all, w1, outputs, p[-1], w[-1], jnp.zeros((), jnp.float32) if z is None else z[-1])
