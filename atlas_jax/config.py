"""Typed configs for every command: frozen dataclasses filled from YAML layers and ``key=value``
overrides, every value checked (type, range, choices, paths) before any work starts.

The shape follows MaxText (a base YAML, model layers, ``key=value`` on the command line) and
Levanter (typed dataclasses, dotted keys into nested sections); the code is our own.

Declaring a config
------------------
A config is a frozen dataclass deriving from :class:`Config`. Its type hints drive the checks;
ranges, choices and path roles sit next to the field in :func:`setting`; a nested section is a
field typed as another dataclass (``optimizer.lr=3e-4`` on the command line)::

    @dataclass(frozen=True)
    class OptimizerConfig(Config):
        lr: float = setting(3e-4, gt=0)
        schedule: Literal["cosine", "constant"] = "cosine"

    @dataclass(frozen=True)
    class TrainConfig(Config):
        preset: str = setting("gated_deltanet", choices=presets.names)   # a callable is read lazily
        steps: int = setting(1000, ge=1)
        run_dir: str = setting("runs/default", output_dir=True)
        optimizer: OptimizerConfig = OptimizerConfig()

Type hints understood: ``int``, ``float``, ``bool``, ``str``, ``pathlib.Path``, ``Literal[...]``,
``X | None``, ``tuple[X, ...]`` and ``tuple[X, Y]`` (YAML lists become tuples), bare ``tuple``,
``typing.Any`` (unchecked), ``dict`` (a free mapping, merged key by key across layers, its entries
unchecked) and a dataclass (a section; a plain dataclass such as a model config
works too, its own ``__post_init__`` ValueErrors are reported as config errors). What each accepts:

* int: ints, and integral floats or numeric strings (``steps=1e5``: PyYAML reads 1e5 as a string);
* float: ints, floats and numeric strings (PyYAML reads ``3e-4`` as a string);
* bool: true/false only; str: strings (an int is taken as its text); Path: a non-empty string,
  ``~`` expanded. On the command line a text field keeps what was typed where YAML would make a
  number or a bool of it (``run_dir=001``, ``mode=on``; ``null`` stays None).
  A ``str`` output folder may be a URL (``gs://...``), whose checks are skipped.

Hints are resolved with ``typing.get_type_hints``, so section classes must be importable names
(defined at module level). Ranges and choices (``ge gt le lt choices nonempty``) apply to each
entry of a tuple. Cross-field
rules go in ``__post_init__`` (call ``super().__post_init__()`` first, which also converts lists to
tuples and numbers to their field's type) and raise ``ConfigError(problem, key=name, value=v)``.
Construction checks types and ranges; the file system is checked only by :func:`load_config` /
:func:`check_paths` and, with creation, by :func:`ensure_output_dir`.

Loading
-------
::

    cfg = load_config(TrainConfig,
                      config_path("base.yml"),                                    # base layer
                      lambda raw: config_path("models", f"{raw['preset']}.yml"),  # picked by a value
                      *user_files,                                                # --config files
                      overrides=["steps=10", "optimizer.lr=1e-3"])                 # the command line
    run_dir = ensure_output_dir(cfg.run_dir, key="run_dir")   # create and probe it, still before work

Order: dataclass defaults < layers, in order < overrides. A layer is a YAML path, a mapping, None
(skipped), a list of those, or a callable that receives the merged raw values of everything else
(defaults, the other layers and the overrides, as nested dicts) and returns a layer. Mappings merge
key by key (sections deeply); any other value replaces. Override values are parsed as YAML
(``n_pairs=[8,16]``, ``poly_coeffs=null``); dotted keys address sections; a key given twice on the
command line is an error. Every problem is a :class:`ConfigError` (a ValueError) whose text is one
line naming the key, the value, what is allowed and where the value came from::

    config: n_pairs=[-3]: each entry must be an int >= 1 (from the command line)
    config: unknown key 'pases' (from the command line); did you mean 'passes'? Valid keys: ...
    config: out_dir=/etc/hosts/x: '/etc/hosts' is a file, so no folder can be made under it; ...

Other helpers: :func:`build` (a config from one mapping), :func:`merge_layers` (the raw merge),
:func:`parse_overrides`, :func:`load_yaml`, :func:`to_dict` / :func:`dump_yaml` (the resolved config,
lists again, for a run folder or ``--print-config``), :func:`resolve_config_file` (a ``--config``
argument).

Shipped configs
---------------
``configs/`` at the repository top is installed as the package ``atlas_jax.configs``
(pyproject ``package-dir``); :func:`config_dir` finds it through ``importlib.resources`` in any
install, editable or not, and falls back to the checkout's ``configs/`` when run from a source tree
whose install predates the mapping. :func:`config_path` names one shipped file.
"""
from __future__ import annotations

