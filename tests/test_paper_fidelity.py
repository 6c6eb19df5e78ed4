"""The deep-memory presets against per-token loops written from the papers' equations.

Each reference below is a plain Python loop over tokens in float64 (`jax.enable_x64`), written from
the seeds, independent of the forms' machinery: it only borrows the memory's `apply` and the
objective's `output_grad` (both tested on their own), and runs the optimizer, the retention, the
Omega window and the per-token knobs itself. The library runs in float32; outputs and final states
must agree to 1e-5 relative (float32 rounding over ~10 steps of a small MLP; 1e-4 for the final
weights of the LayerNorm'd memory with channel-wise momentum: its first layer's gradient passes
the LN backward's rsqrt and the momentum sums up to 1/(1 − ν) ≈ 20 of them, measured 3.4e-5 with
XLA's optimisations off as the suite runs), gradients to 1e-4 where a float64 loop is the reference (float32 rounding
accumulates through backprop), and 1e-5 between the two float32 forms.

* Titans (Titans eq. 13–14, MIRAS Table 1): S_t = η_t S_{t−1} − θ_t ∇ℓ(M_{t−1}),
  M_t = α_t M_{t−1} + S_t — the step inside the momentum.
* Memora's memory is MIRAS' block x + LN(W1 σ(W2 x)).
* Omega window with γ_i^{(t)} [B, T, H, c] (ATLAS §3); [B, T, H] γ is its broadcast case.
* Channel-wise β, ν, α (over the memory's channels) and δ (over output channels), MIRAS.
* MIRAS' chunk-end schedule for Moneta and Memora: gradients at the chunk's start, linear inside
  the chunk, the ℓq / softmax map at chunk ends.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from atlas_jax import objectives as obj
from atlas_jax import optimizers as opt
from atlas_jax import presets
from atlas_jax import retention as ret
from atlas_jax.memory import MLPMemory, _layer_norm
from atlas_jax.spec import MemorySpec
from atlas_jax.features import Identity
from helpers import rel

B, T, H, D = 1, 11, 2, 6


def _inputs(seed, d_k=D, d_v=D):
    ks = jax.random.split(jax.random.PRNGKey(seed), 3)
    unit = lambda x: x / jnp.linalg.norm(x, axis=-1, keepdims=True)
    return unit(jax.random.normal(ks[0], (B, T, H, d_k))), unit(jax.random.normal(ks[1], (B, T, H, d_k))), \
        jax.random.normal(ks[2], (B, T, H, d_v))


def _knob(seed, shape, low, high):
    return low + (high - low) * jax.nn.sigmoid(jax.random.normal(jax.random.PRNGKey(seed), shape))


def _tree_scale(factor, tree, channel_axes):
    """factor ⊙ tree for a scalar or a [d] channel vector (along each leaf's channel axis)."""
    if jnp.ndim(factor) == 0:
        return jax.tree.map(lambda x: factor * x, tree)
    out = {}
    for key, leaf in tree.items():
        shape = [1] * leaf.ndim
        shape[channel_axes[key]] = leaf.shape[channel_axes[key]]
        out[key] = jnp.reshape(factor, shape) * leaf
    return out


def reference(spec, state, q, k, v, *, beta, g, nu=None, window_gates=None, delta=None, chunk=None,
              feature_params=None):
    """Per-token loop of one sequence and head (inputs without B and H axes), in float64.

    window_gates [T, c]: step t's weight of window positions t−c+1 … t (oldest first).
    chunk: None → every gradient at θ_{t−1} and the map every token; C → MIRAS' parallel schedule:
    gradients at the chunk's starting θ₀, θ linear inside the chunk, the map at chunk ends (every
    C tokens; the state returned after a last, shorter chunk is mapped too).
    """
    memory, objective, retention = spec.memory, spec.objective, spec.retention
    info = opt.info(spec.optimizer)
    fp = spec.feature_map.init_params() if feature_params is None else feature_params
    phi = lambda x: spec.feature_map.apply(fp, x)
    c = spec.window
    theta = state["params"]
    acc = state["acc"] if retention.has_map else theta
    m = jax.tree.map(jnp.zeros_like, theta)
    axes = memory.channel_axes(theta)
    outs, start, linear = [], theta, theta
    for t in range(q.shape[0]):
        if chunk is not None and t % chunk == 0:
            start, linear = theta, theta
        point = theta if chunk is None else start
        idx = [i for i in range(t - c + 1, t + 1)]
        w = jnp.asarray([0.0 if i < 0 else (1.0 if window_gates is None else window_gates[t, j])
                         for j, i in enumerate(idx)])
        idx = [max(i, 0) for i in idx]
        xs, ys = phi(k[jnp.asarray(idx)]), v[jnp.asarray(idx)]
        knob = None if delta is None else delta[jnp.asarray(idx)]
        preds, pull = jax.vjp(lambda p: memory.apply(p, xs), point)
        (grad,) = pull(w[:, None] * objective.output_grad(preds, ys, knob))
        step = beta[t]
        if info.kind == "gd":
            u = _tree_scale(-step, grad, axes)
        elif info.step_inside:   # S_t = η_t S_{t−1} − θ_t ∇
            m = jax.tree.map(jnp.add, _tree_scale(nu[t], m, axes), _tree_scale(-step, grad, axes))
            u = m
        else:                    # m_t = ν_t m_{t−1} + ∇, u = −β_t m_t
            m = jax.tree.map(jnp.add, _tree_scale(nu[t], m, axes), grad)
            u = _tree_scale(-step, m, axes)
        alpha = jnp.exp(g[t])
        acc = jax.tree.map(jnp.add, _tree_scale(alpha, acc, axes), u)
        linear = jax.tree.map(jnp.add, _tree_scale(alpha, linear, axes), u)
        chunk_end = chunk is None or (t + 1) % chunk == 0
        if not retention.has_map:
            theta = acc
        else:
            theta = retention.map(acc) if chunk_end else linear
        outs.append(memory.apply(theta, phi(q[t])))
    if retention.has_map and not chunk_end:
        # A sequence that ends inside a chunk returns the chunk-end state after its last step; that
        # step's read stays the linear one, which a longer sequence reads there too.
        theta = retention.map(acc)
    return jnp.stack(outs), theta


def _per_head(state, b, h):
    return {"params": jax.tree.map(lambda x: jnp.asarray(x[b, h], jnp.float64), state.params),
            "acc": None if state.accumulator is None else
            jax.tree.map(lambda x: jnp.asarray(x[b, h], jnp.float64), state.accumulator)}


def _reference_all(spec, state, q, k, v, knobs, **kw):
    """The reference for every (b, h), stacked as the library lays it out."""
    with jax.enable_x64(True):
        f64 = lambda x: None if x is None else jnp.asarray(np.asarray(x), jnp.float64)
        outs, finals = [], []
        for b in range(q.shape[0]):
            for h in range(q.shape[2]):
                sel = lambda x: None if x is None else f64(x)[b, :, h]
                o, theta = reference(spec, _per_head(state, b, h), sel(q), sel(k), sel(v),
                                     **{name: sel(x) for name, x in knobs.items()}, **kw)
                outs.append(np.asarray(o))
                finals.append(jax.tree.map(np.asarray, theta))
        o = np.stack(outs).reshape(q.shape[0], q.shape[2], q.shape[1], -1).transpose(0, 2, 1, 3)
        final = jax.tree.map(lambda *xs: np.stack(xs).reshape((q.shape[0], q.shape[2]) + xs[0].shape), *finals)
    return o, final


def _run(spec, state, q, k, v, knobs, **kw):
    o, final = spec(q, k, v, **knobs, initial_state=state, output_final_state=True, **kw)
    return o, final.params


# ---- Titans ----------------------------------------------------------------------------------
def test_titans_momentum_has_the_step_inside_as_the_paper_writes_it():
    spec = presets.get("titans", hidden=8)
    assert opt.info(spec.optimizer).step_inside and "step inside" in spec.axes()["optimizer"]
    q, k, v = _inputs(0)
    knobs = {"beta": _knob(1, (B, T, H), 0.05, 0.6), "g": jnp.log(_knob(2, (B, T, H), 0.7, 0.99)),
             "nu": _knob(3, (B, T, H), 0.2, 0.95)}
    state = spec.init_state(jax.random.PRNGKey(4), batch=B, heads=H, d_k=D, d_v=D)
    o_ref, s_ref = _reference_all(spec, state, q, k, v, knobs)
    for form in ({"impl": "recurrent"}, {"impl": "chunk", "chunk_size": 1}):
        o, s = _run(spec, state, q, k, v, knobs, **form)
        assert rel(o, o_ref) < 1e-5, form
        for key in s_ref:
            assert rel(s[key], s_ref[key]) < 1e-5, (form, key)
    # The blog's form (β after the momentum) gives other numbers with a per-token β: the test can fail.
    outside = dataclasses.replace(spec, optimizer=opt.momentum(1.0, 0.9))
    o_out, _ = _run(outside, outside.init_state(None, batch=B, heads=H, d_k=D, d_v=D, params=state.params),
                    q, k, v, knobs)
    assert rel(o_out, o_ref) > 1e-3


def test_titans_gradients_through_every_knob_match_the_float64_loop():
    spec = presets.get("titans", hidden=8)
    q, k, v = _inputs(5)
    state = spec.init_state(jax.random.PRNGKey(6), batch=B, heads=H, d_k=D, d_v=D)
    knobs = {"beta": _knob(7, (B, T, H), 0.05, 0.6), "g": jnp.log(_knob(8, (B, T, H), 0.7, 0.99)),
             "nu": _knob(9, (B, T, H), 0.2, 0.95)}
    co = jax.random.normal(jax.random.PRNGKey(10), (B, T, H, D))

    def loss_library(q, k, v, knobs, form):
        o, _ = spec(q, k, v, **knobs, initial_state=state, **form)
        return jnp.sum(o * co)

    grads = {}
    for name, form in (("recurrent", {"impl": "recurrent"}), ("chunk1", {"impl": "chunk", "chunk_size": 1})):
        grads[name] = jax.grad(loss_library, argnums=(0, 1, 2, 3))(q, k, v, knobs, form)
    for a, b in zip(jax.tree.leaves(grads["recurrent"]), jax.tree.leaves(grads["chunk1"])):
        assert rel(a, b) < 1e-5

    with jax.enable_x64(True):
        f64 = lambda x: jnp.asarray(np.asarray(x), jnp.float64)
        per_head = _per_head(state, 0, 0)

        def loss_reference(q, k, v, knobs):
            o, _ = reference(spec, per_head, q, k, v, **knobs)
            return jnp.sum(o * f64(co)[0, :, 0])

        sel = lambda x: f64(x)[0, :, 0]
        ref = jax.grad(loss_reference, argnums=(0, 1, 2, 3))(sel(q), sel(k), sel(v),
                                                             {n: sel(x) for n, x in knobs.items()})
        ref = jax.tree.map(np.asarray, ref)
    got = jax.tree.map(lambda x: np.asarray(x)[0, :, 0], grads["recurrent"])
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(ref)):
        assert rel(a, b) < 1e-4


