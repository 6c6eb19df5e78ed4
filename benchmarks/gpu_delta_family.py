#!/usr/bin/env python3
"""GPU check and benchmark of the Pallas (Triton) delta-family kernels against XLA and fla.

Run on an H100/H200 (jax 0.11.x, torch; fla optional), from the repository root:

    python benchmarks/gpu_delta_family.py 2>&1 | tee $OUT/log

Parts (env PARTS, comma separated, default "check,bench,fla,tune"):
  check  correctness on GPU: Pallas vs the exact XLA chunk form (float32, HIGHEST precision) at
         a few shapes, float32 and bf16, outputs, final states and all gradients (max relative
         errors printed; the bar is 1e-5 in float32 and 1e-2 in bf16), plus packed varlen and
         extreme gates (g in (-1e-3, 0) and g <= -5; CHECKS=g_ selects those).
  bench  fwd and fwd+bwd times of gated_delta_rule (gdn), delta_rule and kda: Pallas, Pallas
         with bf16 residual states, and the XLA chunk form; inputs made as fla makes them
         (q, k L2-normalised, g = logsigmoid(randn), beta = sigmoid(randn), bf16, g float32).
  fla    the same with fla's chunk_gated_delta_rule / chunk_delta_rule / chunk_kda in this
         process (as ../shared/bench/anchors_gpu.py does), if `import fla` works.
  tune   gdn fwd and fwd+bwd at the first shape for a few GpuBlockSizes (warps, V blocks,
         pipeline stages, residual storage dtypes): which defaults to keep (TUNE_OPS, TUNE_ONLY).
  stages each of our kernels timed alone at the first shape (where the time goes; STAGES_VARIANT
         names a TUNE entry for other block sizes).
  kernels every Pallas call of one fwd+bwd, recorded while tracing and re-timed alone, for each
         TUNE entry in STAGES_VARIANT (KERNELS_ONLY: name substrings to keep).
  probe  K1 timed with its serial parts (16x16 forward substitution, block merges) stubbed out:
         timing diagnostics only, the results are wrong on purpose.
  fla_profile  per-kernel CUDA times of fla's fwd+bwd (torch.profiler): the anchor's stage split.
  memory_ours / memory_fla   peak device memory of one fwd+bwd; one of them per process.
Rough durations (compiles included): check 5-8 min, bench 3-5 min per shape, tune 3-5 min; the
command limit is 10 min, so run e.g. PARTS=check, then PARTS=bench,fla, then PARTS=tune.
Env: SHAPES="4,4096,16,128;1,16384,16,128" (B,T,H,D; ';' separated), OPS="gdn,deltanet,kda",
     VARIANTS="pallas,pallas_h16,xla", CHECK_VARIANT (a TUNE entry for the checks' block
     sizes), FLA_PROFILE_MODES ("fwd,fwdbwd"), FLA_MODES ("fwd" skips fla's fwd+bwd, whose
     autotune takes minutes), TUNE_ROUNDS / TUNE_MODES (see tune_op), REPS (timed repetitions,
     default 30), OUT (JSON goes to $OUT/gpu_delta_family.json), INTERPRET=1 (Pallas interpret mode: a CPU smoke test of this
     script, e.g. PARTS=bench SHAPES=1,64,1,16 REPS=2). Every variant runs in its own try/except.
"""

from __future__ import annotations

import os

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
os.environ.setdefault("FLA_DISABLE_BACKEND_DISPATCH", "1")

import importlib.util  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import pathlib  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
import traceback  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402


def _import_kernels():
    """atlas_jax.kernels is the repo's kernels/ folder; map it by hand when not pip-installed."""
    try:
        from atlas_jax.kernels.delta_family import gpu  # noqa: F401
    except ImportError:
        spec = importlib.util.spec_from_file_location(
            "atlas_jax.kernels", ROOT / "kernels" / "__init__.py",
            submodule_search_locations=[str(ROOT / "kernels")])
        mod = importlib.util.module_from_spec(spec)
        sys.modules["atlas_jax.kernels"] = mod
        spec.loader.exec_module(mod)
    from atlas_jax.kernels.delta_family import gpu
    return gpu


gpu = _import_kernels()
from atlas_jax.ops.delta_family import chunk_delta_family  # noqa: E402
from atlas_jax.ops.delta_family.naive import recurrent_delta_family  # noqa: E402

PARTS = os.environ.get("PARTS", "check,bench,fla,tune").split(",")
SHAPES = [tuple(int(x) for x in s.split(","))
          for s in os.environ.get("SHAPES", "4,4096,16,128;1,16384,16,128").split(";") if s]
OPS = os.environ.get("OPS", "gdn,deltanet,kda").split(",")
VARIANTS = os.environ.get("VARIANTS", "pallas,xla").split(",")
REPS = int(os.environ.get("REPS", "30"))
INTERPRET = os.environ.get("INTERPRET") == "1"     # CPU smoke test of this script only
RESULTS = {"device": str(jax.devices()[0]), "device_kind": jax.devices()[0].device_kind,
           "jax": jax.__version__, "check": {}, "bench": {}}


def log(*a):
    print(*a, flush=True)


def rel(a, b):
    a = np.asarray(jnp.asarray(a, jnp.float32), np.float64)
    b = np.asarray(jnp.asarray(b, jnp.float32), np.float64)
    n = np.linalg.norm(b)
    return float(np.linalg.norm(a - b) / n) if n > 0 else float(np.linalg.norm(a))


def save():
    out = os.environ.get("OUT")
    if out:
        pathlib.Path(out).mkdir(parents=True, exist_ok=True)
        with open(os.path.join(out, "gpu_delta_family.json"), "w") as f:
            json.dump(RESULTS, f, indent=1, default=str)


# ---------------------------------------------------------------------------------------------
# Inputs