import dataclasses
import difflib
import functools
import importlib.resources
import math
import os
import re
import tempfile
import types
import typing
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any, Literal, Union

import yaml

__all__ = ["Config", "ConfigError", "setting", "load_config", "build", "merge_layers", "parse_overrides",
           "load_yaml", "to_dict", "dump_yaml", "check_paths", "check_output_dir", "ensure_output_dir",
           "config_dir", "config_path", "resolve_config_file", "repo_root"]

_UNSET = object()
_META = "atlas_jax.config"
_COMMAND_LINE = "the command line"


# --------------------------------------------------------------------------------------------------
# Errors


def show(value) -> str:
    """A value as a user would write it on the command line (YAML flow style)."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(show(v) for v in value) + "]"
    if isinstance(value, Mapping):
        return "{" + ", ".join(f"{k}: {show(v)}" for k, v in value.items()) + "}"
    if isinstance(value, str):
        return value if value and value.strip() == value else repr(value)
    return str(value)


class ConfigError(ValueError):
    """A configuration problem; ``str(err)`` is one line: ``config: key=value: problem (from source)``."""

    def __init__(self, problem: str, *, key: str | None = None, value=_UNSET, source: str | None = None,
                 raw: str | None = None):
        if key is None and problem.startswith("config: "):    # a message already in the one-line form
            problem = problem[len("config: "):]
        self.problem, self.key, self.value, self.source, self.raw = problem, key, value, source, raw
        super().__init__(problem)

    def __str__(self) -> str:
        text = "config: "
        if self.key is not None:
            if self.raw is not None:
                text += f"{self.key}={self.raw}: "
            elif self.value is not _UNSET:
                text += f"{self.key}={show(self.value)}: "
            else:
                text += f"{self.key}: "
        text += self.problem
        if self.source:
            text += f" (from {self.source})"
        return " ".join(text.split("\n"))

    def located(self, prefix: str, sources: Mapping | None) -> "ConfigError":
        """The same error with ``prefix`` before its key and the source of that key filled in."""
        if self.key is None:
            return self
        key = prefix + self.key
        source, raw = _lookup(sources or {}, key)
        return ConfigError(self.problem, key=key, value=self.value, source=self.source or source,
                           raw=self.raw if self.raw is not None else (raw if key in (sources or {}) else None))


def _lookup(sources: Mapping, key: str):
    """(source, raw text) of a dotted key, or of the nearest section above it that was set."""
    parts = key.split(".")
    for n in range(len(parts), 0, -1):
        hit = sources.get(".".join(parts[:n]))
        if hit is not None:
            return hit
    return None, None


class _Bad(Exception):
    """A value that does not fit; ``problem`` reads after ``key=value:``."""

    def __init__(self, problem: str):
        super().__init__(problem)
        self.problem = problem


# --------------------------------------------------------------------------------------------------
# Declaring configs


@dataclasses.dataclass(frozen=True)
class _Rule:
    ge: float | None = None
    gt: float | None = None
    le: float | None = None
    lt: float | None = None
    choices: Any = None                  # an iterable, or a callable returning one (read lazily)
    nonempty: bool = False               # tuples: at least one entry; strings: not ""
    output_dir: bool = False             # a folder the command writes into (checked by load_config)
    must_exist: str | None = None        # "file", "dir" or "any": an input path (checked by load_config)

    def allowed_choices(self):
        if self.choices is None:
            return None
        return tuple(self.choices() if callable(self.choices) else self.choices)


_NO_RULE = _Rule()


def setting(default=dataclasses.MISSING, *, default_factory=dataclasses.MISSING, ge=None, gt=None, le=None,
            lt=None, choices=None, nonempty: bool = False, output_dir: bool = False, must_exist=None):
    """A dataclass field with its checks: numeric bounds (``ge gt le lt``), ``choices`` (an iterable
    or a callable returning one), ``nonempty`` tuples or strings, ``output_dir`` (a folder the command
    will write into) or ``must_exist`` ("file", "dir" or "any": an input path). List defaults become
    tuples."""
    if must_exist not in (None, "file", "dir", "any"):
        raise TypeError(f"setting: must_exist must be 'file', 'dir' or 'any', got {must_exist!r}")
    if isinstance(default, list):
        default = _tuples(default)
    rule = _Rule(ge, gt, le, lt, choices, nonempty, output_dir, must_exist)
    return dataclasses.field(default=default, default_factory=default_factory, metadata={_META: rule})


def _rule(f: dataclasses.Field) -> _Rule:
    return f.metadata.get(_META, _NO_RULE)


@functools.lru_cache(maxsize=None)
def _hints(cls) -> dict:
    return typing.get_type_hints(cls)


def _fields(cls):
    return [f for f in dataclasses.fields(cls) if f.init]


class Config:
    """Base of typed configs (use with ``@dataclass(frozen=True)``): on construction every field is
    checked against its type hint and :func:`setting` rule, lists become tuples, numbers take their
    field's type, and mappings given for sections become those sections."""

    def __post_init__(self):
        cls = type(self)
        hints = _hints(cls)
        for f in _fields(cls):
            value = getattr(self, f.name)
            new = _check_field(f, hints[f.name], value)
            if new is not value:
                object.__setattr__(self, f.name, new)


