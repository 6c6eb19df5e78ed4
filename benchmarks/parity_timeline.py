#!/usr/bin/env python3
"""The GPU timeline of one fla-parity case, ours fused against unfused (bench_ops.py --parity):
per call, the span from its first GPU op to its last, the ops' busy time, their count and the
gaps between them, from a jax.profiler trace of calls run back to back (fwd and fwd+bwd).

    python3 benchmarks/parity_timeline.py --case gdn_gate --shape 4,4096,16,128

Kernel durations alone (ncu) miss what separates two calls that run the same kernels: launch
gaps (XLA captures a program into a CUDA graph only from --xla_gpu_graph_min_graph_size ops on)
and the ops outside the kernels. Writes the trace under --out (default $OUT or .)/trace.
"""
from __future__ import annotations

import argparse
import glob
import gzip
import json
import os
import time

import timing


def gpu_ops(path):
    """[(start us, duration us, name)] of the GPU stream events of a perfetto trace."""
    ev = json.load(gzip.open(path))
    ev = ev["traceEvents"] if isinstance(ev, dict) else ev
    process = {e["pid"]: e["args"]["name"] for e in ev
               if e.get("ph") == "M" and e.get("name") == "process_name"}
    thread = {(e["pid"], e["tid"]): e["args"]["name"] for e in ev
              if e.get("ph") == "M" and e.get("name") == "thread_name"}
    return sorted((float(e["ts"]), float(e["dur"]), e["name"]) for e in ev
                  if e.get("ph") == "X" and "gpu" in process.get(e["pid"], "").lower()
                  and "stream" in thread.get((e["pid"], e["tid"]), "").lower())


def phases(ops, gap_us=20_000):
    """Splits the ops at idle gaps longer than gap_us (the pauses between phases)."""
    groups, cur = [], [ops[0]]
    for a, b in zip(ops, ops[1:]):
        if b[0] - (a[0] + a[1]) > gap_us:
            groups.append(cur)
            cur = []
        cur.append(b)
    return groups + [cur]


def report(groups, names):
    for (name, n), ph in zip(names, groups[-len(names):]):
        span = ph[-1][0] + ph[-1][1] - ph[0][0]
        busy = sum(d for _, d, _ in ph)
        timing.log(f"{name:18s} per call: span {span / n:8.2f} us  busy {busy / n:8.2f} us  "
                   f"ops {len(ph) / n:5.1f}  gaps {(span - busy) / n:6.2f} us")
        per = {}
        for _, d, op in ph:
            per.setdefault(op.split(".")[0][:70], []).append(d)
        for op, ds in sorted(per.items(), key=lambda kv: -sum(kv[1])):
            timing.log(f"    {len(ds) / n:4.1f} x {sum(ds) / len(ds):8.2f} us  {op}")


def main(args):
    import jax
    import bench_ops
    ops = timing.import_tree()
    B, T, H, D = args.shape
    x, do = bench_ops.parity_inputs_jax(args.case, B, T, H, D)
    calls = []
    for variant in ("fused", "unfused"):
        fwd, fwdbwd = bench_ops.parity_fns(ops, args.case, variant)
        calls.append((f"{variant}/fwd", lambda f=fwd: f(x), args.reps))
        calls.append((f"{variant}/fwdbwd", lambda f=fwdbwd: f(x, do), max(args.reps // 3, 1)))
    for _, f, _ in calls:
        for _ in range(3):
            jax.block_until_ready(f())
    out_dir = os.path.join(args.out or os.environ.get("OUT", "."), "trace")
    with jax.profiler.trace(out_dir, create_perfetto_trace=True):
        for _, f, n in calls:
            time.sleep(0.1)
            for _ in range(n):
                out = f()
            jax.block_until_ready(out)
        time.sleep(0.1)
    path = sorted(glob.glob(os.path.join(out_dir, "**", "perfetto_trace.json.gz"),
                            recursive=True), key=os.path.getmtime)[-1]
    timing.log(f"{args.case} {B}x{T}x{H}x{D} on {jax.devices()[0].device_kind}")
    report(phases(gpu_ops(path)), [(name, n) for name, _, n in calls])


if __name__ == "__main__":
    import bench_ops
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--case", default="gdn_gate", choices=list(bench_ops.PARITY))
    ap.add_argument("--shape", type=timing.shape_arg, default=(4, 4096, 16, 128), help="B,T,H,D")
    ap.add_argument("--reps", type=int, default=40, help="fwd calls (fwd+bwd: a third)")
    ap.add_argument("--out", default=None)
    main(ap.parse_args())
