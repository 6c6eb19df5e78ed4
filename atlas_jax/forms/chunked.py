"""The chunked form: chunkwise-parallel, in two flavours.

**Exact** (``is_exact``): a linear memory with the dot or ℓ2 objective, window 1, (implicit) GD,
and no/scalar/channel decay is the delta-rule (or linear-attention) family, whose chunked WY/UT
form equals the recurrence to float tolerance: it runs through ``atlas_jax.ops``' chunk algorithm.

**Exact Omega** (``is_omega_exact``): a linear memory with the dot or ℓ2 objective, an Omega
window c ≥ 1, GD, and decoupled scalar (or no) decay — swla, and omeganet / atlas-style specs on a
linear memory — is exact at any chunk size: with ℓ2 through the expanded-WY form
``atlas_jax.ops.omega_linear_chunk`` (each token becomes its c window terms; ``omega_chunked``);
with the dot objective (swla) the gradient does not read θ, so the chunk-start form below is
already exact and runs it. Both objectives run on the Omega Pallas kernels
(``atlas_jax.ops.omega_linear``, impl "pallas") where ``omega_impl`` picks them.

**Chunk-start gradients** (everything else; Titans §3.2, TTT mini-batch GD, ATLAS §3.3, MIRAS):
inside a chunk of b steps every gradient is taken at the chunk's starting θ₀,

    g_t = Σ_{i=t−c+1..t} γ_i ∇ℓ_i(p_t)          p_t = θ₀ (decoupled) or θ₀ decayed to step t
    m_t = ν_t m_{t−1} + g_t,  u_t = −β_t [NS_J](m_t)            (masked decay matmul; NS in parallel)
    A_t = α_t ⊙ A_{t−1} + u_t,  θ_t = map(A_t),  o_t = M_{θ_t}(φ(q_t))

Decays are products of per-step factors built in log space with the mask applied before exp. With
b = 1 this is the recurrence exactly; for b > 1 the documented approximation is that the gradients
of a chunk do not see the chunk's own earlier writes. Inner optimizers other than GD, momentum,
Muon and implicit GD (e.g. ``optax.adam``, least squares) run as a scan over the chunk's steps on
the same chunk-start gradients (least squares ignores gradients, so its chunked form is exact).

Two implementations of the chunk-start scheme compute the same thing: the **dual form**
(forms/dual.py; memory O(T·d), never a [chunk, |θ|] tensor) for memories made of linear layers with
GD / implicit GD / momentum / Muon with ``ns_every="chunk"``, scalar or no decay and chunk-end maps,
and the **materialising** form below (every step's θ_t of a chunk, rematerialised chunk by chunk in
the backward pass) for everything else: channel-wise knobs, per-token Newton–Schulz, other optax
transforms, per-token maps. ``chunked_sequence`` picks between them.
"""
from __future__ import annotations

import contextlib

import jax
import jax.numpy as jnp
import optax

from atlas_jax import optimizers as inner_opt
from atlas_jax.forms.common import (MemoryState, Steps, WindowCache, channel_extra_args, channel_tree,
                                    decay_matrix, optimizer_extra_args, restarting_chunks, safe_log,
                                    window_gradient)
from atlas_jax.memory import LinearMemory
from atlas_jax.retention import decay_tree
from atlas_jax.objectives import L2, Dot

__all__ = ["is_exact", "is_omega_exact", "chunked_sequence", "deep_kernel_covers", "deep_kernel_route",
           "exact_chunked", "omega_chunked", "omega_impl", "runs_dual_form"]

_PARALLEL_KINDS = ("gd", "momentum", "muon", "implicit_gd")


def is_exact(spec) -> bool:
    """Whether the chunked form of ``spec`` is exact (the delta-rule / linear-attention family)."""
    kind = inner_opt.info(spec.optimizer).kind
    retention = spec.retention
    # Decoupled decay reads the undecayed state in the ℓ2 residual, which is not the WY family.
    forget_then_write = retention.decay == "none" or not retention.decoupled or isinstance(spec.objective, Dot)
    return (isinstance(spec.memory, LinearMemory)
            and type(spec.objective) in (L2, Dot)
            and spec.window == 1
            and kind in ("gd", "implicit_gd")
            and not retention.has_map
            and forget_then_write)