# ---- Memora's block ---------------------------------------------------------------------------
def test_memora_uses_miras_block_residual_and_layernorm():
    spec = presets.get("memora", hidden=8)
    assert spec.memory == MLPMemory(2, 8, residual=True, layernorm=True)
    assert spec.memory == presets.get("moneta", hidden=8).memory == presets.get("yaad", hidden=8).memory
    params = spec.memory.init(jax.random.PRNGKey(0), D, D)
    x = jax.random.normal(jax.random.PRNGKey(1), (5, D))
    gelu = lambda z: 0.5 * z * (1 + jax.scipy.special.erf(z / np.sqrt(2)))   # the exact GELU
    expected = x + _layer_norm(gelu(x @ params["W0"]) @ params["W1"])
    assert rel(spec.memory.apply(params, x), expected) < 1e-6


# ---- Omega gates per window position ------------------------------------------------------------
def _omeganet(window):
    return presets.get("omeganet", window=window, degree=2, hidden=8)


def test_per_position_window_gates_match_the_loop_in_both_forms():
    c, dk = 3, 3
    spec = _omeganet(c)
    q, k, v = _inputs(11, d_k=dk, d_v=spec.feature_dim(dk))
    gates = _knob(12, (B, T, H, c), 0.0, 1.0)
    knobs = {"beta": _knob(13, (B, T, H), 0.05, 0.5), "g": jnp.log(_knob(14, (B, T, H), 0.8, 0.99))}
    state = spec.init_state(jax.random.PRNGKey(15), batch=B, heads=H, d_k=dk, d_v=spec.feature_dim(dk))
    o_ref, s_ref = _reference_all(spec, state, q, k, v, {**knobs, "window_gates": gates})
    for form in ({"impl": "recurrent"}, {"impl": "chunk", "chunk_size": 1}):
        o, s = _run(spec, state, q, k, v, {**knobs, "gamma": gates}, **form)
        assert rel(o, o_ref) < 1e-5, form
        assert all(rel(s[key], s_ref[key]) < 1e-5 for key in s_ref), form


