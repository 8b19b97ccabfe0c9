"""Local tables: every local table of a collection in this process, fused.

Tables with the same ``dim``, optimizer config and row type (``TableConfig.dtype``)
form one *fused group* (see :mod:`embedding.fused_ops` for the flat layout and the
fused backward). A batch costs one ``embedding_bag`` per group forward and one sort +
``embedding_bag`` + optimizer gather/scatter per group backward, whatever the number
of tables.

Data parallel (``group.size > 1``): the tables are replicated, one copy per
rank, all starting from the tables' deterministic initial rows (``TableSpec``'s
initializer); the backward gathers every rank's coalesced row gradients with
``allgatherv`` and divides them by ``group.size``, so every replica applies the
identical update (the same rule as replicated hybrid tables).

Device: the tables live on the collection's device (weights, optimizer state
and clocks allocated there; initial rows hashed there in chunks, bit for bit the
host values). They are module state: each group's ``weight [R, D]``, ``state [R, S]``
and ``clocks [R]`` are registered buffers, so ``module.to(device)`` moves them
(the fused groups are rebound to the moved tensors), and the state dict names
them per table: ``<table>.weight``, ``<table>.state``, ``<table>.clocks``.

Narrow rows (``TableConfig.dtype`` "fp16" or "bf16"): a group's ``weight`` holds that
type (the initial rows rounded to the nearest), the lookups pool in float32 and
every read (:meth:`LocalTables.rows`, checkpoints) returns float32; each update is
computed in float32 and stochastically rounded back (:mod:`ps.rounding`, keyed by the
table's init seed, the row's id and its clock after the update), so a local table and
a ps store table of the same spec give the same rows the same bits. Optimizer state
stays float32. The state dict holds the rows in their stored type; loading rows of
another type (a state dict or a checkpoint of another ``dtype``) converts them,
rounding to the nearest, with one warning per load naming the tables.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import torch
from torch import nn

from comm import ProcessGroup
from comm.device import module_device
from embedding.checks import check_batch_ids, check_weights
from embedding.config import TableConfig
from embedding.fused_ops import (
    FusedGroup,
    FusedLookupFunction,
    GroupBatch,
    group_batch,
    groups_feature_sizes,
    lookup,
    name_parts,
)
from embedding.jagged import KeyedJaggedIds
from embedding.table_state import apply_keep_dtype, copy_checked, target_device, warn_converted
from ps import Optimizer, TableSpec
from ps.checkpoint import TablePart, read_checkpoint, write_checkpoint
from ps.kernels.narrow_rows import RoundingKeys
from ps.local.table import table_array
from ps.table import TORCH_ROW_DTYPES, RowDtype

_INIT_CHUNK_ROWS = 1 << 16  # rows initialised at once (bounds the hash temporaries)


def _storage(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Zeroed table storage on ``device``. On the host it is numpy-allocated: that storage
    gets transparent huge pages, so random row reads over a large table miss the TLB far
    less (measured 26 x 100k x 64, 53k ids: gather 11.8 ms -> 1.8 ms, row scatter 14 ms ->
    3.5 ms). On a GPU it is allocated there directly (no host copy of the table)."""
    if device.type == "cpu":
        return table_array(shape, dtype)
    return torch.zeros(shape, dtype=dtype, device=device)


