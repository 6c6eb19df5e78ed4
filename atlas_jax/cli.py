"""The ``atlas-jax`` command line.

    atlas-jax memorize [--config FILE ...] [--print-config] [key=value ...]
                                              the test-time memorisation experiment
    atlas-jax presets [--markdown] [--size S] [--names a,b]
                                              every preset on the four axes; with --size, every
                                              model's parameters and memory state per layer
    atlas-jax preset NAME [key=value ...]     one preset's axes, with options applied
    atlas-jax train [--config FILE ...] [key=value ...]
                                              pretrain a language model (atlas_jax.train)
    atlas-jax demo [--out DIR] [--models a,b]  tiny ATLAS vs Transformer++ on the built-in corpus
    atlas-jax generate --checkpoint DIR --prompt TEXT [--max-new-tokens N --temperature T --top-p P]
                                              continue a prompt with a trained model

Every command reads and checks its whole configuration before any work starts: a missing
``--config`` file, a value of the wrong type or range, an unknown key or an output folder that
cannot be written is one line ``atlas-jax: error: ...`` on stderr and exit code 2 (no traceback).
``--config`` files layer over the command's shipped base config, then ``key=value`` overrides
(YAML values, dotted keys for sections) layer over those (see atlas_jax.config).

Adding a command: one function taking the parsed arguments and returning the exit code, registered
with ``@command(name, help, arguments)`` where ``arguments(parser)`` adds its flags (use
:func:`add_config_arguments` for the shared ``--config`` / ``--print-config`` / ``key=value`` set and
:func:`load_command_config` to read them). Raise :class:`~atlas_jax.config.ConfigError` for anything
the user must fix; ``main`` prints it as one line.
"""
from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from typing import Callable

from atlas_jax.config import ConfigError, config_path, dump_yaml, load_config, parse_overrides, resolve_config_file

__all__ = ["main", "command", "add_config_arguments", "load_command_config"]


class _UsageError(Exception):
    """A malformed command line (argparse's complaint), reported like a config error."""


class _Parser(argparse.ArgumentParser):
    def error(self, message):
        raise _UsageError(f"{message} (see {self.prog} --help)")


@dataclass(frozen=True)
class _Command:
    name: str
    help: str
    arguments: Callable[[argparse.ArgumentParser], None] | None
    run: Callable[[argparse.Namespace], int]


_COMMANDS: list[_Command] = []


def command(name: str, help: str, arguments: Callable[[argparse.ArgumentParser], None] | None = None):
    """Registers ``fn(args) -> exit code`` as ``atlas-jax NAME``; ``arguments(parser)`` adds its flags."""
    def register(fn):
        _COMMANDS.append(_Command(name, help, arguments, fn))
        return fn
    return register


def add_config_arguments(parser: argparse.ArgumentParser, base: str) -> None:
    """``--config FILE`` (repeatable, layered over ``base``), ``--print-config`` and ``key=value ...``."""
    parser.add_argument("--config", action="append", default=[], metavar="FILE",
                        help=f"YAML layered over the shipped {base} (repeatable; later files win)")
    parser.add_argument("--print-config", action="store_true",
                        help="print the resolved config as YAML and exit without running")
    parser.add_argument("overrides", nargs="*", metavar="key=value",
                        help="overrides parsed as YAML, e.g. passes=3 n_pairs=[8,16]")


def load_command_config(cls, args: argparse.Namespace, *base: str):
    """``cls`` from the shipped ``configs/<base...>``, the ``--config`` files and the overrides, with
    every value and the output folders checked (nothing is created yet)."""
    files = [resolve_config_file(path) for path in args.config]
    return load_config(cls, config_path(*base), *files, overrides=args.overrides)


# --------------------------------------------------------------------------------------------------
# Commands


def _memorize_arguments(parser):
    add_config_arguments(parser, "configs/experiments/memorize.yml")


@command("memorize", "test-time memorisation experiment (recall vs n)", _memorize_arguments)
def _memorize(args) -> int:
    from atlas_jax.experiments.memorization import MemorizationConfig, main

    cfg = load_command_config(MemorizationConfig, args, "experiments", "memorize.yml")
    if args.print_config:
        print(dump_yaml(cfg), end="")
        return 0
    main(cfg)                        # creates and probes out_dir first, then computes
    return 0


def _presets_arguments(parser):
    parser.add_argument("--markdown", action="store_true", help="print a Markdown table")
    parser.add_argument("--size", default=None,
                        help="also print each model's parameter count and its memory state per layer at this "
                             "size (tiny, 170m, 340m, 760m, 1.3b); the attention baselines and hybrids are added")
    parser.add_argument("--names", default=None,
                        help="comma-separated model names to list (default: all)")


_AXES = ("memory", "feature_map", "objective", "window", "optimizer", "retention")


def _model_rows(size, wanted):
    """Parameters and per-layer memory state (float32) of each model at ``size``."""
    from atlas_jax import models

    rows = []
    for name in models.names():
        if wanted is not None and name not in wanted:
            continue
        params = models.param_count(name, size)
        state = models.memory_state_size(name, size)
        rows.append({"model": name, "parameters": params, "state_floats_per_layer": state["total"],
                     "memory_layers": state["memory_layers"]})
    return rows


