"""Model-parallel embedding tables: each rank owns some tables or row ranges.

No parameter server: the rows of every table live on the ranks of ``group``,
placed by a :class:`~embedding.sharding_plan.ShardingPlan` (whole tables, or
row ranges of large ones). One forward on every rank, with its own local batch:

1. **dedup**: per table, the unique ids of all its features in the local batch;
2. **input dist** (alltoallv): each unique id goes to the rank owning its row
   (as a row number local to that owner), preceded by a tiny alltoall of the
   ``[W, T]`` counts and an error flag (so bad input raises on every rank);
3. **lookup**: owners gather the requested rows of their shards;
4. **output dist** (alltoallv): the rows come back, one per unique id;
5. **pool**: the requesting rank pools its bags locally with ``embedding_bag``
   over the returned unique rows (weighted sum, mean, empty bags = zeros), or
   keeps one vector per id for ``pooling="none"``.

This is the row-exchange variant of TorchRec's sharded EmbeddingBagCollection:
TorchRec ships whole bags and pools on the owner; shipping deduplicated rows
sends each id once per rank and step, which is cheaper under skewed (Zipf) ids,
and keeps weighted/mean pooling on the requesting rank.

Backward runs the same path in reverse inside ``loss.backward()``: the
gradient of the returned unique rows ``[U_t, D]`` (already summed over bags by
``embedding_bag``'s backward) goes back to the owners by one alltoallv; each
owner sums the gradients of a row sent by several ranks and applies the table's
``ps`` optimizer (SGD, RowWiseAdagrad, Adagrad, Adam, FTRL: exactly the math of
:class:`ps.InProcessStore`, through :class:`ps.local.table.LocalTable`) once per
unique row. There is no embedding ``nn.Parameter`` and no optimizer step.

**Gradient scale** (the DDP convention): the row gradients are divided by
``group.size``. When every rank takes ``B`` samples of a global batch of
``W * B`` and computes a *mean* loss over its own samples, the update equals
one process training on the global batch with the global mean loss.

**Collective rule**: every rank must call ``forward`` the same number of times
and run one backward through the outputs of each training forward (as DDP
requires); a rank whose local batch is empty still takes part (empty splits).

**Rows of fp16 or bf16** (``TableConfig.dtype``): the shards store them narrow, and
the output dist moves them in their stored type (2 bytes per element instead of 4;
exact, since that is what is stored), widened to float32 where they arrive, before
pooling, which accumulates in float32. Their gradients travel back in float32 (not
rounded to the narrow type on the way): the owner sums them and runs the optimizer in
float32 on float32 copies of its rows, as one process holding the whole table would
(:class:`ps.local.table.LocalTable`), then stores the result stochastically rounded
(:mod:`ps.rounding`) keyed by the *table's* row id and the row's clock, never by a
shard's local row. So a row fed the same summed gradient ends with the same bits at
any number of ranks and in one process; the float32 sums themselves may differ in
their last bit between layouts (partial sums per rank), as for float32 tables.

Initial rows are the ps initializer's values for the *global* row ids
(:meth:`ps.TableSpec.initial_rows` is a hash of ``(seed, id, column)``), so a
sharded table starts exactly like the same unsharded table.

Device: the shards (weights, optimizer state, clocks: registered buffers, so
``module.to(device)`` moves them) live on the module's device, and so do the
ids and rows handed to the alltoallv (a group on nccl moves them as they are;
gloo and MPI groups stage device tensors through host memory). The ``[W, T]``
counts travel on the host: every split size is a Python int anyway. On the host
the owner's optimizer runs in :class:`ps.local.table.LocalTable` (the store's
engine, over the same tensors); on a device in the fused local path's torch code
(:func:`embedding.fused_ops.apply_optimizer`), the same math.

State dict, per table: ``<table>.ids`` (the global row ids of this rank's
shard), ``.weight`` (in the table's row type), ``.state``, ``.clocks``; loading
copies the rows whose ids fall in this rank's range, so it does not depend on the
sharding. Checkpoints hold float32 rows (narrow ones widen exactly) and the spec
records the row type; loading converts rows to the table's type (float32 rows into a
narrow table round to the nearest).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from comm import ProcessGroup, boundary
from comm.device import module_device
from embedding.checkpoint_io import write_from_rank0
from embedding.checks import (
    check_weights,
    features_by_table,
    first_out_of_range,
    sequence_lengths,
    table_of_features,
)
from embedding.config import TableConfig
from embedding.fused_ops import FusedGroup, apply_optimizer, segment_sum
from embedding.jagged import KeyedJaggedIds, offsets_from_lengths
from embedding.jagged_dist import (
    as_wire,
    bucketize,
    dedup,
    float_splits,
    pack_rows,
    split_ids,
    unpack_rows,
    widen_rows,
    wire_dtype,
    wire_widths,
)
from embedding.sharding_plan import DEFAULT_ROW_WISE_THRESHOLD_ROWS, ShardingPlan
from embedding.table_state import (
    apply_keep_dtype,
    part_from_state_dict,
    target_device,
    warn_converted,
)
from ps.checkpoint import TablePart, read_checkpoint
from ps.local.table import LocalTable, take, widened
from ps.rounding import round_to
from ps.table import TORCH_ROW_DTYPES, TableSpec

_INIT_CHUNK_ROWS = 1 << 16

# Error codes carried by the count exchange (column T of each row).
_OK, _BAD_ID, _BAD_BATCH = 0, 1, 2


@dataclass(slots=True)
class _TableBatch:
    """One table's share of this rank's local batch."""

    index: int  # position of the table in the plan
    features: list[str]  # its features in the batch, in key order
    inverse: torch.Tensor  # [N] position of each id in ``unique``
    unique: torch.Tensor  # [U] int64
    lengths: torch.Tensor  # [F * B]
    weights: torch.Tensor | None  # [N] or None
    seq: list[int]  # per feature: ids per sample of pooling "none" (-1 for pooled ones)


@dataclass(slots=True)
class _Exchange:
    """What one forward's backward needs: who asked for which rows."""

    send_counts: torch.Tensor  # [W, T] what this rank asked of each owner
    recv_counts: torch.Tensor  # [W, T] what each rank asked of this one
    served: list[torch.Tensor | None]  # per table, [n_t] local rows asked of this rank


