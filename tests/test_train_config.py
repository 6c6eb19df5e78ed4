"""Training config, optimizer and mesh: every bad value is one line naming the key; the CLI exits 2."""
from __future__ import annotations

import subprocess
import sys

import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from atlas_jax.train.cli import main as train_main
from atlas_jax.train.config import (ConfigError, MeshConfig, OptimConfig, TrainConfig, config_from_dict,
                                    load_train_config)
from atlas_jax.train.optim import decay_mask, learning_rate_schedule, make_optimizer
from atlas_jax.train.sharding import logical_to_spec, make_mesh, mesh_shape


def test_base_yml_is_the_dataclass_defaults():
    assert load_train_config() == TrainConfig()


def test_flat_and_nested_overrides():
    cfg = load_train_config(overrides=["preset=gated_deltanet", "steps=7", "optim.learning_rate=1e-3",
                                       "mesh.fsdp=2", "model.num_layers=1", "run_dir=007"])
    assert (cfg.preset, cfg.steps, cfg.optim.learning_rate, cfg.mesh.fsdp) == ("gated_deltanet", 7, 1e-3, 2)
    assert cfg.model == {"num_layers": 1} and cfg.run_dir == "007"


def test_config_file_layer(tmp_path):
    path = tmp_path / "mine.yml"
    path.write_text("steps: 9\noptim:\n  warmup_steps: 3\n")
    cfg = load_train_config(path, ["steps=11"])
    assert cfg.steps == 11 and cfg.optim.warmup_steps == 3 and cfg.optim.learning_rate == 3e-3


@pytest.mark.parametrize("override, key, allowed", [
    ("stepz=3", "'stepz'", "Valid keys: preset, size, steps"),
    ("optim.lr=1", "'optim.lr'", "valid keys in optim: learning_rate"),
    ("steps=0", "steps", ">= 1"),
    ("steps=ten", "steps", "must be an int >= 1"),
    ("batch_size=2.5", "batch_size", "must be an int >= 1"),
    ("compute_dtype=float16", "compute_dtype", "bfloat16"),
    ("remat=some", "remat", "dots"),
    ("on_nonfinite=ignore", "on_nonfinite", "skip"),
    ("data.tokenizer=wordpiece", "data.tokenizer", "bpe"),
    ("data.format=csv", "data.format", "parquet"),
    ("data.eval_fraction=0.9", "data.eval_fraction", "> 0 and < 0.5"),
    ("optim.learning_rate=-1", "optim.learning_rate", "> 0"),
    ("optim.b2=1.5", "optim.b2", ">= 0 and <= 1"),
    ("mesh.tensor=0", "mesh.tensor", "-1"),
    ("mesh.fsdp=-1", "mesh.fsdp", "at most one of data, fsdp, tensor may be -1"),
    ("checkpoint.keep=0", "checkpoint.keep", ">= 1"),
    ("preset=gpt5", "preset", "gated_deltanet"),
    ("size=7b", "size", "170m"),
    ("model=3", "model", "mapping"),
    ("optim.grad_accum=3", "optim.grad_accum", "batch_size=16"),
    ("run_dir=", "run_dir", "non-empty"),
])
def test_each_bad_value_names_its_key(override, key, allowed):
    with pytest.raises(ConfigError) as err:
        load_train_config(overrides=[override])
    message = str(err.value)
    assert message.startswith("config: ") and key in message and allowed in message and "\n" not in message


def test_cli_errors_are_one_line_and_exit_2(capsys, tmp_path):
    cases = [["stepz=1"], ["preset=nope"], [f"data.source={tmp_path / 'missing.txt'}"],
             ["mesh.data=3", f"run_dir={tmp_path / 'run'}", "data.tokenizer=byte"], ["not-a-pair"]]
    for argv in cases:
        assert train_main(argv) == 2, argv
        err = capsys.readouterr().err.strip()
        assert err.startswith("atlas-jax train: error:") and "\n" not in err, err
    assert train_main(["--config", str(tmp_path / "none.yml")]) == 2
    assert "--config " + str(tmp_path / "none.yml") + ": no such file" in capsys.readouterr().err


def test_one_config_error_class_for_train_and_library(capsys, tmp_path):
    from atlas_jax import config as library
    from atlas_jax.cli import main as atlas_main
    assert ConfigError is library.ConfigError
    # one-line messages written with their own "config: " prefix (train/data.py, sharding.py) keep one
    assert str(ConfigError("config: batch_size: too big")) == "config: batch_size: too big"
    # a train key, a missing --config file, a key given twice on the command line (in code the last
    # one wins, so that callers can put the user's overrides after their own): same class, same exit
    with pytest.raises(library.ConfigError):
        load_train_config(overrides=["stepz=1"])
    with pytest.raises(library.ConfigError):
        load_train_config([tmp_path / "none.yml"])
    assert load_train_config(overrides=["steps=1", "steps=2"]).steps == 2
    for argv in (["stepz=1"], ["--config", str(tmp_path / "none.yml")], ["steps=1", "steps=2"]):
        assert atlas_main(["train", *argv]) == 2, argv
        err = capsys.readouterr().err.strip()
        assert err.startswith("atlas-jax train: error: config: ") and "\n" not in err, err


