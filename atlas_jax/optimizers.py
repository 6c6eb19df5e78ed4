"""Axis 3 — inner optimizers, as optax transforms.

Every factory here returns an ``optax.GradientTransformationExtraArgs`` with a NamedTuple state,
so it composes with optax (``optax.chain``) and, the other way round, any optax transform can be
used as an inner optimizer (``optax.adam(1e-2)`` included). Updates follow optax's sign
convention: θ ← θ + updates (before retention, which is its own axis).

The recurrence passes per-token knobs as keyword-only extra args; a transform ignores the ones it
does not use and plain optax transforms never see them (``optax.with_extra_args_support``):

  ``step_size``      β_t, the inner learning rate (default: the factory's ``step_size``)
  ``momentum_decay`` ν_t (default: the factory's ``momentum_decay``)
  ``input_sq_norm``  Σ_i γ_i ‖φ(k_i)‖² over the window (implicit GD)
  ``inputs``, ``targets``, ``weights``   the window's φ(k_i), v_i and γ_i (closed-form solvers)
  ``decay``          α_t = exp(g_t), the token's retention factor (least squares forgets through it)

The factories also record what they are (``info(opt)``): the chunked form uses it to run GD,
momentum and Muon as parallel in-chunk linear recurrences; any other transform is run as a scan.
"""
from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax.ad_checkpoint import checkpoint_name

from atlas_jax.linalg import gram as gram_matrix, product

__all__ = [
    "OptimizerInfo", "MomentumState", "LeastSquaresState", "MUON_COEFFICIENTS", "CUBIC_COEFFICIENTS",
    "gd", "momentum", "muon", "implicit_gd", "least_squares", "multi_step", "newton_schulz",
    "info", "describe", "get_optimizer", "scale_tree",
]

# Muon's quintic (Jordan et al. 2024): fast, and deliberately not convergent (singular values land
# in ≈ [0.7, 1.2]); the cubic (3/2, −1/2, 0) converges to the polar factor for ‖X‖₂ < √3.
MUON_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
CUBIC_COEFFICIENTS = (1.5, -0.5, 0.0)


class OptimizerInfo(NamedTuple):
    kind: str                      # gd | momentum | muon | implicit_gd | least_squares | optax
    step_size: float | None = None
    momentum_decay: float | None = None
    ns_steps: int | None = None
    ns_coefficients: tuple | None = None
    ns_eps: float = 1e-7
    ridge: float | None = None
    steps: int = 1                 # inner steps per token (DeltaProduct-style multi-step GD)
    step_inside: bool = False      # momentum: β_t scales the gradient before it enters m (Titans)
    ns_every: str = "token"        # muon: Newton–Schulz on every m_t ("token") or at chunk ends ("chunk")
    ns_dtype: str = "float32"      # muon: Newton–Schulz's matmul operands (accumulation float32)
    ns_method: str = "auto"        # muon: Newton–Schulz evaluated on X ("direct") or via its Gram ("gram")


class MomentumState(NamedTuple):
    momentum: Any


class LeastSquaresState(NamedTuple):
    gram: jax.Array   # Σ decayed γ φ(k) φ(k)ᵀ  [d_in, d_in]
    cross: jax.Array  # Σ decayed γ φ(k) vᵀ     [d_in, d_out]


def _tag(init, update, opt_info: OptimizerInfo) -> optax.GradientTransformationExtraArgs:
    update.atlas_info = opt_info
    return optax.GradientTransformationExtraArgs(init, update)


def info(opt) -> OptimizerInfo:
    """What an inner optimizer is; transforms not built here report kind 'optax'."""
    return getattr(opt.update, "atlas_info", None) or OptimizerInfo(kind="optax")


