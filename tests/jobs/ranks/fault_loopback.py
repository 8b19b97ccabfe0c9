"""Rank script: which TCP sockets does this process listen on after our code started?

``mpirun -n 2 python fault_loopback.py mpi|gloo``: the MPI library is started
first (``MPI.Init``, its own sockets), the listening sockets are noted, then
``comm.init(backend)`` runs with one allreduce (for "mpi" also an
:class:`ps.MPIStore` with one server rank and a push), and every listening socket
that appeared since is printed as ``rank R: listen ADDRESS:PORT``, then
``rank R: ok``.
"""

from __future__ import annotations

import ipaddress
import os
import sys

from mpi4py import MPI


def listening() -> set[tuple[str, int]]:
    """(address, port) of the TCP sockets in LISTEN state that this process holds."""
    inodes = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            link = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if link.startswith("socket:["):
            inodes.add(link[8:-1])
    out = set()
    for table, width in (("/proc/self/net/tcp", 4), ("/proc/self/net/tcp6", 16)):
        try:
            lines = open(table).read().splitlines()[1:]  # noqa: SIM115
        except OSError:
            continue
        for line in lines:
            f = line.split()
            if f[3] != "0A" or f[9] not in inodes:  # 0A: LISTEN
                continue
            hex_addr, hex_port = f[1].split(":")
            raw = bytes.fromhex(hex_addr)
            # /proc prints each 32-bit word in host (little-endian) order.
            raw = b"".join(raw[i : i + 4][::-1] for i in range(0, width, 4))
            out.add((str(ipaddress.ip_address(raw)), int(hex_port, 16)))
    return out


def main() -> None:
    backend = sys.argv[1]
    if not MPI.Is_initialized():
        MPI.Init()
    before = listening()
    import torch

    import comm
    import ps

    group = comm.init(backend, timeout_s=60)
    t = torch.ones(2)
    group.allreduce(t)
    if backend == "mpi":
        from ps.mpi.server import serve_mpi
        from ps.mpi.store import MPIStore

        topology = comm.Topology(world_size=group.size, num_servers=1)
        if group.rank in topology.server_ranks:
            serve_mpi(group, topology)
        else:
            store = MPIStore(group, topology)
            store.create_table(ps.TableSpec(name="t", num_rows=10, dim=2, optimizer=ps.SGD(lr=1)))
            store.push("t", torch.tensor([1]), torch.ones(1, 2))
            store.close()
    for address, port in sorted(listening() - before):
        print(f"rank {group.rank}: listen {address}:{port}", flush=True)
    group.barrier()
    print(f"rank {group.rank}: ok", flush=True)


if __name__ == "__main__":
    main()
