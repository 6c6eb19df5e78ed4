"""The config loader and the command line: typed layers and overrides, one-line errors before any
work, output folders checked up front, and the shipped configs found from a non-editable install."""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import pytest
import yaml

from atlas_jax import config as C
from atlas_jax.cli import main as cli_main
from atlas_jax.config import Config, ConfigError, load_config, setting
from atlas_jax.experiments.memorization import MEMORIES, POLYNOMIAL_MEMORIES, MemorizationConfig
from installed import installed  # noqa: F401  (session fixture: one non-editable install per run)

ROOT = Path(__file__).resolve().parent.parent
MEMORIZE_YML = ROOT / "configs" / "experiments" / "memorize.yml"


# --- a training-shaped config: flat keys users change most, nested sections ----------------------

@dataclass(frozen=True)
class OptimSection(Config):
    lr: float = setting(3e-4, gt=0)
    schedule: Literal["cosine", "constant"] = "cosine"
    betas: tuple[float, float] = (0.9, 0.95)


@dataclass(frozen=True)
class DataSection(Config):
    source: str = "builtin"
    path: Path | None = setting(None, must_exist="file")


@dataclass(frozen=True)
class TrainLike(Config):
    preset: str = setting("deltanet", choices=lambda: ("deltanet", "atlas"))
    size: str = "tiny"
    steps: int = setting(100, ge=1)
    batch_size: int = setting(8, ge=1)
    seq_len: int = setting(64, ge=2)
    seed: int = setting(0, ge=0)
    run_dir: str = setting("runs/x", output_dir=True)
    checkpoint_every: int = setting(0, ge=0)
    log_every: int = setting(10, ge=1)
    bf16: bool = False
    model: dict = field(default_factory=dict)
    optimizer: OptimSection = OptimSection()
    data: DataSection = field(default_factory=DataSection)

    def __post_init__(self):
        super().__post_init__()
        if self.checkpoint_every > self.steps:
            raise ConfigError(f"must be <= steps={self.steps} (0: only at the end)", key="checkpoint_every",
                              value=self.checkpoint_every)


def _write(path: Path, data) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(data) if not isinstance(data, str) else data)
    return path


def test_layers_merge_in_order_then_dotted_overrides(tmp_path):
    base = _write(tmp_path / "base.yml", {"steps": 50, "run_dir": str(tmp_path / "run"),
                                          "optimizer": {"lr": 1e-3, "schedule": "constant"}})
    for size, batch in (("tiny", 4), ("big", 64)):
        _write(tmp_path / "sizes" / f"{size}.yml", {"batch_size": batch, "optimizer": {"lr": 5e-4}})
    user = _write(tmp_path / "mine.yml", "seq_len: 128\nmodel: {n_layers: 2}\n")
    seen = []

    def size_layer(raw):
        seen.append(raw["size"])
        return tmp_path / "sizes" / f"{raw['size']}.yml"

    cfg = load_config(TrainLike, base, size_layer, user, None,
                      overrides=["size=big", "steps=1e5", "optimizer.betas=[0.8,0.9]", "bf16=true"])
    assert seen == ["big"]                                   # the callable saw the command line's size
    assert (cfg.steps, cfg.batch_size, cfg.seq_len, cfg.bf16) == (100000, 64, 128, True)
    assert cfg.optimizer == OptimSection(lr=5e-4, schedule="constant", betas=(0.8, 0.9))
    assert cfg.model == {"n_layers": 2} and cfg.data == DataSection()
    assert isinstance(cfg.optimizer.lr, float) and isinstance(cfg.steps, int)
    # YAML reads 3e-4 as a string; a float field takes it. Overrides of a text field keep the text.
    cfg = load_config(TrainLike, base, overrides=["optimizer.lr=3e-4", "run_dir=" + str(tmp_path / "007")])
    assert cfg.optimizer.lr == 3e-4 and cfg.run_dir.endswith("007")
    assert load_config(TrainLike, C.to_dict(cfg)) == cfg     # the resolved config round-trips
    assert C.dump_yaml(cfg).startswith("preset: deltanet\n")


