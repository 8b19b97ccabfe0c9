"""Hybrid tables: rows live in a ``ps`` store (possibly behind a ``cache``).

Forward, per *group* of tables with the same ``dim`` (laid out like the local
fused path, :func:`embedding.fused_ops.group_batch`)::

    ids of every feature of the group, table by table     [N]
    one sort -> unique (table, id) pairs, inverse, runs    [U], [N]   (one dedup for
                                                                       pull AND push)
    pull every table's unique ids in ONE batched request   rows [U, D]
      (``Store.pull_groups_async``: one message per server for all groups and tables;
      fixed tables ask by their packed keys, one group request per group, which a
      shared cache over the same tables takes as it is)
    ONE embedding_bag over rows, bags as in the local path -> [nbags, D] -> features

Backward is fused with the push (as TorchRec fuses it with the optimizer): one
autograd node for the whole module; its backward sums the output gradient per
unique row over the dedup's runs (no ``[N, D]`` temporary, no dense ``[U, D]``
zeros per table) and pushes every group's ``(unique keys, row gradients)`` to the
store in ONE batched push (``Store.push_groups_async``), which applies each table's
optimizer.
There is no separate optimizer step and no embedding ``nn.Parameter``. A rank that
trains alone and unpipelined does not wait for its push's reply in backward: a store
applies one worker's requests in order, so the next pull sees the push, and the rank
waits for it at its next store call (``wait_push``; ``drain``, ``flush`` and every
save or load wait too), while the servers apply it beside the rest of the step.

Data parallel (``group.size > 1``), two cases:

* **replicated store** (``store_is_shared=False``; the default for a
  :class:`ps.InProcessStore`): every rank holds its own copy of every table
  (all start from the same deterministic rows). The backward hook gathers every
  rank's ``(unique ids, row gradients)`` with ``allgatherv``, divides the
  gradients by ``group.size`` (the gradient of the global mean loss is the
  average of the per-rank gradients of the local mean losses) and pushes the
  whole concatenation, so every replica applies the identical update. Like DDP
  this needs every rank to run forward on the same collection and then one
  backward through every output it used.
* **shared store** (``store_is_shared=True``; the default for any other store,
  e.g. MPI server ranks or Redis, also behind a cache): one copy of each table
  is shared by all workers, so each worker pushes its own row gradients divided
  by ``group.size`` and nothing is gathered. The store applies each push as it
  comes (asynchronous PS training): with a stateful optimizer two pushes are not
  exactly one push of their sum, by design.
"""

from __future__ import annotations

import tempfile
from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import nn

from comm import Handle, ProcessGroup, boundary
from comm.agreement import run_on_rank0
from comm.device import module_device
from embedding.checks import check_batch_ids, check_ids, check_weights
from embedding.config import TableConfig
from embedding.fused_ops import (
    GroupBatch,
    group_batch,
    groups_feature_sizes,
    kernel_parts,
    lookup,
    name_parts,
    sorted_segment_sum,
)
from embedding.jagged import KeyedJaggedIds
from embedding.sparse_pipeline import SparsePipeline
from embedding.table_state import part_from_state_dict, target_device
from ps import InProcessStore, PullRequest, PushRequest, Store, TableSpec
from ps.checkpoint import TablePart, read_checkpoint, write_checkpoint
from ps.group_requests import GroupPull, GroupPush, IdSpace
from ps.kernels import rowwise_adagrad as cpu_kernel


def store_is_replicated(store: Store) -> bool:
    """True when ``store`` keeps its tables in this process (an :class:`ps.InProcessStore`,
    directly or wrapped by a cache whose backing store is one): each rank then has its
    own copy. Wrappers are followed through a ``store`` or ``inner`` attribute."""
    seen = 0
    while seen < 8:
        if isinstance(store, InProcessStore):
            return True
        inner = getattr(store, "store", None) or getattr(store, "inner", None)
        if not isinstance(inner, Store) or inner is store:
            return False
        store, seen = inner, seen + 1
    return False


def backing_store(store: Store) -> Store:
    """The store that really holds the rows: ``store`` itself, or the one a cache (or
    another wrapper with a ``store`` or ``inner`` attribute) wraps."""
    for _ in range(8):
        inner = getattr(store, "store", None) or getattr(store, "inner", None)
        if not isinstance(inner, Store) or inner is store:
            return store
        store = inner
    return store


def create_table_once(store: Store, spec: TableSpec) -> None:
    """``store.create_table(spec, exist_ok=True)``: create ``spec.name`` unless the store
    has it with an equal spec; a different spec raises ``ps.TableSpecMismatch`` naming
    both shapes and how to clear the old table."""
    store.create_table(spec, exist_ok=True)


