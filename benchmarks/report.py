#!/usr/bin/env python3
"""Markdown table (ms, ratio to fla, TFLOP/s, GB/s against the roofline) from a results JSON.

    python3 benchmarks/report.py benchmarks/results/delta_family_h200_2026-11-21.json > table.md

FLOP model of the exact chunked delta rule (chunk C, per head and chunk; what any chunked
implementation, fla's included, must do): K Kᵀ, Q Kᵀ (2C²K each), the triangular solve (C³/3),
W = T K and U = T V (2C²K + 2C²V), W S, Q S and the state update Kᵀ U (2CKV each), P U (2C²V).
The backward is modelled as 2× the forward. Bytes: each input read once and each output written
once (bf16 q, k, v, o, dq, dk, dv, do; beta bf16; g float32), per pass. The roofline uses the
results' own "roofline" ceilings if given, else this workplace's measured H200 ceilings:
790 TFLOP/s bf16, 4.3 TB/s.
"""
from __future__ import annotations

import json
import sys

PEAK_FLOPS = 790e12
PEAK_BYTES = 4.3e12
CHUNK = 64


def model(op, B, T, H, D, mode):
    C, K, V = CHUNK, D, D
    per_chunk = 3 * 2 * C * C * K + 2 * 2 * C * C * V + 3 * 2 * C * K * V + C ** 3 / 3
    flops = per_chunk * B * H * (T / C)
    gate = 0 if op == "deltanet" else (4 * K if op == "kda" else 4)
    tokens = B * T * H
    fwd_bytes = tokens * (2 * K * 2 + 2 * V + 2 + gate + 2 * V)          # q, k, v, beta, g in; o out
    if mode == "fwd":
        return flops, fwd_bytes
    bwd_bytes = tokens * (2 * K * 2 + 2 * V + 2 + gate + 2 * V            # q, k, v, beta, g, do in
                          + 2 * K * 2 + 2 * V + 2 + gate)                 # dq, dk, dv, dbeta, dg out
    return 3 * flops, fwd_bytes + bwd_bytes


def table(results) -> str:
    roof = results.get("roofline", {})
    peak_flops = roof.get("tflops", PEAK_FLOPS / 1e12) * 1e12
    peak_bytes = roof.get("tbps", PEAK_BYTES / 1e12) * 1e12
    lines = [f"Device: {results['device']}; {results['date']}; "
             + ", ".join(f"{k} {v}" for k, v in results["versions"].items()) + ".",
             f"Inputs: {results['dtype']}. Timing: {results['timing']}."]
    if roof:
        lines.append(f"Roofline ceilings: {roof['tflops']} TFLOP/s bf16, {roof['tbps']} TB/s "
                     f"({roof['source']}).")
    lines += ["",
              "| shape B,T,H,D | op | pass | ours (Pallas) ms | fla ms | fla/ours (>1: we are faster) "
              "| ours TFLOP/s | ours GB/s | roofline floor ms | XLA chunk ms |",
              "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for shape, vals in results["bench_ms"].items():
        B, T, H, D = (int(x) for x in shape.split("x"))
        for op in ("gdn", "deltanet", "kda"):
            for mode in ("fwd", "fwdbwd"):
                ours = vals.get(f"{op}/pallas/{mode}")
                fla = vals.get(f"{op}/fla/{mode}")
                xla = vals.get(f"{op}/xla/{mode}")
                if ours is None and fla is None:
                    continue
                flops, nbytes = model(op, B, T, H, D, mode)
                floor = max(flops / peak_flops, nbytes / peak_bytes) * 1e3
                fmt = lambda x: "—" if x is None else f"{x:.3f}"   # noqa: E731
                ratio = f"{fla / ours:.2f}" if ours and fla else "—"
                tflops = f"{flops / (ours * 1e-3) / 1e12:.0f}" if ours else "—"
                gbs = f"{nbytes / (ours * 1e-3) / 1e9:.0f}" if ours else "—"
                lines.append(f"| {B},{T},{H},{D} | {op} | {'fwd+bwd' if mode == 'fwdbwd' else 'fwd'} | "
                             f"{fmt(ours)} | {fmt(fla)} | {ratio} | {tflops} | {gbs} | {floor:.3f} | {fmt(xla)} |")
    lines += ["", "Peak device memory of one forward+backward (GB):", "",
              "| shape | op | ours | fla |", "| --- | --- | --- | --- |"]
    if not results.get("memory_fwd_bwd_peak_GB"):
        lines.append("| — | not measured in this run | | |")
    for shape, vals in results.get("memory_fwd_bwd_peak_GB", {}).items():
        for op in ("gdn", "deltanet", "kda"):
            lines.append(f"| {shape.replace('x', ',')} | {op} | {vals.get(f'{op}/ours', '—')} | "
                         f"{vals.get(f'{op}/fla', '—')} |")
    lines += ["", "Our kernels timed alone (ms), where the time goes:", ""]
    if results.get("stages_note"):
        lines += [results["stages_note"], ""]
    for shape, ops in results.get("stages_ms", {}).items():
        names = list(next(iter(ops.values())))
        lines += [f"| {shape.replace('x', ',')} | " + " | ".join(names) + " |",
                  "| --- | " + " | ".join("---" for _ in names) + " |"]
        for op, stages in ops.items():
            lines.append(f"| {op} | " + " | ".join(f"{stages[n]:.3f}" for n in names) + " |")
    for shape, runs in results.get("kernels_ms", {}).items():
        lines += ["", f"Every kernel of one forward+backward at {shape.replace('x', ',')}, each "
                  "launched alone (`tune.py --per-kernel`, ms):", ""]
        for run, kernels in runs.items():
            lines.append(f"- {run} (sum {sum(kernels.values()):.3f}): "
                         + ", ".join(f"{name} {t:.3f}" for name, t in kernels.items()))
    for shape, ops in results.get("fla_profile_fwd_bwd_ms", {}).items():
        lines += ["", f"fla's kernels in one forward+backward at {shape.replace('x', ',')} "
                  "(torch.profiler, ms per call):", ""]
        for op, kernels in ops.items():
            top = sorted(kernels.items(), key=lambda kv: -kv[1])
            lines.append(f"- {op} (total {sum(kernels.values()):.3f}): "
                         + ", ".join(f"{name.split('<')[0]} {t:.3f}" for name, t in top if t >= 0.01))
    for shape, ops in results.get("fla_profile_fwd_ms", {}).items():
        lines += ["", f"fla's kernels in one forward at {shape.replace('x', ',')} "
                  "(torch.profiler, ms per call):", ""]
        for op, kernels in ops.items():
            lines.append(f"- {op}: " + ", ".join(f"{name} {t:.3f}" for name, t in kernels.items()))
    if results.get("gpu_checks_note"):
        lines += ["", results["gpu_checks_note"]]
    for note in results.get("notes", []):
        lines += ["", note]
    if results.get("not_measured"):
        lines += ["", "Not measured: " + "; ".join(results["not_measured"]) + "."]
    return "\n".join(lines)


if __name__ == "__main__":
    print(table(json.load(open(sys.argv[1]))))
