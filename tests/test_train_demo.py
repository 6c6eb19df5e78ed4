"""The demo: both runs, perplexities beside the unigram baseline, samples and one plot in one folder."""
from __future__ import annotations

import json
import math

import pytest

from atlas_jax.train.demo import DEMO_MODELS, run_demo


def test_demo_pipeline_on_the_baseline(tmp_path, capsys):
    report = run_demo(tmp_path, steps=6, presets=["transformer"], new_tokens=8, progress=False,
                      overrides=["seq_len=32", "batch_size=4", "eval_every=6", "log_every=2", "data.vocab_size=300"])
    (row,) = report["models"]
    assert row["model"] == "Transformer++" and row["steps"] == 6 and math.isfinite(row["eval_perplexity"])
    assert report["unigram_perplexity"] > 10
    assert json.loads((tmp_path / "summary.json").read_text())["models"][0]["preset"] == "transformer"
    assert (tmp_path / "samples.txt").read_text().startswith("=== Transformer++")
    assert (tmp_path / "loss.png").stat().st_size > 0
    assert (tmp_path / "transformer" / "checkpoints" / "6").is_dir()
    out = capsys.readouterr().out
    assert "unigram baseline" in out and "Transformer++" in out


@pytest.mark.slow
@pytest.mark.xfail(strict=False, reason="atlas_jax.models' tiny ATLAS: non-finite gradients with segment_ids "
                   "(feature_coeffs, theta0_*) and ~10-100 s per step on 2 CPU cores; see the training report")
def test_full_demo_atlas_beats_the_unigram_baseline(tmp_path):
    report = run_demo(tmp_path, progress=False)
    assert [r["preset"] for r in report["models"]] == [m[0] for m in DEMO_MODELS]
    atlas = report["models"][0]
    assert atlas["eval_perplexity"] < 0.5 * report["unigram_perplexity"]
    assert sum(r["seconds"] for r in report["models"]) < 600
