"""A rank training alone, unpipelined, sends its push in backward and waits for it at
its next store call. The order of the store calls is recorded by a store whose handles
log when they are waited for. Reference for the training itself: the same model and
batches with every push waited for at once (a second, plain store): the rows, state and
clocks must be equal bit for bit, since the stores run the same kernels on the same
requests in the same order (a store applies one worker's requests in order)."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
import torch
import torch.nn.functional as F

import ps
from comm import Handle
from ps.group_requests import GroupPull, GroupPush
from tiny_hybrid import TinyHybrid, tiny_batch
from wrapped_store import WrappedStore

pytestmark = pytest.mark.timeout(60)


class Recording(WrappedStore):
    """An in-process store whose group calls log ``"<pull|push> sent"`` and, when their
    handle is waited for, ``"<pull|push> waited"``."""

    def __init__(self) -> None:
        super().__init__()
        self.log: list[str] = []

    def _logged(self, what: str, handle: Handle) -> Handle:
        self.log.append(f"{what} sent")

        def done() -> object:
            self.log.append(f"{what} waited")
            return handle.wait()

        return Handle(lambda: True, done, what=what, timeout_s=10.0)

    def pull_groups_async(self, requests: Sequence[ps.PullRequest | GroupPull]) -> Handle:
        return self._logged("pull", self.inner.pull_groups_async(requests))

    def push_groups_async(self, requests: Sequence[ps.PushRequest | GroupPush]) -> Handle:
        return self._logged("push", self.inner.push_groups_async(requests))


def _step(model: TinyHybrid, batch: tuple[torch.Tensor, torch.Tensor]) -> None:
    kjt, labels = batch
    F.binary_cross_entropy_with_logits(model(kjt), labels).backward()


def test_the_push_is_waited_for_at_the_next_store_call() -> None:
    store = Recording()
    model = TinyHybrid(store, ps.RowWiseAdagrad(lr=0.1))
    hybrid = model.emb.hybrid
    assert hybrid is not None
    g = torch.Generator().manual_seed(0)
    _step(model, tiny_batch(g))
    assert store.log == ["pull sent", "pull waited", "push sent"]  # backward did not wait
    _step(model, tiny_batch(g))
    assert store.log[3:] == ["push waited", "pull sent", "pull waited", "push sent"]
    hybrid.drain()
    assert store.log[-1] == "push waited"
    hybrid.drain()  # nothing left in flight
    assert store.log.count("push waited") == 2
    # Pipelined, the push runs (and is waited for) on the pipeline's thread.
    model.emb.set_sparse_pipeline(True)
    store.log.clear()
    _step(model, tiny_batch(g))
    hybrid.drain()
    assert store.log == ["pull sent", "pull waited", "push sent", "push waited"]


def test_pushes_waited_for_later_train_exactly_like_pushes_waited_for_at_once() -> None:
    store, plain = Recording(), ps.InProcessStore()
    later = TinyHybrid(store, ps.RowWiseAdagrad(lr=0.1))
    at_once = TinyHybrid(plain, ps.RowWiseAdagrad(lr=0.1))
    g = torch.Generator().manual_seed(1)
    for _ in range(6):
        batch = tiny_batch(g)
        _step(later, batch)
        _step(at_once, batch)
        at_once.emb.hybrid.drain()  # type: ignore[union-attr]
    later.emb.hybrid.flush()  # type: ignore[union-attr]
    assert store.log[-1] == "push waited"
    for name, rows in (("user", 300), ("item", 500)):
        every = torch.arange(rows)
        assert torch.equal(store.pull(name, every).rows, plain.pull(name, every).rows)
        assert torch.equal(store.state(name, every), plain.state(name, every))
        assert torch.equal(store.clocks(name, every), plain.clocks(name, every))
