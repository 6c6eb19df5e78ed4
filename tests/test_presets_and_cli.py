"""Presets are constructible by name with their axes readable back; configs, CLI and README agree."""
from __future__ import annotations

import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from atlas_jax import presets
from atlas_jax.cli import main as cli_main
from atlas_jax.config import load_config
from atlas_jax.experiments.memorization import MemorizationConfig

ROOT = Path(__file__).resolve().parent.parent
DESIGN_PRESETS = ["linear_attention", "retnet", "lightning_attention", "mamba2", "gla", "polysketch", "deltanet",
                  "gated_deltanet", "kda", "rwkv7", "longhorn", "deltaproduct", "mesanet", "ttt_linear", "ttt_mlp",
                  "titans", "dla", "swla", "omeganet", "atlas", "atlas_pp", "moneta", "yaad", "memora",
                  "deep_transformer", "swdt", "dot"]


def test_every_memory_preset_of_the_design_exists_with_readable_axes():
    assert sorted(presets.names()) == sorted(DESIGN_PRESETS)
    for name in DESIGN_PRESETS:
        axes = presets.get(name).axes()
        assert set(axes) == {"memory", "feature_map", "objective", "window", "optimizer", "retention"}
    atlas = presets.get("atlas", window=8, degree=3, ns_steps=2).axes()
    assert atlas["window"] == 8 and atlas["feature_map"] == "polynomial(p=3)" and "J=2" in atlas["optimizer"]
    assert presets.get("kda").axes()["retention"] == "channel α_t"
    assert presets.get("titans").axes()["optimizer"] == "GD + momentum"
    assert presets.get("deltaproduct", num_householder=3).axes()["optimizer"] == "3 × GD per token"


def test_every_preset_has_a_model_config_that_loads():
    for name in DESIGN_PRESETS:
        path = ROOT / "configs" / "models" / f"{name}.yml"
        assert path.is_file(), path
        assert presets.from_config(path).axes() == presets.get(name).axes()
    assert presets.from_config(ROOT / "configs/models/atlas.yml", ["window=2"]).axes()["window"] == 2
    with pytest.raises(ValueError, match=r"unknown option\(s\) \['windows'\]"):
        presets.from_config(ROOT / "configs/models/atlas.yml", ["windows=2"])


def test_readme_preset_table_is_the_generated_one():
    readme = (ROOT / "README.md").read_text()
    assert presets.markdown_table() in readme, "README's preset table is stale: paste `atlas-jax presets --markdown`"


def test_readme_starts_with_the_two_commands_and_ci_calls_the_test_one():
    readme = (ROOT / "README.md").read_text()
    blocks = re.findall(r"```(?:bash|sh)?\n(.*?)```", readme, flags=re.S)
    assert blocks and blocks[0].strip().splitlines() == ["make run", "make test"]
    assert "make test" in (ROOT / ".ci" / "run").read_text()


def test_memorize_config_and_overrides():
    cfg = load_config(MemorizationConfig, ROOT / "configs/experiments/memorize.yml", ["passes=3", "n_pairs=[8,16]"])
    assert cfg.passes == 3 and cfg.n_pairs == (8, 16) and cfg.poly_coeffs == (0.0, 1.0, 1.0)
    with pytest.raises(ValueError, match=r"unknown key\(s\) \['pases'\]"):
        load_config(MemorizationConfig, None, ["pases=3"])
    with pytest.raises(ValueError, match=r"^memorize: unknown memories \['lstm'\]"):
        MemorizationConfig(memories=("lstm",))


def test_cli_memorize_runs_end_to_end(tmp_path, capsys):
    """A tiny real run: the table, results.json and the PNG plot are produced."""
    code = cli_main(["memorize", "n_pairs=[4,20]", "trials=2", "memories=[deltanet,deltanet_poly2]",
                     f"out_dir={tmp_path}"])
    assert code == 0
    out = capsys.readouterr().out
    assert "DeltaNet on φ = poly(2)" in out and "recall" in out
    assert (tmp_path / "results.json").stat().st_size > 0
    assert (tmp_path / "recall_vs_n.png").read_bytes()[:4] == b"\x89PNG"


def test_cli_reports_bad_keys_in_one_line(capsys):
    assert cli_main(["preset", "atlas", "widow=3"]) == 2
    assert "unknown option(s) ['widow']" in capsys.readouterr().err


def test_every_package_is_listed_for_installation():
    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    mapping = {"atlas_jax": ROOT / "atlas_jax", "atlas_jax.kernels": ROOT / "kernels", "atlas_jax.train": ROOT / "train"}
    found = set()
    for prefix, folder in mapping.items():
        for init in folder.rglob("__init__.py"):
            rel = init.parent.relative_to(folder)
            found.add(".".join([prefix, *rel.parts]) if rel.parts else prefix)
    assert found == listed, f"pyproject packages differ: missing {sorted(found - listed)}, extra {sorted(listed - found)}"


def test_readme_example_runs():
    readme = (ROOT / "README.md").read_text()
    example = next(b for b in re.findall(r"```python\n(.*?)```", readme, flags=re.S) if "MemorySpec(" in b)
    scope = {}
    exec(compile(example, "README.md", "exec"), scope)
    assert scope["o"].shape == (2, 64, 4, 16) and scope["o_adam"].shape == (2, 64, 4, 16)
    import numpy as np
    assert np.isfinite(np.asarray(scope["o"])).all() and np.isfinite(np.asarray(scope["o_adam"])).all()