def create_tables(
    store: Store, specs: Sequence[TableSpec], group: ProcessGroup, shared: bool
) -> None:
    """Create the tables ``specs`` that ``store`` lacks (an existing table with an equal
    spec is reused; a different spec raises ValueError naming both shapes).

    A store shared by the ranks of ``group`` (MPI servers, Redis) is changed by rank 0
    only while the others wait (collective): two ranks creating one table at the same
    moment would race. Every rank raises if rank 0 failed, then checks the specs itself.
    A per-rank store (or one rank) creates its own tables."""
    if not shared or group.size == 1:
        for spec in specs:
            create_table_once(store, spec)
        return

    def create_all() -> None:
        for spec in specs:
            create_table_once(store, spec)

    run_on_rank0(
        group, create_all, f"creating the tables {[s.name for s in specs]} in the shared store"
    )
    if group.rank != 0:
        for spec in specs:  # rank 0 made or found them: only the check is left
            have = store.spec(spec.name)
            if have != spec:
                raise ValueError(
                    f"EmbeddingCollection: the shared store's table {spec.name!r} is "
                    f"{have.num_rows} x {have.dim} ({have}), this rank wants "
                    f"{spec.num_rows} x {spec.dim} ({spec})"
                )


_READ_CHUNK_ROWS = 1 << 16  # rows read from a store at once for a whole-table read


def _read_fixed(store: Store, spec: TableSpec) -> TablePart:
    """A fixed-size table whole from ``store``, ``_READ_CHUNK_ROWS`` rows per read."""
    assert spec.num_rows is not None
    chunks = []
    for start in range(0, spec.num_rows, _READ_CHUNK_ROWS):
        ids = torch.arange(start, min(spec.num_rows, start + _READ_CHUNK_ROWS))
        pulled = store.pull(spec.name, ids)
        chunks.append(TablePart(ids, pulled.rows, store.state(spec.name, ids), pulled.clocks))
    return TablePart.concat(chunks, spec.dim, spec.state_dim)


def _saved_tables(store: Store, specs: Sequence[TableSpec]) -> dict[str, TablePart]:
    """Tables ``specs`` whole, from a ``store.save`` into a temporary folder (the store
    alone knows which ids a dynamic table holds)."""
    with tempfile.TemporaryDirectory(prefix="hybrid-tables-") as tmp:
        store.save(Path(tmp) / "store")
        ckpt = read_checkpoint(Path(tmp) / "store")
        return {s.name: ckpt.read_table(s.name) for s in specs}


@dataclass(slots=True)
class _Group:
    """One dim group's share of a batch, between dedup and the push."""

    features: list[tuple[TableConfig, str]]  # output order: table by table
    tables: list[TableConfig]  # the group's tables in the batch, in order
    batch: GroupBatch  # ids = index into the group's unique rows, bags as in local
    perm: torch.Tensor  # [N] positions of the ids, sorted by (table, id)
    counts: torch.Tensor  # [U] occurrences of each unique row (runs of ``perm``)
    # Per table its unique ids [U_t], sorted (CPU); for packed tables cut from ``keys``
    # on first use (:meth:`table_ids`): their pulls and pushes are group requests.
    unique: list[torch.Tensor] | None
    # Fixed tables packed into one id space: the unique keys [U] (CPU, sorted) and the
    # space the store is asked in (table t's id i is key space.bases[t] + i); None for a
    # group with a dynamic table.
    keys: torch.Tensor | None = None
    space: IdSpace | None = None

    def table_ids(self) -> list[torch.Tensor]:
        """Per table of the group, its unique ids ``[U_t]`` sorted (CPU)."""
        if self.unique is None:
            assert self.keys is not None and self.space is not None
            bases = self.space.bases  # [k + 1]
            cut = np.searchsorted(self.keys.numpy(), bases).tolist()
            self.unique = [
                self.keys[cut[i] : cut[i + 1]] - int(bases[i]) for i in range(len(self.tables))
            ]
        return self.unique


Plan = list[tuple[TableConfig, list[str]]]  # the hybrid tables of a batch, with their features


@dataclass(slots=True, eq=False)
class _Ahead:
    """The next batch's dedup and pull, running on the pipeline's thread."""

    kjt: KeyedJaggedIds
    plan: Plan
    # groups, per group one [U, D] of rows, and the overlap with the batch being trained
    future: Future[tuple[list[_Group], list[list[torch.Tensor]], _Overlap] | None]
    # Pushes sent after the pull: each first pushes the rows this batch uses and pulls
    # them again into its rows, and is done when they are right (see _push).
    fixes: list[Future[None]]
    before: list[_Group]  # the batch being trained when this one was announced


@dataclass(slots=True)
class _Overlap:
    """The rows of one batch's groups (``pushed``) that a later batch uses: per table,
    in order, its ids and their ``(group index, positions [K_t])`` in the later batch's
    rows (see :func:`_used_by`)."""

    ids: dict[str, torch.Tensor]
    places: list[tuple[int, torch.Tensor]]


def _same_batch(a: KeyedJaggedIds, b: KeyedJaggedIds) -> bool:
    """The same ids in the same bags (the trainer announces a batch, then may move it)."""
    if a is b:
        return True
    if a.keys != b.keys or a.ids.shape != b.ids.shape or a.lengths.shape != b.lengths.shape:
        return False
    wa, wb = a.weights, b.weights
    if (wa is None) != (wb is None):
        return False
    same = torch.equal(a.ids.cpu(), b.ids.cpu()) and torch.equal(a.lengths.cpu(), b.lengths.cpu())
    return same and (wa is None or wb is None or torch.equal(wa.cpu(), wb.cpu()))


