"""Numpy-checked cases for every ``comm`` collective.

Shared by the rank scripts (``comm_collectives.py`` under mpirun / gloo) and the
in-process tests (``tests/comm/test_comm_local.py`` on a ``LocalGroup``). Every rank
builds every rank's input from ``(seed, rank, case name)``, so each rank computes
the expected result with numpy without any communication, and compares.

Values are ``k / den`` with small integers ``k``: exactly representable in the
dtype, and sums over up to 4 ranks (and averages over 1, 2 or 4) stay exact, so
results compare bit for bit. A wrong row, a wrong rank order or a truncation
shows up as a mismatch, not as rounding noise.
"""

from __future__ import annotations

import time
import warnings
import zlib
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager

import numpy as np
import torch

import comm

DTYPES = (torch.float32, torch.float64, torch.int64)
HALF = (torch.float16, torch.bfloat16)

# dtype -> (largest |k|, denominator): value = k / den.
_GRID: dict[torch.dtype, tuple[int, int]] = {
    torch.float32: (1000, 8),
    torch.float64: (1000, 8),
    torch.int64: (1000, 1),
    torch.float16: (32, 4),
    torch.bfloat16: (16, 2),
}


# ----------------------------------------------------------------------- data


def values(seed: int, rank: int, shape: Sequence[int], dtype: torch.dtype, name: str) -> np.ndarray:
    """Rank ``rank``'s input for case ``name``: float64 (or int64) numpy values."""
    rng = np.random.default_rng([seed, rank, zlib.crc32(name.encode())])
    lim, den = _GRID[dtype]
    k = np.asarray(rng.integers(-lim, lim + 1, size=tuple(shape)), dtype=np.int64)
    return k if dtype == torch.int64 else k / den


