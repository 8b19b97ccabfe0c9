"""Rank script: every collective on device tensors equals the same collective on CPU tensors.

``run(group, [device])``: ``device`` is ``cuda`` (this rank's GPU by local rank, so two
ranks may share one; mpi and gloo stage the tensors through pinned host blocks, nccl
moves them itself) or ``cpu``, where ``force_staging`` (tests/support/staged_groups.py)
sends CPU tensors through the same staging path, so it runs without a GPU.

Each case runs twice on identical inputs (seeded by rank and case): on CPU tensors with
no staging (the reference, itself checked against numpy by comm_suite.py), then on the
device. The device result must be bit-identical (the inputs are small multiples of a
power of two, so every sum and average is exact in any order: see ``GRID``), of the same
dtype and shape, on the input's device, and in place where the collective is in place.
Covered: allreduce (sum, avg, max; float32/64, int64, float16, bfloat16; 0-d, empty and
2 MB tensors), broadcast, allgather, allgatherv (a rank with no rows), reduce_scatter, alltoallv
(uneven and zero splits, N-D rows, recv_splits given or learned), send/recv, several
operations in flight waited in reverse order, barrier, a sub-group, validation off.
Staged runs also check that the pool reuses its blocks (a repeated operation allocates
nothing) and holds no block once every handle was waited; and first, that CPU tensors
(no ``force_staging``) never go near the pool.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable, Sequence

import torch

import comm
from tests.support.staged_groups import force_staging

DTYPES = (torch.float32, torch.float64, torch.int64, torch.float16, torch.bfloat16)


# dtype -> (largest |k|, denominator) of the float inputs k / den: exact in the dtype, and
# so are their sums over up to 4 ranks and averages over 1, 2 or 4, in any order. The
# device's reduction (nccl's ring, a staged copy's) may add in another order than the CPU
# run: with these values the results are still the same bits, so bit for bit is the check.
GRID: dict[torch.dtype, tuple[int, int]] = {
    torch.float32: (1000, 8),
    torch.float64: (1000, 8),
    torch.float16: (32, 4),
    torch.bfloat16: (16, 2),
}


def make(seed: str, rank: int, shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
    """Rank ``rank``'s CPU input for case ``seed``."""
    gen = torch.Generator().manual_seed(zlib.crc32(f"{seed}/{rank}".encode()))
    if dtype == torch.int64:
        return torch.randint(-1000, 1000, tuple(shape), generator=gen)
    lim, den = GRID[dtype]
    k = torch.randint(-lim, lim + 1, tuple(shape), generator=gen, dtype=torch.int64)
    return (k.double() / den).to(dtype)


class DeviceCases:
    """Runs each case on CPU tensors, then on ``device``, and compares."""

    def __init__(self, group: comm.ProcessGroup, device: torch.device) -> None:
        self.group = group
        self.device = device
        self.staged = group.backend in ("mpi", "gloo")  # host backends stage device tensors
        self.force = device.type == "cpu"  # CPU run: force the staging path
        self.count = 0

    def fail(self, name: str, msg: str) -> None:
        g = self.group
        raise AssertionError(f"rank {g.rank}/{g.size} ({g.backend}, {self.device}) {name}: {msg}")

    def both(
        self,
        name: str,
        op: Callable[..., object],
        inputs: Sequence[torch.Tensor],
        *,
        in_place: bool = False,
    ) -> None:
        """``op(*inputs)`` on CPU copies (no staging) and on device copies; compare."""
        g = self.group
        self.count += 1
        force_staging(g, False)
        want = op(*[t.clone() for t in inputs])
        force_staging(g, self.force)
        dev = [t.to(self.device) for t in inputs]
        before = [t.clone() for t in dev]
        got = op(*dev)
        force_staging(g, False)
        self.same(name, got, want)
        if in_place and got is not dev[0]:
            self.fail(name, "an in-place collective must return the tensor it was given")
        if not in_place:
            for t, b in zip(dev, before, strict=True):
                if not torch.equal(t, b):
                    self.fail(name, "the input tensor was modified")

    def same(self, name: str, got: object, want: object) -> None:
        if want is None:
            if got is not None:
                self.fail(name, f"expected None, got {type(got).__name__}")
            return
        assert isinstance(want, torch.Tensor)
        if not isinstance(got, torch.Tensor):
            self.fail(name, f"expected a tensor, got {type(got).__name__}")
        assert isinstance(got, torch.Tensor)
        if got.device != self.device:
            self.fail(name, f"result on {got.device}, the input was on {self.device}")
        if got.dtype != want.dtype or got.shape != want.shape:
            self.fail(
                name,
                f"got {got.dtype} {tuple(got.shape)}, the CPU run gave {want.dtype} "
                f"{tuple(want.shape)}",
            )
        if not torch.equal(got.cpu(), want):
            diff = (got.cpu().double() - want.double()).abs().max().item()
            self.fail(name, f"differs from the CPU run by up to {diff:.3g}")