def make_inputs(B, T, H, K, V, gate, dtype, seed=0, gates="normal"):
    """fla's recipe; gates="near0" puts g in (-1e-3, 0) (decay ~1, nothing forgotten) and
    gates="strong" in (-10, -5] (a chunk's cumulative gate reaches -640: exp must be masked)."""
    ks = jax.random.split(jax.random.PRNGKey(seed), 8)

    def l2(x):
        return x / jnp.sqrt(jnp.sum(x * x, -1, keepdims=True) + 1e-6)

    q = l2(jax.random.normal(ks[0], (B, T, H, K))).astype(dtype)
    k = l2(jax.random.normal(ks[1], (B, T, H, K))).astype(dtype)
    v = jax.random.normal(ks[2], (B, T, H, V)).astype(dtype)
    beta = jax.nn.sigmoid(jax.random.normal(ks[3], (B, T, H))).astype(dtype)
    g = None
    if gate == "scalar":
        g = jax.nn.log_sigmoid(jax.random.normal(ks[4], (B, T, H)))
    elif gate == "channel":
        g = jax.nn.log_sigmoid(jax.random.normal(ks[4], (B, T, H, K)))
    if g is not None and gates == "near0":
        g = -1e-3 * jax.nn.sigmoid(jax.random.normal(ks[6], g.shape))
    elif g is not None and gates == "strong":
        g = -5.0 - 5.0 * jax.nn.sigmoid(jax.random.normal(ks[6], g.shape))
    elif gates != "normal":
        raise ValueError(f"gates must be 'normal', 'near0' or 'strong', got {gates!r}")
    do = jax.random.normal(ks[5], (B, T, H, V)).astype(dtype)
    return q, k, v, beta, g, do


GATE_OF = {"gdn": "scalar", "deltanet": "none", "kda": "channel"}


# ---------------------------------------------------------------------------------------------
# Correctness on GPU


def check_shape(name, B, T, H, K, V, gate, dtype, cu=None, chunk=64, gates="normal"):
    q, k, v, beta, g, _ = make_inputs(B, T, H, K, V, gate, dtype, seed=1, gates=gates)
    n = B if cu is None else len(cu) - 1
    s0 = jax.random.normal(jax.random.PRNGKey(2), (n, H, K, V), jnp.float32) * 0.1
    wo = jax.random.normal(jax.random.PRNGKey(3), (B, T, H, V), jnp.float32)
    ws = jax.random.normal(jax.random.PRNGKey(4), (n, H, K, V), jnp.float32)
    scale = 1.0 / math.sqrt(K)

    def pallas(q, k, v, beta, g, s0):
        return gpu.chunk_delta_family_gpu(
            q, k, v, beta, g, scale=scale, initial_state=s0, output_final_state=True,
            chunk_size=chunk, cu_seqlens=None if cu is None else jnp.asarray(cu, jnp.int32),
            interpret=INTERPRET, block_sizes=CHECK_BLOCKS)

    def ref(q, k, v, beta, g, s0):
        f = lambda x: None if x is None else x.astype(jnp.float32)   # noqa: E731
        q, k, v, beta, g = f(q), f(k), f(v), f(beta), f(g)
        if cu is None:
            return chunk_delta_family(q, k, v, beta, g, scale=scale, initial_state=s0,
                                      output_final_state=True, chunk_size=chunk)
        os_, ss = [], []
        for i in range(n):
            a, b = cu[i], cu[i + 1]
            if a == b:
                ss.append(s0[i])
                continue
            sl = slice(a, b)
            # The per-token scan: jax 0.11.2's XLA fails to compile the chunk form's gradient
            # on some of these slices on an H200 (RET_CHECK in mlir_kernel_emitter, seen for
            # the scalar and channel gates), an XLA bug outside the kernels under test.
            o, s = recurrent_delta_family(q[:, sl], k[:, sl], v[:, sl], beta[:, sl],
                                          None if g is None else g[:, sl], scale=scale,
                                          initial_state=s0[i:i + 1], output_final_state=True)
            os_.append(o)
            ss.append(s[0])
        return jnp.concatenate(os_, axis=1), jnp.stack(ss)

    args = (q, k, v, beta, g, s0)
    argnums = tuple(i for i, a in enumerate(args) if a is not None)

    def loss(fn):
        def f(*a):
            o, s = fn(*a)
            return jnp.sum(o.astype(jnp.float32) * wo) + jnp.sum(s * ws)
        return jax.jit(jax.grad(f, argnums=argnums))

    o1, s1 = jax.jit(pallas)(*args)
    o2, s2 = jax.jit(ref)(*args)
    errs = {"o": rel(o1, o2), "final_state": rel(s1, s2)}
    g1 = loss(pallas)(*args)
    g2 = loss(ref)(*args)
    for i, a, b in zip(argnums, g1, g2):
        errs["d" + "q k v beta g s0".split()[i]] = rel(a, b)
        if not bool(jnp.all(jnp.isfinite(a.astype(jnp.float32)))):
            errs["nonfinite_d" + "q k v beta g s0".split()[i]] = True
    tol = 1e-5 if dtype == jnp.float32 else 1e-2
    worst = max(v_ for v_ in errs.values() if isinstance(v_, float))
    status = "OK " if worst < tol else "BAD"
    log(f"[check] {status} {name:34s} max rel {worst:.2e} (tol {tol:g})  " +
        " ".join(f"{k_}={v_:.1e}" for k_, v_ in errs.items() if isinstance(v_, float)))
    RESULTS["check"][name] = dict(errs, max=worst, ok=worst < tol)


