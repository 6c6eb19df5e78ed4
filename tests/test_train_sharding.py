"""Sharded training gives one device's losses: data-parallel, fsdp and fsdp+tensor meshes over 8 CPU
devices (a memory preset and a hybrid), and two processes of 4 devices each joined by
jax.distributed (the multi-host path). Each runs in subprocesses: XLA_FLAGS must be set before
JAX starts."""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import numpy as np
import pytest

pytestmark = pytest.mark.slow

SMALL = ["model.num_layers=2", "seq_len=32", "batch_size=8", "data.tokenizer=byte", "data.max_documents=40",
         "progress=false", "compute_dtype=float32", "tensorboard=false"]

MESH_WORKER = r"""
import json, sys
import jax
from atlas_jax.train.config import load_train_config
from atlas_jax.train.data import build_dataset
from atlas_jax.train.trainer import Trainer

preset, small = sys.argv[1], json.loads(sys.argv[2])
meshes = {"one device": (["mesh.data=1"], jax.devices()[:1]),
          "data=8": (["mesh.data=8"], None),
          "fsdp=8": (["mesh.data=1", "mesh.fsdp=8"], None),
          "fsdp=4 tensor=2": (["mesh.data=1", "mesh.fsdp=4", "mesh.tensor=2"], None),
          "data=2 fsdp=2 tensor=2": (["mesh.data=2", "mesh.fsdp=2", "mesh.tensor=2"], None)}
out = {}
data = None
for name, (mesh, devices) in meshes.items():
    cfg = load_train_config(overrides=[f"preset={preset}", "steps=3", "run_dir=unused", *small, *mesh])
    if data is None:
        data = build_dataset(cfg.data, seq_len=cfg.seq_len, batch_size=cfg.batch_size, seed=cfg.seed)
    trainer = Trainer(cfg, data.tokenizer.vocab_size, 8, devices=devices)
    state, it, losses = trainer.init_state(), data.train_iterator(), []
    for _ in range(3):
        state, metrics = trainer.train_step(state, trainer.put_batch(next(it)))
        losses.append(float(metrics["loss"]))
    out[name] = losses
print("LOSSES " + json.dumps(out))
"""


def _env(devices: int) -> dict:
    env = dict(os.environ)
    env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={devices}").strip()
    return env


@pytest.mark.parametrize("preset", ["gated_deltanet", "yaad_h"])
def test_meshes_over_8_devices_match_one_device(preset):
    result = subprocess.run([sys.executable, "-c", MESH_WORKER, preset, json.dumps(SMALL)], env=_env(8),
                            capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stderr[-3000:]
    losses = json.loads(result.stdout.split("LOSSES ", 1)[1])
    reference = np.array(losses.pop("one device"))
    assert np.all(np.isfinite(reference)) and reference[-1] < reference[0] + 1.0
    for name, got in losses.items():
        np.testing.assert_allclose(got, reference, rtol=1e-5, err_msg=name)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _losses(run_dir):
    return [json.loads(line)["loss"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_two_processes_match_one_process(tmp_path):
    args = ["preset=gated_deltanet", "steps=4", "log_every=1", "eval_every=0", "checkpoint_every=2", *SMALL]
    single = subprocess.run([sys.executable, "-m", "atlas_jax.train", *args, f"run_dir={tmp_path / 'one'}"],
                            env=_env(1), capture_output=True, text=True, timeout=900)
    assert single.returncode == 0, single.stderr[-3000:]
    port = _free_port()
    procs = [subprocess.Popen(
        [sys.executable, "-m", "atlas_jax.train", *args, f"run_dir={tmp_path / 'two'}", "distributed.enabled=true",
         f"distributed.coordinator_address=127.0.0.1:{port}", "distributed.num_processes=2",
         f"distributed.process_id={i}"], env=_env(4), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for i in range(2)]
    outputs = [p.communicate(timeout=900) for p in procs]
    for proc, (_, err) in zip(procs, outputs):
        assert proc.returncode == 0, err[-3000:]
    np.testing.assert_allclose(_losses(tmp_path / "two"), _losses(tmp_path / "one"), rtol=1e-5)
    assert sorted(int(p.name) for p in (tmp_path / "two" / "checkpoints").iterdir() if p.name.isdigit()) == [2, 4]
