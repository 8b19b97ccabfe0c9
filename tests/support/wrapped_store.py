"""A ``ps.Store`` that hands every call to another store (a fresh ``InProcessStore`` by
default): tests and benchmarks subclass it and override the calls they instrument (count,
delay, time), keeping everything else real."""

from __future__ import annotations

import os

import torch

import ps
from comm import Handle


class WrappedStore(ps.Store):
    """Every ``Store`` method of ``self.inner`` (``inner``, else a fresh
    ``InProcessStore``), one table at a time: the batched calls come from the base class."""

    def __init__(self, inner: ps.Store | None = None) -> None:
        self.inner = ps.InProcessStore() if inner is None else inner

    def create_table(self, spec: ps.TableSpec, *, exist_ok: bool = False) -> None:
        self.inner.create_table(spec, exist_ok=exist_ok)

    def drop_table(self, table: str) -> None:
        self.inner.drop_table(table)

    def tables(self) -> list[str]:
        return self.inner.tables()

    def spec(self, table: str) -> ps.TableSpec:
        return self.inner.spec(table)

    def pull_async(
        self,
        table: str,
        ids: torch.Tensor,
        *,
        clocks: torch.Tensor | None = None,
        bound: int | None = None,
    ) -> Handle:
        return self.inner.pull_async(table, ids, clocks=clocks, bound=bound)

    def push_async(self, table: str, ids: torch.Tensor, grads: torch.Tensor) -> Handle:
        return self.inner.push_async(table, ids, grads)

    def clocks(self, table: str, ids: torch.Tensor) -> torch.Tensor:
        return self.inner.clocks(table, ids)

    def state(self, table: str, ids: torch.Tensor) -> torch.Tensor:
        return self.inner.state(table, ids)

    def stats(self) -> dict[str, dict[str, int | float]]:
        return self.inner.stats()

    def save(self, path: str | os.PathLike[str]) -> None:
        self.inner.save(path)

    def load(self, path: str | os.PathLike[str]) -> None:
        self.inner.load(path)
