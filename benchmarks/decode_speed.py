"""How long a model takes to decode a token: the jitted decode step alone, and `generate` itself.

Per row (bf16 weights, B2, a 100-token prompt of random tokens):
  * ``prefill_ms``: `prefill_fn` alone (the prompt through the training path);
  * ``step_ms``: `decode_step_fn` chained for ``--steps`` greedy tokens, the median step, with
    ``pos`` traced (the step decides a chunk's end on the device); where the tree's step takes
    ``chunk_end`` (static), also ``step_static_ms`` (the steps that are no chunk's end) and
    ``closing_static_ms`` (those that are);
  * ``generate_ms_per_token``: `generate(..., temperature=0)` of ``--new`` tokens, less the prefill,
    over its ``--new`` − 1 decode steps (the better of two calls after a first, which compiles:
    ``generate_first_s``).

    python benchmarks/decode_speed.py --rows atlas-ns-chunk-170m titans-170m --out $OUT
    python benchmarks/decode_speed.py --root build/before --label before ...   # another tree

Every tree runs in its own process; times from one command on one device compare.
"""
from __future__ import annotations

import argparse
import inspect
import json
import os
import time

ROWS = {"titans-170m": ("titans", "170m", {}), "atlas-ns-chunk-170m": ("atlas", "170m", {"preset_options": {"ns_every": "chunk"}}),
        "atlas-170m": ("atlas", "170m", {}), "moneta-170m": ("moneta", "170m", {}), "memora-170m": ("memora", "170m", {}),
        "gated_deltanet-170m": ("gated_deltanet", "170m", {}),
        "atlas-ns-chunk-170m-unrolled": ("atlas", "170m", {"preset_options": {"ns_every": "chunk"}, "scan_layers": False}), "atlas-ns-chunk-tiny": ("atlas", "tiny", {"preset_options": {"ns_every": "chunk"}})}


def _median(xs):
    xs = sorted(xs)
    return 1e3 * xs[len(xs) // 2] if xs else float("nan")


def measure(name, size, overrides, *, steps: int, new: int, batch: int = 2, prompt_len: int = 100) -> dict:
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from atlas_jax.models import build, generate
    from atlas_jax.models.generation import decode_step_fn, prefill_fn

    model = build(name, size, rngs=nnx.Rngs(0), dtype="bfloat16", **overrides)
    graphdef, state = nnx.split(model)
    prompt = jax.random.randint(jax.random.PRNGKey(1), (batch, prompt_len), 0, model.config.vocab_size, dtype=jnp.int32)
    row = {"model": name, "size": size, **overrides, "batch": batch, "prompt": prompt_len}
    prefill = prefill_fn(graphdef, prompt_len + max(steps, new) + 1)
    jax.block_until_ready(prefill(state, prompt))
    times = []
    for _ in range(3):
        start = time.perf_counter()
        jax.block_until_ready(prefill(state, prompt))
        times.append(time.perf_counter() - start)
    row["prefill_ms"] = _median(times)

    step = decode_step_fn(graphdef)
    static = "chunk_end" in inspect.signature(step).parameters
    size_c = model.config.chunk_size
    routes = [("step_ms", None)] + ([("static", True)] if static else [])
    for key, route in routes:
        logits, cache = prefill(state, prompt)
        token = jnp.argmax(logits[:, -1], -1).astype(jnp.int32)[:, None]
        if route is not None:   # compile both steps first
            for end in (False, True):
                jax.block_until_ready(step(state, token, cache, jnp.int32(prompt_len), chunk_end=end))
        regular, closing = [], []
        for i in range(steps):
            pos = prompt_len + i
            end = pos % size_c == size_c - 1
            kwargs = {} if route is None else {"chunk_end": end}
            jax.block_until_ready(cache)
            start = time.perf_counter()
            logits, cache = step(state, token, cache, jnp.int32(pos), **kwargs)
            jax.block_until_ready(logits)
            (closing if end else regular).append(time.perf_counter() - start)
            token = jnp.argmax(logits[:, -1], -1).astype(jnp.int32)[:, None]
        if route is None:
            row["step_ms"] = _median(regular[2:] + closing)
        else:
            row["step_static_ms"] = _median(regular[2:])
            row["closing_static_ms"] = _median(closing)
    start = time.perf_counter()
    jax.block_until_ready(generate(model, prompt, new, temperature=0.0))
    row["generate_first_s"] = time.perf_counter() - start   # compiling it, mostly
    times = []
    for _ in range(2):
        start = time.perf_counter()
        jax.block_until_ready(generate(model, prompt, new, temperature=0.0))
        times.append(time.perf_counter() - start)
    row["generate_ms"] = 1e3 * min(times)
    row["generate_ms_per_token"] = (row["generate_ms"] - row["prefill_ms"]) / (new - 1)
    row["new"] = new
    return row


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", nargs="+", default=["titans-170m", "atlas-ns-chunk-170m"], choices=list(ROWS))
    ap.add_argument("--root", default=None, help="the checkout to import atlas_jax from (default: this one)")
    ap.add_argument("--label", default="tree")
    ap.add_argument("--steps", type=int, default=70, help="chained decode_step_fn steps (70 pass one chunk end)")
    ap.add_argument("--new", type=int, default=129, help="tokens `generate` makes (129: 128 decode steps)")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    a = ap.parse_args()
    from timing import import_tree
    import_tree(a.root) if a.root else import_tree()
    import jax
    rows = []
    for label in a.rows:
        name, size, overrides = ROWS[label]
        row = {"label": a.label, "row": label, **measure(name, size, overrides, steps=a.steps, new=a.new)}
        print(json.dumps(row), flush=True)
        rows.append(row)
    with open(os.path.join(a.out, f"decode_speed_{a.label}.json"), "w") as f:
        json.dump({"device": jax.devices()[0].device_kind, "jax": jax.__version__, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
