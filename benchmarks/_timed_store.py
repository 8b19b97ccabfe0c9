"""A ``ps.Store`` that times what another store spends, for benchmarks that split a
step into "the store's work" and "ours" (cache_bench: the cache's own time per id).

``TimedStore(inner)`` hands every call to ``inner`` and adds the seconds spent inside
it to ``seconds[phase]`` (``phase`` is set by the caller, e.g. "plan", "serve", "push"):
the calls themselves, and waiting on the handles they return (an MPI or Redis store's
network and server time is spent there).
"""

from __future__ import annotations

import math
import os
import time
from collections import defaultdict
from collections.abc import Sequence

import torch

import ps
from comm import Handle


class TimedStore(ps.Store):
    def __init__(self, inner: ps.Store) -> None:
        self.inner = inner
        self.phase = "other"
        self.seconds: defaultdict[str, float] = defaultdict(float)

    def _timed(self, call, *args, **kwargs):  # type: ignore[no-untyped-def]
        t = time.perf_counter()
        try:
            return call(*args, **kwargs)
        finally:
            self.seconds[self.phase] += time.perf_counter() - t

    def _wrap(self, h: Handle) -> Handle:
        # Waiting goes through the inner handle's own wait (a Redis or torch handle
        # completes only inside it), timed; the result comes from it once done.
        return Handle(
            h.is_completed,
            h.wait,
            what="timed",
            timeout_s=float("inf"),
            block=lambda limit: self._timed(h.wait, None if math.isinf(limit) else limit),
        )

    def create_table(self, spec: ps.TableSpec, *, exist_ok: bool = False) -> None:
        self.inner.create_table(spec, exist_ok=exist_ok)

    def drop_table(self, table: str) -> None:
        self.inner.drop_table(table)

    def tables(self) -> list[str]:
        return self.inner.tables()

    def spec(self, table: str) -> ps.TableSpec:
        return self.inner.spec(table)

    def pull_async(
        self,
        table: str,
        ids: torch.Tensor,
        *,
        clocks: torch.Tensor | None = None,
        bound: int | None = None,
    ) -> Handle:
        return self._wrap(
            self._timed(self.inner.pull_async, table, ids, clocks=clocks, bound=bound)
        )

    def push_async(self, table: str, ids: torch.Tensor, grads: torch.Tensor) -> Handle:
        return self._wrap(self._timed(self.inner.push_async, table, ids, grads))

    def pull_many_async(self, requests: Sequence[ps.PullRequest]) -> Handle:
        return self._wrap(self._timed(self.inner.pull_many_async, requests))

    def push_many_async(self, requests: Sequence[ps.PushRequest]) -> Handle:
        return self._wrap(self._timed(self.inner.push_many_async, requests))

    def clocks(self, table: str, ids: torch.Tensor) -> torch.Tensor:
        return self.inner.clocks(table, ids)

    def state(self, table: str, ids: torch.Tensor) -> torch.Tensor:
        return self.inner.state(table, ids)

    def stats(self) -> dict[str, dict[str, int | float]]:
        return self.inner.stats()

    def request_counts(self) -> dict[str, int]:
        return self.inner.request_counts()

    def save(self, path: str | os.PathLike[str]) -> None:
        self.inner.save(path)

    def load(self, path: str | os.PathLike[str]) -> None:
        self.inner.load(path)