def is_omega_exact(spec) -> bool:
    """Whether ``spec`` is outside the WY family but runs exactly through the chunked Omega rule
    (``atlas_jax.ops.omega_linear_chunk``): a linear memory, the ℓ2 or dot objective, any window
    c ≥ 1, one plain GD step per token, no retention map, and no decay or a scalar decay that is
    decoupled (ℓ2; the dot objective's gradient does not read the state, so coupled decay is the
    same there)."""
    info = inner_opt.info(spec.optimizer)
    retention = spec.retention
    decay_ok = retention.decay == "none" or (
        retention.decay == "scalar" and (retention.decoupled or isinstance(spec.objective, Dot)))
    return (not is_exact(spec)
            and isinstance(spec.memory, LinearMemory)
            and type(spec.objective) in (L2, Dot)
            and info.kind == "gd" and info.steps == 1
            and not retention.has_map
            and decay_ok)


# impl="auto" takes the Omega kernels on GPU/TPU only up to this feature width d_φ: the GPU kernel
# holds a [d_φ, 16..64] state block per program in registers (d_φ padded to a power of two), and
# was lowered and tested at K 64 / 128 only; the polynomial features of swla / omeganet-style
# specs (d_φ = C(d + 2, 2), 2145 at d = 64) stay on the XLA forms, which "pallas" overrides.
OMEGA_AUTO_MAX_DIM = 256


def omega_impl(spec, impl: str, d_in: int) -> str | None:
    """What runs an ``is_omega_exact`` spec's call with MemorySpec impl ``impl`` (not "recurrent")
    on a d_in-wide feature map: the ``ops.omega_linear`` impl ("pallas": the Omega kernels,
    interpret mode on CPU; "chunk": the expanded-WY XLA form), or None for the chunk-start form.

    "pallas" always takes the kernels; "auto" takes them where ``ops.omega_linear``'s own "auto"
    does (GPU / TPU) and d_in ≤ OMEGA_AUTO_MAX_DIM, else runs what "chunk" runs: ℓ2 through
    ``omega_linear_chunk``; the dot objective (swla) through the chunk-start form, exact there
    (its gradient does not read θ), which keeps φ per chunk (dual form: no [T, d_φ] array) and
    measured closer to the recurrence (swla's layer, φ-coefficient gradients at chunk 8: 3e-6
    against 1.5e-5)."""
    from atlas_jax.ops.omega.api import _choose_impl

    if impl == "pallas" or (impl == "auto" and _choose_impl("auto") == "pallas"
                            and d_in <= OMEGA_AUTO_MAX_DIM):
        return "pallas"
    return "chunk" if isinstance(spec.objective, L2) else None


def omega_chunked(spec, params, window, steps: Steps, *, chunk_size: int, impl: str = "chunk"):
    """Exact chunked Omega rule over [B, S, H, ·] steps (one step per token, φ already applied);
    ``params`` = {"S": [B, H, d_in, d_out]}, ``window`` the spec's WindowCache ([B, H, c − 1, ·])
    or None at c = 1; ``impl`` the ``ops.omega_linear`` impl ("chunk" or "pallas"; see
    ``omega_impl``). Returns (o [B, S, H, d_out], {"S": final}); the caller updates the cache."""
    from atlas_jax.ops.omega import omega_linear

    opt_info = inner_opt.info(spec.optimizer)
    beta = steps.step_size if steps.step_size is not None else jnp.full(steps.gates.shape, opt_info.step_size)
    gamma = steps.window_gates if steps.window_gates is not None else steps.gates
    g = steps.log_decay if spec.retention.decay != "none" else None
    initial_window = None if window is None else (window.inputs, window.targets, window.weights)
    o, final = omega_linear(steps.queries, steps.inputs, steps.targets, beta, g, gamma,
                            window=spec.window, objective="l2" if isinstance(spec.objective, L2) else "dot",
                            scale=1.0, initial_state=params["S"], output_final_state=True,
                            initial_window=initial_window, impl=impl, chunk_size=chunk_size)
    return o, {"S": final}