def describe(opt) -> str:
    i = info(opt)
    if i.kind == "muon":
        text = f"GD + momentum + Newton–Schulz (J={i.ns_steps}{', per chunk' if i.ns_every == 'chunk' else ''})"
    elif i.kind == "least_squares":
        text = f"exact least squares over all past (ridge λ={i.ridge:g}, gated statistics)"
    else:
        text = {"gd": "GD", "momentum": "GD + momentum", "implicit_gd": "implicit GD",
                "optax": "optax transform"}[i.kind]
        if i.kind == "momentum" and i.step_inside:
            text = "GD + momentum (step inside)"
    return f"{i.steps} × {text} per token" if i.steps > 1 else text


def _positive(name, value):
    if not isinstance(value, (int, float)) or value <= 0:
        raise ValueError(f"{name} must be a positive number, got {value!r}")


def _step(step_size, default):
    return default if step_size is None else step_size


def scale_tree(factor, tree):
    """factor ⊙ tree, where ``factor`` is a scalar or a tree shaped like ``tree`` whose leaves
    broadcast against its leaves (how the recurrence hands over channel-wise β_t and ν_t)."""
    if isinstance(factor, dict):
        return jax.tree.map(lambda f, x: f * x, factor, tree)
    return jax.tree.map(lambda x: factor * x, tree)


def gd(step_size: float = 1.0) -> optax.GradientTransformationExtraArgs:
    """One gradient step per token: updates = −β_t ∇."""
    _positive("gd: step_size", step_size)

    default_beta = step_size

    def init(params):
        del params
        return optax.EmptyState()

    def update(grads, state, params=None, *, step_size=None, **extra):
        beta = _step(step_size, default_beta)
        return scale_tree(beta, jax.tree.map(jnp.negative, grads)), state

    return _tag(init, update, OptimizerInfo(kind="gd", step_size=step_size))


def implicit_gd(step_size: float = 1.0) -> optax.GradientTransformationExtraArgs:
    """Implicit (proximal) GD, Longhorn: θ_t = argmin ½‖θ − θ_{t−1}‖² + β ℓ(θ).

    Exact for a linear memory with the ℓ2 objective, where it is GD with the step
    β / (1 + β ‖φ(k)‖²) (Sherman–Morrison); for other memories/objectives the same scalar
    curvature ‖φ(k)‖² is used as a (Gauss–Newton-style) approximation.
    """
    _positive("implicit_gd: step_size", step_size)

    default_beta = step_size

    def init(params):
        del params
        return optax.EmptyState()

    def update(grads, state, params=None, *, step_size=None, input_sq_norm=None, **extra):
        beta = _step(step_size, default_beta)
        if input_sq_norm is None:
            raise ValueError("implicit_gd needs the extra arg input_sq_norm (Σ γ‖φ(k)‖²); "
                             "the atlas_jax recurrence passes it, call it through MemorySpec")
        if isinstance(beta, dict):
            eff = jax.tree.map(lambda b: b / (1.0 + b * input_sq_norm), beta)
        else:
            eff = beta / (1.0 + beta * input_sq_norm)
        return scale_tree(eff, jax.tree.map(jnp.negative, grads)), state

    return _tag(init, update, OptimizerInfo(kind="implicit_gd", step_size=step_size))


def _momentum_pieces(momentum_decay):
    if not 0 <= momentum_decay <= 1:
        raise ValueError(f"momentum_decay must be in [0, 1], got {momentum_decay!r}")

    def init(params):
        return MomentumState(momentum=jax.tree.map(lambda p: jnp.zeros_like(p, jnp.float32), params))

    def trace(grads, state, nu):
        return jax.tree.map(jnp.add, scale_tree(nu, state.momentum), grads)

    return init, trace


