"""Feasibility probe for issue 21: a deep-memory forward state pass as ONE persistent Pallas GPU
kernel (not yet in the library; `atlas_jax.kernels.deep_memory` still has the one-program-per-head
walk). Programs (hidden tile j, sequence·head bh), j fastest so that a head's tiles are launched
together; each walks all N chunks; per chunk every program forms its tile's share of Y = σ(a W0) W1,
writes it to a double-buffered slot, and a grid barrier per head (an atomic counter, spun on with
atomic reads; a spin cap ends a deadlock instead of hanging) lets every tile sum the shares and
update its own columns of W0 / m0 and rows of W1 / m1 (start states kept per chunk, as the walk).
Interpret mode runs programs one after another, so this kernel cannot run there.

    python benchmarks/persistent_state_pass.py 4,8,64,64,128,512     # B, H, N chunks, n, d, h

Measured on an H200 (2026-11-26, titans sizes, momentum, GELU; forward with every start state
kept): bf16 sources, block 64 / 8 warps 3.86 ms against XLA's 7.87 (default precision) and the walk
kernel's 9.81; float32 (six-bf16-dot exact products) 15.15 ms, equal to XLA at HIGHEST precision
within 5.3e-7. A scalar `plgpu.atomic_add` counts once per program (probed first).
"""
import sys, os, time, functools
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from timing import import_tree
import_tree()
import jax, jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu
from atlas_jax.ops.deep_memory.state_pass import MLPStates, mlp_state_pass
from atlas_jax.kernels.deep_memory.support import act_and_grad, F32
from atlas_jax.kernels.delta_family.gpu_math import load_f32, mm, mm_nt, mm_tn
from atlas_jax.kernels.deep_memory import MLPGpuBlockSizes

CAP = 1 << 16


def probe():
    def k(c_ref, o_ref):
        plgpu.atomic_add(o_ref, (0,), 1)
    out = pl.pallas_call(k, grid=(4,), out_shape=jax.ShapeDtypeStruct((1,), jnp.int32),
                         input_output_aliases={0: 0},
                         compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=1))(jnp.zeros((1,), jnp.int32))
    return int(out[0]) // 4


def persistent_forward(state, a, t, rows, mrows, decay, carry, mcarry, *, bt=64, warps=8, factor=1):
    BH, N, n, d = a.shape
    h, dv = state.w0.shape[-1], state.w1.shape[-1]
    NT = h // bt
    low = a.dtype == jnp.bfloat16

    def kernel(a_ref, t_ref, r_ref, mr_ref, dec_ref, car_ref, mc_ref, w0_ref, w1_ref, m0_ref, m1_ref, c_in,
               s_w0, s_w1, s_m0, s_m1, f_w0, f_w1, f_m0, f_m1, yp_ref, cnt):
        j, bh = pl.program_id(0), pl.program_id(1)
        cols = pl.ds(pl.multiple_of(j * bt, bt), bt)
        al = slice(None)
        s_w0[bh, 0, :, cols] = w0_ref[bh, :, cols]
        s_m0[bh, 0, :, cols] = m0_ref[bh, :, cols]
        s_w1[bh, 0, cols, :] = w1_ref[bh, cols, :]
        s_m1[bh, 0, cols, :] = m1_ref[bh, cols, :]
        plgpu.debug_barrier()
        operand = (lambda x: x) if low else (lambda x: x.astype(F32))

        def chunk(i, c):
            a_ = a_ref[bh, i, :, :]
            a_ = a_ if low else a_.astype(F32)
            tg = load_f32(t_ref, (bh, i, al, al))
            rw = load_f32(r_ref, (bh, i, al))[:, None]
            mrw = load_f32(mr_ref, (bh, i, al))[:, None]
            dec = load_f32(dec_ref, (bh, pl.ds(i, 1)))[None, :]
            ce = load_f32(car_ref, (bh, pl.ds(i, 1)))[None, :]
            mc = load_f32(mc_ref, (bh, pl.ds(i, 1)))[None, :]
            w0 = load_f32(s_w0, (bh, i, al, cols)); w1 = load_f32(s_w1, (bh, i, cols, al))
            z = mm(a_, w0, low)
            hid, slope = act_and_grad("gelu", z)
            slot = lax.rem(i, 2)
            yp_ref[bh, slot, j, :, :] = mm(hid, w1, low)
            plgpu.debug_barrier()
            plgpu.atomic_add(cnt, (bh,), 1)
            target = NT * (i + 1) * factor

            def cond(s):
                return jnp.logical_and(s[0] < target, s[1] < CAP)

            def body(s):
                return plgpu.atomic_add(cnt, (bh,), 0), s[1] + 1

            lax.while_loop(cond, body, (jnp.int32(0), jnp.int32(0)))
            y = lax.fori_loop(0, NT, lambda q, acc: acc + plgpu.load(yp_ref.at[bh, slot, q, :, :], volatile=True),
                              jnp.zeros((n, dv), F32))
            e = y - tg
            d0 = mm_nt(e, w1, low) * slope
            m0 = load_f32(s_m0, (bh, i, al, cols)); m1 = load_f32(s_m1, (bh, i, cols, al))
            nw0 = dec * w0 + mm_tn(a_, operand(rw * d0), low) + ce * m0
            nw1 = dec * w1 + mm_tn(operand(hid), operand(rw * e), low) + ce * m1
            nm0 = mc * m0 + mm_tn(a_, operand(mrw * d0), low)
            nm1 = mc * m1 + mm_tn(operand(hid), operand(mrw * e), low)

            @pl.when(i + 1 < N)
            def _():
                s_w0[bh, i + 1, :, cols] = nw0; s_w1[bh, i + 1, cols, :] = nw1
                s_m0[bh, i + 1, :, cols] = nm0; s_m1[bh, i + 1, cols, :] = nm1

            @pl.when(i + 1 == N)
            def _():
                f_w0[bh, :, cols] = nw0; f_w1[bh, cols, :] = nw1
                f_m0[bh, :, cols] = nm0; f_m1[bh, cols, :] = nm1
            plgpu.debug_barrier()
            return c

        lax.fori_loop(0, N, chunk, 0)

    sds = lambda *s: jax.ShapeDtypeStruct(s, F32)
    outs = [sds(BH, N, d, h), sds(BH, N, h, dv), sds(BH, N, d, h), sds(BH, N, h, dv),
            sds(BH, d, h), sds(BH, h, dv), sds(BH, d, h), sds(BH, h, dv), sds(BH, 2, NT, n, dv),
            jax.ShapeDtypeStruct((BH,), jnp.int32)]
    res = pl.pallas_call(kernel, grid=(NT, BH), out_shape=outs, input_output_aliases={11: 9},
                         compiler_params=plgpu.CompilerParams(num_warps=warps, num_stages=1),
                         name="mlp_state_pass_persistent")(
        a, t, rows, mrows, decay, carry, mcarry, state.w0, state.w1, state.m0, state.m1,
        jnp.zeros((BH,), jnp.int32))
    return MLPStates(*res[:4]), MLPStates(*res[4:8]), res[9]