@pytest.mark.parametrize("form", [{"impl": "recurrent"}, {"impl": "chunk", "chunk_size": 4}])
def test_token_gates_are_the_broadcast_case_of_per_position_gates(form):
    c, dk = 4, 3
    spec = _omeganet(c)
    q, k, v = _inputs(16, d_k=dk, d_v=spec.feature_dim(dk))
    gamma = _knob(17, (B, T, H), 0.0, 1.0)
    # γ_i^{(t)} = γ_i: position j of step t's window is token t − c + 1 + j (0 before the start).
    padded = jnp.pad(gamma, ((0, 0), (c - 1, 0), (0, 0)))
    per_position = jnp.stack([padded[:, j:j + T] for j in range(c)], axis=-1)
    knobs = {"beta": _knob(18, (B, T, H), 0.05, 0.5), "g": jnp.log(_knob(19, (B, T, H), 0.8, 0.99))}
    state = spec.init_state(jax.random.PRNGKey(20), batch=B, heads=H, d_k=dk, d_v=spec.feature_dim(dk))
    o_tok, s_tok = _run(spec, state, q, k, v, {**knobs, "gamma": gamma}, **form)
    o_pos, s_pos = _run(spec, state, q, k, v, {**knobs, "gamma": per_position}, **form)
    assert rel(o_pos, o_tok) < 1e-6
    assert all(rel(s_pos[key], s_tok[key]) < 1e-6 for key in s_tok)


