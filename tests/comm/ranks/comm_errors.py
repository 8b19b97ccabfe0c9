"""Rank script: bad input raises ValueError/TypeError on every rank, with the numbers.

Each case is called on every rank; each rank checks that it raised the expected
exception and that the message names the rank, the argument and the offending
numbers. After every case the group must still work: a numpy-checked allreduce
follows each one, and a last one ends the script. Prints ``rank R: ok N errors``.
"""

from __future__ import annotations

import os
from collections.abc import Callable

import numpy as np
import torch

import comm
from tests.comm.ranks.comm_cases import check, reduce, tensor, values


class Errors:
    def __init__(self, group: comm.ProcessGroup) -> None:
        self.group = group
        self.count = 0

    def expect(
        self, name: str, exc: type[Exception], fn: Callable[[], object], *needles: str
    ) -> None:
        """``fn()`` raises ``exc`` here and its message contains every needle."""
        g = self.group
        self.count += 1
        try:
            fn()
        except exc as e:
            msg = str(e)
            missing = [n for n in needles if n not in msg]
            assert not missing, f"{name}: rank {g.rank}: message lacks {missing}: {msg!r}"
        except Exception as e:
            e.add_note(f"{name}: rank {g.rank} expected {exc.__name__}")
            raise
        else:
            raise AssertionError(f"{name}: rank {g.rank} of {g.size}: no {exc.__name__} raised")
        self.still_works(name)

    def still_works(self, name: str) -> None:
        g = self.group
        ins = [values(7, r, (6,), torch.float64, name) for r in range(g.size)]
        t = tensor(ins[g.rank], torch.float64)
        check(
            f"{name}: allreduce after the error", g.allreduce(t), reduce(ins, "sum"), torch.float64
        )


