"""ops.deep_memory.chunk_step_memory (titans-pytorch's schedule): the segment-parallel form against
the per-chunk reference, float32, outputs, final states and every gradient; bf16 operands; what
the schedule reads; a closed form; bad input. The op against titans-pytorch itself is
benchmarks/titans_pytorch_parity.py (needs torch)."""
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from atlas_jax.memory import LinearMemory, MLPMemory
from atlas_jax.ops.deep_memory import chunk_step_memory

MLP = MLPMemory(2, 12)


def make(B, T, H, D, Dv, C, memory=MLP, seed=0, dtype=jnp.float32):
    ks = jax.random.split(jax.random.PRNGKey(seed), 8)
    q, k = (jax.random.normal(ks[i], (B, T, H, D)) / np.sqrt(D) for i in (0, 1))
    v = jax.random.normal(ks[2], (B, T, H, Dv))
    beta = jax.nn.sigmoid(jax.random.normal(ks[3], (B, T, H)))
    N = T // C
    nu = jax.nn.sigmoid(jax.random.normal(ks[4], (B, N, H)))
    g = jax.nn.log_sigmoid(1.0 + 2.0 * jax.random.normal(ks[5], (B, N, H)))    # α from ~0.05 to ~1
    params = jax.vmap(lambda kk: memory.init(kk, D, Dv))(jax.random.split(ks[6], H))
    momentum = jax.tree.map(lambda x: 0.1 * jax.random.normal(ks[7], (B,) + x.shape), params)
    q, k, v = (x.astype(dtype) for x in (q, k, v))
    return (q, k, v, beta, nu, g, params, momentum)


def run(args, C, segment, impl, memory=MLP, final=True):
    return chunk_step_memory(*args, memory=memory, chunk_size=C, segment=segment, impl=impl,
                             output_final_state=final)


def rel(a, b):
    return float(jnp.max(jnp.abs(a - b)) / (jnp.max(jnp.abs(b)) + 1e-30))


# (B, T, H, D, Dv, C, segment): odd T (a tail read, not written), one gradient point or several,
# segments that do not divide the chunks, one chunk, Dv != D (the residual-free MLP maps D -> Dv)
CASES = [(2, 19, 2, 8, 8, 4, None), (1, 24, 3, 8, 8, 4, 8), (2, 21, 2, 8, 6, 4, 12), (1, 16, 1, 4, 4, 4, 4)]


@pytest.mark.parametrize("B,T,H,D,Dv,C,segment", CASES)
def test_parallel_form_equals_reference(B, T, H, D, Dv, C, segment):
    # float32 both ways; the forms sum the same products in another order: 1e-5 relative
    args = make(B, T, H, D, Dv, C)
    whole = T % C == 0
    (o_ref, s_ref), (o, s) = run(args, C, segment, "recurrent", final=whole), run(args, C, segment, "chunk", final=whole)
    assert rel(o, o_ref) < 1e-5
    if whole:
        for x, y in zip(jax.tree.leaves(s), jax.tree.leaves(s_ref)):
            assert rel(x, y) < 1e-5
    ct = jax.random.normal(jax.random.PRNGKey(7), o.shape)
    # cotangents on the outputs and, where there is one, the final weights and momentum
    def loss(impl):
        def f(a):
            o, s = run(a, C, segment, impl, final=whole)
            return jnp.sum(o * ct) + (0.0 if s is None else sum(jnp.sum(jnp.sin(x)) for x in jax.tree.leaves(s)))
        return f

    g_ref, g = jax.grad(loss("recurrent"))(args), jax.grad(loss("chunk"))(args)
    for path, x, y in zip(jax.tree_util.tree_leaves_with_path(g), jax.tree.leaves(g), jax.tree.leaves(g_ref)):
        assert rel(x, y) < 1e-5, jax.tree_util.keystr(path[0])
        assert float(jnp.max(jnp.abs(y))) > 0, jax.tree_util.keystr(path[0])


