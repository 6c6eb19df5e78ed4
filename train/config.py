"""Training configuration: frozen dataclasses, one per concern, validated on construction.

Layers, later wins (MaxText style): `configs/base.yml` (every default, commented), an optional
`--config FILE`, then `key=value` overrides on the command line (`optim.learning_rate=1e-3`). The
model's own layers (`configs/models/<preset>.yml`, `configs/sizes/<size>.yml`) are read by
`atlas_jax.models.build`; the `model:` section here passes overrides to it.

Every error is a `ConfigError` (a ValueError) whose one line names the key and what it accepts.
"""
from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from atlas_jax.config import ConfigError as _ProjectConfigError

__all__ = ["ConfigError", "TrainConfig", "DataConfig", "OptimConfig", "MeshConfig",
           "CheckpointConfig", "DistributedConfig", "load_train_config", "base_config_path"]


class ConfigError(_ProjectConfigError):
    """A bad configuration value; the message (one line) names the key. A subclass of the project's
    ConfigError, so `atlas-jax`'s shared error handling prints it as one line with exit code 2."""

    def __init__(self, message: str):
        super().__init__(message)

    def __str__(self) -> str:
        return self.problem


def _configs_dir() -> Path:
    try:    # the shipped configs, in any install (atlas_jax.configs)
        from atlas_jax.config import config_dir
        return Path(config_dir())
    except (ImportError, OSError, ValueError):
        return Path(__file__).resolve().parent.parent / "configs"


def base_config_path() -> Path:
    return _configs_dir() / "base.yml"


def _fail(key: str, message: str):
    raise ConfigError(f"config: {key}: {message}")


def _check_int(key, value, low=None):
    if low is not None and value < low:
        _fail(key, f"must be an integer >= {low}, got {value}")


def _check_choice(key, value, choices):
    if value not in choices:
        _fail(key, f"{value!r} is not one of {list(choices)}")


@dataclass(frozen=True)
class DataConfig:
    source: str = "builtin"             # 'builtin' or a path (file, directory or glob)
    format: str = "auto"                 # auto | text | jsonl | parquet | npy
    text_field: str = "text"             # jsonl / parquet column holding the document
    text_separator: str = "\n\n\n"       # splits a .txt file into documents
    tokenizer: str = "bpe"               # byte | bpe
    vocab_size: int = 1024               # BPE vocabulary (incl. specials); ignored for byte/npy
    npy_vocab_size: int = 0              # vocabulary of pre-tokenised .npy data (required then)
    npy_eos_id: int = -1                 # document separator id in a .npy token stream (-1: none)
    eval_fraction: float = 0.05          # share of documents held out
    eval_batches: int = 4                # held-out batches per evaluation
    max_documents: int = 0               # 0: all

    def __post_init__(self):
        _check_choice("data.format", self.format, ("auto", "text", "jsonl", "parquet", "npy"))
        _check_choice("data.tokenizer", self.tokenizer, ("byte", "bpe"))
        _check_int("data.vocab_size", self.vocab_size, 260)
        _check_int("data.npy_vocab_size", self.npy_vocab_size, 0)
        _check_int("data.npy_eos_id", self.npy_eos_id, -1)
        _check_int("data.eval_batches", self.eval_batches, 1)
        _check_int("data.max_documents", self.max_documents, 0)
        if not 0.0 < self.eval_fraction < 0.5:
            _fail("data.eval_fraction", f"must be in (0, 0.5), got {self.eval_fraction}")
        if not self.text_separator:
            _fail("data.text_separator", "must not be empty")


