"""Which shard owns a row: a fixed 64-bit hash of the id, stable across processes and runs.

``shard_of(id, S) = (splitmix64(id) >> 1) % S`` with ``splitmix64`` the output
function of Steele, Lea & Flood's SplitMix64 generator seeded with the id
(``x += 0x9E3779B97F4A7C15`` then two xor-shift-multiply rounds). All
arithmetic is on int64 tensors with wrap-around; the logical right shifts of the
unsigned original are emulated by an arithmetic shift and a mask. Python's
``hash`` is never used (it is salted per process for strings and differs
between builds).

Every store that shards (MPI server ranks, Redis buckets) routes with these
functions, so a checkpoint written by one store can be resharded by another.

Example::

    >>> import torch
    >>> splitmix64(torch.tensor([0])).tolist() == [-2152535657050944081]  # 0xE220A8397B1DCDAF
    True
    >>> shard_of(torch.tensor([0, 1, 2, 3]), 4).tolist()
    [3, 0, 3, 2]
"""

from __future__ import annotations

import torch


def _s64(u: int) -> int:
    """The int64 with the same bits as the uint64 ``u``."""
    return u - (1 << 64) if u >= 1 << 63 else u


_GAMMA = _s64(0x9E3779B97F4A7C15)
_M1 = _s64(0xBF58476D1CE4E5B9)
_M2 = _s64(0x94D049BB133111EB)


def _shr(x: torch.Tensor, k: int) -> torch.Tensor:
    """Logical right shift of the uint64 bits held in int64 ``x`` by ``k`` (0 < k < 64)."""
    return (x >> k) & ((1 << (64 - k)) - 1)


def splitmix64(ids: torch.Tensor) -> torch.Tensor:
    """SplitMix64 of each id: int64 ``[N]`` -> int64 ``[N]`` (the uint64 result's bits).

    Equal to the first output of a SplitMix64 generator whose state is the id
    (reinterpreted as uint64).
    """
    if not isinstance(ids, torch.Tensor) or ids.dtype != torch.int64:
        got = ids.dtype if isinstance(ids, torch.Tensor) else type(ids).__name__
        raise TypeError(f"splitmix64: ids must be an int64 tensor, got {got}")
    z = ids + _GAMMA
    z = (z ^ _shr(z, 30)) * _M1
    z = (z ^ _shr(z, 27)) * _M2
    return z ^ _shr(z, 31)


def shard_of(ids: torch.Tensor, num_shards: int) -> torch.Tensor:
    """Owning shard of each id: int64 ``[N]`` in ``[0, num_shards)``."""
    if not isinstance(num_shards, int) or isinstance(num_shards, bool) or num_shards <= 0:
        raise ValueError(f"shard_of: num_shards must be an int > 0, got {num_shards!r}")
    if num_shards == 1:
        return torch.zeros_like(ids)
    return _shr(splitmix64(ids), 1) % num_shards


def group_by_shard(ids: torch.Tensor, num_shards: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Order the request by shard, for one sub-request per shard.

    Returns ``order`` int64 ``[N]`` (a stable permutation: ``ids[order]`` lists
    shard 0's ids first, then shard 1's, ..., each in request order) and
    ``counts`` int64 ``[num_shards]``. Shard ``s``'s sub-request is
    ``ids[order[start_s : start_s + counts[s]]]``; to put per-shard answers back
    in request order, ``out[order] = torch.cat(answers)``.
    """
    shards = shard_of(ids, num_shards)  # [N]
    order = torch.argsort(shards, stable=True)  # [N]
    counts = torch.bincount(shards, minlength=num_shards)  # [S]
    return order, counts