def exact_chunked(spec, params, steps: Steps, *, chunk_size: int, impl: str = "auto"):
    """Exact chunked form over [B, S, H, ·] steps; ``params`` = {"S": [B, H, d_in, d_out]}.

    Runs through ``atlas_jax.ops.run_delta_family`` with ``impl`` "chunk" (the exact XLA form),
    "pallas" (the kernels) or "auto" (the kernels on GPU/TPU when they cover the call).
    """
    from atlas_jax.ops import run_delta_family

    opt_info = inner_opt.info(spec.optimizer)
    beta = steps.step_size if steps.step_size is not None else jnp.full(steps.gates.shape, opt_info.step_size)
    beta = beta * steps.gates
    if opt_info.kind == "implicit_gd":
        beta = beta / (1.0 + beta * jnp.sum(jnp.square(steps.inputs), axis=-1))
    o, final = run_delta_family(steps.queries, steps.inputs, steps.targets, beta,
                                steps.log_decay if spec.retention.decay != "none" else None,
                                delta=isinstance(spec.objective, L2), scale=1.0, initial_state=params["S"],
                                output_final_state=True, impl=impl, chunk_size=chunk_size)
    return o, {"S": final}


def _linear_recurrence(log_factors, inputs, start, channel_axes):
    """x_t = f_t ⊙ x_{t−1} + u_t for every step of a chunk at once, x_0 = ``start``.

    ``log_factors``: None (f = 1), [b] (scalar per step) or [b, d] (one factor per channel, along
    each leaf's channel axis); ``inputs`` a tree of [b, ...] leaves. Masked decay matmuls, with the
    mask applied before exp (``decay_matrix``)."""
    if log_factors is None:
        b = jax.tree.leaves(inputs)[0].shape[0]
        lower = jnp.tril(jnp.ones((b, b), jnp.float32))
        return jax.tree.map(lambda u, x0: jnp.einsum("TI,I...->T...", lower, u) + x0[None], inputs, start)
    within = decay_matrix(log_factors)                      # [b, b] or [b, b, d]
    from_start = jnp.exp(jnp.cumsum(log_factors, axis=0))   # [b]    or [b, d]
    if log_factors.ndim == 1:
        def one(u, x0):
            scale = jnp.reshape(from_start, from_start.shape + (1,) * x0.ndim)
            return jnp.einsum("TI,I...->T...", within, u) + scale * x0[None]
        return jax.tree.map(one, inputs, start)

    def one_channel(key):
        axis = channel_axes[key]
        u = jnp.moveaxis(inputs[key], axis + 1, 1)        # [b, d, ...]
        x0 = jnp.moveaxis(start[key], axis, 0)            # [d, ...]
        tail = (1,) * (x0.ndim - 1)
        x = (jnp.einsum("TIC,IC...->TC...", within, u)
             + jnp.reshape(from_start, from_start.shape + tail) * x0[None])
        return jnp.moveaxis(x, 1, axis + 1)

    return {key: one_channel(key) for key in inputs}


def _per_step(knob, tree, channel_axes):
    """A [b] or [b, d] per-step knob shaped to multiply a tree of [b, ...] leaves."""
    if knob.ndim == 2:
        return channel_tree(knob, tree, channel_axes, lead=1)
    return jax.tree.map(lambda leaf: jnp.reshape(knob, knob.shape + (1,) * (leaf.ndim - 1)), tree)


def _times(knob, tree, channel_axes):
    factor = _per_step(knob, tree, channel_axes)
    return jax.tree.map(jnp.multiply, factor, tree)


