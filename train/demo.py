"""The demo: a tiny ATLAS and a tiny Transformer++ trained the same way on the built-in corpus.

    python -m atlas_jax.train.demo [--out runs/demo] [--steps N] [key=value ...]

Each model trains with the same data order, tokenizer, optimizer and number of steps (a few
minutes each on a 2-core CPU), then the demo prints their held-out perplexities side by side with
the corpus' unigram baseline, generates a continuation of a prompt with each, and leaves
everything in one folder:

    <out>/atlas/  <out>/transformer/     each a run directory (checkpoints/, metrics.jsonl,
                                         tensorboard/, loss.png, tokenizer.json, config.yml)
    <out>/loss.png                       both loss curves on one plot
    <out>/summary.json, <out>/samples.txt

Running it again with the same --out resumes (or, when both runs are complete, only evaluates
and samples again). Extra key=value overrides apply to both runs (e.g. steps=50 for a smoke run).
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

# (preset, label, its own settings). ATLAS orthogonalises the chunk-end momentum once per chunk of 64
# (ns_every=chunk, the O(T·d) dual form) instead of every token's (the paper's ns_every=token): on a
# 2-core CPU the per-token form takes ~35 s per step here, the per-chunk one ~0.5 s.
DEMO_MODELS = (("atlas", "ATLAS", ("model.preset_options.ns_every=chunk", "model.chunk_size=64")),
               ("transformer", "Transformer++", ()))
DEMO_PROMPT = "ROMEO:\nBut soft, what light"
# Shared by both runs: byte-level BPE of 512 tokens, rows of 128 tokens, float32 on CPU (bfloat16
# is emulated there, and slower).
DEMO_SETTINGS = ["size=tiny", "seq_len=128", "batch_size=8", "data.tokenizer=bpe", "data.vocab_size=512",
                 "compute_dtype=float32", "optim.learning_rate=3e-3", "optim.warmup_steps=30",
                 "log_every=10", "eval_every=100", "checkpoint_every=100", "data.eval_batches=8"]
DEMO_STEPS = 300       # per model: both see the same 300 batches (307K tokens) in the same order
DEMO_MINUTES = 5.0     # per model, a cap: a model that has not reached DEMO_STEPS by then stops there


def run_demo(out_dir="runs/demo", steps: int = DEMO_STEPS, overrides=(), new_tokens: int = 120,
             progress: bool = True, minutes_per_model: float = DEMO_MINUTES, presets=None) -> dict:
    import jax
    from jax import random

    from atlas_jax import models

    from .config import load_train_config
    from .metrics import plot_losses
    from .trainer import train

    out = Path(out_dir).absolute()
    out.mkdir(parents=True, exist_ok=True)
    results, samples = [], []
    chosen = [m for m in DEMO_MODELS if presets is None or m[0] in presets]
    if not chosen:
        raise ValueError(f"demo: --models must name some of {[m[0] for m in DEMO_MODELS]}")
    for preset, label, own in chosen:
        cfg = load_train_config(overrides=[*DEMO_SETTINGS, *own, f"steps={steps}", f"preset={preset}",
                                           f"run_dir={out / preset}", f"progress={str(progress).lower()}",
                                           *overrides])
        started = time.perf_counter()
        summary = train(cfg, time_budget_s=60 * minutes_per_model)
        if summary["exit"] != "done":
            raise SystemExit(f"atlas-jax demo: {label} stopped ({summary['exit']}) at step {summary['steps']}; "
                             f"rerun the same command to resume")
        seconds = time.perf_counter() - started
        trainer, state, dataset = summary["trainer"], summary["state"], summary["dataset"]
        eval_loss = summary["eval_loss"]
        tokenizer = dataset.tokenizer
        prompt = tokenizer.encode(DEMO_PROMPT)
        model = trainer.model(state)
        new = models.generate(model, prompt, min(new_tokens, cfg.seq_len - len(prompt)), temperature=0.8,
                              top_p=0.95, rng=random.PRNGKey(cfg.seed))
        text = tokenizer.decode([int(t) for t in new])
        samples.append(f"=== {label} ({preset}, {cfg.size}) ===\n{DEMO_PROMPT}{text}\n")
        results.append({"model": label, "preset": preset, "steps": summary["steps"], "seconds": round(seconds, 1),
                        "eval_loss": eval_loss, "eval_perplexity": math.exp(eval_loss),
                        "params": sum(leaf.size for leaf in jax.tree.leaves(trainer.abstract_state["params"])),
                        "run_dir": summary["run_dir"]})
        unigram = summary["unigram_loss"]
    plot = plot_losses([r["run_dir"] for r in results], out / "loss.png", labels=[r["model"] for r in results],
                       title="Tiny models on the built-in corpus (byte-level BPE 512)")
    report = {"unigram_perplexity": math.exp(unigram), "models": results, "prompt": DEMO_PROMPT,
              "plot": str(plot), "out_dir": str(out)}
    (out / "summary.json").write_text(json.dumps(report, indent=2))
    (out / "samples.txt").write_text("\n".join(samples))
    print(format_report(report, samples))
    return report


def format_report(report: dict, samples: list[str]) -> str:
    lines = ["", "Held-out perplexity on the built-in corpus (lower is better):",
             f"  {'model':<16s}{'params':>10s}{'steps':>8s}{'time':>9s}{'held-out ppl':>15s}"]
    for r in report["models"]:
        lines.append(f"  {r['model']:<16s}{r['params']:>10,d}{r['steps']:>8d}{r['seconds']:>8.0f}s"
                     f"{r['eval_perplexity']:>15.2f}")
    lines.append(f"  {'unigram baseline':<43s}{report['unigram_perplexity']:>15.2f}")
    lines += ["", *samples, f"Everything is in {report['out_dir']} (loss curves: {report['plot']})."]
    return "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser.add_argument("--out", default="runs/demo", help="output folder (default: runs/demo)")
    parser.add_argument("--steps", type=int, default=DEMO_STEPS, help=f"steps per model (default {DEMO_STEPS})")
    parser.add_argument("--minutes", type=float, default=DEMO_MINUTES,
                        help=f"training time cap per model in minutes (default {DEMO_MINUTES})")
    parser.add_argument("--models", default=",".join(m[0] for m in DEMO_MODELS),
                        help="comma-separated subset of the demo's models (default: all)")
    parser.add_argument("overrides", nargs="*", metavar="key=value", help="train overrides applied to both runs")
    return parser


def run(args) -> int:
    """The `demo` sub-command on parsed arguments (what atlas_jax.cli registers)."""
    from .config import ConfigError

    try:
        run_demo(args.out, args.steps, args.overrides, minutes_per_model=args.minutes,
                 presets=args.models.split(","))
    except (ConfigError, ValueError) as err:
        print(f"atlas-jax demo: error: {err}", file=sys.stderr)
        return 2
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="atlas-jax demo", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    return run(add_arguments(parser).parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