@dataclass(frozen=True)
class OptimConfig:
    learning_rate: float = 3e-3          # peak, reached after warmup_steps
    warmup_steps: int = 50
    min_lr_ratio: float = 0.1            # cosine decays to learning_rate * min_lr_ratio at `steps`
    weight_decay: float = 0.1            # AdamW, on matrices only (not norms, biases, gates)
    b1: float = 0.9
    b2: float = 0.95
    eps: float = 1e-8
    grad_clip: float = 1.0               # global-norm clipping; 0 turns it off
    grad_accum: int = 1                  # micro-batches per step (batch_size must divide)

    def __post_init__(self):
        if not self.learning_rate > 0:
            _fail("optim.learning_rate", f"must be > 0, got {self.learning_rate}")
        _check_int("optim.warmup_steps", self.warmup_steps, 0)
        _check_int("optim.grad_accum", self.grad_accum, 1)
        for key in ("min_lr_ratio", "b1", "b2"):
            if not 0.0 <= getattr(self, key) <= 1.0:
                _fail(f"optim.{key}", f"must be in [0, 1], got {getattr(self, key)}")
        for key in ("weight_decay", "grad_clip", "eps"):
            if getattr(self, key) < 0:
                _fail(f"optim.{key}", f"must be >= 0, got {getattr(self, key)}")


@dataclass(frozen=True)
class MeshConfig:
    data: int = -1                       # -1: every device the other axes leave
    fsdp: int = 1
    tensor: int = 1

    def __post_init__(self):
        for key in ("data", "fsdp", "tensor"):
            value = getattr(self, key)
            if value == 0 or value < -1:
                _fail(f"mesh.{key}", f"must be a positive integer or -1 (the rest), got {value}")
        if [self.data, self.fsdp, self.tensor].count(-1) > 1:
            _fail("mesh", "at most one of data, fsdp, tensor may be -1")


@dataclass(frozen=True)
class CheckpointConfig:
    keep: int = 3                        # newest checkpoints kept
    async_save: bool = True              # write in the background; waited for before exit

    def __post_init__(self):
        _check_int("checkpoint.keep", self.keep, 1)


@dataclass(frozen=True)
class DistributedConfig:
    # Multi-host: every process runs the same command with its own process_id. Empty values
    # let jax.distributed.initialize detect them (SLURM, TPU pods, ...); `enabled: false` skips it.
    enabled: bool = False
    coordinator_address: str = ""
    num_processes: int = 0
    process_id: int = -1
    cpu_collectives: str = "gloo"        # for multi-process runs on CPU

    def __post_init__(self):
        _check_int("distributed.num_processes", self.num_processes, 0)
        _check_int("distributed.process_id", self.process_id, -1)
        _check_choice("distributed.cpu_collectives", self.cpu_collectives, ("gloo", "mpi"))


