"""Packed documents through the chunk-start forms as one row with restarts (each document moved
to a chunk boundary, the memory restarting from θ_0 there: about T + M·C tokens of work per row)
equal one row per document (M·T): MemorySpec's restarts against each document run alone, and
whole models against the document-rows path; outputs and every gradient at float32 rounding."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from atlas_jax import models, presets
from atlas_jax.forms import chunked
from atlas_jax.models import layers

B, T, H, K, V, C = 2, 45, 2, 8, 8, 16
# row 0: documents [0, 16) (a whole chunk), [16, 38) and [38, 45); row 1: [0, 29), [29, 45)
BOUNDS = [[(0, 16), (16, 38), (38, 45)], [(0, 29), (29, 45)]]


def _inputs(spec, seed):
    rng = np.random.default_rng(seed)
    rnd = lambda *s: jnp.asarray(rng.standard_normal(s), jnp.float32)
    unit = lambda x: x / jnp.linalg.norm(x, axis=-1, keepdims=True)
    q, k, v = unit(rnd(B, T, H, K)), unit(rnd(B, T, H, K)), rnd(B, T, H, V)
    knobs = {"beta": 0.3 * jax.nn.sigmoid(rnd(B, T, H))}
    if spec.retention.decay != "none":
        knobs["g"] = -jax.nn.softplus(rnd(B, T, H))
    if spec.opt_kind in ("momentum", "muon"):
        knobs["nu"] = jax.nn.sigmoid(rnd(B, T, H))
    theta = jax.tree.map(lambda x: x[0], spec.init_state(jax.random.PRNGKey(seed), batch=1, heads=H, d_k=K,
                                                         d_v=V).params)
    return q, k, v, knobs, theta


def _per_document(spec, impl, q, k, v, knobs, theta):
    """Reference: every document alone, from θ_0 (what one row per document computes)."""
    out = jnp.zeros_like(v)
    for b, bounds in enumerate(BOUNDS):
        for s0, s1 in bounds:
            cut = lambda x: x[b:b + 1, s0:s1]
            o, _ = spec(cut(q), cut(k), cut(v), **{n: cut(x) for n, x in knobs.items()}, impl=impl,
                        chunk_size=C, initial_state=theta)
            out = out.at[b:b + 1, s0:s1].set(o)
    return out


def _restarts():
    r = np.zeros((B, T), bool)
    for b, bounds in enumerate(BOUNDS):
        for s0, _ in bounds:
            r[b, s0] = True
    return jnp.asarray(r)


# atlas (titans' dual-form restarts plus Newton–Schulz per chunk; ~25 s on 2 CPUs) is slow-marked
# to keep `make test` under 20 minutes
@pytest.mark.parametrize("name,impl,dual", [("titans", "chunk", True), ("titans", "recurrent", False),
                                            pytest.param("atlas", "chunk", True, marks=pytest.mark.slow),
                                            ("omeganet", "chunk", False), ("moneta", "chunk", True)])
def test_restarts_equal_each_document_alone(name, impl, dual):
    spec = presets.get(name, **({"ns_every": "chunk"} if name == "atlas" else {}))
    q, k, v, knobs, theta = _inputs(spec, 3)
    restarts = _restarts()
    # the chunk-start forms restart at chunk boundaries: give each document its own chunks
    if impl == "chunk":
        doc = jnp.asarray([[i for i, (s0, s1) in enumerate(bs) for _ in range(s1 - s0)] for bs in BOUNDS])
        pos = jnp.asarray([[t - s0 for (s0, s1) in bs for t in range(s0, s1)] for bs in BOUNDS])
        dest, length, restarts, valid, overflow = layers.chunk_aligned_layout(doc, pos, C, 3)
        move = lambda x: layers.to_chunk_aligned(x, dest, length)
        back = lambda y: layers.from_chunk_aligned(y, dest, overflow)
    else:
        move = back = lambda x: x
        valid = None

    def run(q, k, v, knobs, theta):
        with (chunked.dual_form() if dual else chunked.materialising()):
            o, _ = spec(move(q), move(k), move(v), **{n: move(x) for n, x in knobs.items()}, impl=impl,
                        chunk_size=C, initial_state=theta, restarts=restarts, valid=valid)
        return back(o)

    def reference(q, k, v, knobs, theta):
        with (chunked.dual_form() if dual else chunked.materialising()):
            return _per_document(spec, impl, q, k, v, knobs, theta)

    cot = jnp.asarray(np.random.default_rng(9).standard_normal(v.shape), jnp.float32)
    # jitted: one compile each instead of thousands of op-by-op dispatches (the suite's time)
    value_and_vjp = lambda f: jax.jit(lambda *args: (lambda out, vjp: (out, vjp(cot)))(*jax.vjp(f, *args)))
    got, got_grads = value_and_vjp(run)(q, k, v, knobs, theta)
    want, want_grads = value_and_vjp(reference)(q, k, v, knobs, theta)
    tol = 3e-5 if name == "atlas" else 1e-5    # Newton–Schulz's five cubic steps amplify rounding
    scale = float(jnp.max(jnp.abs(want)))
    assert float(jnp.max(jnp.abs(got - want))) <= tol * scale
    for g, w in zip(jax.tree.leaves(got_grads), jax.tree.leaves(want_grads)):
        assert float(jnp.max(jnp.abs(g - w))) <= tol * float(jnp.max(jnp.abs(w))) + 1e-12


def test_a_restart_inside_a_chunk_is_nan_and_kernels_refuse_restarts():
    spec = presets.get("titans")
    q, k, v, knobs, theta = _inputs(spec, 4)
    restarts = jnp.zeros((B, T), bool).at[:, 0].set(True).at[0, 20].set(True)   # 20: inside chunk [16, 32)
    o, _ = spec(q, k, v, **knobs, impl="chunk", chunk_size=C, initial_state=theta, restarts=restarts)
    assert bool(jnp.all(jnp.isnan(o[0, 16:32]))) and bool(jnp.all(jnp.isfinite(o[0, :16])))
    assert bool(jnp.all(jnp.isfinite(o[1])))
    with pytest.raises(NotImplementedError, match="kernel"):
        spec(q, k, v, **knobs, impl="pallas", chunk_size=C, initial_state=theta, restarts=restarts)
    with pytest.raises(ValueError, match="restarts must be"):
        spec(q, k, v, **knobs, impl="chunk", chunk_size=C, initial_state=theta, restarts=restarts[:, :10])
    with pytest.raises(NotImplementedError, match="exact"):
        presets.get("gated_deltanet")(q, k, v, beta=knobs["beta"], g=-jnp.ones((B, T, H)), impl="chunk",
                                      restarts=restarts)


def test_models_with_restarts_equal_document_rows(monkeypatch, preset="titans"):
    small = dict(num_layers=1, vocab_size=64, max_documents=3, dtype="float32", width=32, num_heads=2,
                 chunk_size=16)
    model = models.build(preset, "tiny", impl="chunk", rngs=nnx.Rngs(0), **small)
    graphdef, params = nnx.split(model)
    rng = np.random.default_rng(5)
    tokens = jnp.asarray(rng.integers(0, 64, (B, T)), jnp.int32)
    segments = jnp.asarray([[0] * 16 + [1] * 22 + [2] * 7, [4] * 29 + [5] * 16], jnp.int32)
    loss = lambda p: jnp.sum(nnx.merge(graphdef, p)(tokens, segments) ** 2) * 1e-3
    got, got_grad = jax.value_and_grad(loss)(params)
    monkeypatch.setattr(layers, "takes_restarts", lambda spec, impl: False)   # one row per document
    want, want_grad = jax.value_and_grad(loss)(params)
    np.testing.assert_allclose(float(got), float(want), rtol=1e-5)
    for g, w in zip(jax.tree.leaves(got_grad), jax.tree.leaves(want_grad)):
        assert float(jnp.max(jnp.abs(g - w))) <= 1e-5 * float(jnp.max(jnp.abs(w))) + 1e-12


@pytest.mark.parametrize("gap", [False, True])
def test_chunk_aligned_layout(gap):
    # every document starts a chunk, keeps its order and length, and fits the static length; with
    # a gap the token before each restart is padding (what chunk_step_memory's
    # padding_before_restarts asks of its caller)
    doc = jnp.asarray([[i for i, (s0, s1) in enumerate(bs) for _ in range(s1 - s0)] for bs in BOUNDS])
    pos = jnp.asarray([[t - s0 for (s0, s1) in bs for t in range(s0, s1)] for bs in BOUNDS])
    dest, length, restarts, valid, overflow = layers.chunk_aligned_layout(doc, pos, C, 3, gap=gap)
    # a row's first document starts at 0: only the two before the last are padded (the last is
    # followed by its gap)
    assert length == -(-(T + 2 * (C - 1 + gap) + gap) // C) * C and not bool(overflow.any())
    for b, bounds in enumerate(BOUNDS):
        starts = [int(dest[b, s0]) for s0, _ in bounds]
        assert all(s % C == 0 for s in starts) and starts == sorted(starts)
        assert all(int(dest[b, s1 - 1]) - int(dest[b, s0]) == s1 - 1 - s0 for s0, s1 in bounds)
        assert [int(t) for t in np.flatnonzero(np.asarray(restarts[b]))] == starts
        assert int(valid[b].sum()) == T
        before = [bool(valid[b, s - 1]) for s in starts[1:]]
        # row 0's first document is a whole chunk: without a gap the next one follows it directly
        assert (not any(before)) if gap else before == ([True, False] if b == 0 else [False])


@pytest.mark.parametrize("gap", [False, True])
def test_chunk_aligned_layout_fits_the_worst_rows(gap):
    """The static length holds every row: documents of one token past a chunk (the most padding
    each), every split of a row into up to M documents of random lengths, and rows of fewer; with a
    gap a padding token follows every document, the last one included."""
    rng = np.random.default_rng(0)
    time, m = 3 * C, 3
    # C + 1 wastes C − 1 slots of its second chunk; with a gap C wastes C: the last document then
    # ends (and, with a gap, is followed by padding) exactly at the bound
    rows = [[C + 1, C + 1, C - 2], [C, C, C], [1, 1, time - 2], [time]]
    for _ in range(40):
        cuts = np.sort(rng.choice(np.arange(1, time), size=rng.integers(0, m), replace=False))
        rows.append(list(np.diff(np.concatenate([[0], cuts, [time]]))))
    doc = jnp.asarray([[i for i, n in enumerate(r) for _ in range(n)] for r in rows])
    pos = jnp.asarray([[t for n in r for t in range(n)] for r in rows])
    dest, length, restarts, valid, overflow = layers.chunk_aligned_layout(doc, pos, C, m, gap=gap)
    assert length == -(-(time + (m - 1) * (C - 1 + gap) + gap) // C) * C and not bool(overflow.any())
    assert int(dest.max()) + gap < length
    assert int(valid.sum()) == len(rows) * time and bool(jnp.all(dest[:, 0] == 0))
