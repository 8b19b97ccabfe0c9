"""The in-process store: tables as tensors in this process's memory.

It is the embedded default (no servers) and the reference every other store is
tested against. All work is vectorised: ``torch.unique`` to coalesce duplicate
ids, ``index_add_`` to sum their gradients, index gathers and scatters for rows,
state and clocks; nothing loops over ids in Python.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

import torch

from comm import Handle
from ps.store import PullResult, Store
from ps.table import TableSpec
from ps.validate import check_grads, check_ids, unknown_table

_INIT_CHUNK_ROWS = 1 << 16  # rows initialised per step, bounds the temporary hash arrays


@dataclass(slots=True)
class _Table:
    spec: TableSpec
    weights: torch.Tensor  # [num_rows, D] float32
    state: torch.Tensor  # [num_rows, state_dim] float32
    clocks: torch.Tensor  # [num_rows] int64
    lock: threading.Lock = field(default_factory=threading.Lock)


class InProcessStore(Store):
    """Tables held as CPU tensors; requests complete immediately.

    Thread-safe: a push holds the table's lock for its gather-update-scatter, so
    concurrent pushes to one table are applied one after the other.
    """

    def __init__(self) -> None:
        self._tables: dict[str, _Table] = {}
        self._create_lock = threading.Lock()

    def __repr__(self) -> str:
        return f"InProcessStore(tables={list(self._tables)})"

    # ------------------------------------------------------------ tables

    def create_table(self, spec: TableSpec) -> None:
        if not isinstance(spec, TableSpec):
            raise TypeError(f"create_table: expected a ps.TableSpec, got {type(spec).__name__}")
        with self._create_lock:
            if spec.name in self._tables:
                raise ValueError(
                    f"create_table: table {spec.name!r} already exists "
                    f"(known tables: {list(self._tables)})"
                )
            weights = torch.empty(spec.num_rows, spec.dim, dtype=torch.float32)
            for start in range(0, spec.num_rows, _INIT_CHUNK_ROWS):
                stop = min(spec.num_rows, start + _INIT_CHUNK_ROWS)
                weights[start:stop] = spec.initial_rows(torch.arange(start, stop))
            state0 = spec.optimizer.initial_state(spec.dim)  # [S]
            state = state0.unsqueeze(0).repeat(spec.num_rows, 1)  # [num_rows, S]
            clocks = torch.zeros(spec.num_rows, dtype=torch.int64)
            self._tables[spec.name] = _Table(spec, weights, state, clocks)

    def tables(self) -> list[str]:
        return list(self._tables)

    def spec(self, table: str) -> TableSpec:
        return self._get(table).spec

    def _get(self, table: str) -> _Table:
        try:
            return self._tables[table]
        except (KeyError, TypeError):
            raise unknown_table(table, self._tables) from None

    # ------------------------------------------------------------ rows

    def pull_async(self, table: str, ids: torch.Tensor) -> Handle:
        t = self._get(table)
        ids = check_ids(t.spec, ids, "pull").cpu()
        with t.lock:  # rows and clocks of one consistent moment
            result = PullResult(
                rows=t.weights.index_select(0, ids), clocks=t.clocks.index_select(0, ids)
            )
        return Handle.completed(result, what=f"pull {table!r}")

    def push_async(self, table: str, ids: torch.Tensor, grads: torch.Tensor) -> Handle:
        t = self._get(table)
        ids = check_ids(t.spec, ids, "push").cpu()
        grads = check_grads(t.spec, ids, grads).detach().cpu()
        if ids.numel() > 0:
            uniq, inverse = torch.unique(ids, return_inverse=True)  # [U], [N]
            summed = torch.zeros(uniq.numel(), t.spec.dim, dtype=torch.float32)  # [U, D]
            summed.index_add_(0, inverse, grads)
            with t.lock:
                rows = t.weights.index_select(0, uniq)  # [U, D] copies
                state = t.state.index_select(0, uniq)  # [U, S] copies
                t.spec.optimizer.apply(rows, state, summed)
                t.weights.index_copy_(0, uniq, rows)
                t.state.index_copy_(0, uniq, state)
                t.clocks.index_add_(0, uniq, torch.ones_like(uniq))
        return Handle.completed(None, what=f"push {table!r}")

    # ------------------------------------------------------------ inspection

    def clocks(self, table: str, ids: torch.Tensor) -> torch.Tensor:
        t = self._get(table)
        ids = check_ids(t.spec, ids, "clocks").cpu()
        return t.clocks.index_select(0, ids)

    def state(self, table: str, ids: torch.Tensor) -> torch.Tensor:
        t = self._get(table)
        ids = check_ids(t.spec, ids, "state").cpu()
        return t.state.index_select(0, ids)