def run_checks():
    cases = []
    for gate in ("none", "scalar", "channel"):
        for dtype in (jnp.float32, jnp.bfloat16):
            dn = "f32" if dtype == jnp.float32 else "bf16"
            cases.append((f"{gate}/{dn}/B2T1000H4D128", (2, 1000, 4, 128, 128, gate, dtype)))
        cases.append((f"{gate}/bf16/B1T333H2K64V256", (1, 333, 2, 64, 256, gate, jnp.bfloat16)))
        cases.append((f"{gate}/f32/B1T300H2K256V64c32",
                      (1, 300, 2, 256, 64, gate, jnp.float32), 32))
        cases.append((f"{gate}/bf16/varlen/T777H4D128",
                      (1, 777, 4, 128, 128, gate, jnp.bfloat16), 64, [0, 100, 101, 600, 777]))
    for gate in ("scalar", "channel"):
        for gates in ("near0", "strong"):
            cases.append((f"{gate}/f32/B1T300H2D128/g_{gates}",
                          (1, 300, 2, 128, 128, gate, jnp.float32), 64, None, gates))
        cases.append((f"{gate}/bf16/B1T300H2D128/g_strong",
                      (1, 300, 2, 128, 128, gate, jnp.bfloat16), 64, None, "strong"))
    only = os.environ.get("CHECKS")
    log(f"[check] block sizes: TUNE entry {CHECK_VARIANT!r}")
    for case in cases:
        name, shp = case[0], case[1]
        if only and not any(part in name for part in only.split(",")):
            continue
        chunk = case[2] if len(case) > 2 else 64
        cu = case[3] if len(case) > 3 else None
        gates = case[4] if len(case) > 4 else "normal"
        try:
            t = time.perf_counter()
            check_shape(name, *shp, cu=cu, chunk=chunk, gates=gates)
            log(f"        ({time.perf_counter() - t:.1f}s incl. compile)")
        except Exception as e:  # noqa: BLE001
            log(f"[check] ERR {name}: {type(e).__name__}: {str(e)[:2000]}")
            traceback.print_exc()
            RESULTS["check"][name] = {"error": f"{type(e).__name__}: {str(e)[:500]}"}
        save()


# ---------------------------------------------------------------------------------------------
# Timing


def inner_calls(one_call_s, target_s=0.02):
    """Back-to-back calls per timed repetition: enough for ~20 ms, so that the first call's
    dispatch and the final synchronisation (tens of microseconds, before the GPU is busy and
    after it is done) are a small share. H100, B4 T4096 H16 D128 bf16, ours KDA fwd: 1.110 ms
    per call at 5 calls, 1.049 at 20, 1.030 at 50; fla's same wall-clock method at 50 calls
    1.104 against triton's do_bench 1.099 (GPU events around each call)."""
    return max(5, min(200, math.ceil(target_s / max(one_call_s, 1e-6))))


def wall_ms(call, sync, reps=REPS):
    """Median over `reps` of (time of `inner_calls` back-to-back calls) / inner, after warmup;
    the method for ours, and for fla next to triton's do_bench."""
    for _ in range(3):
        sync(call())
    t = time.perf_counter()
    sync(call())
    inner = inner_calls(time.perf_counter() - t)
    ts = []
    for _ in range(reps):
        t = time.perf_counter()
        for _ in range(inner):
            out = call()
        sync(out)
        ts.append((time.perf_counter() - t) / inner)
    return statistics.median(ts) * 1e3


def time_jax(f, *args, reps=REPS):
    return wall_ms(lambda: f(*args), jax.block_until_ready, reps)


def jax_fns(variant, gate, K):
    """fwd and fwd+bwd through the public ops (what users call): impl="pallas" or "chunk"."""
    from atlas_jax import ops
    op = {"none": ops.delta_rule, "scalar": ops.gated_delta_rule, "channel": ops.kda}[gate]
    impl = {"pallas": "pallas", "xla": "chunk"}[variant]

    def fwd(q, k, v, beta, g):
        args = (q, k, v, beta) if g is None else (q, k, v, g, beta)
        return op(*args, impl=impl, chunk_size=64)[0]

    def fwdbwd(q, k, v, beta, g, do):
        o, vjp = jax.vjp(fwd, q, k, v, beta, g)
        return vjp(do)

    return jax.jit(fwd), jax.jit(fwdbwd)


def bench_jax(shape):
    B, T, H, D = shape
    key = "x".join(map(str, shape))
    res = RESULTS["bench"].setdefault(key, {})
    for op in OPS:
        gate = GATE_OF[op]
        q, k, v, beta, g, do = make_inputs(B, T, H, D, D, gate, jnp.bfloat16)
        for variant in VARIANTS:
            if variant == "xla" and op == "kda" and T * B > 8192:
                continue   # the XLA KDA form materialises [C, C, K] decays: 60+ ms, not informative
            fwd, fwdbwd = jax_fns(variant, gate, D)
            for mode, fn, args in (("fwd", fwd, (q, k, v, beta, g)),
                                   ("fwdbwd", fwdbwd, (q, k, v, beta, g, do))):
                name = f"{op}/{variant}/{mode}"
                try:
                    t0 = time.perf_counter()
                    jax.block_until_ready(fn(*args))
                    comp = time.perf_counter() - t0
                    ms = time_jax(fn, *args)
                    res[name] = ms
                    log(f"[bench] {key} {name:28s} {ms:8.3f} ms   (first call {comp:.1f}s)")
                except Exception as e:  # noqa: BLE001
                    res[name] = f"error: {type(e).__name__}: {str(e)[:300]}"
                    log(f"[bench] {key} {name:28s} ERROR {type(e).__name__}: {str(e)[:1500]}")
                save()
        del q, k, v, beta, g, do


def fla_inputs(B, T, H, D, device="cuda"):
    """fla's benchmark recipe in torch: unit q, k; g = logsigmoid(randn) per head (gk per key
    channel, for KDA); beta = sigmoid(randn); bf16 except the gates; and the output cotangent."""
    import torch
    bf = torch.bfloat16
    normal = lambda *s: torch.randn(*s, device=device, dtype=bf)   # noqa: E731
    unit = lambda: torch.nn.functional.normalize(normal(B, T, H, D).float(), dim=-1).to(bf)  # noqa: E731
    q, k = unit().requires_grad_(), unit().requires_grad_()
    v = normal(B, T, H, D).requires_grad_()
    g = torch.nn.functional.logsigmoid(torch.randn(B, T, H, device=device)).requires_grad_()
    gk = torch.nn.functional.logsigmoid(torch.randn(B, T, H, D, device=device)).requires_grad_()
    beta = torch.sigmoid(torch.randn(B, T, H, device=device)).to(bf).requires_grad_()
    return q, k, v, g, gk, beta, normal(B, T, H, D)


