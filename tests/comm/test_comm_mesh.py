"""comm.DeviceMesh: coordinates, sub-groups and errors, in one process and on 2 and 4 real
ranks (gloo and mpi; tests/comm/ranks/comm_mesh.py checks every sub-group's members)."""

from __future__ import annotations

import pytest

import comm
from multiproc import run_ranks


def test_coordinates_are_row_major_last_dimension_fastest() -> None:
    mesh = comm.DeviceMesh(comm.LocalGroup(), {"dp": 1, "pp": 1, "tp": 1})
    assert mesh.coords == {"dp": 0, "pp": 0, "tp": 0} and mesh.names == ("dp", "pp", "tp")
    assert mesh.group("tp").size == 1 and mesh.group("dp", "tp").size == 1
    # The layout itself, without ranks: shape 2 x 2 x 2 maps rank 5 = 1*4 + 0*2 + 1.
    from comm.mesh import key_of

    shape = {"dp": 2, "pp": 2, "tp": 2}
    assert key_of({"dp": 1, "pp": 0, "tp": 1}, shape, list(shape)) == 5
    assert key_of({"dp": 1, "pp": 0, "tp": 1}, shape, ["pp", "tp"]) == 1


@pytest.mark.parametrize(
    ("shape", "pattern"),
    [
        ({"dp": 2, "tp": 2}, r"dp=2 x tp=2 = 4 ranks, but there are 1 ranks"),
        ({}, "shape must be a non-empty mapping"),
        ({"dp": 0}, r"dimension 'dp' must have an int size >= 1, got 0"),
        ({"": 1}, "dimension names must be non-empty strings"),
    ],
)
def test_bad_shapes_are_named(shape: dict[str, int], pattern: str) -> None:
    with pytest.raises(ValueError, match=pattern):
        comm.DeviceMesh(comm.LocalGroup(), shape)


def test_bad_lookups_are_named() -> None:
    mesh = comm.DeviceMesh(comm.LocalGroup(), {"dp": 1, "tp": 1})
    with pytest.raises(ValueError, match=r"no dimension 'pp'; the mesh has \['dp', 'tp'\]"):
        mesh.group("pp")
    with pytest.raises(ValueError, match="a dimension repeats"):
        mesh.group("tp", "tp")
    with pytest.raises(ValueError, match=r"tp coordinate 3 outside \[0, 1\)"):
        mesh.rank_of(tp=3)
    topo = comm.Topology(world_size=3, num_servers=1)
    with pytest.raises(ValueError, match="but there are 2 worker ranks"):
        comm.DeviceMesh.of_workers(comm.LocalGroup(), topo, {"dp": 3})


@pytest.mark.timeout(120)
@pytest.mark.parametrize(("backend", "nprocs"), [("gloo", 2), ("mpi", 4), ("gloo", 4)])
def test_sub_groups_on_real_ranks(backend: str, nprocs: int) -> None:
    text = "\n".join(run_ranks("comm_mesh.py", nprocs, backend, timeout=100))
    for r in range(nprocs):
        assert f"rank {r} mesh ok" in text, text
        assert f"rank {r} error: DeviceMesh: dp={nprocs + 1} x tp=1 = {nprocs + 1} ranks" in text
