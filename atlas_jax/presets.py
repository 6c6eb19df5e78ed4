"""Every memory recurrence of the design space as a named preset: one value per axis.

    spec = atlas_jax.presets.get("atlas", window=8, degree=2)      # a MemorySpec
    spec.axes()                                                    # the four axes, readable back
    atlas_jax.presets.table()                                      # the table in the README

Titans, ATLAS and the MIRAS variants take the inner gradient at θ_{t−1} and decay separately
(``decoupled`` retention), as their papers write; the gated linear-attention family forgets first.

DeepTransformer, SWDT and Dot are non-parametric: ``get`` returns a ``ClosedForm`` that runs their
exact kernel-trick form (``atlas_jax.closed_forms``) and whose ``approximation(order)`` is the
parametric MemorySpec (linear memory on the order-p exp-Taylor features) that converges to it.
The attention baselines (transformer, swa) are layers, not memory recurrences, and are not here.
"""
from __future__ import annotations

import inspect
import math
from dataclasses import dataclass, field
from typing import Callable

from atlas_jax import closed_forms
from atlas_jax import objectives as obj
from atlas_jax import optimizers as opt
from atlas_jax import retention as ret
from atlas_jax.features import EluPlusOne, ExpTaylor, Identity, Polynomial
from atlas_jax.memory import GatedMLPMemory, LinearMemory, MLPMemory
from atlas_jax.spec import MemorySpec

__all__ = ["get", "names", "table", "markdown_table", "from_config", "ClosedForm", "PRESETS"]


@dataclass(frozen=True)
class ClosedForm:
    """A non-parametric preset: its exact closed form plus its four axes."""

    name: str
    function: Callable
    axes_: dict
    options: dict = field(default_factory=dict)

    def axes(self) -> dict:
        return dict(self.axes_)

    def __call__(self, q, k, v, **kwargs):
        return self.function(q, k, v, **{**self.options, **kwargs})

    def approximation(self, order: int = 4) -> MemorySpec:
        """The parametric recurrence on exp-Taylor features of ``order`` (exact as order → ∞)."""
        if self.name == "swdt":
            raise ValueError("swdt: a sliding window evicts tokens, which no finite-state recurrence on "
                             "these axes does exactly; use the closed form")
        objective = obj.Dot() if self.name == "deep_transformer" else obj.L2()
        return MemorySpec(memory=LinearMemory(), feature_map=ExpTaylor(order), objective=objective,
                          optimizer=opt.gd(), name=f"{self.name}~exp_taylor({order})")


_RETNET_LOG_DECAY = math.log(1 - 2.0 ** -5)   # RetNet's first head's γ = 1 − 2^−5


def linear_attention(*, feature_map: str = "elu+1", step_size: float = 1.0) -> MemorySpec:
    fmap = EluPlusOne() if feature_map == "elu+1" else Identity()
    return MemorySpec(LinearMemory(), fmap, obj.Dot(), 1, opt.gd(step_size), ret.none(), "linear_attention")


def retnet(*, log_decay: float = _RETNET_LOG_DECAY) -> MemorySpec:
    return MemorySpec(LinearMemory(), Identity(), obj.Dot(), 1, opt.gd(), ret.scalar(log_decay), "retnet")


def lightning_attention(*, log_decay: float = _RETNET_LOG_DECAY) -> MemorySpec:
    return MemorySpec(LinearMemory(), Identity(), obj.Dot(), 1, opt.gd(), ret.scalar(log_decay),
                      "lightning_attention")


def mamba2() -> MemorySpec:
    return MemorySpec(LinearMemory(), Identity(), obj.Dot(), 1, opt.gd(), ret.scalar(), "mamba2")


def gla() -> MemorySpec:
    return MemorySpec(LinearMemory(), Identity(), obj.Dot(), 1, opt.gd(), ret.channel(), "gla")


def polysketch(*, degree: int = 2) -> MemorySpec:
    return MemorySpec(LinearMemory(), Polynomial(degree), obj.Dot(), 1, opt.gd(), ret.none(), "polysketch")


def deltanet() -> MemorySpec:
    return MemorySpec(LinearMemory(), Identity(), obj.L2(), 1, opt.gd(), ret.none(), "deltanet")


def gated_deltanet() -> MemorySpec:
    return MemorySpec(LinearMemory(), Identity(), obj.L2(), 1, opt.gd(), ret.scalar(), "gated_deltanet")