def bench_fla(shape):
    B, T, H, D = shape
    key = "x".join(map(str, shape))
    res = RESULTS["bench"].setdefault(key, {})
    try:
        import torch
        import triton.testing as tt
        import fla.ops.common.chunk_o as _co
        _co.TRITON_ABOVE_3_7_1 = True   # timing only: fla's Triton<3.7.1 Hopper guard (issue 640)
        from fla.ops.delta_rule import chunk_delta_rule
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule
        try:
            from fla.ops.kda import chunk_kda
        except Exception:  # noqa: BLE001
            chunk_kda = None
    except Exception as e:  # noqa: BLE001
        log(f"[fla] not available: {type(e).__name__}: {e}")
        RESULTS["fla_error"] = repr(e)[:300]
        return
    import fla
    import triton
    RESULTS["versions"] = {"jax": jax.__version__, "torch": torch.__version__,
                           "triton": triton.__version__, "fla": fla.__version__}
    log(f"[fla] versions {RESULTS['versions']}")
    q, k, v, g, gk, beta, do = fla_inputs(B, T, H, D)
    cases = {"gdn": lambda: chunk_gated_delta_rule(q, k, v, g, beta)[0],
             "deltanet": lambda: chunk_delta_rule(q, k, v, beta)[0]}
    if chunk_kda is not None:
        cases["kda"] = lambda: chunk_kda(q, k, v, gk, beta)[0]

    def bench(op, mode, f):
        """fla's time: the faster of the recipe's do_bench (median of GPU-event times around
        each call, L2 flushed before each) and our own wall-clock method (`wall_ms`), so that
        neither method's overhead counts against fla."""
        for _ in range(6):
            f()
        torch.cuda.synchronize()
        dob = tt.do_bench(f, warmup=40, rep=200, return_mode="median")
        wall = wall_ms(f, lambda out=None: torch.cuda.synchronize())
        res[f"{op}/fla_do_bench/{mode}"], res[f"{op}/fla_wall/{mode}"] = dob, wall
        res[f"{op}/fla/{mode}"] = min(dob, wall)
        log(f"[fla]   {key} {op}/fla/{mode} {min(dob, wall):8.3f} ms   (do_bench {dob:.3f}, "
            f"wall {wall:.3f})")

    for op, f in cases.items():
        if op not in OPS:
            continue
        try:
            bench(op, "fwd", f)
            save()      # fla's first fwd+bwd autotunes for minutes; keep the fwd if it is cut
            if os.environ.get("FLA_MODES", "fwd,fwdbwd") == "fwd":
                continue

            def fb():
                f().backward(do)
            bench(op, "fwdbwd", fb)
        except Exception as e:  # noqa: BLE001
            res[f"{op}/fla/error"] = repr(e)[:300]
            log(f"[fla]   {key} {op} ERROR {e!r}"[:1500])
        save()
    del q, k, v, g, gk, beta, do
    torch.cuda.empty_cache()


