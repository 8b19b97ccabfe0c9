"""The training loop every job shares: config -> build -> ``Trainer.fit()`` -> ``close()``.

A job builds its model, optimizer and data, then hands them to a :class:`Trainer`,
which runs the steps on the workers' ``comm.ProcessGroup`` and does the rest:

* epochs and ``max_steps``; the next batch handed to the step early (``lookahead``:
  its ids ride on this batch's pull into the embedding cache); the
  "agreed" iteration for streams (``lockstep``: stop when any rank runs out);
* evaluation every ``eval_every`` steps, at the start, at the end and per epoch,
  through the job's ``evaluate()``;
* best-epoch selection and early stopping (``best_metric``, ``mode``, ``patience``):
  the model of the epoch whose row has the best ``best_metric`` is saved with
  :func:`hybridrec.save_model` (``best/`` under ``checkpoint_dir``, else a temporary
  folder removed by ``close()``) and restored when ``fit()`` ends, so the job reports
  held-out metrics of that epoch; ``patience`` epochs without improvement end the run
  (complete epochs only: one cut short by ``max_steps`` competes once it is resumed);
* checkpoints every ``checkpoint_every`` steps and at the end, and an exact resume
  (:mod:`hybridrec.checkpoint.run_checkpoint`): the data position, the RNG, the epoch's running
  loss; a finished run stays finished; a resume with other model options names them;
* the progress bar, the metrics file (``"step"``, ``"eval"``, ``"epoch"`` lines,
  :class:`hybridrec.train.step_log.StepLog`) and rates over this run's steps only.

The step itself is the job's (``step(batch, next_batch) -> local mean loss``), or
built from a model and a loss for ``(inputs, targets)`` batches::

    trainer = Trainer(TrainerConfig(epochs=2), group=group, data=batches,
                      model=model, loss=F.mse_loss, optimizer=opt)
    result = trainer.fit()
    trainer.close()

Every method is collective over ``group``: all ranks make the same calls.
"""

from __future__ import annotations

import json
import shutil
import tempfile
import time
import weakref
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NoReturn, cast

import torch
from torch import nn

from comm import LocalGroup, ProcessGroup, shared_token
from dense import DataParallel
from embedding import EmbeddingCollection
from hybridrec.checkpoint.row_dtypes import ROW_DTYPES_KEY, converted_rows
from hybridrec.checkpoint.run_checkpoint import (
    DenseOptimizer,
    RunModel,
    latest_checkpoint,
    load_checkpoint,
    load_model,
    save_checkpoint,
    save_model,
)
from hybridrec.train.batches import EpochData, agreed, epoch_data, with_next
from hybridrec.train.interrupts import Interrupted, stop_agreed
from hybridrec.train.loss_sums import Loss, LossSums
from hybridrec.train.metrics_file import MetricsLog
from hybridrec.train.step_log import StepLog, due

# (batch, next batch or None) -> this rank's mean loss: a float, or a 0-d tensor that the
# trainer reads only when it reports (on a GPU, a float per step would wait for the step).
StepFn = Callable[[Any, Any], Loss]


