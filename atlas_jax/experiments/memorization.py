"""Test-time memorisation: how many random key/value pairs can each memory hold?

Stream n pairs (k_i, v_i) — unit random keys in ℝ^{d_k}, unit random values in ℝ^{d_v} — through a
memory (``passes`` times, same order), then query every key with the final state and score

* cosine recall: mean_i cos(M(φ(k_i)), v_i);
* exact-match accuracy: fraction of i whose read-out is closer (in cosine) to v_i than to any other
  stored v_j.

For a linear memory the ceiling is n ≈ d_k (seeds 004 §3, 000 §1): past it the keys cannot be
orthogonal and cross-talk swamps the signal. Polynomial features (φ of degree p has C(d_k+p, p)
dimensions) and deep memories raise it. Everything runs jitted on CPU in a couple of minutes.
Each memory's inner step size is the best of a small grid (per n), applied identically to all.
"""
from __future__ import annotations

import dataclasses
import json
import math
import time
from dataclasses import dataclass
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax

from atlas_jax import optimizers as opt
from atlas_jax import retention as ret
from atlas_jax.config import Config, ConfigError, ensure_output_dir, setting
from atlas_jax.features import Identity, Polynomial
from atlas_jax.memory import LinearMemory, MLPMemory
from atlas_jax.objectives import L2, Dot
from atlas_jax.spec import MemorySpec

__all__ = ["MemorizationConfig", "MEMORIES", "POLYNOMIAL_MEMORIES", "run", "format_table", "plot", "main"]


# name -> (label, spec factory(config), step-size grid)
def _linear(objective, retention=None, feature_map=None):
    def make(cfg):
        return MemorySpec(LinearMemory(), feature_map(cfg) if feature_map else Identity(), objective, 1,
                          opt.gd(), retention or ret.none())
    return make


def _atlas_chunked(cfg, ns_every, ns_dtype="float32", ns_method="auto"):
    return MemorySpec(MLPMemory(2, cfg.hidden, residual=True), Polynomial(cfg.degree), L2(), cfg.window,
                      opt.muon(1.0, 0.9, 5, ns_every=ns_every, ns_dtype=ns_dtype, ns_method=ns_method),
                      ret.scalar(0.0, decoupled=True),
                      impl="chunk", chunk_size=cfg.chunk_size)


MEMORIES = {
    "linear_attention": ("linear attention", _linear(Dot()), (0.25, 0.5, 1.0)),
    "deltanet": ("DeltaNet", _linear(L2()), (0.5, 0.8, 1.0)),
    "gated_deltanet": ("Gated DeltaNet (α=0.98)", _linear(L2(), ret.scalar(math.log(0.98))), (0.5, 0.8, 1.0)),
    "deltanet_poly2": ("DeltaNet on φ = poly(2)", _linear(L2(), feature_map=lambda c: Polynomial(c.degree)),
                       (0.25, 0.5, 0.8)),
    "titans_mlp": ("Titans MLP + momentum",
                   lambda c: MemorySpec(MLPMemory(2, c.hidden), Identity(), L2(), 1, opt.momentum(1.0, 0.9),
                                        ret.scalar(0.0, decoupled=True)), (0.01, 0.03, 0.1, 0.3)),
    "atlas": ("ATLAS (poly φ, Omega, Muon)",
              lambda c: MemorySpec(MLPMemory(2, c.hidden, residual=True), Polynomial(c.degree), L2(), c.window,
                                   opt.muon(1.0, 0.9, 5), ret.scalar(0.0, decoupled=True)), (0.003, 0.01, 0.03, 0.1)),
    # The chunk-start form (impl="chunk", chunk_size), with Newton–Schulz on every m_t (the paper)
    # or once per chunk (ns_every="chunk", what the dual form runs): the cost of the schedule in recall.
    "atlas_chunked": ("ATLAS, chunk-start form, NS per token",
                      lambda c: _atlas_chunked(c, "token"), (0.003, 0.01, 0.03, 0.1)),
    "atlas_ns_per_chunk": ("ATLAS, chunk-start form, NS per chunk",
                           lambda c: _atlas_chunked(c, "chunk"), (0.003, 0.01, 0.03, 0.1)),
    # the same with Newton–Schulz on bf16 operands (muon(ns_dtype="bfloat16"), as Muon runs it)
    "atlas_ns_bf16": ("ATLAS, chunk-start form, NS per chunk, bf16 NS operands",
                      lambda c: _atlas_chunked(c, "chunk", "bfloat16"), (0.003, 0.01, 0.03, 0.1)),
    # and through the Gram matrix (newton_schulz(method="gram"), which "auto" does not take for this
    # experiment's [153, 64]: `newton_schulz`'s docstring says where it does)
    "atlas_ns_bf16_gram": ("ATLAS, chunk-start form, NS per chunk, bf16 NS operands, Gram route",
                           lambda c: _atlas_chunked(c, "chunk", "bfloat16", "gram"), (0.003, 0.01, 0.03, 0.1)),
    "atlas_adam": ("ATLAS memory + optax.adam",
                   lambda c: MemorySpec(MLPMemory(2, c.hidden, residual=True), Polynomial(c.degree), L2(),
                                        c.window, optax.chain(optax.scale_by_adam(), opt.gd()),
                                        ret.scalar(0.0, decoupled=True)), (0.003, 0.01, 0.03, 0.1)),
}
# the memories whose feature map is Polynomial(degree), which reads poly_coeffs
POLYNOMIAL_MEMORIES = ("deltanet_poly2", "atlas", "atlas_chunked", "atlas_ns_per_chunk", "atlas_ns_bf16",
                       "atlas_ns_bf16_gram", "atlas_adam")


