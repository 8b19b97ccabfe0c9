"""Plot a run's metrics (JSON lines, :mod:`hybridrec.train.metrics_file`) into a PNG next to them.

What the picture shows depends on what the run logged:

* a click model (``val_auc`` / ``val_logloss`` / ``test_auc``): left, log loss in nats
  per sample (the training loss of each logged stretch of steps as a line, validation
  as dots, the test result as a star, the popularity baseline dashed); right, ROC AUC
  (unitless; 0.5 is chance, 1 a perfect ranking) on its own axis, with the same marks
  and the training AUC over the recent steps' window (``train_auc``) as a line;
* a language model (``val_loss`` / ``val_ppl``): left, cross-entropy in nats per
  token (training line, validation dots); right, validation perplexity on a log
  scale;
* a next-item recommender (``val_ndcg@10`` / ``val_hr@10``): left, the training
  cross-entropy in nats per predicted item; right, HR@10 and NDCG@10 of the full
  ranking (0 to 1, higher is better), validation dots, the test results as stars and
  the popularity baseline's dashed;
* anything else: the training loss alone.

The x axis is the training step. A resumed run appends to the same file; a step
logged twice (a resume from an earlier checkpoint) keeps its latest value.
:func:`metrics_figure` builds the figure from rows (for a notebook),
:func:`plot_metrics` from a file into a PNG. matplotlib is optional (``pip install
matplotlib``): without it :func:`plot_metrics` returns None and says so.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

# Colours and marks shared by both panels, so a reader matches them at a glance.
TRAIN, VAL, TEST, BASE = "tab:blue", "tab:orange", "tab:green", "tab:gray"


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
    rows = []
    for n, line in enumerate(Path(path).read_text(encoding="utf-8").splitlines(), start=1):
        if line.strip():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{n}: not a JSON line ({e.msg})") from None
    return rows


def _step(row: dict[str, Any]) -> float:
    return float(row["step"] if "step" in row else row.get("steps", 0))


def series(
    rows: list[dict[str, Any]], kinds: tuple[str, ...], key: str
) -> list[tuple[float, float]]:
    """``(step, row[key])`` of the rows of ``kinds`` that have a finite ``key``, by step;
    a step that appears twice keeps the later row."""
    by_step: dict[float, float] = {}
    for r in rows:
        value = r.get(key)
        if r.get("kind") in kinds and isinstance(value, int | float) and math.isfinite(value):
            by_step[_step(r)] = float(value)
    return sorted(by_step.items())


def _line(ax: Any, pts: list[tuple[float, float]], **kw: Any) -> None:
    if pts:
        ax.plot([p[0] for p in pts], [p[1] for p in pts], **kw)


def _final_marks(ax: Any, final: dict[str, Any] | None, test_key: str, base_key: str) -> None:
    """The test result (a star at the step of the model tested: the restored best epoch's,
    else the last) and the popularity baseline (dashed)."""
    if final is None:
        return
    test = final.get(test_key)
    if isinstance(test, int | float):
        at = final.get("tested_step")
        x = float(at) if isinstance(at, int | float) else _step(final)
        ax.plot([x], [test], "*", ms=12, color=TEST, label="test")
    base = final.get(base_key)
    if isinstance(base, int | float):
        ax.axhline(base, ls="--", lw=1, color=BASE, label="popularity baseline")


def _finish(ax: Any, ylabel: str, title: str) -> None:
    ax.set_xlabel("training step")
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3)
    handles, labels = ax.get_legend_handles_labels()
    if handles:  # a label drawn twice (two metrics' test marks) listed once
        unique = dict(zip(labels, handles, strict=True))
        ax.legend(list(unique.values()), list(unique), loc="best", fontsize=8)


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
    fig = metrics_figure(rows, title=run_title(rows, Path(path).name))
    target = Path(out) if out is not None else Path(path).with_suffix(".png")
    fig.savefig(target, dpi=110)
    plt.close(fig)
    return target


def run_title(rows: list[dict[str, Any]], name: str) -> str:
    """What ran, on what, and the file: ``DLRM on movielens data (run.jsonl)``."""
    finals = [r for r in rows if r.get("kind") == "final"]
    config = (finals[-1].get("config") if finals else None) or {}
    if any(k in r for r in rows for k in ("val_auc", "test_auc")):
        data = config.get("data")
        return f"DLRM on {data} data ({name})" if data else f"DLRM ({name})"
    if any("val_ndcg@10" in r for r in rows):
        model = str(config.get("model", "next-item")).upper().replace("SASREC", "SASRec")
        data = config.get("data")
        return f"{model} on {data} data ({name})" if data else f"{model} ({name})"
    if any(k in r for r in rows for k in ("val_loss", "val_ppl")):
        tokens = config.get("tokenizer")
        return f"GPT language model, {tokens} tokens ({name})" if tokens else f"GPT ({name})"
    return name


def metrics_figure(rows: list[dict[str, Any]], title: str = "") -> Any:
    """The matplotlib ``Figure`` of a run's metric rows (needs matplotlib)."""
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter, LogLocator

    finals = [r for r in rows if r.get("kind") == "final"]
    final = finals[-1] if finals else None
    evals = ("eval", "epoch")
    train = series(rows, ("step",), "loss")
    click = any(k in r for r in rows for k in ("val_auc", "val_logloss", "test_auc"))
    lm = not click and any(k in r for r in rows for k in ("val_loss", "val_ppl"))
    ranking = not click and not lm and any("val_ndcg@10" in r for r in rows)

    if click:
        fig, (ax_loss, ax_auc) = plt.subplots(1, 2, figsize=(11, 4.2))
        _line(ax_loss, train, lw=0.9, color=TRAIN, label="training")
        _line(ax_loss, series(rows, evals, "val_logloss"), marker="o", color=VAL,
              label="validation")  # fmt: skip
        _final_marks(ax_loss, final, "test_logloss", "popularity_logloss")
        _finish(ax_loss, "log loss (nats per sample)", "log loss (lower is better)")
        # training AUC over the last --metrics-window steps, at each step line
        _line(ax_auc, series(rows, ("step",), "train_auc"), lw=0.9, color=TRAIN,
              label="training (window)")  # fmt: skip
        _line(ax_auc, series(rows, evals, "val_auc"), marker="o", color=VAL, label="validation")
        _final_marks(ax_auc, final, "test_auc", "popularity_auc")
        _finish(ax_auc, "ROC AUC (0.5 = chance, 1 = perfect)", "AUC (higher is better)")
    elif lm:
        fig, (ax_loss, ax_ppl) = plt.subplots(1, 2, figsize=(11, 4.2))
        _line(ax_loss, train, lw=0.9, color=TRAIN, label="training")
        _line(ax_loss, series(rows, evals, "val_loss"), marker="o", color=VAL,
              label="validation")  # fmt: skip
        _finish(ax_loss, "cross-entropy (nats per token)", "loss (lower is better)")
        ppl = series(rows, evals, "val_ppl") or [
            (s, math.exp(v)) for s, v in series(rows, evals, "val_loss")
        ]
        _line(ax_ppl, ppl, marker="o", color=VAL, label="validation")
        if ppl:
            ax_ppl.set_yscale("log")  # early perplexity is vocabulary-sized, late near 1
            plain = FuncFormatter(lambda v, _: f"{v:g}")  # 20, 30, 300 rather than 3x10^2
            ax_ppl.yaxis.set_major_formatter(plain)
            ax_ppl.yaxis.set_minor_formatter(plain)
            ax_ppl.yaxis.set_minor_locator(LogLocator(subs=(2.0, 3.0, 5.0)))
        _finish(ax_ppl, "perplexity (exp of nats per token)", "perplexity (lower is better)")
    elif ranking:
        fig, (ax_loss, ax_rank) = plt.subplots(1, 2, figsize=(11, 4.2))
        _line(ax_loss, train, lw=0.9, color=TRAIN, label="training")
        _finish(ax_loss, "cross-entropy (nats per predicted item)", "loss (lower is better)")
        for key, mark in (("hr@10", "o"), ("ndcg@10", "s")):
            _line(ax_rank, series(rows, evals, f"val_{key}"), marker=mark, color=VAL,
                  label=f"validation {key.upper()}")  # fmt: skip
            _final_marks(ax_rank, final, f"test_{key}", f"popularity_{key}")
        _finish(ax_rank, "HR@10 (o), NDCG@10 (s) of the full ranking", "ranking (higher is better)")
    else:
        fig, ax_loss = plt.subplots(1, 1, figsize=(6, 4.2))
        _line(ax_loss, train, lw=0.9, color=TRAIN, label="training")
        _finish(ax_loss, "training loss", "training loss")
    if title:
        fig.suptitle(title, fontsize=11)
    fig.tight_layout()
    return fig
