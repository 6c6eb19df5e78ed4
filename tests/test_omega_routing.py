"""MemorySpec routes the exact Omega rule on a linear memory to the Omega kernels (issue 21, item 4).

``forms.is_omega_exact`` specs (a linear memory, the ℓ2 or dot objective, a window c, GD,
decoupled scalar decay: omeganet / atlas-style rules on a linear memory, and swla) run
  impl="pallas"  on the Omega Pallas kernels (``ops.omega_linear(impl="pallas")``; interpret mode here),
  impl="auto"    on them on GPU/TPU (up to d_φ = OMEGA_AUTO_MAX_DIM), else as impl="chunk",
  impl="chunk"   ℓ2 through ``ops.omega_linear_chunk``, swla's dot through the chunk-start form.
Checked on CPU: "pallas" equals the recurrence for outputs, the whole final state (S and the window
cache) and the gradients of q, k, v, β, g, γ, S_0 and φ's coefficients (float32, 1e-5 relative, as
tests/test_omega_kernels.py) at odd T from a state with a filled window cache; which form "auto"
and "chunk" trace (read off the jaxpr, with the backend patched to "gpu" for the accelerator case);
``has_kernel`` for the presets.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import pytest
from helpers import omega_spec_inputs, rel

import atlas_jax as aj
from atlas_jax import objectives as obj
from atlas_jax import optimizers as opt
from atlas_jax import presets
from atlas_jax import retention as ret
from atlas_jax.features import Identity
from atlas_jax.forms import chunked
from atlas_jax.memory import LinearMemory
from atlas_jax.ops.omega import api as omega_api


def _specs():
    """omeganet's rule (ℓ2, polynomial φ, decoupled scalar decay) on a linear memory at c = 1 and
    3, the atlas preset with a linear memory and plain GD (the same rule: ATLAS' Omega rule minus
    Muon), and swla (dot, c = 3)."""
    linear = lambda name, **kw: dataclasses.replace(presets.get(name, **kw), memory=LinearMemory())
    return {"omeganet_linear_c1": linear("omeganet", window=1),
            "omeganet_linear_c3": linear("omeganet", window=3),
            "atlas_linear_gd_c3": dataclasses.replace(linear("atlas", window=3), optimizer=opt.gd()),
            "swla_c3": presets.get("swla", window=3)}


def test_has_kernel_is_truthful():
    for name, spec in _specs().items():
        assert chunked.is_omega_exact(spec) and spec.has_kernel and spec.chunked_is_exact, name
    for name in ("swla", "deltanet", "gated_deltanet", "kda"):
        assert presets.get(name).has_kernel, name
    # The deep-memory state-pass kernel runs depth-2 MLPs without a skip map or LayerNorm, ℓ2,
    # GD or momentum (tests/test_deep_memory_kernel.py); Muon, maps, LayerNorm blocks, the skip
    # map of polynomial features and coupled decay with ℓ2 have no kernel.
    for name in ("titans", "ttt_mlp"):
        assert presets.get(name).has_kernel, name
    for name in ("omeganet", "atlas", "atlas_pp", "dla", "moneta", "yaad", "memora", "mesanet"):
        assert not presets.get(name).has_kernel, name
    coupled = aj.MemorySpec(LinearMemory(), Identity(), obj.L2(), 3, opt.gd(), ret.scalar())
    assert not coupled.has_kernel
    # Linear attention (dot objective, window 1) is exact in XLA, but the kernels write deltas only.
    for name in ("linear_attention", "retnet", "mamba2", "gla"):
        spec = presets.get(name)
        assert spec.chunked_is_exact and not spec.has_kernel, name


def _inputs(spec, *, per_position, T=19, K=3, V=4):
    return omega_spec_inputs(spec, per_position=per_position, seed=5, T=T, K=K, V=V, prefix=4)


@pytest.mark.parametrize("name,per_position", [("omeganet_linear_c1", False), ("omeganet_linear_c3", False),
                                               ("atlas_linear_gd_c3", True), ("swla_c3", True)])
def test_pallas_equals_recurrent_outputs_states_and_gradients(name, per_position):
    spec = _specs()[name]
    args, state0, co, cs = _inputs(spec, per_position=per_position)
    fp = spec.feature_map.init_params()
    fp = jax.tree.map(lambda x: x * (1.0 + 0.1 * jnp.arange(x.size).reshape(x.shape)), fp)

    def loss(q, k, v, beta, g, gamma, s0, fp, impl):
        o, state = spec(q, k, v, beta=beta, g=g, gamma=gamma, initial_state=state0._replace(params={"S": s0}),
                        output_final_state=True, impl=impl, chunk_size=16, feature_params=fp, scale=0.8)
        return jnp.sum(o * co) + jnp.sum(state.params["S"] * cs), (o, state)

    grad_fn = jax.jit(jax.grad(loss, argnums=tuple(range(8)), has_aux=True), static_argnums=8)
    full = args + (state0.params["S"], fp)
    g_rec, (o_rec, s_rec) = grad_fn(*full, "recurrent")
    g_pal, (o_pal, s_pal) = grad_fn(*full, "pallas")
    assert rel(o_pal, o_rec) < 1e-5, rel(o_pal, o_rec)
    assert jax.tree.structure(s_pal) == jax.tree.structure(s_rec)
    for path, a, b in zip(jax.tree_util.tree_leaves_with_path(s_pal), jax.tree.leaves(s_pal), jax.tree.leaves(s_rec)):
        assert rel(a, b) < 1e-5, (jax.tree_util.keystr(path[0]), rel(a, b))
    labels = ["q", "k", "v", "beta", "g", "gamma", "initial_state", "feature_params"]
    for label, a, b in zip(labels, g_pal, g_rec):
        for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
            assert float(jnp.max(jnp.abs(y))) > 0, label
            assert rel(x, y) < 1e-5, (label, rel(x, y))


def _traced(spec, impl, K=3, V=4, T=11):
    args, state0, _, _ = _inputs(spec, per_position=False, T=T, K=K, V=V)
    q, k, v, beta, g, gamma = args
    fn = lambda q, k, v: spec(q, k, v, beta=beta, g=g, gamma=gamma, initial_state=state0, impl=impl,
                              chunk_size=16)[0]
    return str(jax.make_jaxpr(fn)(q, k, v))


@pytest.fixture
def fresh_traces():
    """The form is chosen at trace time (MemorySpec's run is jitted): clear the caches around a test
    that patches what the choice reads."""
    jax.clear_caches()
    yield
    jax.clear_caches()


def test_auto_on_cpu_runs_the_xla_forms(monkeypatch, fresh_traces):
    """On CPU "auto" traces what "chunk" does: ℓ2 through ops.omega_linear_chunk, swla through the
    chunk-start form (no Omega op), never a pallas_call."""
    calls = []
    real = omega_api.omega_linear_chunk
    monkeypatch.setattr(omega_api, "omega_linear_chunk", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    for name in ("omeganet_linear_c3", "swla_c3"):
        spec = _specs()[name]
        for impl in ("auto", "chunk"):
            calls.clear()
            text = _traced(spec, impl)
            assert "pallas_call" not in text, (name, impl)
            assert len(calls) == (1 if name == "omeganet_linear_c3" else 0), (name, impl)
        assert "pallas_call" in _traced(spec, "pallas"), name


def test_auto_on_an_accelerator_takes_the_omega_kernels(monkeypatch, fresh_traces):
    """With the backend reported as a GPU, "auto" traces the Omega kernel (interpret mode still, as the
    real backend is the CPU) for both objectives, and the XLA forms above d_φ = OMEGA_AUTO_MAX_DIM."""
    monkeypatch.setattr(omega_api, "_backend", lambda: "gpu")
    for name in ("omeganet_linear_c1", "omeganet_linear_c3", "swla_c3"):
        assert "pallas_call" in _traced(_specs()[name], "auto"), name
    wide = _specs()["omeganet_linear_c3"]
    K = 22
    assert wide.feature_dim(K) > chunked.OMEGA_AUTO_MAX_DIM
    assert "pallas_call" not in _traced(wide, "auto", K=K, T=3)
    assert "pallas_call" in _traced(wide, "pallas", K=K, T=3)


def test_pallas_refuses_a_channel_wise_beta():
    spec = _specs()["omeganet_linear_c3"]
    (q, k, v, _, g, _), _, _, _ = _inputs(spec, per_position=False, T=5)
    beta = 0.3 * jnp.ones(q.shape[:3] + (spec.feature_dim(q.shape[-1]),))
    with pytest.raises(NotImplementedError, match="channel-wise beta"):
        spec(q, k, v, beta=beta, g=g, impl="pallas", chunk_size=16)
    o, _ = spec(q, k, v, beta=beta, g=g, impl="auto", chunk_size=16)   # the chunk-start form runs it
    assert bool(jnp.all(jnp.isfinite(o)))