def collective_cases(c: DeviceCases) -> None:
    g = c.group
    me, size = g.rank, g.size
    for op in ("sum", "avg", "max"):
        for dtype in DTYPES:
            if op == "avg" and dtype == torch.int64:
                continue
            for shape in ((), (7,), (3, 5), (0,)):
                name = f"allreduce/{op}/{dtype}/{shape}"
                c.both(
                    name,
                    lambda t, op=op: g.allreduce(t, op),
                    [make(name, me, shape, dtype)],
                    in_place=True,
                )
    name = "allreduce/big"  # 2 MB: past MPI's eager limit, a large block class
    big = [make(name, me, (512, 1024), torch.float32)]
    c.both(name, lambda t: g.allreduce(t, "avg"), big, in_place=True)
    for dtype in DTYPES:
        for root in sorted({0, size - 1}):
            name = f"broadcast/{dtype}/root{root}"
            c.both(
                name,
                lambda t, root=root: g.broadcast(t, root),
                [make(name, me, (2, 3), dtype)],
                in_place=True,
            )
        for shape in ((), (4,), (2, 3)):
            name = f"allgather/{dtype}/{shape}"
            c.both(name, g.allgather, [make(name, me, shape, dtype)])
        for tail in ((), (3,)):
            name = f"allgatherv/{dtype}/{tail}"
            rows = (3, 0, 5, 1)[me % 4]
            c.both(name, g.allgatherv, [make(name, me, (rows, *tail), dtype)])
        for op in ("sum", "avg", "max"):
            if op == "avg" and dtype == torch.int64:
                continue
            name = f"reduce_scatter/{op}/{dtype}"
            c.both(
                name,
                lambda t, op=op: g.reduce_scatter(t, op),
                [make(name, me, (size * 3, 4), dtype)],
            )
    for i, tail in enumerate(((), (2, 3), (16,))):
        for given in (True, False):
            dtype = DTYPES[(2 * i + int(given)) % len(DTYPES)]
            name = f"alltoallv/{dtype}/{tail}/given={given}"
            # S[src][dst] rows; pairs with (src + dst) % 3 == 0 exchange nothing.
            s = [[0 if (a + b) % 3 == 0 else 1 + (a * 7 + b * 3 + i) % 4 for b in range(size)]
                 for a in range(size)]  # fmt: skip
            send = s[me]
            recv = [s[src][me] for src in range(size)] if given else None
            c.both(
                name,
                lambda t, send=send, recv=recv: g.alltoallv(t, send, recv),
                [make(name, me, (sum(send), *tail), dtype)],
            )
    if size > 1:
        right, left = (me + 1) % size, (me - 1) % size
        for dtype in (torch.float32, torch.bfloat16, torch.int64):
            name = f"p2p/ring/{dtype}"

            def ring(x: torch.Tensor, name: str = name) -> torch.Tensor:
                buf = torch.zeros_like(x)  # on x's device
                hs = g.send_async(x, right, tag=7)
                out = g.recv_async(buf, left, tag=7).wait()
                if hs.wait() is not None:
                    c.fail(name, "a send's handle must return None")
                if out is not buf:
                    c.fail(name, "recv must fill its tensor in place and return it")
                return out

            c.both(name, ring, [make(name, me, (3, 4), dtype)])
    name = "async/reverse_order"

    def many(a: torch.Tensor, b: torch.Tensor, d: torch.Tensor, e: torch.Tensor) -> torch.Tensor:
        # The results of all five, flattened; ``a`` and ``e`` are changed in place.
        a, e = a.clone(), e.clone()
        hs = [
            g.allreduce_async(a, "sum"),
            g.allgather_async(b),
            g.reduce_scatter_async(d, "avg"),
            g.broadcast_async(e, size - 1),
            g.barrier_async(),
        ]
        out = [h.wait() for h in reversed(hs)]
        if out[0] is not None:
            c.fail(name, "barrier must return None")
        parts = [out[4], out[3].reshape(-1), out[2].reshape(-1), out[1].reshape(-1)]
        return torch.cat([p.reshape(-1).double() for p in parts])

    c.both(
        name,
        many,
        [
            make(name + "a", me, (1000,), torch.float32),
            make(name + "b", me, (2, 3), torch.float64),
            make(name + "d", me, (size * 2, 5), torch.float64),
            make(name + "e", me, (6,), torch.float32),
        ],
    )
    name = "split/parity"
    sub = g.split(me % 2)
    try:
        sub_cases = DeviceCases(sub, c.device)
        sub_cases.both(
            name,
            lambda t: sub.allreduce(t, "sum"),
            [make(name, me, (10,), torch.float64)],
            in_place=True,
        )
        sub_cases.both(name + "/allgather", sub.allgather, [make(name, me, (4,), torch.int64)])
        c.count += sub_cases.count
    finally:
        sub.close()


