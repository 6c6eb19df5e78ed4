#!/usr/bin/env python3
"""How fast are the delta-family ops against fla? Forward and forward+backward times (bf16).

Times gated_delta_rule (gdn), delta_rule (deltanet) and kda through the public ops
(impl="pallas": the kernels; impl="chunk": the XLA chunk form) and, with --fla, fla's
chunk_gated_delta_rule / chunk_delta_rule / chunk_kda in the same process on the same inputs
recipe. Run on the GPU machine from the repository root (fla travels as wheels: see
benchmarks/README.md):

    python3 benchmarks/bench_ops.py --shapes 4,4096,16,128 1,16384,16,128 --fla \\
        2>&1 | tee $OUT/bench_ops.log
    python3 benchmarks/bench_ops.py --memory ours --shapes 1,65536,16,128   # peak memory
    python3 benchmarks/report.py $OUT/bench_ops.json                         # Markdown table

fla's parity arguments (issue 23), with --parity: the fused gate and beta activation
(use_gate_in_kernel with A_log, dt_bias, use_beta_sigmoid_in_kernel: "gdn_gate", "kda_gate")
and grouped value heads (HV = 2 H: "gdn_gva", "kda_gva"), ours fused / grouped against ours
unfused (activations outside, in the same jit; q and k repeated per group) and fla's same call:

    python3 benchmarks/bench_ops.py --parity --shapes 4,4096,16,128 --fla

Timing: ours is the median over --reps repetitions of as many back-to-back jitted calls as fill
~20 ms, per call; fla's is the faster of triton's do_bench and that same method (both kept in
the JSON). --parity times every call of a case once per round, in turn, over --rounds rounds
(default 3) and keeps each call's best. Correctness on the GPU is `pytest -m gpu tests/test_kernels_gpu.py`, not this script.
"""

from __future__ import annotations

import argparse
import time

import timing


def bench_ours(ops, shape, names, impls, reps, res, value_dim=None):
    import jax
    import jax.numpy as jnp
    B, T, H, D = shape
    key = "x".join(map(str, shape))
    for op in names:
        q, k, v, beta, g, do = timing.make_inputs(B, T, H, D, value_dim or D, timing.GATE_OF[op],
                                                  jnp.bfloat16)
        for impl in impls:
            if impl == "chunk" and op == "kda" and T * B > 8192:
                continue   # the XLA KDA form materialises [C, C, K] decays: 60+ ms, not informative
            fwd, fwdbwd = timing.op_fns(ops, op, impl)
            label = {"pallas": "pallas", "chunk": "xla"}[impl]
            for mode, fn, args in (("fwd", fwd, (q, k, v, beta, g)),
                                   ("fwdbwd", fwdbwd, (q, k, v, beta, g, do))):
                name = f"{op}/{label}/{mode}"
                try:
                    t0 = time.perf_counter()
                    jax.block_until_ready(fn(*args))
                    first = time.perf_counter() - t0
                    res[name] = timing.time_jax(fn, *args, reps=reps)
                    timing.log(f"[ours] {key} {name:24s} {res[name]:8.3f} ms   (first call "
                               f"{first:.1f} s)")
                except Exception as e:  # noqa: BLE001
                    res[name] = f"error: {type(e).__name__}: {str(e)[:300]}"
                    timing.log(f"[ours] {key} {name} ERROR {type(e).__name__}: {str(e)[:1500]}")


def time_torch(call, reps):
    """(triton do_bench median, wall-clock) milliseconds of a torch call, after six warm-up calls."""
    import torch
    import triton.testing as tt
    for _ in range(6):
        call()
    torch.cuda.synchronize()
    dob = tt.do_bench(call, warmup=40, rep=200, return_mode="median")
    return dob, timing.wall_ms(call, lambda out=None: torch.cuda.synchronize(), reps)