@dataclass(kw_only=True, slots=True)
class TrainerConfig:
    """The loop's schedule, cadences and outputs (every count is in steps)."""

    epochs: int = 1
    max_steps: int = 0  # stop after this many steps in total; 0: no limit
    samples_per_step: int = 0  # global samples per step (every rank's), for samples/s
    log_every: int = 50  # a "step" line in the metrics file every this many steps
    eval_every: int = 0  # 0: evaluate only at the points below
    eval_at_start: bool = False  # before the first step of a fresh run
    eval_at_end: bool = False  # after the last step (unless eval_every just did)
    epoch_rows: bool = True  # an "epoch" line (train loss, evaluation) after each epoch
    checkpoint_dir: str | None = None
    checkpoint_every: int = 0  # 0: only at the end
    checkpoint_keep: int = 2
    resume: bool = False  # continue from the newest checkpoint in checkpoint_dir
    # a fresh run (no resume) whose checkpoint_dir holds another run's checkpoints stops,
    # naming them, unless told to delete them first
    overwrite_checkpoints: bool = False
    metrics_out: str | None = None  # JSON lines (rank 0) and a PNG plot next to it
    progress: bool = True
    verbose: bool = True  # rank 0 prints resume and finish notes
    lookahead: bool = False  # step(batch, next_batch): the next batch is read first
    lockstep: bool = False  # one tiny allreduce per batch: stop when any rank runs out
    best_metric: str | None = None  # an "epoch" row's metric: keep (and restore) its best epoch
    mode: str = "max"  # "max": higher best_metric is better; "min": lower
    patience: int = 0  # stop after this many epochs without improvement; 0: never early

    def __post_init__(self) -> None:
        for name in ("epochs", "log_every", "checkpoint_keep"):
            if getattr(self, name) < 1:
                raise ValueError(f"TrainerConfig.{name} must be >= 1, got {getattr(self, name)}")
        for name in ("max_steps", "samples_per_step", "eval_every", "checkpoint_every"):
            if getattr(self, name) < 0:
                raise ValueError(f"TrainerConfig.{name} must be >= 0, got {getattr(self, name)}")
        if self.resume and not self.checkpoint_dir:
            raise ValueError("TrainerConfig.resume needs checkpoint_dir (where to find them)")
        if self.mode not in ("max", "min"):
            raise ValueError(f"TrainerConfig.mode must be 'max' or 'min', got {self.mode!r}")
        if self.patience < 0:
            raise ValueError(f"TrainerConfig.patience must be >= 0, got {self.patience}")
        if self.patience and not self.best_metric:
            raise ValueError(
                f"TrainerConfig.patience {self.patience} needs best_metric (what must improve)"
            )
        if self.best_metric is not None and not self.epoch_rows:
            raise ValueError("TrainerConfig.best_metric needs epoch_rows (it reads the epoch rows)")


@dataclass(slots=True)
class TrainResult:
    """What :meth:`Trainer.fit` did (equal on every rank but for the timings)."""

    step: int  # the global step count reached (resumed steps included)
    steps_run: int  # steps this run trained
    train_seconds: float  # this run's time in steps (data included, evaluations not)
    samples_per_s: float  # this run's steps only
    epochs: list[dict[str, Any]] = field(default_factory=list)  # the "epoch" rows
    evals: list[dict[str, Any]] = field(default_factory=list)  # the "eval" rows
    resumed_from: Path | None = None
    already_finished: bool = False  # resumed a run that had reached its end: nothing trained
    best: dict[str, Any] | None = None  # the restored best epoch's row (with best_metric)
    stopped_early: bool = False  # patience ran out before the schedule's end


class _NoEmbeddings:
    """Stands for "no embedding collection" in a checkpoint of a plain torch model."""

    local = hybrid = sharded = store = None


def plain_step(
    model: nn.Module,
    loss: Callable[[Any, Any], torch.Tensor],
    optimizer: DenseOptimizer,
    prefetch: Callable[[Any], None] | None = None,
    forward_context: Callable[[], AbstractContextManager[Any]] = nullcontext,
) -> StepFn:
    """A step for ``(inputs, targets)`` batches: ``loss(model(inputs), targets)``,
    backward (waiting for every ``DataParallel`` inside ``model``), optimizer step.
    ``prefetch(next_batch)`` runs before the forward when a next batch is given (a
    cache sends it with this batch's pull). The forward and the loss run inside
    ``forward_context()`` (e.g. bf16 autocast, :func:`hybridrec.train.precision.autocast`).
    Returns the loss as a 0-d tensor (the trainer reads it when it reports)."""
    parallel = [m for m in model.modules() if isinstance(m, DataParallel)]

    def step(batch: Any, next_batch: Any) -> Loss:
        inputs, targets = batch
        if prefetch is not None and next_batch is not None:
            prefetch(next_batch)
        with forward_context():
            value = loss(model(inputs), targets)
        optimizer.zero_grad(set_to_none=True)
        value.backward()  # DataParallel buckets are allreduced meanwhile
        for dp in parallel:
            dp.finish()
        optimizer.step()
        return value.detach()

    return step


