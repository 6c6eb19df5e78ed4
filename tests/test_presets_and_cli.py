"""Presets are constructible by name with their axes readable back; configs, packaging and README
agree. The command line and the config loader are tested in test_cli_config.py."""
from __future__ import annotations

import re
import tomllib
from pathlib import Path

import pytest

from atlas_jax import presets

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
    assert presets.get("titans").axes()["optimizer"] == "GD + momentum (step inside)"
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


def test_every_package_is_listed_for_installation():
    setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(setuptools["packages"])
    # every top-level folder mapped into the atlas_jax namespace (kernels/, train/, configs/, ...)
    mapping = {name: ROOT / folder for name, folder in setuptools["package-dir"].items()
               if name == "atlas_jax" or "." not in name.removeprefix("atlas_jax.")}
    found = set()
    for prefix, folder in mapping.items():
        for init in folder.rglob("__init__.py"):
            rel = init.parent.relative_to(folder)
            found.add(".".join([prefix, *rel.parts]) if rel.parts else prefix)
    # configs/ ships as package data: each of its folders of YAML files is a package too
    found |= {".".join(["atlas_jax.configs", *yml.parent.relative_to(ROOT / "configs").parts])
              for yml in (ROOT / "configs").rglob("*.yml")}
    # so is each data folder named in package-data (train/data: the built-in corpus)
    data_folders = {name for name in setuptools["package-data"] if name != "*"}
    assert (ROOT / "train" / "data").is_dir() and data_folders == {"atlas_jax.train.data"}, data_folders
    found |= data_folders
    assert found == listed, f"pyproject packages differ: missing {sorted(found - listed)}, extra {sorted(listed - found)}"
