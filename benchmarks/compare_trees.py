#!/usr/bin/env python3
"""Is the speed unchanged between two source trees? Times ops and deep-memory layers side by side.

For a refactor or a kernel change: both trees are imported into one process in turn (each
tree's ops compiled ahead of time before the next tree is imported), then timed in interleaved
rounds (every round times every tree, op and mode once), so that clock drift and neighbours'
load hit both alike. Reports each tree's median over rounds and the ratio to the first tree.

    git archive <before> atlas_jax kernels | tar -x -C build/before      # here, then carry it
    git archive HEAD atlas_jax kernels | tar -x -C build/after
    python3 benchmarks/compare_trees.py --tree before=build/before --tree after=build/after \\
        --shape 4,4096,16,128 --ops gdn deltanet kda --rounds 5 2>&1 | tee $OUT/compare.log
    # a deep-memory layer (deep_memory.py's entries, bf16 q/k/v, impl auto: the kernel route on a GPU)
    python3 benchmarks/compare_trees.py --tree before=build/before --tree after=build/after \\
        --shape 4,4096,8,128 --presets titans --impl auto --rounds 3
    # the same tree with its deep-memory kernels capped at 128 registers a thread (register_cap.py)
    python3 benchmarks/compare_trees.py --tree main=build/after --tree cap128=build/after \
        --maxnreg cap128=128 --shape 4,4096,8,128 --presets titans --impl auto --rounds 2

JSON of every round goes to --out (default $OUT) as compare_trees.json.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import deep_memory
import timing


def _forget_atlas_jax(root):
    """Drops the imported atlas_jax modules and `root` from sys.path, so that the next tree's
    import starts afresh; compiled executables of the previous tree keep working."""
    for name in [n for n in sys.modules if n == "atlas_jax" or n.startswith("atlas_jax.")]:
        del sys.modules[name]
    while str(root) in sys.path:
        sys.path.remove(str(root))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tree", action="append", required=True, metavar="NAME=PATH",
                    help="a source tree (holding atlas_jax/ and kernels/); the first is the "
                         "baseline; give two or more")
    ap.add_argument("--shape", type=timing.shape_arg, default=(4, 4096, 16, 128), help="B,T,H,D")
    ap.add_argument("--ops", nargs="*", default=None, choices=sorted(timing.GATE_OF),
                    help="delta-family ops (default: gdn deltanet kda, or none when --presets is given)")
    ap.add_argument("--presets", nargs="*", default=[], choices=sorted(deep_memory.ENTRIES),
                    help="deep-memory layers as deep_memory.py times them (bf16 q, k, v; chunk 64)")
    ap.add_argument("--modes", nargs="+", default=["fwd", "fwdbwd"], choices=["fwd", "fwdbwd"])
    ap.add_argument("--impl", default="pallas", choices=["pallas", "chunk", "auto"])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--reps", type=int, default=10, help="timed repetitions per round")
    ap.add_argument("--out", default=None, help="folder for compare_trees.json (default $OUT)")
    ap.add_argument("--maxnreg", action="append", default=[], metavar="NAME=CAP",
                    help="compile tree NAME's deep-memory kernels (mlp_*) with at most CAP registers a "
                         "thread (register_cap.py: an experiment on jax's private Triton lowering); "
                         "NAME may repeat another tree's PATH under a new name")
    ap.add_argument("--xla", action="append", default=[], metavar="NAME=FLAG=VALUE",
                    help="compile tree NAME's programs with this XLA debug option (as XLA_FLAGS would set "
                         "it, but for that tree alone: `.compile(compiler_options=...)`), e.g. "
                         "wcb=xla_gpu_enable_command_buffer=FUSION,CUBLAS,WHILE (a list in full: compile "
                         "options take no +/- edits; true / false for a boolean); repeat for more options; "
                         "NAME may repeat another tree's PATH under a new name")
    args = ap.parse_args()
    if args.ops is None:   # a deep-memory comparison does not also spend device time on the ops
        args.ops = [] if args.presets else ["gdn", "deltanet", "kda"]

    import jax
    import jax.numpy as jnp

    trees = [t.split("=", 1) for t in args.tree]
    caps = {name: int(cap) for name, cap in (c.split("=", 1) for c in args.maxnreg)}
    if set(caps) - {name for name, _ in trees}:
        ap.error(f"--maxnreg names trees that --tree does not: {sorted(set(caps) - {n for n, _ in trees})}")
    xla_options = {}
    for item in args.xla:
        if item.count("=") < 2:
            ap.error(f"--xla {item!r}: give NAME=FLAG=VALUE, e.g. wcb=xla_gpu_enable_command_buffer=FUSION")
        name, flag, value = item.split("=", 2)
        # XLA takes a boolean option as a Python bool, not as the string "true"
        value = {"true": True, "false": False}.get(value.lower(), value)
        xla_options.setdefault(name, {})[flag] = value
    if set(xla_options) - {name for name, _ in trees}:
        ap.error(f"--xla names trees that --tree does not: {sorted(set(xla_options) - {n for n, _ in trees})}")
    B, T, H, D = args.shape
    inputs = {op: timing.make_inputs(B, T, H, D, D, timing.GATE_OF[op], jnp.bfloat16)
              for op in args.ops}
    compiled, compiled_gib = {}, {}
    for name, root in trees:
        t0 = time.perf_counter()
        if caps:
            import register_cap
            register_cap.set_cap(caps.get(name))   # at lowering: this tree's compiles below
        ops = timing.import_tree(root)
        for preset in args.presets:   # inputs per tree: the state comes from the tree's own spec
            spec = deep_memory.build(preset)
            q, k, v, knobs, state, do = deep_memory.inputs(spec, B, T, H, D, dtype="bfloat16")
            fwd = jax.jit(deep_memory.forward_fn(spec, 64, args.impl))
            fwdbwd = deep_memory.fwdbwd_fn(spec, 64, args.impl)
            for mode, fn, a in (("fwd", fwd, (q, k, v, knobs, state.params, state)),
                                ("fwdbwd", fwdbwd, (q, k, v, knobs, state, do))):
                if mode in args.modes:
                    exe = fn.lower(*a).compile(compiler_options=xla_options.get(name))
                    compiled_gib[f"{preset}/{mode}/{name}"] = deep_memory.compiled_total_gib(exe)
                    out = jax.block_until_ready(exe(*a))
                    if not deep_memory.all_finite(out):
                        timing.log(f"[warning] {name} {preset} {mode}: non-finite outputs (timed all the same)")
                    compiled[(name, preset, mode)] = (exe, a)
        for op in args.ops:
            fwd, fwdbwd = timing.op_fns(ops, op, args.impl)
            q, k, v, beta, g, do = inputs[op]
            for mode, fn, a in (("fwd", fwd, (q, k, v, beta, g)),
                                ("fwdbwd", fwdbwd, (q, k, v, beta, g, do))):
                if mode in args.modes:
                    exe = fn.lower(*a).compile(compiler_options=xla_options.get(name))
                    jax.block_until_ready(exe(*a))
                    compiled[(name, op, mode)] = (exe, a)
        timing.log(f"[compile] {name} ({root}): {time.perf_counter() - t0:.1f} s")
        _forget_atlas_jax(root)

    device = jax.devices()[0]
    results = {"device": str(device), "device_kind": device.device_kind, "jax": jax.__version__,
               "shape": args.shape, "impl": args.impl, "xla_options": xla_options, "compiled_gib": compiled_gib,
               "rounds": {}}
    for key, gib in compiled_gib.items():
        timing.log(f"[compiled memory] {key}: {gib:.2f} GiB")
    rounds = results["rounds"]
    for r in range(args.rounds):
        for op in args.ops + args.presets:
            for mode in args.modes:
                for name, _ in trees:
                    exe, a = compiled[(name, op, mode)]
                    ms = timing.time_jax(exe, *a, reps=args.reps)
                    rounds.setdefault(f"{op}/{mode}/{name}", []).append(ms)
        timing.log(f"[round {r}] " + "  ".join(f"{k}={v[-1]:.3f}" for k, v in rounds.items()))
        timing.save_json(results, args.out, "compare_trees.json")

    base = trees[0][0]
    timing.log(f"\n=== {device.device_kind}, B{B} T{T} H{H} D{D} bf16, impl={args.impl}: median "
               f"over {args.rounds} interleaved rounds (ms); ratio = tree / {base} ===")
    summary = results["median_ms"] = {}
    for op in args.ops + args.presets:
        for mode in args.modes:
            row, ref = [f"{op:9s} {mode:7s}"], statistics.median(rounds[f"{op}/{mode}/{base}"])
            for name, _ in trees:
                med = statistics.median(rounds[f"{op}/{mode}/{name}"])
                summary[f"{op}/{mode}/{name}"] = med
                row.append(f"{name}={med:.3f}" + ("" if name == base else f" x{med / ref:.3f}"))
            timing.log("  " + "  ".join(row))
    timing.save_json(results, args.out, "compare_trees.json")


if __name__ == "__main__":
    main()