class LocalTables(nn.Module):
    """The local tables of an :class:`~embedding.EmbeddingCollection`, fused per group.

    ``forward(kjt, tables)`` takes ``[(config, features present in kjt)]`` and
    returns ``{feature: [B, D] or [B, T, D]}``. Training (``.train()`` and grad
    enabled) updates the touched rows inside ``backward()``.
    """

    def __init__(
        self,
        configs: Sequence[TableConfig],
        group: ProcessGroup,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        self.configs = {c.name: c for c in configs}
        self.group = group
        dev = module_device(group, device)
        keys: dict[tuple[int, Optimizer, RowDtype], list[TableConfig]] = {}
        for cfg in configs:
            keys.setdefault((cfg.dim, cfg.optimizer, cfg.dtype), []).append(cfg)
        self._group_keys = list(keys)  # (dim, optimizer, row type) of each fused group
        self._group_tables = [[c.name for c in cfgs] for cfgs in keys.values()]
        self.specs: dict[str, TableSpec] = {}
        self.where: dict[str, tuple[int, int]] = {}  # table -> (group index, base row)
        for gi, ((dim, opt, dtype), cfgs) in enumerate(keys.items()):
            total = sum(int(c.num_rows or 0) for c in cfgs)
            # [R, D] of the tables' row type: narrow rows take the initial rows rounded
            # to the nearest (as a ps store's table of the same spec does).
            weight = _storage((total, dim), TORCH_ROW_DTYPES[dtype], dev)
            base = 0
            for c in cfgs:
                spec = c.to_spec()
                n = int(c.num_rows or 0)
                for start in range(0, n, _INIT_CHUNK_ROWS):
                    stop = min(n, start + _INIT_CHUNK_ROWS)
                    # Hashed on the tables' device (bit for bit the host values): a GPU
                    # fills its tables without a host pass.
                    weight[base + start : base + stop] = spec.initial_rows(
                        torch.arange(start, stop, device=dev)
                    )
                self.specs[c.name] = spec
                self.where[c.name] = (gi, base)
                base += n
            state = _storage((total, opt.state_dim(dim)), torch.float32, dev)  # [R, S]
            state[:] = opt.initial_state(dim).to(dev)
            clocks = _storage((total,), torch.int64, dev)  # [R]
            # Buffers, so model.to(), state_dict() and load_state_dict() carry them; the
            # state dict names them per table (see _save_to_state_dict).
            self.register_buffer(f"group{gi}_weight", weight)
            self.register_buffer(f"group{gi}_state", state)
            self.register_buffer(f"group{gi}_clocks", clocks)
        self.groups: list[FusedGroup] = []
        self._bind_groups()
        # Autograd needs one input that requires grad to record the fused node.
        self._anchor = torch.zeros(0, requires_grad=True, device=dev)
        self.tie: torch.Tensor | None = None  # see forward
        self.state_dict_tables = True  # False: state_dict() leaves the tables out

    @property
    def device(self) -> torch.device:
        return self._anchor.device

    def _bind_groups(self) -> None:
        """The fused groups over the current buffers (again after ``.to()`` moved them)."""
        self.groups = []
        for gi, (dim, opt, dtype) in enumerate(self._group_keys):
            weight: torch.Tensor = self._buffers[f"group{gi}_weight"]  # type: ignore[assignment]
            self.groups.append(
                FusedGroup(
                    dim=dim,
                    optimizer=opt,
                    weight=weight,
                    state=self._buffers[f"group{gi}_state"],  # type: ignore[arg-type]
                    clocks=self._buffers[f"group{gi}_clocks"],  # type: ignore[arg-type]
                    keys=self._rounding_keys(gi, dtype, weight.device),
                )
            )

    def _rounding_keys(self, gi: int, dtype: RowDtype, device: torch.device) -> RoundingKeys | None:
        """How group ``gi``'s narrow rows round (its tables' bases and init seeds), on
        ``device``; None for float32 rows."""
        if dtype == "fp32":
            return None
        names = self._group_tables[gi]
        seeds = []
        for name in names:
            init = self.specs[name].init
            assert init is not None  # resolved by TableSpec
            seeds.append(init.seed)
        sizes = [int(self.configs[n].num_rows or 0) for n in names]
        return RoundingKeys.of_tables(TORCH_ROW_DTYPES[dtype], sizes, seeds, device)

    def _apply(self, fn, recurse=True):  # type: ignore[no-untyped-def]
        """``.to(device)``, ``.cuda()``, ``.cpu()``: the tables move and the fused groups
        use the moved tensors. A dtype change (``.half()``, ``.to(torch.bfloat16)``)
        leaves the tables as they are (rows in their table's ``dtype``, float32 state,
        int64 clocks): a table's row type is its config's, and rounding the tables
        would lose their values."""
        for key, buf in list(self._buffers.items()):
            if buf is None:
                continue
            self._buffers[key] = apply_keep_dtype(fn, buf)
        self._anchor = torch.zeros(0, requires_grad=True, device=target_device(fn, self._anchor))
        self._bind_groups()
        return self

    # ------------------------------------------------------------ state dict

    def _table_tensors(self, name: str) -> dict[str, torch.Tensor]:
        g, base, n = self._table_rows(name)
        return {
            "weight": g.weight[base : base + n],  # [n, D] view
            "state": g.state[base : base + n],  # [n, S] view
            "clocks": g.clocks[base : base + n],  # [n] view
        }

    def _save_to_state_dict(self, destination, prefix, keep_vars):  # type: ignore[no-untyped-def]
        """Per table ``<prefix><table>.weight [n, D]``, ``.state [n, S]``, ``.clocks [n]``
        (views of the fused storage): independent of how tables are fused, so a state
        dict loads into a collection that groups its tables differently."""
        if not self.state_dict_tables:
            return
        for name in self.specs:
            for what, t in self._table_tensors(name).items():
                destination[f"{prefix}{name}.{what}"] = t if keep_vars else t.detach()

    def _load_from_state_dict(  # type: ignore[no-untyped-def]
        self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs
    ):
        if not self.state_dict_tables:
            return
        ours = set()
        converted: dict[str, tuple[torch.dtype, torch.dtype]] = {}  # table -> (from, to)
        for name in self.specs:
            for what, target in self._table_tensors(name).items():
                key = f"{prefix}{name}.{what}"
                ours.add(key)
                if key not in state_dict:
                    missing_keys.append(key)
                    continue
                value = state_dict[key]
                error = copy_checked(target, value, f"local table {name!r}: {key}")
                if error:
                    error_msgs.append(error)
                elif what == "weight" and value.dtype != target.dtype:
                    converted[name] = (value.dtype, target.dtype)
        if converted:
            warn_converted(converted, f"the state dict ({prefix or 'top level'})")
        if strict:
            unexpected_keys.extend(k for k in state_dict if k.startswith(prefix) and k not in ours)

    # ------------------------------------------------------------ reads

    def _table_rows(self, table: str) -> tuple[FusedGroup, int, int]:
        if table not in self.where:
            raise KeyError(f"no local table {table!r}; local tables: {list(self.where)}")
        gi, base = self.where[table]
        return self.groups[gi], base, int(self.configs[table].num_rows or 0)

    def _check_read_ids(self, table: str, ids: torch.Tensor, n: int) -> None:
        if ids.dtype != torch.int64:
            raise TypeError(f"table {table!r}: ids must be int64, got {ids.dtype}")
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= n):
            raise ValueError(
                f"table {table!r}: ids must be in [0, {n}), got range "
                f"[{int(ids.min())}, {int(ids.max())}]"
            )

    def rows(self, table: str, ids: torch.Tensor) -> torch.Tensor:
        """A copy of rows ``ids`` ``[N]`` of ``table``: float32 ``[N, D]`` (narrow rows
        widened, exactly)."""
        g, base, n = self._table_rows(table)
        self._check_read_ids(table, ids, n)
        return g.weight.index_select(0, ids.to(g.weight.device) + base).to(torch.float32)

    def state(self, table: str, ids: torch.Tensor) -> torch.Tensor:
        """A copy of the optimizer state of rows ``ids``: ``[N, S]``."""
        g, base, n = self._table_rows(table)
        self._check_read_ids(table, ids, n)
        return g.state.index_select(0, ids.to(g.state.device) + base)

    def clocks(self, table: str, ids: torch.Tensor) -> torch.Tensor:
        """How many updates rows ``ids`` received: int64 ``[N]``."""
        g, base, n = self._table_rows(table)
        self._check_read_ids(table, ids, n)
        return g.clocks.index_select(0, ids.to(g.clocks.device) + base)

    # ------------------------------------------------------------ forward

    def forward(
        self, kjt: KeyedJaggedIds, tables: list[tuple[TableConfig, list[str]]]
    ) -> dict[str, torch.Tensor]:
        train = self.training and torch.is_grad_enabled()
        per_group: list[list[tuple[TableConfig, str]]] = [[] for _ in self.groups]
        check_batch_ids(kjt, tables)  # one host sync on a GPU (bad ids raise here)
        for cfg, feats in tables:
            check_weights(cfg, feats, kjt.weights is not None)
            gi = self.where[cfg.name][0]
            per_group[gi].extend((cfg, f) for f in feats)
        # In data parallel every rank runs every group (maybe empty), so the ranks'
        # backward collectives match.
        active = [gi for gi, fs in enumerate(per_group) if fs or (train and self.group.size > 1)]
        batches = [self._group_batch(kjt, per_group[gi]) for gi in active]
        groups = [self.groups[gi] for gi in active]
        shapes = groups_feature_sizes(kjt, [per_group[gi] for gi in active])  # (seq, sizes)
        splits = [sizes or [0] for _, sizes in shapes]  # [0]: a group without features
        if train:
            parts = FusedLookupFunction.apply(self._anchor, groups, batches, self.group, splits)
        else:
            parts = tuple(
                p
                for g, b, sizes in zip(groups, batches, splits, strict=True)
                for p in lookup(g.weight, b).split(sizes)
            )
        result: dict[str, torch.Tensor] = {}
        start = 0
        for gi, (seq, sizes) in zip(active, shapes, strict=True):
            if sizes:
                mine = parts[start : start + len(sizes)]
                result.update(name_parts(mine, kjt, per_group[gi], seq))
            start += len(sizes) or 1
        # Data parallel without a feature here: the node still has to run backward
        # (its collectives); the collection ties this zero to an output.
        self.tie = parts[0].sum() if train and parts and not result else None
        return result

    def _group_batch(self, kjt: KeyedJaggedIds, feats: list[tuple[TableConfig, str]]) -> GroupBatch:
        """Flat rows (table base added), bag offsets and per-id factors of one group."""
        return group_batch(kjt, feats, [self.where[c.name][1] for c, _ in feats])

    # ------------------------------------------------------------ checkpoints

    def checkpoint_parts(self) -> list[tuple[TableSpec, TablePart]]:
        """Every local table whole (rows, optimizer state, clocks) as ``(spec, part)``
        for :func:`ps.checkpoint.write_checkpoint`."""
        out = []
        for name, spec in self.specs.items():
            g, base, n = self._table_rows(name)
            part = TablePart(
                ids=torch.arange(n, dtype=torch.int64),
                # float32 whatever the rows (narrow ones widen exactly); the spec has the type
                weights=g.weight[base : base + n].cpu().to(torch.float32),
                state=g.state[base : base + n].cpu(),
                clocks=g.clocks[base : base + n].cpu(),
            )
            out.append((spec, part))
        return out

    def save(self, path: str | os.PathLike[str]) -> None:
        """Write every local table in the ps checkpoint format (:mod:`ps.checkpoint`: JSON
        manifest + ``.npy``), so a parameter-server store can load it too."""
        entries = [(spec, [part]) for spec, part in self.checkpoint_parts()]
        write_checkpoint(path, entries, writer="embedding.LocalTables")

    def load(self, path: str | os.PathLike[str]) -> None:
        """Read the local tables back from a ps checkpoint (written by :meth:`save` or
        by any store's ``save``). Every local table must be in it with the same
        rows, dim and optimizer; rows a checkpoint lacks are left as they are. A table
        saved with another row type (``dtype``) is converted to this one's (rounded to
        the nearest), with one warning naming every such table."""
        ckpt = read_checkpoint(path)
        converted: dict[str, tuple[torch.dtype, torch.dtype]] = {}
        for spec in self.specs.values():
            ckpt.expect(spec)
            saved = ckpt.spec(spec.name)
            if saved.dtype != spec.dtype:
                converted[spec.name] = (saved.torch_dtype, spec.torch_dtype)
        if converted:
            warn_converted(converted, f"checkpoint {str(path)!r}")
        for name in self.specs:
            g, base, _ = self._table_rows(name)
            for part in ckpt.parts(name):
                rows = part.ids.to(g.weight.device) + base
                # float32 parts: exact for rows saved narrow, rounded for wider ones
                g.weight.index_copy_(0, rows, part.weights.to(g.weight.device, g.weight.dtype))
                if g.state.shape[1] > 0:
                    g.state.index_copy_(0, rows, part.state.to(g.state.device))
                g.clocks.index_copy_(0, rows, part.clocks.to(g.clocks.device))
