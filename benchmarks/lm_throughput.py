"""Language-model training throughput: our full train step (atlas_jax.train: AdamW, clipping,
bf16 compute with float32 master weights) against fla's GatedDeltaNetForCausalLM with torch AdamW,
side by side in one command, plus the 340M atlas and titans models in the same table.

    python benchmarks/lm_throughput.py [--anchor build/anchors_gpu.py] [--remat dots_and_kernels,full]

The anchor runs first, in a child process (../shared/bench/anchors_gpu.py with PARTS=lm: hidden 1024,
24 layers, 4 heads x 256, expand_v 2, vocab 32000, B8 T4096, bf16 autocast, fused cross entropy),
so it has the GPU to itself; then ours in this process, at the same configuration
(gated_deltanet, size 340m with num_heads=4, expand_v=2, untied embeddings), for each remat policy
given. MFU is 6·N·tokens/s over the device's dense bf16 peak, N the parameters without the input
embedding (the memory recurrence's own FLOPs are left out, so it is a lower bound).

--tiny runs every row at toy shapes on any device (a dry run of the script on CPU).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from timing import import_tree, log, save_json  # noqa: E402

PEAK_BF16_TFLOPS = {"H100": 989.4, "H200": 989.4}    # SXM dense bf16
# scan_layers False: unrolled blocks (on GPU the saved values skip the stacked scan buffers' copies).
FLA_CONFIG = {"num_heads": 4, "expand_v": 2, "tie_embeddings": False, "vocab_size": 32000, "mlp_hidden": 2816,
              "scan_layers": False}


def run_anchor(path: str, timeout: float) -> dict:
    env = dict(os.environ, PARTS="lm")
    start = time.perf_counter()
    try:
        proc = subprocess.run([sys.executable, path], env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"error": f"the anchor did not finish in {timeout:.0f} s"}
    for line in proc.stdout.splitlines():
        if line.startswith("{") and "params_M" in line:
            result = json.loads(line)
            result["wall_s"] = time.perf_counter() - start
            return result
    return {"error": (proc.stderr or proc.stdout)[-800:]}


def peak_tflops(device_kind: str) -> float | None:
    return next((v for k, v in PEAK_BF16_TFLOPS.items() if k in device_kind), None)


def run_ours(name, preset, model, batch, seq_len, remat, dtype, steps, size):
    import jax
    import numpy as np

    from atlas_jax import models
    from atlas_jax.train.config import load_train_config
    from atlas_jax.train.trainer import build_train_step

    overrides = [f"preset={preset}", f"size={size}", f"batch_size={batch}", f"seq_len={seq_len}",
                 f"compute_dtype={dtype}", f"remat={remat}", "steps=1000", "run_dir=/tmp/lm_throughput",
                 f"model={json.dumps(model)}"]
    row = {"model": name, "B": batch, "T": seq_len, "remat": remat}
    try:
        cfg = load_train_config(overrides=overrides)
        step, state, trainer = build_train_step(cfg, max_documents=1)
        params = trainer.abstract_state["params"]
        n_all = sum(x.size for x in jax.tree.leaves(params))
        n_embed = sum(x.size for p, x in jax.tree_util.tree_leaves_with_path(params)
                      if "embed" in jax.tree_util.keystr(p))
        # The input embedding is a gather (no FLOPs); a tied embedding is also the output head.
        model_config = models.config_for(preset, size, **model)
        n_flop_params = n_all if model_config.tie_embeddings else n_all - n_embed
        rng = np.random.default_rng(0)
        vocab = model_config.vocab_size
        tokens = rng.integers(0, vocab, (batch, seq_len + 1), dtype=np.int32)
        data = {"tokens": tokens[:, :-1], "targets": tokens[:, 1:],
                "segment_ids": np.ones((batch, seq_len), np.int32), "mask": np.ones((batch, seq_len), np.float32)}
        started = time.perf_counter()
        state, metrics = step(state, data)
        jax.block_until_ready(metrics)
        row["first_step_s"] = time.perf_counter() - started      # compile included
        for _ in range(2):
            state, metrics = step(state, data)
        jax.block_until_ready(metrics)
        started = time.perf_counter()
        for _ in range(steps):
            state, metrics = step(state, data)
        jax.block_until_ready(metrics)
        step_s = (time.perf_counter() - started) / steps
        device = jax.devices()[0]
        stats = device.memory_stats() or {}
        tokens_per_s = batch * seq_len / step_s
        peak = peak_tflops(device.device_kind)
        row.update(params_M=n_all / 1e6, step_ms=1e3 * step_s, tokens_per_s=tokens_per_s,
                   peak_GB=stats.get("peak_bytes_in_use", 0) / 1e9, loss=float(metrics["loss"]),
                   mfu=(6 * n_flop_params * tokens_per_s / (peak * 1e12)) if peak else None)
        del state
    except Exception as err:     # an OOM is a result here
        row["error"] = f"{type(err).__name__}: {str(err).splitlines()[0][:300]}"
    log(json.dumps(row))
    return row


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--anchor", default="build/anchors_gpu.py", help="fla anchor script ('' to skip)")
    parser.add_argument("--remat", default="dots_and_kernels", help="remat policies of our gated_deltanet row")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--models", default="gated_deltanet,atlas,titans")
    parser.add_argument("--memory-batch", type=int, default=4, help="batch of the atlas / titans rows")
    parser.add_argument("--anchor-timeout", type=float, default=400)
    parser.add_argument("--tag", default="", help="suffix of the output files (lm_throughput<tag>.md/.json)")
    parser.add_argument("--tiny", action="store_true", help="toy shapes (CPU dry run); skips the anchor")
    parser.add_argument("--root", default=None,
                        help="checkout to import atlas_jax from (default: this one), e.g. an archived "
                             "earlier commit, to time two trees side by side")
    args = parser.parse_args(argv)

    # dots_and_kernels keeps ≈ 53 GiB at B8 T4096: let XLA's allocator use the whole card (the
    # default caps it at 75%).
    os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.95")
    rows = []
    if args.anchor and not args.tiny:
        anchor = run_anchor(args.anchor, args.anchor_timeout)
        anchor.update(model="fla GatedDeltaNetForCausalLM (torch AdamW)")
        log(json.dumps(anchor))
        rows.append(anchor)

    import_tree(args.root) if args.root else import_tree()
    import jax

    size, seq, batch = ("tiny", 64, 2) if args.tiny else ("340m", 4096, 8)
    fla_config = dict(FLA_CONFIG, **({"num_heads": 2, "vocab_size": 256, "mlp_hidden": 128} if args.tiny else {}))
    memory_options = {"atlas": {"preset_options": {"ns_every": "chunk"}}, "titans": {}}
    for name in args.models.split(","):
        if name == "gated_deltanet":
            for remat in args.remat.split(","):
                rows.append(run_ours("gated_deltanet (fla config)", "gated_deltanet", fla_config, batch, seq,
                                     remat, "bfloat16", args.steps, size))
        else:
            mb = 2 if args.tiny else args.memory_batch
            rows.append(run_ours(f"{name} {size}" + (" (per-chunk NS)" if name == "atlas" else ""), name,
                                 memory_options.get(name, {}), mb, seq, "full", "bfloat16", args.steps, size))
    device = jax.devices()[0].device_kind
    lines = [f"# LM training throughput, {device}, jax {jax.__version__}, {time.strftime('%Y-%m-%d')}", "",
             "| model | B×T | remat | params (M) | step (ms) | tokens/s | peak (GB) | MFU (6N) |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['model']} | {r.get('B')}×{r.get('T')} | {r.get('remat', '')} | — | {r['error'][:120]} | | | |")
            continue
        step_ms = r.get("step_ms", 1e3 * r.get("step_s", 0))
        mfu = f"{100 * r['mfu']:.1f}%" if r.get("mfu") else "—"
        lines.append(f"| {r['model']} | {r['B']}×{r['T']} | {r.get('remat', 'none')} | {r['params_M']:.0f} | "
                     f"{step_ms:.1f} | {r['tokens_per_s'] / 1e3:.1f}K | {r.get('peak_GB', r.get('peak_mem_GB', 0)):.1f} | {mfu} |")
    table = "\n".join(lines)
    log(table)
    out = os.environ.get("OUT")
    save_json(rows, out, f"lm_throughput{args.tag}.json")
    if out:
        with open(os.path.join(out, f"lm_throughput{args.tag}.md"), "w") as f:
            f.write(table + "\n")
    return rows


if __name__ == "__main__":
    main()