def _section(hint):
    """The dataclass a hint names (also through ``X | None``), else None."""
    if isinstance(hint, type) and dataclasses.is_dataclass(hint):
        return hint
    if typing.get_origin(hint) in (Union, types.UnionType):
        inner = [a for a in typing.get_args(hint) if a is not type(None)]
        if len(inner) == 1:
            return _section(inner[0])
    return None


def _check_field(f: dataclasses.Field, hint, value):
    """``value`` checked and normalised for field ``f``; raises ConfigError keyed by the field name."""
    section = _section(hint)
    if section is not None:
        if isinstance(value, section) or (value is None and _accepts_none(hint)):
            return value
        if isinstance(value, Mapping):
            return build(section, value, prefix=f.name + ".")
        raise ConfigError(f"must be a mapping of {f.name}.* keys (a section), e.g. {f.name}.KEY=VALUE",
                          key=f.name, value=value)
    try:
        return _coerce(hint, value, _rule(f))
    except _Bad as bad:
        raise ConfigError(bad.problem, key=f.name, value=value) from None


# --------------------------------------------------------------------------------------------------
# Type and range checks


def _accepts_none(hint) -> bool:
    return hint is Any or (typing.get_origin(hint) in (Union, types.UnionType)
                           and type(None) in typing.get_args(hint))


def _bounds(rule: _Rule) -> str:
    parts = [f"{op} {show(v)}" for op, v in ((">=", rule.ge), (">", rule.gt), ("<=", rule.le), ("<", rule.lt))
             if v is not None]
    return " and ".join(parts)


def _describe(hint, rule: _Rule) -> str:
    """What a value of ``hint`` under ``rule`` may be, as a noun phrase: 'an int >= 1'."""
    choices = rule.allowed_choices()
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (Union, types.UnionType):
        inner = [a for a in args if a is not type(None)]
        text = " or ".join(_describe(a, rule) for a in inner)
        return ("null or " + text) if type(None) in args else text
    if origin is Literal:
        return "one of: " + ", ".join(show(a) for a in args)
    if hint is tuple or origin is tuple:
        if args and args[-1] is Ellipsis:
            return f"a{' non-empty' if rule.nonempty else ''} list [...], each entry {_describe(args[0], rule)}"
        if args:
            return f"a list of {len(args)}: " + ", ".join(_describe(a, rule) for a in args)
        return "a list"
    if choices is not None:
        return "one of: " + ", ".join(show(c) for c in choices)
    bounds = _bounds(rule)
    name = {int: "an int", float: "a number", bool: "true or false", str: "a string", Path: "a path",
            dict: "a mapping of key: value"}.get(origin or hint, getattr(hint, "__name__", str(hint)))
    if hint is str and rule.nonempty:
        name = "a non-empty string"
    return f"{name} {bounds}" if bounds and hint in (int, float) else name


