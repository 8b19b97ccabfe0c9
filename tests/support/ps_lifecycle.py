"""The table lifecycle every store must follow, run by each of several workers at once.

:func:`check_lifecycle` is called by ``size`` workers (threads on one store or on their
own clients, or MPI worker ranks), each with its ``rank`` and a ``barrier`` that waits
for all of them. The reference is the contract of ``ps.Store.create_table`` /
``drop_table``: all workers race to create one table with ``exist_ok=True`` and all
succeed on ONE table (each worker's push lands in it: every row pushed once has clock
1 everywhere); a second create without ``exist_ok`` is ``ps.TableExistsError``; another
spec is ``ps.TableSpecMismatch`` naming both shapes whatever ``exist_ok``; a drop
removes the table for everyone and a second drop names the unknown table; the name can
then be created again with the other spec.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

import ps


def _expect(what: str, exc: type[Exception], fn: Callable[[], object], *needles: str) -> str:
    try:
        fn()
    except exc as e:
        missing = [n for n in needles if n not in str(e)]
        assert not missing, f"{what}: message lacks {missing}: {e}"
        return str(e)
    raise AssertionError(f"{what}: no {exc.__name__} raised")


def specs(name: str) -> tuple[ps.TableSpec, ps.TableSpec]:
    """The spec the workers race on, and one that differs only in ``dim``."""
    a = ps.TableSpec(name=name, num_rows=64, dim=4, optimizer=ps.RowWiseAdagrad(lr=0.05))
    b = ps.TableSpec(name=name, num_rows=64, dim=8, optimizer=ps.RowWiseAdagrad(lr=0.05))
    return a, b


def check_lifecycle(
    store: ps.Store, rank: int, size: int, barrier: Callable[[], None], name: str
) -> int:
    """Run the lifecycle as worker ``rank`` of ``size``; returns the number of checks."""
    spec, other = specs(name)
    barrier()
    store.create_table(spec, exist_ok=True)  # everyone at once: one creates, all succeed
    barrier()
    store.push(name, torch.tensor([rank]), torch.ones(1, spec.dim))
    barrier()
    got = store.pull(name, torch.arange(size))
    assert got.clocks.tolist() == [1] * size, f"rank {rank}: not one shared table: {got.clocks}"
    barrier()
    # Creating it again with exist_ok (a second collection on this client) keeps the
    # table as it is: this worker's next push still applies (clock 2, not a "repeat").
    store.create_table(spec, exist_ok=True)
    store.push(name, torch.tensor([rank]), torch.ones(1, spec.dim))
    barrier()
    got = store.pull(name, torch.arange(size))
    assert got.clocks.tolist() == [2] * size, f"rank {rank}: a push after exist_ok lost: {got}"
    assert store.spec(name).to_json() == spec.to_json()
    _expect(
        "create again",
        ps.TableExistsError,
        lambda: store.create_table(spec),
        repr(name),
        "already exists",
        "exist_ok=True",
        f"drop_table({name!r})",
    )
    for exist_ok in (True, False):
        msg = _expect(
            f"another dim (exist_ok={exist_ok})",
            ps.TableSpecMismatch,
            lambda ok=exist_ok: store.create_table(other, exist_ok=ok),  # type: ignore[misc]
            repr(name),
            "64 x 4 rowwise_adagrad(lr=0.05",
            "64 x 8 rowwise_adagrad(lr=0.05",
            f"drop_table({name!r})",
        )
        assert isinstance(ps.TableSpecMismatch(msg), ValueError)
    assert store.spec(name).dim == spec.dim  # the mismatch changed nothing
    barrier()
    if rank == 0:
        store.drop_table(name)
    barrier()
    assert name not in store.tables(), store.tables()
    _expect("drop again", ValueError, lambda: store.drop_table(name), "unknown table", repr(name))
    barrier()
    if rank == 0:
        store.create_table(other)  # the name is free again, for another spec
    barrier()
    store.create_table(other, exist_ok=True)
    got = store.pull(name, torch.tensor([0, 1]))
    assert got.rows.shape == (2, other.dim) and got.clocks.tolist() == [0, 0], got
    barrier()
    if rank == 0:
        store.drop_table(name)
    barrier()
    return 9
