"""MemorySpec: one point of the four-axis design space, runnable in the recurrent or chunked form.

    spec = MemorySpec(memory=MLPMemory(residual=True), feature_map=Polynomial(2), objective=L2(),
                      window=4, optimizer=muon(ns_steps=5), retention=scalar(), impl="chunk", chunk_size=16)
    o, state = spec(q, k, v, beta=beta, g=g, gamma=gamma, initial_state=state0, output_final_state=True)

``impl`` (a field, overridable per call) picks the form, with the words of ``atlas_jax.ops``:
  "recurrent"  the lax.scan recurrence: exact for every point of the space (the ground truth);
  "chunk"      the chunked form: exact (WY) for the delta / linear-attention family and for the
               Omega rule on a linear memory (ℓ2 / dot, GD, decoupled scalar decay, any window:
               ``ops.omega_linear_chunk`` for ℓ2; swla's dot needs no solve), the papers' chunk-start-gradient scheme for
               everything else (equal to "recurrent" at chunk 1);
  "pallas"     the Pallas kernels (interpret mode on CPU): the delta family's, and the exact Omega rule's
               on a linear memory (ℓ2 and swla's dot, through ``ops.omega_linear``); ``has_kernel``;
  "auto"       "pallas" on GPU/TPU where a kernel covers the call (the delta family; the Omega rule up to
               d_φ = ``forms.chunked.OMEGA_AUTO_MAX_DIM``; a depth-2 MLP memory's sequential pass for
               bf16 inputs on a GPU, ``forms.chunked.deep_kernel_route``), else "chunk".

Layout [B, T, H, D] as in flash-linear-attention. Per-token knobs, all [B, T, H] unless noted:
  beta   β_t step size (default: the optimizer's own); [B, T, H, n] with n inner steps per token;
         channel-wise [B, T, H, d] (MIRAS "Channel-wise Parameters")
  g      log retention g_t, α_t = exp(g_t); [B, T, H, d] for channel retention
  nu     ν_t momentum decay (default: the optimizer's own); channel-wise [B, T, H, d]
  gamma  γ_t Omega-window gate of token t (default 1); or [B, T, H, c], γ_i^{(t)}: step t's weight
         of each of its c window positions, oldest first (ATLAS §3: γ_i^{(t)} may depend on both)
  delta  the objective's per-token knob (Huber δ_t, robust radius Δ_t; default: the objective's own);
         or per output channel [B, T, H, V]
The channels d of β, ν and α are the memory's channel axis (``memory.channel_axes``): the input
features d_φ of a linear memory (KDA's key channels), and for a depth-2 MLP with d_φ = V the d
channels it reads and writes (row j of W0 and column j of W1 belong to channel j). With a
channel-wise β the linear family's chunked form is the chunk-start form (β ∈ ℝ^d per token is
outside the exact WY family); at chunk size 1 it equals the recurrence.
With ``steps`` inner steps per token (``optimizers.multi_step``), k and v may carry one pair per
step: k [B, T, H, n, K], v [B, T, H, n, V] (DeltaProduct); otherwise each step reuses the token's pair.
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass, field, replace
from functools import cached_property, partial
from typing import Any

import jax
import jax.numpy as jnp
import optax

from atlas_jax import optimizers as inner_opt
from atlas_jax.features import FeatureMap, Identity
from atlas_jax.kernels.delta_family.support import check_chunk_size
from atlas_jax.forms.chunked import (chunked_sequence, deep_kernel_covers, deep_kernel_route, exact_chunked,
                                    is_exact, is_omega_exact, omega_chunked, omega_impl)
from atlas_jax.forms.dual import dual_batched_kernel
from atlas_jax.forms.common import Features, MemoryState, Steps, WindowCache
from atlas_jax.forms.recurrent import recurrent_sequence
from atlas_jax.memory import LinearMemory, MemoryArch
from atlas_jax.objectives import L2, Objective
from atlas_jax.retention import Retention, none

__all__ = ["MemorySpec", "MemoryState", "WindowCache", "IMPLS"]

IMPLS = ("recurrent", "chunk", "pallas", "auto")   # the same words as atlas_jax.ops.IMPLS
_FORM_ALIASES = {"recurrent": "recurrent", "chunked": "chunk"}   # the 0.1.0 ``form=`` argument


@dataclass(frozen=True)
class MemorySpec:
    """A memory layer's recurrence: one value on each of the four axes (plus φ and the window)."""

    memory: MemoryArch = field(default_factory=LinearMemory)
    feature_map: FeatureMap = field(default_factory=Identity)
    objective: Objective = field(default_factory=L2)
    window: int = 1
    optimizer: Any = field(default_factory=inner_opt.gd)
    retention: Retention = field(default_factory=none)
    name: str = "custom"
    impl: str = "recurrent"   # the exact recurrence by default, as in 0.1.0; models pick "auto"
    chunk_size: int = 64

    def __post_init__(self):
        checks = [("memory", self.memory, MemoryArch), ("feature_map", self.feature_map, FeatureMap),
                  ("objective", self.objective, Objective), ("retention", self.retention, Retention)]
        for arg, value, kind in checks:
            if not isinstance(value, kind):
                raise TypeError(f"MemorySpec: {arg} must be a {kind.__name__}, got {type(value).__name__}")
        if not isinstance(self.optimizer, optax.GradientTransformation):
            raise TypeError("MemorySpec: optimizer must be an optax GradientTransformation "
                            f"(e.g. atlas_jax.optimizers.gd() or optax.adam(1e-2)), got {type(self.optimizer).__name__}")
        if not isinstance(self.window, int) or isinstance(self.window, bool) or self.window < 1:
            raise ValueError(f"MemorySpec: window must be an int >= 1 (1 = the current token only), got {self.window!r}")
        if self.retention.decay == "channel":
            probe = jax.eval_shape(lambda: self.memory.init(jax.random.PRNGKey(0), 4, 4))
            if self.memory.channel_axes(probe) is None:
                raise ValueError(f"MemorySpec: channel retention decays each channel of θ, and a "
                                 f"{self.memory.describe()} memory has no single channel axis (a linear "
                                 "memory or a depth-2 MLP has one) — use retention scalar()")
        if self.steps > 1 and self.window > 1:
            raise ValueError("MemorySpec: several inner steps per token and an Omega window > 1 cannot be "
                             "combined; pick one")
        if self.opt_kind == "least_squares" and not isinstance(self.memory, LinearMemory):
            raise ValueError("MemorySpec: the least_squares optimizer needs a LinearMemory")
        _check_impl("MemorySpec", self.impl, self.chunk_size)

    # ---- what the spec is ------------------------------------------------------------------
    @property
    def opt_kind(self) -> str:
        return inner_opt.info(self.optimizer).kind

    @property
    def steps(self) -> int:
        return inner_opt.info(self.optimizer).steps

    def axes(self) -> dict:
        """The four axes, readable back (this is what the preset table prints)."""
        return {"memory": self.memory.describe(), "feature_map": self.feature_map.describe(),
                "objective": self.objective.describe(), "window": self.window,
                "optimizer": inner_opt.describe(self.optimizer), "retention": self.retention.describe()}

    def feature_dim(self, d_k: int) -> int:
        return self.feature_map.output_dim(d_k)

    @property
    def chunked_is_exact(self) -> bool:
        """The chunked form equals the recurrence at any chunk size: the delta family (WY form,
        also the kernels' family: ``has_kernel``) or the Omega rule on a linear memory."""
        return is_exact(self) or is_omega_exact(self)

    @property
    def chunk_start_is_recurrent(self) -> bool:
        """Inside one chunk the chunk-start form is the recurrence with every gradient taken at the
        chunk's start θ₀ (``gradient_point``): no decay or a decoupled one (forget-first takes it at
        θ₀ decayed to the step), no chunk-end retention map and no Newton–Schulz once per chunk (both
        act on the chunk as a whole). Then a decode step costs one token's step, not the chunk's
        (`models.layers.MemoryLayer.decode`)."""
        return (self.retention.decay == "none" or self.retention.decoupled) and self.inside_chunk is self

    @cached_property
    def inside_chunk(self) -> "MemorySpec":
        """The spec whose steps the chunk-start form takes before a chunk's last: itself, except
        where the chunk's end acts on the chunk as a whole. Muon with Newton–Schulz once per chunk
        steps as plain momentum inside it (``optimizers.muon``: m_t = ν_t m_{t−1} + g_t, updates
        −β_t m_t), its last step taking the chunk's steps along NS_J(m_b) instead,
        A_b = P_b A₀ − (Σ_{i≤b} (P_b/P_i) β_i) NS_J(m_b); a retention map at chunk ends (moneta,
        memora) moves θ linearly inside it, with the map's decay and no map, and maps A_b at its
        end. Where that spec's ``chunk_start_is_recurrent``, so is every step before the chunk's
        last (a decode step, `models.layers.MemoryLayer.decode`). Cached: one object, so jit sees
        one static spec."""
        info = inner_opt.info(self.optimizer)
        inside = self
        if info.kind == "muon" and info.ns_every == "chunk":
            inside = replace(inside, optimizer=inner_opt.momentum(info.step_size, info.momentum_decay))
        retention = self.retention
        if retention.has_map and retention.map_at == "chunk_end":
            inside = replace(inside, retention=Retention(retention.decay, retention.log_decay, retention.decoupled))
        return inside

    @property
    def has_kernel(self) -> bool:
        """impl="pallas" covers the spec: the exact delta family with the ℓ2 objective (the delta
        write; the dot objective's linear attention has no kernel), the exact Omega rule on a
        linear memory (``is_omega_exact``: the Omega kernels through ``ops.omega_linear``), and the
        chunk-start form of a depth-2 MLP memory whose sequential pass the deep-memory kernel runs
        (``forms.chunked.deep_kernel_covers``; a call whose sizes it does not take says why)."""
        return ((is_exact(self) and isinstance(self.objective, L2)) or is_omega_exact(self)
                or deep_kernel_covers(self))

    # ---- state ---------------------------------------------------------------------------
    def init_state(self, key, *, batch: int, heads: int, d_k: int, d_v: int, params=None) -> MemoryState:
        """A fresh state, leaves [batch, heads, ...]; θ_0 is drawn per head (shared over the batch)
        unless ``params`` (leaves [heads, ...] or [batch, heads, ...]) is given."""
        d_in = self.feature_dim(d_k)
        if params is None:
            keys = jax.random.split(key, heads)
            raw = jax.vmap(lambda kk: self.memory.init(kk, d_in, d_v))(keys)
            if self.retention.has_map:   # draw the accumulator, read θ through the map
                acc = raw
                params = jax.vmap(self.retention.map)(acc)
            else:
                params = raw
            params = jax.tree.map(lambda x: jnp.broadcast_to(x, (batch,) + x.shape), params)
        return self._state_from_params(params, batch, heads, d_k, d_v)

    def _state_from_params(self, params, batch, heads, d_k, d_v) -> MemoryState:
        """Broadcasts θ given per head ([H, ...]), per batch and head ([B, H, ...]) or shared."""
        per_head = jax.eval_shape(lambda: self.memory.init(jax.random.PRNGKey(0), self.feature_dim(d_k), d_v))
        if jax.tree.structure(per_head) != jax.tree.structure(params):
            raise ValueError(f"initial_state: params must have the keys {sorted(per_head)} of a "
                             f"{self.memory.describe()} memory, got {sorted(params)}")
        params = jax.tree.map(lambda x, ref: _broadcast_params(x, ref.shape, batch, heads), params, per_head)
        per_head = lambda p: self._fresh_aux(p, d_v)
        opt_state, acc, win = jax.vmap(jax.vmap(per_head))(params)
        return MemoryState(params, opt_state, acc, win)

    def _check_state(self, state: MemoryState, d_v) -> None:
        """A MemoryState made for another optimizer, retention or window cannot be continued."""
        expected = jax.eval_shape(lambda p: jax.vmap(jax.vmap(lambda x: self._fresh_aux(x, d_v)))(p), state.params)
        given = (state.opt_state, state.accumulator, state.window)
        for part, exp, got in zip(("opt_state", "accumulator", "window"), expected, given):
            if jax.tree.structure(exp) != jax.tree.structure(got):
                raise ValueError(f"initial_state: its {part} was made for a different inner optimizer, retention "
                                 "or window than this spec's; pass initial_state=state.params to start them fresh")

    def _fresh_aux(self, params, d_v):
        opt_state = optax.with_extra_args_support(self.optimizer).init(params)
        acc = self.retention.inverse_map(params) if self.retention.has_map else None
        win = None
        if self.window > 1:
            d_in = _input_dim(params, self.memory)
            c = self.window - 1
            win = WindowCache(jnp.zeros((c, d_in), jnp.float32), jnp.zeros((c, d_v), jnp.float32),
                              jnp.zeros((c,), jnp.float32), jnp.zeros((c, d_v), jnp.float32))
        return opt_state, acc, win

    # ---- running -------------------------------------------------------------------------
    def __call__(self, q, k, v, *, beta=None, g=None, nu=None, gamma=None, delta=None,
                 initial_state=None, output_final_state: bool = False, impl: str | None = None,
                 chunk_size: int | None = None, feature_params=None, scale: float = 1.0, form: str | None = None,
                 restarts=None, valid=None, gradient_point=None):
        """Run the memory over a sequence: returns (o [B, T, H, V], final MemoryState or None).

        ``impl`` / ``chunk_size`` override the spec's fields for this call; ``form`` is the 0.1.0
        name ("recurrent" | "chunked"), deprecated in favour of ``impl``. ``restarts`` [B, T]
        (bool or 0/1): the memory restarts from ``initial_state`` before each marked token, as if a
        new sequence began there (packed documents). The recurrent form takes them anywhere; the
        chunk-start forms at multiples of ``chunk_size`` only (a chunk with a restart inside gives
        NaN outputs), and the exact delta-family and Omega routes not at all (their ops take
        ``cu_seqlens``). ``valid`` [B, T] (with restarts): False marks padding between a document's
        last token and the next restart; it leaves the memory as it is (a chunk-end map or
        Newton–Schulz acts at the document's last token, as if the document ran alone) and its
        outputs mean nothing. ``gradient_point`` (impl "recurrent" only): params like
        ``initial_state``'s, [B, H, ...], at which every step takes its gradient in place of the
        state before it: the chunk-start form's steps inside one chunk from θ₀ = the point, where
        ``chunk_start_is_recurrent`` (a chunk-start memory's decode step).
        """
        if form is not None:
            if impl is not None:
                raise ValueError("MemorySpec: pass impl only (form is its deprecated 0.1.0 name)")
            if form not in _FORM_ALIASES:
                raise ValueError(f"MemorySpec: form must be one of {tuple(_FORM_ALIASES)} (deprecated; use "
                                 f"impl, one of {IMPLS}), got {form!r}")
            warnings.warn("MemorySpec(form=...) is deprecated: use impl='recurrent' | 'chunk' | 'pallas' | 'auto'",
                          DeprecationWarning, stacklevel=2)
            impl = _FORM_ALIASES[form]
        impl = self.impl if impl is None else impl
        chunk_size = self.chunk_size if chunk_size is None else chunk_size
        _check_impl("MemorySpec call", impl, chunk_size)
        if impl == "pallas" and not self.has_kernel:
            raise NotImplementedError(f"MemorySpec: impl='pallas' has no kernel for {self.name!r} "
                                      f"({self.memory.describe()}, {self.objective.describe()}, window {self.window}, "
                                      f"{inner_opt.describe(self.optimizer)}); the kernels cover the exact delta "
                                      "family, the Omega rule on a linear memory and depth-2 MLP memories with ℓ2 and GD or "
                                      "momentum (titans, ttt_mlp). Use impl='chunk' or 'auto'")
        shapes = _check_inputs(self, q, k, v, beta, g, nu, gamma, delta)
        batch, _, heads, d_k, d_v, n = shapes
        if valid is not None and restarts is None:
            raise ValueError("MemorySpec: valid marks the padding between restarted documents; pass restarts too")
        if restarts is not None:
            if jnp.shape(restarts) != q.shape[:2]:
                raise ValueError(f"MemorySpec: restarts must be [B, T] = {q.shape[:2]} like q's first two axes, "
                                 f"got {jnp.shape(restarts)}")
            if valid is not None and jnp.shape(valid) != q.shape[:2]:
                raise ValueError(f"MemorySpec: valid must be [B, T] = {q.shape[:2]} like q's first two axes, "
                                 f"got {jnp.shape(valid)}")
            if n > 1:
                raise NotImplementedError("MemorySpec: restarts with several inner steps per token are not "
                                          "supported; give each sequence its own row")
            if output_final_state and self.window > 1 and impl != "recurrent":
                raise NotImplementedError("MemorySpec: restarts with an Omega window and output_final_state run "
                                          "with impl='recurrent' (the chunked form rebuilds the final window "
                                          "from the last c - 1 tokens, across a restart)")
        state = self._coerce_state(initial_state, batch, heads, d_k, d_v)
        if gradient_point is not None:
            if impl != "recurrent" or restarts is not None:
                raise ValueError("MemorySpec: gradient_point takes impl='recurrent' and no restarts (it is one "
                                 f"chunk's start θ for the steps inside that chunk), got impl={impl!r}")
            want = jax.tree.map(lambda x: (x.shape, x.dtype), state.params)
            got = jax.tree.map(lambda x: (jnp.shape(x), jnp.result_type(x)), gradient_point)
            if got != want:
                raise ValueError(f"MemorySpec: gradient_point must have the state's params' structure, shapes and "
                                 f"dtypes {want}, got {got}")
        if feature_params is None:
            feature_params = self.feature_map.init_params()
        # A state built here starts the inner optimizer from its init (Muon's momentum zero), which
        # the packed documents' restarts can take as a static fact.
        fresh_opt_state = restarts is not None and not isinstance(initial_state, MemoryState)
        o, final = _run(self, q, k, v, beta, g, nu, gamma, delta, state, feature_params, scale,
                        impl=impl, chunk_size=chunk_size, steps=n, restarts=restarts, valid=valid,
                        gradient_point=gradient_point, fresh_opt_state=fresh_opt_state)
        return o.astype(v.dtype), (final if output_final_state else None)

    def _coerce_state(self, initial_state, batch, heads, d_k, d_v) -> MemoryState:
        if isinstance(initial_state, MemoryState):
            self._check_state(initial_state, d_v)
            return initial_state
        if initial_state is None:
            if not isinstance(self.memory, LinearMemory):
                raise ValueError(f"initial_state: a {self.memory.describe()} memory needs its θ_0; pass "
                                 "spec.init_state(key, batch=B, heads=H, d_k=K, d_v=V)")
            return self.init_state(None, batch=batch, heads=heads, d_k=d_k, d_v=d_v,
                                   params={"S": jnp.zeros((self.feature_dim(d_k), d_v), jnp.float32)})
        if isinstance(initial_state, jax.Array) or hasattr(initial_state, "shape"):
            if not isinstance(self.memory, LinearMemory):
                raise ValueError("initial_state: a bare array is only accepted for a linear memory "
                                 "(the fla-style [B, H, K, V] state); pass a MemoryState or a params dict")
            expected = (batch, heads, self.feature_dim(d_k), d_v)
            if tuple(initial_state.shape) != expected:
                raise ValueError(f"initial_state: expected shape {expected} (B, H, d_φ, V), got {tuple(initial_state.shape)}")
            initial_state = {"S": initial_state}
        if isinstance(initial_state, dict):
            return self._state_from_params(initial_state, batch, heads, d_k, d_v)
        raise TypeError(f"initial_state: expected None, a MemoryState, a params dict or an array, "
                        f"got {type(initial_state).__name__}")