TUNE = {
    "default": {},
    # the layout before the lean state pass: output fused into K2, exact merges, substitution
    # (the JSON of 2026-11-21 also has it with the former K4 order, since removed)
    "legacy": dict(fuse_output=True, wide_intra=False, merge_dots=6,
                   diag_inverse="substitution", num_warps_bwd=4, split_intra=False,
                   split_state_bwd=False, num_stages_state=2),
    # the defaults before 2026-11-21 (one K1, two state-pass stages, one reverse pass); KDA's
    # K1 then also ran on 8 warps (intra_w8)
    "before_split": dict(split_intra=False, split_state_bwd=False, num_stages_state=2),
    "fused_out": dict(fuse_output=True),
    "narrow_intra": dict(wide_intra=False),
    "merge6": dict(merge_dots=6),
    "subst": dict(diag_inverse="substitution"),
    "wide": dict(wide_intra=True),
    "out_bv64": dict(block_v_out=64),
    "out_w8": dict(num_warps_out=8),
    "state_w8": dict(num_warps_state=8),
    "state_bv32": dict(block_v=32),
    "bwd_w8": dict(num_warps_bwd=8),
    "bwd_w4": dict(num_warps_bwd=4),
    "bwd_bv32": dict(block_v_bwd=32),
    "intra_w8": dict(num_warps_intra=8),
    # fla's split of the reverse pass (dv_local + dhu); with V blocks of 32 in the lean pass
    "split_bwd": dict(split_state_bwd=True),
    "split_bwd_bv32": dict(split_state_bwd=True, block_v=32),
    # fewer warps (fla autotunes its kkt/solve kernel over 1, 2, 4 warps, fwd_h over 2, 4)
    "intra_w1": dict(num_warps_intra=1),
    "intra_w2": dict(num_warps_intra=2),
    "intra_w4": dict(num_warps_intra=4),
    "out_w2": dict(num_warps_out=2),
    "state_w2": dict(num_warps_state=2),
    "state_s3": dict(num_stages_state=3),
    "state_s1": dict(num_stages_state=1),
    "bwd_w2": dict(num_warps_bwd=2),
    # K1 as fla splits it: the solve (A, T) on fewer warps, then W, U0 from the stored T
    "split_intra": dict(split_intra=True),
    "split_intra_s1": dict(split_intra=True, num_warps_solve=1),
    "split_intra_s4": dict(split_intra=True, num_warps_solve=4),
    "split_intra_wu8": dict(split_intra=True, num_warps_intra=8),
    "split_intra_wideA": dict(split_intra=True, wide_intra=True),
    "split_intra_subst": dict(split_intra=True, diag_inverse="substitution"),
    "split_intra_subst1": dict(split_intra=True, diag_inverse="substitution",
                               num_warps_solve=1),
    "split_bwd_s3": dict(split_state_bwd=True, num_stages_state=3),
    # KDA's diagonal-block kernels (K1d, K4d), one program per token and diag_heads heads
    # (fla autotunes its token-parallel kernel over 1, 2, 4, 8 heads and 1, 2, 4, 8 warps)
    "diag_h1_w1": dict(diag_heads=1, num_warps_diag=1),
    "diag_h2_w1": dict(diag_heads=2, num_warps_diag=1),
    "diag_h4_w1": dict(diag_heads=4, num_warps_diag=1),
    "diag_h4_w4": dict(diag_heads=4, num_warps_diag=4),
    "diag_h8_w2": dict(diag_heads=8, num_warps_diag=2),
    "diag_h8_w4": dict(diag_heads=8, num_warps_diag=4),
    "diag_h16_w4": dict(diag_heads=16, num_warps_diag=4),
    # KDA's off-diagonal pair kernels (K1p, K4b): K columns per piece (fla: 32 or 64)
    "pairs_bk32": dict(block_k_pairs=32),
    "pairs_bk64": dict(block_k_pairs=64),
    "pairs_bwd_bk128": dict(block_k_pairs_bwd=128),
    "pairs_fused_solve": dict(fuse_pairs_solve=True),
    "pairs_fused_w2": dict(fuse_pairs_solve=True, num_warps_pairs=2),
    "pairs_fused_w8": dict(fuse_pairs_solve=True, num_warps_pairs=8),
    "out_bv64_w2": dict(block_v_out=64, num_warps_out=2),
    "out_bk64": dict(block_k_out=64),
    "out_bk64_s2": dict(block_k_out=64, num_stages_out=2),
    "out_bk64_s3": dict(block_k_out=64, num_stages_out=3),
    "out_bk32_s3": dict(block_k_out=32, num_stages_out=3),
    "out_bk64_s2_w8": dict(block_k_out=64, num_stages_out=2, num_warps_out=8),
    "out_bk64_s2_bv64": dict(block_k_out=64, num_stages_out=2, block_v_out=64),
    "pairs_bk64_w2": dict(block_k_pairs=64, num_warps_pairs=2),
    "s1_w8": dict(num_warps_solve=1, num_warps_intra=8),
    "pairs_w1": dict(num_warps_pairs=1),
    "pairs_w2": dict(num_warps_pairs=2),
    "pairs_w4": dict(num_warps_pairs=4),
    "out_whole": dict(block_k_out=128, num_stages_out=1),
    "solve_w2": dict(num_warps_solve=2),
    "wu64_s2": dict(block_wu=64, num_stages_intra=2),
    "wu64_s3": dict(block_wu=64, num_stages_intra=3),
    "wu64_s2_w8": dict(block_wu=64, num_stages_intra=2, num_warps_intra=8),
    "wu32_s3": dict(block_wu=32, num_stages_intra=3),
    "pairs_w4_out_whole": dict(num_warps_pairs=4, block_k_out=128, num_stages_out=1),
    "pairs_w8": dict(num_warps_pairs=8),
    "split_bwd_bv32_s3": dict(split_state_bwd=True, block_v=32, num_stages_state=3),
    # one long sequence (B = 1): V blocks of 16 double the sequential programs
    "state_bv16": dict(block_v=16),
    "state_bv16_w2": dict(block_v=16, num_warps_state=2),
    "state_bv64": dict(block_v=64),
    "state_s2": dict(num_stages_state=2),
    "state_s4": dict(num_stages_state=4),
    "split_bwd_bv16": dict(split_state_bwd=True, block_v=16),
    "nosplit_bwd": dict(split_state_bwd=False),
    # KDA's K1p: column pieces and pipeline stages (the default is 64 over two stages)
    "pairs_bk128_s1": dict(block_k_pairs=128, num_stages_pairs=1),
    "pairs_bk32_s3": dict(block_k_pairs=32, num_stages_pairs=3),
    "pairs_bk64_s2_w4": dict(block_k_pairs=64, num_stages_pairs=2, num_warps_pairs=4),
    "wu_w8": dict(num_warps_intra=8),
    "wu_s1": dict(num_stages_intra=1),
    "wu_s3": dict(num_stages_intra=3),
    # KDA's K1b in column pieces (the default now: 64 columns over three stages)
    "wuc64": dict(block_wu_channel=64),
    "wuc64_s3": dict(block_wu_channel=64, num_stages_intra=3),
    "wuc32_s3": dict(block_wu_channel=32, num_stages_intra=3),
    "wuc64_w8": dict(block_wu_channel=64, num_warps_intra=8),
    # K1p on one warp, with two K1d heads (both the defaults at K = 128 since 2026-11-22)
    "pairs_w1_diag_h2": dict(num_warps_pairs=1, diag_heads=2),
    "pairs_w1_bk32": dict(num_warps_pairs=1, block_k_pairs=32),
    # the solve's merges as one tf32 dot (fla's solve precision) instead of three bf16 dots;
    # for the scalar or no gate also A = K K^T as 16x16 blocks in registers over K pieces (as
    # fla's fused kkt + solve kernel) instead of the wide [C, C] dot through a scratch buffer
    "merge_tf32": dict(merge_dots=1),
    "kkt0": dict(block_k_kkt=0),
    "kkt64": dict(block_k_kkt=64),
    "kkt64_tf32": dict(block_k_kkt=64, merge_dots=1),
    "kkt32_tf32": dict(block_k_kkt=32, merge_dots=1),
    "kkt128_tf32": dict(block_k_kkt=128, merge_dots=1),
    "kkt64_s2_tf32": dict(block_k_kkt=64, num_stages_solve=2, merge_dots=1),
    "kkt64_s2": dict(block_k_kkt=64, num_stages_solve=2),
    "kkt64_s3": dict(block_k_kkt=64, num_stages_solve=3),
    "kkt32_s3": dict(block_k_kkt=32, num_stages_solve=3),
    "kkt64_subst_tf32": dict(block_k_kkt=64, merge_dots=1, diag_inverse="substitution"),
    "kkt64_tf32_w2": dict(block_k_kkt=64, merge_dots=1, num_warps_solve=2),
    "fused_tf32": dict(fuse_pairs_solve=True, merge_dots=1),
    "wu64_s4": dict(block_wu=64, num_stages_intra=4),
    "combo": dict(split_intra=True, num_stages_state=3, split_state_bwd=True),
    "combo_bv32": dict(split_intra=True, num_stages_state=3, split_state_bwd=True, block_v=32),
}


def tune(shape):
    for op in os.environ.get("TUNE_OPS", "gdn").split(","):
        tune_op(shape, op)