def _parallel_updates(opt_info, grads, opt_state, steps: Steps, sq_norm, channel_axes):
    """u_t for all steps of a chunk and the optimizer state after it (GD / momentum / Muon / implicit)."""
    active = steps.active
    beta = steps.step_size if steps.step_size is not None else jnp.full(active.shape, opt_info.step_size)
    beta = beta * (active if beta.ndim == 1 else active[:, None])
    negative = jax.tree.map(jnp.negative, grads)
    if opt_info.kind == "gd":
        return _times(beta, negative, channel_axes), opt_state
    if opt_info.kind == "implicit_gd":
        eff = beta / (1.0 + beta * (sq_norm if beta.ndim == 1 else sq_norm[:, None]))
        return _times(eff, negative, channel_axes), opt_state
    nu = steps.momentum_decay if steps.momentum_decay is not None else jnp.full(active.shape, opt_info.momentum_decay)
    nu = jnp.where((active > 0) if nu.ndim == 1 else (active > 0)[:, None], nu, 1.0)   # padding keeps m
    log_nu = safe_log(nu)
    if opt_info.step_inside:   # Titans: S_t = ν_t S_{t−1} − β_t ∇, updates = S_t
        m = _linear_recurrence(log_nu, _times(beta, negative, channel_axes), opt_state.momentum, channel_axes)
        updates = _times(active, m, channel_axes)   # padding writes nothing
    else:                      # m_t = ν_t m_{t−1} + ∇, updates = −β_t [NS](m_t)
        m = _linear_recurrence(log_nu, grads, opt_state.momentum, channel_axes)
        per_token_ns = opt_info.kind == "muon" and opt_info.ns_every == "token"
        # [b, rows, cols] matrices only; vectors pass through as in Muon practice
        direction = inner_opt.orthogonalize(m, opt_info, matrix_ndim=3) if per_token_ns else m
        updates = _times(beta, jax.tree.map(jnp.negative, direction), channel_axes)
    return updates, inner_opt.MomentumState(jax.tree.map(lambda x: x[-1], m))


def _scanned_steps(spec, grads, opt_state, base0, steps: Steps, windows, sq_norm, channel_axes):
    """Any other optax transform (adam, least squares, …): the chunk's steps run in sequence on the
    chunk-start gradients, each update applied to the running state as in the recurrence (a
    transform may read its params: least squares returns θ* − θ). Returns A_t and u_t for every
    step, and the optimizer state after the chunk."""
    opt = optax.with_extra_args_support(spec.optimizer)
    retention = spec.retention
    per_step = optimizer_extra_args(steps, windows["inputs"], windows["targets"], windows["weights"], sq_norm,
                                    scalar_decay=steps.log_decay is not None and steps.log_decay.ndim == 1)

    def body(carry, xs):
        state, base = carry
        g, extra, log_decay, active = xs
        params = retention.map(base) if retention.has_map else base
        decayed = base
        if log_decay is not None and retention.decay != "none":
            decayed = decay_tree(base, jnp.exp(log_decay), retention.decay, channel_axes)
        point = params if (retention.decoupled or retention.decay == "none") else (
            retention.map(decayed) if retention.has_map else decayed)
        updates, new_state = opt.update(g, state, point, **channel_extra_args(extra, base, channel_axes))
        updates = jax.tree.map(lambda u: jnp.where(active > 0, u, 0.0), updates)
        new_base = jax.tree.map(lambda d, u: d + u, decayed, updates)
        keep = lambda n, o: jnp.where(active > 0, n, o)
        new_carry = (jax.tree.map(keep, new_state, state), jax.tree.map(keep, new_base, base))
        return new_carry, (new_carry[1], updates)

    (new_state, _), (acc, updates) = jax.lax.scan(body, (opt_state, base0),
                                                  (grads, per_step, steps.log_decay, steps.active))
    return acc, updates, new_state


def _retention_recurrence(spec, base0, updates, steps: Steps, channel_axes):
    """A_t = α_t ⊙ A_{t−1} + u_t for every step of the chunk, in parallel."""
    if spec.retention.decay == "none" or steps.log_decay is None:
        return _linear_recurrence(None, updates, base0, channel_axes)
    g = jnp.where((steps.active > 0).reshape((-1,) + (1,) * (steps.log_decay.ndim - 1)), steps.log_decay, 0.0)
    return _linear_recurrence(g, updates, base0, channel_axes)


def _gradient_points(spec, params0, acc0, steps: Steps, channel_axes):
    """Where each step's gradient is taken, [b, ...θ]: θ₀ (decoupled or no decay), or θ₀ decayed
    to the step, map(P_t ⊙ A₀) with P_t = Π_{j≤t} α_j — the state at t had the chunk written nothing."""
    retention = spec.retention
    b = steps.active.shape[0]
    if retention.decoupled or retention.decay == "none" or steps.log_decay is None:
        return jax.tree.map(lambda x: jnp.broadcast_to(x, (b,) + x.shape), params0)
    g = jnp.where((steps.active > 0).reshape((-1,) + (1,) * (steps.log_decay.ndim - 1)), steps.log_decay, 0.0)
    from_start = jnp.exp(jnp.cumsum(g, axis=0))
    in_map = retention.has_map and retention.map_at == "token"   # chunk_end: the chunk is linear in θ
    base0 = acc0 if in_map else params0
    decayed = jax.vmap(lambda f: decay_tree(base0, f, retention.decay, channel_axes))(from_start)
    return jax.vmap(retention.map)(decayed) if in_map else decayed