def _broadcast_params(x, leaf_shape, batch, heads):
    x = jnp.asarray(x, jnp.float32)
    leading = x.shape[:x.ndim - len(leaf_shape)]
    if x.shape[len(leading):] != tuple(leaf_shape) or leading not in ((), (heads,), (batch, heads)):
        raise ValueError(f"initial_state: a parameter of shape {tuple(x.shape)} is not {tuple(leaf_shape)} "
                         f"per head; expected {tuple(leaf_shape)}, [H={heads}, ...] or [B={batch}, H={heads}, ...]")
    return jnp.broadcast_to(x, (batch, heads) + tuple(leaf_shape))


def _input_dim(params, memory):
    if isinstance(memory, LinearMemory):
        return params["S"].shape[0]
    first = params.get("W0", params.get("Wg"))
    return first.shape[0]


# ---- input checks ----------------------------------------------------------------------------
def _check_float(name, x):
    if x is not None and not jnp.issubdtype(jnp.asarray(x).dtype, jnp.floating):
        raise TypeError(f"{name} must have a floating dtype (float32/bfloat16), got {jnp.asarray(x).dtype}")


def _channel_dim(spec, d_k, d_v):
    """The size of the memory's channel axis for channel-wise β, ν and α (None if it has none)."""
    shapes = jax.eval_shape(lambda: spec.memory.init(jax.random.PRNGKey(0), spec.feature_dim(d_k), d_v))
    return spec.memory.channel_dim(shapes)


