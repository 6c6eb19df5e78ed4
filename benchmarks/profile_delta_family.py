#!/usr/bin/env python3
"""Where the time goes: per-kernel GPU durations of our Pallas kernels and fla's, side by side.

Run under Nsight Compute on the GPU machine, from the repository root:

    ncu --profile-from-start off --clock-control none --metrics gpu__time_duration.sum --csv \
        --log-file $OUT/ncu.csv python3 benchmarks/profile_delta_family.py --shape 4,4096,16,128
    python3 benchmarks/profile_delta_family.py --parse $OUT/ncu.csv

Everything is compiled and warmed up first; only one call of each phase (ours fwd, ours fwd+bwd,
fla fwd, fla fwd+bwd, per op) runs between cudaProfilerStart/Stop, each phase opened by a marker
kernel (torch.cuda._sleep) so the CSV can be split into phases. Flags: --shape B,T,H,D, --ops,
--modes, --value-heads (grouped value heads, fla's GVA), --ours (VARIANTS of tune.py: our block
sizes, one phase each). Kernel names map to the labels of the table in
kernels/delta_family/gpu.py (delta_intra_solve = K1a, ...).
"""
from __future__ import annotations

import argparse
import csv
import functools
import os
from collections import defaultdict

import timing
import tune

MARKER = "spin"


def parse(path):
    """Prints per-phase kernel durations (µs) from an ncu --csv log."""
    names_file = os.path.join(os.path.dirname(path), "phases.txt")
    phases = open(names_file).read().split(",") if os.path.exists(names_file) else []
    rows = []
    with open(path) as f:
        lines = [ln for ln in f if ln.startswith('"')]
    for rec in csv.DictReader(lines):
        if rec.get("Metric Name") != "gpu__time_duration.sum":
            continue
        value = float(rec["Metric Value"].replace(",", ""))
        unit = rec.get("Metric Unit", "ns")
        us = value / 1e3 if unit == "nsecond" or unit == "ns" else value if unit in ("usecond", "us") else value * 1e3
        rows.append((rec["Kernel Name"], us))
    current, order, totals = None, [], defaultdict(list)
    index = 0
    for name, us in rows:
        if MARKER in name.lower():
            current = phases[index] if index < len(phases) and phases[index] else f"phase{index}"
            order.append(current)
            index += 1
            continue
        if current is not None:
            totals[current].append((name, us))
    for phase in order:
        kernels = totals[phase]
        print(f"== {phase}: {sum(us for _, us in kernels):9.1f} us in {len(kernels)} kernels")
        merged = defaultdict(float)
        for name, us in kernels:
            merged[name[:90]] += us
        for name, us in sorted(merged.items(), key=lambda x: -x[1]):
            print(f"   {us:9.1f} us  {name}")


def main(args):
    import jax
    import torch

    public_ops = timing.import_tree()
    from atlas_jax.kernels.delta_family import gpu
    B, T, H, D = args.shape
    ops, modes, variants = args.ops, args.modes, args.ours
    fla = timing.fla_ops()
    phases = []
    for op in ops:
        gate = timing.GATE_OF[op]
        q, k, v, beta, g, do = timing.make_inputs(B, T, H, D, D, gate, jax.numpy.bfloat16,
                                                  value_heads=args.value_heads)
        ours = {}
        for variant in variants:
            # the public op looks the kernel entry point up at trace time: trace (warm up) with
            # this variant's block sizes patched in
            real = gpu.chunk_delta_family_gpu
            gpu.chunk_delta_family_gpu = functools.partial(
                real, block_sizes=gpu.GpuBlockSizes(**tune.VARIANTS[variant]))
            try:
                fwd, fwdbwd = timing.op_fns(public_ops, op, "pallas")
                # bind this op's inputs now: the phases run after the loop over ops
                inputs = (q, k, v, beta, g)
                calls = {"fwd": lambda fwd=fwd, a=inputs: fwd(*a),
                         "fwdbwd": lambda fwdbwd=fwdbwd, a=inputs, do=do: fwdbwd(*a, do)}
                for m in modes:
                    jax.block_until_ready(calls[m]())
            finally:
                gpu.chunk_delta_family_gpu = real
            ours[variant] = calls
        tq = lambda x: torch.from_dlpack(x).detach().clone().requires_grad_()   # noqa: E731
        tq_, tk_, tv_, tb_ = tq(q), tq(k), tq(v), tq(beta)
        tg_ = None if g is None else tq(g)
        tdo = torch.from_dlpack(do).clone()
        t = (tq_, tk_, tv_, tg_, tb_)
        fla_fn = lambda t=t, f=fla[op]: f(t[0], t[1], t[2], t[3], t[3], t[4])   # noqa: E731
        theirs = {"fwd": fla_fn, "fwdbwd": lambda f=fla_fn, do=tdo: f().backward(do)}
        for _ in range(3):
            for calls in ours.values():
                for m in modes:
                    jax.block_until_ready(calls[m]())
            for m in modes:
                theirs[m]()
        torch.cuda.synchronize()
        phases.append((op, ours, theirs))

    names = []
    torch.cuda.profiler.start()
    for op, ours, theirs in phases:
        for mode in modes:
            for variant, calls in ours.items():
                torch.cuda._sleep(1000)
                torch.cuda.synchronize()
                jax.block_until_ready(calls[mode]())
                names.append(f"{op}/ours/{mode}" + ("" if variant == "default" else f"/{variant}"))
            torch.cuda._sleep(1000)
            torch.cuda.synchronize()
            theirs[mode]()
            torch.cuda.synchronize()
            names.append(f"{op}/fla/{mode}")
    torch.cuda.profiler.stop()
    out = args.out or os.environ.get("OUT", ".")
    with open(os.path.join(out, "phases.txt"), "w") as f:
        f.write(",".join(names))
    print("phases: " + ",".join(names), flush=True)


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--parse", metavar="NCU_CSV", help="print the phases of an ncu CSV log")
    ap.add_argument("--shape", type=timing.shape_arg, default=(4, 4096, 16, 128), help="B,T,H,D")
    ap.add_argument("--ops", nargs="+", default=["gdn", "deltanet", "kda"],
                    choices=sorted(timing.GATE_OF))
    ap.add_argument("--modes", nargs="+", default=["fwd", "fwdbwd"], choices=["fwd", "fwdbwd"])
    ap.add_argument("--ours", nargs="+", default=["default"], choices=sorted(tune.VARIANTS))
    ap.add_argument("--value-heads", type=int, default=None,
                    help="HV value heads (grouped: a multiple of H; default H), both sides")
    ap.add_argument("--out", default=None, help="folder for phases.txt (default $OUT or .)")
    cli = ap.parse_args()
    if cli.parse:
        parse(cli.parse)
    else:
        main(cli)
