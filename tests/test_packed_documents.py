"""Packed documents through the delta-family kernels as one varlen row (cu_seqlens from the
segment ids: B·T tokens of work) equal the XLA path that gives each document its own row
(B·max_documents·T): whole models, outputs and every parameter gradient. Kernels in Pallas
interpret mode (CPU), float32, so the bar is float32 rounding (1e-5 relative)."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from atlas_jax import models
from atlas_jax.models import layers

SMALL = dict(num_layers=1, vocab_size=64, max_documents=3, dtype="float32", width=64, num_heads=2)


def _loss(params, graphdef, tokens, segments):
    return jnp.sum(nnx.merge(graphdef, params)(tokens, segments) ** 2) * 1e-3


# kda's channel gate through the varlen kernels is also tests/test_kernels_gpu.py's (op level)
@pytest.mark.parametrize("preset", ["gated_deltanet", pytest.param("kda", marks=pytest.mark.slow)])
def test_varlen_kernels_equal_document_rows(preset, monkeypatch):
    packed = []
    monkeypatch.setattr(layers, "_varlen_offsets", lambda *a: packed.append(a) or _varlen_offsets(*a))
    kernel = models.build(preset, "tiny", impl="pallas", rngs=nnx.Rngs(0), **SMALL)
    xla = models.build(preset, "tiny", impl="chunk", rngs=nnx.Rngs(0), **SMALL)
    graph_kernel, params = nnx.split(kernel)
    graph_xla, _ = nnx.split(xla)
    rng = np.random.default_rng(1)
    tokens = jnp.asarray(rng.integers(0, 64, (2, 45)), jnp.int32)     # odd T, documents of 10, 21, 14
    segments = jnp.asarray([[0] * 10 + [1] * 21 + [2] * 14, [5] * 45], jnp.int32)
    got, got_grad = jax.value_and_grad(_loss)(params, graph_kernel, tokens, segments)
    assert packed, "the kernel model did not take the varlen route"
    ref, ref_grad = jax.value_and_grad(_loss)(params, graph_xla, tokens, segments)
    np.testing.assert_allclose(float(got), float(ref), rtol=1e-5)
    for g, r in zip(jax.tree.leaves(got_grad), jax.tree.leaves(ref_grad)):
        assert float(jnp.max(jnp.abs(g - r))) <= 1e-5 * float(jnp.max(jnp.abs(r))) + 1e-12


def test_varlen_offsets_and_overflow():
    _varlen_offsets = layers._varlen_offsets
    segments = jnp.asarray([[0, 0, 1, 1, 2], [7, 7, 7, 8, 8]], jnp.int32)
    cu, overflow = _varlen_offsets(segments, 6)
    # rows laid end to end: sequences start at 0, 2, 4 (row 0) and 5, 8 (row 1); one spare, empty
    assert cu.tolist() == [0, 2, 4, 5, 8, 10, 10]
    assert not bool(jnp.any(overflow))
    cu, overflow = _varlen_offsets(segments, 4)
    assert cu.tolist() == [0, 2, 4, 5, 10]
    # the fifth sequence (row 1's second document) has no slot: its tokens, and only they, overflow
    assert overflow.tolist() == [False] * 8 + [True] * 2


_varlen_offsets = layers._varlen_offsets
