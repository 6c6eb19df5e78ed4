"""The memory layer on titans-pytorch's schedule (``step_schedule`` "chunk" / "chunk_from_theta0":
one inner step per chunk, `models.layers.run_chunk_steps`): its parallel form against the per-chunk
reference through the whole layer (outputs and every parameter's gradient), the pooled gates
against a hand-written reference, causality, packed documents, which presets take it, bad config.
Decoding on it (prefill, then the chunk replay) equals a re-forward: tests/test_generation.py."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from atlas_jax import presets
from atlas_jax.kernels.delta_family.support import fused_gate
from atlas_jax.models import build
from atlas_jax.models.layers import MemoryLayer, chunk_steps_refusal
from atlas_jax.ops.deep_memory import chunk_step_memory
from helpers import rel as _rel

B, T, WIDTH, HEADS, C = 2, 21, 32, 2, 4     # five chunks and a one-token tail


def _layer(preset, schedule, impl="chunk"):
    return MemoryLayer(presets.get(preset), width=WIDTH, heads=HEADS, impl=impl, chunk_size=C,
                       memory_init="per_head", step_size_max=0.5, step_schedule=schedule, rngs=nnx.Rngs(0))


def _x(seed=2):
    return jax.random.normal(jax.random.PRNGKey(seed), (B, T, WIDTH), jnp.float32)


def _out_and_grads(layer, x, weights):
    def objective(layer, x):
        out = layer(x)
        return jnp.sum(out * weights), out
    (_, out), (g_layer, g_x) = nnx.value_and_grad(objective, argnums=(0, 1), has_aux=True)(layer, x)
    return out, nnx.state(g_layer, nnx.Param), g_x


@pytest.mark.parametrize("preset,schedule", [("titans", "chunk"), ("titans", "chunk_from_theta0"),
                                             ("ttt_mlp", "chunk")])
def test_layer_parallel_form_equals_reference(preset, schedule):
    # the op's segment-parallel form ("chunk") against its per-chunk scan ("recurrent") inside the
    # layer: float32, the same sums in another order, 1e-5 relative for outputs and gradients
    x, weights = _x(), jax.random.normal(jax.random.PRNGKey(3), (B, T, WIDTH))
    out_c, grads_c, gx_c = _out_and_grads(_layer(preset, schedule, "chunk"), x, weights)
    out_r, grads_r, gx_r = _out_and_grads(_layer(preset, schedule, "recurrent"), x, weights)
    assert _rel(out_c, out_r) <= 1e-5
    assert _rel(gx_c, gx_r) <= 1e-5
    for (path, gc), gr in zip(jax.tree_util.tree_leaves_with_path(grads_c), jax.tree.leaves(grads_r)):
        where = jax.tree_util.keystr(path)
        assert float(jnp.max(jnp.abs(gr))) > 0, f"zero gradient at {where}"
        assert _rel(gc, gr) <= 1e-5, where


def test_gates_are_the_chunks_mean_inputs():
    # the layer's memory output against the op called by hand: β per token, ν and the decay from
    # each chunk's mean gate input (the gates' maps are linear: the mean of the inputs' maps)
    layer, x = _layer("titans", "chunk"), _x()
    q, k, v, knobs = layer._inputs(x)
    n = T // C
    pool = lambda y: y[:, :n * C].reshape(B, n, C, HEADS).mean(axis=2)
    nu = jax.nn.sigmoid(pool(layer.nu_proj(x)))
    g = fused_gate(pool(layer.a_proj(x))[..., None], layer.A_log[...], layer.dt_bias[...].reshape(HEADS, 1))[..., 0]
    assert float(jnp.max(g)) < 0 and float(jnp.min(nu)) > 0
    theta0 = layer.theta0()
    expected, _ = chunk_step_memory(q, k, v, knobs["beta"], nu, g, theta0, memory=layer.spec.memory, chunk_size=C,
                                    segment=C, impl="recurrent")
    got, _ = layer._run(q, k, v, knobs, impl="chunk")
    assert _rel(got, expected) <= 1e-5


@pytest.mark.parametrize("schedule", ["chunk", "chunk_from_theta0"])
def test_layer_is_causal(schedule):
    # a chunk's gates pool all its tokens, and only its last token (and later ones) reads the step
    # they make: changing tokens after t leaves the outputs up to t alone
    layer, x = _layer("titans", schedule), _x()
    out = layer(x)
    for t in (1, 3, 6, 12):
        later = x.at[:, t + 1:].add(jax.random.normal(jax.random.PRNGKey(t), x[:, t + 1:].shape))
        moved = layer(later)
        assert float(jnp.max(jnp.abs(moved[:, :t + 1] - out[:, :t + 1]))) <= 1e-6, t
        assert float(jnp.max(jnp.abs(moved[:, t + 1:] - out[:, t + 1:]))) > 1e-4, t


@pytest.mark.parametrize("schedule", ["chunk", "chunk_from_theta0"])
def test_packed_documents_equal_separate_runs(schedule):
    # documents of 8 (two whole chunks: its last token reads its own last step, the next chunk
    # restarts), 5 and 8 tokens packed in one row, moved to chunk boundaries with restarts, equal
    # each run alone from θ_0; so does a row of one document
    model = build("titans", "tiny", rngs=nnx.Rngs(0), chunk_size=C, step_schedule=schedule, max_documents=3)
    tokens = jax.random.randint(jax.random.PRNGKey(4), (2, T), 0, 256, dtype=jnp.int32)
    segment_ids = jnp.asarray([[0] * 8 + [1] * 5 + [2] * 8, [3] * T], jnp.int32)
    packed = model(tokens, segment_ids)
    for row, lo, hi in ((0, 0, 8), (0, 8, 13), (0, 13, 21), (1, 0, 21)):
        assert _rel(packed[row, lo:hi], model(tokens[row:row + 1, lo:hi])[0]) <= 1e-5, (row, lo, hi)


def test_which_presets_take_one_step_per_chunk():
    for name in ("titans", "ttt_mlp"):
        assert chunk_steps_refusal(presets.get(name)) is None, name
    refusals = {"atlas": "Omega window", "omeganet": "feature map", "gated_deltanet": "retention",
                "moneta": "retention", "yaad": "per-token knob"}
    for name, reason in refusals.items():
        refusal = chunk_steps_refusal(presets.get(name))
        assert refusal is not None and reason in refusal, (name, refusal)


@pytest.mark.parametrize("overrides,match", [
    ({"step_schedule": "per_chunk"}, "step_schedule must be one of"),
    ({"step_schedule": "chunk", "impl": "pallas"}, "has no Pallas kernel"),
])
def test_bad_config_names_the_field(overrides, match):
    with pytest.raises(ValueError, match=match):
        build("titans", "tiny", rngs=nnx.Rngs(0), **overrides)


def test_a_preset_that_cannot_names_why():
    with pytest.raises(ValueError, match=r"step_schedule='chunk'.*'omeganet' cannot: its feature map"):
        build("omeganet", "tiny", rngs=nnx.Rngs(0), step_schedule="chunk")


def test_memory_as_context_carries_the_chunk_step_state():
    # MAC carries the memory's state from segment to segment and reads θ at each segment's start:
    # on a chunk-step schedule that state is run_chunk_steps'. The output of a prefix is the
    # output of the whole sequence's prefix (causal across segments and the carried state).
    model = build("titans_mac", "tiny", rngs=nnx.Rngs(0), chunk_size=C, mac_segment=2 * C, step_schedule="chunk")
    tokens = jax.random.randint(jax.random.PRNGKey(6), (1, T), 0, 256, dtype=jnp.int32)
    whole = model(tokens)
    assert bool(jnp.all(jnp.isfinite(whole)))
    assert _rel(model(tokens[:, :13])[0], whole[0, :13]) <= 1e-5
    with pytest.raises(ValueError, match="mac_segment=6 must be a multiple of chunk_size=4"):
        build("titans_mac", "tiny", rngs=nnx.Rngs(0), chunk_size=C, mac_segment=6, step_schedule="chunk")