class HybridTables(nn.Module):
    """Store-backed tables of an :class:`~embedding.EmbeddingCollection`.

    ``forward(kjt, tables)`` takes ``[(config, features present in kjt)]`` and
    returns ``{feature: [B, D] or [B, T, D]}``.
    """

    def __init__(
        self,
        configs: Sequence[TableConfig],
        store: Store,
        group: ProcessGroup,
        store_is_shared: bool | None = None,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        self.configs = {c.name: c for c in configs}
        self.store = store
        self.group = group
        if store_is_shared is None:
            store_is_shared = not store_is_replicated(store)
        self.store_is_shared = bool(store_is_shared)
        create_tables(store, [cfg.to_spec() for cfg in configs], group, self.store_is_shared)
        dev = module_device(group, device)
        # Autograd needs one input that requires grad to record the lookup node.
        self._anchor = torch.zeros(0, requires_grad=True, device=dev)
        # A zero tied to the lookup node when it has no named output in this batch
        # (replicated data parallel: its backward's collectives must still run).
        self.tie: torch.Tensor | None = None
        self.state_dict_tables = True  # False: state_dict() leaves the tables out
        # The sparse pipeline (:meth:`set_pipelined`): store calls on a background thread.
        self.pipeline: SparsePipeline | None = None
        self._announced: tuple[KeyedJaggedIds, Plan] | None = None  # the next batch
        self._ahead: _Ahead | None = None  # its pull, in flight
        # This rank's last push, sent and not yet waited for, when the rank is alone and
        # unpipelined. A store applies one worker's requests in order, so every later
        # request of this rank sees it; waiting at the rank's next store call lets the
        # servers apply it while the rank runs the rest of its step (the dense backward's
        # tail, the optimizer, the next batch) instead of idling until they are done.
        self._push_in_flight: Handle | None = None

    # ------------------------------------------------------------ the sparse pipeline

    def set_pipelined(self, on: bool) -> None:
        """Run the sparse step beside the dense compute (on) or in line with it (off).

        On, a training step's store calls run on one background thread
        (:class:`embedding.sparse_pipeline.SparsePipeline`), in order: the batch
        announced by :meth:`prefetch` is deduplicated and pulled while this batch's dense
        forward and backward run, and the backward's push is handed to the thread. The
        rows a batch is pooled from are what the unpipelined step would pull: rows of
        the announced batch that this worker pushed after its pull was sent are pulled
        again once that push is applied (through a cache: served again, with its
        read-bound check), so with one worker and bounds (0, 0) training is bit-exact
        with the unpipelined run. Other workers' pushes during one step may land after
        the pull, as they may after any pull of an asynchronous PS.

        Needs a store shared by the ranks, or one rank: with per-rank replicas every push
        is a collective (``allgatherv``), which must not run beside the dense allreduce.
        """
        self.wait_push()
        if on and self.pipeline is None:
            if self.group.size > 1 and not self.store_is_shared:
                raise ValueError(
                    f"hybrid tables {list(self.configs)}: the sparse pipeline needs a store "
                    f"shared by the {self.group.size} ranks (or one rank); with per-rank "
                    "replicas every push is a collective (allgatherv), which must not run "
                    "beside the dense allreduce"
                )
            self.pipeline = SparsePipeline()
        elif not on and self.pipeline is not None:
            self._drop_ahead()
            pipeline, self.pipeline = self.pipeline, None
            self._announced = None
            pipeline.close()

    def _store_call(self, call):  # type: ignore[no-untyped-def]
        """``call()`` in order with the pipeline's jobs (on its thread), or here without one."""
        return call() if self.pipeline is None else self.pipeline.run(call)

    def drain(self) -> None:
        """Wait for every store call of this rank: the pipeline's, or the last push
        (raising a failed push's error)."""
        self.wait_push()
        if self.pipeline is not None:
            self.pipeline.drain()

    def wait_push(self) -> None:
        """Wait for the push still in flight, if any (its error, if it failed, is
        raised here: a dead or timed-out server; bad gradients raise when pushed)."""
        handle, self._push_in_flight = self._push_in_flight, None
        if handle is not None:
            handle.wait()

    def settle(self) -> None:
        """:meth:`drain`, and drop the rows pulled ahead: before the store is read or
        written directly (a save, a load: the next batch then pulls in line)."""
        self._drop_ahead()
        self.drain()

    def _take_ahead(
        self, kjt: KeyedJaggedIds, plan: Plan
    ) -> tuple[list[_Group], list[list[torch.Tensor]]] | None:
        """The pipelined dedup and rows of ``kjt`` when they were pulled ahead (None:
        not announced, another batch, or it could not be pulled ahead), once every push
        sent since has pulled the rows it changed again."""
        ahead = self._ahead
        if ahead is None or ahead.plan != plan or not _same_batch(ahead.kjt, kjt):
            return None
        self._ahead = None
        assert self.pipeline is not None
        got = ahead.future.result()  # an error of the pull itself is raised here
        for fix in ahead.fixes:
            fix.result()  # a failed push's error is raised here
        self.pipeline.check()
        return None if got is None else (got[0], got[1])

    def _drop_ahead(self) -> None:
        """Forget the pull ahead; its pushes' errors stay owed (raised by the next check)."""
        if self._ahead is not None and self.pipeline is not None:
            for fix in self._ahead.fixes:
                self.pipeline.owe(fix)
        self._ahead = None

    def _pull_ahead(self, now: list[_Group]) -> None:
        """Send the announced batch's dedup and pull to the pipeline's thread, and the
        rows of this batch (``now``, its groups) it uses, found there too (beside this
        batch's dense step, not in the wait for this batch's push)."""
        announced, self._announced = self._announced, None
        if announced is None or self.pipeline is None:
            return
        kjt, plan = announced
        # Deduplicated where the forward pools (a GPU worker's batch was announced on the
        # host): the groups' index tensors must be on the rows' device.
        here = kjt if kjt.ids.device == self.device else kjt.to(self.device)

        def job() -> tuple[list[_Group], list[list[torch.Tensor]], _Overlap] | None:
            try:  # a bad batch is reported by its own forward, which checks it again
                check_batch_ids(here, plan)
                for cfg, feats in plan:
                    check_weights(cfg, feats, here.weights is not None)
            except (TypeError, ValueError, IndexError, KeyError):
                return None
            groups = self._dedup(here, plan)
            # one [U, D] per group: a push's rows are pulled again into it in one scatter
            rows = [[p[0] if len(p) == 1 else torch.cat(p)] for p in self._pull(groups)]
            return groups, rows, _used_by(now, groups)

        self._drop_ahead()  # an earlier one its batch never came for
        self._ahead = _Ahead(kjt, plan, self.pipeline.submit(job), [], now)

    @property
    def device(self) -> torch.device:
        """Where the pulled rows are pooled and the outputs live (the store stays on the host)."""
        return self._anchor.device

    def _apply(self, fn, recurse=True):  # type: ignore[no-untyped-def]
        """``.to(device)``: later batches pool on the new device (the rows stay in the store)."""
        self._anchor = torch.zeros(0, requires_grad=True, device=target_device(fn, self._anchor))
        return self

    # ------------------------------------------------------------ whole tables

    def flush(self) -> None:
        """Push this worker's pending updates to the store (a cache's ``flush``; nothing
        for a plain store), so a read of the store sees every update of this worker.
        With the sparse pipeline: its calls are done first, the rows pulled ahead dropped."""
        self.settle()
        flush = getattr(self.store, "flush", None)
        if flush is not None:
            flush()

    def table_parts(self) -> list[tuple[TableSpec, TablePart]]:
        """Every hybrid table whole (rows, optimizer state, clocks) as ``(spec, part)``,
        read from the store after :meth:`flush` (not collective: a shared store holds
        this worker's updates, not necessarily its peers' pending ones). Fixed tables
        are read through the store in chunks; dynamic ones (their ids are known only to
        the store) through one ``store.save`` into a temporary folder."""
        self.flush()
        store = backing_store(self.store)
        specs = [cfg.to_spec() for cfg in self.configs.values()]
        dynamic = [s for s in specs if s.num_rows is None]
        saved = _saved_tables(store, dynamic) if dynamic else {}
        return [(s, saved[s.name] if s.num_rows is None else _read_fixed(store, s)) for s in specs]

    def load_parts(self, parts: Sequence[tuple[TableSpec, TablePart]]) -> None:
        """Replace these hybrid tables in the store by ``parts`` (whole tables, checked
        against the specs first): through a temporary ps checkpoint and ``store.load``
        (a cache flushes and empties itself; for a shared store this changes every
        worker's table). Not collective: see ``EmbeddingCollection.load``."""
        checked = self._check_parts(parts)
        self.settle()  # the rows pulled ahead are the old ones
        with tempfile.TemporaryDirectory(prefix="hybrid-tables-") as tmp:
            write_checkpoint(
                Path(tmp) / "tables", [(spec, [part]) for spec, part in checked],
                writer="embedding.HybridTables",
            )  # fmt: skip
            self.store.load(Path(tmp) / "tables")

    def _check_parts(
        self, parts: Sequence[tuple[TableSpec, TablePart]]
    ) -> list[tuple[TableSpec, TablePart]]:
        out = []
        for spec, part in parts:
            cfg = self.configs.get(spec.name)
            if cfg is None:
                raise KeyError(
                    f"no hybrid table {spec.name!r}; hybrid tables: {list(self.configs)}"
                )
            mine = cfg.to_spec()
            if spec != mine:
                raise ValueError(
                    f"hybrid table {spec.name!r}: the rows given are for {spec}, the table "
                    f"is {mine}"
                )
            part.check_spec(mine, "hybrid table rows")
            out.append((mine, part))
        return out

    def _save_to_state_dict(self, destination, prefix, keep_vars):  # type: ignore[no-untyped-def]
        """Per table ``<prefix><table>.ids [n]``, ``.weight [n, D]``, ``.state [n, S]``,
        ``.clocks [n]``: the rows the store holds (all of a fixed table, the live ones of
        a dynamic table), read through the store (:meth:`table_parts`): copies on the
        host. Loading them replaces the store's table (:meth:`load_parts`)."""
        if not self.state_dict_tables:
            return
        for spec, part in self.table_parts():
            destination[f"{prefix}{spec.name}.ids"] = part.ids
            destination[f"{prefix}{spec.name}.weight"] = part.weights
            destination[f"{prefix}{spec.name}.state"] = part.state
            destination[f"{prefix}{spec.name}.clocks"] = part.clocks

    def _load_from_state_dict(  # type: ignore[no-untyped-def]
        self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs
    ):
        if not self.state_dict_tables:
            return
        ours: set[str] = set()
        parts = []
        for name, cfg in self.configs.items():
            try:
                part = part_from_state_dict(state_dict, prefix, name, ours, missing_keys)
                if part is None:
                    continue
                parts.append(self._check_parts([(cfg.to_spec(), part)])[0])
            except (TypeError, ValueError) as e:
                error_msgs.append(f"hybrid table {name!r}: {e}")
        if strict:
            unexpected_keys.extend(k for k in state_dict if k.startswith(prefix) and k not in ours)
        if parts:
            self.load_parts(parts)

    def prefetch(self, kjt: KeyedJaggedIds, tables: list[tuple[TableConfig, list[str]]]) -> None:
        """Hand each table's unique ids to the store's ``prefetch_many`` (a cache: they
        ride on the next batched pull), or else its ``prefetch``; nothing without one,
        nor to a store whose ``prefetching`` is False (a cache in front of an in-process
        store: the batch's own forward checks its ids)."""
        if self.pipeline is not None and self.training and torch.is_grad_enabled():
            self._announced = (kjt, tables)  # pulled ahead once this batch's rows are taken
            return
        many = getattr(self.store, "prefetch_many", None)
        one = getattr(self.store, "prefetch", None)
        if many is None and one is None:
            return
        if not getattr(self.store, "prefetching", True):
            # A cache that fetches nothing ahead would only check the ids, which the
            # batch's own forward checks too; deduplicating 26 tables here for nothing
            # costs ~3 ms of a 60 ms DLRM step at two threads.
            return
        # The store reads host ids and the dedup runs there (no device work). The jobs
        # announce host batches (a hybrid batch stays on the host until the collection
        # moves it), so nothing crosses; a batch given on a device comes over once.
        ids = kjt.ids
        if not ids.is_cpu:
            (ids,) = boundary.to_host([ids])
        starts, key = kjt.key_starts(), {k: i for i, k in enumerate(kjt.keys)}
        requests = []
        for cfg, feats in tables:
            parts = [ids[starts[key[f]] : starts[key[f] + 1]] for f in feats]  # [N_f] each
            check_ids(cfg, feats, parts, on_host=True)
            requests.append(PullRequest(cfg.name, torch.unique(torch.cat(parts))))

        def announce() -> None:
            if many is not None:
                many(requests)
            elif one is not None:
                for r in requests:
                    one(r.table, r.ids)

        self.wait_push()
        self._store_call(announce)

    def forward(
        self, kjt: KeyedJaggedIds, tables: list[tuple[TableConfig, list[str]]]
    ) -> dict[str, torch.Tensor]:
        check_batch_ids(kjt, tables)  # one host sync on a GPU (bad ids raise here)
        for cfg, feats in tables:
            check_weights(cfg, feats, kjt.weights is not None)
        self.wait_push()  # the last step's push, applied meanwhile
        train = self.training and torch.is_grad_enabled()
        got = self._take_ahead(kjt, tables) if train and self.pipeline is not None else None
        if got is None:
            groups = self._dedup(kjt, tables)
            pulled = self._store_call(lambda: self._pull(groups))
        else:
            groups, pulled = got
        if train:
            self._pull_ahead(groups)  # the next batch's pull runs beside this dense step
        rows = _rows_to_device(pulled, self.device, self.store)  # per group [U, D]
        shapes = groups_feature_sizes(kjt, [g.features for g in groups])  # (seq, sizes)
        splits = [sizes for _, sizes in shapes]  # every group has features
        if train:
            parts = _HybridLookup.apply(self._anchor, self, groups, rows, splits)
        else:
            parts = tuple(
                p
                for g, r, sizes in zip(groups, rows, splits, strict=True)
                for p in lookup(r, g.batch).split(sizes)
            )
        out: dict[str, torch.Tensor] = {}
        start = 0
        for g, (seq, sizes) in zip(groups, shapes, strict=True):
            out.update(name_parts(parts[start : start + len(sizes)], kjt, g.features, seq))
            start += len(sizes)
        self.tie = parts[0].sum() if train and parts and not out else None
        return out

    def _pull(self, groups: list[_Group]) -> list[list[torch.Tensor]]:
        """Every table of every group in ONE batched pull (one message per server):
        per group, its rows ``[U, D]`` (a group of fixed tables asks by its packed keys,
        one group request) or its tables' rows ``[U_t, D]``."""
        requests: list[PullRequest | GroupPull] = []
        for g in groups:
            if g.space is not None:
                assert g.keys is not None
                requests.append(GroupPull(g.space, g.keys))
            else:
                ids = g.table_ids()
                requests += [PullRequest(c.name, u) for c, u in zip(g.tables, ids, strict=True)]
        results = iter(self.store.pull_groups_async(requests).wait())
        return [
            [next(results).rows] if g.space is not None else [next(results).rows for _ in g.tables]
            for g in groups
        ]

    def _dedup(self, kjt: KeyedJaggedIds, plan: Plan) -> list[_Group]:
        """Every dim group's dedup (:func:`_dedup_on_device`); the unique ids of every
        group come to the host, where the store takes them, in ONE copy (one read for
        every group and table, not one per group)."""
        staged = [_dedup_on_device(kjt, tabs) for tabs in _by_dim(plan)]
        host = iter(boundary.to_host([u for st in staged for u in st.uniques]))
        return [st.finish([next(host) for _ in st.uniques]) for st in staged]


@dataclass(slots=True)
class _Staged:
    """A group's dedup on the rows' device, before its unique ids come to the host."""

    features: list[tuple[TableConfig, str]]
    tables: list[TableConfig]
    batch: GroupBatch  # ids = index into the group's unique rows
    perm: torch.Tensor  # [N]
    counts: torch.Tensor  # [U]
    # Packed: one tensor, the unique keys [U] (table t's id i is key starts[t] + i);
    # else one per table, its unique ids [U_t].
    uniques: list[torch.Tensor]
    starts: list[int] | None  # packed: each table's base, then the sum of their rows

    def finish(self, host: list[torch.Tensor]) -> _Group:
        """The group, given :attr:`uniques` on the host (``host``, the same order)."""
        if self.starts is None:
            return _Group(self.features, self.tables, self.batch, self.perm, self.counts, host)
        (keys,) = host  # [U] sorted packed keys
        space = IdSpace(tuple(c.name for c in self.tables), np.array(self.starts, np.int64))
        return _Group(
            self.features, self.tables, self.batch, self.perm, self.counts, None, keys, space
        )


def _dedup_on_device(kjt: KeyedJaggedIds, tables: Plan) -> _Staged:
    """One sort for every table of the group: ids are keyed ``(table, id)``.

    Fixed-size tables are packed into one id space (table ``t`` at base
    ``sum of the earlier tables' rows``), so a single sort orders the ids by table,
    then id; a group with a dynamic table (any int64 id) sorts table by table.
    Everything here stays where the batch is; :meth:`_Staged.finish` takes the unique
    ids on the host.
    """
    feats = [(cfg, f) for cfg, fs in tables for f in fs]
    cfgs = [cfg for cfg, _ in tables]
    packed = all(c.num_rows is not None for c in cfgs)
    starts, base = [], 0
    for c in cfgs:
        starts.append(base)
        base += int(c.num_rows or 0)
    table_base = {c.name: b for c, b in zip(cfgs, starts, strict=True)}
    bases = [table_base[c.name] for c, _ in feats] if packed else [0] * len(feats)
    gb = group_batch(kjt, feats, bases)  # ids: packed keys (or raw ids) [N]
    if packed:
        perm, keys, counts, index = cpu_kernel.dedup_ids(gb.ids)  # [N], [U], [U], [N]
        uniques = [keys]
    else:
        per_table = [sum(kjt.key_slice(f).ids.numel() for f in fs) for _, fs in tables]
        perms, all_counts, uniques, indices = [], [], [], []
        pos = rows = 0
        for n in per_table:  # table by table: positions and unique rows offset
            p, u, cnt, i = cpu_kernel.dedup_ids(gb.ids[pos : pos + n])
            perms.append(p + pos)
            all_counts.append(cnt)
            uniques.append(u)
            indices.append(i + rows)
            pos, rows = pos + n, rows + int(u.numel())
        perm, counts, index = torch.cat(perms), torch.cat(all_counts), torch.cat(indices)
    batch = GroupBatch(index, gb.offsets, gb.weights)
    return _Staged(feats, cfgs, batch, perm, counts, uniques, [*starts, base] if packed else None)


class _HybridLookup(torch.autograd.Function):
    """The lookups of every dim group in one autograd node; the backward pushes.

    One node for the module (not a hook per table) means the row gradients of all
    tables are ready at once, so the pushes go out in table order: replicated data
    parallel ranks then enter the same ``allgatherv`` sequence.
    """

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: torch.autograd.function.FunctionCtx,
        anchor: torch.Tensor,
        owner: HybridTables,
        groups: list[_Group],
        rows: list[torch.Tensor],
        splits: list[list[int]],
    ) -> tuple[torch.Tensor, ...]:
        """Each group's lookup, split by ``splits`` (rows per feature): one output per
        feature, so the backward reads their gradients in place (see
        :class:`embedding.fused_ops.FusedLookupFunction`)."""
        ctx.owner = owner  # type: ignore[attr-defined]
        ctx.groups = groups  # type: ignore[attr-defined]
        ctx.splits = splits  # type: ignore[attr-defined]
        ctx.set_materialize_grads(False)  # an unused output pushes nothing
        parts: list[torch.Tensor] = []
        for g, r, sizes in zip(groups, rows, splits, strict=True):
            parts.extend(lookup(r, g.batch).split(sizes))
        if not parts:  # no table in this batch: one empty output to tie the node to
            parts.append(anchor.new_zeros(0))
        return tuple(parts)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(  # type: ignore[override]
        ctx: torch.autograd.function.FunctionCtx, *grad_parts: torch.Tensor | None
    ) -> tuple[None, ...]:
        owner: HybridTables = ctx.owner  # type: ignore[attr-defined]
        groups: list[_Group] = ctx.groups  # type: ignore[attr-defined]
        splits: list[list[int]] = ctx.splits  # type: ignore[attr-defined]
        used: list[tuple[_Group, torch.Tensor]] = []
        start = 0
        for g, sizes in zip(groups, splits, strict=True):
            given = grad_parts[start : start + len(sizes)]
            start += len(sizes)
            if all(p is None for p in given):
                continue  # no output of the group was used: nothing to push
            used.append((g, _row_gradients(g, given, sizes)))  # [U, D] on the device
        # The same [U, D] where the store takes them: a cache with rows on this device
        # takes them as they are, any other store on the host.
        host = _sums_to_store([s for _, s in used], owner.store)
        _push(owner, list(zip([g for g, _ in used], host, strict=True)))
        return None, None, None, None, None


