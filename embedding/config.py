"""Embedding table configs: what a model author writes per table."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from ps import Optimizer, RowWiseAdagrad, TableSpec, UniformInit
from ps.table import RowDtype, check_row_dtype

POOLINGS = ("sum", "mean", "none")
PLACEMENTS = ("local", "hybrid", "sharded")

Pooling = Literal["sum", "mean", "none"]
Placement = Literal["local", "hybrid", "sharded"]


@dataclass(kw_only=True, slots=True, frozen=True)
class TableConfig:
    """One table of ``num_rows`` rows of width ``dim``, shared by ``feature_names``.

    * ``pooling``: each feature's ids in a sample become one ``[dim]`` vector with
      "sum" or "mean" (per-id weights need "sum"); "none" keeps one vector per id
      (sequence features of a language model): the feature's output is
      ``[B, T, dim]`` and every sample must have exactly ``T`` ids.
    * ``placement``: where the rows live. "local": in this process, all local
      tables of a collection fused into one flat weight (replicated when data
      parallel); "hybrid": in a ``ps`` store (possibly behind a ``cache``);
      "sharded": owned by ranks of the group, ids travel by alltoallv.
    * ``num_rows``: an int > 0, or None for a *dynamic* table keyed by any int64 id
      (rows created on first push). Only the parameter server has dynamic tables,
      so None needs ``placement="hybrid"``. ``capacity`` and ``max_age_steps``
      bound a dynamic table's rows (LRU and age eviction on the store, see
      :class:`ps.TableSpec`).
    * ``optimizer`` is applied to touched rows inside ``backward()`` (lazily: rows
      without a gradient do not change); ``init`` None is TorchRec's
      ``U(-sqrt(1/num_rows), sqrt(1/num_rows))`` seeded by the table name.
    * ``dtype``: the element type the rows are stored in, "fp32", "fp16" or "bf16"
      (every placement). Lookups pool in float32; updates are computed in float32
      and written back with stochastic rounding, reproducible from the table's init
      seed (:mod:`ps.rounding`); optimizer state stays float32.
    """

    name: str
    num_rows: int | None
    dim: int
    feature_names: list[str]
    pooling: Pooling = "sum"
    placement: Placement = "local"
    optimizer: Optimizer = field(default_factory=lambda: RowWiseAdagrad(lr=0.01))
    init: UniformInit | None = None
    capacity: int | None = None
    max_age_steps: int | None = None
    dtype: RowDtype = "fp32"

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"TableConfig: name must be a non-empty string, got {self.name!r}")
        check_row_dtype(self.name, self.dtype)
        if self.placement not in PLACEMENTS:
            raise ValueError(
                f"table {self.name!r}: placement must be one of {PLACEMENTS}, "
                f"got {self.placement!r}"
            )
        rows = self.num_rows
        if rows is None:
            if self.placement != "hybrid":
                raise ValueError(
                    f"table {self.name!r}: num_rows=None (a dynamic table) needs "
                    f"placement='hybrid' (only the parameter server has dynamic tables), "
                    f"got placement={self.placement!r}"
                )
        elif not isinstance(rows, int) or isinstance(rows, bool) or rows <= 0:
            raise ValueError(f"table {self.name!r}: num_rows must be an int > 0, got {rows!r}")
        d = self.dim
        if not isinstance(d, int) or isinstance(d, bool) or d <= 0:
            raise ValueError(f"table {self.name!r}: dim must be an int > 0, got {d!r}")
        feats = self.feature_names
        if isinstance(feats, str) or not isinstance(feats, list | tuple) or len(feats) == 0:
            raise ValueError(
                f"table {self.name!r}: feature_names must be a non-empty list of strings, "
                f"got {feats!r}"
            )
        if not all(isinstance(f, str) and f for f in feats):
            raise ValueError(
                f"table {self.name!r}: feature names must be non-empty strings, got {feats!r}"
            )
        if len(set(feats)) != len(feats):
            raise ValueError(f"table {self.name!r}: duplicate feature names in {list(feats)}")
        object.__setattr__(self, "feature_names", list(feats))
        if self.pooling not in POOLINGS:
            raise ValueError(
                f"table {self.name!r}: pooling must be one of {POOLINGS}, got {self.pooling!r}"
            )
        if not isinstance(self.optimizer, Optimizer):
            raise TypeError(
                f"table {self.name!r}: optimizer must be a ps optimizer config such as "
                f"SGD(lr=...) or RowWiseAdagrad(lr=...), got {type(self.optimizer).__name__}"
            )
        if self.init is not None and not isinstance(self.init, UniformInit):
            raise TypeError(
                f"table {self.name!r}: init must be a UniformInit or None, "
                f"got {type(self.init).__name__}"
            )
        if self.capacity is not None or self.max_age_steps is not None:
            self.to_spec()  # the store's rules: positive ints, on a dynamic table only

    @property
    def dynamic(self) -> bool:
        """True for a dynamic table (``num_rows`` None, hybrid only)."""
        return self.num_rows is None

    def to_spec(self) -> TableSpec:
        """The parameter-server view of this table (no features, pooling or placement).

        Local and sharded tables use it too: their initial rows are the spec's
        deterministic ``initial_rows``, so every placement starts from the same values.
        """
        return TableSpec(
            name=self.name,
            num_rows=self.num_rows,
            dim=self.dim,
            optimizer=self.optimizer,
            init=self.init,
            capacity=self.capacity,
            max_age_steps=self.max_age_steps,
            dtype=self.dtype,
        )