def tune_op(shape, op):
    """Whole-op times of the TUNE entries in TUNE_ONLY; TUNE_ROUNDS > 1 times them round-robin
    that many times (compiled once) and keeps each one's best round, so that drifting clocks
    or a neighbour's load do not favour whichever variant ran first. TUNE_MODES: fwd, fwdbwd."""
    B, T, H, D = shape
    key = "x".join(map(str, shape))
    res = RESULTS.setdefault("tune", {}).setdefault(key, {})
    q, k, v, beta, g, do = make_inputs(B, T, H, D, D, GATE_OF[op], jnp.bfloat16)
    scale = 1.0 / math.sqrt(D)
    only = os.environ.get("TUNE_ONLY")
    modes = os.environ.get("TUNE_MODES", "fwd,fwdbwd").split(",")
    rounds = int(os.environ.get("TUNE_ROUNDS", "1"))
    runs = []
    for name, kw in TUNE.items():
        if only and name not in only.split(","):
            continue
        bs = gpu.GpuBlockSizes(**kw)

        def fwd(q, k, v, beta, g, bs=bs):
            return gpu.chunk_delta_family_gpu(q, k, v, beta, g, scale=scale, chunk_size=64,
                                              interpret=INTERPRET, block_sizes=bs)[0]

        def fwdbwd(q, k, v, beta, g, do, fwd=fwd):
            return jax.vjp(fwd, q, k, v, beta, g)[1](do)

        for mode, fn, args in (("fwd", jax.jit(fwd), (q, k, v, beta, g)),
                               ("fwdbwd", jax.jit(fwdbwd), (q, k, v, beta, g, do))):
            if mode in modes:
                runs.append((f"{op}/{name}/{mode}", fn, args))
    best = {}
    for rnd in range(rounds):
        for label, fn, args in runs:
            try:
                ms = time_jax(fn, *args)
                best[label] = min(ms, best.get(label, ms))
                res[label] = best[label]
                if rounds > 1:
                    res.setdefault(label + "/rounds", []).append(ms)
                log(f"[tune]  {key} {label:34s} {ms:8.3f} ms" + (f"  (round {rnd})" if rounds > 1
                                                                   else ""))
            except Exception as e:  # noqa: BLE001
                res[label] = f"error: {type(e).__name__}: {str(e)[:300]}"
                log(f"[tune]  {key} {label} ERROR {type(e).__name__}: {str(e)[:1000]}")
            save()
    if rounds > 1:
        for label in best:
            log(f"[tune]  {key} {label:34s} best {best[label]:8.3f} ms")


# Which kernels a TUNE entry changes: the stage timings of a variant time only those (the
# others would repeat the default's), on the default's intermediate results.
STAGE_NAMES = ("K1 intra fwd", "K2 state fwd (+output)", "K3 state bwd", "K4 intra bwd")
AFFECTS = (("diag", (0, 3)), ("pairs", (0, 3)), ("split_intra", (0,)), ("split_bwd", (1, 2)),
           ("intra", (0,)), ("out", (1,)), ("state", (1, 2)), ("bwd", (3,)))


def _affected(variant):
    return next((ks for prefix, ks in AFFECTS if variant.startswith(prefix)), range(4))


def stages(shape):
    """Per-kernel times of our Pallas path (each stage jitted alone on precomputed inputs);
    STAGES_VARIANT: comma-separated TUNE names, each timed on the kernels it changes."""
    B, T, H, D = shape
    key = "x".join(map(str, shape))
    variants = os.environ.get("STAGES_VARIANT", "default").split(",")
    res_all = RESULTS.setdefault("stages", {}).setdefault(key, {})

    def prep(q, k, v, beta, g, variant):
        return gpu._prepare(q, k, v, beta, g, 1.0 / math.sqrt(D), None, False, 64, None, False,
                            INTERPRET, gpu.GpuBlockSizes(**TUNE[variant]))

    for op in OPS:
        q0, k0, v0, beta0, g0, do = make_inputs(B, T, H, D, D, GATE_OF[op], jnp.bfloat16)
        try:
            q, k, v, beta, g, s0, cu, st = prep(q0, k0, v0, beta0, g0, "default")
            r1 = jax.jit(lambda q, k, v, beta, g: gpu._intra_forward(st, q, k, v, beta, g, True))(
                q, k, v, beta, g)
            r2 = jax.jit(lambda q, k, v, g, r1: gpu._state_forward(st, q, k, v, g, None, None, r1,
                                                                   True))(q, k, v, g, r1)
            saved = dict(w=r1["w"], u0=r1["u0"], tmat=r1["tmat"], p=r1.get("p"), h=r2["h"],
                         vn=r2.get("vn"))
            r3 = jax.jit(lambda q, k, g, saved, do: gpu._state_backward(st, q, k, g, None, saved,
                                                                        do, None))(
                q, k, g, saved, do)
        except Exception as e:  # noqa: BLE001
            res_all[op] = f"error: {type(e).__name__}: {str(e)[:300]}"
            log(f"[stages] {key} {op} ERROR {type(e).__name__}: {str(e)[:1500]}")
            traceback.print_exc()
            continue
        for variant in variants:
            res = res_all if variant == "default" else res_all.setdefault(variant, {})
            try:
                stv = prep(q0, k0, v0, beta0, g0, variant)[-1]
                calls = (
                    (lambda q, k, v, beta, g: gpu._intra_forward(stv, q, k, v, beta, g, True),
                     (q, k, v, beta, g)),
                    (lambda q, k, v, g, r1: gpu._state_forward(stv, q, k, v, g, None, None, r1,
                                                               True), (q, k, v, g, r1)),
                    (lambda q, k, g, saved, do: gpu._state_backward(stv, q, k, g, None, saved,
                                                                    do, None),
                     (q, k, g, saved, do)),
                    (lambda q, k, v, beta, g, saved, do, r3: gpu._intra_backward(
                        stv, q, k, v, beta, g, saved, do, r3),
                     (q, k, v, beta, g, saved, do, r3)))
                times = {STAGE_NAMES[i]: time_jax(jax.jit(calls[i][0]), *calls[i][1])
                         for i in _affected(variant)}
                res[op] = times
                log(f"[stages] {key} {op} {variant}: "
                    + "  ".join(f"{n}={t:.3f} ms" for n, t in times.items()))
            except Exception as e:  # noqa: BLE001
                res[op] = f"error: {type(e).__name__}: {str(e)[:300]}"
                log(f"[stages] {key} {op} {variant} ERROR {type(e).__name__}: {str(e)[:1500]}")
                traceback.print_exc()
            save()