def test_blocks_of_chunks(monkeypatch):
    # the recurrence over chunks runs in blocks (up to 64 chunks on real inputs); of up to 2 here,
    # so that 11 chunks make a scan over blocks and padding, in one segment and in several
    from atlas_jax.ops.deep_memory import chunk_steps
    monkeypatch.setattr(chunk_steps, "BLOCK", 2)
    # BLOCK is read when the op is traced; no other test traces this shape (T 23, chunk 2, D 4)
    args = make(1, 23, 2, 4, 4, 2)
    for segment in (None, 6):
        o_ref, _ = run(args, 2, segment, "recurrent", final=False)
        o, _ = run(args, 2, segment, "chunk", final=False)
        assert rel(o, o_ref) < 1e-5
        # the blocks pad 11 chunks to 12 (one segment) or 3 to 4 (segments of 3): the final state
        # is the last real chunk's
        whole = tuple(x[:, :22] for x in args[:4]) + args[4:]
        for x, y in zip(jax.tree.leaves(run(whole, 2, segment, "chunk")[1]),
                        jax.tree.leaves(run(whole, 2, segment, "recurrent")[1])):
            assert rel(x, y) < 1e-5
        ct = jax.random.normal(jax.random.PRNGKey(1), o.shape)
        g_ref = jax.grad(lambda a: jnp.sum(run(a, 2, segment, "recurrent", final=False)[0] * ct))(args)
        g = jax.grad(lambda a: jnp.sum(run(a, 2, segment, "chunk", final=False)[0] * ct))(args)
        for x, y in zip(jax.tree.leaves(g), jax.tree.leaves(g_ref)):
            assert rel(x, y) < 1e-5


def test_bf16_operands():
    # bf16 q, k, v (products in bf16, states float32) against the float32 reference: 1e-2 relative
    args32 = make(2, 37, 2, 16, 16, 8)
    args16 = tuple(x.astype(jnp.bfloat16) for x in args32[:3]) + args32[3:]
    o_ref, _ = run(args32, 8, None, "recurrent", final=False)
    o, _ = run(args16, 8, None, "chunk", final=False)
    assert o.dtype == jnp.bfloat16
    assert rel(o.astype(jnp.float32), o_ref) < 2e-2


def test_reads_are_causal_and_lag_a_chunk():
    B, T, H, D, C = 1, 20, 2, 8, 4
    args = make(B, T, H, D, D, C)
    q, k, v = args[:3]
    o, _ = run(args, C, None, "chunk", final=False)
    for t in (2, 3, 9, 15):
        later = (q, k.at[:, t + 1:].add(1.0), v.at[:, t + 1:].add(1.0)) + args[3:]
        o2, _ = run(later, C, None, "chunk", final=False)
        assert float(jnp.max(jnp.abs(o2[:, :t + 1] - o[:, :t + 1]))) == 0.0
    # a chunk's tokens but its last read the weights before the chunk: changing chunk 1's keys
    # leaves its first three reads alone and moves its last one
    moved = (q, k.at[:, 4:8].add(1.0), v) + args[3:]
    o3, _ = run(moved, C, None, "chunk", final=False)
    assert float(jnp.max(jnp.abs(o3[:, 4:7] - o[:, 4:7]))) == 0.0
    assert float(jnp.max(jnp.abs(o3[:, 7] - o[:, 7]))) > 1e-3


