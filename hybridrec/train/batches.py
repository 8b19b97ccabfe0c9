"""What the trainer iterates: a job's batches per epoch, restartable at a saved position.

A data source for :class:`hybridrec.train.loop.Trainer` is anything with

* ``steps_per_epoch``: an int, or None for a stream of unknown length;
* ``train_batches(epoch, skip, position)``: an iterator of ``(batch, position)``
  from step ``skip`` of ``epoch`` on. ``position`` is this rank's int64 vector
  after the batch (e.g. a file reader's offset; an empty tensor or None when the
  step count alone locates it); a resumed run passes the saved one back.

:func:`epoch_data` wraps plain Python data in that shape: a list of batches (the
same batches every epoch) or a function ``epoch -> iterable of batches``.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, Protocol, TypeVar, runtime_checkable

import torch

from comm import ProcessGroup

T = TypeVar("T")


@runtime_checkable
class EpochData(Protocol):
    @property
    def steps_per_epoch(self) -> int | None: ...

    def train_batches(
        self, epoch: int, skip: int = 0, start: torch.Tensor | None = None
    ) -> Iterator[tuple[Any, torch.Tensor | None]]: ...


class _Batches:
    """Plain batches as :class:`EpochData`: resuming skips the steps already done."""

    def __init__(self, make: Callable[[int], Iterable[Any]], steps: int | None) -> None:
        self._make = make
        self._steps = steps

    @property
    def steps_per_epoch(self) -> int | None:
        return self._steps

    def train_batches(
        self, epoch: int, skip: int = 0, start: torch.Tensor | None = None
    ) -> Iterator[tuple[Any, torch.Tensor | None]]:
        del start  # the step count locates a plain batch list
        for batch in itertools.islice(self._make(epoch), skip, None):
            yield batch, None


def epoch_data(data: EpochData | Sequence[Any] | Callable[[int], Iterable[Any]]) -> EpochData:
    """``data`` as :class:`EpochData`: itself if it is one; a sequence of batches (each
    epoch goes over it again); or a function ``epoch -> batches`` (length unknown)."""
    if isinstance(data, EpochData):
        return data
    if isinstance(data, Sequence):
        return _Batches(lambda epoch: data, len(data))
    if callable(data):
        return _Batches(data, None)
    raise TypeError(
        "Trainer data: expected a list of batches, a function epoch -> batches or an object "
        f"with steps_per_epoch and train_batches(epoch, skip, start), got {type(data).__name__}"
    )


def agreed(items: Iterable[T], group: ProcessGroup, check: bool) -> Iterator[T]:
    """``items`` while every rank still has one (``check``: one tiny allreduce per item;
    for streams, whose ranks may hold one batch more or less)."""
    it = iter(items)
    while True:
        item = next(it, None)
        if check:
            missing = torch.tensor([1 if item is None else 0], dtype=torch.int64)
            if int(group.allreduce(missing, op="max")):  # some rank ran out
                return
        if item is None:
            return
        yield item


def with_next(items: Iterator[T], lookahead: bool) -> Iterator[tuple[T, T | None]]:
    """``(item, next item or None)``; without ``lookahead`` next is always None (the
    next batch is then not read before this one's step)."""
    cur = next(items, None)
    while cur is not None:
        nxt = next(items, None) if lookahead else None
        yield cur, nxt
        cur = nxt if lookahead else next(items, None)