def _check_inputs(spec, q, k, v, beta, g, nu, gamma, delta):
    for name, x in (("q", q), ("k", k), ("v", v), ("beta", beta), ("g", g), ("nu", nu),
                    ("gamma", gamma), ("delta", delta)):
        _check_float(name, x)
    if q.ndim != 4:
        raise ValueError(f"q must be [B, T, H, K], got shape {tuple(q.shape)}")
    batch, time, heads, d_k = q.shape
    n = spec.steps
    if k.ndim == 5:
        if k.shape[:3] != (batch, time, heads) or k.shape[4] != d_k or k.shape[3] != n:
            raise ValueError(f"k with one key per inner step must be [B, T, H, n={n}, K={d_k}] matching q "
                             f"{tuple(q.shape)}, got {tuple(k.shape)}")
    elif k.shape != q.shape:
        raise ValueError(f"k must have q's shape {tuple(q.shape)} [B, T, H, K], got {tuple(k.shape)}")
    if v.ndim != k.ndim or v.shape[:-1] != k.shape[:-1]:
        raise ValueError(f"v must be [B, T, H, V] (or [B, T, H, n, V] when k has n keys per token) "
                         f"matching k {tuple(k.shape)}, got {tuple(v.shape)}")
    d_v = v.shape[-1]
    bth = (batch, time, heads)
    channels = _channel_dim(spec, d_k, d_v)
    where = (f"the memory's channels d = {channels}" if channels is not None else
             f"none: a {spec.memory.describe()} memory on d_φ = {spec.feature_dim(d_k)}, V = {d_v} has no single "
             "channel axis (channel-wise knobs need a linear memory or a depth-2 MLP with d_φ = V)")

    def check_knob(name, x, extra_shapes, meaning):
        allowed = [bth] + [bth + (m,) for m in extra_shapes]
        if x is not None and tuple(x.shape) not in allowed:
            raise ValueError(f"{name} must be one of {' or '.join(str(a) for a in allowed)} "
                             f"([B, T, H]{meaning}), got {tuple(x.shape)}")

    if n > 1:
        check_knob("beta", beta, (n,), f", or [B, T, H, n] with n = {n} inner steps")
    else:
        check_knob("beta", beta, () if channels is None else (channels,),
                   f", or channel-wise [B, T, H, d] over {where}")
    check_knob("nu", nu, () if channels is None else (channels,), f", or channel-wise [B, T, H, d] over {where}")
    check_knob("delta", delta, (d_v,), f", or per output channel [B, T, H, V={d_v}]")
    check_knob("gamma", gamma, (spec.window,), f", or one weight per window position [B, T, H, c={spec.window}], "
                                                "oldest first")
    if delta is not None and not spec.objective.uses_delta:
        raise ValueError(f"delta: the {spec.objective.describe()} objective has no per-token knob; drop delta")
    if nu is not None and spec.opt_kind not in ("momentum", "muon", "optax"):
        raise ValueError(f"nu: the {inner_opt.describe(spec.optimizer)} optimizer has no momentum; drop nu")
    decay, uses_g = spec.retention.decay, spec.retention.needs_gate or spec.opt_kind == "least_squares"
    if g is None and spec.retention.needs_gate:
        raise ValueError(f"g: the {decay} retention needs per-token log-decays g (α = exp(g))")
    if g is not None:
        if not uses_g:
            raise ValueError(f"g: this memory's retention is {spec.retention.describe()!r} (no per-token decay); "
                             "drop g or choose retention scalar()/channel()")
        if decay == "channel":
            if channels is None:
                raise ValueError(f"g: channel retention needs a channel axis, and there is {where}")
            if g.shape != bth + (channels,):
                raise ValueError(f"g for channel retention must be [B, T, H, d] = {bth + (channels,)} "
                                 f"(d: {where}), got {tuple(g.shape)}")
        elif g.shape != bth:
            raise ValueError(f"g for scalar retention must be [B, T, H] = {bth}, got {tuple(g.shape)}; "
                             "a [B, T, H, d] gate needs retention channel()")
    return batch, time, heads, d_k, d_v, n


