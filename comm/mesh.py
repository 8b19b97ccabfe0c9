"""A named N-D mesh of ranks (``dp x pp x tp``) and each rank's sub-groups.

The ranks of ``group`` are laid out row-major over the named dimensions, the LAST
varying fastest: with ``{"dp": 2, "pp": 2, "tp": 2}`` ranks 0 and 1 differ only in
``tp``, ranks 0 and 2 only in ``pp``, ranks 0 and 4 only in ``dp``. Put the dimension
with the most traffic last (tensor parallelism allreduces in every block), so its
ranks are neighbours (on one machine when ranks are placed by node).

For each dimension the mesh makes the sub-group of the ranks that share every OTHER
coordinate (``mesh.group("tp")``: this rank's tensor-parallel peers), by
:meth:`ProcessGroup.split` at construction, so every rank creates the same groups
in the same order. ``mesh.group("dp", "tp")`` joins several dimensions (a
collective, made on first use: call it on every rank in the same order).

Parameter-server ranks are not part of a mesh: build it on the workers' group
(``Topology.role_group``), as :meth:`DeviceMesh.of_workers` does.

Example::

    mesh = DeviceMesh(group, {"dp": 2, "pp": 1, "tp": 2})   # 4 ranks
    mesh.coord("tp"), mesh.size("tp"), mesh.group("tp").size   # 0 or 1, 2, 2
"""

from __future__ import annotations

import math
from collections.abc import Mapping

from comm.group import ProcessGroup
from comm.topology import Role, Topology


class DeviceMesh:
    """The ranks of ``group`` as a grid of named dimensions (see the module docstring)."""

    def __init__(self, group: ProcessGroup, shape: Mapping[str, int]) -> None:
        self.root = group
        self.shape: dict[str, int] = check_shape(shape, group.size)
        self.names: tuple[str, ...] = tuple(self.shape)
        self.coords: dict[str, int] = self.coords_of(group.rank)
        self._groups: dict[tuple[str, ...], ProcessGroup] = {}
        for name in self.names:  # every rank splits in the same order
            self.group(name)

    @classmethod
    def of_workers(
        cls, group: ProcessGroup, topology: Topology, shape: Mapping[str, int]
    ) -> DeviceMesh | None:
        """Collective over ``group`` (the whole job): the mesh of the worker ranks, None
        on a parameter-server rank. The shape must multiply to the number of workers."""
        check_shape(
            shape, topology.num_workers, what="worker ranks (PS server ranks are not in a mesh)"
        )
        workers = topology.role_group(group)
        return cls(workers, shape) if topology.role(group.rank) is Role.WORKER else None

    def size(self, name: str) -> int:
        return self.shape[self._known(name)]

    def coord(self, name: str) -> int:
        """This rank's index along ``name`` (its rank in ``group(name)``)."""
        return self.coords[self._known(name)]

    def coords_of(self, rank: int) -> dict[str, int]:
        """The coordinates of ``rank`` of the root group."""
        if not 0 <= rank < self.root.size:
            raise ValueError(f"DeviceMesh: rank {rank} is outside the {self.root.size} ranks")
        out: dict[str, int] = {}
        for name in reversed(self.names):  # the last dimension varies fastest
            rank, out[name] = divmod(rank, self.shape[name])
        return {name: out[name] for name in self.names}

    def rank_of(self, **coords: int) -> int:
        """The root-group rank at ``coords`` (missing dimensions: this rank's)."""
        for name in coords:
            self._known(name)
        rank = 0
        for name in self.names:
            c = coords.get(name, self.coords[name])
            if not 0 <= c < self.shape[name]:
                raise ValueError(
                    f"DeviceMesh: {name} coordinate {c} outside [0, {self.shape[name]})"
                )
            rank = rank * self.shape[name] + c
        return rank

    def group(self, *names: str) -> ProcessGroup:
        """This rank's peers along ``names`` (all other coordinates equal), ordered by
        their coordinates along ``names`` (row-major). Collective on first use."""
        if not names:
            raise ValueError(f"DeviceMesh.group: name at least one of {list(self.names)}")
        for name in names:
            self._known(name)
        if len(set(names)) != len(names):
            raise ValueError(f"DeviceMesh.group: a dimension repeats in {list(names)}")
        key = tuple(n for n in self.names if n in names)  # the mesh's order
        if key not in self._groups:
            color = key_of(self.coords, self.shape, [n for n in self.names if n not in key])
            self._groups[key] = self.root.split(color, key_of(self.coords, self.shape, key))
        return self._groups[key]

    def _known(self, name: str) -> str:
        if name not in self.shape:
            raise ValueError(f"DeviceMesh: no dimension {name!r}; the mesh has {list(self.names)}")
        return name

    def __repr__(self) -> str:
        dims = " x ".join(f"{n}={s}" for n, s in self.shape.items())
        return f"DeviceMesh({dims}, rank {self.root.rank} at {self.coords})"


def key_of(
    coords: Mapping[str, int], shape: Mapping[str, int], names: list[str] | tuple[str, ...]
) -> int:
    """Row-major index of ``coords`` over the dimensions ``names`` (0 for none)."""
    index = 0
    for name in names:
        index = index * shape[name] + coords[name]
    return index


def check_shape(shape: Mapping[str, int], world: int, *, what: str = "") -> dict[str, int]:
    """``shape`` as a dict, or a ValueError naming what is wrong: the same on every rank
    (it depends only on the arguments), so every rank raises it."""
    if not isinstance(shape, Mapping) or not shape:
        raise ValueError(
            f"DeviceMesh: shape must be a non-empty mapping name -> size, got {shape!r}"
        )
    out: dict[str, int] = {}
    for name, size in shape.items():
        if not isinstance(name, str) or not name:
            raise ValueError(f"DeviceMesh: dimension names must be non-empty strings, got {name!r}")
        if not isinstance(size, int) or isinstance(size, bool) or size < 1:
            raise ValueError(
                f"DeviceMesh: dimension {name!r} must have an int size >= 1, got {size!r}"
            )
        out[name] = size
    total = math.prod(out.values())
    if total != world:
        dims = " x ".join(f"{n}={s}" for n, s in out.items())
        raise ValueError(
            f"DeviceMesh: {dims} = {total} ranks, but there are {world} {what or 'ranks'}; the "
            "sizes must multiply to that number"
        )
    return out
