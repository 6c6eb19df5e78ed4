"""On a GPU: the chunk-start memories' cached decode equals a re-run of the forward over the buffer
(bf16 models on `impl="auto"`, so titans' prefill and every decode step's chunk run the
deep-memory kernels), and how long a decode step takes against the recurrent one.

    python benchmarks/decode_check_gpu.py --out $OUT      # writes decode_check_gpu.json
"""
from __future__ import annotations

import argparse
import json
import os
import time

import jax
import jax.numpy as jnp
from flax import nnx

from timing import import_tree


def check(name, size, overrides, prompt_len, new, dtype):
    from atlas_jax.models import build, layers
    from atlas_jax.models.generation import decode_step_fn, prefill_fn
    model = build(name, size, rngs=nnx.Rngs(0), dtype=dtype, **overrides)
    by_chunk = layers.MemoryLayer.decodes_by_chunk
    prompt = jax.random.randint(jax.random.PRNGKey(1), (2, prompt_len), 0, model.config.vocab_size, dtype=jnp.int32)
    graphdef, state = nnx.split(model)
    forward = nnx.jit(lambda m, t: m(t))
    row = {"model": name, "size": size, **overrides, "dtype": dtype, "prompt": prompt_len, "new": new}
    for mode in ("chunk", "recurrent"):
        if mode == "recurrent":
            layers.MemoryLayer.decodes_by_chunk = property(lambda self: False)
        logits, cache = prefill_fn(graphdef, prompt_len + new)(state, prompt)
        step = decode_step_fn(graphdef)
        buffer = jnp.pad(prompt, ((0, 0), (0, new)))
        token = jnp.argmax(logits[:, -1], -1).astype(jnp.int32)
        worst, scale, agree, times = 0.0, 0.0, 0, []
        for i in range(new - 1):
            buffer = buffer.at[:, prompt_len + i].set(token)
            reference = forward(model, buffer)[:, prompt_len + i].astype(jnp.float32)
            t = time.perf_counter()
            logits, cache = step(state, token[:, None], cache, jnp.int32(prompt_len + i))
            logits = jax.block_until_ready(logits)[:, 0].astype(jnp.float32)
            times.append(time.perf_counter() - t)
            worst = max(worst, float(jnp.abs(logits - reference).max()))
            scale = max(scale, float(jnp.abs(reference).max()))
            agree += int(jnp.sum(jnp.argmax(logits, -1) == jnp.argmax(reference, -1)))
            token = jnp.argmax(logits, -1).astype(jnp.int32)
        times = sorted(times[2:])
        row[mode] = {"max_abs_diff": worst, "max_abs_logit": scale, "argmax_agree": f"{agree}/{2 * (new - 1)}",
                     "step_ms_median": 1e3 * times[len(times) // 2]}
        print(json.dumps(row), flush=True)
    layers.MemoryLayer.decodes_by_chunk = by_chunk
    return row


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    a = ap.parse_args()
    import_tree()
    rows = [check("titans", "tiny", {}, 100, 40, "bfloat16"),
            check("atlas", "tiny", {}, 100, 40, "bfloat16"),
            check("titans", "tiny", {}, 100, 40, "float32"),
            check("titans", "170m", {}, 100, 12, "bfloat16")]
    with open(os.path.join(a.out, "decode_check_gpu.json"), "w") as f:
        json.dump({"device": jax.devices()[0].device_kind, "jax": jax.__version__, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
