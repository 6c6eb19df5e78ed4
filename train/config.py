"""Training configuration: frozen dataclasses, one per concern, declared and loaded with
:mod:`atlas_jax.config` like every other command's config.

Layers, later wins (MaxText style): the dataclass defaults, `configs/base.yml` (every default,
commented), any `--config FILE` (repeatable; a shipped one such as `configs/experiments/...` works
from any directory), then `key=value` overrides on the command line, dotted for sections
(`optim.learning_rate=1e-3`, `mesh.data=2`, `model.preset_options.ns_every=4`). The model's own
layers (`configs/models/<preset>.yml`, `configs/sizes/<size>.yml`) are read by
`atlas_jax.models.build`; the `model:` section here is a free mapping of overrides passed to it
(merged key by key across layers; its keys are checked by `models.build`).

Every error is an `atlas_jax.config.ConfigError` (a ValueError) whose one line names the key, the
value, what it accepts and where the value came from.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from atlas_jax.models.config import REMAT_POLICIES

from atlas_jax.config import (Config, ConfigError, build, config_dir, config_path, load_config, resolve_config_file,
                              setting)
from atlas_jax.config import to_dict as _to_dict

__all__ = ["ConfigError", "TrainConfig", "DataConfig", "OptimConfig", "MeshConfig",
           "CheckpointConfig", "DistributedConfig", "load_train_config", "config_from_dict"]


def _preset_names():
    from atlas_jax import models
    return models.names()


def _size_names():
    return sorted(p.stem for p in (config_dir() / "sizes").glob("*.yml"))


@dataclass(frozen=True)
class DataConfig(Config):
    source: str = setting("builtin", nonempty=True)   # 'builtin' or a path (file, directory or glob)
    format: Literal["auto", "text", "jsonl", "parquet", "npy"] = "auto"
    text_field: str = "text"             # jsonl / parquet column holding the document
    text_separator: str = setting("\n\n\n", nonempty=True)    # splits a .txt file into documents
    tokenizer: Literal["byte", "bpe"] = "bpe"
    vocab_size: int = setting(1024, ge=260)     # BPE vocabulary (incl. specials); ignored for byte/npy
    npy_vocab_size: int = setting(0, ge=0)      # vocabulary of pre-tokenised .npy data (required then)
    npy_eos_id: int = setting(-1, ge=-1)        # document separator id in a .npy token stream (-1: none)
    eval_fraction: float = setting(0.05, gt=0, lt=0.5)    # share of documents held out
    eval_batches: int = setting(4, ge=1)        # held-out batches per evaluation
    max_documents: int = setting(0, ge=0)       # 0: all


@dataclass(frozen=True)
class OptimConfig(Config):
    learning_rate: float = setting(3e-3, gt=0)  # peak, reached after warmup_steps
    warmup_steps: int = setting(50, ge=0)
    min_lr_ratio: float = setting(0.1, ge=0, le=1)    # cosine decays to learning_rate * min_lr_ratio at `steps`
    weight_decay: float = setting(0.1, ge=0)    # AdamW, on matrices only (not norms, biases, gates)
    b1: float = setting(0.9, ge=0, le=1)
    b2: float = setting(0.95, ge=0, le=1)
    eps: float = setting(1e-8, ge=0)
    grad_clip: float = setting(1.0, ge=0)       # global-norm clipping; 0 turns it off
    grad_accum: int = setting(1, ge=1)          # micro-batches per step (batch_size must divide)


@dataclass(frozen=True)
class MeshConfig(Config):
    data: int = setting(-1, ge=-1)              # -1: every device the other axes leave
    fsdp: int = setting(1, ge=-1)
    tensor: int = setting(1, ge=-1)

    def __post_init__(self):
        super().__post_init__()
        axes = ("data", "fsdp", "tensor")
        for key in axes:
            if getattr(self, key) == 0:
                raise ConfigError("must be an int >= 1, or -1 for every device the other axes leave",
                                  key=key, value=0)
        rest = [key for key in axes if getattr(self, key) == -1]
        if len(rest) > 1:
            raise ConfigError(f"at most one of data, fsdp, tensor may be -1 (here {', '.join(rest)})",
                              key=rest[-1], value=-1)


@dataclass(frozen=True)
class CheckpointConfig(Config):
    keep: int = setting(3, ge=1)                # newest checkpoints kept
    async_save: bool = True                     # write in the background; waited for before exit


@dataclass(frozen=True)
class DistributedConfig(Config):
    # Multi-host: every process runs the same command with its own process_id. Empty values
    # let jax.distributed.initialize detect them (SLURM, TPU pods, ...); `enabled: false` skips it.
    enabled: bool = False
    coordinator_address: str = ""
    num_processes: int = setting(0, ge=0)
    process_id: int = setting(-1, ge=-1)
    cpu_collectives: Literal["gloo", "mpi"] = "gloo"    # for multi-process runs on CPU


@dataclass(frozen=True)
class TrainConfig(Config):
    preset: str = setting("atlas", choices=_preset_names)
    size: str = setting("tiny", choices=_size_names)
    steps: int = setting(500, ge=1)
    batch_size: int = setting(16, ge=1)         # global, in sequences
    seq_len: int = setting(256, ge=2)
    seed: int = setting(0, ge=0)
    run_dir: str = setting("runs/atlas-tiny", nonempty=True, output_dir=True)
    checkpoint_every: int = setting(100, ge=0)  # 0: only at the end (and on SIGTERM)
    log_every: int = setting(10, ge=1)
    eval_every: int = setting(100, ge=0)        # 0: only at the end
    compute_dtype: Literal["bfloat16", "float32"] = "bfloat16"    # float32 master weights either way
    remat: Literal[REMAT_POLICIES] = "none"    # rematerialisation of the forward (models.config owns the names)
    on_nonfinite: Literal["skip", "stop"] = "skip"
    progress: bool = True                       # tqdm bar on process 0
    tensorboard: bool = True
    model: dict | None = field(default_factory=dict)    # overrides for atlas_jax.models.build (null: none)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    mesh: MeshConfig = field(default_factory=MeshConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    distributed: DistributedConfig = field(default_factory=DistributedConfig)

    def __post_init__(self):
        super().__post_init__()
        if self.model is None:
            object.__setattr__(self, "model", {})
        if self.batch_size % self.optim.grad_accum:
            raise ConfigError(f"must divide batch_size={self.batch_size}", key="optim.grad_accum",
                              value=self.optim.grad_accum)

    def to_dict(self) -> dict:
        return _to_dict(self)


def _typed_escapes(item: str) -> str:
    """``data.text_separator=\\n\\n`` means two newlines (plain YAML would keep the backslashes)."""
    key, _, raw = str(item).partition("=")
    if key.strip() != "data.text_separator" or "\\" not in raw or raw.strip()[:1] in ("'", '"'):
        return item
    return key + '="' + raw.replace('"', '\\"') + '"'


def load_train_config(config_file=None, overrides=(), base=None) -> TrainConfig:
    """The training config of `base` (default: the shipped `configs/base.yml`), the `config_file`
    layer(s) in order and the `key=value` overrides; every value and `run_dir` checked. A key given
    more than once in `overrides` takes its last value (callers compose lists: theirs, then the
    user's); the `atlas-jax train` command line itself rejects a repeated key, as every command does."""
    files = config_file if isinstance(config_file, (list, tuple)) else [config_file]
    layers = [resolve_config_file(path) for path in files if path is not None]
    last = {str(item).partition("=")[0].strip(): _typed_escapes(item) for item in overrides}
    return load_config(TrainConfig, base or config_path("base.yml"), *layers, overrides=list(last.values()))


def config_from_dict(values: dict) -> TrainConfig:
    """A TrainConfig from one mapping (a run's saved config.yml), every value checked."""
    return build(TrainConfig, values)
