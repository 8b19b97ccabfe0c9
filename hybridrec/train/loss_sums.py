"""Running loss sums that read a device's losses once per report, not once per step.

A step returns its loss as a float or as a 0-d tensor. Converting a CUDA loss to a
float waits for the step's kernels (a host synchronisation per step, which stalls the
next step's launches); :class:`LossSums` adds device losses up on the device (one tiny
kernel per step) and reads the sum when the sums are read (a log line, an evaluation,
a checkpoint).
"""

from __future__ import annotations

import torch

Loss = float | torch.Tensor


class LossSums:
    """``[sum of losses, count]`` (float64, host) with device losses summed lazily."""

    def __init__(self) -> None:
        self._host = torch.zeros(2, dtype=torch.float64)
        self._device_sum: torch.Tensor | None = None  # 0-d float64 on the losses' device
        self._device_count = 0

    def add(self, loss: Loss) -> None:
        if isinstance(loss, torch.Tensor) and loss.device.type != "cpu":
            value = loss.detach().reshape(()).double()
            self._device_sum = value if self._device_sum is None else self._device_sum + value
            self._device_count += 1
        else:
            self._host += torch.tensor([float(loss), 1.0], dtype=torch.float64)

    def value(self) -> torch.Tensor:
        """The sums, float64 ``[2]`` on the host (reads the device sum once)."""
        if self._device_sum is not None:
            count = torch.tensor(float(self._device_count), dtype=torch.float64)
            self._host += torch.stack([self._device_sum.cpu(), count])
            self._device_sum, self._device_count = None, 0
        return self._host.clone()

    def set(self, sums: torch.Tensor) -> None:
        self._host = sums.to(torch.float64).clone()
        self._device_sum, self._device_count = None, 0

    def reset(self) -> None:
        self.set(torch.zeros(2, dtype=torch.float64))

    def __bool__(self) -> bool:
        return self._device_count > 0 or bool(self._host[1])