# ---- the run ---------------------------------------------------------------------------------
def _check_impl(where, impl, chunk_size):
    if impl not in IMPLS:
        raise ValueError(f"{where}: impl must be one of {IMPLS}, got {impl!r}")
    # The kernels own the chunk-size rule (one checker for the ops, the kernels and the spec).
    check_chunk_size(where, chunk_size, kernel=impl == "pallas")


@partial(jax.jit, static_argnames=("spec", "impl", "chunk_size", "steps", "fresh_opt_state"))
def _run(spec, q, k, v, beta, g, nu, gamma, delta, state, feature_params, scale, *, impl, chunk_size, steps,
         restarts=None, valid=None, gradient_point=None, fresh_opt_state=False):
    f32 = lambda x: None if x is None else jnp.asarray(x, jnp.float32)
    # The exact family hands q, k, v to the ops as given (bf16 stays bf16 for the kernels, which
    # keep gates, solves and states in float32); every other path computes in float32.
    # A channel-wise β ([B, T, H, d] with one step per token) is outside the WY (delta-rule) family:
    # the chunk-start form runs it.
    channel_beta = beta is not None and beta.ndim == 4 and steps == 1
    if impl == "pallas" and channel_beta:
        raise NotImplementedError("MemorySpec: impl='pallas': the kernels take a [B, T, H] beta; a "
                                  "channel-wise beta runs with impl='chunk' (the chunk-start form) or 'recurrent'")
    exact_path = impl != "recurrent" and is_exact(spec) and not channel_beta
    # The Omega rule on a linear memory (window c, decoupled decay): exact through ops.omega_linear,
    # on the Omega kernels with "pallas" (and "auto" on GPU/TPU), else ℓ2 through its XLA chunk
    # form and swla's dot through the chunk-start form below (``omega_impl`` says why).
    omega_route = None
    if impl != "recurrent" and is_omega_exact(spec) and not channel_beta and steps == 1:
        omega_route = omega_impl(spec, impl, spec.feature_dim(q.shape[-1]))
    omega_path = omega_route is not None
    if restarts is not None and impl == "pallas":
        raise NotImplementedError("MemorySpec: restarts have no kernel path; use impl='chunk' or 'auto' "
                                  "(or give each sequence its own row)")
    if restarts is not None and (exact_path or omega_path):
        raise NotImplementedError(f"MemorySpec: restarts run in the recurrent and chunk-start forms; "
                                  f"{spec.name!r} takes the exact {'delta-family' if exact_path else 'Omega'} "
                                  f"route, whose ops take cu_seqlens (or give each sequence its own row)")
    as_given = exact_path and q.dtype == k.dtype == v.dtype and jnp.issubdtype(q.dtype, jnp.floating)
    low_precision = q.dtype == k.dtype == jnp.bfloat16
    if not as_given:
        q, k, v = map(f32, (q, k, v))
    beta, g, nu, gamma, delta = map(f32, (beta, g, nu, gamma, delta))
    batch, time, heads, _ = q.shape
    n = steps
    features = None
    if impl == "recurrent" or exact_path or omega_path:
        fq = spec.feature_map.apply(feature_params, scale * q)
        fk = spec.feature_map.apply(feature_params, k)
    else:   # the chunk-start form applies φ itself: chunk by chunk in the dual form, no [T, d_φ] kept
        features = Features(spec.feature_map, feature_params)
        fq, fk = scale * q, k
    if spec.retention.log_decay is not None:
        g = jnp.full((batch, time, heads), spec.retention.log_decay, jnp.float32)
    if gamma is None:
        gamma = jnp.ones((batch, time, heads), jnp.float32)
    window_gates = None
    if gamma.ndim == 4:   # γ_i^{(t)}: the step's weight of each window position
        if spec.window == 1:
            gamma = gamma[..., 0]
        else:
            window_gates, gamma = gamma, jnp.ones((batch, time, heads), jnp.float32)
    if delta is not None and delta.ndim == 3:   # one knob for every output channel
        delta = jnp.broadcast_to(delta[..., None], delta.shape + (v.shape[-1],))

    # Tokens → inner steps [B, T·n, H, ...].
    if fk.ndim == 4:
        fk, v = fk[:, :, :, None], v[:, :, :, None]
    fk = jnp.broadcast_to(fk, (batch, time, heads, n, fk.shape[-1]))
    v = jnp.broadcast_to(v, (batch, time, heads, n, v.shape[-1]))
    first = (jnp.arange(n) == 0)
    to_steps = lambda x: None if x is None else jnp.swapaxes(x, 2, 3).reshape((batch, time * n, heads) + x.shape[4:])
    per_step = lambda x: None if x is None else to_steps(jnp.broadcast_to(x[:, :, :, None], (batch, time, heads, n) + x.shape[3:]))
    per_inner_step = beta is not None and beta.ndim == 4 and not channel_beta
    beta_steps = None if beta is None else (to_steps(beta[..., None])[..., 0] if per_inner_step else per_step(beta))
    g_steps = None
    if g is not None:   # the decay acts once per token, on its first inner step
        mask = first.reshape((1, 1, 1, n) + (1,) * (g.ndim - 3))
        g_steps = to_steps(jnp.where(mask, jnp.broadcast_to(g[:, :, :, None], (batch, time, heads, n) + g.shape[3:]), 0.0))
    per_head = lambda x: jnp.broadcast_to(jnp.asarray(x, jnp.float32)[:, :, None], (batch, time, heads))
    active = jnp.ones((batch, time * n, heads), jnp.float32) if valid is None else per_head(valid)
    steps_bsh = Steps(inputs=to_steps(fk), targets=to_steps(v), queries=per_step(fq), step_size=beta_steps,
                      log_decay=g_steps, momentum_decay=per_step(nu), gates=per_step(gamma),
                      delta=per_step(delta), active=active, window_gates=per_step(window_gates),
                      restart=None if restarts is None else per_head(restarts))
    emit = slice(n - 1, None, n)

    if exact_path:
        o, params = exact_chunked(spec, state.params, steps_bsh, chunk_size=chunk_size, impl=impl)
        final = MemoryState(params, state.opt_state, None, None)
        return o[:, emit], final

    if omega_path:
        o, params = omega_chunked(spec, state.params, state.window, steps_bsh, chunk_size=chunk_size,
                                  impl=omega_route)
        window = None
        if spec.window > 1:
            bhs = jax.tree.map(lambda x: jnp.moveaxis(x, 2, 1), steps_bsh)
            window = _last_window(state.window, bhs, spec.window)
        return o, MemoryState(params, state.opt_state, None, window)

    # Per-sequence, per-head forms: [B, H, S, ...] and vmap twice.
    bhs = jax.tree.map(lambda x: jnp.moveaxis(x, 2, 1), steps_bsh)
    total = time * n
    if impl == "recurrent":
        run_one = lambda st, xs, point: recurrent_sequence(spec, st, xs, point)
        padded = bhs
    else:
        pad = (-total) % chunk_size
        padded = jax.tree.map(lambda x: jnp.pad(x, [(0, 0), (0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 3)), bhs)
        run_one = lambda st, xs, point: chunked_sequence(spec, st, xs, chunk_size=chunk_size, features=features,
                                                         low_precision=low_precision, fresh_opt_state=fresh_opt_state)
    if deep_kernel_route(spec, state, padded, impl=impl, chunk_size=chunk_size, features=features,
                         low_precision=low_precision):
        # The dual form with its sequential pass on the deep-memory kernel (bf16 dots for bf16 inputs).
        final, o = dual_batched_kernel(spec, state, padded, chunk_size=chunk_size, features=features,
                                       low_precision=low_precision)
    else:
        final, o = jax.vmap(jax.vmap(run_one))(state, padded, gradient_point)
    if impl != "recurrent" and spec.window > 1:
        final = final._replace(window=_last_window(state.window, bhs, spec.window, features))
    o = jnp.moveaxis(o[:, :, :total], 1, 2)  # [B, S, H, V]
    return o[:, emit], final


def _last_window(window: WindowCache, steps: Steps, c: int, features=None) -> WindowCache:
    """The last c − 1 real steps (padding of the final chunk must not enter the cache); the cache
    holds φ(k), formed here for those steps when the steps carry raw keys (``features``)."""
    keep = lambda cached, new: jnp.concatenate([cached, new[:, :, -(c - 1):]], axis=2)[:, :, -(c - 1):]
    delta = window.delta if steps.delta is None else keep(window.delta, steps.delta)
    last_inputs = steps.inputs[:, :, -(c - 1):]
    if features is not None:
        last_inputs = features(last_inputs)
    return WindowCache(keep(window.inputs, last_inputs), keep(window.targets, steps.targets),
                       keep(window.weights, steps.gates), delta)
