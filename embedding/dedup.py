"""Deduplicate a batch's ids per table: each table's unique ids and the inverse map.

A table shared by several features sees their ids as one stream (features in
the order given), so a row looked up by two features is fetched once::

    table "items", features ["clicked", "bought"]
    ids      = [ 7, 2, 7 | 2, 9 ]          # clicked's ids, then bought's
    unique   = [ 2, 7, 9 ]                 # [U] sorted
    inverse  = [ 1, 0, 1,  0, 2 ]          # [N] unique[inverse] == ids
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from embedding.jagged import KeyedJaggedIds


@dataclass(slots=True, frozen=True)
class TableIds:
    """One table's ids in a batch: ``unique`` int64 ``[U]`` (sorted), ``inverse``
    int64 ``[N]`` with ``unique[inverse] == ids``, ``features`` (those present in
    the batch, in the order given) and ``sizes`` (ids per feature, summing to N)."""

    unique: torch.Tensor
    inverse: torch.Tensor
    features: list[str]
    sizes: list[int]


def dedup(ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(unique [U] sorted, inverse [N])`` of int64 ``ids`` ``[N]``."""
    unique, inverse = torch.unique(ids, sorted=True, return_inverse=True)
    return unique, inverse


def dedup_per_table(
    kjt: KeyedJaggedIds, tables: Mapping[str, Sequence[str]]
) -> dict[str, TableIds]:
    """``{table: TableIds}`` for every table with at least one feature in ``kjt``.

    ``tables`` maps a table name to its feature names; features absent from the
    batch are skipped, and a table with none present is left out.
    """
    out: dict[str, TableIds] = {}
    for table, feats in tables.items():
        present = [f for f in feats if f in kjt]
        if not present:
            continue
        parts = [kjt.key_slice(f).ids for f in present]
        unique, inverse = dedup(torch.cat(parts))
        out[table] = TableIds(unique, inverse, present, [int(p.numel()) for p in parts])
    return out