def kda() -> MemorySpec:
    return MemorySpec(LinearMemory(), Identity(), obj.L2(), 1, opt.gd(), ret.channel(), "kda")


def rwkv7() -> MemorySpec:
    return MemorySpec(LinearMemory(), Identity(), obj.L2(), 1, opt.gd(), ret.channel(), "rwkv7")


def longhorn() -> MemorySpec:
    return MemorySpec(LinearMemory(), Identity(), obj.L2(), 1, opt.implicit_gd(), ret.none(), "longhorn")


def deltaproduct(*, num_householder: int = 2) -> MemorySpec:
    return MemorySpec(LinearMemory(), Identity(), obj.L2(), 1, opt.multi_step(opt.gd(), num_householder),
                      ret.scalar(), "deltaproduct")


def mesanet(*, ridge: float = 1.0) -> MemorySpec:
    return MemorySpec(LinearMemory(), Identity(), obj.L2(), 1, opt.least_squares(ridge), ret.none(), "mesanet")


def ttt_linear(*, step_size: float = 1.0) -> MemorySpec:
    return MemorySpec(LinearMemory(), Identity(), obj.L2(), 1, opt.gd(step_size), ret.none(), "ttt_linear")


def ttt_mlp(*, hidden: int | None = None, activation: str = "gelu", step_size: float = 1.0) -> MemorySpec:
    return MemorySpec(MLPMemory(2, hidden, activation=activation), Identity(), obj.L2(), 1, opt.gd(step_size),
                      ret.none(), "ttt_mlp")


def titans(*, depth: int = 2, hidden: int | None = None, step_size: float = 1.0,
           momentum_decay: float = 0.9) -> MemorySpec:
    # Titans eq. 13–14 (MIRAS Table 1): S_t = η_t S_{t−1} − θ_t ∇ℓ, M_t = α_t M_{t−1} + S_t.
    return MemorySpec(MLPMemory(depth, hidden), Identity(), obj.L2(), 1,
                      opt.momentum(step_size, momentum_decay, step_inside=True),
                      ret.scalar(decoupled=True), "titans")


def dla(*, degree: int = 2, hidden: int | None = None) -> MemorySpec:
    return MemorySpec(MLPMemory(2, hidden), Polynomial(degree), obj.Dot(), 1, opt.gd(), ret.scalar(decoupled=True), "dla")


def swla(*, window: int = 4, degree: int = 2) -> MemorySpec:
    return MemorySpec(LinearMemory(), Polynomial(degree), obj.Dot(), window, opt.gd(), ret.scalar(decoupled=True), "swla")


def omeganet(*, window: int = 4, degree: int = 2, hidden: int | None = None) -> MemorySpec:
    return MemorySpec(MLPMemory(2, hidden, residual=True), Polynomial(degree), obj.L2(), window, opt.gd(),
                      ret.scalar(decoupled=True), "omeganet")


def atlas(*, window: int = 4, degree: int = 2, hidden: int | None = None, ns_steps: int = 5,
          step_size: float = 1.0, momentum_decay: float = 0.9, ns_every: str = "token",
          ns_dtype: str = "float32", ns_method: str = "auto") -> MemorySpec:
    return MemorySpec(MLPMemory(2, hidden, residual=True), Polynomial(degree), obj.L2(), window,
                      opt.muon(step_size, momentum_decay, ns_steps, ns_every=ns_every, ns_dtype=ns_dtype,
                               ns_method=ns_method),
                      ret.scalar(decoupled=True), "atlas")


def atlas_pp(*, window: int = 4, degree: int = 2, hidden: int | None = None, ns_steps: int = 5,
             step_size: float = 1.0, momentum_decay: float = 0.9, ns_every: str = "token",
             ns_dtype: str = "float32", ns_method: str = "auto") -> MemorySpec:
    return MemorySpec(GatedMLPMemory(hidden), Polynomial(degree), obj.L2(), window,
                      opt.muon(step_size, momentum_decay, ns_steps, ns_every=ns_every, ns_dtype=ns_dtype,
                               ns_method=ns_method),
                      ret.scalar(decoupled=True), "atlas_pp")


def moneta(*, p: float = 3.0, q: float = 4.0, hidden: int | None = None, map_at: str = "chunk_end") -> MemorySpec:
    # MIRAS §5: A_t = α_t A_{t−1} − η_t ∇ℓ_p, W_t = A_t / ‖A_t‖_q^{q−2}; the block x + LN(W1 σ(W2 x)).
    return MemorySpec(MLPMemory(2, hidden, residual=True, layernorm=True), Identity(), obj.Lp(p), 1, opt.gd(),
                      ret.lq(q, map_at=map_at), "moneta")