def check_pool(c: DeviceCases) -> None:
    """Staged: a repeated operation takes its blocks from the pool; none stays in use."""
    g = c.group
    pool = g.staging_pool
    if pool is None:
        c.fail("pool", "staged collectives ran but the group has no staging pool")
    assert pool is not None
    if pool.pin != torch.cuda.is_available():
        c.fail("pool", f"pin={pool.pin}, but torch.cuda.is_available()={torch.cuda.is_available()}")
    force_staging(g, c.force)
    try:
        x = make("pool", g.rank, (300, 100), torch.float32).to(c.device)
        g.allreduce(x)
        g.allgather(x)  # the first of each size class allocates
        before = dict(pool.stats)
        for _ in range(3):
            g.allreduce(x)
            g.allgather(x)
        after = pool.stats
        if after["allocated"] != before["allocated"] or after["reused"] <= before["reused"]:
            c.fail("pool", f"repeated operations allocated blocks: {before} -> {after}")
        in_use = after["allocated"] - pool.free_blocks()
        if in_use:
            c.fail("pool", f"{in_use} blocks still in use after every handle was waited")
    finally:
        force_staging(g, False)


def check_cpu_path_untouched(c: DeviceCases) -> None:
    """CPU tensors without ``force_staging`` never reach the staging pool."""
    g = c.group
    pool = g.staging_pool
    before = None if pool is None else dict(pool.stats)
    t = make("cpu-path", g.rank, (64,), torch.float32)
    g.allreduce(t)
    g.allgather(t)
    g.alltoallv(t, [64 // g.size] * (g.size - 1) + [64 - 64 // g.size * (g.size - 1)])
    after = None if g.staging_pool is None else dict(g.staging_pool.stats)
    if after != before:
        c.fail("cpu path", f"CPU tensors went through the staging pool: {before} -> {after}")


def device_of(name: str) -> torch.device:
    if name == "cpu":
        return torch.device("cpu")
    return comm.resolve_device(name, comm.detect_launch().local_rank)


def run(group: comm.ProcessGroup, args: list[str]) -> None:
    """``args[0]``: ``cpu`` or ``cuda`` (also called by battery.py)."""
    device = device_of(args[0] if args else "cpu")
    c = DeviceCases(group, device)
    check_cpu_path_untouched(c)
    saved = group.validate
    try:
        for validate in (True, False):
            group.validate = validate
            collective_cases(c)
    finally:
        group.validate = saved
    if c.staged:
        check_pool(c)
    print(
        f"rank {group.rank}/{group.size} {group.backend} comm_device {args[0]}: ok "
        f"({c.count} cases)",
        flush=True,
    )


if __name__ == "__main__":
    from tests.support.ranks.rank_main import run_main

    run_main(run)
