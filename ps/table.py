"""Table specs and deterministic row initialisation.

A table is ``num_rows`` rows of ``dim`` float32 values (ids ``[0, num_rows)``),
or, with ``num_rows=None``, a *dynamic* table keyed by any int64 id, plus the
optimizer that the store applies to pushed gradients.

Initial values are a pure function of ``(seed, row id, column)`` (a counter-based
hash, not a sequential RNG stream), so every process, every shard of a sharded
store and every lazily created row of a dynamic table computes the same value for
the same row without talking to anyone.
"""

from __future__ import annotations

import json
import math
import zlib
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np
import torch

from ps.optimizers import Optimizer, optimizer_from_json

_U64 = np.uint64
_GOLDEN = _U64(0x9E3779B97F4A7C15)


def _splitmix64(x: np.ndarray) -> np.ndarray:
    """The splitmix64 finaliser on a uint64 array (wrapping arithmetic)."""
    x = x + _GOLDEN
    x = (x ^ (x >> _U64(30))) * _U64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> _U64(27))) * _U64(0x94D049BB133111EB)
    return x ^ (x >> _U64(31))


def _signed(c: int) -> int:
    """A uint64 constant as the int64 with the same bits (torch has no full uint64 math)."""
    return c - (1 << 64) if c >= 1 << 63 else c


def _shr(x: torch.Tensor, k: int) -> torch.Tensor:
    """Logical right shift of int64 bits (torch's ``>>`` extends the sign)."""
    return (x >> k) & ((1 << (64 - k)) - 1)


def _splitmix64_torch(x: torch.Tensor) -> torch.Tensor:
    """:func:`_splitmix64` on int64 tensors holding uint64 bits, on any device (int64
    addition and multiplication wrap like uint64's, bit for bit)."""
    x = x + _signed(0x9E3779B97F4A7C15)
    x = (x ^ _shr(x, 30)) * _signed(0xBF58476D1CE4E5B9)
    x = (x ^ _shr(x, 27)) * _signed(0x94D049BB133111EB)
    return x ^ _shr(x, 31)


@dataclass(kw_only=True, slots=True, frozen=True)
class UniformInit:
    """Rows drawn uniformly from ``[low, high)``, reproducibly from ``seed``.

    ``low == high`` gives every element that one value (``UniformInit(low=0.0,
    high=0.0)``: rows that start at zero, as additive n-gram tables do).
    """

    low: float
    high: float
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("low", "high"):
            v = getattr(self, name)
            if not isinstance(v, int | float) or not math.isfinite(v):
                raise ValueError(f"UniformInit: {name} must be a finite number, got {v!r}")
        if not self.low <= self.high:
            raise ValueError(f"UniformInit: need low <= high, got low={self.low} high={self.high}")
        if not isinstance(self.seed, int) or not 0 <= self.seed < 2**63:
            raise ValueError(f"UniformInit: seed must be an int in [0, 2**63), got {self.seed!r}")

    def rows(self, ids: torch.Tensor, dim: int) -> torch.Tensor:
        """Initial values of rows ``ids`` (int64 ``[N]``): float32 ``[N, dim]``."""
        if self.low == self.high:  # a constant: no hashing (a 1M-row table starts at once)
            return torch.full(
                (int(ids.numel()), dim), float(self.low), dtype=torch.float32, device=ids.device
            )
        if ids.device.type != "cpu":
            return self.rows_torch(ids, dim)
        ids_np = ids.detach().cpu().numpy().astype(np.int64).view(np.uint64)  # [N]
        cols = np.arange(dim, dtype=np.uint64)  # [D]
        with np.errstate(over="ignore"):
            key = _splitmix64(np.full(1, self.seed, dtype=np.uint64))  # [1]
            row_key = _splitmix64(ids_np ^ key)  # [N]
            h = _splitmix64(row_key[:, None] + cols[None, :] * _GOLDEN)  # [N, D]
        unit = (h >> _U64(40)).astype(np.float64) * (1.0 / (1 << 24))  # [N, D] in [0, 1)
        values = self.low + (self.high - self.low) * unit
        return torch.from_numpy(values.astype(np.float32))

    def rows_torch(self, ids: torch.Tensor, dim: int) -> torch.Tensor:
        """:meth:`rows` computed with torch ops on ``ids``' device, bit for bit the same
        values: a GPU initialises a table in HBM without a host pass (the numpy path
        takes ~0.8 s per 65,536 x 128 rows on one core)."""
        ids = ids.to(torch.int64)
        key = _splitmix64_torch(torch.tensor([self.seed], dtype=torch.int64, device=ids.device))
        row_key = _splitmix64_torch(ids ^ key)  # [N]
        cols = torch.arange(dim, dtype=torch.int64, device=ids.device)  # [D]
        h = _splitmix64_torch(row_key[:, None] + cols[None, :] * _signed(0x9E3779B97F4A7C15))
        unit = _shr(h, 40).to(torch.float64) * (1.0 / (1 << 24))  # [N, D] in [0, 1)
        return (self.low + (self.high - self.low) * unit).to(torch.float32)

    def to_json(self) -> dict[str, Any]:
        """JSON-ready dict ``{"type": "uniform", "low", "high", "seed"}``."""
        return {"type": "uniform", "low": self.low, "high": self.high, "seed": self.seed}

    @staticmethod
    def from_json(data: dict[str, Any]) -> UniformInit:
        if not isinstance(data, dict) or data.get("type") != "uniform":
            raise ValueError(f"init JSON: expected {{'type': 'uniform', ...}}, got {data!r}")
        return UniformInit(low=data["low"], high=data["high"], seed=data["seed"])


