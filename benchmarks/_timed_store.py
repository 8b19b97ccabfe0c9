"""A ``ps.Store`` that times what another store spends, for benchmarks that split a
step into "the store's work" and "ours" (cache_bench: the cache's own time per id).

``TimedStore(inner)`` hands every call to ``inner`` (``tests/support/wrapped_store.py``) and adds
the seconds spent inside its requests (and its clocks and state reads) to
``seconds[phase]`` (``phase`` is set by the
caller, e.g. "plan", "serve", "push"): the calls themselves, and waiting on the handles
they return (an MPI or Redis store's network and server time is spent there). Batched
and group requests go to ``inner`` as they are, so it still sends one message per server.
"""

from __future__ import annotations

import math
import time
from collections import defaultdict
from collections.abc import Callable, Sequence
from typing import Any

import torch

import ps
from comm import Handle
from ps.group_requests import GroupPull, GroupPush, GroupWrite
from tests.support.wrapped_store import WrappedStore  # the repository root is on the path


class TimedStore(WrappedStore):
    def __init__(self, inner: ps.Store) -> None:
        super().__init__(inner)
        self.counted_pushes = inner.counted_pushes  # its batched pushes go to inner whole
        self.value_writes = inner.value_writes  # and its writes
        self.phase = "other"
        self.seconds: defaultdict[str, float] = defaultdict(float)

    def _timed(self, call: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
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

    def pull_async(
        self,
        table: str,
        ids: torch.Tensor,
        *,
        clocks: torch.Tensor | None = None,
        bound: int | None = None,
    ) -> Handle:
        return self._wrap(self._timed(super().pull_async, table, ids, clocks=clocks, bound=bound))

    def push_async(self, table: str, ids: torch.Tensor, grads: torch.Tensor) -> Handle:
        return self._wrap(self._timed(super().push_async, table, ids, grads))

    def pull_many_async(self, requests: Sequence[ps.PullRequest]) -> Handle:
        return self._wrap(self._timed(self.inner.pull_many_async, requests))

    def push_many_async(self, requests: Sequence[ps.PushRequest]) -> Handle:
        return self._wrap(self._timed(self.inner.push_many_async, requests))

    def pull_groups_async(self, requests: Sequence[ps.PullRequest | GroupPull]) -> Handle:
        return self._wrap(self._timed(self.inner.pull_groups_async, requests))

    def push_groups_async(self, requests: Sequence[ps.PushRequest | GroupPush]) -> Handle:
        return self._wrap(self._timed(self.inner.push_groups_async, requests))

    def write_many_async(self, requests: Sequence[ps.WriteRequest]) -> Handle:
        return self._wrap(self._timed(self.inner.write_many_async, requests))

    def write_groups_async(self, requests: Sequence[ps.WriteRequest | GroupWrite]) -> Handle:
        return self._wrap(self._timed(self.inner.write_groups_async, requests))

    def clocks(self, table: str, ids: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self._timed(self.inner.clocks, table, ids)
        return out

    def state(self, table: str, ids: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self._timed(self.inner.state, table, ids)
        return out

    def state_many(self, requests: Sequence[tuple[str, torch.Tensor]]) -> list[torch.Tensor]:
        out: list[torch.Tensor] = self._timed(self.inner.state_many, requests)
        return out

    def request_counts(self) -> dict[str, int]:
        return self.inner.request_counts()
