"""Rank script: comm.DeviceMesh on real ranks.

For every shape whose sizes multiply to the world (1, 2 or 4 ranks), each rank builds
the mesh and checks, with an allgather of world ranks inside each sub-group, that the
group along each dimension (and along two dimensions together) holds exactly the ranks
whose other coordinates equal its own, ordered by their coordinates. Then: a shape that
does not multiply to the world raises the same ValueError on every rank; with the last
rank a parameter-server rank, ``of_workers`` builds the mesh of the others only. Each
rank prints ``rank R mesh ok`` (and the error text) for the test to count.
"""

from __future__ import annotations

import itertools
import math
import os

import torch

import comm

SHAPES = {
    1: [{"dp": 1}, {"dp": 1, "pp": 1, "tp": 1}],
    2: [{"dp": 2}, {"pp": 2, "tp": 1}, {"dp": 1, "tp": 2}],
    4: [{"dp": 4}, {"dp": 2, "tp": 2}, {"pp": 2, "tp": 2}, {"dp": 1, "pp": 2, "tp": 2},
        {"dp": 2, "pp": 2, "tp": 1}],
}  # fmt: skip


def expected_members(
    shape: dict[str, int], coords: dict[str, int], along: tuple[str, ...]
) -> list[int]:
    """World ranks sharing every coordinate outside ``along``, row-major along ``along``."""
    names = list(shape)
    out = []
    for combo in itertools.product(*(range(shape[n]) for n in along)):
        c = dict(coords) | dict(zip(along, combo, strict=True))
        rank = 0
        for n in names:
            rank = rank * shape[n] + c[n]
        out.append(rank)
    return out


def main() -> None:
    group = comm.init(os.environ["HYBRIDREC_TEST_BACKEND"], timeout_s=60.0)
    me = torch.tensor([group.rank], dtype=torch.int64)
    for shape in SHAPES[group.size]:
        mesh = comm.DeviceMesh(group, shape)
        assert mesh.rank_of() == group.rank and mesh.coords_of(group.rank) == mesh.coords
        dims = [(n,) for n in shape] + list(itertools.combinations(shape, 2))
        for along in dims:
            sub = mesh.group(*along)
            got = sub.allgather(me).reshape(-1).tolist()
            want = expected_members(shape, mesh.coords, along)
            assert got == want, (shape, along, got, want)
            assert sub.size == math.prod(shape[n] for n in along)
        for name in shape:
            assert mesh.group(name).rank == mesh.coord(name)
    try:
        comm.DeviceMesh(group, {"dp": group.size + 1, "tp": 1})
    except ValueError as e:
        print(f"rank {group.rank} error: {e}", flush=True)
    if group.size > 1:  # the last rank serves: the mesh covers the others
        topo = comm.Topology(world_size=group.size, num_servers=1)
        mesh = comm.DeviceMesh.of_workers(group, topo, {"dp": group.size - 1})
        if group.rank == group.size - 1:
            assert mesh is None
        else:
            assert mesh is not None
            got = mesh.group("dp").allgather(me).reshape(-1).tolist()
            assert got == list(range(group.size - 1)), got
    group.barrier()
    print(f"rank {group.rank} mesh ok", flush=True)


if __name__ == "__main__":
    main()