# ---- channel-wise knobs ------------------------------------------------------------------------------
def _channel_spec(optimizer, objective=None, retention=None):
    return MemorySpec(MLPMemory(2, 8, residual=True, layernorm=True), Identity(), objective or obj.L2(), 1,
                      optimizer, retention or ret.channel(decoupled=True), "channel_test")


CHANNEL_CASES = {
    "titans_momentum": lambda: _channel_spec(opt.momentum(1.0, 0.9, step_inside=True)),
    "momentum_outside": lambda: _channel_spec(opt.momentum(1.0, 0.9)),
    "yaad_huber_gd": lambda: _channel_spec(opt.gd(), obj.Huber("mixture", 1.0)),
}


@pytest.mark.parametrize("case", sorted(CHANNEL_CASES))
def test_channel_wise_knobs_match_the_loop_in_both_forms(case):
    spec = CHANNEL_CASES[case]()
    q, k, v = _inputs(21)
    knobs = {"beta": _knob(22, (B, T, H, D), 0.05, 0.6), "g": jnp.log(_knob(23, (B, T, H, D), 0.7, 0.99))}
    if opt.info(spec.optimizer).kind == "momentum":
        knobs["nu"] = _knob(24, (B, T, H, D), 0.2, 0.95)
    if spec.objective.uses_delta:
        knobs["delta"] = _knob(25, (B, T, H, D), 0.05, 1.0)
    state = spec.init_state(jax.random.PRNGKey(26), batch=B, heads=H, d_k=D, d_v=D)
    o_ref, s_ref = _reference_all(spec, state, q, k, v, knobs)
    results = [_run(spec, state, q, k, v, knobs, **form)
               for form in ({"impl": "recurrent"}, {"impl": "chunk", "chunk_size": 1})]
    for o, s in results:
        assert rel(o, o_ref) < 1e-5
        assert all(rel(s[key], s_ref[key]) < 1e-4 for key in s_ref)
    (o_rec, s_rec), (o_chk, s_chk) = results
    assert rel(o_chk, o_rec) < 1e-5 and all(rel(s_chk[key], s_rec[key]) < 1e-5 for key in s_rec)


# The two knob layouts take different orders of the same float32 operations (channel-wise
# products before the reductions, scalar ones after), and the layer-normed MLP memory's gradient
# step amplifies those roundings: relative state differences of 1.1e-6 (chunk form, the suite's
# JAX_DISABLE_MOST_OPTIMIZATIONS=1) and 3.3e-5 (recurrent form, XLA's optimisations on) over these
# 11 steps on a 2-core CPU, 2026-11-30. A layout bug (a knob on the wrong axis) is O(1e-1).
LAYOUT_TOL = 1e-4


def test_channel_knobs_constant_over_channels_equal_the_scalar_knobs():
    spec = _channel_spec(opt.momentum(1.0, 0.9, step_inside=True), obj.Huber("mixture", 1.0),
                         ret.scalar(decoupled=True))
    q, k, v = _inputs(27)
    scalar = {"beta": _knob(28, (B, T, H), 0.05, 0.6), "nu": _knob(29, (B, T, H), 0.2, 0.95),
              "delta": _knob(30, (B, T, H), 0.05, 1.0), "g": jnp.log(_knob(31, (B, T, H), 0.7, 0.99))}
    wide = {name: (x if name == "g" else jnp.broadcast_to(x[..., None], x.shape + (D,))) for name, x in scalar.items()}
    state = spec.init_state(jax.random.PRNGKey(32), batch=B, heads=H, d_k=D, d_v=D)
    for form in ({"impl": "recurrent"}, {"impl": "chunk", "chunk_size": 4}):
        o_s, s_s = _run(spec, state, q, k, v, scalar, **form)
        o_w, s_w = _run(spec, state, q, k, v, wide, **form)
        assert rel(o_w, o_s) < LAYOUT_TOL and all(rel(s_w[key], s_s[key]) < LAYOUT_TOL for key in s_s), form
    # and a channel-wise retention that is constant over channels is the scalar one
    chan = dataclasses.replace(spec, retention=ret.channel(decoupled=True))
    g_wide = jnp.broadcast_to(scalar["g"][..., None], (B, T, H, D))
    o_c, _ = _run(chan, state, q, k, v, {**wide, "g": g_wide}, impl="chunk", chunk_size=4)
    o_s, _ = _run(spec, state, q, k, v, scalar, impl="chunk", chunk_size=4)
    assert rel(o_c, o_s) < LAYOUT_TOL


