"""Training metrics over a window of recent steps: the last ``steps`` steps' predictions
of every rank, scored at each step line of the metrics file.

A step adds its probabilities and labels (device tensors, kept as they are: no host
synchronisation per step); :meth:`ClickWindow.report` (collective, at a step line) moves
them to the host once, gathers every rank's and reports AUC, normalized entropy and
calibration over them (:mod:`hybridrec.train.click_metrics`), as ``train_auc``,
``train_ne``, ``train_calibration`` and ``window_samples``. The loss of a step line is
the mean since the line before; these cover the last ``steps`` steps, so they move less
from line to line and read as a held-out metric does.
"""

from __future__ import annotations

from collections import deque

import torch

from comm import ProcessGroup
from hybridrec.train.click_metrics import click_report, metric_values


class ClickWindow:
    """The last ``steps`` steps' ``(probabilities [b], labels [b])`` of this rank."""

    def __init__(self, steps: int) -> None:
        if steps < 1:
            raise ValueError(f"a metrics window needs >= 1 step, got {steps}")
        self.steps = steps
        self._kept: deque[tuple[torch.Tensor, torch.Tensor]] = deque(maxlen=steps)

    def add(self, logits: torch.Tensor, labels: torch.Tensor) -> None:
        """One step's logits ``[b]`` and labels ``[b]`` (detached here)."""
        self._kept.append((torch.sigmoid(logits.detach().float()), labels.detach().float()))

    def report(self, group: ProcessGroup) -> dict[str, float]:
        """Collective: the window's metrics over every rank's samples (NaN where one has
        no value: AUC and NE of a one-class window)."""
        kept = list(self._kept)
        probs = torch.cat([p.cpu() for p, _ in kept] or [torch.empty(0)])
        labels = torch.cat([y.cpu() for _, y in kept] or [torch.empty(0)])
        both = group.allgatherv(torch.stack([probs, labels], dim=1).contiguous())  # [n, 2]
        report = click_report(both[:, 1], both[:, 0])
        values = metric_values(report)
        out = {f"train_{k}": values[k] for k in ("auc", "ne", "calibration")}
        return {**out, "window_samples": float(report["count"])}
