"""The exact Omega rule on a linear memory (atlas_jax.ops.omega, issue 21 item 1).

(a) the float32 reference is the library's definition: it equals MemorySpec(LinearMemory(),
    Identity(), L2() | Dot(), c, gd(), scalar(decoupled=True)) in its recurrent form;
(b) the chunked form equals the reference for outputs, final states and every gradient
    (q, k, v, beta, g, gamma, initial state) at float32 rounding, on odd T, windows
    c ∈ {1, 2, 4, 7}, per-token and per-position γ, chunk sizes 8 and 16, extreme gates;
(c) at c = 1 it is the delta family: the delta rule when g = 0, the gated delta rule with
    v → α v, β → β / α (decoupled vs decay-first), linear attention for the dot objective.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from atlas_jax import objectives as obj
from atlas_jax import ops
from atlas_jax import optimizers as opt
from atlas_jax import retention as ret
from atlas_jax.features import Identity
from atlas_jax.memory import LinearMemory
from atlas_jax.ops.omega import omega_linear_chunk, omega_linear_recurrent
from atlas_jax.spec import MemorySpec
from helpers import rel

B, T, H, K, V = 2, 37, 2, 8, 6
TOL = 1e-5


def _inputs(c, *, per_position, gates="random", seed=0):
    """Random inputs, none zero. Keys are unit vectors scaled by 1/√c so that the window's
    curvature Σ_j w κκᵀ has norm ≤ 1: with β ≤ 1 every transition αI − βΣ is a contraction,
    and β near 1 is the largest step the recurrence takes stably."""
    ks = jax.random.split(jax.random.PRNGKey(seed), 8)
    q = jax.random.normal(ks[0], (B, T, H, K))
    k = jax.random.normal(ks[1], (B, T, H, K))
    k = k / jnp.linalg.norm(k, axis=-1, keepdims=True) / np.sqrt(c)
    v = jax.random.normal(ks[2], (B, T, H, V))
    u = jax.random.uniform(ks[3], (B, T, H), minval=0.05, maxval=0.95)
    beta = {"random": u, "strong_decay": u, "tiny_beta": 1e-4 * (1 + u),
            "max_beta": 1 - 1e-3 * u}[gates]
    if gates == "strong_decay":   # α from e^{-60} to e^{-5}, a few tokens without decay at all
        g = -jax.random.uniform(ks[4], (B, T, H), minval=5.0, maxval=60.0)
        g = jnp.where(jax.random.uniform(ks[7], (B, T, H)) < 0.2, -1e-3, g)
    else:
        g = -jax.nn.softplus(jax.random.normal(ks[4], (B, T, H)))
    shape = (B, T, H, c) if per_position else (B, T, H)
    gamma = jax.random.uniform(ks[5], shape, minval=0.05, maxval=1.0)
    s0 = jax.random.normal(ks[6], (B, H, K, V))
    return q, k, v, beta, g, gamma, s0


def _loss_and_grads(fn, args, **kw):
    """Outputs, final state and the gradients of a fixed random projection of both w.r.t. all
    seven inputs (q, k, v, beta, g, gamma, initial state)."""
    wo = jax.random.normal(jax.random.PRNGKey(11), (B, T, H, V))
    ws = jax.random.normal(jax.random.PRNGKey(12), (B, H, K, V))

    def loss(q, k, v, beta, g, gamma, s0):
        o, s = fn(q, k, v, beta, g, gamma, initial_state=s0, output_final_state=True, **kw)
        return jnp.sum(o * wo) + jnp.sum(s * ws), (o, s)

    # One compiled program for the forward and backward passes (compiling dominates here).
    grads, (o, s) = jax.jit(jax.grad(loss, argnums=tuple(range(7)), has_aux=True))(*args)
    return o, s, grads


_NAMES = ("dq", "dk", "dv", "dbeta", "dg", "dgamma", "ds0")


def _errors(got, want):
    (o, s, grads), (o_r, s_r, grads_r) = got, want
    errs = {"o": rel(o, o_r), "final_state": rel(s, s_r)}
    errs.update({n: rel(a, b) for n, a, b in zip(_NAMES, grads, grads_r)})
    return errs


# ---- (a) the reference is the library's definition -------------------------------------------
@pytest.mark.parametrize("c,per_position", [(1, False), (3, False), (3, True)])
def test_reference_equals_memory_spec_recurrent(c, per_position):
    q, k, v, beta, g, gamma, s0 = _inputs(c, per_position=per_position)
    for objective, objective_cls in (("l2", obj.L2), ("dot", obj.Dot)):
        spec = MemorySpec(LinearMemory(), Identity(), objective_cls(), c, opt.gd(),
                          ret.scalar(decoupled=True))
        o_s, st = spec(q, k, v, beta=beta, g=g, gamma=gamma, initial_state=s0,
                       output_final_state=True, impl="recurrent", scale=0.7)
        o_r, s_r = omega_linear_recurrent(q, k, v, beta, g, gamma, window=c, objective=objective,
                                          scale=0.7, initial_state=s0, output_final_state=True)
        assert rel(o_r, o_s) <= TOL, (objective, rel(o_r, o_s))
        assert rel(s_r, st.params["S"]) <= TOL, (objective, rel(s_r, st.params["S"]))


@pytest.mark.parametrize("per_position", [False, True], ids=["gamma_token", "gamma_position"])
def test_continuation_with_the_window_cache(per_position):
    """Run MemorySpec over a prefix, then the ops over the rest from its final state and window
    cache: both equal MemorySpec over the whole sequence."""
    c, cut = 4, 20
    q, k, v, beta, g, gamma, s0 = _inputs(c, per_position=per_position, seed=2)
    spec = MemorySpec(LinearMemory(), Identity(), obj.L2(), c, opt.gd(), ret.scalar(decoupled=True))
    run = lambda sl, st: spec(q[:, sl], k[:, sl], v[:, sl], beta=beta[:, sl], g=g[:, sl],
                              gamma=gamma[:, sl], initial_state=st, output_final_state=True,
                              impl="recurrent", scale=0.5)
    o_full, st_full = run(slice(None), s0)
    _, st_cut = run(slice(None, cut), s0)
    rest = slice(cut, None)
    args = (q[:, rest], k[:, rest], v[:, rest], beta[:, rest], g[:, rest], gamma[:, rest])
    kw = dict(window=c, scale=0.5, initial_state=st_cut.params["S"], output_final_state=True)
    for o, s in (omega_linear_recurrent(*args, initial_window=st_cut.window, **kw),
                 omega_linear_chunk(*args, initial_window=tuple(st_cut.window)[:3], chunk_size=8, **kw)):
        assert rel(o, o_full[:, rest]) <= TOL and rel(s, st_full.params["S"]) <= TOL


# ---- (b) the chunked form is exact ------------------------------------------------------------
@pytest.mark.parametrize("per_position", [False, True], ids=["gamma_token", "gamma_position"])
@pytest.mark.parametrize("c", [1, 2, 4, 7])
def test_chunk_equals_reference_with_gradients(c, per_position):
    args = _inputs(c, per_position=per_position, seed=c)
    want = _loss_and_grads(omega_linear_recurrent, args, window=c)
    for chunk in (8, 16):
        errs = _errors(_loss_and_grads(omega_linear_chunk, args, window=c, chunk_size=chunk), want)
        assert max(errs.values()) <= TOL, (chunk, errs)


@pytest.mark.parametrize("gates", ["strong_decay", "tiny_beta", "max_beta"])
def test_chunk_exact_under_extreme_gates(gates):
    c = 4
    args = _inputs(c, per_position=gates == "max_beta", gates=gates, seed=5)
    want = _loss_and_grads(omega_linear_recurrent, args, window=c)
    assert all(bool(jnp.all(jnp.isfinite(x))) for x in jax.tree.leaves(want))
    for chunk in (8, 16):
        errs = _errors(_loss_and_grads(omega_linear_chunk, args, window=c, chunk_size=chunk), want)
        assert max(errs.values()) <= TOL, (chunk, errs)


@pytest.mark.parametrize("c", [2, 7])
def test_chunk_dot_objective_with_gradients(c):
    args = _inputs(c, per_position=c == 2, seed=3)
    want = _loss_and_grads(omega_linear_recurrent, args, window=c, objective="dot")
    errs = _errors(_loss_and_grads(omega_linear_chunk, args, window=c, objective="dot",
                                   chunk_size=8), want)
    assert max(errs.values()) <= TOL, errs


def test_defaults_and_no_initial_state():
    """beta, g, gamma and the initial state are optional (1, no decay, 1, zeros); scale 1/√K."""
    c = 3
    q, k, v, *_ = _inputs(c, per_position=False)
    o_r, s_r = omega_linear_recurrent(q, k, v, window=c, output_final_state=True)
    o_c, s_c = omega_linear_chunk(q, k, v, window=c, output_final_state=True, chunk_size=8)
    o_x, _ = omega_linear_recurrent(q * K ** -0.5, k, v, window=c, scale=1.0)
    assert rel(o_c, o_r) <= TOL and rel(s_c, s_r) <= TOL
    assert rel(o_x, o_r) <= TOL
    o_n, s_n = omega_linear_chunk(q, k, v, window=c, chunk_size=8)
    assert s_n is None and rel(o_n, o_r) <= TOL


# ---- (c) the delta family at c = 1 ------------------------------------------------------------
def test_window_one_is_the_delta_family():
    q, k, v, beta, g, gamma, s0 = _inputs(1, per_position=False)
    kw = dict(window=1, initial_state=s0, output_final_state=True, chunk_size=8)
    # Without decay the decoupled and decay-first conventions agree: DeltaNet with β·γ.
    o, s = omega_linear_chunk(q, k, v, beta, None, gamma, **kw)
    o_d, s_d = ops.delta_rule(q, k, v, beta * gamma, initial_state=s0, output_final_state=True,
                              impl="recurrent")
    assert rel(o, o_d) <= TOL and rel(s, s_d) <= TOL
    # With decay: α S − β k (kᵀS − vᵀ) = α (S + (β/α) k (α v − kᵀS)ᵀ)... i.e. decay first, then a
    # delta write with step β/α on the value α v — the gated delta rule, exactly in exact
    # arithmetic (mild gates here, so β/α stays moderate).
    g_mild = 0.2 * g
    o, s = omega_linear_chunk(q, k, v, beta, g_mild, gamma, **kw)
    alpha = jnp.exp(g_mild)
    o_g, s_g = ops.gated_delta_rule(q, k, alpha[..., None] * v, g_mild, beta * gamma / alpha,
                                    initial_state=s0, output_final_state=True, impl="recurrent")
    assert rel(o, o_g) <= TOL and rel(s, s_g) <= TOL
    # The dot objective does not read S: linear attention with the write β·γ (any decay).
    o, s = omega_linear_chunk(q, k, v, beta, g, gamma, objective="dot", **kw)
    o_l, s_l = ops.linear_attention(q, k, v, g, beta * gamma, initial_state=s0,
                                    output_final_state=True, impl="recurrent")
    assert rel(o, o_l) <= TOL and rel(s, s_l) <= TOL


def test_rejects_bad_arguments():
    q, k, v, beta, g, gamma, _ = _inputs(2, per_position=False)
    with pytest.raises(ValueError, match="objective"):
        omega_linear_chunk(q, k, v, window=2, objective="huber")
    with pytest.raises(ValueError, match="gamma"):
        omega_linear_recurrent(q, k, v, gamma=jnp.ones((B, T, H, 3)), window=2)
    with pytest.raises(ValueError, match="window"):
        omega_linear_recurrent(q, k, v, window=0)
    with pytest.raises(ValueError, match="initial_window"):
        omega_linear_chunk(q, k, v, window=2, initial_window=(k[:, :, :1], v[:, :, :1], beta[:, :, :1]))


def test_exported_from_ops():
    assert ops.omega_linear_chunk is omega_linear_chunk
    assert ops.omega_linear_recurrent is omega_linear_recurrent
    assert {"omega_linear_chunk", "omega_linear_recurrent"} <= set(ops.__all__)