class ShardedTables(nn.Module):
    """Tables sharded over ``group`` by a plan; ``forward(kjt)`` pools this rank's batch.

    ``forward(kjt)`` returns ``{feature: [B_local, dim]}`` (``[B_local, T, dim]``
    for ``pooling="none"``) in the order of ``kjt.keys``; every key must be a
    feature of one of ``configs``. ``plan`` defaults to
    ``ShardingPlan.build(configs, group.size, row_wise_threshold_rows=...)``;
    all ranks must build the same one (checked at construction).
    """

    def __init__(
        self,
        configs: Sequence[TableConfig],
        group: ProcessGroup,
        *,
        plan: ShardingPlan | None = None,
        row_wise_threshold_rows: int | None = DEFAULT_ROW_WISE_THRESHOLD_ROWS,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        configs = list(configs)
        if not configs:
            raise ValueError("ShardedTables: needs at least one TableConfig")
        if not isinstance(group, ProcessGroup):
            raise TypeError(f"ShardedTables: group must be a comm.ProcessGroup, got {group!r}")
        self._configs: list[TableConfig] = []
        for cfg in configs:
            if not isinstance(cfg, TableConfig):
                raise TypeError(f"ShardedTables: expected TableConfig, got {type(cfg).__name__}")
            if any(c.name == cfg.name for c in self._configs):
                raise ValueError(f"ShardedTables: table name {cfg.name!r} appears twice")
            self._configs.append(cfg)
        # feature -> table index
        self._table_of: dict[str, int] = table_of_features(self._configs, "ShardedTables")
        self._features = list(self._table_of)  # error codes name features by this index
        self.group = group
        if plan is None:
            plan = ShardingPlan.build(
                configs, group.size, row_wise_threshold_rows=row_wise_threshold_rows
            )
        self.plan = plan
        self._check_plan()
        self._dims = torch.tensor([c.dim for c in self._configs], dtype=torch.int64)  # [T]
        # Rows travel in their stored type: [T] row types, the exchange's element type
        # and its elements per row (jagged_dist's module doc).
        self._row_dtypes = [TORCH_ROW_DTYPES[c.dtype] for c in self._configs]
        self._wire = wire_dtype(self._row_dtypes)
        self._wire_dims = wire_widths(self._dims, self._row_dtypes, self._wire)  # [T]
        dev = module_device(group, device)
        # The leaf the row exchange hangs off, so autograd calls its backward.
        self._anchor = torch.empty(0, requires_grad=True, device=dev)
        self._shards: list[LocalTable | None] = [
            self._make_shard(i, cfg, dev) for i, cfg in enumerate(self._configs)
        ]
        self.tie: torch.Tensor | None = None  # see forward
        self.state_dict_tables = True  # False: state_dict() leaves the tables out

    @property
    def device(self) -> torch.device:
        return self._anchor.device

    def _rows(self, i: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """``(weights [n, D], state [n, S], clocks [n])`` of table ``i``'s shard here, or
        None where this rank holds none of its rows."""
        w = self._buffers.get(f"shard{i}_weight")
        if w is None:
            return None
        s, c = self._buffers[f"shard{i}_state"], self._buffers[f"shard{i}_clocks"]
        assert s is not None and c is not None
        return w, s, c

    def _shard_spec(self, cfg: TableConfig) -> TableSpec:
        start, stop = self.plan.table(cfg.name).rows_on(self.group.rank)
        full = cfg.to_spec()  # its init is resolved: the same on every rank
        return TableSpec(
            name=cfg.name, num_rows=stop - start, dim=cfg.dim, optimizer=cfg.optimizer,
            init=full.init, dtype=cfg.dtype,
        )  # fmt: skip

    def _shard_table(self, cfg: TableConfig) -> LocalTable:
        """An uninitialised LocalTable for this rank's rows of ``cfg``. Stochastic
        rounding is keyed by table ids, so every sharding rounds alike: shard row ``i``
        is id ``start + i``, which a narrow shard past the table's first row is told
        (``[n]`` int64; elsewhere row ``i`` is id ``i``, LocalTable's default)."""
        start, stop = self.plan.table(cfg.name).rows_on(self.group.rank)
        table = LocalTable(self._shard_spec(cfg), initialise=False)
        if table.spec.narrow and start > 0:
            table.row_table_ids = torch.arange(start, stop, dtype=torch.int64)  # [n]
        return table

    def _bind_shards(self) -> None:
        """On the host, each shard's :class:`ps.local.table.LocalTable` (its push runs
        the optimizer) holds the shard's buffers; rebound after ``.to()`` moved them."""
        old = self._shards or [None] * len(self._configs)
        self._shards = []
        for i, cfg in enumerate(self._configs):
            rows = self._rows(i)
            if rows is None or rows[0].device.type != "cpu":
                self._shards.append(None)
                continue
            table = old[i] or self._shard_table(cfg)
            table.weights, table.state, table.clocks = rows
            self._shards.append(table)

    def _apply(self, fn, recurse=True):  # type: ignore[no-untyped-def]
        """``.to(device)``: the shards move (dtype kept, see :mod:`embedding.table_state`)."""
        for key, buf in list(self._buffers.items()):
            if buf is not None:
                self._buffers[key] = apply_keep_dtype(fn, buf)
        self._anchor = torch.empty(0, requires_grad=True, device=target_device(fn, self._anchor))
        self._bind_shards()
        return self

    # ------------------------------------------------------------ setup

    def _check_plan(self) -> None:
        plan, group = self.plan, self.group
        if not isinstance(plan, ShardingPlan):
            raise TypeError(f"ShardedTables: plan must be a ShardingPlan, got {plan!r}")
        if plan.world_size != group.size:
            raise ValueError(
                f"ShardedTables: the plan is for {plan.world_size} ranks, the group has "
                f"{group.size}"
            )
        names = [c.name for c in self._configs]
        if plan.table_names != names:
            raise ValueError(
                f"ShardedTables: the plan covers tables {plan.table_names}, the configs are "
                f"{names} (same tables in the same order expected)"
            )
        for cfg in self._configs:
            t = plan.table(cfg.name)
            if (t.num_rows, t.dim) != (cfg.num_rows, cfg.dim):
                raise ValueError(
                    f"ShardedTables: table {cfg.name!r} is {cfg.num_rows}x{cfg.dim} but the "
                    f"plan has {t.num_rows}x{t.dim}"
                )
        if group.size > 1:
            mine = torch.tensor(plan.fingerprint(), dtype=torch.int64)
            everyone = group.allgather(mine)  # [W, 3]
            differ = [r for r in range(group.size) if not torch.equal(everyone[r], mine)]
            if differ:
                raise ValueError(
                    f"ShardedTables: rank {group.rank} built a different sharding plan than "
                    f"ranks {differ} (same configs and threshold on every rank needed); this "
                    f"rank's plan:\n{plan.describe()}"
                )

    def _make_shard(self, i: int, cfg: TableConfig, device: torch.device) -> LocalTable | None:
        """Table ``i``'s rows on this rank as buffers ``shard{i}_weight`` ``[n, D]``,
        ``shard{i}_state`` ``[n, S]``, ``shard{i}_clocks`` ``[n]`` (none without rows).
        On the host they are a LocalTable's storage (numpy, huge pages, as a store's),
        which is returned; on a device they are allocated there (None returned)."""
        start, stop = self.plan.table(cfg.name).rows_on(self.group.rank)
        if stop == start:
            return None
        full = cfg.to_spec()
        table = None
        if device.type == "cpu":
            table = self._shard_table(cfg)
            weights, state, clocks = table.weights, table.state, table.clocks
        else:
            n, s = stop - start, full.state_dim
            weights = torch.zeros(n, cfg.dim, dtype=full.torch_dtype, device=device)
            state = full.initial_state().to(device).expand(n, s).contiguous()
            clocks = torch.zeros(n, dtype=torch.int64, device=device)
        # Hashed on the shard's device; narrow rows round to the nearest, as a store's.
        for lo in range(start, stop, _INIT_CHUNK_ROWS):
            hi = min(stop, lo + _INIT_CHUNK_ROWS)
            weights[lo - start : hi - start] = full.initial_rows(
                torch.arange(lo, hi, device=device)
            )
        self.register_buffer(f"shard{i}_weight", weights)
        self.register_buffer(f"shard{i}_state", state)
        self.register_buffer(f"shard{i}_clocks", clocks)
        return table

    # ------------------------------------------------------------ accessors

    @property
    def tables(self) -> list[TableConfig]:
        return list(self._configs)

    @property
    def feature_names(self) -> list[str]:
        return list(self._features)

    def shard(self, table: str) -> tuple[int, int, torch.Tensor]:
        """``(start, stop, weights [stop - start, D])`` of this rank's rows of ``table``
        (the shard's storage, in the table's row type)."""
        i = self._index(table)
        start, stop = self.plan.table(table).rows_on(self.group.rank)
        mine = self._rows(i)
        rows = mine[0] if mine is not None else self._no_rows(i)
        return start, stop, rows

    def _no_rows(self, i: int) -> torch.Tensor:
        """Weights ``[0, D]`` of table ``i`` in its row type, where this rank holds none."""
        return torch.empty(0, self._configs[i].dim, dtype=self._row_dtypes[i], device=self.device)

    def full_table(self, table: str) -> torch.Tensor:
        """Collective: the whole table ``[num_rows, D]`` float32 on every rank (for tests,
        export; narrow rows travel narrow and widen exactly)."""
        return widened(self._gather(table, "weights"))

    def full_state(self, table: str) -> torch.Tensor:
        """Collective: the optimizer state ``[num_rows, S]`` on every rank."""
        return self._gather(table, "state")

    def full_clocks(self, table: str) -> torch.Tensor:
        """Collective: updates applied per row ``[num_rows]`` int64."""
        return self._gather(table, "clocks")

    def _gather(self, table: str, what: str) -> torch.Tensor:
        i = self._index(table)
        cfg, mine = self._configs[i], self._rows(i)
        if mine is not None:
            part = mine[("weights", "state", "clocks").index(what)].clone()
        elif what == "clocks":
            part = torch.empty(0, dtype=torch.int64, device=self.device)
        elif what == "weights":
            part = self._no_rows(i)  # the type the owners send
        else:
            width = cfg.optimizer.state_dim(cfg.dim)
            part = torch.empty(0, width, dtype=torch.float32, device=self.device)
        # Ranges run in rank order, so the rank-ordered concatenation is the table.
        return self.group.allgatherv(part.contiguous())

    # ------------------------------------------------------------ checkpoints

    def checkpoint_parts(self) -> list[tuple[TableSpec, TablePart]]:
        """Collective: every table gathered whole (rows, optimizer state, clocks; ``[num_rows,
        D]`` on every rank), as ``(spec, part)`` for :func:`ps.checkpoint.write_checkpoint`.

        Whole tables keep the checkpoint independent of the sharding: it loads into any
        number of ranks, any plan, a local collection or a store."""
        out = []
        for cfg in self._configs:
            assert cfg.num_rows is not None
            part = TablePart(
                ids=torch.arange(cfg.num_rows, dtype=torch.int64),
                weights=self.full_table(cfg.name).cpu(),
                state=self.full_state(cfg.name).cpu(),
                clocks=self.full_clocks(cfg.name).cpu(),
            )
            out.append((cfg.to_spec(), part))
        return out

    def save(self, path: str | os.PathLike[str]) -> None:
        """Collective: write every table whole to the ps checkpoint folder ``path``
        (rank 0 writes; every rank returns once it is complete)."""
        write_from_rank0(self.group, path, self.checkpoint_parts(), "embedding.ShardedTables")

    @torch.no_grad()
    def load(self, path: str | os.PathLike[str]) -> None:
        """Copy this rank's rows of every table (weights, optimizer state, clocks) from
        the ps checkpoint at ``path`` (whole tables, e.g. from :meth:`save`, any store's
        ``save`` or a local collection's). Every table must be in it with the same
        rows, dim and optimizer; everything is checked before any row changes. A table
        saved with another row type (``dtype``) is converted to this one's (rounded to
        the nearest where narrower), with one warning naming every such table."""
        ckpt = read_checkpoint(path)
        converted: dict[str, tuple[torch.dtype, torch.dtype]] = {}  # table -> (from, to)
        for cfg in self._configs:
            spec = cfg.to_spec()
            ckpt.expect(spec)
            saved = ckpt.spec(cfg.name)
            if saved.dtype != spec.dtype:
                converted[cfg.name] = (saved.torch_dtype, spec.torch_dtype)
        if converted:
            warn_converted(converted, f"checkpoint {str(path)!r}")
        for i, cfg in enumerate(self._configs):
            if self._rows(i) is not None:
                self._copy_rows(i, ckpt.read_table(cfg.name))

    def _copy_rows(self, i: int, part: TablePart) -> None:
        """Copy the rows of ``part`` (global ids) that fall in this rank's shard of table
        ``i``; the others are not this rank's, and rows ``part`` lacks stay."""
        rows = self._rows(i)
        if rows is None:
            return
        weights, state, clocks = rows
        start, stop = self.plan.table(self._configs[i].name).rows_on(self.group.rank)
        mine = (part.ids >= start) & (part.ids < stop)
        at = (part.ids[mine] - start).to(weights.device)
        # float32 rows into the table's type: narrow rows saved widened come back exactly.
        weights[at] = part.weights[mine].to(weights.device, weights.dtype)
        if state.shape[1] > 0:
            state[at] = part.state[mine].to(state.device)
        clocks[at] = part.clocks[mine].to(clocks.device)

    # ------------------------------------------------------------ state dict

    def _save_to_state_dict(self, destination, prefix, keep_vars):  # type: ignore[no-untyped-def]
        """Per table ``<prefix><table>.ids`` int64 ``[n]`` (global row ids of this rank's
        shard; ``[0]`` where it holds none), ``.weight [n, D]``, ``.state [n, S]``,
        ``.clocks [n]`` (the shard's buffers)."""
        if not self.state_dict_tables:
            return
        for i, cfg in enumerate(self._configs):
            start, stop = self.plan.table(cfg.name).rows_on(self.group.rank)
            rows = self._rows(i)
            if rows is None:
                s = cfg.optimizer.state_dim(cfg.dim)
                rows = (
                    self._no_rows(i),
                    torch.empty(0, s, device=self.device),
                    torch.empty(0, dtype=torch.int64, device=self.device),
                )
            destination[f"{prefix}{cfg.name}.ids"] = torch.arange(start, stop, dtype=torch.int64)
            for what, t in zip(("weight", "state", "clocks"), rows, strict=True):
                destination[f"{prefix}{cfg.name}.{what}"] = t if keep_vars else t.detach()

    def _load_from_state_dict(  # type: ignore[no-untyped-def]
        self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs
    ):
        """Rows by global id: any sharding's dict (this rank copies the rows it owns);
        rows of another type are converted (one warning names those tables)."""
        if not self.state_dict_tables:
            return
        ours: set[str] = set()
        converted: dict[str, tuple[torch.dtype, torch.dtype]] = {}  # table -> (from, to)
        for i, cfg in enumerate(self._configs):
            try:
                part = part_from_state_dict(state_dict, prefix, cfg.name, ours, missing_keys)
                if part is None:
                    continue
                part.check_spec(cfg.to_spec(), "state dict")
            except (TypeError, ValueError) as e:
                error_msgs.append(f"sharded table {cfg.name!r}: {e}")
                continue
            saved = state_dict[f"{prefix}{cfg.name}.weight"].dtype  # a tensor: checked above
            if saved != self._row_dtypes[i]:
                converted[cfg.name] = (saved, self._row_dtypes[i])
            with torch.no_grad():
                self._copy_rows(i, part)
        if converted:
            warn_converted(converted, f"the state dict ({prefix or 'top level'})")
        if strict:
            unexpected_keys.extend(k for k in state_dict if k.startswith(prefix) and k not in ours)

    def _index(self, table: str) -> int:
        for i, c in enumerate(self._configs):
            if c.name == table:
                return i
        raise KeyError(
            f"ShardedTables: no table {table!r}; tables: {[c.name for c in self._configs]}"
        )

    def extra_repr(self) -> str:
        parts = [
            f"{c.name}: {c.num_rows}x{c.dim} {c.pooling} {c.feature_names}" for c in self._configs
        ]
        return f"tables=[{'; '.join(parts)}], group={self.group!r}"

    # ------------------------------------------------------------ forward

    def forward(self, kjt: KeyedJaggedIds) -> dict[str, torch.Tensor]:
        group, w, t_count = self.group, self.group.size, len(self._configs)
        error: Exception | None = None
        code = [_OK, 0, 0]
        batches: list[_TableBatch] = []
        try:
            batches, code = self._prepare(kjt)
        except (ValueError, TypeError, KeyError) as e:
            error, code = e, [_BAD_BATCH, 0, 0]
        dev = self.device
        uniques = [torch.empty(0, dtype=torch.int64, device=dev) for _ in self._configs]
        for tb in batches:
            uniques[tb.index] = tb.unique  # [U_t] each
        buckets = bucketize(self.plan, [c.name for c in self._configs], uniques)
        # [W, T]: what this rank asks of each owner. Every split below is a Python int,
        # so the counts travel on the host (a host sync on a GPU: the device-to-host copy).
        (counts,) = boundary.to_host([buckets.counts])
        # 1) counts + error flag: row p goes to rank p; every rank learns every error.
        head = torch.cat([counts, torch.tensor([code] * w, dtype=torch.int64)], dim=1)
        # [W, T + 3], on the host (a group that moves device tensors, nccl, answers there)
        (got,) = boundary.to_host([group.alltoallv(head.contiguous(), [1] * w, [1] * w)])
        self._raise_if_bad(got[:, t_count:], error)
        recv_counts = got[:, :t_count].contiguous()  # [W, T]: what each rank asks of me
        # 2) unique ids to their owners (as owner-local rows), device tensors.
        recv_ids = group.alltoallv(
            buckets.send_ids.contiguous(), counts.sum(1).tolist(), recv_counts.sum(1).tolist()
        )  # [R]
        # 3) look up the rows this rank owns, packed in the order they were asked for, as
        # stored (narrow rows stay narrow on the wire).
        served: list[torch.Tensor | None] = []
        rows: list[torch.Tensor | None] = []
        for i, local in enumerate(split_ids(recv_ids, recv_counts)):
            # local: [n_t] rows of this shard, asked by rank 0, then rank 1, ...
            mine = self._rows(i)
            served.append(None if mine is None else local)
            if mine is not None:  # [n_t, D_t * k] wire elements
                rows.append(as_wire(_gather(mine[0], local), self._wire))
            else:
                rows.append(None)
        answer = pack_rows(rows, recv_counts, dev, self._wire)  # ordered (asking rank, table)
        # 4) rows back to the ranks that asked, widened to float32 (through autograd
        # when training).
        ex = _Exchange(counts, recv_counts, served)
        if self.training and torch.is_grad_enabled():
            flat = _RowExchange.apply(self._anchor, self, ex, answer)  # [sum_i D_t(i)]
        else:
            flat = self._rows_back(answer, ex)
        # 5) pool locally over the unique rows.
        per_table = unpack_rows(flat, counts, self._dims)  # [U_t, D_t] in unique-id order
        b = kjt.batch_size
        out: dict[str, torch.Tensor] = {}
        for tb in batches:
            cfg = self._configs[tb.index]
            pooled_feats = self._pool(cfg, tb, per_table[tb.index], b)
            for feat, pooled in zip(tb.features, pooled_feats, strict=True):
                out[feat] = pooled
        # No feature here but peers exchange rows: the exchange's backward must still
        # run on this rank; the collection ties this zero to an output.
        train = self.training and torch.is_grad_enabled()
        self.tie = flat.sum() if train and not out else None
        return {k: out[k] for k in kjt.keys}

    def _prepare(self, kjt: KeyedJaggedIds) -> tuple[list[_TableBatch], list[int]]:
        """Group this rank's batch by table and dedup it; ``code`` flags an id out of range."""
        if not isinstance(kjt, KeyedJaggedIds):
            raise TypeError(f"ShardedTables: expected a KeyedJaggedIds, got {type(kjt).__name__}")
        per_table = features_by_table(kjt.keys, self._table_of, "ShardedTables", "sharded table")
        batches: list[_TableBatch] = []
        b = kjt.batch_size
        kjt = kjt.to(self.device)  # a no-op behind the collection, which moved it already
        order = sorted(per_table)
        slices = {t: [kjt.key_slice(f) for f in per_table[t]] for t in order}
        ids = {t: torch.cat([s.ids for s in slices[t]]) for t in order}  # [N] per table
        found = first_out_of_range([(self._configs[t].num_rows, ids[t]) for t in order])
        if found is not None:  # (one host sync on a GPU for every table)
            t = order[found[0]]
            n = self._configs[t].num_rows
            assert n is not None
            bad = (ids[t] < 0) | (ids[t] >= n)
            pos = int(torch.nonzero(bad)[0, 0])
            ends = torch.tensor([s.ids.numel() for s in slices[t]]).cumsum(0)
            feat = per_table[t][int(torch.searchsorted(ends, pos, right=True))]
            return [], [_BAD_ID, self._features.index(feat), int(ids[t][pos])]
        for t in order:
            check_weights(self._configs[t], per_table[t], kjt.weights is not None)
        unpooled = [
            (self._configs[t], f, s.lengths)
            for t in order
            if self._configs[t].pooling == "none"
            for f, s in zip(per_table[t], slices[t], strict=True)
        ]
        seq_of = iter(sequence_lengths(unpooled))  # every feature's at once: one host sync
        for t in order:
            cfg, feats = self._configs[t], per_table[t]
            seq = [next(seq_of) if cfg.pooling == "none" else -1 for _ in feats]
            unique, inverse = dedup(ids[t])  # [U], [N]
            lengths = torch.cat([s.lengths for s in slices[t]])  # [F * B]
            weights = None
            if kjt.weights is not None:
                weights = torch.cat([s.weights for s in slices[t] if s.weights is not None])
            batches.append(_TableBatch(t, feats, inverse, unique, lengths, weights, seq))
            assert lengths.numel() == len(feats) * b
        return batches, [_OK, 0, 0]

    def _raise_if_bad(self, codes: torch.Tensor, mine: Exception | None) -> None:
        """``codes`` ``[W, 3]``: each rank's (kind, feature index, id). Raise on every rank."""
        if mine is not None:
            raise mine
        bad = torch.nonzero(codes[:, 0] != _OK).squeeze(1).tolist()
        if not bad:
            return
        r = int(bad[0])
        kind, fi, bad_id = (int(x) for x in codes[r].tolist())
        if kind == _BAD_ID:
            feat = self._features[fi]
            cfg = self._configs[self._table_of[feat]]
            raise ValueError(
                f"ShardedTables: rank {r}: feature {feat!r} has id {bad_id}, out of range for "
                f"table {cfg.name!r} with {cfg.num_rows} rows (valid ids [0, {cfg.num_rows})); "
                "no rank exchanged any ids"
            )
        raise ValueError(
            f"ShardedTables: rank {r} rejected its batch (its own error says why; ranks "
            f"{bad} had bad batches); no rank exchanged any ids"
        )

    def _pool(
        self, cfg: TableConfig, tb: _TableBatch, rows: torch.Tensor, b: int
    ) -> list[torch.Tensor]:
        """Per feature of ``tb``: ``[B, D]`` pooled, or ``[B, T, D]`` for pooling "none"."""
        weights = None if tb.weights is None else tb.weights.to(rows.dtype)
        f_count = len(tb.features)
        if cfg.pooling == "none":
            per_id = F.embedding(tb.inverse, rows)  # [N, D]
            if weights is not None:
                per_id = per_id * weights.unsqueeze(1)
            parts = torch.split(per_id, [b * t for t in tb.seq])  # [B * T, D] per feature
            return [p.view(b, t, cfg.dim) for p, t in zip(parts, tb.seq, strict=True)]
        pooled = F.embedding_bag(
            tb.inverse,
            rows,
            offsets_from_lengths(tb.lengths),
            mode=cfg.pooling,
            per_sample_weights=weights,
            include_last_offset=True,
        )  # [F * B, D]; empty bags are zeros
        return list(pooled.view(f_count, b, cfg.dim).unbind(0))

    # ------------------------------------------------------------ exchange of rows

    def _rows_back(self, answer: torch.Tensor, ex: _Exchange) -> torch.Tensor:
        """Owner -> requester: ``answer`` (wire elements ordered like the ids received)
        comes back ordered like the ids this rank sent, as float32 rows."""
        got = self.group.alltoallv(
            answer,
            float_splits(ex.recv_counts, self._wire_dims),
            float_splits(ex.send_counts, self._wire_dims),
        )  # [sum_i W_t(i)] wire elements
        return widen_rows(got, ex.send_counts, self._dims, self._row_dtypes)  # [sum_i D_t(i)]

    def _apply_grads(self, grad: torch.Tensor, ex: _Exchange) -> None:
        """Requester -> owner: the rows' gradients go back (float32, whatever the rows);
        owners run the optimizer."""
        got = self.group.alltoallv(
            grad.contiguous(),
            float_splits(ex.send_counts, self._dims),
            float_splits(ex.recv_counts, self._dims),
        )  # ordered like the ids this rank received
        scale = 1.0 / self.group.size  # the DDP average: see the module doc
        grads = unpack_rows(got, ex.recv_counts, self._dims)  # [n_t, D_t] like ex.served
        on_device: list[tuple[int, torch.Tensor, torch.Tensor]] = []  # (table, rows, sums)
        for i, (local, g) in enumerate(zip(ex.served, grads, strict=True)):
            if local is None or local.numel() == 0:
                continue
            g = g.mul(scale)
            shard = self._shards[i]
            if shard is not None:  # on the host: the store's engine
                with shard.lock:
                    shard.push(local, g)  # sums repeats, optimizer once per row; raises on Inf
                continue
            index = torch.arange(local.numel(), device=local.device)
            on_device.append((i, *segment_sum(local, g, index, None)))  # [U], [U, D]
        if on_device:
            self._push_on_device(on_device)

    def _push_on_device(self, sums: list[tuple[int, torch.Tensor, torch.Tensor]]) -> None:
        """What :meth:`ps.local.table.LocalTable.push` does, for shards on a device:
        ``sums`` holds per table ``(index, unique shard rows [U], summed gradients [U, D])``;
        non-finite sums are refused (as the store's default ``nan_policy="raise"``), every
        table's checked at once (one host sync on a GPU) before any is applied; then the
        optimizer runs once per unique row (:func:`embedding.fused_ops.apply_optimizer`,
        the same math; narrow rows: :meth:`_apply_narrow`)."""
        finite = torch.stack([torch.isfinite(s).all() for _, _, s in sums])  # [T_owned]
        for (i, uniq, summed), ok in zip(sums, boundary.read(finite), strict=True):
            if not ok:
                bad = int(uniq[~torch.isfinite(summed).all(dim=1)][0])
                raise ValueError(
                    f"sharded table {self._configs[i].name!r}: the summed gradient of shard "
                    f"row {bad} is not finite; nothing was applied"
                )
        for i, uniq, summed in sums:
            rows = self._rows(i)
            assert rows is not None
            cfg = self._configs[i]
            if rows[0].dtype != torch.float32:
                self._apply_narrow(i, uniq, summed)
            else:
                apply_optimizer(FusedGroup(cfg.dim, cfg.optimizer, *rows), uniq, summed)

    def _apply_narrow(self, i: int, uniq: torch.Tensor, summed: torch.Tensor) -> None:
        """The optimizer on float32 copies of narrow shard rows ``uniq`` ``[U]`` (distinct)
        with ``summed`` ``[U, D]``, written back stochastically rounded, keyed by the
        rows' table ids and clocks after the update (as :class:`ps.local.table.LocalTable`
        does on the host)."""
        rows = self._rows(i)
        assert rows is not None
        weights, state, clocks = rows
        cfg = self._configs[i]
        copy = FusedGroup(
            cfg.dim, cfg.optimizer,
            weights.index_select(0, uniq).to(torch.float32),  # [U, D]
            state.index_select(0, uniq),  # [U, S]
            clocks.index_select(0, uniq),  # [U]
        )  # fmt: skip
        apply_optimizer(copy, torch.arange(uniq.numel(), device=uniq.device), summed)
        start, _ = self.plan.table(cfg.name).rows_on(self.group.rank)
        init = cfg.to_spec().init
        assert init is not None
        narrow = round_to(
            copy.weight, weights.dtype, seed=init.seed, ids=uniq + start, versions=copy.clocks
        )  # [U, D]
        weights.index_copy_(0, uniq, narrow)
        if state.shape[1] > 0:
            state.index_copy_(0, uniq, copy.state)
        clocks.index_copy_(0, uniq, copy.clocks)


def _gather(weights: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """``weights[rows]`` ``[n, D]``: numpy's single-threaded take on the host (see
    :func:`ps.local.table.take`), ``index_select`` on a device."""
    return take(weights, rows) if weights.device.type == "cpu" else weights.index_select(0, rows)


class _RowExchange(torch.autograd.Function):
    """Rows owner -> requester in forward; their gradients back + optimizer in backward."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, anchor: torch.Tensor, module: ShardedTables, ex: _Exchange, answer: torch.Tensor
    ) -> torch.Tensor:
        ctx.module, ctx.ex = module, ex
        return module._rows_back(answer, ex)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[None, None, None, None]:  # type: ignore[override]
        ctx.module._apply_grads(grad, ctx.ex)
        return None, None, None, None