def momentum(step_size: float = 1.0, momentum_decay: float = 0.9, *,
             step_inside: bool = False) -> optax.GradientTransformationExtraArgs:
    """Gradient descent with momentum, in either of the two conventions of the seeds.

    ``step_inside=False`` (the blog's Adam-style form, seed 000 §3; ATLAS' Muon without NS):
        m_t = ν_t m_{t−1} + ∇ℓ,        updates = −β_t m_t
    ``step_inside=True`` (the Titans paper, MIRAS Table 1 "Titans-LMM"; the titans preset):
        S_t = η_t S_{t−1} − θ_t ∇ℓ,    updates = S_t        (η_t = ν_t, θ_t = β_t)
    so that M_t = α_t M_{t−1} + S_t with retention. The two agree when β is constant in time;
    with a per-token β the step of an old token is its own β_i (inside) rather than today's β_t.
    The state holds m_t (outside) or S_t (inside).
    """
    _positive("momentum: step_size", step_size)
    init, trace = _momentum_pieces(momentum_decay)
    default_beta, default_nu = step_size, momentum_decay

    def update(grads, state, params=None, *, step_size=None, momentum_decay=None, **extra):
        nu = _step(momentum_decay, default_nu)
        beta = _step(step_size, default_beta)
        if step_inside:
            s_t = trace(scale_tree(beta, jax.tree.map(jnp.negative, grads)), state, nu)
            return s_t, MomentumState(s_t)
        m = trace(grads, state, nu)
        return scale_tree(beta, jax.tree.map(jnp.negative, m)), MomentumState(m)

    return _tag(init, update, OptimizerInfo(kind="momentum", step_size=step_size,
                                            momentum_decay=momentum_decay, step_inside=bool(step_inside)))


def _coefficients(coefficients):
    if isinstance(coefficients, str):
        table = {"muon": MUON_COEFFICIENTS, "cubic": CUBIC_COEFFICIENTS}
        if coefficients not in table:
            raise ValueError(f"muon: coefficients must be 'muon', 'cubic' or (a, b, c), got {coefficients!r}")
        return table[coefficients]
    coefficients = tuple(float(c) for c in coefficients)
    if len(coefficients) != 3:
        raise ValueError(f"muon: coefficients must have 3 entries (a, b, c), got {coefficients!r}")
    return coefficients


NS_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}


NS_METHODS = ("auto", "direct", "gram")
# "auto" takes the Gram route where it saves enough of the direct iteration's FLOPs to pay for its
# n × n chain's launches. For an a : 1 matrix and J = 5 it does (20a + 10)/(8a + 30) times fewer
# (1.45 at a = 4, 1.7 at a = 6). Either (least entries, least aspect) pair below takes it; on an
# H200 (float32 at the default precision; `benchmarks/results/ns_gram_threshold_h200_2026-12-01.md`,
# `newton_schulz_gram_h200_2026-11-26.md`):
#   * from 2¹⁸ entries at 4:1: [2145, 256] 0.96 against 1.60 ms (64 matrices);
#   * from 2¹⁴ entries at 6:1: atlas 170m's [1225, 192] 0.359 against 0.501 ms and [1225, 48] 0.106
#     against 0.130 (32 matrices); at 4:1 and below 2¹⁸ the chain breaks even or loses: [192, 48]
#     0.059 against 0.049 ms, and atlas' dual form with its [512, 128] W1 at B1 H8 took 437.8
#     against 435.2 ms a layer's fwd+bwd.
_GRAM_ROUTE = ((1 << 18, 4), (1 << 14, 6))