def _by_dim(tables: Plan) -> list[Plan]:
    """The batch's tables grouped by ``dim`` (one lookup per group), in order."""
    by_dim: dict[int, Plan] = {}
    for cfg, feats in tables:
        by_dim.setdefault(cfg.dim, []).append((cfg, feats))
    return list(by_dim.values())


def _row_gradients(
    g: _Group, given: Sequence[torch.Tensor | None], sizes: Sequence[int]
) -> torch.Tensor:
    """The group's row gradients float32 ``[U, D]`` (CPU) from its per-feature output
    gradients ``given`` (None: unused, zero): the C kernel reads them in place; else
    one concatenation and one ``embedding_bag`` over the dedup's runs."""
    b = g.batch
    d = g.tables[0].dim
    ref = next(p for p in given if p is not None)
    parts = [
        p if p is not None else ref.new_zeros(1, d).expand(n, d)
        for p, n in zip(given, sizes, strict=True)
    ]  # [n_f, D] each
    if ref.is_cpu:
        sums = cpu_kernel.segment_sum_parts(
            g.perm, g.counts, b.kernel_offsets(), kernel_parts(parts), d, b.kernel_weights()
        )
        if sums is not None:
            return sums
    grad = torch.cat(parts).contiguous()  # [nbags, D]
    bag_of = torch.repeat_interleave(
        torch.arange(b.num_bags, device=grad.device),
        b.offsets[1:] - b.offsets[:-1],
        output_size=b.ids.numel(),
    )  # [N]
    return sorted_segment_sum(g.perm, g.counts, grad, bag_of, b.weights).to(torch.float32)


