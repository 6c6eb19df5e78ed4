"""On a GPU: the chunk-start memories' cached decode equals a re-run of the forward over the buffer
(bf16 models on `impl="auto"`, so titans' prefill runs the deep-memory kernels), and how long a
decode step takes (`decode_agreement.agreement`) as generation decodes (a recurrent step with the
gradient at the chunk's start θ), by replaying the chunk, and on the plain recurrence.

    python benchmarks/decode_check_gpu.py --out $OUT      # writes decode_check_gpu.json
    python benchmarks/decode_check_gpu.py --rows atlas-ns-chunk-170m --out $OUT     # one row
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


# label -> check()'s model, size, overrides, prompt, new tokens (bf16 every one)
ROWS = {"titans-tiny": ("titans", "tiny", {}, 100, 40), "atlas-tiny": ("atlas", "tiny", {}, 100, 40),
        "omeganet-tiny": ("omeganet", "tiny", {}, 100, 40), "titans-170m": ("titans", "170m", {}, 100, 12),
        "atlas-ns-chunk-tiny": ("atlas", "tiny", {"preset_options": {"ns_every": "chunk"}}, 100, 40),
        "atlas-ns-chunk-170m": ("atlas", "170m", {"preset_options": {"ns_every": "chunk"}}, 100, 40),
        "moneta-tiny": ("moneta", "tiny", {}, 100, 40), "memora-tiny": ("memora", "tiny", {}, 100, 40),
        "moneta-170m": ("moneta", "170m", {}, 100, 40), "memora-170m": ("memora", "170m", {}, 100, 40)}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--rows", nargs="+", default=list(ROWS), choices=list(ROWS))
    a = ap.parse_args()
    import_tree()
    rows = [check(*ROWS[label][:3], *ROWS[label][3:], "bfloat16") for label in a.rows]
    with open(os.path.join(a.out, "decode_check_gpu.json"), "w") as f:
        json.dump({"device": jax.devices()[0].device_kind, "jax": jax.__version__, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