def newton_schulz(x: jax.Array, steps: int, coefficients=MUON_COEFFICIENTS, eps: float = 1e-7,
                  operand_dtype: str = "float32", method: str = "auto", residual_name: str | None = None) -> jax.Array:
    """Newton–Schulz orthogonalisation of a matrix (Muon): X ← aX + (bA + cA²)X, A = XXᵀ.

    Frobenius-normalised first (so every singular value starts ≤ 1); a tall matrix is transposed so
    that the Gram matrix A is the smaller one. The iterate, the norm and every accumulation are
    float32; ``operand_dtype`` "bfloat16" rounds the forward matmuls' operands to bf16 (Muon's
    practice: about twice the tensor-core rate of TF32; the result moves by a few 1e-2 of its
    largest entry), while the backward's take float32 ones (below).

    ``method``: the same polynomial of X evaluated two ways. "direct" iterates on X [n, m] (n ≤ m):
    two n × n × m products per step. "gram" iterates on n × n matrices only: every step is
    X_k = R_k X_0 with R_k a polynomial in A_0 = X_0 X_0ᵀ, so it carries R and A_k = R A_0 Rᵀ and
    forms X once at the end — for atlas' [2145, 256] momenta 1.6 GFLOP instead of 3.0 per
    orthogonalisation (J = 5), and no m-wide iterate kept for the backward pass. Two things keep it
    as accurate as "direct": one restart halfway (X formed, its Gram recomputed: A_0 resolves
    singular values only down to √ε of the largest), and R X taken as αX + (R − αI)X with
    α = tr(R)/n, so that R's scalar part (up to a^J ≈ 480 on small singular directions) is not
    rounded with the matmul operands. Largest difference from a float64 iteration on Gaussian and
    ill-conditioned [2145, 256] matrices: float32 1.0e-5 (direct 9.4e-6), TF32-rounded operands
    (a GPU's default float32 matmul) 5.7e-3 (direct 5.6e-3), bf16 operands 5.1e-2 (direct 4.6e-2;
    `benchmarks/results/ns_gram_route_cpu_2026-11-26.md`).
    "auto": "gram" on matrices at least 4× longer than wide with ≥ 2¹⁸ entries or at least 6× longer
    with ≥ 2¹⁴ entries, else "direct".

    ``residual_name``: a `jax.ad_checkpoint.checkpoint_name` given to the norm and the Gram
    matrices of x (the products that read all of it), so that a rematerialisation policy can keep
    them: the dual form's chunks do, and their rematerialisation in the backward pass then forms
    the n × n chain again from the kept Gram matrices rather than x's. atlas' layer (B1 T4096 H8
    D128 bf16, NS per chunk, fwd+bwd, one command on an H200): 630.7 -> 609.0 ms, for 0.34 GiB
    more compiled memory (XLA's analysis, CPU); naming the n × n chain's matrices too gave 610.3
    ms for 2.2 GiB more (`benchmarks/results/atlas_ns_residuals_h200_2026-11-29.md`).
    With bf16 operands too: its difference is the direct route's order (above), it memorises the
    same (recall within 1e-3, `deep_memory_h200_2026-11-27f.md`), and atlas' layer (B1 T1024 H8
    D128, NS per chunk on bf16 operands, fwd+bwd, one command on an H200) takes 131.2 ms through
    it against 187.7 direct (166.1 with float32 operands through the Gram matrix).
    """
    if method not in NS_METHODS:
        raise ValueError(f"newton_schulz: argument `method` must be one of {NS_METHODS}; got {method!r}.")
    a, b, c = coefficients
    # bf16 operands through `linalg.product`, the backward's products on float32 ones: NS's
    # derivative is up to a^J ≈ 480 on x's near-null directions, and a cotangent rounded to bf16
    # there leaks into the rest, chunk after chunk in the dual form (atlas with ns_dtype="bfloat16",
    # B1 T16384 H8 D128 bf16 on an H200: max |dk| of the first 2048 tokens 7.8e15 with the backward
    # on bf16 operands, 2.8 on float32 ones, float32 throughout 0.74; 1.16× the layer's time at B1
    # T4096; benchmarks/results/atlas_backward_growth_h200_2026-11-29.md)
    low = None if operand_dtype == "float32" else jnp.dtype(NS_DTYPES[operand_dtype])
    kept = (lambda u: u) if residual_name is None else (lambda u: checkpoint_name(u, residual_name))
    mm = lambda u, v: product(u, v, "nn", low, None)
    x = x.astype(jnp.float32)
    # A tall matrix keeps its layout: its Gram matrix is XᵀX and the polynomial multiplies from the
    # right (X (bA + cA²)ᵀ for the wide (bA + cA²) X), the same products without transposing a
    # state-sized X twice per orthogonalisation.
    tall = x.shape[-2] > x.shape[-1]
    # (`linalg.gram`: one state-sized product in its backward, x (g + gᵀ), where product(x, x)'s
    # backward takes two and their sum)
    gram_of = lambda u: kept(gram_matrix(u, "tn" if tall else "nt", low, None))
    apply_left = (lambda left, u: product(u, left, "nt", low, None)) if tall else mm
    # A zero momentum (an empty packed row, a token without gradient) must give a zero direction
    # and a finite gradient: √ has an infinite derivative at 0, so take it only where it is > 0.
    sq = jnp.sum(jnp.square(x), axis=(-2, -1), keepdims=True)
    norm = kept(jnp.where(sq > 0, jnp.sqrt(jnp.where(sq > 0, sq, 1.0)), 0.0))
    x = x / (norm + eps)
    short, long = min(x.shape[-2:]), max(x.shape[-2:])
    if method == "auto":
        takes = any(long * short >= size and long >= aspect * short for size, aspect in _GRAM_ROUTE)
        method = "gram" if takes else "direct"
    if method == "gram":
        return _newton_schulz_gram(x, steps, coefficients, mm, gram_of, apply_left, short)
    for _ in range(steps):
        gram = gram_of(x)
        x = a * x + apply_left(b * gram + c * mm(gram, gram), x)
    return x