def _last_real_step(active):
    """True from a chunk's last real step on (where chunk-end maps and per-chunk NS act)."""
    after = jnp.concatenate([active[1:], jnp.zeros((1,), active.dtype)])
    return after == 0


def _chunk_end_orthogonalized(spec, opt_info, base0, acc, momentum, steps: Steps):
    """Muon with ``ns_every="chunk"``: the chunk-end accumulator P_b A₀ − (Σ_i (P_b/P_i) β_i)·NS(m_b)
    in place of the plain-momentum one, from the last real step on (see ``optimizers.muon``)."""
    active = steps.active
    beta = steps.step_size if steps.step_size is not None else jnp.full(active.shape, opt_info.step_size)
    beta = beta * active
    if spec.retention.decay == "none" or steps.log_decay is None:
        total_step, from_start = jnp.sum(beta), jnp.asarray(1.0, jnp.float32)
    else:
        g = jnp.where(active > 0, steps.log_decay, 0.0)
        total_step = decay_matrix(g)[-1] @ beta
        from_start = jnp.exp(jnp.sum(g))
    direction = inner_opt.orthogonalize(momentum, opt_info)
    end = jax.tree.map(lambda a0, n: from_start * a0 - total_step * n, base0, direction)
    at_end = _last_real_step(active)
    return jax.tree.map(lambda e, a: jnp.where(at_end.reshape((-1,) + (1,) * e.ndim), e[None], a), end, acc)


# Which form runs a spec the dual form covers: "auto" (the dual form when a chunk's materialised
# states would take at least DUAL_FORM_MIN_BYTES per sequence and head), "dual" or "materialising";
# set through the context managers below. Below that size the materialised [chunk, |θ|] stack is
# small, and the materialising form keeps the rounding of the form the small-model tests were
# written against (the two forms differ by float32 rounding, which ill-conditioned specs — MIRAS'
# LayerNorm blocks with Huber — amplify to ~1e-6 relative over a few chunks).
_FORM = "auto"
DUAL_FORM_MIN_BYTES = 2 ** 20


@contextlib.contextmanager
def _form(name):
    # The form is chosen at trace time, so jit caches are cleared on entry and exit.
    global _FORM
    previous, _FORM = _FORM, name
    jax.clear_caches()
    try:
        yield
    finally:
        _FORM = previous
        jax.clear_caches()


def materialising():
    """Context: run the chunk-start form by materialising every step's θ (the dual form's reference)."""
    return _form("materialising")


def dual_form():
    """Context: run every spec the dual form covers through it, whatever its size."""
    return _form("dual")


def _chunk_state_bytes(state: MemoryState, chunk_size: int) -> int:
    leaves = jax.tree.leaves((state.params, state.opt_state))
    return chunk_size * sum(x.size * x.dtype.itemsize for x in leaves)


def runs_dual_form(spec, state: MemoryState, steps: Steps, *, chunk_size: int, d_in: int | None = None) -> bool:
    """Whether ``chunked_sequence`` runs these steps (one sequence and head) through the dual form,
    under the current form choice (``d_in``: the memory's input width when the steps carry raw keys)."""
    from atlas_jax.forms import dual

    if _FORM == "materialising" or not dual.covers(spec, state, steps, d_in=d_in):
        return False
    return _FORM == "dual" or _chunk_state_bytes(state, chunk_size) >= DUAL_FORM_MIN_BYTES


def deep_kernel_covers(spec) -> bool:
    """Whether the deep-memory state-pass kernel (``ops.deep_memory``) runs ``spec``'s dual form
    at some sizes (``deep_kernel_route`` decides for a call's sizes)."""
    from atlas_jax.features import Identity
    from atlas_jax.forms.dual import _memory_has_linear_layers
    from atlas_jax.ops.deep_memory import kernel_covers

    # A feature map widens the input (d_φ > d), so a residual memory needs a skip map there.
    d_in = 4 if type(spec.feature_map) is Identity else 5
    probe = jax.eval_shape(lambda: spec.memory.init(jax.random.PRNGKey(0), d_in, 4))
    return kernel_covers(spec, d_in, 4) is None and _memory_has_linear_layers(spec.memory, probe, d_in)


