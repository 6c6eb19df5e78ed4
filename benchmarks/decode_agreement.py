"""How far a trained run's cached decode is from its own forward (CPU, about a minute).

Prefills a prompt from the built-in corpus, then decodes greedily token by token; after every
token it runs the whole buffer through the model's forward and compares the decode step's logits
with the forward's at that position (the largest absolute difference, and whether their argmax
agrees). ``--decode recurrent`` forces the token-by-token recurrence on every memory layer (what
generation ran before the chunk-start memories decoded by chunk), for comparison.

    python benchmarks/decode_agreement.py --run runs/demo/atlas                 # after `make run`
    python benchmarks/decode_agreement.py --run runs/demo/atlas --decode recurrent
"""
from __future__ import annotations

import argparse
import pathlib

import jax
import jax.numpy as jnp
from flax import nnx

from atlas_jax.models import layers
from atlas_jax.models.generation import decode_step_fn, prefill_fn
from atlas_jax.train.trainer import load_run

CORPUS = pathlib.Path(__file__).resolve().parents[1] / "train" / "data" / "shakespeare.txt"


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--run", required=True, help="a run directory of atlas-jax train (or one checkpoint's)")
    ap.add_argument("--prompt-tokens", type=int, default=100)
    ap.add_argument("--new-tokens", type=int, default=60)
    ap.add_argument("--offset", type=int, default=200_000, help="where in the corpus the prompt starts (characters)")
    ap.add_argument("--decode", choices=["model", "recurrent"], default="model",
                    help="model: as generation decodes; recurrent: the recurrence on every memory layer")
    a = ap.parse_args()
    if a.decode == "recurrent":
        layers.MemoryLayer.decodes_by_chunk = property(lambda self: False)
    model, tokenizer, step = load_run(a.run)
    text = CORPUS.read_text()[a.offset:a.offset + 40 * a.prompt_tokens]
    prompt = jnp.asarray(tokenizer.encode(text)[:a.prompt_tokens], jnp.int32)[None]
    P, new = prompt.shape[1], a.new_tokens
    graphdef, state = nnx.split(model)
    forward = nnx.jit(lambda m, t: m(t))
    logits, cache = prefill_fn(graphdef, P + new)(state, prompt)
    step_fn = decode_step_fn(graphdef)
    buffer = jnp.pad(prompt, ((0, 0), (0, new)))
    token = jnp.argmax(logits[:, -1], -1).astype(jnp.int32)
    worst, agree = 0.0, 0
    for i in range(new - 1):
        buffer = buffer.at[:, P + i].set(token)
        reference = forward(model, buffer)[:, P + i]
        logits, cache = step_fn(state, token[:, None], cache, jnp.int32(P + i))
        worst = max(worst, float(jnp.abs(logits[:, 0] - reference).max()))
        agree += int(jnp.argmax(logits[:, 0], -1)[0] == jnp.argmax(reference, -1)[0])
        token = jnp.argmax(logits[:, 0], -1).astype(jnp.int32)
    print(f"{a.run} (step {step}), decode {a.decode}: prompt {P} tokens, {new - 1} decode steps; largest "
          f"|decode logit - forward logit| {worst:.3e}; greedy argmax agrees at {agree}/{new - 1}")


if __name__ == "__main__":
    main()
