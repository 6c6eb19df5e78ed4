"""`atlas-jax train [--config FILE] [key=value ...]` (also `python -m atlas_jax.train ...`).

Exit codes: 0 done (or preempted by SIGTERM after saving: rerun the same command to resume),
2 a configuration or data error (one line naming the key), 3 stopped on a non-finite loss.
"""
from __future__ import annotations

import argparse
import math
import sys

from atlas_jax.config import ConfigError, parse_overrides

USAGE_EXAMPLE = "atlas-jax train preset=gated_deltanet size=tiny steps=200 run_dir=runs/gdn optim.learning_rate=1e-3"


def add_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser.add_argument("--config", action="append", default=[], metavar="FILE",
                        help="YAML layered over configs/base.yml (repeatable; later files win; a shipped "
                             "one such as configs/experiments/... works from any directory)")
    parser.add_argument("overrides", nargs="*", metavar="key=value",
                        help="overrides, dotted for nested keys, e.g. steps=200 optim.learning_rate=1e-3")
    return parser


def run(args) -> int:
    """The `train` sub-command on parsed arguments (what atlas_jax.cli registers)."""
    from .config import load_train_config
    from .trainer import NonFiniteError, EXIT_NONFINITE, train

    try:
        parse_overrides(args.overrides)    # a malformed or repeated key=value: the library's one-line error
        cfg = load_train_config(args.config, args.overrides)
        summary = train(cfg)
    except NonFiniteError as err:
        print(f"atlas-jax train: {err}", file=sys.stderr)
        return EXIT_NONFINITE
    except (ConfigError, ValueError, FileNotFoundError) as err:
        print(f"atlas-jax train: error: {err}", file=sys.stderr)
        return 2
    last = summary["last"]
    if summary["exit"] == "done" and "eval_loss" in last and "unigram_loss" in summary:    # process 0
        baseline = f" (unigram baseline {math.exp(summary['unigram_loss']):.2f})"
        print(f"{cfg.preset} ({cfg.size}): step {summary['steps']}, train loss {last['loss']:.4f}, "
              f"held-out loss {last['eval_loss']:.4f}, perplexity {last['eval_perplexity']:.2f}{baseline}; "
              f"run directory {summary['run_dir']}")
    return 0


def main(argv=None) -> int:
    parser = add_arguments(argparse.ArgumentParser(
        prog="atlas-jax train", description=__doc__, epilog=f"example: {USAGE_EXAMPLE}",
        formatter_class=argparse.RawDescriptionHelpFormatter))
    return run(parser.parse_args(argv))