if __name__ == "__main__":
    factor = probe()
    print("atomic increments per program for one scalar atomic_add:", factor, flush=True)
    B, H, N, n, d, h = [int(x) for x in (sys.argv[1] if len(sys.argv) > 1 else "4,8,64,64,128,512").split(",")]
    dv = d
    ks = jax.random.split(jax.random.PRNGKey(0), 12)
    f = lambda i, s, sc=1.0: sc * jax.random.normal(ks[i], s, jnp.float32)
    state = MLPStates(f(0, (B, H, d, h), 0.05), f(1, (B, H, h, dv), 0.05), f(2, (B, H, d, h), 0.01), f(3, (B, H, h, dv), 0.01))
    a = f(4, (B, H, N, n, d)) / jnp.sqrt(d)
    rest = (f(5, (B, H, N, n, dv)), -0.01 * jax.nn.sigmoid(f(6, (B, H, N, n))), -0.01 * jax.nn.sigmoid(f(7, (B, H, N, n))),
            jax.nn.sigmoid(4 + f(8, (B, H, N))), jax.nn.sigmoid(f(9, (B, H, N))), jax.nn.sigmoid(2 + f(10, (B, H, N))))
    flat = lambda x: x.reshape((B * H,) + x.shape[2:])
    rel = lambda x, y: float(jnp.linalg.norm((x - y).ravel()) / (jnp.linalg.norm(y.ravel()) + 1e-30))

    def timeit(g, *args, reps=10):
        r = g(*args); jax.block_until_ready(r); best = 1e9
        for _ in range(3):
            t0 = time.perf_counter()
            for _ in range(reps): r = g(*args)
            jax.block_until_ready(r); best = min(best, (time.perf_counter() - t0) / reps * 1e3)
        return best, r

    with jax.default_matmul_precision("highest"):
        ref_hi = jax.jit(lambda *x: mlp_state_pass(*x, activation="gelu", impl="chunk"))(state, a, *rest)
    xla_ms, ref = timeit(jax.jit(lambda *x: mlp_state_pass(*x, activation="gelu", impl="chunk")), state, a, *rest)
    print(f"xla f32 (default precision) fwd {xla_ms:.2f} ms; rel to highest: {rel(ref[1].w0, ref_hi[1].w0):.1e}", flush=True)
    for dt in (jnp.bfloat16, jnp.float32):
        args = (jax.tree.map(flat, state), flat(a.astype(dt))) + tuple(map(flat, rest))
        for bt, w in (((64, 8), (32, 4)) if dt == jnp.bfloat16 else ((64, 8),)):
            try:
                fn = jax.jit(functools.partial(persistent_forward, bt=bt, warps=w, factor=factor))
                ms, (starts, fin, cnt) = timeit(fn, *args)
                want = ref_hi
                err = max(rel(x.reshape(y.shape), y) for x, y in zip(jax.tree.leaves(fin), jax.tree.leaves(want[1])))
                errs = max(rel(x.reshape(y.shape), y) for x, y in zip(jax.tree.leaves(starts), jax.tree.leaves(want[0])))
                print(f"persistent {jnp.dtype(dt).name} bt{bt} w{w}: fwd {ms:.2f} ms  final rel {err:.1e} starts rel {errs:.1e}"
                      f"  counter {int(cnt[0])} (want {N * (h // bt) * factor})", flush=True)
            except Exception as ex:
                print(f"persistent {jnp.dtype(dt).name} bt{bt} w{w}: FAILED {type(ex).__name__}: {str(ex)[:400]}", flush=True)
    walk_ms, _ = timeit(jax.jit(lambda *x: mlp_state_pass(*x, activation="gelu", impl="pallas", block_sizes=MLPGpuBlockSizes())),
                        state, a.astype(jnp.bfloat16), *rest)
    print(f"walk kernel bf16 fwd {walk_ms:.2f} ms", flush=True)