def test_layers_merge_the_model_section_and_round_trip(tmp_path):
    path = tmp_path / "mine.yml"
    path.write_text("model:\n  num_layers: 1\n  preset_options: {ns_every: 2}\ndata:\n  source: corpus.txt\n")
    cfg = load_train_config(path, ["model.preset_options.ns_every=4", "mesh.data=1", r"data.text_separator=\n\n"])
    assert cfg.model == {"num_layers": 1, "preset_options": {"ns_every": 4}}
    assert (cfg.data.source, cfg.data.text_separator, cfg.mesh.data) == ("corpus.txt", "\n\n", 1)
    assert config_from_dict(cfg.to_dict()) == cfg
    path.write_text("model:\n")    # an empty section is no overrides
    assert load_train_config(path).model == {}


def test_cli_exit_code_in_a_process(tmp_path):
    result = subprocess.run([sys.executable, "-m", "atlas_jax.train", f"data.source={tmp_path}/nothing.jsonl"],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        f"atlas-jax train: error: config: data.source: '{tmp_path}/nothing.jsonl' does not exist "
        "(give 'builtin', a file, a directory or a glob)"]


def test_mesh_must_divide_the_devices():
    assert mesh_shape(MeshConfig(), 8) == (8, 1, 1)
    assert mesh_shape(MeshConfig(fsdp=2, tensor=2), 8) == (2, 2, 2)
    with pytest.raises(ConfigError, match="mesh.*does not divide the 8 devices"):
        mesh_shape(MeshConfig(fsdp=3), 8)
    with pytest.raises(ConfigError, match="mesh: data x fsdp x tensor = 2 x 2 x 1 = 4 does not match the 8"):
        mesh_shape(MeshConfig(data=2, fsdp=2), 8)
    assert make_mesh(MeshConfig()).shape == {"data": jax.device_count(), "fsdp": 1, "tensor": 1}


def test_logical_rules_shard_only_what_divides():
    mesh = jax.make_mesh((1, 1, 1), ("data", "fsdp", "tensor"))

    class FakeMesh:    # shapes of a bigger mesh, for the rule arithmetic alone
        shape = {"data": 2, "fsdp": 4, "tensor": 2}
    assert logical_to_spec(("embed", "mlp"), (64, 128), FakeMesh) == P("fsdp", "tensor")
    assert logical_to_spec(("embed", "mlp"), (6, 128), FakeMesh) == P(None, "tensor")
    assert logical_to_spec(("batch", None), (16, 5), FakeMesh) == P(("data", "fsdp"), None)
    assert logical_to_spec(("embed",), (64,), mesh) == P(None)


def test_schedule_warmup_then_cosine_and_decay_mask():
    cfg = OptimConfig(learning_rate=1.0, warmup_steps=10, min_lr_ratio=0.1)
    lr = learning_rate_schedule(cfg, 110)
    assert float(lr(0)) == 0.0 and float(lr(5)) == pytest.approx(0.5)
    assert float(lr(10)) == pytest.approx(1.0)
    assert float(lr(60)) == pytest.approx(0.55, rel=1e-4)      # half way down the cosine
    assert float(lr(110)) == pytest.approx(0.1)
    params = {"dense": {"kernel": np.ones((2, 3))}, "norm": {"scale": np.ones((2, 3))}, "bias": np.ones(3)}
    assert decay_mask(params) == {"dense": {"kernel": True}, "norm": {"scale": False}, "bias": False}


def test_clipping_is_in_the_chain():
    import jax.numpy as jnp
    tx, _ = make_optimizer(OptimConfig(grad_clip=1.0, warmup_steps=0, weight_decay=0.0), 10)
    params = {"w": jnp.zeros(4)}
    state = tx.init(params)
    big, _ = tx.update({"w": jnp.full(4, 100.0)}, state, params)
    small, _ = tx.update({"w": jnp.full(4, 0.5)}, state, params)
    # Adam's first step is sign-like either way; clipping shows in its state's first moment
    _, clipped_state = tx.update({"w": jnp.full(4, 100.0)}, state, params)
    mu = jax.tree.leaves(clipped_state[1][0].mu)[0]
    np.testing.assert_allclose(np.asarray(mu), 0.1 * 0.5, rtol=1e-6)    # (1 - b1) * clipped grad 0.5
    assert np.all(np.isfinite(np.asarray(big["w"]))) and np.all(np.isfinite(np.asarray(small["w"])))
