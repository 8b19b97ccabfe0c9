"""A progress bar for training loops: samples/s, loss and ETA, on rank 0 only.

Quiet when stderr is not a terminal (CI logs, redirected runs), on ranks other
than 0 (multi-rank jobs print one bar, not N interleaved ones), when the job
says so (``--no-progress``), or when ``tqdm`` is not installed (a training machine
with only torch and numpy still trains, without a bar).
"""

from __future__ import annotations

import sys
import time
from typing import Any

import torch

try:
    from tqdm import tqdm
except ImportError:  # tqdm is the examples' extra, not a dependency of training
    tqdm = None

_SHOW_EVERY_S = 0.5  # the loss and rate on the bar are refreshed at most this often


class Progress:
    """``with Progress(total_steps, rank=r) as bar: bar.step(samples, loss)``.

    ``total_steps`` None: no ETA (a stream of unknown length); ``initial``: steps
    already done (a resumed run).
    """

    def __init__(
        self,
        total_steps: int | None,
        *,
        rank: int = 0,
        desc: str = "train",
        enabled: bool = True,
        initial: int = 0,
    ) -> None:
        on = enabled and rank == 0 and sys.stderr.isatty()
        if tqdm is None:
            self._bar: Any = _NoBar()
        else:
            self._bar = tqdm(
                total=total_steps,
                initial=initial,
                desc=desc,
                unit="step",
                disable=not on,
                dynamic_ncols=True,
            )
        self._samples = 0
        self._shown = -_SHOW_EVERY_S  # when the postfix was last written (monotonic s)

    def step(self, samples: int, loss: float | torch.Tensor, **extra: float) -> None:
        """One step of ``samples`` samples done with training loss ``loss``.

        The loss is read at most every ``_SHOW_EVERY_S`` seconds, and never when the bar
        is off: reading a device loss waits for its step (a host synchronisation)."""
        self._samples += samples
        now = time.monotonic()
        if self._bar.disable or now - self._shown < _SHOW_EVERY_S:
            self._bar.update(1)
            return
        self._shown = now
        elapsed = self._bar.format_dict.get("elapsed", 0.0) or 1e-9
        fields = {"loss": f"{loss:.4f}", "samples/s": f"{self._samples / elapsed:.0f}"}
        fields.update({k: f"{v:.4g}" for k, v in extra.items()})
        self._bar.set_postfix(fields, refresh=False)
        self._bar.update(1)

    def close(self) -> None:
        self._bar.close()

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class _NoBar:
    """The part of tqdm's bar :class:`Progress` uses, switched off (no tqdm installed)."""

    disable = True

    def update(self, n: int = 1) -> None:
        pass

    def close(self) -> None:
        pass
