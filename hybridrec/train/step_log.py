"""The per-step bookkeeping of the trainer's loop: progress bar, loss lines, cadences.

:class:`hybridrec.train.loop.Trainer` calls :meth:`StepLog.step` after every step
(a hand-written loop may too); every ``log_every`` steps that writes one ``"step"`` line to
the metrics file with the global-batch loss (the mean of every rank's local mean
loss, one allreduce per line, none per step), samples/s and the job's extra
counters (cache hit rate, PS rows moved, ...), read on rank 0 only.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from comm import ProcessGroup
from hybridrec.train.loss_sums import Loss, LossSums
from hybridrec.train.metrics_file import MetricsLog
from hybridrec.train.progress_bar import Progress


def due(step: int, every: int) -> bool:
    """True every ``every`` steps (never for ``every`` 0)."""
    return every > 0 and step % every == 0


class StepLog:
    """Collective at every ``log_every``-th step: all ranks must call :meth:`step` alike."""

    def __init__(
        self,
        *,
        group: ProcessGroup,
        log: MetricsLog,
        log_every: int,
        samples_per_step: int,
        total_steps: int | None,
        start_step: int = 0,
        progress: bool = True,
        extras: Callable[[], dict[str, float]] | None = None,
        collective_extras: Callable[[], dict[str, float]] | None = None,
    ) -> None:
        """``extras``: counters read on rank 0 for each step line; ``collective_extras``:
        figures every rank computes together for it (a windowed metric's gather)."""
        self.group = group
        self.log = log
        self.log_every = log_every
        self.samples_per_step = samples_per_step  # global: every rank's samples together
        self.extras = extras
        self.collective_extras = collective_extras
        self.bar = Progress(total_steps, rank=group.rank, enabled=progress, initial=start_step)
        self._acc = LossSums()  # [sum of local mean losses, steps]
        self._since = time.perf_counter()
        self._steps_since = 0
        self.last_loss: float | None = None

    def step(self, step: int, loss: Loss) -> None:
        """Step ``step`` (1-based, global count) finished with this rank's mean loss ``loss``
        (a device tensor is read only where the progress bar shows it)."""
        self.bar.step(self.samples_per_step, loss)
        self._acc.add(loss)
        self._steps_since += 1
        if due(step, self.log_every):
            self.flush(step)

    def flush(self, step: int) -> None:
        """Write a ``"step"`` line for the steps since the last one (collective)."""
        if self._steps_since == 0:
            return
        acc = self.group.allreduce(self._acc.value(), op="sum")  # over ranks: [sum, steps*size]
        now = time.perf_counter()
        row: dict[str, float | int | str] = {
            "kind": "step",
            "step": step,
            "loss": float(acc[0] / acc[1]),
            "samples_per_s": self._steps_since
            * self.samples_per_step
            / max(now - self._since, 1e-9),
        }
        self.last_loss = float(row["loss"])
        if self.collective_extras is not None:
            shared = self.collective_extras()  # every rank, every line: it is collective
            if self.group.rank == 0:
                row.update(shared)
        if self.extras is not None and self.group.rank == 0:
            row.update(self.extras())
        self.log.write(row)
        self._acc.reset()
        self._steps_since = 0
        self._since = now

    def close(self) -> None:
        self.bar.close()