@pytest.mark.parametrize("overrides, message", [
    (["steps=0"], "config: steps=0: must be an int >= 1 (from the command line)"),
    (["steps=2.5"], "config: steps=2.5: must be an int >= 1"),
    (["bf16=1"], "config: bf16=1: must be true or false"),
    (["preset=titans"], "config: preset=titans: must be one of: deltanet, atlas"),
    (["optimizer.lr=abc"], "config: optimizer.lr=abc: must be a number > 0 (from the command line)"),
    (["optimizer.lr=-1"], "config: optimizer.lr=-1: must be a number > 0"),
    (["optimizer.schedule=linear"], "config: optimizer.schedule=linear: must be one of: cosine, constant"),
    (["optimizer.betas=[0.9]"], "config: optimizer.betas=[0.9]: must be a list of 2: a number, a number"),
    (["optimizer=3"], "config: optimizer=3: must be a mapping of optimizer.* keys"),
    (["optimizer.lrr=1"], "config: unknown key 'optimizer.lrr' (from the command line); did you mean "
                          "'optimizer.lr'? Valid keys in optimizer: lr, schedule, betas"),
    (["stepz=3"], "config: unknown key 'stepz' (from the command line); did you mean 'steps'? Valid keys: preset,"),
    (["checkpoint_every=500"], "config: checkpoint_every=500: must be <= steps=100 (0: only at the end)"),
    (["data.path=/no/such.txt"], "config: data.path=/no/such.txt: no such file; give an existing file"),
    (["steps"], "config: override 'steps' must look like key=value"),
    (["steps=1", "steps=2"], "config: steps is given twice on the command line (1 and 2); give it once"),
    (["model=[1,2"], "config: model=[1,2: not a valid YAML value"),
])
def test_each_bad_value_is_one_line_naming_key_value_and_rule(tmp_path, overrides, message):
    with pytest.raises(ConfigError) as info:
        load_config(TrainLike, {"run_dir": str(tmp_path / "run")}, overrides=overrides)
    text = str(info.value)
    assert text.startswith(message), text
    assert "\n" not in text


def test_file_layers_name_themselves_in_errors(tmp_path):
    bad = _write(tmp_path / "bad.yml", {"steps": -1})
    with pytest.raises(ConfigError, match=rf"^config: steps=-1: must be an int >= 1 \(from {bad}\)$"):
        load_config(TrainLike, bad)
    with pytest.raises(ConfigError, match=r"^config: file '.*/nope.yml' does not exist$"):
        load_config(TrainLike, tmp_path / "nope.yml")
    with pytest.raises(ConfigError, match=r"broken.yml' is not valid YAML at line 3: "):
        load_config(TrainLike, _write(tmp_path / "broken.yml", "steps: 1\nx: [1,\n"))
    with pytest.raises(ConfigError, match=r"must hold a mapping of key: value, got list"):
        load_config(TrainLike, _write(tmp_path / "list.yml", "- 1\n"))
    with pytest.raises(ConfigError, match=r"^config: missing required key 'lr'"):
        C.build(Required, {})


@dataclass(frozen=True)
class Required(Config):
    lr: float = setting(gt=0)


def test_output_folder_is_checked_before_and_created_by_the_helper(tmp_path):
    target = tmp_path / "a" / "b"
    C.check_output_dir(target, "run_dir")
    assert not target.exists()                               # checking creates nothing
    assert C.ensure_output_dir(target, "run_dir") == target and target.is_dir()
    blocker = tmp_path / "file"
    blocker.write_text("x")
    for path, problem in ((blocker / "sub" / "dir", f"'{blocker}' is a file, so no folder can be made under it"),
                          (blocker, "is a file, not a folder")):
        with pytest.raises(ConfigError) as info:
            C.ensure_output_dir(path, "run_dir")
        assert str(info.value).startswith(f"config: run_dir={path}: {problem}")
    # load_config checks output folders (without creating them) and names where the value came from
    with pytest.raises(ConfigError, match=rf"^config: run_dir={blocker}/x: .* \(from the command line\)$"):
        load_config(TrainLike, overrides=[f"run_dir={blocker}/x"])
    if os.geteuid() != 0:                                    # root writes anywhere
        locked = tmp_path / "locked"
        locked.mkdir(mode=0o500)
        with pytest.raises(ConfigError, match="is not writable"):
            C.ensure_output_dir(locked / "sub", "run_dir")
    assert C.ensure_output_dir("gs://bucket/run", "run_dir") == "gs://bucket/run"   # URLs are not checked