def device_rows(store: Store) -> bool:
    """Whether ``store`` serves rows and takes gradients in a device's memory (a cache
    given a device, ``cuda`` or ``cpu``) rather than as host tensors."""
    return isinstance(getattr(store, "device", None), torch.device)


def _rows_to_device(
    pulled: list[list[torch.Tensor]], device: torch.device, store: Store
) -> list[torch.Tensor]:
    """Per group, its tables' pulled rows ``[U_t, D]`` as one ``[U, D]`` on ``device``.

    A store serving device rows (a cache on this device) has them there: one
    concatenation per group with more than one table. Host rows cross in ONE
    non-blocking host-to-device copy (:func:`comm.boundary.to_device`); a group's
    tables are then adjacent in it, and the group is a view of them."""
    if device_rows(store):
        return [
            (p[0] if len(p) == 1 else torch.cat(p)).to(device) for p in pulled
        ]  # on the cache's device already: .to() returns them
    flat = iter(boundary.to_device([r for p in pulled for r in p], device))
    return [boundary.joined([next(flat) for _ in p]) for p in pulled]


def _sums_to_store(sums: list[torch.Tensor], store: Store) -> list[torch.Tensor]:
    """The groups' row gradients ``[U, D]`` where ``store`` takes them: as they are for
    a store taking device rows; else on the host, every group's in ONE device-to-host
    copy (:func:`comm.boundary.to_host`), which waits for the backward kernels (the
    push needs the values: a host sync per step on a GPU)."""
    if not sums or device_rows(store):
        return sums
    return boundary.to_host(sums)