def test_channel_knob_shapes_are_checked_with_the_allowed_shapes_named():
    spec = presets.get("titans", hidden=8, depth=3)
    q, k, v = _inputs(33)
    state = spec.init_state(jax.random.PRNGKey(34), batch=B, heads=H, d_k=D, d_v=D)
    with pytest.raises(ValueError, match=r"beta must be one of \(1, 11, 2\) \(\[B, T, H\].*no single channel axis"):
        spec(q, k, v, beta=jnp.ones((B, T, H, D)), g=jnp.zeros((B, T, H)), initial_state=state)
    spec2 = presets.get("titans", hidden=8)
    state2 = spec2.init_state(jax.random.PRNGKey(34), batch=B, heads=H, d_k=D, d_v=D)
    with pytest.raises(ValueError, match=r"nu must be one of \(1, 11, 2\) or \(1, 11, 2, 6\)"):
        spec2(q, k, v, nu=jnp.ones((B, T, H, 5)), g=jnp.zeros((B, T, H)), initial_state=state2)
    with pytest.raises(ValueError, match=r"delta: the l2 objective has no per-token knob"):
        spec2(q, k, v, delta=jnp.ones((B, T, H, D)), g=jnp.zeros((B, T, H)), initial_state=state2)
    with pytest.raises(ValueError, match=r"gamma must be one of .*\(1, 11, 2, 1\)"):
        spec2(q, k, v, gamma=jnp.ones((B, T, H, 3)), g=jnp.zeros((B, T, H)), initial_state=state2)
    with pytest.raises(ValueError, match="channel retention decays each channel"):
        MemorySpec(MLPMemory(3, 8), retention=ret.channel())


# ---- MIRAS' chunk-end schedule ---------------------------------------------------------------------
@pytest.mark.parametrize("name", ["moneta", "memora"])
@pytest.mark.parametrize("chunk", [4, 5])
def test_chunk_end_schedule_matches_the_miras_loop(name, chunk):
    spec = presets.get(name, hidden=8)
    assert spec.retention.map_at == "chunk_end"
    q, k, v = _inputs(40)
    knobs = {"beta": _knob(41, (B, T, H), 0.05, 0.3), "g": jnp.log(_knob(42, (B, T, H), 0.8, 0.99))}
    state = spec.init_state(jax.random.PRNGKey(43), batch=B, heads=H, d_k=D, d_v=D)
    o_ref, s_ref = _reference_all(spec, state, q, k, v, knobs, chunk=chunk)
    o, final = spec(q, k, v, **knobs, initial_state=state, output_final_state=True, impl="chunk",
                    chunk_size=chunk)
    assert rel(o, o_ref) < 1e-5
    assert all(rel(final.params[key], s_ref[key]) < 1e-5 for key in s_ref)
    # the per-token map is the other schedule, and at chunk size 1 they coincide
    per_token = dataclasses.replace(spec, retention=dataclasses.replace(spec.retention, map_at="token"))
    o_tok, _ = per_token(q, k, v, **knobs, initial_state=state, impl="chunk", chunk_size=chunk)
    assert rel(o_tok, o_ref) > 1e-4
    o1, _ = spec(q, k, v, **knobs, initial_state=state, impl="chunk", chunk_size=1)
    o_rec, _ = spec(q, k, v, **knobs, initial_state=state, impl="recurrent")
    assert rel(o1, o_rec) < 1e-5


def test_polynomial_kernel_starts_as_the_taylor_series_of_exp():
    poly = presets.get("atlas").feature_map
    x, y = jax.random.normal(jax.random.PRNGKey(0), (2, 5)) * 0.5
    params = poly.init_params()
    s = float(x @ y)
    assert abs(float(poly.apply(params, x) @ poly.apply(params, y)) - (1 + s + s * s / 2)) < 1e-5