def _newton_schulz_gram(x, steps, coefficients, mm, gram_of, apply_left, short):
    """`newton_schulz`'s steps on a normalised x through short × short matrices only (``gram_of``:
    its Gram matrix on the short side; ``apply_left(R, x)``: R X for a wide x, X Rᵀ for a tall one).

    x is normalised by a state-sized pass of its own. Folded into the n × n matrices instead
    (X_0 = s x, A_0 = s² xᵀx with s from tr(xᵀx)) that pass goes, but the backward's radial
    cancellation (R's scalar part, up to a⁵ ≈ 480, against the rest) then happens in sums of n × n
    products rather than elementwise: atlas' skip-map gradient (d_φ 2145, hidden 128, 21 tokens,
    chunk 8, against a float64 evaluation of the layer) went from 6.3e-5 to 1.7e-4 (direct: 2.6e-5).
    Not kept."""
    a, b, c = coefficients
    t = lambda u: jnp.swapaxes(u, -1, -2)
    eye = jnp.eye(short, dtype=jnp.float32)

    def times_x(right, x):
        # R X as αX + (R − αI)X, α = tr(R)/n: R's scalar part (a^k on the small singular
        # directions, up to 3.4^5) stays out of the rounded matmul operands
        alpha = jnp.trace(right, axis1=-2, axis2=-1)[..., None, None] / short
        return alpha * x + apply_left(right - alpha * eye, x)

    restart = steps // 2 + 1 if steps >= 3 else None
    gram0 = gram = gram_of(x)
    right = None                       # X_k = right @ X_0 (None: the identity)
    for k in range(steps):
        if k == restart:
            x = times_x(right, x)
            gram0 = gram = gram_of(x)
            right = None
        poly = a * eye + b * gram + c * mm(gram, gram)
        right = poly if right is None else mm(poly, right)
        if k + 1 < steps and k + 1 != restart:
            gram = mm(mm(right, gram0), t(right))
    return x if right is None else times_x(right, x)


class NewtonSchulzFactor(NamedTuple):
    """NS_J(m) = scale·m + m·right for a matrix m known only through its Gram matrix mᵀm
    (`newton_schulz_factor`): ``scale`` [] and ``right`` [n, n] float32."""
    scale: jax.Array
    right: jax.Array


