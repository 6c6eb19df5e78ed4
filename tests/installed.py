"""A regular (non-editable) install of this checkout, built once per test session, to run commands as
a user who typed ``pip install .`` would: from another working directory, with nothing of the
checkout on the import path.

    from installed import installed        # noqa: F401  (the session fixture, imported into a test module)

    def test_something(installed):
        done = installed.run(["atlas-jax", "memorize", "trials=1"])   # the installed console script
        done = installed.python("-c", "import atlas_jax; print(atlas_jax.__file__)")
        done = installed.shell("atlas-jax presets | head -3")          # e.g. a README bash block
        assert done.returncode == 0, done.stderr

Each call runs in an empty working directory (``installed.workdir``, or ``cwd=``), with
``PYTHONPATH=<site>`` only, ``PYTHONSAFEPATH=1`` (the working directory is not importable) and
``<site>/bin`` then the running interpreter's folder first on ``PATH``. Dependencies (jax, ...) come
from the running virtual environment, which may also hold an editable install of the checkout: the
``--target`` folder comes first on ``sys.path`` and wins (``installed.python`` can check
``atlas_jax.__file__``).

How it is built (``install``): the checkout's files, without .git, virtual environments, build
outputs and results, are copied to a temporary folder (a build writes ``build/`` and ``*.egg-info``
next to its sources, and two pytest-xdist workers must not share them), then

    python -m pip install --no-deps --no-index --no-build-isolation --target <site> <copy>

with the running interpreter's pip: a few seconds, offline. That needs a setuptools that builds
wheels by itself (>= 70.1) or the ``wheel`` package in the environment; without either (Python
3.11's venv ships setuptools 65.5 alone) pip builds in an isolated environment instead, which fetches
setuptools from the package index. The ``installed`` fixture builds once per session, shared by
pytest-xdist workers through a lock file in the session's temporary folder.
"""
from __future__ import annotations

import fcntl
import importlib.metadata
import importlib.util
import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

# Copied from the checkout: everything but these (names matched at any depth).
_SKIP = shutil.ignore_patterns(".git", ".venv", "venv", "build", "dist", "*.egg-info", "__pycache__",
                               ".pytest_cache", "results", ".mypy_cache", ".ruff_cache")

__all__ = ["Installed", "install", "installed", "ROOT"]


@dataclass(frozen=True)
class Installed:
    """A ``pip install --target`` of the package: ``site`` is the folder on PYTHONPATH."""

    site: Path
    workdir: Path

    @property
    def bin(self) -> Path:
        return self.site / "bin"

    def env(self, **extra: str) -> dict:
        env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
        env.update(PYTHONPATH=str(self.site), PYTHONSAFEPATH="1", PYTHONNOUSERSITE="1",
                   PATH=os.pathsep.join([str(self.bin), str(Path(sys.executable).parent), env.get("PATH", "")]))
        env.update(extra)
        return env

    def run(self, args, *, cwd=None, timeout: float = 300, env: dict | None = None,
            input: str | None = None) -> subprocess.CompletedProcess:
        """Runs ``args`` (a list; ``args[0]`` looked up on the install's PATH) and captures its output."""
        env = self.env(**(env or {}))
        args = [str(a) for a in args]
        exe = shutil.which(args[0], path=env["PATH"]) or args[0]
        return subprocess.run([exe, *args[1:]], cwd=cwd or self.workdir, env=env, capture_output=True, text=True,
                              timeout=timeout, input=input)

    def python(self, *args, **kwargs) -> subprocess.CompletedProcess:
        """The running interpreter with ``args`` (``"-c", code`` or ``"-m", module, ...``)."""
        return self.run([sys.executable, *args], **kwargs)

    def shell(self, script: str, **kwargs) -> subprocess.CompletedProcess:
        """``script`` under ``bash -euo pipefail`` (a README code block, say)."""
        return self.run(["bash", "-euo", "pipefail", "-c", script], **kwargs)


def _builds_wheels_offline() -> bool:
    """Whether this environment's setuptools can build a wheel without fetching anything."""
    if importlib.util.find_spec("wheel") is not None:
        return True
    try:
        version = importlib.metadata.version("setuptools")
    except importlib.metadata.PackageNotFoundError:
        return False
    return tuple(int(x) for x in re.findall(r"\d+", version)[:2]) >= (70, 1)


def install(folder: Path, source: Path = ROOT) -> Installed:
    """Copies ``source`` into ``folder/src`` and pip-installs it (not editable) into ``folder/site``."""
    folder = Path(folder)
    src, site, workdir = folder / "src", folder / "site", folder / "work"
    for path in (src, site):
        shutil.rmtree(path, ignore_errors=True)
    shutil.copytree(source, src, ignore=_SKIP, symlinks=True)
    workdir.mkdir(parents=True, exist_ok=True)
    command = [sys.executable, "-m", "pip", "install", "--no-deps", "--no-compile", "--disable-pip-version-check",
               "--quiet", "--target", str(site)]
    if _builds_wheels_offline():
        command += ["--no-index", "--no-build-isolation"]
    done = subprocess.run([*command, str(src)], capture_output=True, text=True, timeout=600, cwd=folder)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} {src} failed ({done.returncode}):\n{done.stdout}\n{done.stderr}")
    # An editable install of the checkout in the running environment puts a finder at the end of
    # sys.meta_path that serves any atlas_jax.<sub> the installed copy lacks (a package missing from
    # pyproject's list would still import). Python imports sitecustomize from PYTHONPATH after the
    # .pth files ran: drop those finders there, so only what pip installed can be imported.
    (site / "sitecustomize.py").write_text(
        "import sys\n"
        "sys.meta_path[:] = [f for f in sys.meta_path if '__editable__' not in getattr(f, '__module__', '')]\n"
        "sys.path_hooks[:] = [h for h in sys.path_hooks if '__editable__' not in getattr(h, '__module__', '')]\n")
    return Installed(site=site, workdir=workdir)


def _session_folder(tmp_path_factory) -> Path:
    """The session's temporary folder, shared by every pytest-xdist worker of this run."""
    base = tmp_path_factory.getbasetemp()
    return base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base


@pytest.fixture(scope="session")
def installed(tmp_path_factory) -> Installed:
    """The package installed once per session (per run, across xdist workers), non-editable."""
    folder = _session_folder(tmp_path_factory) / "atlas_jax_installed"
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        marker = folder / ".done"
        if marker.exists():
            return Installed(site=folder / "site", workdir=folder / "work")
        result = install(folder)
        marker.touch()
        return result