def run_errors(group: comm.ProcessGroup) -> int:
    """Every bad-input case on ``group``; returns how many ran."""
    g, me, size = group, group.rank, group.size
    e = Errors(group)
    f32, f64, i64 = torch.float32, torch.float64, torch.int64
    # --- local checks: every rank passes the same kind of bad input
    strided = torch.zeros((4, 6))[:, ::2]  # [4, 3], strides (6, 2)
    for op, fn in {
        "allreduce": lambda: g.allreduce(strided),
        "broadcast": lambda: g.broadcast(strided),
        "allgather": lambda: g.allgather(strided),
        "alltoallv": lambda: g.alltoallv(strided, [4] + [0] * (size - 1)),
        "send": lambda: g.send(strided, (me + 1) % size) if size > 1 else g.allreduce(strided),
    }.items():
        e.expect(
            f"non-contiguous/{op}",
            ValueError,
            fn,
            f"rank {me}",
            "non-contiguous",
            "(4, 3)",
            "(6, 2)",
        )

    five = torch.zeros((5, 2))
    e.expect(
        "send_splits/sum",
        ValueError,
        lambda: g.alltoallv(five, [1] * size),
        f"rank {me}",
        "send_splits",
        f"add up to {size}",
        "5 rows",
    )
    rows = torch.zeros(size + 1)
    e.expect(
        "send_splits/count",
        ValueError,
        lambda: g.alltoallv(rows, [1] * (size + 1)),
        f"rank {me}",
        f"passed {size + 1} send_splits",
        f"({size})",
    )
    ok = torch.zeros(size)
    e.expect(
        "recv_splits/count",
        ValueError,
        lambda: g.alltoallv(ok, [1] * size, [1] * (size + 2)),
        f"rank {me}",
        f"passed {size + 2} recv_splits",
        f"({size})",
    )
    e.expect(
        "send_splits/negative",
        ValueError,
        lambda: g.alltoallv(ok, [2, -1] + [0] * (size - 2) if size > 1 else [-1]),
        f"rank {me}",
        "negative send_splits",
    )
    e.expect(
        "alltoallv/0-d",
        ValueError,
        lambda: g.alltoallv(torch.tensor(1.0), [1] * size),
        f"rank {me}",
        "0-d",
    )

    e.expect(
        "allgatherv/0-d",
        ValueError,
        lambda: g.allgatherv(torch.tensor(1.0)),
        f"rank {me}",
        "0-d",
    )
    for root in (size, -1):

        def bcast(root: int = root) -> object:
            return g.broadcast(torch.zeros(3), root=root)

        e.expect(
            f"broadcast/root={root}",
            ValueError,
            bcast,
            f"rank {me}",
            f"root={root}",
            f"[0, {size})",
        )
    e.expect(
        "send/dst out of range",
        ValueError,
        lambda: g.send(torch.zeros(2), size),
        f"rank {me}",
        f"dst={size}",
        f"[0, {size})",
    )
    e.expect(
        "recv/src out of range",
        ValueError,
        lambda: g.recv(torch.zeros(2), -1),
        f"rank {me}",
        "src=-1",
        f"[0, {size})",
    )
    e.expect("send/to self", ValueError, lambda: g.send(torch.zeros(2), me), f"rank {me}", "itself")

    ints = torch.arange(2 * size, dtype=i64)
    e.expect(
        "allreduce/avg int",
        TypeError,
        lambda: g.allreduce(ints, "avg"),
        f"rank {me}",
        "avg",
        "int64",
    )
    e.expect(
        "reduce_scatter/avg int",
        TypeError,
        lambda: g.reduce_scatter(ints, "avg"),
        f"rank {me}",
        "avg",
        "int64",
    )
    e.expect(
        "allreduce/unknown op",
        ValueError,
        lambda: g.allreduce(torch.zeros(2), "min"),
        "'min'",
        "'sum'",
        "'avg'",
        "'max'",
    )
    e.expect(
        "allreduce/not a tensor",
        TypeError,
        lambda: g.allreduce(np.zeros(3)),  # type: ignore[arg-type]
        f"rank {me}",
        "ndarray",
        "torch.Tensor",
    )
    e.expect("split/negative color", ValueError, lambda: g.split(-2), f"rank {me}", "-2")
    if size > 1:
        odd = torch.zeros((2 * size + 1, 3))
        e.expect(
            "reduce_scatter/rows",
            ValueError,
            lambda: g.reduce_scatter(odd),
            f"rank {me}",
            f"({2 * size + 1}, 3)",
            f"group size {size}",
        )

    # --- cross-rank checks: one rank disagrees; every rank must raise
    if size > 1:
        bad = size - 1  # the odd one out
        t = torch.zeros(4, dtype=f64 if me == bad else f32)
        e.expect(
            "allreduce/dtype mismatch",
            ValueError,
            lambda: g.allreduce(t),
            "allreduce",
            f"rank {bad}",
            "float64",
            "rank 0",
            "float32",
        )
        t = torch.zeros(5 if me == bad else 4)
        e.expect(
            "allreduce/shape mismatch",
            ValueError,
            lambda: g.allreduce(t),
            "allreduce",
            f"rank {bad}",
            "(5,)",
            "(4,)",
        )
        t = torch.zeros((2, 3) if me == bad else (3, 2))
        e.expect(
            "broadcast/shape mismatch",
            ValueError,
            lambda: g.broadcast(t),
            "broadcast",
            f"rank {bad}",
            "(2, 3)",
            "(3, 2)",
        )
        t = torch.zeros(3, dtype=i64 if me == bad else f32)
        e.expect(
            "allgather/dtype mismatch",
            ValueError,
            lambda: g.allgather(t),
            "allgather",
            f"rank {bad}",
            "int64",
            "float32",
        )
        t = torch.zeros((2 * size, 4 if me == bad else 3))
        e.expect(
            "reduce_scatter/shape mismatch",
            ValueError,
            lambda: g.reduce_scatter(t),
            "reduce_scatter",
            f"rank {bad}",
            f"({2 * size}, 4)",
            f"({2 * size}, 3)",
        )
        t = torch.zeros((size, 3), dtype=i64 if me == bad else f32)
        e.expect(
            "alltoallv/dtype mismatch",
            ValueError,
            lambda: g.alltoallv(t, [1] * size),
            "alltoallv",
            f"rank {bad}",
            "int64",
            "float32",
        )
        t = torch.zeros((size, 4 if me == bad else 3))
        e.expect(
            "alltoallv/row shape mismatch",
            ValueError,
            lambda: g.alltoallv(t, [1] * size),
            "alltoallv",
            f"rank {bad}",
            "4)",
            "3)",
        )
        t = torch.zeros((size + me, 2))  # row counts may differ: not an error
        out = g.allgatherv(t)
        assert tuple(out.shape) == (sum(size + r for r in range(size)), 2), out.shape
        # every rank expects 3 rows from rank 0, which sends 2 to everyone
        t = torch.zeros(2 * size)
        recv = [3] + [2] * (size - 1)
        e.expect(
            "recv_splits/all disagree",
            ValueError,
            lambda: g.alltoallv(t, [2] * size, recv),
            f"rank {me}",
            "recv_splits[0]=3",
            "rank 0 sends 2",
        )
        # only the last rank expects a wrong count from rank 0; the others' calls are
        # right, yet every rank must raise (not hang in the exchange)
        recv = [3 if me == bad else 2] + [2] * (size - 1)
        needles = [f"rank {bad}", "recv_splits"]
        if me == bad:
            needles += ["recv_splits[0]=3", "rank 0 sends 2"]
        e.expect(
            "recv_splits/one rank disagrees",
            ValueError,
            lambda: g.alltoallv(t, [2] * size, recv),
            *needles,
        )

    e.still_works("final")
    group.barrier()
    return e.count


def main() -> None:
    backend = os.environ.get("HYBRIDREC_TEST_BACKEND", "auto")
    group = comm.init(backend, timeout_s=60.0)
    try:
        n = run_errors(group)
    finally:
        group.close()
    print(f"rank {group.rank}: ok {n} errors", flush=True)


if __name__ == "__main__":
    main()