def test_memorize_config_and_overrides():
    cfg = load_config(MemorizationConfig, MEMORIZE_YML, overrides=["passes=3", "n_pairs=[8,16]"])
    assert cfg.passes == 3 and cfg.n_pairs == (8, 16) and cfg.poly_coeffs == (0.0, 1.0, 1.0)
    assert load_config(MemorizationConfig, MEMORIZE_YML) == MemorizationConfig()   # the YAML is the defaults
    with pytest.raises(ConfigError, match=r"unknown key 'pases' \(from the command line\); did you mean 'passes'"):
        load_config(MemorizationConfig, None, overrides=["pases=3"])
    # constructed in code, the same checks run (and lists become tuples)
    assert MemorizationConfig(n_pairs=[4, 8]).n_pairs == (4, 8)
    with pytest.raises(ConfigError, match=r"^config: memories=\[lstm\]: each entry must be one of: linear_attention"):
        MemorizationConfig(memories=("lstm",))
    with pytest.raises(ConfigError, match=r"^config: poly_coeffs=\[0.0, 1.0, 1.0\]: needs degree \+ 1 = 4"):
        MemorizationConfig(degree=3)
    assert MemorizationConfig(degree=3, memories=("deltanet",)).degree == 3     # no polynomial memory: fine
    assert set(POLYNOMIAL_MEMORIES) == {name for name, (_, make, _) in MEMORIES.items()
                                        if make(MemorizationConfig()).feature_map.name == "polynomial"}


def test_shipped_configs_are_found(tmp_path, monkeypatch):
    assert (C.config_dir() / "experiments" / "memorize.yml").is_file()
    assert C.config_path("experiments", "memorize.yml").read_text() == MEMORIZE_YML.read_text()
    with pytest.raises(ConfigError, match=r"no shipped config 'experiments/nope.yml'; available in experiments: "
                                          r".*memorize.yml"):
        C.config_path("experiments", "nope.yml")
    monkeypatch.chdir(tmp_path)                              # --config names a shipped file from anywhere
    assert C.resolve_config_file("configs/experiments/memorize.yml").samefile(MEMORIZE_YML)
    assert C.resolve_config_file("experiments/memorize.yml").samefile(MEMORIZE_YML)
    with pytest.raises(ConfigError, match=r"^config: --config /no/such.yml: no such file"):
        C.resolve_config_file("/no/such.yml")


# --- the command line ------------------------------------------------------------------------------


def _blocker(tmp_path) -> Path:
    path = tmp_path / "a_file"
    path.write_text("not a folder")
    return path


CLI_ERRORS = [   # (arguments, what the one line must contain)
    (["--config", "/no/such.yml"], "--config /no/such.yml: no such file"),
    (["n_pairs=-3"], "n_pairs=-3: must be a non-empty list [...], each entry an int >= 1"),
    (["n_pairs=[-3]"], "n_pairs=[-3]: each entry must be an int >= 1"),
    (["n_pairs=[0]"], "n_pairs=[0]: each entry must be an int >= 1"),
    (["trials=abc"], "trials=abc: must be an int >= 1"),
    (["pases=3"], "unknown key 'pases'"),
    (["memories=[lstm]"], "memories=[lstm]: each entry must be one of: linear_attention"),
    (["poly_coeffs=[1,2]"], "poly_coeffs=[1,2]: needs degree + 1 = 3 coefficients"),
    (["out_dir={blocker}/sub"], "out_dir={blocker}/sub: '{blocker}' is a file, so no folder can be made under it"),
    (["out_dir={blocker}"], "out_dir={blocker}: is a file, not a folder"),
    (["out_dir="], "out_dir=: must be a non-empty path"),
    (["passes"], "override 'passes' must look like key=value"),
    (["--passes=3"], "unrecognized arguments: --passes=3 (overrides are key=value, without dashes)"),
]


@pytest.mark.parametrize("args, expected", CLI_ERRORS, ids=[" ".join(a) for a, _ in CLI_ERRORS])
def test_cli_errors_are_one_line_before_any_work(tmp_path, capsys, args, expected):
    blocker = _blocker(tmp_path)
    out_dir = tmp_path / "out"
    args = [a.format(blocker=blocker) for a in args]
    if not any(a.startswith("out_dir=") for a in args):
        args.append(f"out_dir={out_dir}")
    code = cli_main(["memorize", *args])
    captured = capsys.readouterr()
    assert code == 2
    assert captured.err.endswith("\n") and len(captured.err.splitlines()) == 1, captured.err
    assert captured.err.startswith("atlas-jax: error: ") and expected.format(blocker=blocker) in captured.err
    assert captured.out == ""                      # the experiment's first log line never printed
    assert not out_dir.exists() and blocker.read_text() == "not a folder"


