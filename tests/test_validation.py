"""Bad input gets a clear error naming the argument and the fix."""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import pytest

import atlas_jax as aj
from atlas_jax import features, memory, objectives, optimizers, presets, retention
from helpers import random_inputs


@pytest.fixture(scope="module")
def inputs():
    return random_inputs(0, B=1, T=9, H=2, K=4, V=3)


def test_mismatched_shapes_name_the_argument(inputs):
    q, k, v, beta, g = inputs
    spec = presets.get("gated_deltanet")
    with pytest.raises(ValueError, match=r"^k must have q's shape"):
        spec(q, k[:, :5], v, beta=beta, g=g)
    with pytest.raises(ValueError, match=r"^v must be"):
        spec(q, k, v[:, :5], beta=beta, g=g)
    with pytest.raises(ValueError, match=r"^beta must be one of \(1, 9, 2\) or \(1, 9, 2, 4\) \(\[B, T, H\]"):
        spec(q, k, v, beta=beta[..., None, None], g=g)
    with pytest.raises(ValueError, match=r"^q must be \[B, T, H, K\]"):
        spec(q[0], k, v, beta=beta, g=g)
    with pytest.raises(ValueError, match=r"^initial_state: expected shape"):
        spec(q, k, v, beta=beta, g=g, initial_state=jnp.ones((1, 2, 5, 3)))


def test_wrong_gate_rank_for_the_retention(inputs):
    q, k, v, beta, g = inputs
    with pytest.raises(ValueError, match=r"^g for scalar retention must be \[B, T, H\].*retention channel"):
        presets.get("gated_deltanet")(q, k, v, beta=beta, g=jnp.ones((1, 9, 2, 4)))
    with pytest.raises(ValueError, match=r"^g for channel retention must be \[B, T, H, d\]"):
        presets.get("kda")(q, k, v, beta=beta, g=g)
    with pytest.raises(ValueError, match=r"^g: the scalar retention needs per-token log-decays"):
        presets.get("gated_deltanet")(q, k, v, beta=beta)
    with pytest.raises(ValueError, match=r"^g: this memory's retention is 'none'"):
        presets.get("deltanet")(q, k, v, beta=beta, g=g)


def test_non_floating_dtypes_raise_type_error(inputs):
    q, k, v, beta, g = inputs
    with pytest.raises(TypeError, match=r"^q must have a floating dtype"):
        presets.get("deltanet")(q.astype(jnp.int32), k, v, beta=beta)
    with pytest.raises(TypeError, match=r"^beta must have a floating dtype"):
        presets.get("deltanet")(q, k, v, beta=(beta > 0.5))


def test_chunk_size_and_impl_and_window(inputs):
    q, k, v, beta, g = inputs
    spec = presets.get("deltanet")
    for bad in (0, -4, 2.5):
        with pytest.raises(ValueError, match=r"^MemorySpec call: argument `chunk_size` must be a positive int"):
            spec(q, k, v, beta=beta, impl="chunk", chunk_size=bad)
        with pytest.raises(ValueError, match=r"^MemorySpec: argument `chunk_size` must be a positive int"):
            dataclasses.replace(spec, chunk_size=bad)
    with pytest.raises(ValueError, match=r"^MemorySpec call: impl must be one of \('recurrent', 'chunk', 'pallas', 'auto'\)"):
        spec(q, k, v, beta=beta, impl="parallel")
    with pytest.raises(ValueError, match=r"^MemorySpec: form must be one of"):
        spec(q, k, v, beta=beta, form="parallel")
    with pytest.warns(DeprecationWarning, match="use impl="):
        spec(q, k, v, beta=beta, form="chunked")
    with pytest.raises(NotImplementedError, match=r"impl='pallas' has no kernel for 'atlas'"):
        atlas = presets.get("atlas", hidden=4)
        atlas(q, k, v, initial_state=atlas.init_state(jax.random.PRNGKey(0), batch=q.shape[0],
                                                        heads=q.shape[2], d_k=q.shape[3], d_v=v.shape[3]),
              impl="pallas")
    for bad in (0, -1, 1.5):
        with pytest.raises(ValueError, match=r"^MemorySpec: window must be an int >= 1"):
            aj.MemorySpec(window=bad)


def test_knobs_the_spec_does_not_use(inputs):
    q, k, v, beta, g = inputs
    with pytest.raises(ValueError, match=r"^delta: the l2 objective has no per-token knob"):
        presets.get("deltanet")(q, k, v, beta=beta, delta=beta)
    with pytest.raises(ValueError, match=r"^nu: the GD optimizer has no momentum"):
        presets.get("deltanet")(q, k, v, beta=beta, nu=beta)
    with pytest.raises(ValueError, match=r"^nu must be one of \(1, 9, 2\)"):
        presets.get("titans")(q, k, v, beta=beta, g=g, nu=beta[:, :3])


def test_deep_memories_need_an_initial_state(inputs):
    q, k, v, beta, g = inputs
    with pytest.raises(ValueError, match=r"^initial_state: a MLP\(.*needs its θ_0; pass spec.init_state"):
        presets.get("titans")(q, k, v, beta=beta, g=g)


