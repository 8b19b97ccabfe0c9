"""A receive whose sender never shows up raises CommTimeoutError in time.

Rank 0 posts ``recv_async`` from rank 1 and waits 1 s; rank 1 sends nothing.
Under MPI rank 0 then tells rank 1 (tag 8) that it has timed out, rank 1 sends,
and rank 0 waits the same handle again and gets the data, and the group still
works. Under gloo a timed-out wait closes the connections (the group is dead, as
``CommTimeoutError`` documents), so rank 1 only stays alive until rank 0 timed out.
``check_silent_peer(group)`` runs it (the last check of a launch: under gloo the
group is dead afterwards); as a script it prints ``rank R: ok timeout <elapsed>``.
"""

from __future__ import annotations

import os
import time

import torch

import comm

TIMEOUT = 1.0


def check_silent_peer(group: comm.ProcessGroup) -> float:
    """Rank 0's wait on a peer that sends nothing times out; returns how long it took
    there (0.0 on the other ranks)."""
    assert group.size >= 2, "needs at least 2 ranks"
    payload = torch.arange(5, dtype=torch.float32) * 1.5
    elapsed = 0.0
    group.barrier()
    if group.rank == 0:
        buf = torch.zeros(5, dtype=torch.float32)
        h = group.recv_async(buf, src=1, tag=7)
        t0 = time.monotonic()
        try:
            h.wait(timeout=TIMEOUT)
        except comm.CommTimeoutError as e:
            elapsed = time.monotonic() - t0
            msg = str(e)
            assert isinstance(e, TimeoutError)
        else:
            raise AssertionError("recv from a silent peer returned instead of timing out")
        assert TIMEOUT * 0.9 <= elapsed < 5.0, f"timed out after {elapsed:.3f} s"
        assert "recv" in msg and "1 s" in msg, f"message does not name the op: {msg!r}"
        if group.backend == "mpi":
            # MPI keeps the request posted: once the peer sends, the same handle
            # completes, and the group goes on working.
            assert not h.is_completed()
            group.send(torch.ones(1), dst=1, tag=8)  # "I timed out; send now"
            out = h.wait()
            assert out is buf
            assert torch.equal(buf, payload), buf
    elif group.rank == 1:
        if group.backend == "mpi":
            group.recv(torch.zeros(1), src=0, tag=8)
            group.send(payload, dst=0, tag=7)
        else:
            # gloo drops the connection on a timed-out wait (the group is dead
            # afterwards, as CommTimeoutError documents): stay alive, silent,
            # until rank 0 has timed out, then leave.
            time.sleep(TIMEOUT + 4.0)
    if group.backend == "mpi":
        t = torch.ones(3, dtype=torch.int64)
        group.allreduce(t)  # the group still works
        assert t.tolist() == [group.size] * 3, t
        group.barrier()
    return elapsed


def main() -> None:
    group = comm.init(os.environ.get("HYBRIDREC_TEST_BACKEND", "auto"), timeout_s=60.0)
    try:
        elapsed = check_silent_peer(group)
    finally:
        group.close()
    print(f"rank {group.rank}: ok timeout {elapsed:.3f}", flush=True)


if __name__ == "__main__":
    main()