def deep_kernel_route(spec, state: MemoryState, steps: Steps, *, impl: str, chunk_size: int,
                      features=None, low_precision: bool = False) -> bool:
    """Whether a MemorySpec call ([B, H, S, ...] steps, padded) runs the dual form on the
    deep-memory kernel: impl "pallas" whenever the kernel takes the call (else NotImplementedError
    saying why); "auto" for bf16 inputs on a GPU where the kernel takes the call. On an H200
    (titans, B4 T4096 H8 D128, bf16, one command; benchmarks/results/titans_persistent_h200_2026-11-26.md)
    the kernel route ran forward+backward in 27.8 ms against 34.0 for the XLA dual form, forward in
    6.6 against 8.5, at 6.4 against 3.6 GiB peak (the split form keeps every chunk's read
    intermediates); B1 T16384 39.8 against 62.6 ms (35.8 in a later command, with narrower
    backward tiles). float32 inputs stay on XLA: the kernel's float32 forward is level with XLA's
    with TF32 products and slower with exact ones."""
    from atlas_jax.forms import dual

    if impl not in ("pallas", "auto") or not deep_kernel_covers(spec) or _FORM == "materialising":
        return False
    if impl == "auto" and not (low_precision and jax.default_backend() == "gpu"):
        return False
    one = jax.tree.map(lambda x: x[0, 0], (state, steps))
    d_in = None if features is None else features.output_dim(steps.inputs.shape[-1])
    gap = dual.kernel_gap(spec, *one, chunk_size=chunk_size, d_in=d_in)
    if gap is not None and impl == "pallas":
        raise NotImplementedError(f"MemorySpec: impl='pallas': the deep-memory kernel does not take "
                                  f"{gap}; use impl='chunk' or 'auto'")
    return gap is None


def chunked_sequence(spec, state: MemoryState, steps: Steps, *, chunk_size: int, features=None,
                     low_precision: bool = False, fresh_opt_state: bool = False):
    """Chunk-start-gradient form for one sequence and head; steps already padded to a multiple
    of ``chunk_size``. Returns (final state, outputs [S, d_out]).

    Specs the dual form covers (``dual.covers``) run in O(T·d) memory through it once a chunk's
    materialised states would reach ``DUAL_FORM_MIN_BYTES``; the others materialise every step's θ
    inside a chunk, one chunk at a time (rematerialised in the backward pass, so memory is
    O(chunk·|θ|) plus the chunk boundaries).

    ``features`` (a ``common.Features``): the steps carry the raw k and scale·q and φ is applied
    here — chunk by chunk inside the dual form, so that no [S, d_φ] array is kept for the backward
    pass (degree-2 features at d = 128 are 8385 wide); to the whole sequence before the
    materialising form. None: the steps carry φ(k) and φ(scale·q) already. ``low_precision`` (bf16
    q, k, v): the dual form's products with θ take bf16 operands (`dual.operand_dtype`); the
    materialising form ignores it. ``fresh_opt_state``: ``state``'s optimizer state is the
    optimizer's init (`dual.dual_sequence`)."""
    from atlas_jax.forms import dual

    d_in = None if features is None else features.output_dim(steps.inputs.shape[-1])
    if runs_dual_form(spec, state, steps, chunk_size=chunk_size, d_in=d_in):
        return dual.dual_sequence(spec, state, steps, chunk_size=chunk_size, features=features,
                                  low_precision=low_precision, fresh_opt_state=fresh_opt_state)
    if features is not None:
        steps = steps._replace(inputs=features(steps.inputs), queries=features(steps.queries))
    return _materialising_sequence(spec, state, steps, chunk_size=chunk_size)


