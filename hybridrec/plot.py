"""Plot a run's metrics (JSON lines) into a PNG next to them.

Rows with ``"kind": "step"`` give the training loss per step; rows with
``"kind": "epoch"`` or ``"kind": "eval"`` give validation metrics (AUC and log
loss for click models, loss and perplexity for language models). matplotlib is
optional (``pip install matplotlib``): without it :func:`plot_metrics` returns
None and says so.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

# Metrics shown in the second panel when present, in this order.
EVAL_KEYS = ("val_auc", "val_logloss", "val_loss", "val_perplexity")


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
    rows = []
    for n, line in enumerate(Path(path).read_text(encoding="utf-8").splitlines(), start=1):
        if line.strip():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{n}: not a JSON line ({e.msg})") from None
    return rows


def plot_metrics(path: str | Path, out: str | Path | None = None) -> Path | None:
    """Write ``<path without .jsonl>.png`` (or ``out``); None if matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")  # no display needed
        import matplotlib.pyplot as plt
    except ImportError:
        print("plot skipped: matplotlib is not installed (pip install matplotlib)")
        return None
    rows = read_metrics(path)
    steps = [r for r in rows if r.get("kind") == "step"]
    evals = [r for r in rows if r.get("kind") in ("epoch", "eval")]
    fig, (ax_loss, ax_eval) = plt.subplots(1, 2, figsize=(10, 4))
    if steps:
        ax_loss.plot([r["step"] for r in steps], [r["loss"] for r in steps], lw=0.8)
    ax_loss.set_xlabel("step")
    ax_loss.set_ylabel("training loss")
    ax_loss.grid(alpha=0.3)
    drawn = False
    for key in EVAL_KEYS:
        pts = [
            (r["steps"] if "steps" in r else r.get("step", 0), r[key]) for r in evals if key in r
        ]
        if pts:
            ax_eval.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=key)
            drawn = True
    ax_eval.set_xlabel("step")
    if drawn:  # no validation data: an empty panel, no legend
        ax_eval.legend(loc="best")
    ax_eval.grid(alpha=0.3)
    fig.suptitle(Path(path).name)
    fig.tight_layout()
    target = Path(out) if out is not None else Path(path).with_suffix(".png")
    fig.savefig(target, dpi=100)
    plt.close(fig)
    return target
