"""Watching a run: metrics.jsonl, TensorBoard events, a tqdm bar and the loss-curve PNG.

Only process 0 writes. A resumed run first drops the lines a killed run wrote after the checkpoint
it resumes from, so metrics.jsonl reads as one uninterrupted run.
"""
from __future__ import annotations

import json
import math
import time
from pathlib import Path

METRICS_FILE = "metrics.jsonl"
PLOT_FILE = "loss.png"


def read_metrics(run_dir) -> list[dict]:
    path = Path(run_dir) / METRICS_FILE
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _finite_or_none(value):
    value = float(value)
    return value if math.isfinite(value) else None


class MetricsWriter:
    def __init__(self, run_dir, *, start_step: int, total_steps: int, tensorboard: bool, progress: bool,
                 enabled: bool = True):
        self.enabled = enabled
        self.run_dir = Path(run_dir)
        self.path = self.run_dir / METRICS_FILE
        self._tb = self._bar = None
        self._last_time, self._last_step = time.perf_counter(), start_step
        if not enabled:
            return
        kept = [r for r in read_metrics(run_dir) if r.get("step", 0) <= start_step]
        self.path.write_text("".join(json.dumps(r) + "\n" for r in kept))
        self._file = self.path.open("a")
        if tensorboard:
            from tensorboardX import SummaryWriter

            # purge_step hides the events a killed run wrote past the checkpoint resumed from.
            self._tb = SummaryWriter(str(self.run_dir / "tensorboard"), purge_step=start_step + 1 if start_step else None)
        if progress:
            from tqdm import tqdm

            self._bar = tqdm(total=total_steps, initial=start_step, unit="step", dynamic_ncols=True,
                             desc=self.run_dir.name)

    def advance(self, steps: int = 1):
        if self._bar is not None:
            self._bar.update(steps)

    def throughput(self, step: int, tokens_per_step: int) -> float:
        now = time.perf_counter()
        rate = (step - self._last_step) * tokens_per_step / max(now - self._last_time, 1e-9)
        self._last_time, self._last_step = now, step
        return rate

    def write(self, record: dict):
        """One JSON object per logged step (NaN/inf written as null, JSON has neither)."""
        if not self.enabled:
            return
        clean = {k: (_finite_or_none(v) if isinstance(v, float) else v) for k, v in record.items()}
        self._file.write(json.dumps(clean) + "\n")
        self._file.flush()
        step = record["step"]
        if self._tb is not None:
            for key, value in record.items():
                if key != "step" and isinstance(value, (int, float)) and not isinstance(value, bool):
                    self._tb.add_scalar(f"{'eval' if key.startswith('eval') else 'train'}/{key}", value, step)
            self._tb.flush()
        if self._bar is not None:
            shown = {"loss": f"{record['loss']:.4f}"} if "loss" in record else {}
            if "tokens_per_s" in record:
                shown["tok/s"] = f"{record['tokens_per_s']:.0f}"
            if "eval_loss" in record:
                shown["eval_ppl"] = f"{record['eval_perplexity']:.2f}"
            self._bar.set_postfix(shown, refresh=False)

    def message(self, text: str):
        if not self.enabled:
            return
        if self._bar is not None:
            self._bar.write(text)
        else:
            print(text, flush=True)

    def close(self):
        if not self.enabled:
            return
        if self._bar is not None:
            self._bar.close()
        if self._tb is not None:
            self._tb.close()
        self._file.close()


def plot_losses(run_dirs, out_path, labels=None, title="Training loss") -> Path:
    """Training loss (lines) and held-out loss (markers) of one or more runs against the step."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    run_dirs = [run_dirs] if isinstance(run_dirs, (str, Path)) else list(run_dirs)
    labels = labels or [Path(d).name for d in run_dirs]
    fig, ax = plt.subplots(figsize=(7, 4.2))
    for run_dir, label in zip(run_dirs, labels):
        records = read_metrics(run_dir)
        train = [(r["step"], r["loss"]) for r in records if r.get("loss") is not None]
        held = [(r["step"], r["eval_loss"]) for r in records if r.get("eval_loss") is not None]
        if train:
            line, = ax.plot(*zip(*train), label=f"{label} train", linewidth=1.2)
            if held:
                ax.plot(*zip(*held), "o--", color=line.get_color(), label=f"{label} held-out", markersize=4)
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy (nats / token)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    out_path = Path(out_path)
    fig.savefig(out_path, dpi=120)
    plt.close(fig)
    return out_path
