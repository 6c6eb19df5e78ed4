"""The train step and the run on a real preset (gated_deltanet, one block of the tiny size):
gradient accumulation, the non-finite guard, and resume after SIGKILL / SIGTERM giving exactly the
losses of an uninterrupted run.

Runs go through `python -m atlas_jax.train` in subprocesses (a kill must hit a real process); they
share a persistent compilation cache so only the first compiles.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from atlas_jax.train.config import load_train_config
from atlas_jax.train.data import build_dataset
from atlas_jax.train.trainer import Trainer, load_run, train

SMALL = ["preset=gated_deltanet", "model.num_layers=1", "seq_len=32", "batch_size=4", "data.tokenizer=byte",
         "data.max_documents=40", "progress=false", "compute_dtype=float32", "tensorboard=false"]


@pytest.fixture(scope="module")
def cache_env(tmp_path_factory):
    cache = tmp_path_factory.mktemp("jax-cache")
    return dict(os.environ, JAX_COMPILATION_CACHE_DIR=str(cache), JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
                JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0")


def _losses(run_dir):
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [(r["step"], r["loss"]) for r in records], [r["eval_loss"] for r in records if "eval_loss" in r]


def _start(args, env):
    return subprocess.Popen([sys.executable, "-m", "atlas_jax.train", *args], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _wait_for_lines(proc, metrics, n, timeout=240):
    deadline = time.time() + timeout
    while time.time() < deadline:
        if metrics.is_file() and len(metrics.read_text().splitlines()) >= n:
            return
        if proc.poll() is not None:
            raise AssertionError(f"run ended early ({proc.returncode}): {proc.stderr.read()[-2000:]}")
        time.sleep(0.05)
    raise AssertionError("run did not log in time")


def test_killed_and_resumed_run_logs_the_uninterrupted_losses(tmp_path, cache_env):
    common = SMALL + ["steps=12", "log_every=1", "eval_every=6", "checkpoint_every=2"]
    whole, broken = tmp_path / "whole", tmp_path / "broken"
    done = subprocess.run([sys.executable, "-m", "atlas_jax.train", *common, f"run_dir={whole}"], env=cache_env,
                          capture_output=True, text=True, timeout=400)
    assert done.returncode == 0, done.stderr[-3000:]
    expected, expected_eval = _losses(whole)
    assert [s for s, _ in expected] == list(range(1, 13)) and len(expected_eval) == 2

    # SIGKILL mid-run (async checkpoints every 2 steps: often mid-save)
    proc = _start(common + [f"run_dir={broken}"], cache_env)
    _wait_for_lines(proc, broken / "metrics.jsonl", 5)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    checkpoints = broken / "checkpoints"
    complete = sorted(int(p.name) for p in checkpoints.iterdir() if p.name.isdigit())
    assert complete and max(complete) < 12
    # a half-written save, as a kill inside orbax's write leaves it: a temporary folder never renamed
    # (the kill often leaves a real one; otherwise plant one, truncated files and all)
    if not any(".orbax-checkpoint-tmp" in p.name for p in checkpoints.iterdir()):
        half = checkpoints / f"{max(complete) + 2}.orbax-checkpoint-tmp"
        shutil.copytree(checkpoints / str(max(complete)), half)
        for path in sorted(half.rglob("*"))[len(list(half.rglob("*"))) // 2:]:
            if path.is_file():
                path.write_bytes(b"")

    # SIGTERM after resuming: save at the current step, wait, exit 0
    proc = _start(common + [f"run_dir={broken}"], cache_env)
    _wait_for_lines(proc, broken / "metrics.jsonl", 9)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err[-3000:]
    assert f"resumed from {checkpoints / str(max(complete))}" in err + out
    assert "SIGTERM: saved step" in err + out
    stopped_at = int((err + out).split("SIGTERM: saved step ")[1].split()[0])
    assert stopped_at in {int(p.name) for p in checkpoints.iterdir() if p.name.isdigit()}

    # the same command again finishes the run
    again = subprocess.run([sys.executable, "-m", "atlas_jax.train", *common, f"run_dir={broken}"], env=cache_env,
                           capture_output=True, text=True, timeout=400)
    assert again.returncode == 0, again.stderr[-3000:]
    assert f"resumed from {checkpoints / str(stopped_at)}" in again.stderr + again.stdout
    got, got_eval = _losses(broken)
    assert got == expected          # bit-identical per-step losses (JSON floats round-trip exactly)
    assert got_eval == expected_eval
    assert (broken / "loss.png").is_file()
    kept = sorted(int(p.name) for p in checkpoints.iterdir() if p.name.isdigit())
    assert kept[-1] == 12 and len(kept) <= 3        # checkpoint.keep


@pytest.fixture(scope="module")
def small_trainer():
    cfg = load_train_config(overrides=SMALL + ["steps=4", "run_dir=unused"])
    data = build_dataset(cfg.data, seq_len=cfg.seq_len, batch_size=cfg.batch_size, seed=0)
    return cfg, data


def test_grad_accumulation_equals_one_large_batch(small_trainer):
    cfg, data = small_trainer
    batch = next(data.train_iterator())
    results = []
    for k in (1, 2):
        trainer = Trainer(load_train_config(overrides=SMALL + ["steps=4", "run_dir=unused", f"optim.grad_accum={k}"]),
                          data.tokenizer.vocab_size, 8)
        state, metrics = trainer.train_step(trainer.init_state(), trainer.put_batch(batch))
        results.append((jax.device_get(metrics), jax.device_get(state["params"])))
    (m1, p1), (m2, p2) = results
    np.testing.assert_allclose(m2["loss"], m1["loss"], rtol=1e-5)
    np.testing.assert_allclose(m2["grad_norm"], m1["grad_norm"], rtol=1e-5)
    for a, b in zip(jax.tree.leaves(p1), jax.tree.leaves(p2)):
        np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-7)
    assert m1["target_tokens"] == m2["target_tokens"] == batch["mask"].sum()


def test_nonfinite_step_is_not_applied(small_trainer):
    cfg, data = small_trainer
    trainer = Trainer(cfg, data.tokenizer.vocab_size, 8)
    state = trainer.init_state()
    params = jax.device_get(state["params"])
    poisoned = jax.tree.map(np.array, params)        # writable copies
    jax.tree_util.tree_leaves(poisoned)[0][...] = np.nan
    state["params"] = jax.device_put(poisoned, trainer.state_sharding["params"])
    count_before = jax.device_get(jax.tree.leaves(state["opt_state"]))
    new_state, metrics = trainer.train_step(state, trainer.put_batch(next(data.train_iterator())))
    assert not bool(metrics["finite"])
    for a, b in zip(jax.tree.leaves(poisoned), jax.tree.leaves(jax.device_get(new_state["params"]))):
        np.testing.assert_array_equal(a, b)          # NaN == NaN for assert_array_equal
    for a, b in zip(count_before, jax.device_get(jax.tree.leaves(new_state["opt_state"]))):
        np.testing.assert_array_equal(a, b)
    assert int(new_state["step"]) == 1


def test_on_nonfinite_stop_writes_metrics_and_says_so(tmp_path, cache_env):
    # a learning rate of 1e30 turns the parameters to inf after the first update
    result = subprocess.run([sys.executable, "-m", "atlas_jax.train", *SMALL, "steps=6", "log_every=1",
                             "optim.learning_rate=1e30", "optim.warmup_steps=0", "optim.grad_clip=0",
                             "on_nonfinite=stop", f"run_dir={tmp_path}"], env=cache_env,
                            capture_output=True, text=True, timeout=400)
    assert result.returncode == 3, result.stderr[-3000:]
    assert "non-finite loss or gradient at step" in result.stderr and "on_nonfinite=stop" in result.stderr
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert None in (records[-1]["loss"], records[-1]["grad_norm"]) and records[-1]["step"] < 6


def test_train_in_process_returns_a_summary(tmp_path, capsys):
    cfg = load_train_config(overrides=SMALL + ["steps=2", "log_every=1", "eval_every=2", f"run_dir={tmp_path}",
                                               "tensorboard=true"])
    summary = train(cfg)
    assert summary["exit"] == "done" and summary["steps"] == 2
    assert np.isfinite(summary["last"]["eval_loss"]) and summary["unigram_loss"] > 0
    assert list((tmp_path / "tensorboard").iterdir())
    assert (tmp_path / "config.yml").is_file() and (tmp_path / "tokenizer.json").is_file()
    # what generate loads: the latest checkpoint's parameters in a rebuilt model, and the tokenizer
    model, tokenizer, step = load_run(tmp_path)
    assert step == 2 and tokenizer.vocab_size == summary["dataset"].tokenizer.vocab_size
    tokens = np.asarray(summary["dataset"].eval_batches(1)[0]["tokens"][:2])
    expected = summary["trainer"].model(jax.device_get(summary["state"]))(tokens)
    np.testing.assert_array_equal(np.asarray(model(tokens)), np.asarray(expected))
    # atlas-jax generate on the run directory: greedy continues the prompt as models.generate does
    from atlas_jax import models
    from atlas_jax.cli import main as cli_main
    assert cli_main(["generate", "--checkpoint", str(tmp_path), "--prompt", "ROMEO:", "--max-new-tokens", "5",
                     "--temperature", "0"]) == 0
    printed = capsys.readouterr().out.strip()
    greedy = models.generate(model, jnp.asarray(tokenizer.encode("ROMEO:"), jnp.int32), 5, temperature=0.0)
    assert printed == "ROMEO:" + tokenizer.decode([int(t) for t in greedy])
    assert cli_main(["generate", "--checkpoint", str(tmp_path / "nothing"), "--prompt", "x"]) == 2