def check_checkpoint_dir(root: str | Path | None, *, resume: bool, overwrite: bool) -> list[str]:
    """What of another run a fresh run's checkpoint folder ``root`` holds (its ``step-*``
    checkpoints, complete or being written, the ``latest`` pointer and the ``best``
    model, by name); ValueError naming them and the ways on unless ``overwrite`` (then
    the caller deletes them). Nothing to check with ``resume`` or without a folder.
    Jobs call it before they start, the :class:`Trainer` again before its first step."""
    if root is None or resume or not Path(root).is_dir():
        return []
    folder = Path(root)
    names = sorted(p.name for p in folder.glob("step-*"))
    names += [n for n in ("latest", "best") if (folder / n).exists()]
    if names and not overwrite:
        raise ValueError(
            f"--checkpoint-dir {str(root)!r} holds checkpoints of another run "
            f"({', '.join(names)}): continue that run with --resume, give this run "
            "another --checkpoint-dir, or delete them with --overwrite-checkpoints"
        )
    return names


def _change(name: str, saved: Any, now: Any) -> str:
    """``"dim: 16 in the checkpoint, 8 now"``; for dicts only the keys that differ."""
    if isinstance(saved, dict) and isinstance(now, dict):
        keys = [k for k in {**saved, **now} if saved.get(k) != now.get(k)]
        saved = {k: saved.get(k) for k in keys[:4]}
        now = {k: now.get(k) for k in keys[:4]}
        more = f" (and {len(keys) - 4} more)" if len(keys) > 4 else ""
        return f"{name}: {saved!r} in the checkpoint, {now!r} now{more}"
    return f"{name}: {saved!r} in the checkpoint, {now!r} now"


