"""benchmarks/flops.py, the matmul FLOP count behind deep_memory.py's TFLOP/s column."""
import os
import sys

import jax
import jax.numpy as jnp

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))
import flops  # noqa: E402


def test_dot_flops_counts_scans_rematerialisation_and_operand_dtypes():
    """A scan of 5 steps of a checkpointed [4, 6] @ [6, 6] product and a bf16 product: the forward
    has 5 products of 2·4·6·6 FLOPs; the gradient with respect to w recomputes each one inside the
    backward's remat and adds the cotangent's product (x's cotangent is not asked for, so not
    formed: 3 products a step in all); the bf16 product and its two backward products count as
    bf16; a while loop is reported as left out."""
    x, w = jnp.ones((4, 6)), jnp.ones((6, 6))
    step = jax.checkpoint(lambda h, w: jnp.tanh(h @ w))

    def f(w, x):
        h, _ = jax.lax.scan(lambda h, _: (step(h, w) @ w / 6.0, None), x, None, length=5)
        return jnp.sum(h) + jnp.sum((x.astype(jnp.bfloat16) @ w.astype(jnp.bfloat16)).astype(jnp.float32))

    one = 2 * 4 * 6 * 6
    assert flops.dot_flops(f, w, x) == flops.FlopCount(11 * one, one, True, ())
    count = flops.dot_flops(jax.grad(f), w, x)
    assert count.complete and count.bf16_flops == 2 * one, count
    # forward: 2 products a step and the bf16 one; backward: the remat's recomputed product and
    # two cotangent products per step product (h's and w's), the bf16 one's w cotangent
    assert count.flops == (5 * 2 + 1 + 5 * (1 + 2 + 2) + 1) * one, count.flops / one
    loop = flops.dot_flops(lambda w: jax.lax.fori_loop(0, jnp.int32(3), lambda i, h: h @ w, w), w)
    assert not loop.complete and loop.left_out == ("while",)
    assert flops.peak_tflops("NVIDIA H200", count) > 494 and flops.peak_tflops("cpu", count) is None
