"""A server's batched messages served whole in C (:mod:`ps.kernels.message_pass`).

:class:`BatchedPass` keeps what the C passes need of the server's tables, one
descriptor row per table index (addresses of the rows, state and clocks, the id map
of a :class:`ps.mpi.fixed_shard.FixedShard`, the optimizer's kind and
hyper-parameters) and the counters the passes add to. The server rebuilds it
whenever its tables change (create, drop, a committed load); the tensors it points
into are the tables' own, which a fixed table never reallocates, and the tables are
held here so the addresses stay valid.

Which messages it serves: a ``PULL_MANY`` whose parts are all fixed tables (fp16 / bf16
rows go back as their stored bits, in the table's type on the wire), and a
``PUSH_MANY`` whose parts are all fixed row-wise Adagrad tables with strictly
increasing ids (a cache's and the hybrid tables' deduplicated pushes are) and
finite gradients, counted (a cache's under a write bound: each row with its update
count and statistic; not of a narrow table) or not; a narrow table's gradients come in
its type and are widened in the pass. Everything else (dynamic tables, other
optimizers, repeated ids, any request the checks would refuse) is served part by part
in Python, as before; the C checks only decide which path, never what an error says.

Counters: the passes count into one int64 array; :meth:`fold` adds them to the
tables' own counters (before a stats reply and before the tables change), so
``stats()`` reads the same whichever path served a request.
"""

from __future__ import annotations

import numpy as np
import torch

from ps.kernels import message_pass
from ps.kernels.message_pass import COUNTER_WORDS, TABLE_WORDS
from ps.local.batched_pass import descriptor
from ps.local.table import COUNTERS, LocalTable
from ps.mpi import wire
from ps.mpi.fixed_shard import FixedShard
from ps.mpi.wire import HEADER_LEN, Op

Shard = LocalTable | FixedShard
#: A ``PUSH_MANY``'s table of contents ``[k, 3]``, ids ``[N]``, gradients and, counted, its
#: counts and statistics (:data:`ps.kernels.message_pass.Counted`).
PushParts = tuple[np.ndarray, np.ndarray, np.ndarray, message_pass.Counted]

assert len(COUNTERS) == COUNTER_WORDS  # the C passes count in this order


