"""Table specs and deterministic row initialisation.

A table is ``num_rows`` rows of ``dim`` float32 values plus the optimizer that
the store applies to pushed gradients.

Initial values are a pure function of ``(seed, row id, column)`` (a counter-based
hash, not a sequential RNG stream), so every process, every shard of a sharded
store and every lazily created row of a dynamic table computes the same value for
the same row without talking to anyone.
"""

from __future__ import annotations

import math
import zlib
from dataclasses import dataclass, field

import numpy as np
import torch

from ps.optimizers import Optimizer

_U64 = np.uint64
_GOLDEN = _U64(0x9E3779B97F4A7C15)


def _splitmix64(x: np.ndarray) -> np.ndarray:
    """The splitmix64 finaliser on a uint64 array (wrapping arithmetic)."""
    x = x + _GOLDEN
    x = (x ^ (x >> _U64(30))) * _U64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> _U64(27))) * _U64(0x94D049BB133111EB)
    return x ^ (x >> _U64(31))


@dataclass(kw_only=True, slots=True, frozen=True)
class UniformInit:
    """Rows drawn uniformly from ``[low, high)``, reproducibly from ``seed``."""

    low: float
    high: float
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("low", "high"):
            v = getattr(self, name)
            if not isinstance(v, int | float) or not math.isfinite(v):
                raise ValueError(f"UniformInit: {name} must be a finite number, got {v!r}")
        if not self.low < self.high:
            raise ValueError(f"UniformInit: need low < high, got low={self.low} high={self.high}")
        if not isinstance(self.seed, int) or not 0 <= self.seed < 2**63:
            raise ValueError(f"UniformInit: seed must be an int in [0, 2**63), got {self.seed!r}")

    def rows(self, ids: torch.Tensor, dim: int) -> torch.Tensor:
        """Initial values of rows ``ids`` (int64 ``[N]``): float32 ``[N, dim]``."""
        ids_np = ids.detach().cpu().numpy().astype(np.int64).view(np.uint64)  # [N]
        cols = np.arange(dim, dtype=np.uint64)  # [D]
        with np.errstate(over="ignore"):
            key = _splitmix64(np.full(1, self.seed, dtype=np.uint64))  # [1]
            row_key = _splitmix64(ids_np ^ key)  # [N]
            h = _splitmix64(row_key[:, None] + cols[None, :] * _GOLDEN)  # [N, D]
        unit = (h >> _U64(40)).astype(np.float64) * (1.0 / (1 << 24))  # [N, D] in [0, 1)
        values = self.low + (self.high - self.low) * unit
        return torch.from_numpy(values.astype(np.float32))


def default_init(name: str, num_rows: int) -> UniformInit:
    """TorchRec's default: ``U(-sqrt(1/num_rows), sqrt(1/num_rows))``, seeded by the name."""
    bound = math.sqrt(1.0 / num_rows)
    return UniformInit(low=-bound, high=bound, seed=zlib.crc32(name.encode("utf-8")))


@dataclass(kw_only=True, slots=True, frozen=True)
class TableSpec:
    """What a store needs to create a table.

    ``init`` None means :func:`default_init` (resolved in ``__post_init__``, so a
    spec's ``init`` is always a :class:`UniformInit` afterwards).
    """

    name: str
    num_rows: int
    dim: int
    optimizer: Optimizer
    init: UniformInit | None = field(default=None)

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"TableSpec: name must be a non-empty string, got {self.name!r}")
        for arg in ("num_rows", "dim"):
            v = getattr(self, arg)
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                raise ValueError(f"table {self.name!r}: {arg} must be an int > 0, got {v!r}")
        if not isinstance(self.optimizer, Optimizer):
            raise TypeError(
                f"table {self.name!r}: optimizer must be a ps optimizer config such as "
                f"SGD(lr=...) or RowWiseAdagrad(lr=...), got {type(self.optimizer).__name__}"
            )
        if self.init is None:
            object.__setattr__(self, "init", default_init(self.name, self.num_rows))
        elif not isinstance(self.init, UniformInit):
            raise TypeError(
                f"table {self.name!r}: init must be a UniformInit or None, "
                f"got {type(self.init).__name__}"
            )

    @property
    def state_dim(self) -> int:
        return self.optimizer.state_dim(self.dim)

    def initial_rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Initial values of rows ``ids`` (int64 ``[N]``): float32 ``[N, dim]``."""
        assert self.init is not None  # resolved in __post_init__
        return self.init.rows(ids, self.dim)
