"""Rank script: a worker dies or hangs and the server notices, names it and stops.

``mpirun -n 3 python ps_mpi_lost_worker.py --fate dies|hangs``: ranks 0 and 1 are
workers, rank 2 serves with ``ServerConfig(worker_timeout_s=TIMEOUT_S)``. Both workers
first run the table lifecycle (``tests/support/ps_lifecycle.py``: they race to create one
table) and push; then worker 1 either exits without a goodbye (``os._exit(3)``; run
under ``mpiexec -disable-auto-cleanup`` so that the launcher leaves the others alive)
or sleeps without a goodbye, and worker 0 closes its store normally and waits.

The server must raise ``comm.CommTimeoutError`` naming worker rank 1 and its silence;
it prints ``rank 2: stopped after S s: <message>`` and aborts the job (what a launch
role's uncaught error does), which also ends the sleeping worker. The test checks the
message and that the whole job ended within the bound.
"""

from __future__ import annotations

import argparse
import os
import time

import torch

import comm
from ps.mpi.server import ServerConfig, serve_mpi
from ps.mpi.store import MPIStore
from tests.support.ps_lifecycle import check_lifecycle, specs

TIMEOUT_S = 3.0


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--fate", choices=("dies", "hangs"), required=True)
    args = parser.parse_args()
    group = comm.init("mpi")
    topology = comm.Topology(world_size=group.size, num_servers=1)
    mates = topology.role_group(group)
    if topology.role(group.rank) is comm.Role.SERVER:
        start = time.monotonic()
        try:
            serve_mpi(group, topology, ServerConfig(worker_timeout_s=TIMEOUT_S))
        except comm.CommTimeoutError as e:
            took = time.monotonic() - start
            print(f"rank {group.rank}: stopped after {took:.1f} s: {e}", flush=True)
            comm.abort(4)  # after a pause that lets mpirun forward the line
        raise AssertionError("serve_mpi returned although worker 1 never said goodbye")
    store = MPIStore(group, topology, request_timeout_s=30.0)
    n = check_lifecycle(store, mates.rank, mates.size, mates.barrier, "race")
    spec, _other = specs("kept")
    store.create_table(spec, exist_ok=True)
    for _ in range(3):
        store.push("kept", torch.arange(8), torch.ones(8, spec.dim))
    mates.barrier()
    print(f"rank {group.rank}: ok worker {n} lifecycle checks", flush=True)
    if mates.rank == 1:
        if args.fate == "dies":
            os._exit(3)
        time.sleep(600)  # hangs: no request, no goodbye
    store.close()
    time.sleep(600)  # ended by the server's abort
    os._exit(0)


if __name__ == "__main__":
    main()
