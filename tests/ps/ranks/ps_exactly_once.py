"""Rank script: exactly-once pushes of the MPI (and Redis) store with lost replies injected.

Run as ``mpirun -n N python ps_exactly_once.py --servers S --drop K [--control]``:
the last ``S`` ranks serve with ``tests.support.ps_faults.serve_mpi_lossy`` (every K-th
applied push gets no reply, as if it were lost), the others are workers whose
``MPIStore`` resends a push after ``push_retry_s`` = 0.25 s.

Each worker pushes a known sequence (several in flight) to two tables:

* ``shared``: SGD (lr 0.5, rows zeroed first) on gradients that are multiples
  of 1/8, all workers on overlapping ids, so every partial sum is exact and the
  rows must equal the exact sum whatever the interleaving;
* ``own<r>``: worker r's own Adam table on a dynamic id space, so the sequential
  reference (an InProcessStore fed each push exactly once, in order) must agree
  row for row, within the replay tolerance of its pushes (``ps_reference.Replay``: the
  store's kernels may round otherwise, e.g. Redis in doubles). A repeat, applied twice
  or late, moves a row by about Adam's lr, far past that.

The Redis tests (``tests/ps/test_ps_exactly_once.py``) use the same sequences and
references from their own process.

Worker 0 then compares rows and clocks with the references and prints
``rank 0: result match`` or ``rank 0: result mismatch <what>``. With
``--control`` the same job then runs a second session (servers serve again, the
workers open stores whose pushes carry no sequence numbers) and prints ``rank 0:
control ...``: there a mismatch is the expected outcome, which shows that the check
can fail. Counters: pushes issued (summed over workers), applied and repeated (the
servers'), resends.
"""

from __future__ import annotations

import argparse
import json
import time
from collections import deque
from typing import TYPE_CHECKING

import numpy as np
import torch

import comm
import ps
from ps.mpi import wire
from tests.support.ps_reference import RecordingStore
from tests.support.tolerance import assert_same, max_abs_diff

if TYPE_CHECKING:
    from ps.mpi.store import MPIStore

DIM = 4
ROWS = 64
STEPS = 24