@command("presets", "the four axes of every preset (with --size: parameters and memory state)", _presets_arguments)
def _presets(args) -> int:
    from atlas_jax import presets

    wanted = None if args.names is None else [n.strip() for n in args.names.split(",") if n.strip()]
    if args.size is not None:
        from atlas_jax import models
        from atlas_jax.models.config import size_values

        try:
            size_values(args.size)
        except ValueError as err:
            raise ConfigError(f"--size: {err}") from None
        unknown = sorted(set(wanted or ()) - set(models.names()))
        if unknown:
            raise ConfigError(f"--names: unknown model(s) {unknown}; choose from {models.names()}")
        print(f"# size {args.size}: parameters include embeddings and head (tied weights once); memory state is "
              "θ + inner-optimizer state + retention/window per sequence, float32, per memory layer")
        for row in _model_rows(args.size, wanted):
            state_mib = 4 * row["state_floats_per_layer"] / 2 ** 20
            print(f"{row['model']:<20s} {row['parameters'] / 1e6:9.1f}M params   "
                  f"{state_mib:9.2f} MiB state/layer × {row['memory_layers']} layers")
        return 0
    rows = [row for row in presets.table() if wanted is None or row["preset"] in wanted]
    if args.markdown:
        print(presets.markdown_table())
    else:
        for row in rows:
            print(f"{row['preset']:<20s} " + " | ".join(row[c] for c in _AXES))
    return 0


def _preset_arguments(parser):
    parser.add_argument("name")
    parser.add_argument("overrides", nargs="*", metavar="key=value", help="preset options, e.g. window=8")


@command("preset", "one preset's axes", _preset_arguments)
def _preset(args) -> int:
    from atlas_jax import presets

    options = parse_overrides(args.overrides)
    try:
        spec = presets.get(args.name, **options)
    except (ValueError, TypeError) as err:    # an unknown name or option, or an option value that does not fit
        raise ConfigError(str(err)) from None
    print(json.dumps({"preset": args.name, **{k: str(v) for k, v in spec.axes().items()}}, indent=2,
                     ensure_ascii=False))
    return 0


def _train_arguments(parser):
    from atlas_jax.train import cli as train_cli
    train_cli.add_arguments(parser)


@command("train", "pretrain a language model (configs/base.yml, --config FILE, key=value)", _train_arguments)
def _train(args) -> int:
    from atlas_jax.train import cli as train_cli
    return train_cli.run(args)


def _demo_arguments(parser):
    from atlas_jax.train import demo
    demo.add_arguments(parser)


@command("demo", "tiny ATLAS and Transformer++ trained the same way on the built-in corpus, side by side",
         _demo_arguments)
def _demo(args) -> int:
    from atlas_jax.train import demo
    return demo.run(args)


def _generate_arguments(parser):
    parser.add_argument("--checkpoint", required=True,
                        help="a run directory of atlas-jax train (its latest checkpoint) or one checkpoint's directory")
    parser.add_argument("--prompt", required=True, help="the text to continue")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=1.0, help="0 for greedy decoding")
    parser.add_argument("--top-k", type=int, default=None)
    parser.add_argument("--top-p", type=float, default=None)
    parser.add_argument("--seed", type=int, default=0)


@command("generate", "continue a prompt with a trained model (prefill, then decode on its recurrent state)",
         _generate_arguments)
def _generate(args) -> int:
    if args.max_new_tokens < 1:
        raise ConfigError(f"--max-new-tokens={args.max_new_tokens}: must be an int >= 1")
    import jax
    import jax.numpy as jnp

    from atlas_jax import models
    from atlas_jax.train.trainer import load_run

    model, tokenizer, _ = load_run(args.checkpoint)
    prompt = tokenizer.encode(args.prompt)
    if not prompt:
        raise ConfigError("--prompt: encodes to no tokens; give some text")
    try:
        new = models.generate(model, jnp.asarray(prompt, jnp.int32), args.max_new_tokens,
                              temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                              rng=jax.random.PRNGKey(args.seed))
    except ValueError as err:   # sampling settings that do not fit
        raise ConfigError(str(err)) from None
    print(args.prompt + tokenizer.decode([int(t) for t in jax.device_get(new)]))
    return 0


# --------------------------------------------------------------------------------------------------


def _parser() -> _Parser:
    from atlas_jax import __version__

    parser = _Parser(prog="atlas-jax", description=__doc__.split("\n\n")[1],
                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version", version=f"atlas-jax {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for cmd in _COMMANDS:
        one = sub.add_parser(cmd.name, help=cmd.help, description=cmd.help)
        if cmd.arguments is not None:
            cmd.arguments(one)
        one.set_defaults(run=cmd.run)
    return parser


def _error(message: str) -> int:
    print(f"atlas-jax: error: {' '.join(message.split())}", file=sys.stderr)
    return 2


def main(argv=None) -> int:
    parser = _parser()
    try:
        args, extra = parser.parse_known_args(argv)
        # key=value given after an option land in ``extra``; anything else there is unknown.
        unknown = [a for a in extra if a.startswith("-") or not hasattr(args, "overrides")]
        if unknown:
            hint = " (overrides are key=value, without dashes)" if any("=" in a for a in unknown) else ""
            raise _UsageError(f"unrecognized arguments: {' '.join(unknown)}{hint} "
                              f"(see atlas-jax {args.command} --help)")
        if extra:
            args.overrides = [*args.overrides, *extra]
        return args.run(args)
    except (ConfigError, _UsageError) as err:   # configuration errors: one line, no traceback
        return _error(str(err))


if __name__ == "__main__":
    sys.exit(main())
