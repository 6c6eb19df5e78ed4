"""The ``atlas-jax`` command line.

    atlas-jax memorize [key=value ...]        the test-time memorisation experiment
    atlas-jax presets [--markdown]            every preset on the four axes
    atlas-jax preset NAME [key=value ...]     one preset's axes, with options applied
"""
from __future__ import annotations

import argparse
import json
import sys

from atlas_jax.config import load_config, parse_overrides, repo_root


def _memorize(args) -> int:
    from atlas_jax.experiments.memorization import MemorizationConfig, main

    config_path = args.config or repo_root() / "configs" / "experiments" / "memorize.yml"
    cfg = load_config(MemorizationConfig, config_path if config_path.exists() else None, args.overrides)
    main(cfg)
    return 0


def _presets(args) -> int:
    from atlas_jax import presets

    if args.markdown:
        print(presets.markdown_table())
    else:
        for row in presets.table():
            print(f"{row['preset']:<20s} " + " | ".join(row[c] for c in
                                                         ("memory", "feature_map", "objective", "window",
                                                          "optimizer", "retention")))
    return 0


def _preset(args) -> int:
    from atlas_jax import presets

    spec = presets.get(args.name, **parse_overrides(args.overrides))
    print(json.dumps({"preset": args.name, **{k: str(v) for k, v in spec.axes().items()}}, indent=2,
                     ensure_ascii=False))
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="atlas-jax", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)

    mem = sub.add_parser("memorize", help="test-time memorisation experiment (recall vs n)")
    mem.add_argument("--config", type=lambda p: __import__("pathlib").Path(p), default=None,
                     help="base YAML (default: configs/experiments/memorize.yml)")
    mem.add_argument("overrides", nargs="*", help="key=value overrides, e.g. passes=3 d_k=32")
    mem.set_defaults(func=_memorize)

    pre = sub.add_parser("presets", help="the four axes of every preset")
    pre.add_argument("--markdown", action="store_true", help="print a Markdown table")
    pre.set_defaults(func=_presets)

    one = sub.add_parser("preset", help="one preset's axes")
    one.add_argument("name")
    one.add_argument("overrides", nargs="*", help="preset options as key=value")
    one.set_defaults(func=_preset)

    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except ValueError as err:   # configuration errors: one clear line, no traceback
        print(f"atlas-jax: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
