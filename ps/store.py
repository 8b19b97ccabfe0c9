"""The interface every parameter-server store speaks.

A store holds named tables of float32 rows. Workers *pull* rows by id and *push*
row gradients; the store applies the table's optimizer (see
:mod:`ps.optimizers`) and counts, per row, how many updates it applied (the
row's *clock*). Caches compare clocks to bound staleness.

Push semantics (all stores):

* gradients of ids that repeat within one push are **summed first**; the
  optimizer then runs **once per unique row**, and each touched row's clock goes
  up by exactly 1;
* a push is atomic per table: the request is validated before anything changes,
  so a bad request (unknown table, bad ids, wrong shape, NaN/Inf) raises and
  leaves rows, optimizer state and clocks as they were.

Every request has an ``*_async`` form returning a :class:`comm.Handle`; the
synchronous form is ``*_async(...).wait()``. Requests are validated when they
are issued, so a bad one raises from the ``*_async`` call itself. The in-process
store completes at once; remote stores (MPI, Redis) return handles for requests
in flight.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

from comm import Handle
from ps.table import TableSpec


@dataclass(kw_only=True, slots=True, frozen=True)
class PullResult:
    """Rows as of the pull: ``rows`` float32 ``[N, D]``, ``clocks`` int64 ``[N]``."""

    rows: torch.Tensor
    clocks: torch.Tensor


class Store(ABC):
    """A set of tables of rows; see the module docstring for push semantics."""

    # ------------------------------------------------------------ tables

    @abstractmethod
    def create_table(self, spec: TableSpec) -> None:
        """Create ``spec.name`` with its initial rows; ValueError if it exists."""

    @abstractmethod
    def tables(self) -> list[str]:
        """Names of the tables, in creation order."""

    @abstractmethod
    def spec(self, table: str) -> TableSpec:
        """The spec ``table`` was created with."""

    def num_rows(self, table: str) -> int:
        return self.spec(table).num_rows

    # ------------------------------------------------------------ rows

    @abstractmethod
    def pull_async(self, table: str, ids: torch.Tensor) -> Handle:
        """Start a pull of rows ``ids`` (int64 ``[N]``); ``wait()`` gives a :class:`PullResult`."""

    def pull(self, table: str, ids: torch.Tensor) -> PullResult:
        result: PullResult = self.pull_async(table, ids).wait()
        return result

    @abstractmethod
    def push_async(self, table: str, ids: torch.Tensor, grads: torch.Tensor) -> Handle:
        """Start a push of ``grads`` float32 ``[N, D]`` for rows ``ids`` int64 ``[N]``.

        ``wait()`` returns None once the update is applied.
        """

    def push(self, table: str, ids: torch.Tensor, grads: torch.Tensor) -> None:
        self.push_async(table, ids, grads).wait()

    # ------------------------------------------------------------ inspection

    @abstractmethod
    def clocks(self, table: str, ids: torch.Tensor) -> torch.Tensor:
        """Update counts of rows ``ids``: int64 ``[N]``."""

    @abstractmethod
    def state(self, table: str, ids: torch.Tensor) -> torch.Tensor:
        """Optimizer state of rows ``ids``: float32 ``[N, state_dim]`` (for tests, checkpoints)."""

    def close(self) -> None:  # noqa: B027 - optional; stores without resources keep it
        """Release connections or servers; the in-process store has nothing to release."""

    def __enter__(self) -> Store:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