def bench_fla(shape, names, reps, modes, res, results, value_dim=None):
    import torch
    fla = timing.fla_ops()
    if fla is None:
        results["fla_error"] = "fla does not import"
        return
    import fla as fla_pkg
    import triton
    results["versions"].update(torch=torch.__version__, triton=triton.__version__,
                               fla=fla_pkg.__version__)
    B, T, H, D = shape
    key = "x".join(map(str, shape))
    q, k, v, g, gk, beta, do = timing.fla_inputs(B, T, H, D, V=value_dim)
    for op in names:
        f = lambda fn=fla[op]: fn(q, k, v, g, gk, beta)   # noqa: E731
        for mode in modes:
            call = f if mode == "fwd" else (lambda f=f: f().backward(do))
            try:
                dob, wall = time_torch(call, reps)
                res[f"{op}/fla_do_bench/{mode}"], res[f"{op}/fla_wall/{mode}"] = dob, wall
                res[f"{op}/fla/{mode}"] = min(dob, wall)
                timing.log(f"[fla]  {key} {op}/fla/{mode:7s} {min(dob, wall):8.3f} ms   "
                           f"(do_bench {dob:.3f}, wall {wall:.3f})")
            except Exception as e:  # noqa: BLE001
                res[f"{op}/fla/error"] = repr(e)[:300]
                timing.log(f"[fla]  {key} {op} ERROR {e!r}"[:1500])
    del q, k, v, g, gk, beta, do
    torch.cuda.empty_cache()


def peak_memory(ops, shape, names, who, res):
    """Peak device memory of one fwd+bwd; one `who` per process (the peaks are per process)."""
    import jax
    import jax.numpy as jnp
    B, T, H, D = shape
    key = "x".join(map(str, shape))
    for op in names:
        try:
            if who == "ours":
                q, k, v, beta, g, do = timing.make_inputs(B, T, H, D, D, timing.GATE_OF[op],
                                                          jnp.bfloat16)
                jax.block_until_ready(timing.op_fns(ops, op, "pallas")[1](q, k, v, beta, g, do))
                stats = jax.devices()[0].memory_stats() or {}
                peak = stats.get("peak_bytes_in_use", float("nan")) / 1e9
            else:
                import torch
                fla = timing.fla_ops()
                q, k, v, g, gk, beta, do = timing.fla_inputs(B, T, H, D)
                if op == "kda":
                    g = gk
                del gk          # only the op's own gate counts towards the peak
                torch.cuda.reset_peak_memory_stats()
                fla[op](q, k, v, g, g, beta).backward(do)
                torch.cuda.synchronize()
                peak = torch.cuda.max_memory_allocated() / 1e9
                del q, k, v, beta, g, do
                torch.cuda.empty_cache()
            res[f"{op}/{who}"] = peak
            timing.log(f"[memory] {key} {op}/{who} fwd+bwd peak {peak:.2f} GB")
        except Exception as e:  # noqa: BLE001
            res[f"{op}/{who}"] = f"error: {type(e).__name__}: {str(e)[:300]}"
            timing.log(f"[memory] {key} {op}/{who} ERROR {type(e).__name__}: {str(e)[:1000]}")


PARITY = ("gdn_gate", "kda_gate", "gdn_gva", "kda_gva")


def parity_inputs_jax(case, B, T, H, D, seed=1):
    """bf16 q, k (unit), v [B, T, HV, D]; the gate cases: raw g (float32), beta logits (bf16),
    A_log [HV] = log U(1, 16), dt_bias ([HV] or [HV * D]); the grouped cases (HV = 2 H):
    g = logsigmoid, beta = sigmoid (activated). And a cotangent [B, T, HV, D]."""
    import jax
    import jax.numpy as jnp
    kda = case.startswith("kda")
    HV = 2 * H if case.endswith("gva") else H
    ks = jax.random.split(jax.random.PRNGKey(seed), 8)
    bf = jnp.bfloat16

    def l2(x):
        return x / jnp.sqrt(jnp.sum(x * x, -1, keepdims=True) + 1e-6)

    q = l2(jax.random.normal(ks[0], (B, T, H, D))).astype(bf)
    k = l2(jax.random.normal(ks[1], (B, T, H, D))).astype(bf)
    v = jax.random.normal(ks[2], (B, T, HV, D)).astype(bf)
    graw = jax.random.normal(ks[3], (B, T, HV, D) if kda else (B, T, HV))
    braw = jax.random.normal(ks[4], (B, T, HV))
    A_log = jnp.log(jax.random.uniform(ks[5], (HV,), minval=1.0, maxval=16.0))
    dt_bias = 0.1 * jax.random.normal(ks[6], (HV * D,) if kda else (HV,))
    do = jax.random.normal(ks[7], (B, T, HV, D)).astype(bf)
    if case.endswith("gva"):
        return dict(q=q, k=k, v=v, g=jax.nn.log_sigmoid(graw),
                    beta=jax.nn.sigmoid(braw).astype(bf)), do
    return dict(q=q, k=k, v=v, g=graw, beta=braw.astype(bf), A_log=A_log,
                dt_bias=dt_bias), do