def _coerce(hint, value, rule: _Rule):
    """``value`` as ``hint`` (tuples for lists, numbers converted), or _Bad saying what is allowed."""
    if hint is Any:
        return _tuples(value)
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        inner = [a for a in args if a is not type(None)]
        for option in inner:
            try:
                return _coerce(option, value, rule)
            except _Bad as bad:
                if len(inner) == 1 and bad.problem.startswith("each entry"):
                    raise                       # the list was right, an entry was not: say which rule
        raise _Bad(f"must be {_describe(hint, rule)}")
    if origin is Literal:
        for allowed in args:
            if value == allowed and type(value) is type(allowed):
                return allowed
        raise _Bad(f"must be {_describe(hint, rule)}")
    if hint is tuple or origin is tuple:
        if not isinstance(value, (list, tuple)) or (rule.nonempty and not value):
            raise _Bad(f"must be {_describe(hint, rule)}")
        if not args:
            return _tuples(value)
        if args[-1] is Ellipsis:
            out = []
            for item in value:
                try:
                    out.append(_coerce(args[0], item, rule))
                except _Bad:
                    raise _Bad(f"each entry must be {_describe(args[0], rule)}") from None
            return tuple(out)
        if len(value) != len(args):
            raise _Bad(f"must be {_describe(hint, rule)}")
        try:
            return tuple(_coerce(a, v, rule) for a, v in zip(args, value))
        except _Bad:
            raise _Bad(f"must be {_describe(hint, rule)}") from None
    return _scalar(hint, value, rule)


_NUMBER = re.compile(r"[+-]?(\d+\.?\d*|\.\d+)([eE][+-]?\d+)?")


def _scalar(hint, value, rule: _Rule):
    def bad():
        return _Bad(f"must be {_describe(hint, rule)}")

    if hint is bool:
        if not isinstance(value, bool):
            raise bad()
        out = value
    elif hint is int:
        if isinstance(value, bool):
            raise bad()
        if isinstance(value, str) and _NUMBER.fullmatch(value.strip()):
            value = float(value)
        if isinstance(value, float) and math.isfinite(value) and value == int(value):
            value = int(value)
        if not isinstance(value, int):
            raise bad()
        out = value
    elif hint is float:
        if isinstance(value, bool):
            raise bad()
        if isinstance(value, str) and _NUMBER.fullmatch(value.strip()):
            value = float(value)
        if not isinstance(value, (int, float)) or math.isnan(value):
            raise bad()
        out = float(value)
    elif hint is str:
        if isinstance(value, int) and not isinstance(value, bool):
            value = str(value)
        if not isinstance(value, str) or (rule.nonempty and not value):
            raise bad()
        out = value
    elif hint is Path:
        if isinstance(value, int) and not isinstance(value, bool):
            value = str(value)
        if not isinstance(value, (str, Path)) or not str(value).strip():
            raise _Bad("must be a non-empty path")
        out = Path(value).expanduser()
    elif isinstance(hint, type) or isinstance(typing.get_origin(hint), type):
        if not isinstance(value, typing.get_origin(hint) or hint):
            raise bad()
        out = value
    else:
        raise TypeError(f"atlas_jax.config: unsupported type hint {hint!r}")
    choices = rule.allowed_choices()
    if choices is not None and out not in choices:
        raise bad()
    if hint in (int, float):
        if ((rule.ge is not None and not out >= rule.ge) or (rule.gt is not None and not out > rule.gt)
                or (rule.le is not None and not out <= rule.le) or (rule.lt is not None and not out < rule.lt)):
            raise bad()
    return out


