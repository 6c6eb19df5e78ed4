"""Exact chunkwise-parallel Omega rule on a linear memory (expanded WY / UT form), plain XLA.

The recurrence (see `naive.py`): per token t, with the window terms κ_{t,j} = k_{t−c+1+j},
ν_{t,j} = v_{t−c+1+j} and weights w_{t,j} (j = 0..c−1, oldest first, 0 before the first token),

    S_t = α_t S_{t−1} + Σ_j κ_{t,j} x_{t,j}ᵀ,
    x_{t,j} = β_t w_{t,j} (ν_{t,j} − S_{t−1}ᵀ κ_{t,j})        (ℓ2)
    x_{t,j} = β_t w_{t,j} ν_{t,j}                              (dot)

Every token is expanded into its c window terms ("pseudo-tokens" m = (t, j), M = C·c per chunk
of C tokens). All c terms of token t read the same, *undecayed* S_{t−1} (decoupled retention),
so within a chunk with start state S_0 and log-decays g (chunk-local, float32):

    S_t          = e^{G_t} S_0 + Σ_{s≤t} Σ_j e^{G_t − G_s} κ_{s,j} x_{s,j}ᵀ,    G_t = Σ_{l≤t} g_l
    S_{t−1}ᵀ κ_m = e^{E_t} S_0ᵀ κ_m + Σ_{s<t} Σ_{j'} e^{D_{t,s}} (κ_m·κ_{s,j'}) x_{s,j'}
                   with E_t = Σ_{l<t} g_l (= G_{t−1}),  D_{t,s} = Σ_{s<l<t} g_l (= G_{t−1} − G_s)

Substituting into x gives one linear system per chunk, block-strictly lower triangular in the
token index (terms of the same token do not see each other), hence unit lower triangular in the
flattened order m = t·c + j:

    (I + diag(βw) A) X = diag(βw) (N − (e^{E} ⊙ Κ) S_0),   A_{m,m'} = [s(m') < t(m)] e^{D_{t(m),s(m')}} κ_m·κ_{m'}

Since X is affine in S_0, it is solved once for both right-hand sides, X = X_0 − W S_0 with
X_0 = L⁻¹ diag(βw) N and W = L⁻¹ diag(βw) (e^{E} ⊙ Κ), for all chunks in parallel; only a
matmul pass over the chunks is sequential:

    o_t    = e^{G_t} (scale q_t)ᵀ S_0 + Σ_{m: s(m)≤t} e^{G_t − G_{s(m)}} (scale q_t·κ_m) x_m
    S_C    = e^{G_C} S_0 + Σ_m e^{G_C − G_{s(m)}} κ_m x_mᵀ

(for the dot objective X = diag(βw) N and there is no solve: a windowed linear attention).
Per chunk the arrays are [M, M] and [M, K or V]: memory O(T·c·(K + V + C·c)), and the chunk
scan keeps one [K, V] state per chunk, O(T·K·V / C); nothing is [T, K, V]. The windows are
built by shifting k and v (c − 1 rows in front: zeros, or ``initial_window`` to continue a
sequence), so a window crossing a chunk boundary simply reads the previous chunk's keys; a chunk
interacts with the past only through S_0.
Every decay exponent is a direct (masked) segment sum of g, not a difference of cumulative
sums, and is masked before exp, so strong gates stay finite and accurate, gradients too.
With c = 1 this is the gated delta rule with decoupled decay; with g = 0 it is the delta rule.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp

from atlas_jax.linalg import solve_unit_lower
from atlas_jax.ops.chunking import HIGHEST as _HI
from atlas_jax.ops.chunking import from_chunks as _from_chunks
from atlas_jax.ops.chunking import masked_exp as _masked_exp
from atlas_jax.ops.chunking import to_chunks as _to_chunks
from atlas_jax.ops.omega.naive import check_args, float32_inputs, window_triple


def _windows(x, c, before):
    """[B, T, H, ...] -> [B, T, H, c, ...]: entry j of token t is x_{t−c+1+j}, read from
    ``before`` ([B, H, c−1, ...], the c − 1 tokens before the first, oldest first) for t−c+1+j < 0."""
    t = x.shape[1]
    xp = jnp.concatenate([jnp.moveaxis(before, 2, 1).astype(x.dtype), x], axis=1)
    return jnp.stack([xp[:, j:j + t] for j in range(c)], axis=3)


def _gate_sums(gc):
    """The chunk-local exponents from gc [..., C], each a direct masked sum of g (no differences).

    Returns (G [.., C] = Σ_{l≤t} g_l, E [.., C] = Σ_{l<t} g_l, R [.., C] = Σ_{l>s} g_l,
    incl [.., C, C] = Σ_{s<l≤t} g_l, excl [.., C, C] = Σ_{s<l<t} g_l) (pairs indexed [t, s]).
    """
    size = gc.shape[-1]
    idx = jnp.arange(size)
    after = idx[:, None] > idx[None, :]                          # [l, s]: l > s
    x = jnp.where(after, gc[..., :, None], 0.0)                  # x[l, s] = g_l for l > s
    incl = jnp.cumsum(x, axis=-2)                                # Σ_{s<l≤t}
    excl = jnp.concatenate([jnp.zeros_like(incl[..., :1, :]), incl[..., :-1, :]], axis=-2)
    G = jnp.cumsum(gc, axis=-1)
    E = jnp.concatenate([jnp.zeros_like(gc[..., :1]), G[..., :-1]], axis=-1)
    rev = jnp.flip(jnp.cumsum(jnp.flip(gc, -1), axis=-1), -1)    # Σ_{l≥s}
    R = jnp.concatenate([rev[..., 1:], jnp.zeros_like(rev[..., :1])], axis=-1)
    return G, E, R, incl, excl


class ChunkOperands(NamedTuple):
    """What the sequential pass over chunks reads, per chunk (float32, layout [N, B, H, ...]):

      x0 [.., M, V], w [.., M, K] (None for the dot objective): X = X0 − W S_0;
      kd [.., M, K] = e^{G_C − G_s(m)} κ_m;  qg [.., C, K] = e^{G_t} scale q_t;
      p [.., C, M] = e^{Σ_{s(m)<l≤t} g} q_t·κ_m on s(m) ≤ t (0 elsewhere);  last [..] = e^{G_C}.
    """
    x0: jax.Array
    w: jax.Array | None
    kd: jax.Array
    qg: jax.Array
    p: jax.Array
    last: jax.Array


def check_chunk_size(chunk_size) -> int:
    C = int(chunk_size)
    if C < 1:
        raise ValueError(f"omega: chunk_size must be >= 1, got {chunk_size!r}")
    return C


def chunk_operands(q, k, v, beta, g, gamma, *, window, objective, scale, initial_window,
                   chunk_size) -> ChunkOperands:
    """The chunk-parallel part of the chunked form (gate sums, windows, the per-chunk unit-lower
    solve), for checked arguments (`check_args`; ``initial_window`` a triple or None). T is
    padded to N·C tokens that leave the state unchanged (β·w = g = q = 0)."""
    B, T, H = q.shape[:3]
    V = v.shape[-1]
    c = window
    C = chunk_size
    N = -(-T // C)
    pad = N * C - T
    M = C * c
    f32 = jnp.float32
    qs, kf, vf, bf, gf, gam, initial_window = float32_inputs(q, k, v, beta, g, gamma, initial_window,
                                                            window=c, scale=scale)

    # Window terms and weights per token, oldest position first: w_{t,j} = own_{t−c+1+j} · γ^{(t)}_j
    # with own = γ per token (1 with per-position γ, whose own weights are all 1); the c − 1
    # tokens before the first come from initial_window (empty slots: zeros, own weight 0).
    k_prev, v_prev, w_prev = initial_window
    kw, vw = _windows(kf, c, k_prev), _windows(vf, c, v_prev)   # [B, T, H, c, K|V]
    if gam.ndim == 4:
        w = _windows(jnp.ones((B, T, H), f32), c, w_prev) * gam
    else:
        w = _windows(gam, c, w_prev)
    bw = bf[..., None] * w                                       # [B, T, H, c]

    if pad:
        # β·w = g = q = 0 on the padding leaves the state exactly unchanged.
        def padt(x):
            return jnp.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2))
        qs, kw, vw, bw, gf = map(padt, (qs, kw, vw, bw, gf))

    def pseudo(x):   # [B, T, H, c, ...] -> [N, B, H, M, ...], m = t·c + j
        x = _to_chunks(x, N, C)
        return x.reshape(x.shape[:3] + (M,) + x.shape[5:])

    qc = _to_chunks(qs, N, C)                                    # [N, B, H, C, K]
    kap, nu, bwm = pseudo(kw), pseudo(vw), pseudo(bw)           # [N, B, H, M, K|V], [.., M]
    gc = _to_chunks(gf, N, C)                                    # [N, B, H, C]
    G, E, R, incl, excl = _gate_sums(gc)

    idx = jnp.arange(C)
    tok = jnp.repeat(idx, c)                                     # token of pseudo-token m
    on_incl = idx[:, None] >= tok[None, :]                       # [t, m]: s(m) ≤ t
    rep = lambda x, axis: jnp.repeat(x, c, axis=axis)            # token axis -> pseudo axis

    # Read-out: o = e^{G} q S_0 + P X with P[t, m] = e^{Σ_{s(m)<l≤t} g} q_t·κ_m on s(m) ≤ t.
    p = _masked_exp(rep(incl, -1), on_incl) * jnp.einsum('NBHTK,NBHMK->NBHTM', qc, kap, precision=_HI)
    qg = jnp.exp(G)[..., None] * qc
    kd = rep(jnp.exp(R), -1)[..., None] * kap                    # e^{G_C − G_s(m)} κ_m
    last = jnp.exp(G[..., -1])                                   # [N, B, H]

    bv = bwm[..., None] * nu
    if objective == "l2":
        strict = tok[:, None] > tok[None, :]                     # [m, m']: s(m') < t(m)
        dec = _masked_exp(rep(rep(excl, -1), -2), strict)
        a = dec * jnp.einsum('NBHIK,NBHJK->NBHIJ', kap, kap, precision=_HI)
        rhs = jnp.concatenate([bv, bwm[..., None] * rep(jnp.exp(E), -1)[..., None] * kap], axis=-1)
        sol = solve_unit_lower(bwm[..., None] * a, rhs)
        x0, wy = sol[..., :V], sol[..., V:]                      # X = X0 − W S_0
    else:
        x0, wy = bv, None
    return ChunkOperands(x0=x0, w=wy, kd=kd, qg=qg, p=p, last=last)


def state_pass(ops: ChunkOperands, s0):
    """The sequential part in plain XLA: a scan over chunks from S_0 [B, H, K, V] (float32),

        X = X0 − W S,   S_next = e^{G_C} S + kdᵀ X,   then   o = qg S_start + P X,

    the read-out for all chunks at once. Returns (o [N, B, H, C, V], final state [B, H, K, V]).
    The Pallas kernels (atlas_jax.kernels.omega) run the same pass with the read-out fused."""
    def step(s, xs):
        x0_n, w_n, kd_n, last_n = xs
        x = x0_n if w_n is None else x0_n - jnp.einsum('BHMK,BHKV->BHMV', w_n, s, precision=_HI)
        s_next = last_n[..., None, None] * s + jnp.einsum('BHMK,BHMV->BHKV', kd_n, x, precision=_HI)
        return s_next, (s, x)

    s_final, (starts, xs_) = jax.lax.scan(step, s0, (ops.x0, ops.w, ops.kd, ops.last))
    o = (jnp.einsum('NBHTK,NBHKV->NBHTV', ops.qg, starts, precision=_HI)
         + jnp.einsum('NBHTM,NBHMV->NBHTV', ops.p, xs_, precision=_HI))
    return o, s_final


@functools.partial(jax.jit, static_argnames=("window", "objective", "output_final_state", "chunk_size"))
def omega_linear_chunk(q, k, v, beta=None, g=None, gamma=None, *, window=1, objective="l2",
                       scale=None, initial_state=None, output_final_state=False, initial_window=None,
                       chunk_size=16):
    """Chunkwise-parallel Omega rule; equals `omega_linear_recurrent` to float32 rounding.

    Args: as `omega_linear_recurrent`, plus
      chunk_size: tokens per chunk (each expands into `window` pseudo-tokens, so the per-chunk
        system is chunk_size·window square); any T is accepted (the tail is padded internally).

    Returns:
      (o [B, T, H, V] in v.dtype, final state [B, H, K, V] float32 or None).
    """
    initial_window = window_triple(initial_window)
    check_args(q, k, v, beta, g, gamma, window, objective, initial_window)
    C = check_chunk_size(chunk_size)
    B, T, H, K = q.shape
    V = v.shape[-1]
    ops = chunk_operands(q, k, v, beta, g, gamma, window=window, objective=objective, scale=scale,
                         initial_window=initial_window, chunk_size=C)
    s0 = (jnp.zeros((B, H, K, V), jnp.float32) if initial_state is None
          else initial_state.astype(jnp.float32))
    o, s_final = state_pass(ops, s0)
    o = _from_chunks(o)[:, :T].astype(v.dtype)
    return o, (s_final if output_final_state else None)
