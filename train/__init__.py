"""Training (installed as atlas_jax.train); the training issue fills this in."""
