"""YAML configs with ``key=value`` overrides (MaxText style): a base file, then the command line.

    cfg = load_config(MemorizationConfig, "configs/experiments/memorize.yml", ["passes=3", "d_k=32"])

Values are parsed as YAML (``n_pairs=[8,16,32]``, ``poly_coeffs=null``); lists become tuples so the
frozen dataclasses stay hashable; an unknown key is an error that lists the valid ones.
"""
from __future__ import annotations

import dataclasses
from pathlib import Path

import yaml

__all__ = ["parse_overrides", "load_yaml", "build", "load_config", "repo_root"]


def repo_root() -> Path:
    return Path(__file__).resolve().parent.parent


def load_yaml(path) -> dict:
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"config: file {str(path)!r} does not exist")
    data = yaml.safe_load(path.read_text()) or {}
    if not isinstance(data, dict):
        raise ValueError(f"config: {str(path)!r} must hold a mapping of key: value, got {type(data).__name__}")
    return data


def parse_overrides(items) -> dict:
    out = {}
    for item in items:
        if "=" not in item:
            raise ValueError(f"config override {item!r} must look like key=value")
        key, raw = item.split("=", 1)
        out[key.strip()] = yaml.safe_load(raw)
    return out


def _tuples(value):
    if isinstance(value, list):
        return tuple(_tuples(v) for v in value)
    return value


def build(cls, values: dict):
    """cls(**values) for a dataclass, with unknown keys named in the error."""
    names = [f.name for f in dataclasses.fields(cls)]
    unknown = sorted(set(values) - set(names))
    if unknown:
        raise ValueError(f"config: unknown key(s) {unknown} for {cls.__name__}; valid keys: {names}")
    return cls(**{k: _tuples(v) for k, v in values.items()})


def load_config(cls, path=None, overrides=()):
    values = load_yaml(path) if path is not None else {}
    values.update(parse_overrides(overrides))
    return build(cls, values)