def kernels(shape):
    """Time of every Pallas kernel of one fwd+bwd, each launched alone, for each of the block
    sizes in STAGES_VARIANT (default "default"). The calls are recorded while the op is traced, then each
    is re-run under jit on fresh inputs of the recorded shapes (small negative floats, so that
    gates decay; the kernels have no data-dependent control flow, so the data does not change
    their time)."""
    for variant in os.environ.get("STAGES_VARIANT", "default").split(","):
        kernels_variant(shape, variant)


def kernels_variant(shape, variant):
    B, T, H, D = shape
    key = "x".join(map(str, shape))
    res = RESULTS.setdefault("kernels", {}).setdefault(key, {}).setdefault(variant, {})
    real = gpu._call
    for op in OPS:
        recorded = []

        def record(body, grid, ins, outs, **kw):
            recorded.append((body, grid, [(n, jax.ShapeDtypeStruct(a.shape, a.dtype), s)
                                          for n, a, s in ins], outs, kw))
            return real(body, grid, ins, outs, **kw)

        q, k, v, beta, g, do = make_inputs(B, T, H, D, D, GATE_OF[op], jnp.bfloat16)
        gpu._call = record
        try:
            bs = gpu.GpuBlockSizes(**TUNE[variant])

            def fwd(q, k, v, beta, g):
                return gpu.chunk_delta_family_gpu(q, k, v, beta, g, scale=1.0 / math.sqrt(D),
                                                  chunk_size=64, interpret=INTERPRET or None,
                                                  block_sizes=bs)[0]

            jax.jit(lambda *a: jax.vjp(fwd, *a[:5])[1](a[5])).lower(q, k, v, beta, g, do)
        except Exception as e:  # noqa: BLE001
            log(f"[kernels] {key} {op} ERROR {type(e).__name__}: {str(e)[:800]}")
            continue
        finally:
            gpu._call = real
        times, seen = {}, set()
        only = os.environ.get("KERNELS_ONLY")
        for i, (body, grid, ins, outs, kw) in enumerate(recorded):
            # the forward is traced twice (primal and custom_vjp fwd): time each kernel once
            sig = (kw["name"], grid, tuple((n, sd.shape) for n, sd, _ in ins))
            if sig in seen:
                continue
            seen.add(sig)
            name = f"{len(seen)}:{kw['name']}"
            if only and not any(part in kw["name"] for part in only.split(",")):
                continue
            try:
                rng = np.random.default_rng(i)
                arrays = [jnp.asarray(-0.1 * rng.random(sd.shape), sd.dtype)
                          if jnp.issubdtype(sd.dtype, jnp.floating)
                          else jnp.zeros(sd.shape, sd.dtype) for _, sd, _ in ins]
                f = jax.jit(lambda *xs, body=body, grid=grid, ins=ins, outs=outs, kw=kw: real(
                    body, grid, [(n, x, s) for (n, _, s), x in zip(ins, xs)], outs, **kw))
                times[name] = time_jax(f, *arrays)
            except Exception as e:  # noqa: BLE001
                times[name] = f"error: {type(e).__name__}: {str(e)[:200]}"
        res[op] = times
        total = sum(t for t in times.values() if isinstance(t, float))
        log(f"[kernels] {key} {op} {variant}: sum {total:.3f} ms")
        for name, t in times.items():
            log(f"    {name:34s} {t:8.3f} ms" if isinstance(t, float) else f"    {name} {t}")
        save()


def probe(shape):
    """Diagnostics of K1 (gdn, kda): the intra-chunk forward as is, then with the 16x16 diagonal
    inverses replaced by the identity and with the block merges (and Neumann products) cut to
    one bf16 dot per product (wrong or less accurate results, timing only), to see what the
    serial parts of the blocked inverse cost."""
    B, T, H, D = shape
    key = "x".join(map(str, shape))
    res = RESULTS.setdefault("probe", {}).setdefault(key, {})
    gk = sys.modules[gpu.__name__.rsplit(".", 1)[0] + ".gpu_kernels"]
    real = (gk.inv_unit_lower_multi, gk.inv_unit_lower_products, gk.mm, gk._dot)
    eyes = lambda ms: [jnp.eye(m.shape[0], dtype=jnp.float32) + 0 * m for m in ms]   # noqa: E731
    eye = lambda m: eyes([m])[0]                                                    # noqa: E731

    def cheap_mm(a, b, low, exact=False):
        return real[2](a, b, low, False if exact in (True, 3) else exact)

    def cheap_dot(a, b, dims, low, exact=False):
        return real[3](a, b, dims, low, False if exact in (True, 3) else exact)

    for op in [o for o in OPS if o != "deltanet"]:
        q, k, v, beta, g, do = make_inputs(B, T, H, D, D, GATE_OF[op], jnp.bfloat16)
        for name, patch in (("K1", real),
                            ("K1 no-diag-inverse", (eyes, eye) + real[2:]),
                            ("K1 one-dot-products", real[:2] + (cheap_mm, cheap_dot)),
                            ("K1 neither", (eyes, eye, cheap_mm, cheap_dot))):
            (gk.inv_unit_lower_multi, gk.inv_unit_lower_products, gk.mm, gk._dot) = patch
            try:
                q_, k_, v_, beta_, g_, s0, cu, st = gpu._prepare(
                    q, k, v, beta, g, 1.0 / math.sqrt(D), None, False, 64, None, False,
                    INTERPRET, None)
                k1 = jax.jit(lambda q, k, v, beta, g, st=st: gpu._intra_forward(
                    st, q, k, v, beta, g, True))
                res[f"{op}/{name}"] = ms = time_jax(k1, q_, k_, v_, beta_, g_)
                log(f"[probe] {key} {op} {name:20s} {ms:8.3f} ms")
            except Exception as e:  # noqa: BLE001
                log(f"[probe] {key} {op} {name} ERROR {type(e).__name__}: {str(e)[:800]}")
            finally:
                (gk.inv_unit_lower_multi, gk.inv_unit_lower_products, gk.mm, gk._dot) = real
        save()