@dataclass(frozen=True)
class MemorizationConfig(Config):
    """The experiment's settings: the YAML keys of configs/experiments/memorize.yml and the
    ``key=value`` overrides of ``atlas-jax memorize``. Every field is checked on construction."""

    d_k: int = setting(16, ge=1)
    d_v: int = setting(16, ge=1)
    n_pairs: tuple[int, ...] = setting((4, 8, 12, 16, 24, 32, 48, 64, 96, 128), ge=1, nonempty=True)
    trials: int = setting(8, ge=1)
    passes: int = setting(1, ge=1)
    hidden: int = setting(64, ge=1)
    degree: int = setting(2, ge=1)
    window: int = setting(4, ge=1)
    chunk_size: int = setting(16, ge=1)   # the chunk-start form's chunk (atlas_chunked, atlas_ns_per_chunk)
    # a_0 = 0: the constant feature is shared by every key and only adds cross-talk; an outer loop
    # would learn that (ATLAS §3.1, input gating), this experiment has no outer loop.
    poly_coeffs: tuple[float, ...] | None = (0.0, 1.0, 1.0)
    seed: int = setting(0, ge=0)
    memories: tuple[str, ...] = setting(("linear_attention", "deltanet", "gated_deltanet", "deltanet_poly2",
                                         "titans_mlp", "atlas", "atlas_adam"), choices=lambda: MEMORIES,
                                        nonempty=True)
    out_dir: Path = setting("results/memorization", output_dir=True)

    def __post_init__(self):
        super().__post_init__()
        polynomial = [m for m in self.memories if m in POLYNOMIAL_MEMORIES]
        if polynomial and self.poly_coeffs is not None and len(self.poly_coeffs) != self.degree + 1:
            raise ConfigError(f"needs degree + 1 = {self.degree + 1} coefficients for degree={self.degree} "
                              f"(used by {', '.join(polynomial)}), or null for the defaults 1/i!",
                              key="poly_coeffs", value=self.poly_coeffs)


def _pairs(key, trials, n, d_k, d_v):
    kk, kv = jax.random.split(key)
    keys = jax.random.normal(kk, (trials, n, d_k))
    values = jax.random.normal(kv, (trials, n, d_v))
    unit = lambda x: x / jnp.linalg.norm(x, axis=-1, keepdims=True)
    return unit(keys), unit(values)


def _scores(readout, values):
    """Cosine recall and exact-match accuracy per trial; readout/values [trials, n, d]."""
    unit = lambda x: x / (jnp.linalg.norm(x, axis=-1, keepdims=True) + 1e-9)
    cos = jnp.einsum("TID,TJD->TIJ", unit(readout), unit(values))
    recall = jnp.mean(jnp.diagonal(cos, axis1=1, axis2=2), axis=-1)
    accuracy = jnp.mean(jnp.argmax(cos, axis=-1) == jnp.arange(values.shape[1]), axis=-1)
    return recall, accuracy


def _evaluate(spec, cfg, keys, values, step_sizes, init_key, feature_params):
    """Recall/accuracy for every step size at once: the batch axis holds trials × step sizes."""
    trials, n, _ = keys.shape
    grid = len(step_sizes)
    stream_k = jnp.tile(keys, (1, cfg.passes, 1))
    stream_v = jnp.tile(values, (1, cfg.passes, 1))
    batch = lambda x: jnp.repeat(x, grid, axis=0)[:, :, None]            # [trials·grid, T, 1, D]
    q = k = batch(stream_k)
    v = batch(stream_v)
    beta = jnp.tile(jnp.asarray(step_sizes, jnp.float32), trials)[:, None, None] * jnp.ones(q.shape[:3])
    state0 = spec.init_state(init_key, batch=trials * grid, heads=1, d_k=cfg.d_k, d_v=cfg.d_v)
    kwargs = {"g": jnp.zeros(q.shape[:3])} if spec.retention.needs_gate else {}
    _, state = spec(q, k, v, beta=beta, initial_state=state0, output_final_state=True,
                    feature_params=feature_params, **kwargs)
    features = spec.feature_map.apply(feature_params, batch(keys))[:, :, 0]
    params = jax.tree.map(lambda x: x[:, 0], state.params)
    readout = jax.vmap(spec.memory.apply)(params, features)                # [trials·grid, n, d_v]
    recall, accuracy = _scores(readout, jnp.repeat(values, grid, axis=0))
    return recall.reshape(trials, grid).mean(0), accuracy.reshape(trials, grid).mean(0)