def _push(owner: HybridTables, sums: list[tuple[_Group, torch.Tensor]]) -> None:
    """Push every group's row gradients (``sums``: per group its ``[U, D]``, where the
    store takes them, rows in the order of its tables' unique ids).

    Shared store (or one rank): each rank pushes its own gradients divided by the
    group size. Replicated store: every table of the module (empty where this rank's
    batch lacked it) is gathered from all ranks, averaged and pushed, so every
    replica applies the identical update.

    With the sparse pipeline the push runs on its thread, then pulls the rows it changed
    that the batch pulled ahead uses again into that batch's rows (which waits for that).
    """
    pipeline, ahead = owner.pipeline, owner._ahead
    if pipeline is None:
        _push_now(owner, sums)
        return
    if ahead is None:  # on the pipeline's thread; its error is raised later
        pipeline.submit_owed(lambda: _push_now(owner, sums))
        return

    def push_then_pull_again() -> None:
        _push_now(owner, sums)  # a bad gradient fails it before anything is applied
        got = ahead.future.result()  # done: it ran before this job
        if got is None:
            return
        groups, pulled, overlap = got
        pushed = [g for g, _ in sums]  # the groups of unused outputs pushed nothing
        if [id(g) for g in pushed] != [id(g) for g in ahead.before]:
            overlap = _used_by(pushed, groups)  # found for other groups (a second backward)
        if overlap.ids:
            _pull_again(owner, pulled, overlap)

    ahead.fixes.append(pipeline.submit(push_then_pull_again))


