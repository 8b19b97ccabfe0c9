"""Embedding table configs: what a model author writes per table."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from ps import Optimizer, RowWiseAdagrad, TableSpec, UniformInit

POOLINGS = ("sum", "mean")


@dataclass(kw_only=True, slots=True, frozen=True)
class TableConfig:
    """One table of ``num_rows`` rows of width ``dim``, shared by ``feature_names``.

    Each feature's ids in a sample are pooled into one ``[dim]`` vector with
    ``pooling`` ("sum" or "mean"; per-id weights need "sum"). ``optimizer`` runs
    on the parameter server; ``init`` None is TorchRec's
    ``U(-sqrt(1/num_rows), sqrt(1/num_rows))`` seeded by the table name.
    """

    name: str
    num_rows: int
    dim: int
    feature_names: list[str]
    pooling: Literal["sum", "mean"] = "sum"
    optimizer: Optimizer = field(default_factory=lambda: RowWiseAdagrad(lr=0.01))
    init: UniformInit | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"TableConfig: name must be a non-empty string, got {self.name!r}")
        for arg in ("num_rows", "dim"):
            v = getattr(self, arg)
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                raise ValueError(f"table {self.name!r}: {arg} must be an int > 0, got {v!r}")
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

    def to_spec(self) -> TableSpec:
        """The parameter-server view of this table (no features, no pooling)."""
        return TableSpec(
            name=self.name,
            num_rows=self.num_rows,
            dim=self.dim,
            optimizer=self.optimizer,
            init=self.init,
        )
