"""Where a data-parallel step's time goes (issue 22): one process times a preset's train step on
one device at B/2 rows and on two devices (mesh.data=2) at B rows — the same rows per device — and
traces one step of each, summing the device-side events per device (busy ms against the step's
wall ms, the largest kernels, the collectives).

    python3 benchmarks/multi_gpu_profile.py --preset atlas --shape 8x512      # two GPUs
    python3 benchmarks/multi_gpu_profile.py --tiny                            # 2 CPU devices

The batch is synthetic: random tokens, each row packed with --documents documents of random
lengths (segment ids), as the built-in data packs them.
"""
from __future__ import annotations

import argparse
import gzip
import json
import os
import pathlib
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from timing import import_tree, log, save_json  # noqa: E402


def packed_batch(B, T, vocab, documents, seed=0):
    import numpy as np
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, vocab, (B, T + 1)).astype(np.int32)
    segments = np.zeros((B, T), np.int32)
    for row in range(B):
        cuts = np.sort(rng.choice(np.arange(1, T), documents - 1, replace=False))
        segments[row] = np.searchsorted(cuts, np.arange(T), side="right")
    return {"tokens": tokens[:, :-1], "targets": tokens[:, 1:], "segment_ids": segments,
            "mask": np.ones((B, T), np.float32)}


def device_summary(trace_dir, top=12):
    """{device name: (busy ms, [(kernel, ms, count)])} of the newest Perfetto trace under trace_dir."""
    paths = sorted(pathlib.Path(trace_dir).rglob("*.trace.json.gz"), key=lambda p: p.stat().st_mtime)
    if not paths:
        return {}
    events = json.load(gzip.open(paths[-1]))["traceEvents"]
    names = {e["pid"]: str(e["args"]["name"]) for e in events if e.get("ph") == "M"
             and e.get("name") == "process_name" and "/device:" in str(e.get("args", {}).get("name", ""))}
    out = {}
    for pid, name in names.items():
        sums, spans = {}, []
        for e in events:
            if e.get("pid") == pid and e.get("ph") == "X" and "dur" in e:
                ms, count = sums.get(e["name"], (0.0, 0))
                sums[e["name"]] = (ms + e["dur"] / 1e3, count + 1)
                spans.append((e["ts"], e["ts"] + e["dur"]))
        busy, end = 0.0, -1.0     # union of the event spans: streams overlap
        for s, t in sorted(spans):
            if t > end:
                busy += t - max(s, end)
                end = t
        rows = sorted(((k, ms, n) for k, (ms, n) in sums.items()), key=lambda r: -r[1])
        out[name] = {"busy_ms": busy / 1e3, "events": len(spans), "top": rows[:top],
                     "collectives": [r for r in rows if any(c in r[0].lower() for c in ("nccl", "all-reduce", "allreduce", "all_reduce"))][:5]}
    return out


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="atlas")
    parser.add_argument("--shape", default="8x512", help="global BxT of the two-device step")
    parser.add_argument("--documents", type=int, default=3, help="documents packed per row")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--remat", default="full")
    parser.add_argument("--tiny", action="store_true", help="2 CPU devices, the tiny model")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    B, T = (int(x) for x in args.shape.lower().split("x"))
    if args.tiny:
        os.environ["JAX_PLATFORMS"] = "cpu"
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=2").strip()
    import_tree()
    import jax
    from atlas_jax.train.config import load_train_config
    from atlas_jax.train.trainer import Trainer

    vocab = 512 if args.tiny else 32000
    model = {"vocab_size": vocab, **({"num_layers": 2} if args.tiny else {})}
    if args.preset == "atlas":
        model["preset_options"] = {"ns_every": "chunk"}
    results = []
    for devices, rows, mesh in ((1, B // 2, "mesh.data=1"), (2, B, "mesh.data=2")):
        cfg = load_train_config(overrides=[
            f"preset={args.preset}", f"size={'tiny' if args.tiny else '340m'}", f"seq_len={T}", f"batch_size={rows}",
            "compute_dtype=bfloat16", f"remat={args.remat}", f"model={json.dumps(model)}", mesh])
        trainer = Trainer(cfg, vocab, args.documents, devices=jax.devices()[:devices])
        state = trainer.init_state()
        batch = trainer.put_batch(packed_batch(rows, T, vocab, args.documents))
        start = time.perf_counter()
        with jax.set_mesh(trainer.mesh):
            state, metrics = trainer.train_step(state, batch)
            jax.block_until_ready(metrics)
            first_s = time.perf_counter() - start
            times = []
            for _ in range(args.steps):
                t0 = time.perf_counter()
                state, metrics = trainer.train_step(state, batch)
                jax.block_until_ready(metrics)
                times.append(time.perf_counter() - t0)
            trace_dir = tempfile.mkdtemp()
            t0 = time.perf_counter()
            with jax.profiler.trace(trace_dir, create_perfetto_trace=True):
                state, metrics = trainer.train_step(state, batch)
                jax.block_until_ready(metrics)
            traced_s = time.perf_counter() - t0
        step_s = sorted(times)[len(times) // 2]
        summary = device_summary(trace_dir)
        result = {"preset": args.preset, "devices": devices, "rows_per_device": rows // devices, "T": T,
                  "compile_and_first_s": first_s, "step_s": step_s, "steps_s": times, "traced_step_s": traced_s,
                  "loss": float(metrics["loss"]), "device_kind": jax.devices()[0].device_kind, "trace": summary}
        log(f"{devices} device(s), {rows} rows: step {step_s:.3f} s (steps {[round(t, 3) for t in times]}), "
            f"traced {traced_s:.3f} s")
        for name, s in summary.items():
            log(f"  {name}: busy {s['busy_ms']:.1f} ms over {s['events']} events; collectives {s['collectives']}")
            for kernel, ms, n in s["top"][:8]:
                log(f"    {ms:9.1f} ms  {n:6d}×  {kernel[:110]}")
        results.append(result)
        del state, trainer
    log(f"one device at {B // 2} rows: {results[0]['step_s']:.3f} s; two devices at {B} rows: "
        f"{results[1]['step_s']:.3f} s; ratio of tokens/s {2 * results[0]['step_s'] / results[1]['step_s']:.2f}×")
    save_json(results, args.out or os.environ.get("OUT", "."), "multi_gpu_profile.json")


if __name__ == "__main__":
    main()