def _tuples(value):
    if isinstance(value, (list, tuple)):
        return tuple(_tuples(v) for v in value)
    return value


# --------------------------------------------------------------------------------------------------
# YAML files, overrides, merging


def load_yaml(path) -> dict:
    """The mapping in a YAML file (an empty file is ``{}``); ConfigError if it is missing or not one."""
    path = Path(path)
    if not path.exists():
        raise ConfigError(f"file {str(path)!r} does not exist")
    if not path.is_file():
        raise ConfigError(f"{str(path)!r} is a folder, not a YAML file")
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark is not None else ""
        raise ConfigError(f"{str(path)!r} is not valid YAML{where}: {getattr(err, 'problem', None) or err}") from None
    except (OSError, UnicodeDecodeError) as err:
        raise ConfigError(f"cannot read {str(path)!r}: {err}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{str(path)!r} must hold a mapping of key: value, got {type(data).__name__}")
    return data


_KEY = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*")


def _parse_items(items) -> list[tuple[str, str, Any]]:
    """(key, raw text, YAML value) of each ``key=value``; ConfigError for malformed or repeated keys."""
    out, seen = [], {}
    for item in items:
        key, sep, raw = str(item).partition("=")
        key = key.strip()
        if not sep or not _KEY.fullmatch(key):
            hint = " (no leading dashes)" if key.startswith("-") else ""
            raise ConfigError(f"override {item!r} must look like key=value{hint}, e.g. passes=3 or optimizer.lr=3e-4")
        if key in seen:
            raise ConfigError(f"{key} is given twice on the command line ({seen[key]} and {raw}); give it once")
        seen[key] = raw
        try:
            value = yaml.safe_load(raw)
        except yaml.YAMLError as err:
            raise ConfigError(f"not a valid YAML value ({getattr(err, 'problem', None) or 'parse error'}); "
                              "quote it or fix the brackets", key=key, raw=raw) from None
        out.append((key, raw, value))
    return out


def parse_overrides(items) -> dict:
    """``["a=1", "b.c=[1,2]"]`` -> ``{"a": 1, "b.c": [1, 2]}`` (values parsed as YAML, keys kept flat)."""
    return {key: value for key, _, value in _parse_items(items)}


def _nest(flat: Mapping) -> dict:
    """Dotted keys into nested mappings: {"a.b": 1} -> {"a": {"b": 1}}."""
    out: dict = {}
    for key, value in flat.items():
        parts = key.split(".")
        node = out
        for i, part in enumerate(parts[:-1]):
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                raise ConfigError(f"{'.'.join(parts[:i + 1])} is set both as a value and as a section on the "
                                  "command line; give one")
            node = child
        if isinstance(node.get(parts[-1]), dict):
            if not isinstance(value, Mapping):
                raise ConfigError(f"{key} is set both as a value and as a section on the command line; give one")
            node[parts[-1]] = _merged(node[parts[-1]], value)
        else:
            node[parts[-1]] = value
    return out


def _merged(dst: Mapping, src: Mapping) -> dict:
    out = dict(dst)
    for key, value in src.items():
        if isinstance(value, Mapping) and isinstance(out.get(key), Mapping):
            out[key] = _merged(out[key], value)
        else:
            out[key] = value
    return out


def _record(sources: dict, value, key: str, source: str, raw: str | None = None) -> None:
    sources[key] = (source, raw)
    if isinstance(value, Mapping):
        for k, v in value.items():
            _record(sources, v, f"{key}.{k}", source)


def _merge_into(dst: dict, src: Mapping, source: str, sources: dict, prefix: str = "") -> None:
    for key, value in src.items():
        if not isinstance(key, str):
            raise ConfigError(f"keys must be strings, got {key!r} (from {source})")
        full = prefix + key
        if isinstance(value, Mapping) and isinstance(dst.get(key), Mapping):
            dst[key] = dict(dst[key])
            _merge_into(dst[key], value, source, sources, full + ".")
        else:
            dst[key] = dict(value) if isinstance(value, Mapping) else value
            _record(sources, value, full, source)


