"""Two GPUs of one host against one (issue 22): same losses, throughput, and checkpoints that move
between meshes.

    python3 benchmarks/multi_gpu.py [--presets gated_deltanet,atlas] [--steps 20] [--out DIR]
    python3 benchmarks/multi_gpu.py --tiny      # dry run: 2 CPU devices stand in for the GPUs
    python3 benchmarks/multi_gpu.py --presets gated_deltanet --batch-size 16 --runs one,data \
        --no-resume --extra data.eval_fraction=0.1      # the throughput pair alone

Budget: a 340M gated_deltanet run (B8 T4096) takes about 50 s with its compile on an H100, the
whole preset (five runs) 4.5 min. The 340M atlas is far dearer per token: Newton–Schulz on the
[d_φ=2145, h=256] momenta of every head, layer and chunk (polynomial features of degree 2 on 64-wide
heads) makes it about 25× gated_deltanet's FLOPs per token (counted from the shapes); jitted forward + backward runs ~600
tokens/s on an H200 (B4 T512: 3.4 s a step, compile 24 s). Give it its own shape, e.g.
--shape atlas=4x512, and state it. Its step also has ~1 s that does not shrink with the rows (about
250K kernel launches a step at T512, 2026-11-26 trace), so the two-GPU ratio wants several rows
per GPU (global 16 × 512: ~1.9× expected from one GPU's B4/B8 step times). When the ratio falls
short, `multi_gpu_profile.py` times and traces one GPU at B/2 rows against two at B rows.

For each preset (340M, bf16 compute, float32 master weights, the same global batch and seed), every
run is `atlas-jax train` in its own process, restricted to its devices (CUDA_VISIBLE_DEVICES; on
CPU --xla_force_host_platform_device_count), so that each reports its own peak memory:

  one     1 device,  mesh.data=1
  data    2 devices, mesh.data=2            (the pmap layout: batch split, parameters replicated)
  fsdp    2 devices, mesh.data=1 mesh.fsdp=2 (parameters and optimizer state split too)
  2→1     the data run's checkpoint at step N/2 resumed on 1 device up to N
  1→2     the one run's checkpoint at step N/2 resumed on 2 devices (data) up to N

and reports: the first N losses of data and fsdp against one (max relative difference; the issue's
bar is 1e-3 in bf16), the resumed losses against the uninterrupted run's, tokens/s (median of the
steps after the first two), the 2-device / 1-device throughput ratio (bar: >= 1.8 for data),
peak memory per device and MFU (6·N·tokens/s over the devices' dense bf16 peak, N without the
input embedding unless it is tied to the head). JSON and a Markdown table go to --out ($OUT).
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from timing import ROOT, import_tree, log, save_json  # noqa: E402

PEAK_BF16_TFLOPS = {"H100": 989.4, "H200": 989.4}

# Runs `atlas-jax train` in this process, then prints the devices' peak memory (the trainer keeps
# no memory statistics of its own).
WORKER = r"""
import json, os, sys
sys.path.insert(0, os.path.join(os.getcwd(), "benchmarks"))
from timing import import_tree
import_tree()                     # this checkout's atlas_jax (+ .train, .configs), installed or not
import jax
from atlas_jax.train.config import load_train_config
from atlas_jax.train.trainer import train
cfg = load_train_config(overrides=json.loads(sys.argv[1]))
train(cfg)
peaks = [(d.memory_stats() or {}).get("peak_bytes_in_use", 0) / 1e9 for d in jax.local_devices()]
print("RESULT " + json.dumps({"devices": len(jax.local_devices()), "kind": jax.devices()[0].device_kind,
                              "peak_GB": peaks}))
