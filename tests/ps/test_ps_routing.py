"""ps.routing: splitmix64 and shard_of against a pure-Python reference and fixed known values."""

from __future__ import annotations

import pytest
import torch

from ps.routing import group_by_shard, shard_of, splitmix64

pytestmark = pytest.mark.timeout(30)

MASK = (1 << 64) - 1


def splitmix64_ref(x: int) -> int:
    """SplitMix64 (Steele, Lea, Flood 2014) first output for state x, as an unsigned int."""
    z = (x + 0x9E3779B97F4A7C15) & MASK
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK
    return z ^ (z >> 31)


EDGE_IDS = [0, 1, 2, 3, -1, -2, 2**31, -(2**31), 2**62 + 12345, 2**63 - 1, -(2**63), 10**18]


def test_known_values() -> None:
    # The well-known first output of SplitMix64 seeded with 0, and frozen shard numbers:
    # if these change, every existing sharded store and Redis key layout changes.
    assert splitmix64(torch.tensor([0])).tolist()[0] & MASK == 0xE220A8397B1DCDAF
    assert shard_of(torch.tensor([0, 1, 2, 3, 4, 5, 6, 7]), 4).tolist() == [3, 0, 3, 2, 1, 1, 0, 3]
    assert shard_of(torch.tensor([-1, 2**63 - 1, -(2**63)]), 3).tolist() == [
        (splitmix64_ref(i & MASK) >> 1) % 3 for i in (-1, 2**63 - 1, -(2**63))
    ]


def test_matches_python_reference() -> None:
    gen = torch.Generator().manual_seed(0)
    ids = torch.cat(
        [
            torch.tensor(EDGE_IDS),
            torch.randint(-(2**63), 2**63 - 1, (2000,), generator=gen, dtype=torch.int64),
        ]
    )
    got = splitmix64(ids).tolist()
    want = [splitmix64_ref(i & MASK) for i in ids.tolist()]
    assert [g & MASK for g in got] == want
    for shards in (1, 2, 3, 7, 64):
        got_s = shard_of(ids, shards).tolist()
        assert got_s == [(w >> 1) % shards for w in want]


def test_shards_are_balanced_and_grouping_is_stable() -> None:
    ids = torch.arange(-50_000, 50_000)
    counts = torch.bincount(shard_of(ids, 5), minlength=5)
    assert int(counts.min()) > 0.95 * ids.numel() / 5
    req = torch.tensor([9, 4, 4, -7, 123, 9, 0])
    order, per_shard = group_by_shard(req, 3)
    shards = shard_of(req, 3)
    assert per_shard.tolist() == torch.bincount(shards, minlength=3).tolist()
    assert shards[order].tolist() == sorted(shards.tolist())
    for s in range(3):  # within a shard, request order is kept
        pos = order[shards[order] == s].tolist()
        assert pos == sorted(pos)
    back = torch.empty_like(req)
    back[order] = req[order]
    assert torch.equal(back, req)


def test_bad_arguments() -> None:
    with pytest.raises(TypeError, match="splitmix64: ids must be an int64 tensor, got torch.int32"):
        splitmix64(torch.tensor([1], dtype=torch.int32))
    with pytest.raises(ValueError, match="num_shards must be an int > 0, got 0"):
        shard_of(torch.tensor([1]), 0)