def _defaults(cls) -> dict:
    """The dataclass defaults of ``cls`` as nested dicts (fields without a default are left out)."""
    out = {}
    for f in _fields(cls):
        if f.default is not dataclasses.MISSING:
            value = f.default
        elif f.default_factory is not dataclasses.MISSING:
            value = f.default_factory()
        else:
            continue
        out[f.name] = _defaults_of(value)
    return out


def _defaults_of(value):
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _defaults_of(getattr(value, f.name)) for f in _fields(type(value))}
    return value


def _load_layer(layer, values: dict, sources: dict) -> None:
    if layer is None:
        return
    if isinstance(layer, (list, tuple)):
        for item in layer:
            _load_layer(item, values, sources)
    elif isinstance(layer, Mapping):
        _merge_into(values, layer, "a mapping passed in code", sources)
    elif isinstance(layer, (str, os.PathLike)):
        _merge_into(values, load_yaml(layer), str(layer), sources)
    else:
        raise TypeError(f"atlas_jax.config: a layer is a path, a mapping, None, a list or a callable; got {layer!r}")


def merge_layers(*layers, overrides=(), defaults_of=None, _sources=None) -> dict:
    """The raw nested mapping of ``layers`` (paths, mappings, None, lists, callables) then ``overrides``,
    on top of the dataclass defaults of ``defaults_of`` if given. Callables get the merge of all the
    rest and return a layer that takes their place."""
    sources = {} if _sources is None else _sources
    items = _parse_items(overrides)
    flat = {key: value for key, _, value in items}
    nested = _nest(flat)

    def merged(resolve):
        values: dict = _defaults(defaults_of) if defaults_of is not None else {}
        sources.clear()
        for layer in layers:
            if callable(layer):
                if resolve is None:
                    continue
                layer = layer(resolve)
            _load_layer(layer, values, sources)
        _merge_into(values, nested, _COMMAND_LINE, sources)
        for key, raw, _ in items:
            sources[key] = (_COMMAND_LINE, raw)
        return values

    values = merged(None)
    if any(callable(layer) for layer in layers):
        values = merged(values)
    return values


def build(cls, values: Mapping, *, prefix: str = "", sources: Mapping | None = None):
    """``cls(**values)`` for a dataclass: unknown keys named with the valid ones, sections built from
    nested mappings, every value checked; errors carry the dotted key and its source."""
    if not (isinstance(cls, type) and dataclasses.is_dataclass(cls)):
        raise TypeError(f"atlas_jax.config: {cls!r} is not a dataclass")
    here = prefix.rstrip(".")
    if not isinstance(values, Mapping):
        source, raw = _lookup(sources or {}, here)
        raise ConfigError(f"must be a mapping of {here}.* keys (a section)", key=here, value=values, source=source)
    fields = _fields(cls)
    names = [f.name for f in fields]
    unknown = [k for k in values if k not in names]
    if unknown:
        raise _unknown(unknown, names, prefix, sources or {})
    hints = _hints(cls)
    kwargs = {}
    for f in fields:
        if f.name not in values:
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                raise ConfigError(f"missing required key {prefix + f.name!r}; set it in a config file or "
                                  f"as {prefix + f.name}=VALUE")
            continue
        value = values[f.name]
        raw = (sources or {}).get(prefix + f.name, (None, None))[1]
        if raw is not None:
            value = _as_typed_text(hints[f.name], value, raw)
        section = _section(hints[f.name])
        try:
            if section is not None and isinstance(value, Mapping):
                value = build(section, value, prefix=prefix + f.name + ".", sources=sources)
            elif not issubclass(cls, Config):
                value = _check_field(f, hints[f.name], value)        # a plain dataclass: checked here
        except ConfigError as err:
            raise (err if err.key is None or err.key.startswith(prefix + f.name + ".")
                   else err.located(prefix, sources)) from None
        kwargs[f.name] = value
    try:
        return cls(**kwargs)
    except ConfigError as err:
        raise err.located(prefix, sources) from None
    except ValueError as err:                 # a plain dataclass's own checks
        raise ConfigError(str(err) if not here else f"{here}: {err}") from None


