"""Small collectives that make every rank of a group agree, for work that is not a tensor
exchange: whether a step failed on any rank (:func:`agree`), work that rank 0 does alone
for the group (:func:`run_on_rank0`), and a random number drawn once for the group
(:func:`shared_token`).

Without them a rank that fails alone leaves its peers waiting in the next collective
until their timeout; with them every rank raises at the same point, the failed rank its
own error and the others one that names it.
"""

from __future__ import annotations

import secrets
from collections.abc import Callable
from typing import Any

import torch

from comm.group import ProcessGroup


def agree(group: ProcessGroup, error: BaseException | None, what: str) -> None:
    """Collective (one small allreduce): raise on every rank if ``what`` failed on any
    rank: a failed rank raises its own ``error``, the others a RuntimeError naming the
    failed ranks. Also a barrier: no rank returns before every rank got here."""
    if group.size > 1:
        flags = torch.zeros(group.size, dtype=torch.int64)  # [size]: 1 where a rank failed
        flags[group.rank] = 0 if error is None else 1
        failed = group.allreduce(flags, op="max")
        bad = [r for r in range(group.size) if int(failed[r])]
        if error is None and bad:
            who = (
                f"rank {bad[0]} (see its error)"
                if len(bad) == 1
                else f"ranks {bad} (see their errors)"
            )
            raise RuntimeError(f"{what} failed on {who}")
    if error is not None:
        raise error


def run_on_rank0(group: ProcessGroup, action: Callable[[], Any], what: str) -> None:
    """Collective: rank 0 runs ``action``; every rank returns once it is done, or raises
    if it failed (rank 0 with its own error, the others naming rank 0)."""
    error: Exception | None = None
    if group.rank == 0:
        try:
            action()
        except Exception as e:  # every rank must learn it (one small allreduce)
            error = e
    agree(group, error, what)


def shared_token(group: ProcessGroup, bits: int = 48) -> int:
    """Collective: a random ``bits``-bit number (``bits`` <= 63) drawn by rank 0 and
    broadcast, the same on every rank (e.g. the name of a folder every rank writes into)."""
    if not 0 < bits <= 63:
        raise ValueError(f"shared_token: bits must be in [1, 63], got {bits}")
    token = torch.tensor([secrets.randbits(bits) if group.rank == 0 else 0], dtype=torch.int64)
    if group.size > 1:
        group.broadcast(token, root=0)
    return int(token)
