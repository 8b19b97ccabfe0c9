"""The element types of a run's embedding rows, as its checkpoints record them.

Every job writes ``{"row_dtypes": {table: "fp32" | "fp16" | "bf16"}}`` into the run
configuration its checkpoints keep (``meta.json``). The type is not a shape: a resume,
an evaluation or a prediction may ask for other types (``--emb-dtype``,
``--emb-dtype-of``) and the rows convert as they load (a checkpoint holds float32 rows,
a narrow row widened exactly; a narrow table rounds them to the nearest value of its
type). The job says so in one line (:func:`converted_rows`). A checkpoint without the
key was saved before rows had a type: every table of it is fp32.

Local and sharded tables convert what they load themselves. A parameter-server store
loads a table with the spec its checkpoint records, the type included, so a store's
checkpoint whose types differ from the job's tables is first copied with the job's
types (:func:`store_checkpoint_as`) and the store loads the copy.
"""

from __future__ import annotations

import dataclasses
import tempfile
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from ps.checkpoint import read_checkpoint, write_checkpoint
from ps.table import RowDtype

ROW_DTYPES_KEY = "row_dtypes"
SAVED_BEFORE_DTYPES = "fp32"  # the rows of a checkpoint whose config has no row_dtypes


def converted_rows(saved_config: Mapping[str, Any] | None, now: Mapping[str, str]) -> str | None:
    """The line a job prints when the tables ``now`` (``{table: dtype}``) load rows the
    checkpoint of ``saved_config`` (its run configuration) saved in another type::

        "the embedding rows are converted as they load: cat0, cat1 fp32 -> bf16"

    None when every table keeps its type. Tables the checkpoint does not name are left
    out (the load itself says what is missing)."""
    if saved_config is None:
        return None
    saved = saved_config.get(ROW_DTYPES_KEY)
    if not isinstance(saved, Mapping):
        saved = dict.fromkeys(now, SAVED_BEFORE_DTYPES)
    changes: dict[tuple[str, str], list[str]] = {}  # (from, to) -> tables, in now's order
    for table, dtype in now.items():
        before = saved.get(table)
        if before is not None and before != dtype:
            changes.setdefault((str(before), dtype), []).append(table)
    if not changes:
        return None
    parts = [f"{_names(tables)} {a} -> {b}" for (a, b), tables in changes.items()]
    return "the embedding rows are converted as they load: " + "; ".join(parts)


def _names(tables: list[str]) -> str:
    """``"cat0, cat1"``; past four tables, the first four and how many more."""
    if len(tables) <= 4:
        return ", ".join(tables)
    return f"{', '.join(tables[:4])} and {len(tables) - 4} more"


@contextmanager
def store_checkpoint_as(
    path: Path, dtypes: Mapping[str, RowDtype], scratch: Path
) -> Iterator[Path]:
    """The store checkpoint ``path``, or, when a table of it has another row type than
    ``dtypes`` gives it (``{table: dtype}``; tables not named keep theirs), a copy with
    those types in a hidden folder under ``scratch``, removed when the block ends. The
    parts hold float32 rows whatever the type, so the copy's are the same: the store
    rounds them as it loads them. ``scratch`` is beside the saved model: PS server ranks
    read the copy, and they see the checkpoints' filesystem."""
    ckpt = read_checkpoint(path)
    specs = [
        dataclasses.replace(s, dtype=dtypes[s.name]) if dtypes.get(s.name, s.dtype) != s.dtype
        else s
        for s in ckpt.specs
    ]  # fmt: skip
    if specs == ckpt.specs:
        yield path
        return
    with tempfile.TemporaryDirectory(prefix=".rows-as-", dir=scratch) as folder:
        copy = Path(folder) / path.name
        write_checkpoint(copy, [(s, ckpt.parts(s.name)) for s in specs], writer="hybridrec")
        yield copy


__all__ = ["ROW_DTYPES_KEY", "converted_rows", "store_checkpoint_as"]
