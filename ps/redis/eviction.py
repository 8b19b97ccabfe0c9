"""Eviction of a dynamic Redis table's rows (the rules of :class:`ps.table.TableSpec`).

The table step is a Redis counter (INCR per push); pulls and pushes stamp the rows they
touch in the bucket's sorted set (``{P:T:b}:t``, see :mod:`ps.redis.layout`); after
each push the client evicts rows older than ``max_age_steps`` (one script per bucket)
and, over ``capacity``, the least recently touched rows (ties: smaller id first).
These cost extra round trips per request on such tables only. Under concurrent
workers the steps interleave, so eviction is exact for one worker and approximate
(never corrupting) for several.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ps.redis.conn import RedisLink, evalsha, pack, raw
from ps.redis.layout import RedisTable
from ps.redis.lua import EVICT_AGE, EVICT_IDS, LRU_CANDIDATES


@dataclass(frozen=True, slots=True)
class EvictionScripts:
    """The SHA1s of the eviction scripts, registered on the link."""

    age: str
    ids: str
    lru: str

    @staticmethod
    def register(link: RedisLink) -> EvictionScripts:
        return EvictionScripts(
            age=link.register_script(EVICT_AGE),
            ids=link.register_script(EVICT_IDS),
            lru=link.register_script(LRU_CANDIDATES),
        )


def evict(
    link: RedisLink,
    sha: EvictionScripts,
    t: RedisTable,
    step: int,
    what: str,
    label: str | None = None,
) -> int:
    """Evict by age, then by capacity (LRU, ties: smaller id first); rows evicted.
    ``label``: the round trips are counted under it (:meth:`RedisLink.round_trips`)."""
    gone = 0
    age = t.spec.max_age_steps
    if age is not None and step - age >= 0:
        cmds = [
            evalsha(sha.age, EVICT_AGE, [t.w_keys[b], t.s_keys[b], t.t_keys[b]], [step - age])
            for b in range(t.buckets)
        ]
        gone += sum(int(r) for r in link.run(cmds, what, label))
    if t.spec.capacity is not None:
        gone += evict_lru(link, sha, t, t.spec.capacity, what, label)
    return gone


def evict_lru(
    link: RedisLink,
    sha: EvictionScripts,
    t: RedisTable,
    capacity: int,
    what: str,
    label: str | None = None,
) -> int:
    """Evict the least recently touched rows over ``capacity``; rows evicted."""
    sizes = link.run([raw(k, pack(["ZCARD", k])) for k in t.t_keys], what, label)  # [B]
    excess = sum(int(s) for s in sizes) - capacity
    if excess <= 0:
        return 0
    # Per bucket, the `excess` oldest entries and every entry tied with the last one,
    # so that the global (step, id) order can be cut exactly on the client.
    lru = [evalsha(sha.lru, LRU_CANDIDATES, [k], [excess]) for k in t.t_keys]
    cands = link.run(lru, what, label)
    cid = np.frombuffer(b"".join(c[0] for c in cands), dtype="<i8").astype(np.int64)
    sc = np.frombuffer(b"".join(c[1] for c in cands), dtype="<i8").astype(np.int64)
    bucket_of = np.concatenate(
        [np.full(len(c[0]) // 8, b, dtype=np.int64) for b, c in enumerate(cands)]
    )
    pick = np.lexsort((cid, sc))[:excess]  # by step, then id
    bk = bucket_of[pick]
    cmds = []
    for b in np.unique(bk).tolist():
        sel = pick[bk == b]
        cmds.append(
            evalsha(
                sha.ids,
                EVICT_IDS,
                [t.w_keys[b], t.s_keys[b], t.t_keys[b]],
                [cid[sel].astype("<i8").tobytes(), sc[sel].astype("<i8").tobytes()],
            )
        )
    return sum(int(r) for r in link.run(cmds, what, label))
