"""The hybrid tables of a job in a store that may outlive it (``--existing-tables``).

A shared store (Redis; MPI server ranks live only as long as the job) keeps the
tables a run made. :func:`prepare_tables` decides, once and on every rank alike,
what a new job does with them before its embedding collection is built: stop and
say so (``fail``, the default for a fresh job), train on from their rows (``reuse``,
implied by ``--resume``), or drop and recreate them (``replace``). A table with
another shape is named with both shapes and how to clear it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch

from comm import ProcessGroup
from comm.agreement import agree
from embedding.hybrid import store_is_replicated
from ps import Store, TableSpec

EXISTING_TABLES = ("fail", "reuse", "replace")
# A table that differs in its rows' type alone: the store keeps its rows' type, a
# checkpoint's rows convert as they load.
_NEW_DTYPE = (
    "; to continue a run with another --emb-dtype, --resume --existing-tables replace "
    "loads the checkpoint's rows into the new type"
)


class ExistingTablesError(ValueError):
    """A fresh job found its tables already in a shared store (an earlier run's rows)."""


def _shape(spec: TableSpec) -> str:
    rows = "dynamic" if spec.num_rows is None else str(spec.num_rows)
    return f"{rows} x {spec.dim}"


def _differences(have: TableSpec, want: TableSpec) -> str:
    """``rows x dim`` of both, and the other fields that differ, by name."""
    fields = [
        f"{name} {getattr(have, name)!r} vs {getattr(want, name)!r}"
        for name in ("optimizer", "init", "capacity", "max_age_steps", "nan_policy", "dtype")
        if getattr(have, name) != getattr(want, name)
    ]
    text = f"the store has {_shape(have)} (rows x dim), this job needs {_shape(want)}"
    return text + (f"; {', '.join(fields)}" if fields else "")


def _check_tables(store: Store, specs: list[TableSpec], policy: str) -> list[str]:
    """Apply ``policy`` to the tables of ``specs`` that ``store`` already holds; returns
    the names of the tables kept from an earlier run. Missing (or dropped) tables are
    left to the embedding collection, which creates the tables of a shared store from
    one worker while the others wait."""
    have = set(store.tables())
    found = [s for s in specs if s.name in have]
    if found and policy == "fail":
        names = ", ".join(repr(s.name) for s in found[:4])
        names += f" and {len(found) - 4} more" if len(found) > 4 else ""
        raise ExistingTablesError(
            f"the parameter-server store already holds table(s) {names}, probably from an "
            "earlier run; this job would train on from their rows. Pass --resume to continue "
            "that run from its checkpoint, --existing-tables reuse to train on from the rows "
            "in the store, or --existing-tables replace to drop them and start fresh"
        )
    kept = []
    for spec in found:
        old = store.spec(spec.name)
        if policy == "replace":
            store.drop_table(spec.name)
        elif old != spec:
            raise ValueError(
                f"table {spec.name!r} is already in the parameter-server store with another "
                f"spec: {_differences(old, spec)}. Run with the options that made it, or clear "
                f"it: --existing-tables replace drops it (or FLUSHDB on a Redis store)"
                + (_NEW_DTYPE if dataclasses.replace(old, dtype=spec.dtype) == spec else "")
            )
        else:
            kept.append(spec.name)
    return kept


def prepare_tables(
    store: Store, specs: list[TableSpec], group: ProcessGroup, policy: str = "reuse"
) -> list[str]:
    """Collective over the workers: decide what happens to the hybrid tables ``specs``
    that ``store`` already holds, before the workers build their embedding collections
    (which create the missing ones); returns the names of the tables reused.

    ``policy`` says what to do with a table the store already holds (a shared store
    such as Redis outlives a job): ``fail`` (ValueError naming them and the options),
    ``reuse`` (keep its rows; a different spec is a ValueError naming the table and
    both shapes) or ``replace`` (drop it; the collection creates it afresh). A shared
    store is checked by rank 0 alone while the others wait (two workers dropping the
    same table at once would race); a per-rank (replicated) store by every rank.
    Every rank raises the same error if it fails.
    """
    if policy not in EXISTING_TABLES:
        raise ValueError(f"policy must be one of {', '.join(EXISTING_TABLES)}, got {policy!r}")
    if not specs:
        return []
    if group.size == 1 or store_is_replicated(store):  # every rank checks its own copy
        return _on_every_rank(lambda: _check_tables(store, specs, policy), group)
    # A shared store: rank 0 decides; its answer (kept names or its error) goes to all.
    answer = ""
    if group.rank == 0:
        try:
            answer = "ok\n" + ",".join(_check_tables(store, specs, policy))
        except Exception as e:
            answer = f"{type(e).__name__}\n{e}"
    kind, _, text = _from_rank0(answer, group).partition("\n")
    if kind == "ok":
        return [n for n in text.split(",") if n]
    raise (ExistingTablesError if kind == "ExistingTablesError" else ValueError)(text)


def _from_rank0(text: str, group: ProcessGroup) -> str:
    """Collective: rank 0's ``text`` on every rank (one allgatherv of its UTF-8 bytes)."""
    mine = list(text.encode()) if group.rank == 0 else []
    return bytes(group.allgatherv(torch.tensor(mine, dtype=torch.uint8)).tolist()).decode()


def _on_every_rank(work: Callable[[], list[str]], group: ProcessGroup) -> list[str]:
    """Collective: run ``work`` on every rank; if it fails on any, raise on every rank."""
    error: Exception | None = None
    out: list[str] = []
    try:
        out = work()
    except Exception as e:
        error = e
    agree(group, error, "preparing the embedding tables")
    return out


__all__ = ["EXISTING_TABLES", "ExistingTablesError", "prepare_tables"]