def fla_profile(shape):
    """Per-kernel CUDA times of fla's fwd+bwd (torch.profiler), the anchor's stage split."""
    B, T, H, D = shape
    key = "x".join(map(str, shape))
    res = RESULTS.setdefault("fla_profile", {}).setdefault(key, {})
    try:
        import torch
        from torch.profiler import ProfilerActivity, profile
        import fla.ops.common.chunk_o as _co
        _co.TRITON_ABOVE_3_7_1 = True
        from fla.ops.delta_rule import chunk_delta_rule
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule
        from fla.ops.kda import chunk_kda
    except Exception as e:  # noqa: BLE001
        log(f"[fla_profile] not available: {e!r}")
        return
    q, k, v, g, gk, beta, do = fla_inputs(B, T, H, D)
    for op, f in (("gdn", lambda: chunk_gated_delta_rule(q, k, v, g, beta)[0]),
                  ("deltanet", lambda: chunk_delta_rule(q, k, v, beta)[0]),
                  ("kda", lambda: chunk_kda(q, k, v, gk, beta)[0])):
        if op not in OPS:
            continue
        for mode, step in (("fwd", lambda f=f: f()), ("fwdbwd", lambda f=f: f().backward(do))):
            if mode not in os.environ.get("FLA_PROFILE_MODES", "fwd,fwdbwd").split(","):
                continue
            for _ in range(5):
                step()
            torch.cuda.synchronize()
            n = 10
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                for _ in range(n):
                    step()
                torch.cuda.synchronize()
            times = {}
            for ev in prof.key_averages():
                t = getattr(ev, "device_time_total", None) or getattr(ev, "cuda_time_total", 0)
                if t:
                    times[ev.key[:60]] = t / n / 1e3
            res[f"{op}/{mode}"] = times
            log(f"[fla_profile] {key} {op} {mode} total {sum(times.values()):.3f} ms")
            for name, t in sorted(times.items(), key=lambda kv: -kv[1]):
                log(f"    {t:8.3f} ms  {name}")
            save()


def memory(shape, who):
    """Peak device memory of one fwd+bwd (this process only; run one `who` per process)."""
    B, T, H, D = shape
    key = "x".join(map(str, shape))
    res = RESULTS.setdefault("memory", {}).setdefault(key, {})
    for op in OPS:
        try:
            if who == "ours":
                q, k, v, beta, g, do = make_inputs(B, T, H, D, D, GATE_OF[op], jnp.bfloat16)
                _, fwdbwd = jax_fns("pallas", GATE_OF[op], D)
                jax.block_until_ready(fwdbwd(q, k, v, beta, g, do))
                stats = jax.devices()[0].memory_stats() or {}
                peak = stats.get("peak_bytes_in_use", float("nan")) / 1e9
            else:
                import torch
                import fla.ops.common.chunk_o as _co
                _co.TRITON_ABOVE_3_7_1 = True
                from fla.ops.delta_rule import chunk_delta_rule
                from fla.ops.gated_delta_rule import chunk_gated_delta_rule
                from fla.ops.kda import chunk_kda
                q, k, v, g, gk, beta, do = fla_inputs(B, T, H, D)
                if op == "kda":
                    g = gk
                del gk          # only the op's own gate counts towards the peak
                torch.cuda.reset_peak_memory_stats()
                fn = {"gdn": lambda: chunk_gated_delta_rule(q, k, v, g, beta)[0],
                      "deltanet": lambda: chunk_delta_rule(q, k, v, beta)[0],
                      "kda": lambda: chunk_kda(q, k, v, g, beta)[0]}[op]
                fn().backward(do)
                torch.cuda.synchronize()
                peak = torch.cuda.max_memory_allocated() / 1e9
                del q, k, v, beta, g, do
                torch.cuda.empty_cache()
            res[f"{op}/{who}"] = peak
            log(f"[memory] {key} {op}/{who} fwd+bwd peak {peak:.2f} GB")
        except Exception as e:  # noqa: BLE001
            res[f"{op}/{who}"] = f"error: {type(e).__name__}: {str(e)[:300]}"
            log(f"[memory] {key} {op}/{who} ERROR {type(e).__name__}: {str(e)[:1000]}")
        save()


def table():
    log("\n=== summary (ms, bf16; ratio = fla / ours: > 1 means we are faster) ===")
    for key, res in RESULTS["bench"].items():
        log(f"-- {key}")
        for op in OPS:
            for mode in ("fwd", "fwdbwd"):
                fla = res.get(f"{op}/fla/{mode}")
                row = [f"{op:9s} {mode:7s}"]
                for variant in VARIANTS + ["fla"]:
                    val = res.get(f"{op}/{variant}/{mode}")
                    if isinstance(val, float):
                        r = f" x{fla / val:.2f}" if isinstance(fla, float) and variant != "fla" else ""
                        row.append(f"{variant}={val:.3f}{r}")
                    elif val is not None:
                        row.append(f"{variant}=ERR")
                log("  " + "  ".join(row))


CHECK_VARIANT = os.environ.get("CHECK_VARIANT", "default")
CHECK_BLOCKS = gpu.GpuBlockSizes(**TUNE[CHECK_VARIANT])


def main():
    log(f"device {RESULTS['device']}  jax {jax.__version__}  parts {PARTS}  shapes {SHAPES}")
    if "check" in PARTS:
        run_checks()
    for shape in SHAPES:
        if "bench" in PARTS:
            bench_jax(shape)
        if "fla" in PARTS:
            bench_fla(shape)
    if "tune" in PARTS and SHAPES:
        tune(SHAPES[0])
    if "stages" in PARTS and SHAPES:
        stages(SHAPES[0])
    if "kernels" in PARTS and SHAPES:
        kernels(SHAPES[0])
    if "probe" in PARTS and SHAPES:
        probe(SHAPES[0])
    if "fla_profile" in PARTS and SHAPES:
        fla_profile(SHAPES[0])
    for who in ("ours", "fla"):
        if f"memory_{who}" in PARTS:
            for shape in SHAPES:
                memory(shape, who)
    table()
    save()
    log("DONE " + json.dumps({k: v for k, v in RESULTS.items() if k != "check"}, default=str))


if __name__ == "__main__":
    main()