def parity_fns(ops, case, variant):
    """Jitted fwd(**x) and fwdbwd(x, do) of ours: variant "fused" (the parity arguments) or
    "unfused" (activations outside in the same jit / q, k repeated per group)."""
    import jax
    import jax.numpy as jnp
    kda = case.startswith("kda")
    op = ops.kda if kda else ops.gated_delta_rule

    def fwd(x):
        q, k, v, g, beta = x["q"], x["k"], x["v"], x["g"], x["beta"]
        if case.endswith("gate") and variant == "fused":
            return op(q, k, v, g, beta, use_gate_in_kernel=True, A_log=x["A_log"],
                      dt_bias=x["dt_bias"], use_beta_sigmoid_in_kernel=True, impl="pallas")[0]
        if case.endswith("gate"):
            a = jnp.exp(x["A_log"].astype(jnp.float32))
            bias = x["dt_bias"]
            if kda:
                a, bias = a[:, None], bias.reshape(a.shape[0], -1)
            g = -a * jax.nn.softplus(g.astype(jnp.float32) + bias)
            beta = jax.nn.sigmoid(beta.astype(jnp.float32))
        elif variant == "unfused":
            G = v.shape[2] // q.shape[2]
            q, k = jnp.repeat(q, G, axis=2), jnp.repeat(k, G, axis=2)
        return op(q, k, v, g, beta, impl="pallas")[0]

    def fwdbwd(x, do):
        return jax.vjp(fwd, x)[1](do)

    return jax.jit(fwd), jax.jit(fwdbwd)


def parity_fla(case, B, T, H, D):
    """fla's same call (torch): (fn() -> o, do), or None when fla does not import."""
    import torch
    import torch.nn.functional as F
    if timing.fla_ops() is None:          # also lifts fla's Triton guard, as for the other rows
        return None
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule
    from fla.ops.kda import chunk_kda
    kda = case.startswith("kda")
    HV = 2 * H if case.endswith("gva") else H
    dev, bf = "cuda", torch.bfloat16
    unit = lambda: F.normalize(torch.randn(B, T, H, D, device=dev), dim=-1).to(bf)   # noqa: E731
    q, k = unit().requires_grad_(), unit().requires_grad_()
    v = torch.randn(B, T, HV, D, device=dev, dtype=bf).requires_grad_()
    graw = torch.randn(*((B, T, HV, D) if kda else (B, T, HV)), device=dev)
    braw = torch.randn(B, T, HV, device=dev)
    do = torch.randn(B, T, HV, D, device=dev, dtype=bf)
    fn = chunk_kda if kda else chunk_gated_delta_rule
    if case.endswith("gva"):
        g = F.logsigmoid(graw).requires_grad_()
        beta = torch.sigmoid(braw).to(bf).requires_grad_()
        return (lambda: fn(q, k, v, g, beta)[0]), do
    A_log = torch.log(torch.empty(HV, device=dev).uniform_(1, 16)).requires_grad_()
    dt_bias = (0.1 * torch.randn(HV * D if kda else HV, device=dev)).requires_grad_()
    g, beta = graw.requires_grad_(), braw.to(bf).requires_grad_()
    return (lambda: fn(q, k, v, g, beta, A_log=A_log, dt_bias=dt_bias, use_gate_in_kernel=True,
                       use_beta_sigmoid_in_kernel=True)[0]), do