def newton_schulz_factor(gram: jax.Array, steps: int, coefficients=MUON_COEFFICIENTS,
                         eps: float = 1e-7, precision=jax.lax.Precision.HIGHEST) -> NewtonSchulzFactor:
    """`newton_schulz` of a matrix m [k, n] from its Gram matrix mᵀm [n, n] alone: every iterate is
    X_{j+1} = X_j P_j with P_j = aI + bA_j + cA_j² (A_j = X_jᵀX_j; the same as (aI + bXXᵀ + c(XXᵀ)²) X),
    so NS_J(m) = m R/(‖m‖ + eps) with R = P_0 ⋯ P_{J−1} [n, n], whichever side of m is longer. For
    the dual form, which knows a momentum as a low-rank update of a materialised one and carries
    its Gram matrix, never m itself (`forms.dual`'s Muon super-chunks).

    The chain carries A_{j+1} = P_j A_j P_j and R, every product float32-accurate (``precision``:
    HIGHEST, or a multi-pass algorithm such as `DotAlgorithmPreset.BF16_BF16_F32_X3`, which the dual
    form passes), whatever the momentum's NS operand dtype: unlike the direct iteration,
    which forms every Gram matrix again from its iterate, the chain never sees m again, so a rounding
    error in A_j on a null or small singular direction (a momentum of decayed gradients has many) is
    amplified by P ≈ a there every step, and R's eigenvalues run from ~1 (the large singular
    directions) to a^J ≈ 480 (the small ones, which m removes again): on TF32 operands the chain was
    0.23 off `newton_schulz` for a momentum of 300 rank-one terms decayed by 0.9 (512 × 64; the
    direct iteration on TF32 operands: 1e-3), on bf16 ones it diverged. R must be applied at such a
    precision too. Returned as scale·m + m·right, scale = α/(‖m‖ + eps), α = tr(R)/n. Singular
    values below ~√ε of the largest are resolved no better than A₀ resolves them (float32: within
    ~1e-5 of `newton_schulz` on a square Gaussian m, tested). A zero m gives a zero factor (and
    finite gradients)."""
    a, b, c = coefficients
    mm = lambda u, v: jnp.matmul(u, v, precision=precision)
    gram = gram.astype(jnp.float32)
    short = gram.shape[-1]
    eye = jnp.eye(short, dtype=jnp.float32)
    sq = jnp.trace(gram, axis1=-2, axis2=-1)[..., None, None]
    norm = jnp.where(sq > 0, jnp.sqrt(jnp.where(sq > 0, sq, 1.0)), 0.0)
    inverse = jnp.where(sq > 0, 1.0 / (norm + eps), 0.0)
    gram = gram * jnp.square(inverse)
    total = None                       # R = P_0 ⋯ P_j (the P_j commute)
    for k in range(steps):
        poly = a * eye + b * gram + c * mm(gram, gram)
        total = poly if total is None else mm(total, poly)
        if k + 1 < steps:
            gram = mm(mm(poly, gram), poly)
    if total is None:
        return NewtonSchulzFactor(inverse[..., 0, 0], jnp.zeros_like(gram))
    alpha = jnp.trace(total, axis1=-2, axis2=-1)[..., None, None] / short
    return NewtonSchulzFactor((alpha * inverse)[..., 0, 0], (total - alpha * eye) * inverse)


def orthogonalize_tree(tree, steps, coefficients, eps, operand_dtype: str = "float32", matrix_ndim: int = 2,
                       method: str = "auto", residual_name: str | None = None):
    """Newton–Schulz on every matrix leaf (``matrix_ndim`` 3: a leading batch of matrices);
    vectors/scalars pass through (as in Muon practice). ``residual_name``: `newton_schulz`'s."""
    return jax.tree.map(lambda m: newton_schulz(m, steps, coefficients, eps, operand_dtype, method, residual_name)
                        if m.ndim == matrix_ndim else m, tree)


