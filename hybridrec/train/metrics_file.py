"""The metrics file of a run: JSON lines on rank 0, and a PNG plot next to it at the end.

Each line is one JSON object with a ``kind``:

* ``"step"``: every ``--log-every`` steps: ``step``, ``loss`` (mean over the steps
  since the last line and over all ranks: the global-batch loss), ``samples_per_s``
  and, when the job has them, ``cache_hit_rate``, ``ps_rows_moved`` (rows pulled +
  pushed since the start), ``staleness_max`` / ``staleness_mean`` (cached rows served);
* ``"eval"`` / ``"epoch"``: validation metrics (``val_auc``, ``val_logloss`` for
  click models; ``val_loss``, ``val_ppl`` for language models);
* ``"final"``: the run's summary.

With ``--resume`` the file is appended to, so one file holds the whole run.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from hybridrec.train.metrics_plot import plot_metrics


class MetricsLog:
    """``log.write({"kind": "step", ...})``; ``log.close()`` writes the plot. No-op if path is
    None (ranks other than 0, or no ``--metrics-out``)."""

    def __init__(self, path: str | None, *, append: bool = False) -> None:
        self.path = Path(path) if path else None
        if self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            if not append or not self.path.exists():
                self.path.write_text("", encoding="utf-8")

    def write(self, row: dict[str, Any]) -> None:
        if self.path is not None:
            with open(self.path, "a", encoding="utf-8") as f:
                f.write(json.dumps(row) + "\n")

    def close(self, plot: bool = True) -> Path | None:
        """Plot the curves into ``<path>.png``; returns it (None without a file or matplotlib)."""
        if self.path is None or not plot:
            return None
        return plot_metrics(self.path)


def cache_metrics(stats: dict[str, dict[str, Any]]) -> dict[str, float]:
    """Hit rate, rows moved and staleness served, over every table of ``cache_stats()``."""
    lookups = sum(s["lookups"] for s in stats.values())
    served: dict[int, int] = {}
    for s in stats.values():
        for k, n in s["staleness_served"].items():
            served[int(k)] = served.get(int(k), 0) + n
    count = sum(served.values())
    return {
        "cache_hit_rate": sum(s["hits"] for s in stats.values()) / max(lookups, 1),
        "ps_rows_moved": float(sum(s["rows_pulled"] + s["rows_pushed"] for s in stats.values())),
        "staleness_max": float(max(served, default=0)),
        "staleness_mean": sum(k * n for k, n in served.items()) / max(count, 1),
    }


def store_metrics(stats: dict[str, dict[str, int | float]]) -> dict[str, float]:
    """Rows moved through a store without a cache (its ``stats()``)."""
    return {
        "ps_rows_moved": float(
            sum(s.get("rows_pulled", 0) + s.get("rows_pushed", 0) for s in stats.values())
        )
    }
