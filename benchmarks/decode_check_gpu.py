"""On a GPU: the chunk-start memories' cached decode equals a re-run of the forward over the buffer
(bf16 models on `impl="auto"`, so titans' prefill runs the deep-memory kernels), and how long a
decode step takes (`decode_agreement.agreement`) as generation decodes (a recurrent step with the
gradient at the chunk's start θ), by replaying the chunk, and on the plain recurrence.

    python benchmarks/decode_check_gpu.py --out $OUT      # writes decode_check_gpu.json
"""
from __future__ import annotations

import argparse
import json
import os

import jax
import jax.numpy as jnp
from flax import nnx

from decode_agreement import agreement, recurrent_decode, replay_decode
from timing import import_tree


def check(name, size, overrides, prompt_len, new, dtype):
    from atlas_jax.models import build
    model = build(name, size, rngs=nnx.Rngs(0), dtype=dtype, **overrides)
    prompt = jax.random.randint(jax.random.PRNGKey(1), (2, prompt_len), 0, model.config.vocab_size, dtype=jnp.int32)
    row = {"model": name, "size": size, **overrides, "dtype": dtype, "prompt": prompt_len, "new": new,
           "decode": agreement(model, prompt, new)}
    with replay_decode():
        row["replay"] = agreement(model, prompt, new)
    with recurrent_decode():
        row["recurrent"] = agreement(model, prompt, new)
    print(json.dumps(row), flush=True)
    return row


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    a = ap.parse_args()
    import_tree()
    rows = [check("titans", "tiny", {}, 100, 40, "bfloat16"),
            check("atlas", "tiny", {}, 100, 40, "bfloat16"),
            check("omeganet", "tiny", {}, 100, 40, "bfloat16"),
            check("titans", "170m", {}, 100, 12, "bfloat16")]
    with open(os.path.join(a.out, "decode_check_gpu.json"), "w") as f:
        json.dump({"device": jax.devices()[0].device_kind, "jax": jax.__version__, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