def _textual(hint) -> bool:
    """Whether a field takes text: str, Path, a Literal of strings, or an optional one of these."""
    if hint in (str, Path):
        return True
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is Literal:
        return all(isinstance(a, str) for a in args)
    if origin in (Union, types.UnionType):
        inner = [a for a in args if a is not type(None)]
        return bool(inner) and all(_textual(a) for a in inner)
    return False


def _as_typed_text(hint, value, raw: str):
    """An override of a text field keeps the text as typed where YAML made a number or a bool of it:
    ``run_dir=001`` is '001', ``mode=on`` is 'on' (``null`` stays None)."""
    if isinstance(value, (bool, int, float)) and _textual(hint):
        return raw.strip()
    return value


def _unknown(unknown, names, prefix, sources) -> ConfigError:
    where = {_lookup(sources, prefix + k)[0] for k in unknown} - {None}
    keys = ", ".join(repr(prefix + k) for k in unknown)
    text = f"unknown key{'s' if len(unknown) > 1 else ''} {keys}"
    if where:
        text += f" (from {', '.join(sorted(where))})"
    close = difflib.get_close_matches(str(unknown[0]), names, n=1)
    valid = f"alid keys{' in ' + prefix.rstrip('.') if prefix else ''}: {', '.join(names)}"
    text += f"; did you mean {prefix + close[0]!r}? V{valid}" if close else f"; v{valid}"
    return ConfigError(text)


def load_config(cls, *layers, overrides: Iterable[str] = (), check_files: bool = True):
    """A ``cls`` from its dataclass defaults, then ``layers`` in order, then ``key=value`` overrides,
    every value checked; with ``check_files`` the output folders are checked writable (nothing is
    created) and input paths existing. See the module docstring."""
    sources: dict = {}
    values = merge_layers(*layers, overrides=overrides, defaults_of=cls, _sources=sources)
    cfg = build(cls, values, sources=sources)
    if check_files:
        check_paths(cfg, sources=sources)
    return cfg


# --------------------------------------------------------------------------------------------------
# Paths


def _is_url(path) -> bool:
    return isinstance(path, str) and "://" in path


def check_output_dir(path, key: str = "out_dir") -> None:
    """ConfigError unless ``path`` is, or could be created as, a writable folder. Creates nothing."""
    if _is_url(path):
        return
    try:
        target = Path(path).expanduser().absolute()
    except (TypeError, ValueError):
        raise ConfigError("must be a folder path", key=key, value=path) from None
    if target.exists():
        if not target.is_dir():
            raise ConfigError("is a file, not a folder; choose a folder path", key=key, value=path)
        if not os.access(target, os.W_OK | os.X_OK):
            raise ConfigError("the folder is not writable; choose a writable folder", key=key, value=path)
        return
    parent = target.parent
    while not parent.exists() and parent != parent.parent:
        parent = parent.parent
    if not parent.is_dir():
        raise ConfigError(f"{str(parent)!r} is a file, so no folder can be made under it; choose a path "
                          "outside it", key=key, value=path)
    if not os.access(parent, os.W_OK | os.X_OK):
        raise ConfigError(f"cannot create it: {str(parent)!r} is not writable; choose a writable folder",
                          key=key, value=path)


def ensure_output_dir(path, key: str = "out_dir") -> Path:
    """Creates the output folder ``path`` and checks a file can be written in it, before any work;
    ConfigError (one line naming ``key``) otherwise. Returns the folder as a Path (URLs unchanged)."""
    if _is_url(path):
        return path
    check_output_dir(path, key)
    target = Path(path).expanduser()
    try:
        target.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=target):
            pass
    except OSError as err:
        raise ConfigError(f"cannot write there ({err.strerror or err}); choose a writable folder",
                          key=key, value=path) from None
    return target