def tensor(a: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
    return torch.from_numpy(np.array(a)).to(dtype).contiguous()


def check(what: str, got: object, want: np.ndarray, dtype: torch.dtype) -> None:
    """``got`` is a tensor of ``dtype`` and ``want``'s shape holding ``want``'s values, bit
    for bit: the values lie on the grid of :data:`_GRID`, so every sum over up to 4 ranks
    and every average over 1, 2 or 4 is exact in ``dtype``, in any order and on any CPU
    (sums only, never an average, on the sub-groups of 3)."""
    assert isinstance(got, torch.Tensor), f"{what}: got {type(got).__name__}, expected a tensor"
    assert got.dtype == dtype, f"{what}: got dtype {got.dtype}, expected {dtype}"
    assert tuple(got.shape) == want.shape, (
        f"{what}: got shape {tuple(got.shape)}, expected {want.shape}"
    )
    ref = torch.int64 if dtype == torch.int64 else torch.float64
    g = got.detach().cpu().to(ref).numpy()
    np.testing.assert_array_equal(g, want, err_msg=what)


def reduce(stack: list[np.ndarray], op: str) -> np.ndarray:
    a = np.stack(stack)
    if op == "sum":
        return a.sum(axis=0)
    if op == "max":
        return a.max(axis=0)
    assert op == "avg"
    return a.sum(axis=0) / len(stack)


def name_of(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


class Cases:
    """Runs named cases on ``group`` and counts them; a failure names the case and rank."""

    def __init__(self, group: comm.ProcessGroup, seed: int) -> None:
        self.group = group
        self.seed = seed
        self.count = 0

    @contextmanager
    def case(self, name: str) -> Iterator[None]:
        self.count += 1
        try:
            yield
        except BaseException as e:
            g = self.group
            e.add_note(f"comm case {name!r} on rank {g.rank} of {g.size} ({g.backend})")
            raise

    def vals(self, rank: int, shape: Sequence[int], dtype: torch.dtype, name: str) -> np.ndarray:
        return values(self.seed, rank, shape, dtype, name)


# ---------------------------------------------------------------- collectives


def allreduce_cases(c: Cases) -> None:
    g = c.group
    shapes: list[tuple[int, ...]] = [(), (7,), (3, 5), (0,)]
    for op in ("sum", "avg", "max"):
        for dtype in DTYPES + HALF:
            if op == "avg" and dtype == torch.int64:
                continue
            for shape in shapes:
                name = f"allreduce/{op}/{name_of(dtype)}/{shape}"
                with c.case(name):
                    ins = [c.vals(r, shape, dtype, name) for r in range(g.size)]
                    t = tensor(ins[g.rank], dtype)
                    out = g.allreduce(t, op=op)
                    assert out is t, f"{name}: allreduce must work in place and return its tensor"
                    check(name, t, reduce(ins, op), dtype)
    # One big buffer: several MB, past every eager/rendezvous threshold.
    for op, dtype in (("sum", torch.float32), ("max", torch.int64), ("avg", torch.bfloat16)):
        name = f"allreduce/big/{op}/{name_of(dtype)}"
        with c.case(name):
            ins = [c.vals(r, (256, 1024), dtype, name) for r in range(g.size)]
            t = tensor(ins[g.rank], dtype)
            check(name, g.allreduce(t, op), reduce(ins, op), dtype)
    name = "allreduce/ReduceOp.SUM"
    with c.case(name):
        ins = [c.vals(r, (4,), torch.float32, name) for r in range(g.size)]
        t = tensor(ins[g.rank], torch.float32)
        check(name, g.allreduce(t, comm.ReduceOp.SUM), reduce(ins, "sum"), torch.float32)


def broadcast_cases(c: Cases) -> None:
    g = c.group
    roots = sorted({0, g.size - 1, g.size // 2})
    for dtype in DTYPES + HALF:
        for root in roots:
            for shape in ((5,), (2, 3)):
                name = f"broadcast/{name_of(dtype)}/root{root}/{shape}"
                with c.case(name):
                    ins = [c.vals(r, shape, dtype, name) for r in range(g.size)]
                    t = tensor(ins[g.rank], dtype)
                    out = g.broadcast(t, root=root)
                    assert out is t, f"{name}: broadcast must work in place and return its tensor"
                    check(name, t, ins[root], dtype)
    name = "broadcast/big"
    with c.case(name):
        ins = [c.vals(r, (200_000,), torch.float64, name) for r in range(g.size)]
        t = tensor(ins[g.rank], torch.float64)
        check(name, g.broadcast(t, root=g.size - 1), ins[g.size - 1], torch.float64)


def allgather_cases(c: Cases) -> None:
    g = c.group
    for dtype in DTYPES + HALF:
        for shape in ((), (4,), (2, 3)):
            name = f"allgather/{name_of(dtype)}/{shape}"
            with c.case(name):
                ins = [c.vals(r, shape, dtype, name) for r in range(g.size)]
                t = tensor(ins[g.rank], dtype)
                out = g.allgather(t)
                check(name, out, np.stack(ins), dtype)  # [size, *shape]
                check(f"{name} (input untouched)", t, ins[g.rank], dtype)


ALLGATHERV_ROWS = (3, 0, 5, 1)  # rank r has ALLGATHERV_ROWS[r % 4] rows; rank 1 has none


def allgatherv_cases(c: Cases) -> None:
    g = c.group
    for dtype in DTYPES:
        for tail in ((), (3,)):
            name = f"allgatherv/{name_of(dtype)}/tail{tail}"
            with c.case(name):
                ins = [
                    c.vals(r, (ALLGATHERV_ROWS[r % 4], *tail), dtype, name) for r in range(g.size)
                ]
                out = g.allgatherv(tensor(ins[g.rank], dtype))
                check(name, out, np.concatenate(ins), dtype)  # [sum(rows), *tail]
    name = "allgatherv/equal_rows"
    with c.case(name):
        ins = [c.vals(r, (2, 2), torch.float32, name) for r in range(g.size)]
        check(
            name,
            g.allgatherv(tensor(ins[g.rank], torch.float32)),
            np.concatenate(ins),
            torch.float32,
        )


def reduce_scatter_cases(c: Cases) -> None:
    g = c.group
    n = 3
    for op in ("sum", "avg", "max"):
        for dtype in DTYPES + HALF:
            if op == "avg" and dtype == torch.int64:
                continue
            for tail in ((), (4,)):
                name = f"reduce_scatter/{op}/{name_of(dtype)}/tail{tail}"
                with c.case(name):
                    ins = [c.vals(r, (g.size * n, *tail), dtype, name) for r in range(g.size)]
                    out = g.reduce_scatter(tensor(ins[g.rank], dtype), op=op)
                    want = reduce(ins, op)[g.rank * n : (g.rank + 1) * n]  # [n, *tail]
                    check(name, out, want, dtype)


def split_matrix(size: int, pattern: str, seed: int) -> np.ndarray:
    """``S[src, dst]``: rows rank ``src`` sends to rank ``dst``."""
    rng = np.random.default_rng([seed, 77, size, zlib.crc32(pattern.encode())])
    if pattern == "even":
        return np.full((size, size), 2, dtype=np.int64)
    s = rng.integers(0, 6, size=(size, size)).astype(np.int64)
    if pattern == "uneven":
        s[0, size - 1] = 7  # at least one nonzero and uneven
    elif pattern == "zero_pairs":  # some pairs exchange nothing
        s[(np.add.outer(np.arange(size), np.arange(size)) % 3) == 0] = 0
    elif pattern == "silent_sender":  # the last rank sends nothing at all
        s[size - 1, :] = 0
    elif pattern == "deaf_receiver":  # nobody sends to rank 0
        s[:, 0] = 0
    elif pattern == "all_empty":
        s[:] = 0
    elif pattern == "large":
        s = rng.integers(3000, 6000, size=(size, size)).astype(np.int64)
    else:
        raise AssertionError(pattern)
    return s


PATTERNS = ("even", "uneven", "zero_pairs", "silent_sender", "deaf_receiver", "all_empty", "large")


def alltoallv_once(
    c: Cases,
    name: str,
    s: np.ndarray,
    dtype: torch.dtype,
    tail: tuple[int, ...],
    given_recv: bool,
    *,
    ranks_vals: Callable[[int, tuple[int, ...]], np.ndarray] | None = None,
) -> None:
    """One alltoallv with split matrix ``s``, checked against numpy."""
    g = c.group
    size, me = g.size, g.rank

    def vals(r: int, shape: tuple[int, ...]) -> np.ndarray:
        return ranks_vals(r, shape) if ranks_vals else c.vals(r, shape, dtype, name)

    ins = [vals(r, (int(s[r].sum()), *tail)) for r in range(size)]  # [sum(S[r]), *tail]
    send = [int(x) for x in s[me]]
    recv = [int(x) for x in s[:, me]]
    parts = []
    for src in range(size):
        lo = int(s[src, :me].sum())
        parts.append(ins[src][lo : lo + int(s[src, me])])
    want = np.concatenate(parts)  # [sum(S[:, me]), *tail], peer 0's rows first
    out = g.alltoallv(tensor(ins[me], dtype), send, recv if given_recv else None)
    check(name, out, want, dtype)


def alltoallv_cases(c: Cases) -> None:
    g = c.group
    dtypes = DTYPES + HALF
    i = 0
    for pattern in PATTERNS:
        s = split_matrix(g.size, pattern, c.seed)
        for tail in ((), (3,)) if pattern != "large" else ((16,),):
            for given in (True, False):
                dtype = dtypes[i % len(dtypes)]
                i += 1
                name = f"alltoallv/{pattern}/{name_of(dtype)}/tail{tail}/recv_given={given}"
                with c.case(name):
                    alltoallv_once(c, name, s, dtype, tail, given)
    s = split_matrix(g.size, "uneven", c.seed)
    for dtype in DTYPES:  # every main dtype on an N-D tail
        name = f"alltoallv/3d/{name_of(dtype)}"
        with c.case(name):
            alltoallv_once(c, name, s, dtype, (2, 3), False)
    name = "alltoallv/tuple_splits"
    with c.case(name):
        ins = [c.vals(r, (g.size,), torch.int64, name) for r in range(g.size)]
        out = g.alltoallv(tensor(ins[g.rank], torch.int64), tuple([1] * g.size))
        check(name, out, np.array([ins[r][g.rank] for r in range(g.size)]), torch.int64)


def barrier_cases(c: Cases) -> None:
    g = c.group
    with c.case("barrier/sync"):
        g.barrier()
    with c.case("barrier/async"):
        assert g.barrier_async().wait() is None
    with c.case("barrier/nobody_leaves_early"):
        # Rank 0 arrives late; no rank may leave before the last one entered.
        # Same machine, so time.time() is one clock for all ranks.
        g.barrier()
        if g.rank == 0:
            time.sleep(0.2)
        t_in = time.time()
        g.barrier()
        t_out = time.time()
        times = g.allgather(torch.tensor([t_in, t_out], dtype=torch.float64))  # [size, 2]
        last_in, first_out = float(times[:, 0].max()), float(times[:, 1].min())
        assert first_out >= last_in, (
            f"a rank left the barrier at {first_out:.6f} before the last one entered at "
            f"{last_in:.6f} (times {times.tolist()})"
        )


def p2p_cases(c: Cases) -> None:
    g = c.group
    me, size = g.rank, g.size
    if size == 1:
        return
    right, left = (me + 1) % size, (me - 1) % size
    for dtype in DTYPES + HALF:
        name = f"p2p/ring_async/{name_of(dtype)}"
        with c.case(name):
            ins = [c.vals(r, (3, 4), dtype, name) for r in range(size)]
            buf = torch.zeros((3, 4), dtype=dtype)
            hs = g.send_async(tensor(ins[me], dtype), right, tag=3)
            hr = g.recv_async(buf, left, tag=3)
            out = hr.wait()
            assert hs.wait() is None
            assert out is buf, f"{name}: recv must fill its tensor in place and return it"
            check(name, buf, ins[left], dtype)
    if size % 2 == 0:
        name = "p2p/ring_sync"  # even ranks send first, odd ranks receive first
        with c.case(name):
            ins = [c.vals(r, (50_000,), torch.float64, name) for r in range(size)]
            buf = torch.zeros(50_000, dtype=torch.float64)
            x = tensor(ins[me], torch.float64)
            if me % 2 == 0:
                g.send(x, right)
                out = g.recv(buf, left)
            else:
                out = g.recv(buf, left)
                g.send(x, right)
            assert out is buf
            check(name, buf, ins[left], torch.float64)
    name = "p2p/tags_out_of_order"  # rank 0 sends tag 11 then 12; rank 1 waits 12 first
    with c.case(name):
        a = c.vals(0, (6,), torch.int64, name + "a")
        b = c.vals(0, (2, 2), torch.float32, name + "b")
        if me == 0:
            h1 = g.send_async(tensor(a, torch.int64), 1, tag=11)
            h2 = g.send_async(tensor(b, torch.float32), 1, tag=12)
            h2.wait()
            h1.wait()
        elif me == 1:
            ra, rb = torch.zeros(6, dtype=torch.int64), torch.zeros((2, 2), dtype=torch.float32)
            hb = g.recv_async(rb, 0, tag=12)
            ha = g.recv_async(ra, 0, tag=11)
            check(name + "/tag12", hb.wait(), b, torch.float32)
            check(name + "/tag11", ha.wait(), a, torch.int64)
        g.barrier()


def async_cases(c: Cases) -> None:
    """Several operations in flight at once, waited in an order unlike the issue order."""
    g = c.group
    me, size = g.rank, g.size
    name = "async/many_in_flight"
    with c.case(name):
        f32, f64, i64 = torch.float32, torch.float64, torch.int64
        a = [c.vals(r, (1000,), f32, name + "a") for r in range(size)]
        b = [c.vals(r, (2, 3), i64, name + "b") for r in range(size)]
        d = [c.vals(r, (size * 2, 5), f64, name + "d") for r in range(size)]
        e = [c.vals(r, (4,), f64, name + "e") for r in range(size)]
        s = split_matrix(size, "uneven", c.seed)
        x = [c.vals(r, (int(s[r].sum()), 2), f32, name + "x") for r in range(size)]
        p = [c.vals(r, (9,), i64, name + "p") for r in range(size)]

        ta, te = tensor(a[me], f32), tensor(e[me], f64)
        h_allreduce = g.allreduce_async(ta, "sum")
        h_alltoallv = g.alltoallv_async(tensor(x[me], f32), [int(v) for v in s[me]])
        h_allgather = g.allgather_async(tensor(b[me], i64))
        h_bcast = g.broadcast_async(te, root=size - 1)
        h_rs = g.reduce_scatter_async(tensor(d[me], f64), "avg")
        h_max = g.allreduce_async(tensor(b[me], i64), "max")
        v = [c.vals(r, (ALLGATHERV_ROWS[r % 4], 3), f64, name + "v") for r in range(size)]
        h_gatherv = g.allgatherv_async(tensor(v[me], f64))
        p2p = []
        if size > 1:
            pbuf = torch.zeros(9, dtype=i64)
            p2p = [
                g.send_async(tensor(p[me], i64), (me + 1) % size, tag=5),
                g.recv_async(pbuf, (me - 1) % size, tag=5),
            ]
        h_barrier = g.barrier_async()

        # wait in an order unlike the issue order
        check(name + "/broadcast", h_bcast.wait(), e[size - 1], f64)
        want_x = np.concatenate(
            [x[r][int(s[r, :me].sum()) : int(s[r, : me + 1].sum())] for r in range(size)]
        )
        check(name + "/alltoallv", h_alltoallv.wait(), want_x, f32)
        if p2p:
            check(name + "/recv", p2p[1].wait(), p[(me - 1) % size], i64)
            p2p[0].wait()
        assert h_barrier.wait() is None
        check(name + "/max", h_max.wait(), reduce(b, "max"), i64)
        check(name + "/allgatherv", h_gatherv.wait(), np.concatenate(v), f64)
        out = h_allreduce.wait()
        assert out is ta
        check(name + "/allreduce", ta, reduce(a, "sum"), f32)
        check(name + "/reduce_scatter", h_rs.wait(), reduce(d, "avg")[me * 2 : me * 2 + 2], f64)
        check(name + "/allgather", h_allgather.wait(), np.stack(b), i64)
        # a finished handle keeps its result
        assert h_allreduce.is_completed()
        assert h_allreduce.wait() is ta
        again = h_allgather.wait(timeout=0.001)
        check(name + "/allgather again", again, np.stack(b), i64)

    name = "async/reverse_order_allreduces"
    with c.case(name):
        ins = [
            [c.vals(r, (64,), torch.float32, f"{name}{k}") for r in range(size)] for k in range(8)
        ]
        ts = [tensor(ins[k][me], torch.float32) for k in range(8)]
        hs = [g.allreduce_async(t) for t in ts]
        for k in reversed(range(8)):
            check(f"{name}/{k}", hs[k].wait(), reduce(ins[k], "sum"), torch.float32)


# ----------------------------------------------------------------- sub-groups


def subgroup_cases(c: Cases) -> None:
    g = c.group
    me, size = g.rank, g.size
    splits = {
        "parity": (me % 2, [r for r in range(size) if r % 2 == me % 2]),
        "roles": (  # workers 0..size-2, the last rank alone as the server
            1 if me == size - 1 else 0,
            [size - 1] if me == size - 1 else list(range(size - 1)),
        ),
    }
    for label, (color, members) in splits.items():
        name = f"split/{label}"
        with c.case(name):
            sub = g.split(color)
            try:
                assert sub.size == len(members), f"{name}: size {sub.size}, members {members}"
                assert sub.rank == members.index(me), (
                    f"{name}: sub rank {sub.rank}, expected {members.index(me)} of {members}"
                )
                assert sub.backend == g.backend
                # allreduce of the members' inputs (keyed by global rank)
                ins = [c.vals(r, (10,), torch.float64, name) for r in members]
                t = tensor(c.vals(me, (10,), torch.float64, name), torch.float64)
                check(name + "/allreduce", sub.allreduce(t), reduce(ins, "sum"), torch.float64)
                # alltoallv inside the sub-group, inputs keyed by (color, sub rank)
                s = split_matrix(sub.size, "uneven", c.seed + color)
                sc = Cases(sub, c.seed)

                def sub_vals(
                    r: int, shape: tuple[int, ...], _color: int = color, _name: str = name
                ) -> np.ndarray:
                    return values(c.seed, 1000 * (_color + 1) + r, shape, torch.int64, _name)

                alltoallv_once(
                    sc, name + "/alltoallv", s, torch.int64, (2,), False, ranks_vals=sub_vals
                )
                # the parent still works while the sub-group exists
                ins2 = [c.vals(r, (3,), torch.int64, name + "parent") for r in range(size)]
                t2 = tensor(ins2[me], torch.int64)
                check(name + "/parent", g.allreduce(t2, "max"), reduce(ins2, "max"), torch.int64)
                sub.barrier()
            finally:
                sub.close()

    name = "split/key_reversed"
    with c.case(name):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            sub = g.split(0, key=size - 1 - me)
        try:
            order = sub.allgather(torch.tensor(me, dtype=torch.int64)).tolist()
            if g.backend == "mpi" or size == 1:
                want = list(reversed(range(size)))
                assert sub.rank == size - 1 - me, f"{name}: sub rank {sub.rank}"
                assert order == want, f"{name}: global ranks by sub rank {order}, expected {want}"
            else:
                # torch.distributed orders sub-group ranks by global rank: documented, warned.
                assert order == list(range(size)), f"{name}: {order}"
                assert any("orders sub-group ranks" in str(w.message) for w in caught), (
                    f"{name}: expected a warning that key order is ignored, got "
                    f"{[str(w.message) for w in caught]}"
                )
        finally:
            sub.close()


# ------------------------------------------------------------------- battery

SUITES: dict[str, Callable[[Cases], None]] = {
    "allreduce": allreduce_cases,
    "broadcast": broadcast_cases,
    "allgather": allgather_cases,
    "allgatherv": allgatherv_cases,
    "reduce_scatter": reduce_scatter_cases,
    "alltoallv": alltoallv_cases,
    "barrier": barrier_cases,
    "p2p": p2p_cases,
    "async": async_cases,
    "split": subgroup_cases,
}


def run_battery(group: comm.ProcessGroup, seed: int = 1234, suites: Sequence[str] = ()) -> int:
    """Run the suites (all by default) with validation on, then again with it off.

    Returns the number of cases run; raises on the first failure.
    """
    names = list(suites) or list(SUITES)
    c = Cases(group, seed)
    saved = group.validate
    try:
        for validate in (True, False):
            group.validate = validate
            for n in names:
                SUITES[n](c)
    finally:
        group.validate = saved
    return c.count