def test_spec_construction_errors():
    with pytest.raises(TypeError, match=r"^MemorySpec: optimizer must be an optax GradientTransformation"):
        aj.MemorySpec(optimizer="adam")
    with pytest.raises(TypeError, match=r"^MemorySpec: memory must be a MemoryArch"):
        aj.MemorySpec(memory="mlp")
    with pytest.raises(ValueError, match=r"^MemorySpec: channel retention decays each channel.*use retention scalar"):
        aj.MemorySpec(memory=memory.MLPMemory(depth=3), retention=retention.channel())
    with pytest.raises(ValueError, match=r"^MLPMemory: depth must be an int >= 2"):
        memory.MLPMemory(depth=1)
    with pytest.raises(ValueError, match=r"^MLPMemory: unknown activation 'swish'"):
        memory.MLPMemory(activation="swish")
    with pytest.raises(ValueError, match=r"^Polynomial: degree must be an int >= 1"):
        features.Polynomial(0)
    with pytest.raises(ValueError, match=r"^Huber: kind must be one of"):
        objectives.Huber(kind="smooth")
    with pytest.raises(ValueError, match=r"^momentum_decay must be in \[0, 1\]"):
        optimizers.momentum(momentum_decay=1.5)
    with pytest.raises(ValueError, match=r"^muon: coefficients must be 'muon', 'cubic'"):
        optimizers.muon(coefficients="quartic")
    with pytest.raises(ValueError, match=r"^retention: log_decay must be <= 0"):
        retention.scalar(log_decay=0.5)
    with pytest.raises(ValueError, match=r"^lq retention: q must be > 2 and != 3"):
        retention.lq(q=3)


def test_unknown_names_and_options():
    with pytest.raises(ValueError, match=r"^preset: unknown name 'atlantis'"):
        presets.get("atlantis")
    with pytest.raises(ValueError, match=r"^preset 'atlas': unknown option\(s\) \['widow'\]; it takes"):
        presets.get("atlas", widow=4)
    with pytest.raises(ValueError, match=r"^optimizer: unknown name 'sgdd'"):
        optimizers.get_optimizer("sgdd")
    with pytest.raises(ValueError, match=r"^optimizer: optax has no transform 'adamx'"):
        optimizers.get_optimizer("optax:adamx")
    with pytest.raises(ValueError, match=r"^retention: unknown name"):
        retention.get_retention("forget")


def test_a_state_from_another_optimizer_is_refused(inputs):
    q, k, v, beta, g = inputs
    titans = presets.get("titans", hidden=8)
    state = titans.init_state(jax.random.PRNGKey(0), batch=1, heads=2, d_k=4, d_v=3)
    import dataclasses, optax
    adam = dataclasses.replace(titans, optimizer=optax.adam(1e-2))
    with pytest.raises(ValueError, match=r"^initial_state: its opt_state was made for a different inner optimizer"):
        adam(q, k, v, g=g, initial_state=state)
    o, _ = adam(q, k, v, g=g, initial_state=state.params)
    assert o.shape == v.shape


def test_initial_params_are_broadcast_by_shape_not_by_guess(inputs):
    q, k, v, beta, g = inputs
    spec = presets.get("deltanet")
    S = jax.random.normal(jax.random.PRNGKey(1), (2, 4, 3))                 # [H, K, V] per head
    o_heads, _ = spec(q, k, v, beta=beta, initial_state={"S": S})
    o_full, _ = spec(q, k, v, beta=beta, initial_state={"S": S[None]})      # [B, H, K, V]
    assert jnp.allclose(o_heads, o_full)
    with pytest.raises(ValueError, match=r"^initial_state: a parameter of shape \(2, 5, 3\) is not \(4, 3\)"):
        spec(q, k, v, beta=beta, initial_state={"S": jnp.ones((2, 5, 3))})
    with pytest.raises(ValueError, match=r"^initial_state: params must have the keys \['S'\]"):
        spec(q, k, v, beta=beta, initial_state={"W": S})


@pytest.mark.parametrize("impl", ["recurrent", "chunk", "pallas"])
def test_memory_spec_impl_reaches_that_form(impl):
    """impl on the spec (and per call) picks the form: a scan over the tokens, the chunked XLA form,
    or the Pallas kernels (interpret mode here) — read off the traced program."""
    q, k, v, beta, g = random_inputs(0, B=1, T=32, H=1, K=16, V=16)
    spec = dataclasses.replace(presets.get("gated_deltanet"), impl=impl, chunk_size=16)
    text = str(jax.make_jaxpr(lambda q, k, v, beta, g: spec(q, k, v, beta=beta, g=g)[0])(q, k, v, beta, g))
    assert ("pallas_call" in text) == (impl == "pallas")
    assert ("length=32" in text) == (impl == "recurrent")   # the recurrence scans T steps
    per_call = str(jax.make_jaxpr(lambda q, k, v, beta, g: presets.get("gated_deltanet")(
        q, k, v, beta=beta, g=g, impl=impl, chunk_size=16)[0])(q, k, v, beta, g))
    assert ("pallas_call" in per_call) == (impl == "pallas")


def test_exact_family_hands_bf16_inputs_to_the_ops_as_given():
    """bf16 q, k, v reach the kernels as bf16 (float32 gates and states), within bf16 rounding of
    the float32 call (1e-2 relative, the kernels' bf16 bar)."""
    q, k, v, beta, g = random_inputs(1, B=1, T=40, H=2, K=16, V=16)
    spec = presets.get("gated_deltanet")
    half = [x.astype(jnp.bfloat16) for x in (q, k, v)]
    o32, _ = spec(q, k, v, beta=beta, g=g, impl="chunk", chunk_size=16)
    o16, _ = spec(*half, beta=beta, g=g, impl="chunk", chunk_size=16)
    assert o16.dtype == jnp.bfloat16
    assert float(jnp.linalg.norm(o16.astype(jnp.float32) - o32) / jnp.linalg.norm(o32)) < 1e-2
    text = str(jax.make_jaxpr(lambda *a: spec(*a, beta=beta, g=g, impl="pallas", chunk_size=16)[0])(*half))
    kernel_inputs = text.split("pallas_call")[1].split("\n")[0]
    assert "bf16" in text and "pallas_call" in text, kernel_inputs