def _round_order(timers, rnd):
    """The callables of one round, mode by mode (fused, unfused, fla), with fused and unfused
    swapped every other round: of two like calls timed in turn, the first runs slower (H200,
    GDN B4 T4096 fused gate: 2-3 us of the 0.39 ms forward, whichever variant goes first), so
    each variant goes first in half of the rounds."""
    variants = ("fused", "unfused", "fla") if rnd % 2 == 0 else ("unfused", "fused", "fla")
    names = [f"{case}/{v}/{mode}" for case in {n.split("/")[0] for n in timers}
             for mode in ("fwd", "fwdbwd") for v in variants]
    return [(n, timers[n]) for n in names if n in timers]


def bench_parity(ops, shape, cases, reps, with_fla, res, rounds=1, on_case=None):
    """Ours fused / unfused and fla's call per case, fwd and fwd+bwd. With rounds > 1 every
    callable of a case is timed once per round, in turn (`_round_order`), and the best round is
    kept (as tune.py), so that a drifting clock, a neighbour's load or the position in the round
    favours none of them."""
    import jax
    B, T, H, D = shape
    key = "x".join(map(str, shape))
    for case in cases:
        x, do = parity_inputs_jax(case, B, T, H, D)
        timers = {}                 # name -> () -> ms
        for variant in ("fused", "unfused"):
            fwd, fwdbwd = parity_fns(ops, case, variant)
            for mode, fn, args in (("fwd", fwd, (x,)), ("fwdbwd", fwdbwd, (x, do))):
                name = f"{case}/{variant}/{mode}"
                try:
                    jax.block_until_ready(fn(*args))
                    timers[name] = lambda fn=fn, args=args: timing.time_jax(fn, *args, reps=reps)
                except Exception as e:  # noqa: BLE001
                    res[name] = f"error: {type(e).__name__}: {str(e)[:300]}"
                    timing.log(f"[ours] {key} {name} ERROR {type(e).__name__}: {str(e)[:1500]}")
        made = None
        if with_fla:
            try:
                made = parity_fla(case, B, T, H, D)
            except Exception as e:  # noqa: BLE001
                res[f"{case}/fla/error"] = repr(e)[:300]
                timing.log(f"[fla]  {key} {case} ERROR {e!r}"[:1500])
        if made is not None:
            f, fdo = made
            for mode in ("fwd", "fwdbwd"):
                call = f if mode == "fwd" else (lambda: f().backward(fdo))
                timers[f"{case}/fla/{mode}"] = lambda call=call: min(time_torch(call, reps))
        for rnd in range(rounds):
            for name, timer in _round_order(timers, rnd):
                try:
                    t = timer()
                except Exception as e:  # noqa: BLE001
                    res[name] = f"error: {type(e).__name__}: {str(e)[:300]}"
                    timing.log(f"{key} {name} ERROR {e!r}"[:1500])
                    continue
                if isinstance(res.get(name, 0.0), float):
                    res[name] = min(res.get(name, float("inf")), t)
        for name in timers:
            if isinstance(res.get(name), float):
                timing.log(f"[{'fla' if '/fla/' in name else 'ours'}] {key} {name:26s} "
                           f"{res[name]:8.3f} ms (best of {rounds})")
        del x, do, timers, made
        if on_case is not None:     # results so far survive a time-out of the next case
            on_case()
        if with_fla:
            import torch
            torch.cuda.empty_cache()


def parity_table(results):
    timing.log("\n=== parity rows (ms, bf16; x = other / fused: > 1 means the fused call is "
               "faster) ===")
    for key, res in results["bench_ms"].items():
        timing.log(f"-- {key}")
        for case in PARITY:
            for mode in ("fwd", "fwdbwd"):
                ours = res.get(f"{case}/fused/{mode}")
                if ours is None:
                    continue
                row = [f"{case:9s} {mode:7s}"]
                for label in ("fused", "unfused", "fla"):
                    val = res.get(f"{case}/{label}/{mode}")
                    if isinstance(val, float):
                        ratio = (f" x{val / ours:.2f}" if isinstance(ours, float)
                                 and label != "fused" else "")
                        row.append(f"{label}={val:.3f}{ratio}")
                    elif val is not None:
                        row.append(f"{label}=ERR")
                timing.log("  " + "  ".join(row))