def _feature_params(spec, cfg):
    params = spec.feature_map.init_params()
    if isinstance(spec.feature_map, Polynomial) and cfg.poly_coeffs is not None:
        params = {"coeffs": jnp.asarray(cfg.poly_coeffs, jnp.float32)}
    return params


def run(cfg: MemorizationConfig, log=print) -> dict:
    """Runs every memory at every n; returns {memory: {n: {...}}} and writes results.json + PNG."""
    key = jax.random.PRNGKey(cfg.seed)
    results = {"config": dataclasses.asdict(cfg), "memories": {}}
    for name in cfg.memories:
        label, factory, step_sizes = MEMORIES[name]
        spec = factory(cfg)
        feature_params = _feature_params(spec, cfg)
        evaluate = jax.jit(lambda keys, values, init_key: _evaluate(spec, cfg, keys, values, step_sizes, init_key,
                                                                    feature_params))
        rows = {}
        start = time.perf_counter()
        for n in cfg.n_pairs:
            keys, values = _pairs(jax.random.fold_in(key, n), cfg.trials, n, cfg.d_k, cfg.d_v)
            recall, accuracy = jax.device_get(evaluate(keys, values, jax.random.fold_in(key, 10_000 + n)))
            # A step size that diverged (non-finite read-out) loses to every finite one.
            best = int(np.argmax(np.where(np.isfinite(recall), recall, -np.inf)))
            rows[n] = {"recall": float(recall[best]), "accuracy": float(accuracy[best]),
                       "step_size": step_sizes[best]}
        results["memories"][name] = {"label": label, "axes": spec.axes(), "rows": rows}
        log(f"  {label:<32s} done in {time.perf_counter() - start:5.1f} s")
    return results


def format_table(results: dict) -> str:
    ns = results["config"]["n_pairs"]
    d_k = results["config"]["d_k"]
    head = f"{'memory':<32s}" + "".join(f"{n:>7d}" for n in ns)
    lines = [f"cosine recall / exact-match accuracy vs n stored pairs (d_k = {d_k}; n = d_k marked *)",
             head.replace(f"{d_k:>7d}", f"{str(d_k) + '*':>7s}")]
    for metric in ("recall", "accuracy"):
        lines.append(f"-- {metric}")
        for entry in results["memories"].values():
            lines.append(f"{entry['label']:<32s}" + "".join(f"{entry['rows'][n][metric]:7.3f}" for n in ns))
    return "\n".join(lines)


def plot(results: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ns = results["config"]["n_pairs"]
    d_k = results["config"]["d_k"]
    fig, axes = plt.subplots(1, 2, figsize=(12, 5))
    for metric, ax in zip(("recall", "accuracy"), axes):
        for entry in results["memories"].values():
            ax.plot(ns, [entry["rows"][n][metric] for n in ns], marker="o", label=entry["label"])
        ax.axvline(d_k, color="grey", linestyle="--", linewidth=1)
        ax.text(d_k, 0.02, " n = d_k", color="grey")
        ax.set_xlabel("n stored key/value pairs")
        ax.set_ylabel({"recall": "cosine recall", "accuracy": "exact-match accuracy"}[metric])
        ax.set_ylim(0, 1.05)
        ax.grid(alpha=0.3)
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=4, fontsize=8, frameon=False)
    passes = results["config"]["passes"]
    fig.suptitle(f"Test-time memorisation, d_k = d_v = {d_k}, {passes} pass{'es' if passes > 1 else ''}")
    fig.tight_layout(rect=(0, 0.1, 1, 1))
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(cfg: MemorizationConfig, log=print) -> dict:
    """Runs the experiment; the output folder is created and checked writable before any work."""
    out = ensure_output_dir(cfg.out_dir, key="out_dir")
    log(f"atlas-jax memorize: d_k={cfg.d_k}, d_v={cfg.d_v}, n={list(cfg.n_pairs)}, {cfg.trials} trials, "
        f"{cfg.passes} pass(es), backend {jax.default_backend()}")
    results = run(cfg, log)
    (out / "results.json").write_text(json.dumps(results, indent=2, default=str))
    plot(results, out / "recall_vs_n.png")
    log(format_table(results))
    log(f"wrote {out / 'results.json'} and {out / 'recall_vs_n.png'}")
    return results
