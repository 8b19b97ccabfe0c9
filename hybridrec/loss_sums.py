"""Running loss sums that read a device's losses once per report, not once per step.

A step returns its loss as a float or as a 0-d tensor. Converting a CUDA loss to a
float waits for the step's kernels (a host synchronisation per step, which stalls the
next step's launches); :class:`LossSums` keeps device losses as tensors and adds them
up when the sums are read (a log line, an evaluation, a checkpoint).
"""

from __future__ import annotations

import torch

Loss = float | torch.Tensor


class LossSums:
    """``[sum of losses, count]`` (float64, host) with device losses summed lazily."""

    def __init__(self) -> None:
        self._host = torch.zeros(2, dtype=torch.float64)
        self._pending: list[torch.Tensor] = []  # 0-d device losses not yet added

    def add(self, loss: Loss) -> None:
        if isinstance(loss, torch.Tensor) and loss.device.type != "cpu":
            self._pending.append(loss.detach().reshape(()))
        else:
            self._host += torch.tensor([float(loss), 1.0], dtype=torch.float64)

    def value(self) -> torch.Tensor:
        """The sums, float64 ``[2]`` on the host (reads any device losses once)."""
        if self._pending:
            total = torch.stack(self._pending).double().sum()
            self._host += torch.stack([total.cpu(), torch.tensor(float(len(self._pending)))])
            self._pending = []
        return self._host.clone()

    def set(self, sums: torch.Tensor) -> None:
        self._host = sums.to(torch.float64).clone()
        self._pending = []

    def reset(self) -> None:
        self.set(torch.zeros(2, dtype=torch.float64))

    def __bool__(self) -> bool:
        return bool(self._pending) or bool(self._host[1])