@dataclass(frozen=True)
class TrainConfig:
    preset: str = "atlas"
    size: str = "tiny"
    steps: int = 500
    batch_size: int = 16                 # global, in sequences
    seq_len: int = 256
    seed: int = 0
    run_dir: str = "runs/atlas-tiny"
    checkpoint_every: int = 100          # 0: only at the end (and on SIGTERM)
    log_every: int = 10
    eval_every: int = 100                # 0: only at the end
    compute_dtype: str = "bfloat16"      # float32 master weights either way
    remat: str = "none"                  # none | full | dots (rematerialisation of the forward)
    on_nonfinite: str = "skip"           # skip | stop
    progress: bool = True                # tqdm bar on process 0
    tensorboard: bool = True
    model: dict = field(default_factory=dict)    # overrides for atlas_jax.models.build
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    mesh: MeshConfig = field(default_factory=MeshConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    distributed: DistributedConfig = field(default_factory=DistributedConfig)

    def __post_init__(self):
        _check_int("steps", self.steps, 1)
        _check_int("batch_size", self.batch_size, 1)
        _check_int("seq_len", self.seq_len, 2)
        _check_int("seed", self.seed, 0)
        _check_int("checkpoint_every", self.checkpoint_every, 0)
        _check_int("log_every", self.log_every, 1)
        _check_int("eval_every", self.eval_every, 0)
        _check_choice("compute_dtype", self.compute_dtype, ("bfloat16", "float32"))
        _check_choice("remat", self.remat, ("none", "full", "dots"))
        _check_choice("on_nonfinite", self.on_nonfinite, ("skip", "stop"))
        if not self.run_dir:
            _fail("run_dir", "must name a directory")
        if self.batch_size % self.optim.grad_accum:
            _fail("optim.grad_accum", f"{self.optim.grad_accum} must divide batch_size={self.batch_size}")
        _check_preset(self.preset, self.size)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def _check_preset(preset: str, size: str):
    try:
        from atlas_jax import models
    except ImportError:    # the models package is not installed: build() will say so
        return
    names = list(models.names()) if hasattr(models, "names") else None
    if names is not None and preset not in names:
        _fail("preset", f"{preset!r} is not one of {sorted(names)}")
    sizes_dir = _configs_dir() / "sizes"
    sizes = sorted(p.stem for p in sizes_dir.glob("*.yml"))
    if sizes and size not in sizes:
        _fail("size", f"{size!r} is not one of {sizes}")


# --- loading: YAML layers + dotted key=value overrides, typed -----------------------------------

def _type_name(tp) -> str:
    return getattr(tp, "__name__", str(tp))


def _coerce(key: str, tp, value):
    """value as type tp (YAML already typed it); ints pass for floats, nothing else converts."""
    if tp is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if tp is float and isinstance(value, str):
        try:    # PyYAML reads 3e-4 (no dot) as a string
            return float(value)
        except ValueError:
            pass
    if tp is dict:
        if value is None:
            return {}
        if not isinstance(value, dict):
            _fail(key, f"must be a mapping of key: value, got {value!r}")
        return value
    if tp is str and isinstance(value, (int, float)) and not isinstance(value, bool):
        return str(value)
    if tp in (int, float, bool, str) and (type(value) is not tp):
        _fail(key, f"must be {_type_name(tp)}, got {value!r} ({type(value).__name__})")
    return value


def _build(cls, values: dict, prefix: str = ""):
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    if not isinstance(values, dict):
        _fail(prefix.rstrip(".") or "config", f"must be a mapping, got {values!r}")
    unknown = sorted(set(values) - set(names))
    if unknown:
        where = f"section {prefix.rstrip('.')!r}" if prefix else "the top level"
        _fail(prefix + unknown[0], f"unknown key at {where}; valid keys: {names}")
    kwargs = {}
    for name, value in values.items():
        tp = hints[name]
        if dataclasses.is_dataclass(tp):
            kwargs[name] = _build(tp, value or {}, prefix + name + ".")
        else:
            kwargs[name] = _coerce(prefix + name, tp, value)
    return cls(**kwargs)


def _merge(base: dict, update: dict) -> dict:
    out = dict(base)
    for key, value in update.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _merge(out[key], value)
        else:
            out[key] = value
    return out


def _read_yaml(path) -> dict:
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config: file {str(path)!r} does not exist")
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as err:
        raise ConfigError(f"config: {path} is not valid YAML: {str(err).splitlines()[0]}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"config: {path} must hold a mapping of key: value")
    return data


def parse_override(item: str) -> dict:
    """'optim.learning_rate=1e-3' -> {'optim': {'learning_rate': 0.001}} (value parsed as YAML)."""
    if "=" not in item:
        raise ConfigError(f"config: override {item!r} must look like key=value (e.g. steps=100)")
    key, raw = item.split("=", 1)
    key = key.strip()
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError:
        value = raw
    if key == "data.text_separator" or (key.endswith("run_dir") or key == "data.source"):
        value = raw    # paths and separators stay strings ('001' is not 1)
    if key == "data.text_separator":
        value = raw.encode().decode("unicode_escape")    # so '\n\n' can be typed
    out: dict = {}
    node = out
    parts = key.split(".")
    for part in parts[:-1]:
        node = node.setdefault(part, {})
    node[parts[-1]] = value
    return out


def load_train_config(config_file=None, overrides=(), base=None) -> TrainConfig:
    values = _read_yaml(base or base_config_path())
    files = config_file if isinstance(config_file, (list, tuple)) else [config_file]
    for path in files:    # several --config files layer in order, later wins
        if path is not None:
            values = _merge(values, _read_yaml(path))
    for item in overrides:
        values = _merge(values, parse_override(item))
    return _build(TrainConfig, values)


def config_from_dict(values: dict) -> TrainConfig:
    return _build(TrainConfig, values)
