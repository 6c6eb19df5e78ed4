"""The memory layer on a delta-family op hands it the raw gate input and β logits (fla's
use_gate_in_kernel / use_beta_sigmoid_in_kernel): the outputs and the gradient of every parameter
equal the layer computing g and β itself (MemoryLayer.fuse_activations = False), float32, at an
odd T, unpacked and packed, in the XLA chunk form and the kernels (interpret mode on CPU)."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from atlas_jax import presets
from atlas_jax.models.layers import MemoryLayer, run_memory

B, T, WIDTH, HEADS = 2, 37, 32, 2       # head dim 16: the kernels take it in interpret mode
CHUNK = 16                               # three chunks over T = 37, the last one partial
# The same float32 formulas, in the layer or in the op: unpacked the results were bitwise equal
# (chunk and pallas), packed within 6.4e-7 relative (the padding after a document gets a decay
# and β 1/2 from raw zeros instead of 0, which changes rounding only); 1e-5 leaves room for
# another contraction order. Sigmoid applied twice to the fused β fails by 0.3 to 1.1.
TOL = 1e-5

# (preset, step_size_max, the op arguments the layer must hand over)
CASES = [
    ("gated_deltanet", None, {"use_gate_in_kernel", "A_log", "dt_bias", "use_beta_sigmoid_in_kernel"}),
    ("kda", None, {"use_gate_in_kernel", "A_log", "dt_bias", "use_beta_sigmoid_in_kernel"}),
    ("deltanet", None, {"use_beta_sigmoid_in_kernel"}),
    # β = 0.5 · sigmoid is not fla's: the layer keeps β, the op takes the gate only.
    ("gated_deltanet", 0.5, {"use_gate_in_kernel", "A_log", "dt_bias"}),
]


def _rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def _layer(preset, impl, step_size_max, max_documents=8):
    return MemoryLayer(presets.get(preset), width=WIDTH, heads=HEADS, impl=impl, chunk_size=CHUNK,
                       step_size_max=step_size_max, max_documents=max_documents, rngs=nnx.Rngs(0))


@nnx.jit
def _out_and_grads(layer, x, weights, segment_ids):
    def objective(layer):
        out = layer(x, segment_ids)
        return jnp.sum(jnp.where(jnp.isnan(out), 0.0, out) * weights), out
    (_, out), grads = nnx.value_and_grad(objective, has_aux=True)(layer)
    return out, nnx.state(grads, nnx.Param)


def _compare(layer, segment_ids=None):
    keys = jax.random.split(jax.random.PRNGKey(1), 2)
    x = jax.random.normal(keys[0], (B, T, WIDTH), jnp.float32)
    weights = jax.random.normal(keys[1], (B, T, WIDTH), jnp.float32)
    out_f, grads_f = _out_and_grads(layer, x, weights, segment_ids)
    layer.fuse_activations = False
    try:
        out_u, grads_u = _out_and_grads(layer, x, weights, segment_ids)
    finally:
        layer.fuse_activations = True
    assert bool(jnp.all(jnp.isfinite(out_f)))
    errors = {"out": _rel(out_f, out_u)}
    flat_f = jax.tree_util.tree_leaves_with_path(grads_f)
    flat_u = jax.tree.leaves(grads_u)
    assert len(flat_f) == len(flat_u) > 0
    for (path, gf), gu in zip(flat_f, flat_u):
        name = jax.tree_util.keystr(path)
        assert float(jnp.max(jnp.abs(gu))) > 0, f"zero gradient at {name}"
        errors[name] = _rel(gf, gu)
    bad = {name: err for name, err in errors.items() if not err <= TOL}
    assert not bad, f"fused != unfused beyond {TOL}: {bad}"


@pytest.mark.parametrize("impl", ["chunk", "pallas"])
@pytest.mark.parametrize("preset, step_size_max, handed", CASES)
def test_fused_activations_equal_the_layers(preset, step_size_max, handed, impl):
    layer = _layer(preset, impl, step_size_max)
    assert set(layer._fused(impl)) == handed
    _compare(layer)


@pytest.mark.parametrize("preset", ["gated_deltanet", "kda"])
def test_fused_activations_with_packed_documents(preset):
    """Packed rows: the raw knobs are moved into document rows like the activated ones."""
    layer = _layer(preset, "chunk", None, max_documents=3)
    segment_ids = jnp.asarray([[0] * 11 + [1] * 20 + [2] * 6, [4] * T], jnp.int32)
    _compare(layer, segment_ids)


def test_only_the_delta_family_ops_get_raw_knobs():
    """The recurrent impl (decode's), delta_product and the core's forms keep activated knobs; and
    run_memory refuses fla's arguments where no op runs."""
    assert _layer("gated_deltanet", "chunk", None)._fused("recurrent") == {}
    assert _layer("deltaproduct", "chunk", None)._fused("chunk") == {}
    assert _layer("titans", "chunk", None)._fused("chunk") == {}
    q = k = v = jnp.zeros((1, 4, 1, 16))
    with pytest.raises(ValueError, match="use_beta_sigmoid_in_kernel"):
        run_memory(presets.get("deltanet"), q, k, v, {"beta": jnp.zeros((1, 4, 1))}, impl="recurrent",
                   chunk_size=16, fused={"use_beta_sigmoid_in_kernel": True})