def orthogonalize(tree, opt_info: OptimizerInfo, matrix_ndim: int = 2, residual_name: str | None = None):
    """``orthogonalize_tree`` with a muon's settings (its OptimizerInfo): what the chunked forms call."""
    return orthogonalize_tree(tree, opt_info.ns_steps, opt_info.ns_coefficients, opt_info.ns_eps,
                              opt_info.ns_dtype, matrix_ndim, opt_info.ns_method, residual_name)


NS_SCHEDULES = ("token", "chunk")


def muon(step_size: float = 1.0, momentum_decay: float = 0.9, ns_steps: int = 5,
         coefficients="muon", eps: float = 1e-7, ns_every: str = "token",
         ns_dtype: str = "float32", ns_method: str = "auto") -> optax.GradientTransformationExtraArgs:
    """ATLAS (eq. 32–33): S_t = θ_t S_{t−1} + ∇ℓ, M_t = α_t M_{t−1} − η_t NewtonSchulz_J(S_t),
    i.e. m_t = ν_t m_{t−1} + ∇, updates = −β_t NS_J(m_t): the step multiplies after the momentum
    (the convention of ``momentum(step_inside=False)``).

    ``ns_every`` says where the chunked form (``impl="chunk"``) orthogonalises; the recurrent form
    and this transform's own ``update`` always do it per token (the two coincide at chunk size 1):

    * ``"token"`` (ATLAS as written): NS_J on every m_t. It has no low-rank form, so the chunked
      form materialises every step's θ_t inside a chunk (memory O(chunk·|θ|), rematerialised per
      chunk in the backward pass).
    * ``"chunk"``: inside a chunk of b steps with chunk-start gradients, the momentum runs as
      usual, m_t = ν_t m_{t−1} + g_t, and the reads of steps 1..b−1 use the plain momentum updates,
      θ_t = P_t θ₀ − Σ_{i≤t} (P_t/P_i) β_i m_i (P_t = Π_{j≤t} α_j, retention's decay). At the chunk's
      last step the chunk's steps are taken along the orthogonalised chunk-end momentum instead:
          θ_b = P_b θ₀ − (Σ_{i≤b} (P_b/P_i) β_i) · NS_J(m_b),
      which is the state carried into the next chunk and the one the last step reads (with b = 1
      this is exactly the per-token update). The momentum state carried is m_b (never
      orthogonalised). Every read inside the chunk is then linear in the chunk's gradients, which
      is what the O(T·d) dual form (forms/dual.py) needs.

    ``ns_dtype``: Newton–Schulz's matmul operands, "float32" (default) or "bfloat16" (as Muon runs
    it; the iterate, the accumulations and the backward's products stay float32). NS on [d_φ, h]
    momenta is most of ATLAS' FLOPs.

    ``ns_method``: how Newton–Schulz is evaluated (`newton_schulz`): "direct", "gram" (through the
    n × n Gram matrix, for tall momenta) or "auto" (default: "gram" where it saves work).
    """
    _positive("muon: step_size", step_size)
    if not isinstance(ns_steps, int) or ns_steps < 0:
        raise ValueError(f"muon: ns_steps must be an int >= 0, got {ns_steps!r}")
    if ns_every not in NS_SCHEDULES:
        raise ValueError(f"muon: ns_every must be one of {NS_SCHEDULES}, got {ns_every!r}")
    if ns_dtype not in NS_DTYPES:
        raise ValueError(f"muon: ns_dtype must be one of {tuple(NS_DTYPES)}, got {ns_dtype!r}")
    if ns_method not in NS_METHODS:
        raise ValueError(f"muon: ns_method must be one of {NS_METHODS}, got {ns_method!r}")
    coeffs = _coefficients(coefficients)
    init, trace = _momentum_pieces(momentum_decay)
    default_beta, default_nu = step_size, momentum_decay

    def update(grads, state, params=None, *, step_size=None, momentum_decay=None, **extra):
        nu = _step(momentum_decay, default_nu)
        beta = _step(step_size, default_beta)
        m = trace(grads, state, nu)
        direction = orthogonalize_tree(m, ns_steps, coeffs, eps, ns_dtype, method=ns_method)
        return scale_tree(beta, jax.tree.map(jnp.negative, direction)), MomentumState(m)

    return _tag(init, update, OptimizerInfo(kind="muon", step_size=step_size, momentum_decay=momentum_decay,
                                            ns_steps=ns_steps, ns_coefficients=coeffs, ns_eps=eps,
                                            ns_every=ns_every, ns_dtype=ns_dtype, ns_method=ns_method))


