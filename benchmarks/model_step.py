"""One language model's jitted forward+backward on the device: the Pallas kernels its compiled
program runs (by their pallas_call names), the time per step, tokens/s and peak memory.

    python benchmarks/model_step.py --model gated_deltanet --size 340m --batch 4 --seq-len 4096

The kernel names are read from the optimised HLO of the compiled step (the Triton custom calls
carry the kernel's name), so the listing is what runs, not what was asked for. Peak memory is the
device's peak_bytes_in_use after the timed steps.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from timing import import_tree, log, save_json  # noqa: E402


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="gated_deltanet")
    parser.add_argument("--size", default="340m")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=4096)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--remat", default="none", help="none | full | dots (the model config's remat)")
    parser.add_argument("--preset-options", default=None,
                        help='JSON of the preset\'s options, e.g. \'{"ns_every": "chunk"}\' for atlas: its '
                             'default, NS on every m_t, needs 72 GiB at 340M B1 T512')
    parser.add_argument("--out", default=None, help="folder for model_step.json (default $OUT)")
    parser.add_argument("--root", default=None, help="the checkout to import atlas_jax from (default: this one)")
    args = parser.parse_args(argv)

    import_tree(args.root) if args.root else import_tree()
    import jax
    import jax.numpy as jnp
    from flax import nnx
    from atlas_jax import models

    options = {} if args.preset_options is None else {"preset_options": json.loads(args.preset_options)}
    model = models.build(args.model, args.size, rngs=nnx.Rngs(0), dtype=args.dtype, context_length=args.seq_len,
                         remat=args.remat, **options)
    vocab = model.config.vocab_size
    tokens = jax.random.randint(jax.random.PRNGKey(0), (args.batch, args.seq_len + 1), 0, vocab, jnp.int32)
    graphdef, state = nnx.split(model)

    def loss_and_grads(state, tokens):
        def loss_fn(state):
            logits = nnx.merge(graphdef, state)(tokens[:, :-1])
            logp = jax.nn.log_softmax(logits.astype(jnp.float32))
            return -jnp.mean(jnp.take_along_axis(logp, tokens[:, 1:, None], axis=-1))
        return jax.value_and_grad(loss_fn)(state)

    start = time.perf_counter()
    compiled = jax.jit(loss_and_grads).lower(state, tokens).compile()
    compile_s = time.perf_counter() - start
    hlo = compiled.as_text()
    kernels = sorted(set(re.findall(r"\b(delta_(?:intra|state|output|du)[a-z_]*)", hlo)))
    log(f"compiled in {compile_s:.1f} s; Pallas kernels in the compiled step: {kernels}")
    loss, grads = compiled(state, tokens)
    jax.block_until_ready(grads)
    t0 = time.perf_counter()
    for _ in range(args.steps):
        out = compiled(state, tokens)
    jax.block_until_ready(out)
    step_s = (time.perf_counter() - t0) / args.steps
    stats = jax.devices()[0].memory_stats() or {}
    result = {"model": args.model, "size": args.size, "params": models.param_count(args.model, args.size),
              "batch": args.batch, "seq_len": args.seq_len, "dtype": args.dtype, "preset_options": options.get("preset_options"),
              "loss": float(loss),
              "compile_s": compile_s, "step_ms": 1e3 * step_s, "tokens_per_s": args.batch * args.seq_len / step_s,
              "peak_gb": stats.get("peak_bytes_in_use", 0) / 1e9, "pallas_kernels": kernels,
              "device": jax.devices()[0].device_kind, "jax": jax.__version__}
    log(result)
    save_json([result], args.out or os.environ.get("OUT", "."), f"model_step_{args.model}_{args.size}.json")
    return result


if __name__ == "__main__":
    main()