class BatchedPass:
    """Descriptors and counters of the C passes over one server's tables."""

    def __init__(self, threads: int) -> None:
        """``threads``: how many threads serve the parts of one message (parts of
        different tables run at once; 1: one after another)."""
        self.threads = threads
        self.enabled = message_pass.available()
        self.shards: list[Shard | None] = []  # table index -> the table (None: not served)
        self.tables = np.zeros((0, TABLE_WORDS), dtype=np.int64)  # [T, TABLE_WORDS]
        self.hyper = np.zeros((0, 2), dtype=np.float32)  # [T, 2] lr, eps
        self.counters = np.zeros((0, COUNTER_WORDS), dtype=np.int64)  # [T, COUNTER_WORDS]
        self.served = 0  # messages these passes served (the rest went the Python path)

    def rebuild(self, shards: list[Shard | None]) -> None:
        """Point the descriptors at ``shards`` (by table index; None: an index whose
        table was dropped or re-created under another index), after folding the
        counters into the tables they counted for."""
        self.fold()
        self.shards = list(shards)
        t = len(shards)
        self.tables = np.zeros((t, TABLE_WORDS), dtype=np.int64)
        self.hyper = np.zeros((t, 2), dtype=np.float32)
        self.counters = np.zeros((t, COUNTER_WORDS), dtype=np.int64)
        for index, shard in enumerate(shards):
            # fixed tables (dynamic ones take the Python path)
            if shard is not None and shard.spec.num_rows is not None:
                self.tables[index], self.hyper[index] = _descriptor(shard)

    def fold(self) -> None:
        """Add the passes' counts to the tables' own counters and start again from 0."""
        for index in np.flatnonzero(self.counters.any(axis=1)).tolist():
            shard = self.shards[index]
            if shard is not None:
                own = _engine(shard).counters
                for name, value in zip(COUNTERS, self.counters[index].tolist(), strict=True):
                    own[name] += value
        self.counters[:] = 0

    def pull_many(
        self, k: int, request_id: int, payload: np.ndarray, with_state: bool = False
    ) -> tuple[np.ndarray, np.ndarray] | None:
        """The reply (meta, rows) to a ``PULL_MANY`` of ``k`` parts, or None: serve it in
        Python (``payload``: the request's words after its header; ``with_state``: each
        row's optimizer state follows its values)."""
        width = wire.PULL_PART_WORDS
        if not self.enabled or payload.size < k * width:
            return None
        toc, words = payload[: k * width].reshape(k, width), payload[k * width :]
        sizes = message_pass.pull_check(toc, words, self.tables, with_state, packed=True)
        if sizes is None:
            return None
        meta = np.empty(HEADER_LEN + sizes[0], dtype=np.int64)
        rows = np.empty(sizes[1], dtype=np.float32)
        used, floats = message_pass.pull_apply(
            toc, words, self.tables, self.counters, meta[HEADER_LEN:], rows, self.threads,
            with_state, packed=True,
        )  # fmt: skip
        meta[:HEADER_LEN] = wire.header(Op.PULL_MANY, request_id, n=k)
        self.served += 1
        return meta[: HEADER_LEN + used], rows[:floats]

    def checked_push(
        self,
        k: int,
        payload: np.ndarray,
        data: np.ndarray,
        sequenced: bool,
        *,
        counted: bool = False,
        wide: bool = False,
    ) -> PushParts | None:
        """The parts of a ``PUSH_MANY`` of ``k`` parts that :meth:`push` can apply, or None:
        serve it in Python (``payload``: the words after its header; ``sequenced``: the
        session word ends it; ``counted``: the update counts follow the ids, ``wide`` as
        int64 words, and the statistics the gradients)."""
        parts = self._parts(k, payload, data, sequenced, counted, wide)
        if parts is None or not message_pass.push_check(
            *parts[:3], self.tables, parts[3], packed=True, threads=self.threads
        ):
            return None
        return parts

    def push(self, parts: PushParts) -> None:
        """Apply a ``PUSH_MANY`` whose parts :meth:`checked_push` gave."""
        toc, ids, grads, counts = parts
        message_pass.push_apply(
            toc,
            ids,
            grads,
            self.tables,
            self.hyper,
            self.counters,
            self.threads,
            counts,
            packed=True,
        )
        self.served += 1

    def _parts(
        self,
        k: int,
        payload: np.ndarray,
        data: np.ndarray,
        sequenced: bool,
        counted: bool,
        wide: bool,
    ) -> PushParts | None:
        """A ``PUSH_MANY``'s table of contents ``[k, 3]``, ids ``[N]`` and gradients (views)
        and, counted, its counts ``[N]`` and statistics ``[N]`` (one per row: the pass
        takes row-wise Adagrad only, whose statistic is one float); None where the
        sizes do not add up (the Python path then says what is wrong)."""
        width = wire.PUSH_PART_WORDS
        if not self.enabled or payload.size < k * width + int(sequenced):
            return None
        toc = payload[: k * width].reshape(k, width)
        end = payload.size - int(sequenced)
        if not counted:
            return toc, payload[k * width : end], data, None
        n = int(toc[:, 1].sum())
        if n < 0 or k * width + n + wire.count_words(n, wide) != end or data.size < n:
            return None
        ids = payload[k * width : k * width + n]
        counts = wire.unpack_counts(payload[k * width + n : end], n, wide)
        grads, stats = data[: data.size - n], data[data.size - n :]
        return toc, ids, grads, (counts, stats)

    def write(
        self,
        toc: np.ndarray,
        ids: np.ndarray,
        clocks: np.ndarray,
        rows: np.ndarray,
        state: np.ndarray,
    ) -> bool:
        """Apply a ``WRITE`` (its table of contents ``[k, 4]`` as sent, its ids, clocks,
        rows and state, each the parts' back to back) in one checked C pass
        (:func:`ps.kernels.message_pass.write`); False: nothing changed, serve it in
        Python (which says what is wrong, if anything)."""
        if not self.enabled:
            return False
        toc = np.ascontiguousarray(toc)
        ids, clocks = np.ascontiguousarray(ids), np.ascontiguousarray(clocks)
        rows, state = np.ascontiguousarray(rows), np.ascontiguousarray(state)
        if not message_pass.write(toc, ids, clocks, rows, state, self.tables):
            return False
        for index, n in toc[:, :2].tolist():
            shard = self.shards[index]
            assert shard is not None  # (the pass takes only described tables)
            own = _engine(shard).counters
            own["write_requests"] += 1
            own["rows_written"] += n
        self.served += 1
        return True


def _engine(shard: Shard) -> LocalTable:
    """The fixed table that holds ``shard``'s rows."""
    return shard.table if isinstance(shard, FixedShard) else shard


def _descriptor(shard: Shard) -> tuple[list[int], list[float]]:
    """One table's descriptor words and (lr, eps) (layout: ``message_pass.c``)."""
    ids_map: torch.Tensor | None = shard.local if isinstance(shard, FixedShard) else None
    return descriptor(_engine(shard), shard.spec, ids_map)