def least_squares(ridge: float = 1.0) -> optax.GradientTransformationExtraArgs:
    """MesaNet: θ_t = argmin Σ_i decayed γ_i ½‖v_i − θᵀφ(k_i)‖² + ½λ‖θ‖², solved exactly.

    Keeps the sufficient statistics (Gram and cross-covariance, decayed by α_t = ``decay``) and
    returns updates = θ* − θ_{t−1}. Linear memory only. Pair it with retention ``none``: the
    forgetting acts on the statistics, not on θ.
    """
    _positive("least_squares: ridge", ridge)

    def init(params):
        if set(params) != {"S"} or params["S"].ndim != 2:
            raise ValueError("least_squares: works on a linear memory (params {'S': [d_in, d_out]}), "
                             f"got params with keys {sorted(params)}")
        d_in, d_out = params["S"].shape
        return LeastSquaresState(gram=jnp.zeros((d_in, d_in), jnp.float32),
                                 cross=jnp.zeros((d_in, d_out), jnp.float32))

    def update(grads, state, params=None, *, inputs=None, targets=None, weights=None, decay=None, **extra):
        if inputs is None or targets is None:
            raise ValueError("least_squares needs the extra args inputs/targets (the window's φ(k), v); "
                             "the atlas_jax recurrence passes them, call it through MemorySpec")
        w = jnp.ones(inputs.shape[:1], jnp.float32) if weights is None else weights
        alpha = 1.0 if decay is None else decay
        gram = alpha * state.gram + jnp.einsum("N,NI,NJ->IJ", w, inputs, inputs)
        cross = alpha * state.cross + jnp.einsum("N,NI,NV->IV", w, inputs, targets)
        eye = jnp.eye(gram.shape[0], dtype=gram.dtype)
        solution = jnp.linalg.solve(gram + ridge * eye, cross)
        return {"S": solution - params["S"]}, LeastSquaresState(gram, cross)

    return _tag(init, update, OptimizerInfo(kind="least_squares", ridge=ridge))


def multi_step(opt, steps: int) -> optax.GradientTransformationExtraArgs:
    """``steps`` inner steps per token (DeltaProduct): the recurrence re-evaluates the gradient
    before each one; with several keys/values per token, step j uses the j-th pair."""
    if not isinstance(steps, int) or steps < 1:
        raise ValueError(f"multi_step: steps must be an int >= 1, got {steps!r}")
    inner = optax.with_extra_args_support(opt)

    def update(grads, state, params=None, **extra):
        return inner.update(grads, state, params, **extra)

    return _tag(inner.init, update, info(opt)._replace(steps=steps))


_OPTIMIZERS = {"gd": gd, "momentum": momentum, "muon": muon, "implicit_gd": implicit_gd,
               "least_squares": least_squares}


def get_optimizer(name: str, **kwargs):
    """Inner optimizer by name (gd, momentum, muon, implicit_gd, least_squares, or optax:<name>)."""
    if name.startswith("optax:"):
        factory = getattr(optax, name.split(":", 1)[1], None)
        if factory is None:
            raise ValueError(f"optimizer: optax has no transform {name.split(':', 1)[1]!r}")
        return factory(**kwargs)
    if name not in _OPTIMIZERS:
        raise ValueError(f"optimizer: unknown name {name!r}; choose one of {sorted(_OPTIMIZERS)} "
                         "or 'optax:<transform>' (e.g. optax:adam)")
    return _OPTIMIZERS[name](**kwargs)