#: Half-width of the default init of a dynamic table (no ``num_rows`` to scale by;
#: the TorchRec rule gives the same value for a 10 000-row table).
DYNAMIC_INIT_BOUND = 0.01

NAN_POLICIES = ("raise", "skip")

#: Element types of a table's rows. Optimizer state and clocks are fp32/int64 whatever
#: the rows (row-wise state is a float or two per row; the narrow types are for rows).
ROW_DTYPES = ("fp32", "fp16", "bf16")
TORCH_ROW_DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
RowDtype = Literal["fp32", "fp16", "bf16"]


def check_row_dtype(table: str, dtype: object) -> None:
    """A ValueError naming ``table``, the value and the choices unless ``dtype`` is one
    of :data:`ROW_DTYPES`."""
    if dtype not in ROW_DTYPES:
        raise ValueError(
            f"table {table!r}: dtype must be one of {', '.join(ROW_DTYPES)}, got {dtype!r}"
        )


def default_init(name: str, num_rows: int | None) -> UniformInit:
    """TorchRec's default ``U(-sqrt(1/num_rows), sqrt(1/num_rows))``, seeded by the name.

    A dynamic table (``num_rows`` None) gets ``U(-0.01, 0.01)``.
    """
    bound = DYNAMIC_INIT_BOUND if num_rows is None else math.sqrt(1.0 / num_rows)
    return UniformInit(low=-bound, high=bound, seed=zlib.crc32(name.encode("utf-8")))


def _optional_positive_int(table: str, arg: str, v: object) -> None:
    if v is None:
        return
    if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
        raise ValueError(f"table {table!r}: {arg} must be None or an int > 0, got {v!r}")