def shared_pushes(rank: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(100 + rank)
    out = []
    for _ in range(STEPS):
        ids = torch.randint(0, ROWS, (16,), generator=g)
        grads = torch.randint(-8, 9, (16, DIM), generator=g).to(torch.float32) / 8
        out.append((ids, grads))
    return out


def own_pushes(rank: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(200 + rank)
    return [
        (torch.randint(-20, 20, (12,), generator=g), torch.randn(12, DIM, generator=g))
        for _ in range(STEPS)
    ]


def shared_spec() -> ps.TableSpec:
    return ps.TableSpec(name="shared", num_rows=ROWS, dim=DIM, optimizer=ps.SGD(lr=0.5))


def own_spec(rank: int) -> ps.TableSpec:
    return ps.TableSpec(name=f"own{rank}", num_rows=None, dim=DIM, optimizer=ps.Adam(lr=0.05))


def push_all(store: ps.Store, rank: int, *, own_in_order: bool = False) -> None:
    """Both sequences interleaved, at most 3 handles in flight; every other step
    pushes both tables in one batched request (``push_many_async``).

    ``own_in_order``: each push of the Adam table is waited before the next request
    (the Redis store creates a new row in a second round trip when the push is
    waited, so with several in flight a later push may reach a new row first; Adam
    is order-sensitive)."""
    inflight: deque[comm.Handle] = deque()
    steps = zip(shared_pushes(rank), own_pushes(rank), strict=True)
    for k, ((si, sg), (oi, og)) in enumerate(steps):
        if k % 2:
            if len(inflight) == 3:
                inflight.popleft().wait()
            batch = [ps.PushRequest("shared", si, sg), ps.PushRequest(f"own{rank}", oi, og)]
            inflight.append(store.push_many_async(batch))
            if own_in_order:
                while inflight:
                    inflight.popleft().wait()
            continue
        for table, ids, grads in (("shared", si, sg), (f"own{rank}", oi, og)):
            if len(inflight) == 3:
                inflight.popleft().wait()
            inflight.append(store.push_async(table, ids, grads))
            if own_in_order and table != "shared":
                while inflight:
                    inflight.popleft().wait()
    while inflight:
        inflight.popleft().wait()


def zero_shared(store: ps.Store) -> None:
    """Zero the shared rows (one push of ``2 * rows`` at lr 0.5): then every sum is exact."""
    everything = torch.arange(ROWS)
    store.push("shared", everything, 2 * store.pull("shared", everything).rows)


def compare(store: ps.Store, workers: int) -> str:
    """'match' or 'mismatch <what>' against the exact sum and the sequential references."""
    ids = torch.arange(ROWS)
    total = np.zeros((ROWS, DIM))
    clocks = np.ones(ROWS, dtype=np.int64)  # the zeroing push
    for r in range(workers):
        for i, g in shared_pushes(r):
            np.add.at(total, i.numpy(), g.numpy().astype(np.float64))
            clocks[np.unique(i.numpy())] += 1
    want = (-0.5 * torch.from_numpy(total)).float()
    got = store.pull("shared", ids)
    problems = []
    # Bit for bit: rows from 0, lr 1/2, multiples of 1/8, so every partial sum and every
    # update is exact in float32 (and in Redis's doubles) in any order.
    if not torch.equal(got.rows, want):
        problems.append(f"shared rows (max error {float((got.rows - want).abs().max()):.3g})")
    if not torch.equal(got.clocks, torch.from_numpy(clocks)):
        problems.append("shared clocks")
    for r in range(workers):
        ref = RecordingStore()  # remembers the pushes, for the tolerance
        ref.create_table(own_spec(r))
        for i, g in own_pushes(r):
            ref.push(f"own{r}", i, g)
        probe = torch.arange(-25, 25)
        a, b = store.pull(f"own{r}", probe), ref.pull(f"own{r}", probe)
        if max_abs_diff(a.rows, b.rows) > ref.rows_tol(f"own{r}", probe):
            problems.append(f"own{r} rows")
        if not torch.equal(a.clocks, b.clocks):
            problems.append(f"own{r} clocks")
    return "match" if not problems else "mismatch " + ", ".join(problems)


# ---------------------------------------------------------------- hand-made bad messages


def raw_request(store: MPIStore, meta: bytes, data: bytes | None, rid: int) -> str:
    """Send ``meta`` (and ``data``, unless None) as raw bytes to server 0; return the text of
    the error reply (AssertionError if the reply is not an error or does not come)."""
    from mpi4py import MPI

    c, dest = store._comm, store.server_ranks[0]  # private: a test of the wire protocol
    reply = np.zeros(wire.HEADER_LEN + wire.ERROR_WORDS, dtype=np.int64)
    junk = np.empty(1 << 10, dtype=np.float32)
    meta_tag, data_tag = wire.reply_tags(rid, store._tag_ub)
    m = np.frombuffer(meta, dtype=np.uint8).copy()
    reqs = [
        c.Irecv([reply, MPI.INT64_T], source=dest, tag=meta_tag),
        c.Irecv([junk, MPI.FLOAT], source=dest, tag=data_tag),
        c.Isend([m, MPI.BYTE], dest=dest, tag=wire.TAG_REQUEST),
    ]
    if data is not None:
        d = np.frombuffer(data, dtype=np.uint8).copy()
        reqs.append(c.Isend([d, MPI.BYTE], dest=dest, tag=wire.TAG_REQUEST_DATA))
    deadline = time.monotonic() + 20.0
    while not MPI.Request.Testall(reqs):
        assert time.monotonic() < deadline, "no reply to a bad message: the server hangs?"
    try:
        wire.raise_if_error(reply, "")
    except (ValueError, TypeError, RuntimeError) as e:
        return str(e)
    raise AssertionError(f"a bad message got a normal reply: {reply[: wire.HEADER_LEN]}")


def bad_wire_checks(store: MPIStore) -> int:
    """Messages only a server can refuse: each gets an error reply and changes nothing."""
    index = store._table("shared").index[0]
    ids = np.array([1, 2], dtype=np.int64)
    grads = np.ones(2 * DIM, dtype=np.float32).tobytes()

    def head(rid: int, op: int = wire.Op.PUSH, **kw: int) -> list[int]:
        fields = dict(table=index, n=2, dim=DIM)
        fields.update(kw)
        return wire.header(op, rid, **fields)

    def msg(h: list[int], *payload: np.ndarray) -> bytes:
        return wire.message(h, *payload).tobytes()

    session = np.array([7], dtype=np.int64)
    cases = [
        ("not whole words", lambda r: (b"x" * 13, grads), "whole number of 8-byte"),
        (
            "short header",
            lambda r: (np.array([wire.MAGIC_VERSION, 5, r], np.int64).tobytes(), grads),
            "shorter than",
        ),
        ("bad magic", lambda r: (msg([1, 5, r, 0, 2, DIM, 0, 0], ids), grads), "magic"),
        ("huge n", lambda r: (msg(head(r, n=wire.MAX_IDS + 1), ids), grads), "n <= "),
        ("negative n", lambda r: (msg(head(r, n=-2), ids), grads), "n <= "),
        ("negative dim", lambda r: (msg(head(r, dim=-4), ids), grads), "width -4"),
        ("table index", lambda r: (msg(head(r, table=-5), ids), grads), "table index -5"),
        ("table index big", lambda r: (msg(head(r, table=1 << 40), ids), grads), "table index"),
        ("data not floats", lambda r: (msg(head(r), ids), b"abcdef"), "4-byte words"),
        ("data too short", lambda r: (msg(head(r), ids), grads[:8]), "sizes"),
        ("payload vs n", lambda r: (msg(head(r, n=3), ids), grads), "sizes"),
        (
            "seq without session",
            lambda r: (msg(head(r, flags=wire.FLAG_SEQ, arg=1), ids), grads),
            "sizes",
        ),
        (
            "pull data",
            lambda r: (msg(head(r, op=wire.Op.PULL), ids), grads),
            "sizes",
        ),
        (
            "text bytes",
            lambda r: (msg(wire.header(wire.Op.LOOKUP, r, arg=999), session), b""),
            "bytes of text",
        ),
        ("no data message", lambda r: (msg(head(r), ids, session), None), "did not follow"),
    ]
    before = store.pull("shared", torch.arange(ROWS))
    for what, make, needle in cases:
        rid = store._next_id
        store._next_id += 1
        meta, data = make(rid)
        # A message the server cannot parse is answered on request id 0's tags.
        text = raw_request(store, meta, data, rid if len(meta) >= 24 else 0)
        assert needle in text, f"{what}: error reply {text!r} lacks {needle!r}"
        after = store.pull("shared", torch.arange(ROWS))
        assert_same(after.rows, before.rows, what=what, why="a refused message writes nothing")
        assert torch.equal(after.clocks, before.clocks), f"{what}: clocks changed"
    return len(cases)


def worker_phase(store: MPIStore, mates: comm.ProcessGroup, label: str, bad_wire: bool) -> None:
    """Push both sequences on every worker, then rank 0 compares and prints
    ``rank 0: <label> <match | mismatch ...>`` and the counters."""
    if mates.rank == 0:
        store.create_table(shared_spec())
        zero_shared(store)
    store.create_table(own_spec(mates.rank))
    mates.barrier()
    push_all(store, mates.rank)
    mine = store.stats()
    sent = sum(int(v["worker_push_calls"]) for v in mine.values())
    resent = sum(int(v["worker_push_retries"]) for v in mine.values())
    counts = torch.tensor([sent, resent], dtype=torch.int64)
    mates.allreduce(counts)
    mates.barrier()  # every push is acknowledged
    if mates.rank == 0:
        result = compare(store, mates.size)
        st = store.stats()
        tables = ["shared", *(f"own{r}" for r in range(mates.size))]
        applied = sum(int(st[t]["push_requests"]) for t in tables)
        repeats = sum(int(st[t]["push_duplicates"]) for t in tables)
        report = {
            "issued": int(counts[0]),
            "resent": int(counts[1]),
            "applied": applied,
            "duplicates": repeats,
        }
        print(f"rank 0: {label} {result}", flush=True)
        print(f"rank 0: {label} counters {json.dumps(report)}", flush=True)
        if bad_wire:
            print(f"rank 0: bad wire ok {bad_wire_checks(store)} cases", flush=True)
    mates.barrier()  # nobody closes (and ends the servers) before the comparison


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--servers", type=int, default=1)
    parser.add_argument("--drop", type=int, required=True)
    parser.add_argument("--control", action="store_true")
    parser.add_argument("--bad-wire", action="store_true")
    args = parser.parse_args()
    from ps.mpi.server import ServerConfig
    from ps.mpi.store import MPIStore
    from tests.support.ps_faults import serve_mpi_lossy, unnumbered_mpi_store

    group = comm.init("mpi")
    topology = comm.Topology(world_size=group.size, num_servers=args.servers)
    mates = topology.role_group(group)
    # Each session: servers serve until every worker closed its store; then the next.
    sessions = [("result", MPIStore)]
    if args.control:
        sessions.append(("control", unnumbered_mpi_store))
    for label, open_store in sessions:
        if topology.role(group.rank) is comm.Role.SERVER:
            config = ServerConfig(data_timeout_s=1.0)
            stats = serve_mpi_lossy(group, topology, config, drop_reply_every=args.drop)
            print(f"rank {group.rank}: ok server {label} tables={len(stats)}", flush=True)
            continue
        with open_store(
            group, topology, request_timeout_s=30.0, push_retry_s=0.25, max_retries=3
        ) as store:
            worker_phase(store, mates, label, args.bad_wire and label == "result")
        print(f"rank {group.rank}: ok worker {label}", flush=True)


if __name__ == "__main__":
    main()