def _materialising_sequence(spec, state: MemoryState, steps: Steps, *, chunk_size: int):
    memory, objective, retention = spec.memory, spec.objective, spec.retention
    opt_info = inner_opt.info(spec.optimizer)
    c, b = spec.window, chunk_size
    n_chunks = steps.active.shape[0] // b
    chunks = jax.tree.map(lambda x: x.reshape((n_chunks, b) + x.shape[1:]), steps)
    window_index = jnp.arange(b)[:, None] + jnp.arange(c)[None, :]   # step t's window in the extended arrays
    channel_axes = memory.channel_axes(state.params)

    def one_chunk(carry: MemoryState, xc: Steps):
        params0, opt_state, acc0, win = carry
        gates = xc.gates * xc.active
        ext = {"inputs": xc.inputs, "targets": xc.targets, "weights": gates, "delta": xc.delta}
        if win is not None:   # prepend the previous c − 1 steps
            ext = {"inputs": jnp.concatenate([win.inputs, xc.inputs]),
                   "targets": jnp.concatenate([win.targets, xc.targets]),
                   "weights": jnp.concatenate([win.weights, gates]),
                   "delta": None if xc.delta is None else jnp.concatenate([win.delta, xc.delta])}
        windows = {key: None if value is None else value[window_index] for key, value in ext.items()}
        windows["weights"] = windows["weights"] * xc.active[:, None]   # padding steps take no gradient
        if xc.window_gates is not None:   # step t's own weight of each window position
            windows["weights"] = windows["weights"] * xc.window_gates
        points = _gradient_points(spec, params0, acc0, xc, channel_axes)

        grads = jax.vmap(lambda p, x, y, w, d: window_gradient(memory, objective, p, x, y, w, d),
                         in_axes=(0, 0, 0, 0, None if windows["delta"] is None else 0))(
            points, windows["inputs"], windows["targets"], windows["weights"], windows["delta"])
        sq_norm = jnp.sum(windows["weights"] * jnp.sum(jnp.square(windows["inputs"]), axis=-1), axis=-1)

        base0 = acc0 if retention.has_map else params0
        if opt_info.kind in _PARALLEL_KINDS:
            updates, new_opt_state = _parallel_updates(opt_info, grads, opt_state, xc, sq_norm, channel_axes)
            acc = _retention_recurrence(spec, base0, updates, xc, channel_axes)
        else:
            acc, updates, new_opt_state = _scanned_steps(spec, grads, opt_state, base0, xc, windows, sq_norm,
                                                         channel_axes)
        # The chunk-end state (Muon's orthogonalised step, a chunk-end map) is what the state
        # carries from the chunk's last real step on, and what the chunk's last position reads.
        # Reads before it read the linear state, also on a sequence's last step inside a chunk,
        # which a longer sequence reads mid-chunk: an output must not depend on what follows.
        reads_end = jnp.arange(b) == b - 1
        pick = lambda mask, at_end, linear: jax.tree.map(
            lambda e, w: jnp.where(mask.reshape((-1,) + (1,) * (e.ndim - 1)), e, w), at_end, linear)
        read_acc = acc
        if opt_info.kind == "muon" and opt_info.ns_every == "chunk":
            linear_acc = acc
            acc = _chunk_end_orthogonalized(spec, opt_info, base0, acc, new_opt_state.momentum, xc)
            read_acc = pick(reads_end, acc, linear_acc)
        if not retention.has_map:
            params, read_params = acc, read_acc
        elif retention.map_at == "token":
            params, read_params = jax.vmap(retention.map)(acc), jax.vmap(retention.map)(read_acc)
        else:   # linear inside the chunk from θ₀, the map at its end
            linear = _retention_recurrence(spec, params0, updates, xc, channel_axes)
            mapped = jax.vmap(retention.map)(acc)
            params = pick(_last_real_step(xc.active), mapped, linear)
            read_params = pick(reads_end, mapped, linear)
        outputs = jax.vmap(memory.apply)(read_params, xc.queries)

        last_params, last_acc = jax.tree.map(lambda x: x[-1], (params, acc))
        new_win = None
        if win is not None:
            keep = lambda x: x[-(c - 1):]
            new_win = WindowCache(keep(ext["inputs"]), keep(ext["targets"]), keep(ext["weights"]),
                                  win.delta if ext["delta"] is None else keep(ext["delta"]))
        new_state = MemoryState(last_params, new_opt_state, last_acc if retention.has_map else None, new_win)
        return new_state, outputs

    # Rematerialised per chunk: the backward pass keeps only the chunk-boundary states.
    final, outputs = jax.lax.scan(jax.checkpoint(restarting_chunks(one_chunk, state)), state, chunks)
    return final, outputs.reshape((n_chunks * b,) + outputs.shape[2:])
