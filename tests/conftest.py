"""Set up XLA for the test suite before JAX starts: CPU thread pools sized to the CPUs this
machine really has, compile-time optimisations off and, on jaxlib 0.10, XLA's older, faster-compiling
CPU emitters.

The tests run tiny shapes, so compiling dominates their time (Pallas interpret mode unrolls every
kernel into a large XLA program). JAX_DISABLE_MOST_OPTIMIZATIONS skips XLA's and LLVM's expensive
passes: the suite ran in 5.0 instead of 7.4-8.8 min (2 CPUs, 200 tests), with the same
operations (rounding may differ in the last bits, far inside the tolerances) and all tests
passing. Set it to 0 to test with full optimisation.

XLA sizes its client and compiler thread pools from the CPU affinity mask
(tsl::port::MaxParallelism), which ignores a container's CPU quota. On a 2-CPU quota over a
many-core host each pytest-xdist worker would start one thread per host core and the quota
throttles them all. XLA reads NPROC (PJRT_NPROC first) as the reservation instead; we set it to
min(affinity, quota) unless the caller already did.

A small pool exposed a deadlock (a test hung here with both threads of the 2-thread pool inside
LAPACK trsm, each waiting for batch work queued behind the other): the XLA forms now solve with
matmuls (atlas_jax/linalg.py). pytest-timeout turns any other hang into a failure with stacks.
"""
from __future__ import annotations

import math
import os


def _cpu_quota() -> float | None:
    try:                                                   # cgroup v2
        quota, period = open("/sys/fs/cgroup/cpu.max").read().split()[:2]
        return None if quota == "max" else int(quota) / int(period)
    except (OSError, ValueError):
        pass
    try:                                                   # cgroup v1
        quota = int(open("/sys/fs/cgroup/cpu/cpu.cfs_quota_us").read())
        period = int(open("/sys/fs/cgroup/cpu/cpu.cfs_period_us").read())
        return None if quota <= 0 else quota / period
    except (OSError, ValueError):
        return None


def available_cpus() -> int:
    cpus = float(len(os.sched_getaffinity(0)))
    quota = _cpu_quota()
    if quota is not None:
        cpus = min(cpus, quota)
    return max(1, math.floor(cpus))


os.environ.setdefault("JAX_DISABLE_MOST_OPTIMIZATIONS", "1")


def _jaxlib_version() -> str:
    from importlib import metadata
    try:
        return metadata.version("jaxlib")
    except metadata.PackageNotFoundError:
        return ""


# XLA's CPU fusion emitters (MLIR) compile a fusion several times slower than the elemental IR
# emitters they replace, and compiling is most of this suite's time: three of its slower tests took
# 34 instead of 54 s with them off (backend compile 17 against 37 s; the whole suite 15:29 against
# 25:40; 2 CPUs, jaxlib 0.10.2, 2026-11-30). Same operations, another code generator. Only on the
# jaxlib 0.10 line, where the flag is known to exist: 0.11.2 (the GPU machines') no longer has it,
# and XLA aborts on an unknown flag. Any XLA_FLAGS setting of the caller's wins.
if (_jaxlib_version().startswith("0.10.")
        and "xla_cpu_use_fusion_emitters" not in os.environ.get("XLA_FLAGS", "")):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_cpu_use_fusion_emitters=false").strip()

# Every worker gets all of them, not a share: on 2 CPUs with 2 workers, 1-thread pools per worker
# were no faster (8.2 against 7.4-8.8 min for the whole suite).
if not (os.environ.get("PJRT_NPROC") or os.environ.get("NPROC")):
    os.environ["NPROC"] = str(available_cpus())


def _setup_line():
    return (f"CPUs: affinity {len(os.sched_getaffinity(0))}, cgroup quota {_cpu_quota()}, "
            f"XLA thread pools (NPROC) {os.environ.get('PJRT_NPROC') or os.environ['NPROC']}, "
            f"JAX_DISABLE_MOST_OPTIMIZATIONS={os.environ['JAX_DISABLE_MOST_OPTIMIZATIONS']}, "
            f"XLA_FLAGS={os.environ.get('XLA_FLAGS', '')!r}")


def pytest_report_header(config):
    return _setup_line()


def pytest_terminal_summary(terminalreporter):
    # -q hides the header; CI keeps the end of the log, so say it there too.
    terminalreporter.write_line(_setup_line())


import gc  # noqa: E402

import pytest  # noqa: E402


@pytest.fixture(autouse=True, scope="module")
def _release_compiled_programs():
    """Each test module's compiled programs are dropped after it: a pytest-xdist worker runs
    modules of every layer (kernels in interpret mode, models, training) one after another, and
    their executables would otherwise pile up in one process (a worker that had run ~200 tests
    crashed in XLA's CPU compiler on the next large interpret-mode kernel)."""
    yield
    import jax
    jax.clear_caches()
    gc.collect()
