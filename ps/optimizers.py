"""Server-side optimizers: small configs plus the update they apply to touched rows.

A store keeps, per table, the weights ``[num_rows, dim]`` and an optimizer state
``[num_rows, state_dim(dim)]`` (float32). A push gathers the touched rows and
their state, calls :meth:`Optimizer.apply` on those copies, and writes them back,
so an optimizer never sees the whole table and never loops over ids.

Adding an optimizer (Adam, FTRL, full Adagrad) is one more subclass: say how many
state columns a row needs and how a row and its state change given its gradient.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch


class Optimizer(ABC):
    """Base of every optimizer config; subclasses are frozen dataclasses."""

    __slots__ = ()

    @property
    @abstractmethod
    def name(self) -> str:
        """Short stable name (stores may record it next to the table)."""

    @abstractmethod
    def state_dim(self, dim: int) -> int:
        """Number of float32 state columns a row of width ``dim`` needs (0: stateless)."""

    @abstractmethod
    def apply(self, rows: torch.Tensor, state: torch.Tensor, grads: torch.Tensor) -> None:
        """Update ``rows`` and ``state`` in place.

        ``rows`` ``[U, D]``, ``state`` ``[U, state_dim(D)]`` and ``grads`` ``[U, D]``
        (float32) hold one entry per unique touched row; duplicate ids were summed
        by the store before this call.
        """

    def initial_state(self, dim: int) -> torch.Tensor:
        """The state ``[state_dim(dim)]`` float32 every row starts with (zeros by default)."""
        return torch.zeros(self.state_dim(dim), dtype=torch.float32)


def _check_positive(cls: str, field: str, value: float) -> None:
    if not isinstance(value, int | float) or isinstance(value, bool):
        raise TypeError(f"{cls}: {field} must be a number, got {type(value).__name__}")
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"{cls}: {field} must be a finite number > 0, got {value}")


@dataclass(kw_only=True, slots=True, frozen=True)
class SGD(Optimizer):
    """Plain SGD: ``w -= lr * g``. No state."""

    lr: float

    def __post_init__(self) -> None:
        _check_positive("SGD", "lr", self.lr)

    @property
    def name(self) -> str:
        return "sgd"

    def state_dim(self, dim: int) -> int:
        return 0

    def apply(self, rows: torch.Tensor, state: torch.Tensor, grads: torch.Tensor) -> None:
        rows.add_(grads, alpha=-self.lr)


@dataclass(kw_only=True, slots=True, frozen=True)
class RowWiseAdagrad(Optimizer):
    """Row-wise Adagrad (FBGEMM's ``EXACT_ROWWISE_ADAGRAD``): one accumulator per row.

    For a touched row with gradient ``g`` ``[D]``::

        s += mean(g ** 2)                    # scalar per row
        w -= lr * g / (sqrt(s) + eps)

    ``initial_accumulator`` is the value ``s`` starts from.
    """

    lr: float
    eps: float = 1e-8
    initial_accumulator: float = 0.0

    def __post_init__(self) -> None:
        _check_positive("RowWiseAdagrad", "lr", self.lr)
        _check_positive("RowWiseAdagrad", "eps", self.eps)
        acc = self.initial_accumulator
        if not isinstance(acc, int | float) or not (math.isfinite(acc) and acc >= 0):
            raise ValueError(
                f"RowWiseAdagrad: initial_accumulator must be a finite number >= 0, got {acc!r}"
            )

    @property
    def name(self) -> str:
        return "rowwise_adagrad"

    def state_dim(self, dim: int) -> int:
        return 1

    def apply(self, rows: torch.Tensor, state: torch.Tensor, grads: torch.Tensor) -> None:
        acc = state[:, 0]  # [U]
        acc.add_(grads.square().mean(dim=1))
        step = grads / (acc.sqrt() + self.eps).unsqueeze(1)  # [U, D]
        rows.add_(step, alpha=-self.lr)

    def initial_state(self, dim: int) -> torch.Tensor:
        return torch.full((1,), float(self.initial_accumulator), dtype=torch.float32)
