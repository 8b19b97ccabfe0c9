"""The DLRM model scored on a split: predictions over every rank, and the metrics of a
saved run (``hybridrec evaluate``).

:func:`predictions` runs the model over this rank's batches and gathers every rank's
probabilities and labels (and a feature's value per sample, for per-slice metrics);
:func:`hybridrec.train.click_metrics.metric_values` is what the training run reports of
them; :func:`evaluate_saved` loads a checkpoint's model into a built job and reports each
split the way the training run printed its test split, e.g. ``test AUC 0.7788  logloss
0.5600  NE 0.8129  calibration 0.965``.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any, Protocol

import torch

from comm import ProcessGroup
from hybridrec.datasets.ctr import Batch
from hybridrec.dlrm.model import DLRM
from hybridrec.train.batches import agreed
from hybridrec.train.click_metrics import click_report, metric_values
from hybridrec.train.device_batches import DeviceBatches
from hybridrec.train.precision import autocast


def slice_values(batch: Batch, feature: str) -> torch.Tensor:
    """``[B]`` int64: ``feature``'s first row id per sample (-1 for a sample without one),
    the value a per-slice metric groups by."""
    bag = batch.sparse[feature]
    first = torch.full((bag.batch_size,), -1, dtype=torch.int64)
    has = bag.lengths > 0
    first[has] = bag.ids[bag.offsets()[:-1][has]].to(torch.int64).cpu()
    return first


@torch.no_grad()
def predictions(
    model: DLRM,
    batches: Iterable[Batch],
    group: ProcessGroup,
    lockstep: bool,
    feed: DeviceBatches | None = None,
    precision: str = "fp32",
    slice_by: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """``(probs [n], labels [n], slice values [n] or None)`` over every rank's ``batches``
    (collective; rank order). ``feed`` moves them to the model's device; the scores stay
    there until the end."""
    model.eval()
    device = feed.device if feed is not None else torch.device("cpu")
    probs = [torch.empty(0, device=device)]
    labels = [torch.empty(0, device=device)]
    values = [torch.empty(0, dtype=torch.int64)]
    rows = agreed(batches, group, lockstep)
    for b in feed.batches(rows) if feed is not None else rows:
        if slice_by is not None:
            values.append(slice_values(b, slice_by))
        with autocast(device, precision):
            logits = model(b)
        probs.append(torch.sigmoid(logits.float()))
        labels.append(b.labels.float())
    model.train()
    p = group.allgatherv(torch.cat(probs).cpu().contiguous())  # [n] over all ranks
    y = group.allgatherv(torch.cat(labels).cpu().contiguous())
    v = group.allgatherv(torch.cat(values).contiguous()) if slice_by is not None else None
    return p, y, v


def metrics_line(name: str, scores: dict[str, Any]) -> str:
    """``"test AUC 0.7788  logloss 0.5600  NE 0.8129  calibration 0.965"``."""

    def fmt(key: str, digits: int) -> str:
        value = scores.get(key)
        return "-" if value is None else f"{value:.{digits}f}"

    return (
        f"{name} AUC {fmt('auc', 4)}  logloss {fmt('logloss', 4)}  NE {fmt('ne', 4)}  "
        f"calibration {fmt('calibration', 3)}"
    )


class EvaluatedJob(Protocol):
    """What :func:`evaluate_saved` needs of a built DLRM job."""

    model: DLRM
    group: ProcessGroup
    lockstep: bool
    feed: DeviceBatches
    source: Any
    cfg: Any

    def say(self, text: str) -> None: ...

    def load_saved(self, folder: Path) -> None: ...


def evaluate_saved(
    job: EvaluatedJob,
    evaluation: Any,
    *,
    features: Sequence[str],
) -> dict[str, Any]:
    """Collective: load ``evaluation.model`` (a saved model folder) into ``job``, score
    each split and say it as the training run said its test split, per slice after it.
    ``features``: the sparse features a ``--slice-by`` may name. Returns ``{"kind":
    "evaluate", split: report, ...}``."""
    slice_by = evaluation.slice_by
    if slice_by is not None and slice_by not in features:
        raise ValueError(
            f"--slice-by {slice_by!r}: not a sparse feature of this model; its features are "
            f"{list(features)}"
        )
    source = job.source
    splits = evaluation.splits or (("test",) if source.has_split("test") else ("val",))
    for split in splits:
        if not source.has_split(split):
            raise ValueError(f"--split {split}: {source.describe()} has no {split} split")
    job.load_saved(evaluation.model)
    best = evaluation.meta.get("best") if evaluation.model.name == "best" else None
    which = (
        f"the best validation epoch, {best['row']['epoch']}, at step {best['row']['step']}"
        if best
        else f"step {evaluation.meta.get('step')}"
    )
    job.say(f"evaluating {evaluation.model} ({which})")
    result: dict[str, Any] = {
        "kind": "evaluate",
        "checkpoint": str(evaluation.checkpoint),
        "model": str(evaluation.model),
        "step": evaluation.meta.get("step"),
    }
    names = source.value_names(slice_by) if slice_by is not None else None
    for split in splits:
        probs, labels, values = predictions(
            job.model, source.eval_batches(split), job.group, job.lockstep, job.feed,
            job.cfg.precision, slice_by,
        )  # fmt: skip
        report = click_report(labels, probs, values)
        scores = metric_values(report)
        result.update({f"{split}_{k}": v for k, v in scores.items()})
        result[f"{split}_count"] = report["count"]
        job.say(metrics_line(split, scores))
        if values is not None:
            by_value = {}
            for value, part in report["slices"].items():
                label = (
                    names[int(value)]
                    if names is not None and 0 <= int(value) < len(names)
                    else value
                )
                by_value[label] = part
                job.say(f"  {slice_by}={label} ({part['count']} samples): "
                        + metrics_line(split, part).removeprefix(f"{split} "))  # fmt: skip
            result[f"{split}_slices"] = {"by": slice_by, "values": by_value}
    return result