def check_paths(cfg, *, sources: Mapping | None = None, prefix: str = "") -> None:
    """Checks every ``output_dir`` (writable or creatable; nothing is created) and ``must_exist`` field
    of ``cfg`` and its sections."""
    for f in _fields(type(cfg)):
        value = getattr(cfg, f.name)
        rule = _rule(f)
        key = prefix + f.name
        try:
            if dataclasses.is_dataclass(value) and not isinstance(value, type):
                check_paths(value, sources=sources, prefix=key + ".")
            elif value is None:
                continue
            elif rule.output_dir:
                check_output_dir(value, f.name)
            elif rule.must_exist and not _is_url(value):
                path = Path(value).expanduser()
                kind = rule.must_exist
                if not path.exists() or (kind == "file" and not path.is_file()) or (kind == "dir" and not path.is_dir()):
                    what = {"file": "file", "dir": "folder", "any": "file or folder"}[kind]
                    raise ConfigError(f"no such {what}; give an existing {what}", key=f.name, value=value)
        except ConfigError as err:
            raise (err.located(prefix, sources) if err.key == f.name else err) from None


def config_dir() -> Path:
    """The shipped ``configs/`` folder: the installed ``atlas_jax.configs`` package, else the checkout's."""
    try:
        root = importlib.resources.files("atlas_jax.configs")
    except ModuleNotFoundError:
        root = None
    if root is not None and isinstance(root, Path) and root.is_dir():
        return root
    checkout = Path(__file__).resolve().parent.parent / "configs"
    if checkout.is_dir():
        return checkout
    raise ConfigError("the shipped configs (atlas_jax.configs) are not installed; reinstall atlas-jax")


def config_path(*parts: str) -> Path:
    """One shipped config, e.g. ``config_path("experiments", "memorize.yml")``; ConfigError naming the
    available files of that folder if it does not exist."""
    path = config_dir().joinpath(*parts)
    if not path.is_file():
        folder = path.parent
        available = sorted(p.name for p in folder.glob("*.yml")) if folder.is_dir() else []
        where = "/".join(parts[:-1]) or "."
        raise ConfigError(f"no shipped config {'/'.join(parts)!r}"
                          + (f"; available in {where}: {', '.join(available)}" if available else ""))
    return path


def resolve_config_file(path, flag: str = "--config") -> Path:
    """A ``--config`` argument: a YAML file as given (relative to the working directory), or, failing
    that, one of the shipped configs (``configs/experiments/memorize.yml`` or ``experiments/memorize.yml``
    work from any directory and from an installed package)."""
    given = Path(path).expanduser()
    if given.is_file():
        return given
    if given.exists():
        raise ConfigError(f"{flag} {path}: is a folder; give a YAML file")
    if not given.is_absolute():
        parts = given.parts[1:] if given.parts and given.parts[0] == "configs" else given.parts
        shipped = config_dir().joinpath(*parts) if parts else None
        if shipped is not None and shipped.is_file():
            return shipped
    raise ConfigError(f"{flag} {path}: no such file; give an existing YAML file (or a shipped one such as "
                      "configs/experiments/memorize.yml)")


def repo_root() -> Path:
    """Deprecated: the folder that holds ``configs/`` (the checkout root, or the installed package's
    folder), so that ``repo_root() / "configs"`` keeps working in every install. Use :func:`config_dir`."""
    return config_dir().parent


# --------------------------------------------------------------------------------------------------
# Writing a resolved config back


def to_dict(cfg) -> dict:
    """A config as plain YAML-ready values (sections as dicts, tuples as lists, paths as strings);
    ``load_config(type(cfg), to_dict(cfg)) == cfg``."""
    def plain(value):
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            return {f.name: plain(getattr(value, f.name)) for f in _fields(type(value))}
        if isinstance(value, (list, tuple)):
            return [plain(v) for v in value]
        if isinstance(value, Mapping):
            return {k: plain(v) for k, v in value.items()}
        if isinstance(value, Path):
            return str(value)
        return value
    return plain(cfg)


def dump_yaml(cfg) -> str:
    """The resolved config as YAML text (keys in field order)."""
    return yaml.safe_dump(to_dict(cfg), sort_keys=False, default_flow_style=None, allow_unicode=True, width=100)