def _used_by(pushed: list[_Group], ahead: list[_Group]) -> _Overlap:
    """The rows of the groups ``pushed`` (their unique ids: what their push sends) that
    the batch of the groups ``ahead`` uses, and where they sit in that batch's rows.

    A pushed group of fixed tables that the ahead batch has with the same tables is
    matched with one ``searchsorted`` over the packed keys (its tables' ids are views);
    any other table with ``isin``."""
    by_tables = {tuple(c.name for c in g.tables): k for k, g in enumerate(ahead)}
    used: dict[str, torch.Tensor] = {}
    places: list[tuple[int, torch.Tensor]] = []
    for gp in pushed:
        k = by_tables.get(tuple(c.name for c in gp.tables))
        ga = ahead[k] if k is not None else None
        if ga is not None and gp.space is not None and ga.space is not None:
            # the same tables in the same order: the same id space
            assert gp.keys is not None and ga.keys is not None and k is not None
            ka, kp = ga.keys, gp.keys  # [U_a], [U_p] packed, sorted
            if ka.numel() == 0:
                continue
            pos = torch.searchsorted(ka, kp).clamp_(max=ka.numel() - 1)  # [U_p]
            hit = torch.nonzero(ka[pos] == kp).squeeze(1)  # [K] pushed rows the batch uses
            keys, at = kp[hit], pos[hit]  # [K] each
            bases = gp.space.bases  # [k + 1], the last above every key
            cut = torch.searchsorted(keys, torch.from_numpy(bases)).tolist()
            for t, cfg in enumerate(gp.tables):
                if cut[t + 1] > cut[t]:
                    used[cfg.name] = keys[cut[t] : cut[t + 1]] - int(bases[t])
                    places.append((k, at[cut[t] : cut[t + 1]]))
            continue
        for cfg, ids in zip(gp.tables, gp.table_ids(), strict=True):  # table by table
            where = next(
                (
                    (k, t)
                    for k, g in enumerate(ahead)
                    for t, c in enumerate(g.tables)
                    if c.name == cfg.name
                ),
                None,
            )
            if where is None or ids.numel() == 0:
                continue
            k, t = where
            mine = ahead[k].table_ids()[t]  # [U_t] sorted
            mask = torch.isin(ids, mine)
            if bool(mask.any()):
                used[cfg.name] = ids[mask]
                offset = sum(int(u.numel()) for u in ahead[k].table_ids()[:t])
                places.append((k, offset + torch.searchsorted(mine, ids[mask])))
    return _Overlap(used, places)