class Trainer:
    """Runs the steps of one job on the workers ``group`` (see the module docstring).

    ``data``: :class:`hybridrec.train.batches.EpochData`, a list of batches or a function
    ``epoch -> batches``. Either ``step`` or ``model`` and ``loss``. ``dense`` is the
    module whose weights a checkpoint holds (default ``model``; a ``DataParallel``
    wrapper as it is); ``embeddings`` the model's embedding collection, if any.
    ``evaluate() -> {metric: value}`` (collective; None: nothing to report).
    ``extras() -> {counter: value}`` adds to every "step" line (rank 0);
    ``collective_extras()`` too, called on every rank (e.g. a windowed metric's gather).
    ``on_row(row)`` sees every "eval" and "epoch" row (to print them).
    ``run_config`` goes into each checkpoint; a resume whose ``run_config`` differs
    from the checkpoint's in one of ``shape_options`` stops with their names; one whose
    tables' row types (its ``"row_dtypes"``, :mod:`hybridrec.checkpoint.row_dtypes`)
    differ goes on, saying which rows convert as they load.
    """

    def __init__(
        self,
        config: TrainerConfig,
        *,
        optimizer: DenseOptimizer,
        data: EpochData | Sequence[Any] | Callable[[int], Any],
        group: ProcessGroup | None = None,
        step: StepFn | None = None,
        model: nn.Module | None = None,
        loss: Callable[[Any, Any], torch.Tensor] | None = None,
        dense: nn.Module | None = None,
        embeddings: EmbeddingCollection | None = None,
        evaluate: Callable[[], dict[str, Any] | None] | None = None,
        extras: Callable[[], dict[str, float]] | None = None,
        collective_extras: Callable[[], dict[str, float]] | None = None,
        on_row: Callable[[dict[str, Any]], None] | None = None,
        run_config: dict[str, Any] | None = None,
        shape_options: Sequence[str] = (),
    ) -> None:
        self.config = config
        self.group = group if group is not None else LocalGroup()
        self.optimizer = optimizer
        self.data = epoch_data(data)
        if step is None:
            if model is None or loss is None:
                raise ValueError("Trainer: give step=, or model= and loss= (for a default step)")
            step = plain_step(model, loss, optimizer)
        self.step_fn = step
        if dense is None:
            if model is None:
                raise ValueError("Trainer: give dense= (the module a checkpoint holds) or model=")
            dense = model  # a DataParallel wrapper included: the checkpoint keeps its codec state
        self.dense = dense
        self.embeddings = embeddings
        self.evaluate = evaluate
        self.extras = extras
        self.collective_extras = collective_extras
        self.on_row = on_row
        self.run_config = dict(run_config or {})
        self.shape_options = list(shape_options)
        self.log: MetricsLog | None = None
        self.train_seconds = 0.0
        # Per rank: [sum of local mean losses, steps] over the epoch and since the last
        # evaluation (rank 0 also carries a resumed run's global sums).
        self._epoch_loss, self._interval_loss = LossSums(), LossSums()
        self.evals: list[dict[str, Any]] = []
        self.epochs: list[dict[str, Any]] = []
        # Best-epoch tracking: the best row so far, epochs since it, whether patience ran
        # out; carried by checkpoints (meta "best") so a resume keeps them.
        self.best: dict[str, Any] | None = None
        self.stale_epochs = 0
        self.stopped_early = False
        self._best_dir: Path | None = None  # where the best model is saved
        # A temporary folder of ours (no checkpoint_dir), removed by close() or, for a
        # trainer never closed (an exception, a caller that forgets), when it is collected
        # or the interpreter exits.
        self._best_tmp: weakref.finalize | None = None

    # ---------------------------------------------------------------- helpers

    def say(self, text: str) -> None:
        if self.config.verbose and self.group.rank == 0:
            print(text, flush=True)

    @property
    def total_steps(self) -> int | None:
        """The step count at which the run ends (None: a stream without max_steps)."""
        cfg, spe = self.config, self.data.steps_per_epoch
        total = spe * cfg.epochs if spe is not None else None
        if cfg.max_steps:
            total = min(total, cfg.max_steps) if total is not None else cfg.max_steps
        return total

    def _global(self, sums: LossSums) -> torch.Tensor:
        return self.group.allreduce(sums.value(), op="sum")  # [sum over ranks, steps * size]

    def _mean_loss(self, sums: LossSums) -> float | None:
        total = self._global(sums)
        return float(total[0] / total[1]) if float(total[1]) else None

    def _row(self, row: dict[str, Any]) -> None:
        assert self.log is not None
        self.log.write(row)
        if self.on_row is not None:
            self.on_row(row)

    def _eval(self, step: int) -> None:
        metrics = self.evaluate() if self.evaluate is not None else None
        loss = self._mean_loss(self._interval_loss)
        self._interval_loss.reset()
        if metrics is None:
            return
        row = {"kind": "eval", "step": step, "train_loss": loss, **metrics}
        self.evals.append(row)
        self._row(row)

    def _end_epoch(self, epoch: int, step: int, steps_in_epoch: int, complete: bool) -> None:
        """The epoch's row; a run stopped inside the epoch keeps its running loss (the
        final checkpoint carries it to the resumed run, whose row spans the epoch)."""
        loss = self._mean_loss(self._epoch_loss)
        if complete:
            self._epoch_loss.reset()
        if not self.config.epoch_rows:
            return
        metrics = (self.evaluate() if self.evaluate is not None else None) or {}
        row = {"kind": "epoch", "step": step, "epoch": epoch + 1, "steps": step,
               "steps_in_epoch": steps_in_epoch, "train_loss": loss, **metrics}  # fmt: skip
        self.epochs.append(row)
        self._row(row)
        self._track_best(row, complete)

    # ---------------------------------------------------------------- best epoch

    def _improves(self, value: float) -> bool:
        if self.best is None:
            return True
        best = float(self.best[cast(str, self.config.best_metric)])
        return value > best if self.config.mode == "max" else value < best

    def _track_best(self, row: dict[str, Any], complete: bool) -> None:
        """Collective: save the model if ``row`` is the best so far, else count an epoch
        without improvement. Only complete epochs compete: an epoch cut short by
        ``max_steps`` is judged by the row of the resumed run that completes it, so an
        interrupted and resumed run chooses the epoch an uninterrupted one does."""
        name = self.config.best_metric
        if name is None or not complete:
            return
        if name not in row:
            raise ValueError(
                f"Trainer: best_metric {name!r} is not in the epoch row (it has "
                f"{sorted(row)}); evaluate() must report it"
            )
        if self._improves(float(row[name])):
            self.best, self.stale_epochs = dict(row), 0
            save_model(self.best_dir(), self._run_model(), group=self.group)
        else:
            self.stale_epochs += 1
        if self.config.patience and self.stale_epochs >= self.config.patience:
            self.stopped_early = True

    def best_dir(self) -> Path:
        """Collective (on first use without a checkpoint_dir): the best model's folder."""
        if self._best_dir is None:
            if self.config.checkpoint_dir:
                self._best_dir = Path(self.config.checkpoint_dir) / "best"
            else:  # rank 0's random name: every rank sees the folder (one machine)
                token = shared_token(self.group)
                folder = Path(tempfile.gettempdir()) / f"hybridrec-best-{token:012x}"
                if self.group.rank == 0:
                    self._best_tmp = weakref.finalize(self, shutil.rmtree, folder, True)
                self._best_dir = folder / "model"
        return self._best_dir

    def _run_model(self) -> nn.Module:
        return RunModel(self.dense, self._embeddings())

    def load_saved_model(self, folder: str | Path) -> None:
        """Collective: the model saved in ``folder`` (a checkpoint's ``model/`` or a run's
        ``best/``) into this trainer's dense part and tables, at any worker count; the
        optimizer is left as it is (evaluation, prediction and export need none)."""
        load_model(folder, self._run_model(), group=self.group)

    def _restore_best(self, step: int) -> None:
        """Collective: load the best epoch's model unless it is the one trained last."""
        if self.best is None or int(self.best["step"]) == step:
            return
        load_model(self.best_dir(), self._run_model(), group=self.group)
        name = cast(str, self.config.best_metric)
        self.say(
            f"restored the model of epoch {self.best['epoch']} (step {self.best['step']}): "
            f"the best {name}, {float(self.best[name]):.4f}"
        )

    def _embeddings(self) -> EmbeddingCollection:
        return self.embeddings if self.embeddings is not None else cast(Any, _NoEmbeddings())

    def save(self, step: int, epoch: int, in_epoch: int, position: torch.Tensor | None) -> Path:
        """Collective: a checkpoint at ``step`` that resumes at step ``in_epoch`` of ``epoch``."""
        cfg = self.config
        assert cfg.checkpoint_dir is not None
        sums = {"epoch": self._global(self._epoch_loss).tolist(),
                "interval": self._global(self._interval_loss).tolist()}  # fmt: skip
        meta = {"epoch": epoch, "step_in_epoch": in_epoch, "loss_sums": sums,
                "config": self.run_config, "best": self._best_meta()}  # fmt: skip
        return save_checkpoint(
            cfg.checkpoint_dir, step, group=self.group, dense=self.dense,
            optimizer=self.optimizer, embeddings=self._embeddings(), meta=meta,
            rank_state=position, keep=cfg.checkpoint_keep,
        )  # fmt: skip

    def _best_meta(self) -> dict[str, Any] | None:
        if self.config.best_metric is None:
            return None
        return {"row": self.best, "stale_epochs": self.stale_epochs,
                "stopped_early": self.stopped_early}  # fmt: skip

    def check_resume_options(self, checkpoint: Path) -> None:
        """ValueError naming every shape option that differs from ``checkpoint``'s."""
        meta = json.loads((checkpoint / "meta.json").read_text(encoding="utf-8"))
        saved = meta.get("config") or {}
        changed = [
            _change(k, saved[k], self.run_config[k])
            for k in self.shape_options
            if k in saved and k in self.run_config and saved[k] != self.run_config[k]
        ]
        if changed:
            raise ValueError(
                f"cannot resume from {checkpoint}: the model options differ: "
                + "; ".join(changed)
                + ". Resume with the checkpoint's options, or use a new --checkpoint-dir"
            )

    def _resume(self) -> tuple[Path | None, int, int, int, torch.Tensor | None]:
        """Collective: load the newest checkpoint if asked; ``(path, epoch, step in epoch,
        step, this rank's data position)``."""
        cfg = self.config
        self._claim_checkpoint_dir()
        path = latest_checkpoint(cfg.checkpoint_dir) if cfg.checkpoint_dir and cfg.resume else None
        if path is None:
            if cfg.resume:
                self.say(f"no checkpoint in {cfg.checkpoint_dir}: starting from scratch")
            return None, 0, 0, 0, None
        self.check_resume_options(path)
        saved_meta = json.loads((path / "meta.json").read_text(encoding="utf-8"))
        dtypes = self.run_config.get(ROW_DTYPES_KEY)
        converted = None if dtypes is None else converted_rows(saved_meta.get("config"), dtypes)
        if converted is not None:
            self.say(f"resuming {path}: {converted}")
        saved = int(saved_meta["world_size"])
        if saved != self.group.size:
            self.say(
                f"resuming a checkpoint of {saved} worker(s) on {self.group.size}: the model "
                "and optimizer reshard; per-rank random streams and data positions restart "
                "from the global step"
            )
        meta, position = load_checkpoint(
            path, group=self.group, dense=self.dense, optimizer=self.optimizer,
            embeddings=self._embeddings(), resize=saved != self.group.size,
        )  # fmt: skip
        step = int(meta["step"])
        sums = meta.get("loss_sums")
        if sums is not None and self.group.rank == 0:  # the global sums, counted once
            self._epoch_loss.set(torch.tensor(sums["epoch"], dtype=torch.float64))
            self._interval_loss.set(torch.tensor(sums["interval"], dtype=torch.float64))
        epoch, in_epoch = int(meta.get("epoch", 0)), int(meta.get("step_in_epoch", step))
        best = meta.get("best")
        if best and self.config.best_metric is not None:
            self.best, self.stale_epochs = best["row"], int(best["stale_epochs"])
            self.stopped_early = bool(best["stopped_early"])
        return path, epoch, in_epoch, step, position

    def _claim_checkpoint_dir(self) -> None:
        """Collective, a fresh run: its checkpoint folder must hold no other run's
        checkpoints (they would mix with this run's, and ``latest`` would name whichever
        wrote last); with ``overwrite_checkpoints`` rank 0 deletes them first. Every rank
        reads the folder (checkpoints live where all ranks see them), so all stop alike."""
        cfg = self.config
        found = check_checkpoint_dir(
            cfg.checkpoint_dir, resume=cfg.resume, overwrite=cfg.overwrite_checkpoints
        )
        if found:
            assert cfg.checkpoint_dir is not None  # found nothing without a folder
            root = Path(cfg.checkpoint_dir)
            if self.group.rank == 0:
                for name in found:
                    target = root / name
                    if target.is_dir():
                        shutil.rmtree(target)
                    else:
                        target.unlink()
                self.say(f"deleted the checkpoints of another run in {root}: {', '.join(found)}")
            self.group.barrier()

    # ---------------------------------------------------------------- the loop

    def fit(self) -> TrainResult:
        """Collective: train to the end of the schedule (or resume and finish it)."""
        cfg, group = self.config, self.group
        resumed_from, epoch, skip, step, position = self._resume()
        total = self.total_steps
        self.log = MetricsLog(
            cfg.metrics_out if group.rank == 0 else None, append=resumed_from is not None
        )
        reached = epoch >= cfg.epochs or (total is not None and step >= total) or self.stopped_early
        finished = resumed_from is not None and reached  # a fresh run with no data just ends
        if resumed_from is not None and not finished:
            self.say(f"resumed from {resumed_from} at step {step} (epoch {epoch + 1})")
        if finished:
            self.say(
                f"the run in {resumed_from} already finished at step {step} "
                f"(epochs {cfg.epochs}, max_steps {cfg.max_steps or 'none'}): nothing to train; "
                "raise max_steps or epochs to train on"
            )
            self._restore_best(step)
            if cfg.eval_at_end:
                self._eval(step)
            return self._result(step, 0, resumed_from, already_finished=True)

        steps = StepLog(
            group=group, log=self.log, log_every=cfg.log_every,
            samples_per_step=cfg.samples_per_step, total_steps=total, start_step=step,
            progress=cfg.progress, extras=self.extras, collective_extras=self.collective_extras,
        )  # fmt: skip
        if cfg.eval_at_start and step == 0:
            self._eval(0)
        start_step, stopped = step, False
        end: tuple[int, int, torch.Tensor | None] = (cfg.epochs, 0, None)
        for e in range(epoch, cfg.epochs):
            in_epoch = skip if e == epoch else 0
            batches = self.data.train_batches(e, in_epoch, position if e == epoch else None)
            pos: torch.Tensor | None = None
            mark = time.perf_counter()
            for (batch, pos), nxt in with_next(agreed(batches, group, cfg.lockstep), cfg.lookahead):
                # No batch is announced before a checkpoint: what the step pulls ahead for
                # it would be in the saved cache, and a resumed run pulls it again.
                last = bool(cfg.max_steps) and step + 1 >= cfg.max_steps
                saving = bool(cfg.checkpoint_dir) and (due(step + 1, cfg.checkpoint_every) or last)
                loss = self.step_fn(batch, None if nxt is None or saving else nxt[0])
                self.train_seconds += time.perf_counter() - mark
                step, in_epoch = step + 1, in_epoch + 1
                self._epoch_loss.add(loss)
                self._interval_loss.add(loss)
                steps.step(step, loss)
                if due(step, cfg.eval_every) or (cfg.eval_at_end and step == total):
                    self._eval(step)
                saved = bool(cfg.checkpoint_dir) and due(step, cfg.checkpoint_every)
                if saved:
                    self.save(step, e, in_epoch, pos)
                if stop_agreed(group):  # a rank got Ctrl-C or SIGTERM (hybridrec.train.interrupts)
                    self._interrupted(steps, step, e, in_epoch, pos, saved)
                if cfg.max_steps and step >= cfg.max_steps:
                    stopped = True
                    break
                mark = time.perf_counter()
            steps.flush(step)
            spe = self.data.steps_per_epoch
            complete = not stopped or (spe is not None and in_epoch >= spe)
            self._end_epoch(e, step, in_epoch, complete)
            if self.stopped_early:
                self.say(
                    f"early stop after epoch {e + 1}: {cfg.best_metric} has not improved for "
                    f"{self.stale_epochs} epoch(s) (patience {cfg.patience})"
                )
                stopped = True
            if stopped:
                end = (e + 1, 0, None) if complete else (e, in_epoch, pos)
                break
        steps.close()
        if cfg.eval_at_end and (not self.evals or self.evals[-1]["step"] != step):
            self._eval(step)  # stopped by max_steps before the schedule's last step
        if cfg.checkpoint_dir and step > start_step:
            self.save(step, *end)  # the last model: a resume with more epochs goes on from it
        self._restore_best(step)
        return self._result(step, step - start_step, resumed_from)

    def _interrupted(
        self,
        steps: StepLog,
        step: int,
        epoch: int,
        in_epoch: int,
        position: torch.Tensor | None,
        saved: bool,
    ) -> NoReturn:
        """Collective, after the step a stop request was agreed at: a checkpoint there
        (with a checkpoint folder), one line, :class:`hybridrec.train.interrupts.Interrupted`."""
        steps.flush(step)
        steps.close()
        if self.config.checkpoint_dir:
            if not saved:
                self.save(step, epoch, in_epoch, position)
            self.say(f"interrupted at step {step}; resume with --resume")
        else:
            self.say(f"interrupted at step {step} (no --checkpoint-dir: nothing was saved)")
        self.close()  # the metrics file and its plot
        raise Interrupted()

    def _result(
        self, step: int, run: int, resumed_from: Path | None, already_finished: bool = False
    ) -> TrainResult:
        rate = run * self.config.samples_per_step / max(self.train_seconds, 1e-9) if run else 0.0
        return TrainResult(
            step=step, steps_run=run, train_seconds=self.train_seconds, samples_per_s=rate,
            epochs=self.epochs, evals=self.evals, resumed_from=resumed_from,
            already_finished=already_finished, best=self.best, stopped_early=self.stopped_early,
        )  # fmt: skip

    def write(self, row: dict[str, Any]) -> None:
        """One more line in the metrics file (e.g. the job's final summary)."""
        if self.log is None:
            self.log = MetricsLog(self.config.metrics_out if self.group.rank == 0 else None)
        self.log.write(row)

    def close(self) -> Path | None:
        """Close the metrics file and plot it; returns the PNG (None without one). Removes
        the temporary folder of the best model (not ``best/`` under ``checkpoint_dir``)."""
        if self._best_tmp is not None:
            self._best_tmp()  # runs once: the folder is gone and the finalizer spent
        if self.log is None:
            return None
        png, self.log = self.log.close(), None
        if png is not None:
            self.say(f"metrics: {self.config.metrics_out}, plot: {png}")
        return png
