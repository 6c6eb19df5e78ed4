"""The shipped YAML configs, installed as the package ``atlas_jax.configs`` (see pyproject's
package-dir); ``atlas_jax.config.config_dir()`` finds them in any install.

    experiments/   one base config per experiment command (atlas-jax memorize, ...)
    models/        one per memory preset: the preset, its options, an optional ``model`` section
"""
