"""Pallas kernels (installed as atlas_jax.kernels)."""


def lazy_exports(package: str, exports: dict):
    """A module ``__getattr__`` for ``package`` that imports ``package.<module>`` only when one of
    ``exports`` ({name: module}) is first read: importing a kernel package must not pull in Pallas
    (Triton or Mosaic)."""
    def __getattr__(name):
        if name in exports:
            import importlib
            return getattr(importlib.import_module(f"{package}.{exports[name]}"), name)
        raise AttributeError(f"module {package!r} has no attribute {name!r}")
    return __getattr__
