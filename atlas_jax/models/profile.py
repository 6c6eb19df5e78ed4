"""Time (and optionally trace) one model's jitted forward + backward, for the device machine:

    from atlas_jax.models.profile import profile_model
    profile_model("gated_deltanet", "340m", batch=8, seq_len=4096, trace_dir="/tmp/trace")

With ``trace_dir`` the timed steps run under ``jax.profiler.trace`` (TensorBoard / Perfetto), where
the Pallas kernels of the exact delta family show up by name. Returns a dict of the measurements.
"""
from __future__ import annotations

import time

import jax
import jax.numpy as jnp
from flax import nnx

from atlas_jax.models.build import build, param_count

__all__ = ["profile_model"]


def profile_model(name: str = "gated_deltanet", size: str = "340m", *, batch: int = 8, seq_len: int = 4096,
                  steps: int = 5, dtype: str = "bfloat16", trace_dir: str | None = None, seed: int = 0,
                  **overrides) -> dict:
    model = build(name, size, rngs=nnx.Rngs(seed), dtype=dtype, **overrides)
    vocab = model.config.vocab_size
    tokens = jax.random.randint(jax.random.PRNGKey(seed), (batch, seq_len + 1), 0, vocab, dtype=jnp.int32)
    graphdef, state = nnx.split(model)

    @jax.jit
    def forward_backward(state, tokens):
        def loss_fn(state):
            logits = nnx.merge(graphdef, state)(tokens[:, :-1])
            logp = jax.nn.log_softmax(logits)
            return -jnp.mean(jnp.take_along_axis(logp, tokens[:, 1:, None], axis=-1))
        return jax.value_and_grad(loss_fn)(state)

    start = time.perf_counter()
    loss, grads = forward_backward(state, tokens)
    jax.block_until_ready(grads)
    compile_s = time.perf_counter() - start

    def timed():
        t0 = time.perf_counter()
        for _ in range(steps):
            out = forward_backward(state, tokens)
        jax.block_until_ready(out)
        return (time.perf_counter() - t0) / steps

    if trace_dir is not None:
        with jax.profiler.trace(trace_dir):
            step_s = timed()
    else:
        step_s = timed()
    return {"name": name, "size": size, "params": param_count(name, size, **overrides), "batch": batch,
            "seq_len": seq_len, "dtype": dtype, "loss": float(loss), "compile_s": compile_s, "step_s": step_s,
            "tokens_per_s": batch * seq_len / step_s, "device": str(jax.devices()[0])}