def _pull_again(owner: HybridTables, pulled: list[list[torch.Tensor]], rows: _Overlap) -> None:
    """Pull ``rows`` again into the rows pulled ahead (``pulled``: per group ONE
    ``[U, D]``), in place."""
    fresh = owner.store.pull_many([PullRequest(name, ids) for name, ids in rows.ids.items()])
    targets = [pulled[k][0] for k, _ in rows.places]  # [U, D] of each place's group
    if not targets:
        return
    # The positions (host) where the rows are (a cache's device): one copy for all.
    places = boundary.to_device([pos for _, pos in rows.places], targets[0].device)
    for target, pos, got in zip(targets, places, fresh, strict=True):
        target[pos] = got.rows.to(target.device)  # the store serves them there: no copy


def _by_table(g: _Group, rows: torch.Tensor) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Group ``g``'s ``[U, D]`` row gradients ``rows`` cut by table:
    ``{table: (its unique ids [U_t], its rows [U_t, D])}``."""
    out, at = {}, 0
    for cfg, ids in zip(g.tables, g.table_ids(), strict=True):
        n = int(ids.numel())
        out[cfg.name] = (ids, rows[at : at + n])
        at += n
    return out


def _push_now(owner: HybridTables, sums: list[tuple[_Group, torch.Tensor]]) -> None:
    """:func:`_push`'s store calls (on the pipeline's thread when there is one)."""
    group, store = owner.group, owner.store
    if group.size == 1 or owner.store_is_shared:
        scale = 1.0 / group.size
        requests: list[PushRequest | GroupPush] = []
        for g, rows in sums:
            rows = rows.contiguous() if scale == 1.0 else rows * scale  # [U, D]
            if g.space is not None and rows.is_cpu:  # one group push over the packed keys
                assert g.keys is not None
                requests.append(GroupPush(g.space, g.keys, rows))
            else:
                requests += [PushRequest(n, i, r) for n, (i, r) in _by_table(g, rows).items()]
        handle = store.push_groups_async(requests)  # one batched push: one message per server
        if group.size == 1 and owner.pipeline is None:
            owner.wait_push()  # (a second backward before the next forward)
            owner._push_in_flight = handle  # waited for at this rank's next store call
        else:
            handle.wait()  # the other ranks' next pulls must see it (or the pipeline's)
        return
    grads = {n: part for g, rows in sums for n, part in _by_table(g, rows).items()}
    gathered = []
    for name, cfg in owner.configs.items():
        if name in grads:
            ids, part = grads[name]
            ids, part = ids.contiguous(), part.contiguous()
        else:
            ids = torch.empty(0, dtype=torch.int64)
            part = torch.empty(0, cfg.dim, dtype=torch.float32)
        all_ids = group.allgatherv(ids)  # [sum U_r]
        all_grads = group.allgatherv(part)  # [sum U_r, D]
        all_grads.div_(group.size)
        gathered.append(PushRequest(name, all_ids, all_grads))
    store.push_many(gathered)
