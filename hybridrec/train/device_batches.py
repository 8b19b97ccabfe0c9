"""Batches on the worker's device: pinned host memory, copied ahead on a side stream.

On a CUDA worker every batch is built on the host, pinned, and copied with
``non_blocking=True`` on a copy stream while the previous step's kernels run: the
copy of batch ``i + 1`` is issued before step ``i`` is handed out, and the compute
stream waits for it (an event, no host synchronisation) only when batch ``i + 1``
is used. On a CPU worker batches pass through untouched.

A batch is any nesting of tensors, :class:`embedding.KeyedJaggedIds`, dataclasses,
tuples, lists and dicts. ``sparse_on_host``: the ``KeyedJaggedIds`` stay on the host
(pinned), for models whose hybrid tables dedup and pull ids on the host; the
embedding collection moves what its device tables need itself.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch

from embedding import KeyedJaggedIds
from hybridrec.train.batches import EpochData


def map_batch(batch: Any, fn: Callable[[Any], Any]) -> Any:
    """``batch`` with ``fn`` applied to every tensor and ``KeyedJaggedIds`` in it."""
    if isinstance(batch, torch.Tensor | KeyedJaggedIds):
        return fn(batch)
    if dataclasses.is_dataclass(batch) and not isinstance(batch, type):
        changes = {f.name: map_batch(getattr(batch, f.name), fn) for f in dataclasses.fields(batch)}
        return dataclasses.replace(batch, **changes)
    if isinstance(batch, tuple):
        items = [map_batch(b, fn) for b in batch]
        return type(batch)(*items) if hasattr(batch, "_fields") else tuple(items)
    if isinstance(batch, list):
        return [map_batch(b, fn) for b in batch]
    if isinstance(batch, dict):
        return {k: map_batch(v, fn) for k, v in batch.items()}
    return batch


def to_device(
    batch: Any, device: torch.device, *, non_blocking: bool = False, sparse_on_host: bool = False
) -> Any:
    """``batch`` on ``device`` (``KeyedJaggedIds`` left alone with ``sparse_on_host``)."""

    def move(t: Any) -> Any:
        if sparse_on_host and isinstance(t, KeyedJaggedIds):
            return t
        return t.to(device, non_blocking=non_blocking)

    return map_batch(batch, move)


def pinned(batch: Any) -> Any:
    """``batch`` in page-locked host memory, so a host -> device copy can run async.
    A ``KeyedJaggedIds`` measures its key boundaries here, on the host, so slicing it
    by key on the device reads nothing back."""

    def pin(t: Any) -> Any:
        if isinstance(t, KeyedJaggedIds) and t.device.type == "cpu":
            t.key_starts()
        return t if t.device.type != "cpu" or t.is_pinned() else t.pin_memory()

    return map_batch(batch, pin)


def _record(batch: Any, stream: Any) -> None:
    """Tell the CUDA allocator the batch's memory is used on ``stream`` (it was made on
    the copy stream; without this it could be reused while the step still reads it)."""

    def rec(t: Any) -> Any:
        tensors = [t] if isinstance(t, torch.Tensor) else [t.ids, t.lengths, t.weights]
        for x in tensors:
            if x is not None and x.is_cuda:
                x.record_stream(stream)
        return t

    map_batch(batch, rec)


class DeviceBatches:
    """Iterate batches on ``device``, each copied while the step before it runs.

    ``batches(items)`` takes an iterable of host batches (or ``(batch, extra)`` pairs
    with ``pairs=True``, the trainer's ``(batch, data position)``) and yields them on
    the device. On the CPU it yields them as they are.
    """

    def __init__(self, device: torch.device, *, sparse_on_host: bool = False) -> None:
        self.device = device
        self.sparse_on_host = sparse_on_host
        self.cuda = device.type == "cuda"
        self._stream = torch.cuda.Stream(device) if self.cuda else None

    def _issue(self, batch: Any) -> tuple[Any, Any]:
        """Start the copy of one host batch; ``(device batch, event)``."""
        assert self._stream is not None
        host = pinned(batch)
        with torch.cuda.stream(self._stream):
            moved = to_device(
                host, self.device, non_blocking=True, sparse_on_host=self.sparse_on_host
            )
            done = torch.cuda.Event()
            done.record(self._stream)
        return moved, done

    def batches(self, items: Iterable[Any], *, pairs: bool = False) -> Iterator[Any]:
        if not self.cuda:
            yield from items
            return
        it = iter(items)
        ahead = self._next(it, pairs)
        while ahead is not None:
            (moved, done), extra = ahead
            ahead = self._next(it, pairs)  # the next copy starts before this step runs
            current = torch.cuda.current_stream(self.device)
            current.wait_event(done)
            _record(moved, current)
            yield (moved, extra) if pairs else moved

    def _next(self, it: Iterator[Any], pairs: bool) -> tuple[tuple[Any, Any], Any] | None:
        item = next(it, None)
        if item is None:
            return None
        batch, extra = item if pairs else (item, None)
        return self._issue(batch), extra


class DeviceEpochData:
    """An :class:`~hybridrec.train.batches.EpochData` whose training batches arrive on a device
    (the data positions stay host tensors)."""

    def __init__(self, data: EpochData, feed: DeviceBatches) -> None:
        self.data = data
        self.feed = feed

    @property
    def steps_per_epoch(self) -> int | None:
        return self.data.steps_per_epoch

    def train_batches(
        self, epoch: int, skip: int = 0, start: torch.Tensor | None = None
    ) -> Iterator[tuple[Any, torch.Tensor | None]]:
        return self.feed.batches(self.data.train_batches(epoch, skip, start), pairs=True)