def table(results, names, impls):
    timing.log("\n=== summary (ms, bf16; ratio = fla / ours: > 1 means ours is faster) ===")
    labels = [{"pallas": "pallas", "chunk": "xla"}[i] for i in impls] + ["fla"]
    for key, res in results["bench_ms"].items():
        timing.log(f"-- {key}")
        for op in names:
            for mode in ("fwd", "fwdbwd"):
                fla = res.get(f"{op}/fla/{mode}")
                row = [f"{op:9s} {mode:7s}"]
                for label in labels:
                    val = res.get(f"{op}/{label}/{mode}")
                    if isinstance(val, float):
                        ratio = (f" x{fla / val:.2f}" if isinstance(fla, float) and label != "fla"
                                 else "")
                        row.append(f"{label}={val:.3f}{ratio}")
                    elif val is not None:
                        row.append(f"{label}=ERR")
                timing.log("  " + "  ".join(row))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shapes", nargs="+", type=timing.shape_arg, default=[(4, 4096, 16, 128)],
                    help="B,T,H,D (K = V = D)")
    ap.add_argument("--ops", nargs="+", default=["gdn", "deltanet", "kda"],
                    choices=sorted(timing.GATE_OF))
    ap.add_argument("--impls", nargs="+", default=["pallas"], choices=["pallas", "chunk"],
                    help="ours: the kernels and/or the XLA chunk form")
    ap.add_argument("--fla", action="store_true", help="also time fla in this process")
    ap.add_argument("--value-dim", type=int, default=None,
                    help="V per head (default D; fla's GatedDeltaNet LM: K 256, V 512)")
    ap.add_argument("--fla-modes", nargs="+", default=["fwd", "fwdbwd"],
                    choices=["fwd", "fwdbwd"],
                    help="fwd alone skips fla's fwd+bwd, whose first call autotunes for minutes")
    ap.add_argument("--memory", choices=["ours", "fla"],
                    help="peak memory of one fwd+bwd instead of times (one side per process)")
    ap.add_argument("--parity", action="store_true",
                    help="fla's parity rows instead: fused gate and grouped value heads "
                         "(HV = 2 H), ours fused / unfused and (--fla) fla's same call")
    ap.add_argument("--parity-cases", nargs="+", default=list(PARITY), choices=list(PARITY),
                    help="which parity rows (fla's first fwd+bwd of each autotunes for minutes)")
    ap.add_argument("--reps", type=int, default=30, help="timed repetitions")
    ap.add_argument("--rounds", type=int, default=3,
                    help="--parity: interleaved rounds of every call of a case, best kept")
    ap.add_argument("--out", default=None, help="folder for bench_ops.json (default $OUT)")
    args = ap.parse_args()

    ops = timing.import_tree()
    import jax
    results = {"device": str(jax.devices()[0]), "device_kind": jax.devices()[0].device_kind,
               "versions": {"jax": jax.__version__}, "bench_ms": {},
               "memory_fwd_bwd_peak_GB": {}}
    timing.log(f"device {results['device']}  jax {jax.__version__}  shapes {args.shapes}")
    for shape in args.shapes:
        key = "x".join(map(str, shape))
        if args.memory:
            peak_memory(ops, shape, args.ops, args.memory, results["memory_fwd_bwd_peak_GB"].setdefault(key, {}))
        elif args.parity:
            bench_parity(ops, shape, args.parity_cases, args.reps, args.fla,
                         results["bench_ms"].setdefault(key, {}), rounds=args.rounds,
                         on_case=lambda: timing.save_json(results, args.out, "bench_ops.json"))
        else:
            res = results["bench_ms"].setdefault(key, {})
            bench_ours(ops, shape, args.ops, args.impls, args.reps, res, args.value_dim)
            if args.fla:
                bench_fla(shape, args.ops, args.reps, args.fla_modes, res, results, args.value_dim)
        timing.save_json(results, args.out, "bench_ops.json")
    if args.parity:
        parity_table(results)
    elif not args.memory:
        table(results, args.ops, args.impls)


if __name__ == "__main__":
    main()
