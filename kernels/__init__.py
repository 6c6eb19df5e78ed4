"""Pallas kernels (installed as atlas_jax.kernels)."""
