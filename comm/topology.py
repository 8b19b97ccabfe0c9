"""Roles of the ranks in a job, decided once and validated up front.

A job of ``world_size`` ranks has ``num_servers`` parameter-server ranks (the
last ones, so rank 0 is always a worker and does the printing) and the rest are
workers. Everything that needs to know who is who asks this object; nothing
guesses from environment variables later.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from comm.group import ProcessGroup


class Role(enum.Enum):
    WORKER = "worker"
    SERVER = "server"


@dataclass(frozen=True, slots=True, kw_only=True)
class Topology:
    """``world_size`` ranks: workers ``[0, num_workers)``, servers after them."""

    world_size: int
    num_servers: int = 0

    def __post_init__(self) -> None:
        if self.world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {self.world_size}")
        if not 0 <= self.num_servers < self.world_size:
            raise ValueError(
                f"num_servers={self.num_servers} leaves no worker in a world of "
                f"{self.world_size} ranks; expected 0 <= num_servers < world_size"
            )

    @classmethod
    def of(cls, group: ProcessGroup, num_servers: int = 0) -> Topology:
        return cls(world_size=group.size, num_servers=num_servers)

    @property
    def num_workers(self) -> int:
        return self.world_size - self.num_servers

    @property
    def worker_ranks(self) -> list[int]:
        return list(range(self.num_workers))

    @property
    def server_ranks(self) -> list[int]:
        return list(range(self.num_workers, self.world_size))

    def role(self, rank: int) -> Role:
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is outside the world of {self.world_size} ranks")
        return Role.WORKER if rank < self.num_workers else Role.SERVER

    def role_group(self, group: ProcessGroup) -> ProcessGroup:
        """Collective over ``group``: the sub-group of ranks sharing this rank's role."""
        if group.size != self.world_size:
            raise ValueError(
                f"topology is for {self.world_size} ranks but the group has {group.size}"
            )
        return group.split(0 if self.role(group.rank) is Role.WORKER else 1)
