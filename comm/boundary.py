"""Where a worker's training step crosses between its device and the host.

Product code that needs on the host a value a device tensor holds (a split size, a
finiteness verdict, the ids a store takes, rows for a push), or that hands per-step data
from the host to the device, does it through these four functions and nowhere else:

=========================  ============================================================
``read(t)``                ``t.tolist()``: the values of a small tensor on the host
``to_host(tensors)``       device tensors on the host, in ONE copy (pinned memory)
``to_device(tensors, d)``  host tensors on device ``d``, in ONE ``non_blocking`` copy
``move(batch, d)``         a batch (anything with ``.to(device, non_blocking=)``) on ``d``
=========================  ============================================================

and ``constant(values, d)``: a small int64 tensor of values that change only with the
layout (table bases, row bounds), made on ``d`` once and kept, so it crosses once, not
per step; ``joined(parts)``: parts that one copy left back to back (``to_host`` and
``to_device`` results, a split), as one tensor without another copy.

On a GPU each call of ``read`` or ``to_host`` is at most one host synchronisation (the
host waits for the kernels that made the values), and each call of ``to_device`` or
``move`` at most one copy queued without waiting (from page-locked memory). On the host
``read`` reads and the others return their input, so callers make the same calls
whatever the device: a call is left out only for a reason that holds on every device
(the store keeps rows on the device, the batch came on the host). Counting the calls of
a step on the CPU therefore counts where a GPU run of that step may cross
(``tests/embedding/test_host_syncs.py`` does).

Not here: tensors that stay on the host on every worker (a store's ids, the cache's
slot metadata, split sizes the host computed), and the reads hidden in torch ops whose
output shape depends on values (``torch.unique``, ``nonzero``, a boolean mask): on a GPU
those synchronise too, which only ``torch.cuda.set_sync_debug_mode`` sees.

Callers reach them as attributes of this module (``boundary.read(t)``), so a function
replaced on the module (a test's wrapper) sees every call.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any, Protocol, Self, TypeVar

import torch


class Movable(Protocol):
    """What :func:`move` moves (``embedding.KeyedJaggedIds``, a tensor)."""

    def to(self, device: torch.device, non_blocking: bool = False) -> Self: ...


_M = TypeVar("_M", bound=Movable)


def read(t: torch.Tensor) -> Any:
    """``t.tolist()`` (a Python scalar for a 0-d tensor): one host sync on a GPU. For a
    few values that decide what the host does next (bounds, counts, verdicts)."""
    return t.tolist()


def to_host(tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """``tensors`` on the host: those on a device in ONE device-to-host copy per dtype
    into pinned memory, then one wait (one host sync on a GPU); host ones as they are.
    The results are views of the copy (detached)."""
    out = list(tensors)
    at = [i for i, t in enumerate(out) if t.device.type != "cpu"]
    if not at:
        return out
    device = out[at[0]].device
    cuda = device.type == "cuda"
    by_dtype: dict[torch.dtype, list[int]] = {}
    for i in at:
        by_dtype.setdefault(out[i].dtype, []).append(i)
    for dtype, idx in by_dtype.items():
        parts = [out[i].detach().reshape(-1) for i in idx]
        flat = parts[0] if len(parts) == 1 else torch.cat(parts)  # [sum numel] on the device
        host = torch.empty(flat.shape, dtype=dtype, pin_memory=cuda)
        host.copy_(flat, non_blocking=cuda)
        start = 0
        for i in idx:
            n = out[i].numel()
            out[i] = host[start : start + n].view(out[i].shape)
            start += n
    if cuda:  # the one wait: every copy above has landed once the stream is idle
        torch.cuda.current_stream(device).synchronize()
    return out


def to_device(tensors: Sequence[torch.Tensor], device: torch.device | str) -> list[torch.Tensor]:
    """Host ``tensors`` on ``device``: packed per dtype into pinned memory and copied in
    ONE ``non_blocking`` host-to-device copy per dtype (no host sync), the results views
    of it. Tensors already on ``device`` (every one, when it is the host) as they are."""
    device = torch.device(device)
    out = list(tensors)
    at = [i for i, t in enumerate(out) if t.device != device]
    if not at:
        return out
    by_dtype: dict[torch.dtype, list[int]] = {}
    for i in at:
        assert out[i].device.type == "cpu", f"to_device: a {out[i].device} tensor is not a host one"
        by_dtype.setdefault(out[i].dtype, []).append(i)
    for dtype, idx in by_dtype.items():
        n_all = sum(out[i].numel() for i in idx)
        host = torch.empty(n_all, dtype=dtype, pin_memory=device.type == "cuda")  # [sum numel]
        start = 0
        for i in idx:
            n = out[i].numel()
            host[start : start + n].view(out[i].shape).copy_(out[i])
            start += n
        moved = host.to(device, non_blocking=True)
        start = 0
        for i in idx:
            n = out[i].numel()
            out[i] = moved[start : start + n].view(out[i].shape)
            start += n
    return out


def move(batch: _M, device: torch.device | str) -> _M:
    """``batch.to(device)``, ``non_blocking`` towards a GPU (from pinned memory the copy
    overlaps; the batch itself is returned when it is there already)."""
    device = torch.device(device)
    return batch.to(device, non_blocking=device.type == "cuda")


@functools.lru_cache(maxsize=1024)
def constant(values: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """int64 ``[len(values)]`` on ``device``, made once per ``(values, device)`` and kept
    (never write to it). For values fixed by a layout, read every step: a fused group's
    table bases, a sharded table's row bounds. Made by a blocking copy, so it is complete
    for every stream that reads it later."""
    return torch.tensor(values, dtype=torch.int64, device=device)


def joined(parts: Sequence[torch.Tensor]) -> torch.Tensor:
    """``[sum n_i, *rest]``: the parts ``[n_i, *rest]`` one after the other. A view when
    they lie back to back in one storage (what one copy or one ``split`` made), else a
    concatenation (a copy)."""
    first = parts[0]
    if len(parts) == 1:
        return first
    rest, offset = first.shape[1:], first.storage_offset()
    ptr = first.untyped_storage().data_ptr()
    for p in parts:
        if (
            p.untyped_storage().data_ptr() != ptr
            or p.dtype != first.dtype
            or p.shape[1:] != rest
            or not p.is_contiguous()
            or p.storage_offset() != offset
        ):
            return torch.cat(list(parts))
        offset += p.numel()
    strides = [1]
    for d in reversed(rest):
        strides.insert(0, strides[0] * d)  # row-major
    rows = sum(int(p.shape[0]) for p in parts)
    return torch.as_strided(first, (rows, *rest), strides, first.storage_offset())
