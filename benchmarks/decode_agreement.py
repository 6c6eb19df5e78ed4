"""How far a trained run's cached decode is from its own forward (CPU, about a minute).

Prefills a prompt from the built-in corpus, then decodes greedily token by token; after every
token it runs the whole buffer through the model's forward and compares the decode step's logits
with the forward's at that position (the largest absolute difference, and whether their argmax
agrees). ``--decode recurrent`` forces the token-by-token recurrence on every memory layer (what
generation ran before the chunk-start memories decoded by chunk), ``--decode replay`` the chunk
replay on every chunk-start layer (what they ran before a step took its gradient at the chunk's
start θ), for comparison.

    python benchmarks/decode_agreement.py --run runs/demo/atlas                 # after `make run`
    python benchmarks/decode_agreement.py --run runs/demo/atlas --decode recurrent

`agreement` is the loop, which `decode_check_gpu.py` runs on a GPU too.
"""
from __future__ import annotations

import argparse
import contextlib
import pathlib
import time

import jax
import jax.numpy as jnp
from flax import nnx

CORPUS = pathlib.Path(__file__).resolve().parents[1] / "train" / "data" / "shakespeare.txt"


@contextlib.contextmanager
def _layers_with(prop: str, value: bool):
    """Every MemoryLayer's property ``prop`` reads ``value`` inside the context."""
    from atlas_jax.models import layers
    before = getattr(layers.MemoryLayer, prop)
    setattr(layers.MemoryLayer, prop, property(lambda self: value))
    try:
        yield
    finally:
        setattr(layers.MemoryLayer, prop, before)


def recurrent_decode():
    """Every memory layer decodes on the token-by-token recurrence (generation before the
    chunk-start memories decoded what their forward computes)."""
    return _layers_with("decodes_by_chunk", False)


def replay_decode():
    """Every chunk-start memory layer decodes by replaying its current chunk (generation before a
    step took its gradient at the chunk's start θ, `MemoryLayer.decodes_at_chunk_start`)."""
    return _layers_with("decodes_at_chunk_start", False)


def agreement(model, prompt, new: int) -> dict:
    """Greedy decode of ``new`` tokens after ``prompt`` [B, P]; each step's logits against the
    forward's over the whole buffer: the largest |difference|, the largest |logit|, how many argmax
    agree (of B·(new − 1)) and the median time of a decode step (ms, after two warm-up steps)."""
    from atlas_jax.models.generation import decode_step_fn, prefill_fn
    P = prompt.shape[1]
    graphdef, state = nnx.split(model)
    forward = nnx.jit(lambda m, t: m(t))
    logits, cache = prefill_fn(graphdef, P + new)(state, prompt)
    step = decode_step_fn(graphdef)
    buffer = jnp.pad(prompt, ((0, 0), (0, new)))
    token = jnp.argmax(logits[:, -1], -1).astype(jnp.int32)
    worst, scale, agree, times = 0.0, 0.0, 0, []
    for i in range(new - 1):
        buffer = buffer.at[:, P + i].set(token)
        # ready before the clock starts: else the step's time holds the forward's tail
        reference = jax.block_until_ready(forward(model, buffer)[:, P + i].astype(jnp.float32))
        start = time.perf_counter()
        logits, cache = step(state, token[:, None], cache, jnp.int32(P + i))
        logits = jax.block_until_ready(logits)[:, 0].astype(jnp.float32)
        times.append(time.perf_counter() - start)
        worst = max(worst, float(jnp.abs(logits - reference).max()))
        scale = max(scale, float(jnp.abs(reference).max()))
        agree += int(jnp.sum(jnp.argmax(logits, -1) == jnp.argmax(reference, -1)))
        token = jnp.argmax(logits, -1).astype(jnp.int32)
    times = sorted(times[2:]) or [float("nan")]
    return {"max_abs_diff": worst, "max_abs_logit": scale, "argmax_agree": f"{agree}/{prompt.shape[0] * (new - 1)}",
            "step_ms_median": 1e3 * times[len(times) // 2]}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--run", required=True, help="a run directory of atlas-jax train (or one checkpoint's)")
    ap.add_argument("--prompt-tokens", type=int, default=100)
    ap.add_argument("--new-tokens", type=int, default=60)
    ap.add_argument("--offset", type=int, default=200_000, help="where in the corpus the prompt starts (characters)")
    ap.add_argument("--decode", choices=["model", "replay", "recurrent"], default="model",
                    help="model: as generation decodes; replay: the chunk replay on every chunk-start layer; "
                         "recurrent: the recurrence on every memory layer")
    a = ap.parse_args()
    from atlas_jax.train.trainer import load_run
    model, tokenizer, step = load_run(a.run)
    text = CORPUS.read_text()[a.offset:a.offset + 40 * a.prompt_tokens]
    prompt = jnp.asarray(tokenizer.encode(text)[:a.prompt_tokens], jnp.int32)[None]
    context = {"recurrent": recurrent_decode, "replay": replay_decode}.get(a.decode, contextlib.nullcontext)
    with context():
        row = agreement(model, prompt, a.new_tokens)
    print(f"{a.run} (step {step}), decode {a.decode}: prompt {prompt.shape[1]} tokens, {a.new_tokens - 1} decode "
          f"steps; largest |decode logit - forward logit| {row['max_abs_diff']:.3e}; greedy argmax agrees at "
          f"{row['argmax_agree']}")


if __name__ == "__main__":
    main()