"""


def _env(devices: int, tiny: bool, cache: Path) -> dict:
    env = dict(os.environ)
    # One persistent compilation cache for the preset's runs: a resumed run compiles the same
    # program as the run it resumes, so only the first of each mesh pays the compile.
    env["JAX_COMPILATION_CACHE_DIR"] = str(cache)
    if tiny:
        env["JAX_PLATFORMS"] = "cpu"
        env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={devices}").strip()
    else:
        env["CUDA_VISIBLE_DEVICES"] = ",".join(str(i) for i in range(devices))
        env.setdefault("NCCL_NVLS_ENABLE", "0")    # NVLink multicast can take a shared host's GPUs down
        env.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.9")
    return env


def _train(overrides, devices, tiny, timeout, cache):
    try:
        proc = subprocess.run([sys.executable, "-c", WORKER, json.dumps(overrides)], env=_env(devices, tiny, cache),
                              capture_output=True, text=True, timeout=timeout, cwd=ROOT)
    except subprocess.TimeoutExpired as e:
        tail = (e.stderr or b"")[-1500:]
        raise RuntimeError(f"train ({devices} device(s), {overrides[-3:]}) ran past --timeout {timeout:.0f} s: "
                           f"{tail.decode(errors='replace') if isinstance(tail, bytes) else tail}") from None
    if proc.returncode != 0 or "RESULT " not in proc.stdout:
        raise RuntimeError(f"train ({devices} device(s), {overrides[-3:]}) failed: {proc.stderr[-1500:]}")
    return json.loads(proc.stdout.split("RESULT ", 1)[1].splitlines()[0])


def _records(run_dir: Path):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _max_rel(a, b):
    return max(abs(x - y) / max(abs(y), 1e-12) for x, y in zip(a, b))


def _resume_from_half(src: Path, dst: Path, half: int):
    """dst = src as it was after step `half`: its checkpoint at `half` only, metrics up to it."""
    shutil.copytree(src, dst)
    for child in (dst / "checkpoints").iterdir():
        if child.name.isdigit() and int(child.name) != half:
            shutil.rmtree(child)
    kept = [line for line in (dst / "metrics.jsonl").read_text().splitlines() if json.loads(line)["step"] <= half]
    (dst / "metrics.jsonl").write_text("\n".join(kept) + "\n")


def flop_params(preset: str, size: str, model: dict) -> int:
    from atlas_jax import models
    cfg = models.config_for(preset, size, **model)
    n = models.param_count(preset, size, **model)
    return n if cfg.tie_embeddings else n - cfg.vocab_size * cfg.width


def _shape_arg(text):
    """--shape PRESET=BxT -> (preset, (B, T))."""
    match = re.fullmatch(r"(\w+)=(\d+)x(\d+)", text)
    if not match:
        raise argparse.ArgumentTypeError(f"--shape: expected PRESET=BxT (e.g. atlas=4x512), got {text!r}")
    return match.group(1), (int(match.group(2)), int(match.group(3)))


def _shape(preset, args):
    """(global batch, seq_len) of a preset: its --shape, else --batch-size × --seq-len."""
    return dict(args.shape).get(preset, (args.batch_size, args.seq_len))


def run_preset(preset, args, work: Path):
    steps, half = args.steps, args.steps // 2
    batch_size, seq_len = _shape(preset, args)
    if args.tiny:
        base = [f"preset={preset}", "size=tiny", "seq_len=64", "batch_size=8", "data.tokenizer=byte",
                "data.max_documents=200", "compute_dtype=float32"]
        model = {"num_layers": 2}
    else:
        # lr: the tiny models' 3e-3 makes the 340M loss spike within 20 steps (at a step that bf16
        # rounding decides, so the runs part by 1e-1); 3e-4 is the order 340M models train at
        base = [f"preset={preset}", "size=340m", f"seq_len={seq_len}", f"batch_size={batch_size}",
                "compute_dtype=bfloat16", f"remat={args.remat}", f"optim.learning_rate={args.lr}"]
        # the 340M model as the papers size it (T5's 32K vocabulary) though the built-in BPE uses
        # fewer ids: the head and its softmax cost what they cost at 340M
        model = {"vocab_size": 32000, **json.loads(args.model or "{}")}
    if preset == "atlas":    # Newton–Schulz once per chunk: the per-token form does not fit 340M at T4096
        model.setdefault("preset_options", {"ns_every": "chunk"})
    common = [*base, f"model={json.dumps(model)}", f"steps={steps}", "log_every=1", "eval_every=0",
              f"checkpoint_every={half}", "checkpoint.keep=3", "progress=false", "tensorboard=false",
              "seed=0", "data.eval_batches=1", *args.extra]
    runs = {"one": (1, ["mesh.data=1"]), "data": (2, ["mesh.data=2"]), "fsdp": (2, ["mesh.data=1", "mesh.fsdp=2"])}
    runs = {name: runs[name] for name in args.runs.split(",")}
    out = {"preset": preset, "steps": steps, "global_batch": batch_size if not args.tiny else 8,
           "seq_len": seq_len if not args.tiny else 64, "remat": args.remat, "lr": None if args.tiny else args.lr, "model": model, "runs": {}}
    cache = work / "jax_cache"
    for name, (devices, mesh) in runs.items():
        run_dir = work / preset / name
        info = _train([*common, *mesh, f"run_dir={run_dir}"], devices, args.tiny, args.timeout, cache)
        records = _records(run_dir)
        rates = [r["tokens_per_s"] for r in records[2:]] or [records[-1]["tokens_per_s"]]
        out["runs"][name] = {"devices": devices, "mesh": mesh, "losses": [r["loss"] for r in records],
                             "tokens_per_s": statistics.median(rates), "peak_GB_per_device": info["peak_GB"],
                             "device_kind": info["kind"]}
        log(f"[{preset}] {name}: {out['runs'][name]['tokens_per_s']:.0f} tokens/s, peak "
            f"{max(info['peak_GB'] or [0]):.1f} GB per device, losses {out['runs'][name]['losses'][:3]} ...")
    one = out["runs"]["one"]["losses"]
    for name in ("data", "fsdp"):
        if name in out["runs"]:
            out["runs"][name]["max_rel_loss_vs_one"] = _max_rel(out["runs"][name]["losses"], one)
            out[f"{name}_speedup"] = out["runs"][name]["tokens_per_s"] / out["runs"]["one"]["tokens_per_s"]
    # Checkpoints across meshes: orbax restores into the new mesh's shardings.
    for name, src, devices, mesh in (("2→1", "data", 1, ["mesh.data=1"]), ("1→2", "one", 2, ["mesh.data=2"])):
        if not args.resume or src not in out["runs"]:
            continue
        dst = work / preset / f"resume_{src}"
        _resume_from_half(work / preset / src, dst, half)
        _train([*common, *mesh, f"run_dir={dst}"], devices, args.tiny, args.timeout, cache)
        resumed = [r["loss"] for r in _records(dst) if r["step"] > half]
        reference = out["runs"][src]["losses"][half:]
        out[f"resume {name}"] = {"losses": resumed, "max_rel_vs_uninterrupted": _max_rel(resumed, reference)}
        log(f"[{preset}] resume {name}: max relative difference {out[f'resume {name}']['max_rel_vs_uninterrupted']:.2e}")
    n = flop_params(preset, "tiny" if args.tiny else "340m", model)
    kind = out["runs"]["one"]["device_kind"]
    peak = next((v for k, v in PEAK_BF16_TFLOPS.items() if k in kind), None)
    for r in out["runs"].values():
        r["mfu"] = 6 * n * r["tokens_per_s"] / (peak * 1e12 * r["devices"]) if peak else None
    return out


def table(results):
    lines = ["| model | run | devices | tokens/s | peak GB / device | MFU | max rel. loss vs 1 device |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for res in results:
        for name, r in res["runs"].items():
            mfu = f"{100 * r['mfu']:.1f}%" if r.get("mfu") else "—"
            rel = f"{r['max_rel_loss_vs_one']:.1e}" if "max_rel_loss_vs_one" in r else "—"
            lines.append(f"| {res['preset']} | {name} | {r['devices']} | {r['tokens_per_s']:.0f} | "
                         f"{max(r['peak_GB_per_device'] or [0]):.1f} | {mfu} | {rel} |")
        ratios = ", ".join(f"{name} {res[f'{name}_speedup']:.2f}×" for name in ("data", "fsdp") if f"{name}_speedup" in res)
        resumes = ", ".join(f"resume {name} {res[f'resume {name}']['max_rel_vs_uninterrupted']:.1e}"
                            for name in ("2→1", "1→2") if f"resume {name}" in res)
        lines.append(f"| {res['preset']} | 2 / 1 device | | {ratios} | | | {resumes or '—'} |")
    return "\n".join(lines)


def environment() -> str:
    """Versions and device of this host, for the table's heading."""
    import importlib.metadata as md
    import datetime
    versions = []
    for name in ("jax", "jaxlib", "flax", "optax", "orbax-checkpoint", "grain"):
        try:
            versions.append(f"{name} {md.version(name)}")
        except md.PackageNotFoundError:
            pass
    try:
        smi = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=30).stdout.strip().splitlines()
        gpus = f"{len(smi)}× {smi[0]}" if smi else "no GPU"
    except (OSError, subprocess.TimeoutExpired):
        gpus = "no GPU (nvidia-smi missing)"
    return f"{gpus}; {', '.join(versions)}; {datetime.date.today().isoformat()}"


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--presets", default="gated_deltanet,atlas")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--batch-size", type=int, default=8, help="global batch, the same for every run")
    parser.add_argument("--seq-len", type=int, default=4096)
    parser.add_argument("--shape", nargs="*", default=[], metavar="PRESET=BxT", type=_shape_arg,
                        help="a preset's own global batch and length (e.g. atlas=4x512)")
    parser.add_argument("--remat", default="full")
    parser.add_argument("--runs", default="one,data,fsdp", help="which of one,data,fsdp (one is needed)")
    parser.add_argument("--no-resume", dest="resume", action="store_false", help="skip the checkpoint runs")
    parser.add_argument("--extra", nargs="*", default=[], help="more key=value overrides for every run")
    parser.add_argument("--lr", type=float, default=3e-4, help="peak learning rate of the 340M runs")
    parser.add_argument("--model", default="", help="JSON overrides of the model (e.g. '{\"scan_layers\": false}')")
    parser.add_argument("--timeout", type=float, default=1800, help="seconds per training process")
    parser.add_argument("--tiny", action="store_true", help="dry run on 2 CPU devices at toy shapes")
    parser.add_argument("--out", default=None, help="folder for multi_gpu.json / .md (default $OUT)")
    args = parser.parse_args(argv)
    if args.steps < 4 or args.steps % 2:
        parser.error("--steps must be an even number >= 4 (the resume runs start at steps / 2)")
    import_tree()    # this checkout's atlas_jax, for the parameter count (the runs import it themselves)
    work = Path(tempfile.mkdtemp(prefix="multi_gpu_"))
    results = []
    for preset in args.presets.split(","):
        results.append(run_preset(preset, args, work))
        save_json(results, args.out, "multi_gpu.json")    # what finished survives a later failure
    text = f"{environment()}\n\n" + "\n\n".join(
        f"{r['preset']}: global batch {r['global_batch']} × {r['seq_len']} tokens, remat {r['remat']}, lr {r['lr']}, "
        f"model {json.dumps(r['model'])}, {r['steps']} steps" for r in results) + "\n\n" + table(results)
    log(text)
    out = args.out or os.environ.get("OUT")
    save_json(results, out, "multi_gpu.json")
    if out:
        Path(out, "multi_gpu.md").write_text(text + "\n")
    shutil.rmtree(work, ignore_errors=True)
    return results


if __name__ == "__main__":
    main()