@pytest.mark.parametrize("impl", ["recurrent", "chunk"])
@pytest.mark.parametrize("segment,split", [(None, 8), (4, 8), (8, 16)])
def test_a_call_continues_where_one_ended(impl, segment, split):
    # a sequence run in two calls (the second from the first's state, with gradient_params the
    # point of the segment it continues) gives the one call's outputs and final state: how a
    # decode step continues a sequence. Segments count from a call's first chunk, so a split falls
    # on a segment's boundary (8, 16) or continues the one segment (None).
    C = 4
    q, k, v, beta, nu, g, params, momentum = make(2, 24, 2, 8, 8, C)
    whole = lambda x, lo, hi: x[:, lo:hi]
    o, state = chunk_step_memory(q, k, v, beta, nu, g, params, momentum, memory=MLP, chunk_size=C,
                                 segment=segment, impl=impl, output_final_state=True)
    o1, s1 = chunk_step_memory(*(whole(x, 0, split) for x in (q, k, v, beta)), nu[:, :split // C], g[:, :split // C],
                               params, momentum, memory=MLP, chunk_size=C, segment=segment, impl=impl,
                               output_final_state=True)
    if segment is None:
        point = params
    else:   # the weights after the last whole segment before the split
        start = split // segment * segment
        _, at_start = chunk_step_memory(*(whole(x, 0, start) for x in (q, k, v, beta)), nu[:, :start // C],
                                        g[:, :start // C], params, momentum, memory=MLP, chunk_size=C,
                                        segment=segment, impl=impl, output_final_state=True)
        point = at_start.params
    o2, s2 = chunk_step_memory(*(whole(x, split, 24) for x in (q, k, v, beta)), nu[:, split // C:], g[:, split // C:],
                               s1.params, s1.momentum, memory=MLP, chunk_size=C, segment=segment,
                               gradient_params=point, impl=impl, output_final_state=True)
    assert rel(jnp.concatenate([o1, o2], axis=1), o) < 1e-5
    for x, y in zip(jax.tree.leaves(s2), jax.tree.leaves(state)):
        assert rel(x, y) < 1e-5
    # without the segment's point, a continued segment=None call is another computation
    if segment is None:
        o3, _ = chunk_step_memory(*(whole(x, split, 24) for x in (q, k, v, beta)), nu[:, split // C:],
                                  g[:, split // C:], s1.params, s1.momentum, memory=MLP, chunk_size=C, impl=impl)
        assert rel(o3, o[:, split:]) > 1e-3


@pytest.mark.parametrize("segment", [None, 4])
def test_restarts_equal_separate_sequences(segment):
    # two documents on chunk boundaries in one row: A in chunks 0-2 (its last chunk half padding,
    # β = 0 there), B in chunks 3-5 with a restart before it. B's outputs and the final state are
    # B's alone; both forms, and the parallel form's gradients against the reference's.
    C = 4
    q, k, v, beta, nu, g, params, momentum = make(2, 24, 2, 8, 8, C)
    beta = beta.at[:, 10:12].set(0.0)
    restarts = jnp.zeros((2, 6), bool).at[:, 3].set(True)
    b = lambda x, lo: x[:, lo:]
    for impl in ("recurrent", "chunk"):
        o, state = chunk_step_memory(q, k, v, beta, nu, g, params, momentum, memory=MLP, chunk_size=C, segment=segment,
                                     restarts=restarts, impl=impl, output_final_state=True)
        o_b, state_b = chunk_step_memory(*(b(x, 12) for x in (q, k, v, beta)), b(nu, 3), b(g, 3), params, memory=MLP,
                                         chunk_size=C, segment=segment, impl=impl, output_final_state=True)
        o_a, _ = chunk_step_memory(*(x[:, :10] for x in (q, k, v, beta)), nu[:, :2], g[:, :2], params, momentum,
                                   memory=MLP, chunk_size=C, segment=segment, impl=impl)
        assert rel(o[:, 12:], o_b) < 1e-5, impl
        assert rel(o[:, :10], o_a) < 1e-5, impl
        for x, y in zip(jax.tree.leaves(state), jax.tree.leaves(state_b)):
            assert rel(x, y) < 1e-5, impl
    ct = jax.random.normal(jax.random.PRNGKey(5), o.shape)
    args = (q, k, v, beta, nu, g, params, momentum)
    grad = lambda impl: jax.grad(lambda a: jnp.sum(chunk_step_memory(
        *a, memory=MLP, chunk_size=C, segment=segment, restarts=restarts, impl=impl)[0] * ct))(args)
    for x, y in zip(jax.tree.leaves(grad("chunk")), jax.tree.leaves(grad("recurrent"))):
        assert rel(x, y) < 1e-5


def test_restarts_in_blocks(monkeypatch):
    # restarts anywhere, several in a block of chunks and one on a block's first chunk (blocks of 3
    # over 11 chunks): the parallel form against the reference
    from atlas_jax.ops.deep_memory import chunk_steps
    monkeypatch.setattr(chunk_steps, "BLOCK", 3)
    args = make(2, 22, 2, 4, 4, 2, seed=3)
    restarts = jnp.asarray([[0, 1, 0, 1, 1, 0, 0, 0, 0, 1, 0], [1, 0, 0, 0, 0, 0, 1, 0, 0, 0, 1]], bool)
    o_ref, s_ref = chunk_step_memory(*args, memory=MLP, chunk_size=2, restarts=restarts, impl="recurrent",
                                     output_final_state=True)
    o, s = chunk_step_memory(*args, memory=MLP, chunk_size=2, restarts=restarts, impl="chunk", output_final_state=True)
    assert rel(o, o_ref) < 1e-5
    for x, y in zip(jax.tree.leaves(s), jax.tree.leaves(s_ref)):
        assert rel(x, y) < 1e-5


def test_padding_before_restarts(monkeypatch):
    # padding_before_restarts (the packed layer's layout leaves a padding token before every
    # restart): the token before a restart reads θ_0 and every other output is as without it; the
    # parallel form (blocks of 3 over 11 chunks, padded to 12) against the reference, outputs,
    # final state and every gradient
    from atlas_jax.ops.deep_memory import chunk_steps
    monkeypatch.setattr(chunk_steps, "BLOCK", 3)
    C = 2
    args = make(2, 22, 2, 4, 4, C, seed=4)
    restarts = jnp.asarray([[0, 1, 0, 0, 1, 0, 0, 0, 0, 1, 0], [0, 0, 0, 1, 0, 0, 1, 0, 0, 0, 1]], bool)
    call = lambda a, impl, padding=True, final=True: chunk_step_memory(
        *a, memory=MLP, chunk_size=C, restarts=restarts, padding_before_restarts=padding, impl=impl,
        output_final_state=final)
    (o_ref, s_ref), (o, s) = call(args, "recurrent"), call(args, "chunk")
    assert rel(o, o_ref) < 1e-5
    for x, y in zip(jax.tree.leaves(s), jax.tree.leaves(s_ref)):
        assert rel(x, y) < 1e-5
    before_restart = jnp.zeros((2, 22), bool).at[:, :-C].set(jnp.repeat(restarts[:, 1:], C, axis=1) &
                                                                 (jnp.arange(20) % C == C - 1))
    exact, _ = call(args, "recurrent", padding=False)
    assert bool(jnp.all(jnp.where(before_restart[..., None, None], True, o_ref == exact)))
    assert float(jnp.min(jnp.max(jnp.abs(o_ref - exact), axis=(2, 3))[before_restart])) > 1e-3
    ct = jax.random.normal(jax.random.PRNGKey(5), o.shape)
    grad = lambda impl: jax.grad(lambda a: jnp.sum(call(a, impl, final=False)[0] * ct))(args)
    for path, x, y in zip(jax.tree_util.tree_leaves_with_path(args), jax.tree.leaves(grad("chunk")),
                          jax.tree.leaves(grad("recurrent"))):
        assert rel(x, y) < 1e-5, jax.tree_util.keystr(path[0])


def test_linear_memory_closed_form():
    # Linear memory θ = S, one segment, no momentum carry (η = 0), no decay (α = 1): every chunk's
    # gradient is taken at S_0, so S_N = S_0 − Σ_t β_t k_t (S_0ᵀ k_t − v_t)ᵀ over the written tokens
    B, T, H, D, C = 2, 14, 2, 4, 4
    q, k, v, beta, nu, g, _, _ = make(B, T, H, D, D, C, memory=LinearMemory())
    S0 = jax.random.normal(jax.random.PRNGKey(3), (H, D, D))
    nu, g = jnp.zeros_like(nu), jnp.zeros_like(g)
    written = (T // C) * C
    _, state = chunk_step_memory(q[:, :written], k[:, :written], v[:, :written], beta[:, :written], nu, g,
                                 {"S": S0}, memory=LinearMemory(), chunk_size=C, output_final_state=True)
    err = jnp.einsum("BTHK,HKV->BTHV", k[:, :written], S0) - v[:, :written]
    expected = S0 - jnp.einsum("BTH,BTHK,BTHV->BHKV", beta[:, :written], k[:, :written], err)
    assert rel(state.params["S"], expected) < 1e-5


@pytest.mark.parametrize("change, message", [
    (lambda a: {"nu": a["nu"][:, :-1]}, "nu holds one gate per complete chunk"),
    (lambda a: {"beta": a["beta"][:, :-1]}, "beta (the per-token step size) must be"),
    (lambda a: {"segment": 6}, "segment must be None"),
    (lambda a: {"chunk_size": 32}, "holds no complete chunk"),
    (lambda a: {"final": True}, "is not a multiple of chunk_size"),
    (lambda a: {"params": {"W0": a["params"]["W0"][:, :3]}}, "params must have the leaves"),
    (lambda a: {"params": {"W0": a["params"]["W0"][:, :3], "W1": a["params"]["W1"]}}, "params['W0'] must be"),
    (lambda a: {"impl": "pallas"}, "impl must be one of"),
    (lambda a: {"gradient_params": {"W0": a["params"]["W0"]}}, "gradient_params must have the leaves"),
    (lambda a: {"restarts": jnp.zeros((1, 5), bool)}, "restarts marks the complete chunks"),
    (lambda a: {"restarts": jnp.zeros((1, 4), bool), "segment": 8}, "restarts need segment None"),
    (lambda a: {"restarts": jnp.zeros((1, 4), bool), "gradient_params": a["params"]}, "cannot be combined"),
])
def test_bad_input_names_the_argument(change, message):
    q, k, v, beta, nu, g, params, _ = make(1, 18, 2, 8, 8, 4)     # 4 chunks and 2 tokens
    a = dict(q=q, k=k, v=v, beta=beta, nu=nu, g=g, params=params, segment=None, chunk_size=4, final=False,
             impl="chunk", gradient_params=None, restarts=None)
    a.update(change(a))
    with pytest.raises(ValueError, match=re.escape(message)):
        chunk_step_memory(a["q"], a["k"], a["v"], a["beta"], a["nu"], a["g"], a["params"], memory=MLP,
                          chunk_size=a["chunk_size"], segment=a["segment"], impl=a["impl"],
                          gradient_params=a["gradient_params"], restarts=a["restarts"], output_final_state=a["final"])
