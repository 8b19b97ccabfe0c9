"""Rank script: the last server rank dies (``os._exit(3)``) while the worker pulls.

``mpirun -n 3 python ps_mpi_dead.py``: rank 0 works, ranks 1 and 2 serve; rank 2
exits 1 s after it starts serving.

* Under MPICH's default launcher the whole job is torn down at once (the
  launcher kills every rank when one exits without finalising): the test
  checks that it ends quickly with a non-zero exit code.
* Under ``mpiexec -disable-auto-cleanup`` the other ranks live on: the worker's
  pull must raise ``comm.CommTimeoutError`` naming rank 2 within a few seconds
  (``request_timeout_s=2``), later requests to rank 2 must fail at once, and
  ``close()`` must still release the living server. The worker prints
  ``rank 0: ok detected ...``; the living ranks then leave with ``os._exit(0)``
  (MPI_Finalize would wait for the dead rank forever), so the job's exit code
  is the dead rank's.
"""

from __future__ import annotations

import os
import threading
import time

import torch

import comm
import ps
from ps.mpi.server import serve_mpi
from ps.mpi.store import MPIStore

TIMEOUT_S = 2.0


def die_later(delay_s: float) -> None:
    def run() -> None:
        time.sleep(delay_s)
        os._exit(3)

    threading.Thread(target=run, daemon=True).start()


def worker(group: comm.ProcessGroup, topology: comm.Topology, victim: int) -> None:
    store = MPIStore(group, topology, request_timeout_s=TIMEOUT_S)
    spec = ps.TableSpec(name="t", num_rows=1000, dim=4, optimizer=ps.SGD(lr=0.5))
    store.create_table(spec)
    ids = torch.arange(1000)  # routes to both servers
    start = time.monotonic()
    last_ok = start
    try:
        while time.monotonic() - start < 30.0:
            store.pull("t", ids)
            last_ok = time.monotonic()
            time.sleep(0.01)
        raise AssertionError("the dead server went unnoticed for 30 s")
    except comm.CommTimeoutError as e:
        waited = time.monotonic() - last_ok
        assert f"[{victim}]" in str(e), f"error does not name rank {victim}: {e}"
        assert waited < TIMEOUT_S + 3.0, f"took {waited:.1f} s to notice"
        print(f"rank {group.rank}: detected in {waited:.1f} s: {e}", flush=True)
    t0 = time.monotonic()
    try:
        store.push("t", ids, torch.ones(1000, 4))
    except comm.CommTimeoutError as e:
        assert time.monotonic() - t0 < 1.0, "a known-dead server must fail at once"
        assert str(victim) in str(e), e
    else:
        raise AssertionError("a push to a dead server succeeded")
    store.close()  # goodbye to the living server; must not raise or hang
    print(f"rank {group.rank}: ok detected dead server rank {victim}", flush=True)


def main() -> None:
    group = comm.init("mpi")
    topology = comm.Topology(world_size=group.size, num_servers=2)
    victim = topology.server_ranks[-1]
    if topology.role(group.rank) is comm.Role.WORKER:
        worker(group, topology, victim)
    else:
        if group.rank == victim:
            die_later(1.0)
        serve_mpi(group, topology)
        print(f"rank {group.rank}: ok server returned", flush=True)
    os._exit(0)  # not MPI_Finalize: it would wait for the dead rank


if __name__ == "__main__":
    main()