def test_cli_memorize_runs_end_to_end(tmp_path, capsys):
    """A tiny real run: the table, results.json and the PNG plot are produced."""
    code = cli_main(["memorize", "n_pairs=[4,20]", "trials=2", "memories=[deltanet,deltanet_poly2]",
                     f"out_dir={tmp_path / 'new' / 'folder'}"])
    assert code == 0
    out = capsys.readouterr().out
    assert "DeltaNet on φ = poly(2)" in out and "recall" in out
    results = json.loads((tmp_path / "new" / "folder" / "results.json").read_text())
    assert results["config"]["n_pairs"] == [4, 20]
    assert (tmp_path / "new" / "folder" / "recall_vs_n.png").read_bytes()[:4] == b"\x89PNG"


def test_cli_print_config_layers_files_and_overrides(tmp_path, capsys):
    mine = _write(tmp_path / "mine.yml", {"trials": 3, "passes": 2})
    assert cli_main(["memorize", "--config", str(mine), "--print-config", "passes=5"]) == 0
    printed = yaml.safe_load(capsys.readouterr().out)
    assert printed["trials"] == 3 and printed["passes"] == 5 and printed["d_k"] == 16
    assert printed["out_dir"] == "results/memorization" and not (tmp_path / "results").exists()


def test_cli_preset_reports_bad_keys_in_one_line(capsys):
    assert cli_main(["preset", "atlas", "widow=3"]) == 2
    err = capsys.readouterr().err
    assert "unknown option(s) ['widow']" in err and len(err.splitlines()) == 1
    assert cli_main(["preset", "nope"]) == 2 and "unknown name 'nope'" in capsys.readouterr().err
    assert cli_main([]) == 2 and "required: COMMAND" in capsys.readouterr().err


# --- a regular (non-editable) install, from another working directory ------------------------------


def test_installed_package_ships_its_configs(installed):
    done = installed.python("-c", "import atlas_jax, atlas_jax.config as c; d = c.config_dir(); "
                            "print(atlas_jax.__file__); print(d); "
                            "print(*sorted(p.relative_to(d).as_posix() for p in d.rglob('*.yml')), sep='\\n')")
    assert done.returncode == 0, done.stderr
    module, folder, *ymls = done.stdout.splitlines()
    assert Path(module).is_relative_to(installed.site) and Path(folder) == installed.site / "atlas_jax" / "configs"
    assert set(ymls) == {p.relative_to(ROOT / "configs").as_posix() for p in (ROOT / "configs").rglob("*.yml")}


def test_installed_memorize_runs_from_another_directory(installed, tmp_path):
    done = installed.run(["atlas-jax", "memorize", "n_pairs=[4]", "trials=1", "memories=[deltanet]"], cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert "DeltaNet" in done.stdout
    assert (tmp_path / "results" / "memorization" / "results.json").is_file()   # the default out_dir, here


def test_presets_size_prints_parameter_counts_near_the_papers(capsys):
    """ATLAS Table 7's sizes: gated_deltanet, titans and atlas within 15% of 340M and 760M."""
    for size, nominal in (("340m", 340e6), ("760m", 760e6)):
        assert cli_main(["presets", "--size", size, "--names", "gated_deltanet,titans,atlas"]) == 0
        lines = [line for line in capsys.readouterr().out.splitlines() if not line.startswith("#")]
        assert [line.split()[0] for line in lines] == ["gated_deltanet", "titans", "atlas"]
        for line in lines:
            params = float(line.split()[1].rstrip("M")) * 1e6
            assert abs(params / nominal - 1) < 0.15, (size, line)
    assert cli_main(["presets", "--size", "2b"]) == 2
    assert "unknown size '2b'" in capsys.readouterr().err
    assert cli_main(["presets", "--size", "tiny", "--names", "lstm"]) == 2
    assert "unknown model(s) ['lstm']" in capsys.readouterr().err