def yaad(*, delta: float = 1.0, hidden: int | None = None) -> MemorySpec:
    return MemorySpec(MLPMemory(2, hidden, residual=True, layernorm=True), Identity(),
                      obj.Huber("mixture", delta), 1, opt.gd(), ret.scalar(decoupled=True), "yaad")


def memora(*, scale: float = 1.0, hidden: int | None = None, map_at: str = "chunk_end") -> MemorySpec:
    # MIRAS §5: W_t = Softmax(α_t log W_{t−1} − η_t ∇ℓ_2), with Moneta's block x + LN(W1 σ(W2 x)).
    return MemorySpec(MLPMemory(2, hidden, residual=True, layernorm=True), Identity(), obj.L2(), 1, opt.gd(),
                      ret.kl(scale, map_at=map_at), "memora")


def deep_transformer(*, normalize: bool = False) -> ClosedForm:
    return ClosedForm("deep_transformer", closed_forms.deep_transformer,
                      {"memory": "non-parametric (linear on φ*)", "feature_map": "exp", "objective": "dot",
                       "window": "T", "optimizer": "— (closed form)", "retention": "—"},
                      {"normalize": normalize})


def swdt(*, window: int = 64, normalize: bool = False) -> ClosedForm:
    return ClosedForm("swdt", closed_forms.swdt,
                      {"memory": "non-parametric (linear on φ*)", "feature_map": "exp", "objective": "dot",
                       "window": f"c={window}", "optimizer": "— (closed form)", "retention": "—"},
                      {"window": window, "normalize": normalize})


def dot() -> ClosedForm:
    return ClosedForm("dot", closed_forms.dot,
                      {"memory": "non-parametric (linear on φ*)", "feature_map": "exp", "objective": "l2 (delta)",
                       "window": "T", "optimizer": "— (closed form)", "retention": "—"})


PRESETS = {f.__name__: f for f in (
    linear_attention, retnet, lightning_attention, mamba2, gla, polysketch, deltanet, gated_deltanet, kda,
    rwkv7, longhorn, deltaproduct, mesanet, ttt_linear, ttt_mlp, titans, dla, swla, omeganet, atlas, atlas_pp,
    moneta, yaad, memora, deep_transformer, swdt, dot)}


def names() -> list[str]:
    return list(PRESETS)


def get(name: str, **options):
    """The preset ``name`` with keyword ``options`` (each preset's keywords are its knobs)."""
    if name not in PRESETS:
        raise ValueError(f"preset: unknown name {name!r}; choose one of {names()}")
    factory = PRESETS[name]
    allowed = list(inspect.signature(factory).parameters)
    unknown = sorted(set(options) - set(allowed))
    if unknown:
        raise ValueError(f"preset {name!r}: unknown option(s) {unknown}; it takes {allowed or 'no options'}")
    return factory(**options)


_COLUMNS = ("memory", "feature_map", "objective", "window", "optimizer", "retention")


def table() -> list[dict]:
    """One row per preset with its axes, read back from the constructed object."""
    return [{"preset": name, **{c: str(get(name).axes()[c]) for c in _COLUMNS}} for name in names()]


def markdown_table() -> str:
    header = ("preset", "memory", "φ", "objective", "window", "optimizer", "retention")
    lines = ["| " + " | ".join(header) + " |", "| " + " | ".join("---" for _ in header) + " |"]
    for row in table():
        lines.append("| " + " | ".join([row["preset"]] + [row[c] for c in _COLUMNS]) + " |")
    return "\n".join(lines)


def from_config(path, overrides=()):
    """The preset named in a model config YAML (``configs/models/<preset>.yml``) with its options,
    then ``key=value`` overrides of those options."""
    from atlas_jax.config import load_yaml, parse_overrides

    data = load_yaml(path)
    # ``model`` holds the language-model layer's settings (atlas_jax.models reads it); the
    # recurrence needs only the preset and its options.
    unknown = sorted(set(data) - {"preset", "options", "model"})
    if unknown or "preset" not in data:
        raise ValueError(f"model config {str(path)!r}: expected keys 'preset', 'options' and optionally "
                         f"'model', got {sorted(data)}")
    options = dict(data.get("options") or {})
    options.update(parse_overrides(overrides))
    return get(data["preset"], **options)
