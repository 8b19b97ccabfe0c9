"""An exported table read for serving: memory-mapped rows, looked up and pooled.

Only the rows a batch names are read from the files and converted to float32
(fp16 -> fp32; int8: ``code * scale + bias``); the pooling is the training model's
(:mod:`embedding.fused_ops`): one ``embedding_bag(mode="sum")`` per feature, "mean" bags
as per-id weights ``1 / len``, so fp32 rows pool to the training forward's bits.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from embedding.jagged import JaggedIds, offsets_from_lengths
from hybridrec.serving.artefact import ExportReader
from ps import TableSpec


@dataclass
class ServingTable:
    """One table of an export: ``rows [n, D]`` (float32, float16 or uint8 codes, memory
    mapped), ``scale_bias [n, 2]`` for int8, ``ids [n]`` sorted for a dynamic table."""

    name: str
    dim: int
    num_rows: int | None  # None: a dynamic table (any int64 id)
    dtype: str
    rows: np.ndarray
    scale_bias: np.ndarray | None
    ids: np.ndarray | None
    spec: TableSpec | None  # dynamic tables: the initial rows of ids never trained
    weight: torch.Tensor = field(init=False)
    scale: torch.Tensor | None = field(init=False)

    @classmethod
    def open(cls, reader: ExportReader, name: str, doc: dict[str, Any]) -> ServingTable:
        def mapped(key: str) -> np.ndarray | None:
            return reader.array(doc[key], mmap=True) if doc.get(key) else None

        rows = mapped("rows")
        assert rows is not None
        ids = doc.get("ids")
        table = cls(
            name=name, dim=int(doc["dim"]), num_rows=doc["num_rows"], dtype=doc["dtype"],
            rows=rows, scale_bias=mapped("scale_bias"),
            ids=None if ids is None else reader.array(ids),  # searched every batch: in memory
            spec=None if doc.get("spec") is None else TableSpec.from_json(doc["spec"]),
        )  # fmt: skip
        if rows.ndim != 2 or rows.shape[1] != table.dim:
            raise ValueError(f"export table {name!r}: rows {rows.shape}, expected [n, {table.dim}]")
        return table

    def __post_init__(self) -> None:
        # torch views of the read-only maps (no copy): torch's gathers and dtype
        # conversions are vectorised where numpy's float16 ones are not. Nothing writes
        # through them, so torch's warning about non-writable arrays does not apply.
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            self.weight = torch.from_numpy(self.rows)  # [n, D]
            self.scale = None if self.scale_bias is None else torch.from_numpy(self.scale_bias)

    @property
    def nbytes(self) -> int:
        """Bytes of its row files (rows and scale/bias; a dynamic table's ids apart)."""
        return int(self.rows.nbytes + (0 if self.scale_bias is None else self.scale_bias.nbytes))

    def check_ids(self, feature: str, ids: torch.Tensor) -> None:
        """ValueError naming the feature, the table, the first bad id and the range."""
        if self.num_rows is None or ids.numel() == 0:
            return
        bad = (ids < 0) | (ids >= self.num_rows)
        if bool(bad.any()):
            first = int(ids[bad][0])
            raise ValueError(
                f"feature {feature!r}: id {first} is out of range for table {self.name!r}, "
                f"whose ids are [0, {self.num_rows}) ({int(bad.sum())} bad ids in this batch)"
            )

    def positions(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``(rows [N], unseen [N] bool or None)``: where ``ids`` are in the row files. A
        dynamic table's ids are found by binary search; an id the run never trained is
        flagged (it reads as its initial row, as the store's pull reads it)."""
        if self.ids is None:
            return ids, None
        q = ids.numpy()
        pos = np.minimum(np.searchsorted(self.ids, q), max(len(self.ids) - 1, 0))
        found = (self.ids[pos] == q) if len(self.ids) else np.zeros(len(q), dtype=bool)
        return torch.from_numpy(pos), None if found.all() else torch.from_numpy(~found)

    def lookup(self, ids: torch.Tensor) -> torch.Tensor:
        """float32 ``[N, D]``: the rows of ``ids`` (int64 ``[N]``, checked), dequantized."""
        ids = ids.cpu()
        if self.weight.shape[0] == 0:  # a dynamic table that kept no rows
            assert self.spec is not None
            return self.spec.initial_rows(ids)
        pos, unseen = self.positions(ids)
        picked = self.weight.index_select(0, pos)  # [N, D] stored dtype
        if self.scale is not None:  # int8: code * scale + bias
            sb = self.scale.index_select(0, pos)  # [N, 2]
            rows = picked.to(torch.float32) * sb[:, :1] + sb[:, 1:]
        else:
            rows = picked.to(torch.float32)
        if unseen is not None:
            assert self.spec is not None
            rows[unseen] = self.spec.initial_rows(ids[unseen])
        return rows

    def pool(self, bag: JaggedIds, pooling: str) -> torch.Tensor:
        """``[B, D]``: each sample's rows summed ("sum") or averaged ("mean"), with the
        bag's per-id weights if it has them; zeros for an empty bag."""
        ids, lengths = bag.ids.cpu(), bag.lengths.cpu()
        weights = None if bag.weights is None else bag.weights.cpu().to(torch.float32)
        if pooling == "mean":
            inv = 1.0 / lengths.clamp(min=1).to(torch.float32)  # [B]
            scale = torch.repeat_interleave(inv, lengths, output_size=ids.numel())  # [N]
            weights = scale if weights is None else weights * scale
        if self.ids is None and self.weight.dtype == torch.float32:
            # fp32 rows pooled straight from the map: the training forward's gather+sum
            table, index = self.weight, ids
        else:
            table, index = self.lookup(ids), torch.arange(ids.numel())  # [N, D], [N]
        return F.embedding_bag(
            index,
            table,
            offsets_from_lengths(lengths),
            mode="sum",
            per_sample_weights=weights,
            include_last_offset=True,
        )