@dataclass(kw_only=True, slots=True, frozen=True)
class TableSpec:
    """What a store needs to create a table.

    * ``num_rows``: an int > 0 for a fixed table (ids ``[0, num_rows)``, all rows
      exist from the start), or None for a **dynamic** table: any int64 id
      (negative too); a row is created by the first push that touches it, from
      ``init`` (a pull of an id that has no row returns the initial row with
      clock 0 and creates nothing).
    * ``init``: None means :func:`default_init` (resolved in ``__post_init__``, so
      a spec's ``init`` is always a :class:`UniformInit` afterwards).
    * ``capacity`` (dynamic only): at most this many rows; when a push creates
      rows past it, the least recently touched rows (pull or push) are evicted.
    * ``max_age_steps`` (dynamic only): after each push to the table, rows not
      touched (pulled or pushed) during the last ``max_age_steps`` pushes of this
      table are evicted. An evicted row is gone: its weights, optimizer state
      and clock; a later touch starts it again from ``init`` with clock 0.
    * ``nan_policy``: "raise" rejects a push whose gradients hold NaN/Inf (naming
      the row), "skip" applies the rest of the push and drops the rows whose
      summed gradient is not finite (counted in ``stats()["rows_skipped_nan"]``).
    * ``dtype``: the element type rows are stored in ("fp32", "fp16", "bf16").
      Pulls return float32 rows (a narrow row widens exactly); updates are computed
      in float32 and written back with stochastic rounding (:mod:`ps.rounding`);
      optimizer state stays float32.
    """

    name: str
    num_rows: int | None
    dim: int
    optimizer: Optimizer
    init: UniformInit | None = field(default=None)
    capacity: int | None = None
    max_age_steps: int | None = None
    nan_policy: Literal["raise", "skip"] = "raise"
    dtype: RowDtype = "fp32"

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"TableSpec: name must be a non-empty string, got {self.name!r}")
        check_row_dtype(self.name, self.dtype)
        if self.num_rows is not None:
            v = self.num_rows
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                raise ValueError(
                    f"table {self.name!r}: num_rows must be an int > 0, got {v!r} "
                    "(None makes a dynamic table)"
                )
        d = self.dim
        if not isinstance(d, int) or isinstance(d, bool) or d <= 0:
            raise ValueError(f"table {self.name!r}: dim must be an int > 0, got {d!r}")
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
        _optional_positive_int(self.name, "capacity", self.capacity)
        _optional_positive_int(self.name, "max_age_steps", self.max_age_steps)
        if self.num_rows is not None:
            for arg in ("capacity", "max_age_steps"):
                if getattr(self, arg) is not None:
                    raise ValueError(
                        f"table {self.name!r}: {arg}={getattr(self, arg)} needs a dynamic "
                        f"table (num_rows=None), got num_rows={self.num_rows}"
                    )
        if self.nan_policy not in NAN_POLICIES:
            raise ValueError(
                f"table {self.name!r}: nan_policy must be one of {NAN_POLICIES}, "
                f"got {self.nan_policy!r}"
            )

    @property
    def dynamic(self) -> bool:
        """True for a dynamic table (``num_rows`` None)."""
        return self.num_rows is None

    @property
    def state_dim(self) -> int:
        return self.optimizer.state_dim(self.dim)

    @property
    def torch_dtype(self) -> torch.dtype:
        """The torch element type of the stored rows."""
        return TORCH_ROW_DTYPES[self.dtype]

    @property
    def narrow(self) -> bool:
        """Rows stored in 16 bits (fp16 or bf16)."""
        return self.dtype != "fp32"

    @property
    def row_bytes(self) -> int:
        """Bytes a stored row takes: weights (2 or 4 per element), fp32 optimizer state
        and an int64 clock."""
        return self.dim * (2 if self.narrow else 4) + 4 * self.state_dim + 8

    def initial_rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Initial values of rows ``ids`` (int64 ``[N]``): float32 ``[N, dim]``."""
        assert self.init is not None  # resolved in __post_init__
        return self.init.rows(ids, self.dim)

    def initial_state(self) -> torch.Tensor:
        """Optimizer state ``[state_dim]`` float32 of a fresh row."""
        return self.optimizer.initial_state(self.dim)

    def to_json(self) -> dict[str, Any]:
        """A JSON-ready dict (checkpoint manifests, wire messages); see :meth:`from_json`.
        ``dtype`` is written only for narrow rows (an fp32 spec reads as before)."""
        assert self.init is not None
        out: dict[str, Any] = {
            "name": self.name,
            "num_rows": self.num_rows,
            "dim": self.dim,
            "optimizer": self.optimizer.to_json(),
            "init": self.init.to_json(),
            "capacity": self.capacity,
            "max_age_steps": self.max_age_steps,
            "nan_policy": self.nan_policy,
        }
        if self.narrow:
            out["dtype"] = self.dtype
        return out

    @staticmethod
    def from_json(data: dict[str, Any] | str) -> TableSpec:
        """Rebuild a spec from :meth:`to_json` output (dict or JSON text); validates it."""
        if isinstance(data, str):
            data = json.loads(data)
        if not isinstance(data, dict):
            raise TypeError(f"table spec JSON must be an object, got {type(data).__name__}")
        known = {"name", "num_rows", "dim", "optimizer", "init"}
        known |= {"capacity", "max_age_steps", "nan_policy", "dtype"}
        unknown = sorted(set(data) - known)
        missing = sorted({"name", "num_rows", "dim", "optimizer"} - set(data))
        if unknown or missing:
            raise ValueError(
                f"table spec JSON: unknown fields {unknown}, missing fields {missing} in {data!r}"
            )
        init = data.get("init")
        return TableSpec(
            name=data["name"],
            num_rows=data["num_rows"],
            dim=data["dim"],
            optimizer=optimizer_from_json(data["optimizer"]),
            init=None if init is None else UniformInit.from_json(init),
            capacity=data.get("capacity"),
            max_age_steps=data.get("max_age_steps"),
            nan_policy=data.get("nan_policy", "raise"),
            dtype=data.get("dtype", "fp32"),
        )
