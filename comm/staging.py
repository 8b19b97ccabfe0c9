"""Staging device tensors through page-locked host memory for the host-side backends.

The MPI backend (mpi4py reads numpy views of host memory) and gloo move host memory.
A CUDA tensor handed to one of their collectives travels::

    device tensor --D2H (non_blocking)--> pinned block --MPI / gloo--> pinned block(s)
                                                 --H2D (non_blocking, at wait)--> device tensor

Stream rules (the copies are queued on the device's current stream):

* D2H: an event is recorded after the copies into the host blocks, and the host waits
  for it (:meth:`StagedOp.inputs_ready`) before the library call reads the blocks:
  MPI and gloo read host memory outside any stream, so the bytes must be there first.
* H2D: the result is copied back when the handle is waited; an event recorded after
  that copy goes back to the pool with the blocks, and the pool waits for it before it
  hands such a block out again (the library may write a block the moment it has it,
  while a copy still reading the old bytes would then carry the new ones). Work queued
  later on the same stream sees the result in order, as with nccl.

Blocks come from a :class:`PinnedPool` per process group: byte blocks in power-of-two
size classes (at least 4 KiB), viewed as the dtype and shape each operation needs,
returned after the operation and reused by the next one of the same class. The pool
grows to the largest set of blocks in flight at once (one per bucket a
``DataParallel`` has in flight, say) and keeps them: pinning is a slow system call
that locks every page, so it is done once per block, not per operation.

CPU tensors never come here: the backends call their host path directly, with no copy
and no pinned allocation (``ProcessGroup._on_host`` decides; ``ProcessGroup._staged`` is
this path, which a test may call for CPU tensors to run it without a GPU).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from comm.handle import Handle

MIN_BLOCK_BYTES = 4096

#: How a host path allocates its outputs: ``alloc(shape, dtype)``; :func:`host_empty` for
#: CPU tensors, :meth:`StagedOp.empty` (pinned blocks) for staged ones.
Alloc = Callable[[tuple[int, ...], torch.dtype], torch.Tensor]


def host_empty(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    return torch.empty(shape, dtype=dtype)


class Pending(Protocol):
    """What must finish before a block is written again (a ``torch.cuda.Event``)."""

    def query(self) -> bool: ...

    def synchronize(self) -> None: ...


@dataclass(slots=True, eq=False)
class Block:
    """One host allocation of ``data.numel()`` bytes (a power of two)."""

    data: torch.Tensor  # uint8 [capacity]
    pending: Pending | None = None  # the last copy out of it, when not known to be done

    @property
    def capacity(self) -> int:
        return self.data.numel()

    def view(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """The first bytes of the block as a contiguous ``dtype`` tensor of ``shape``."""
        numel = 1
        for d in shape:
            numel *= d
        nbytes = numel * dtype.itemsize
        assert nbytes <= self.capacity, (nbytes, self.capacity)
        return self.data[:nbytes].view(dtype).view(shape)


def size_class(nbytes: int) -> int:
    """The block size that serves ``nbytes``: the next power of two, at least 4 KiB."""
    return max(MIN_BLOCK_BYTES, 1 << max(0, nbytes - 1).bit_length())


class PinnedPool:
    """Reusable host blocks for staging; see the module docstring.

    ``pin`` (default: whether torch sees CUDA) allocates page-locked memory; without
    CUDA a CPU-only torch cannot pin, and nothing needs it (only CUDA tensors are
    staged), so the blocks are ordinary memory there. ``stats`` counts ``allocated``
    blocks, ``reused`` hand-outs, ``waited`` hand-outs that had to wait for a copy,
    and ``bytes`` held in all blocks.
    """

    def __init__(self, *, pin: bool | None = None) -> None:
        self.pin = torch.cuda.is_available() if pin is None else bool(pin)
        self._free: dict[int, list[Block]] = {}  # size class -> blocks not in use
        self.stats = {"allocated": 0, "reused": 0, "waited": 0, "bytes": 0}

    def take(self, nbytes: int, device: torch.device | None = None) -> Block:
        """A block of at least ``nbytes`` bytes that nothing reads or writes any more
        (``device``: the device whose tensors it stages, for pinning)."""
        cls = size_class(nbytes)
        free = self._free.get(cls)
        if free:
            # Prefer a block whose last copy is known to be done; else wait for the oldest.
            for i, block in enumerate(free):
                if block.pending is None or block.pending.query():
                    free.pop(i)
                    break
            else:
                block = free.pop(0)
                assert block.pending is not None
                block.pending.synchronize()
                self.stats["waited"] += 1
            block.pending = None
            self.stats["reused"] += 1
            return block
        if self.pin and device is not None and device.type == "cuda":
            # Pin under the tensor's device, or CUDA would start a context on device 0 too.
            with torch.cuda.device(device):
                data = torch.empty(cls, dtype=torch.uint8, pin_memory=True)
        else:
            data = torch.empty(cls, dtype=torch.uint8, pin_memory=self.pin)
        self.stats["allocated"] += 1
        self.stats["bytes"] += cls
        return Block(data)

    def give_back(self, block: Block, pending: Pending | None) -> None:
        """Return ``block``; ``pending`` (if any) must finish before it is written again."""
        block.pending = pending
        self._free.setdefault(block.capacity, []).append(block)

    def free_blocks(self) -> int:
        return sum(len(v) for v in self._free.values())


def _current_event(device: torch.device) -> Any:
    """An event recorded now on ``device``'s current stream (None off CUDA)."""
    if device.type != "cuda":
        return None
    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream(device))
    return event


class StagedOp:
    """The host side of one operation on a device tensor: its blocks and its copies.

    ::

        op = StagedOp(pool, tensor.device, group.timeout_s)
        host = op.copy_in(tensor)            # or op.empty(shape, dtype) for a receive
        op.inputs_ready()                    # before MPI / gloo reads ``host``
        inner = host_collective(host, op.empty)   # outputs allocated with op.empty
        return op.handle(inner, into=tensor)      # in place; or op.handle(inner) for a new tensor
    """

    __slots__ = ("_pool", "device", "_timeout_s", "_blocks", "_copied")

    def __init__(self, pool: PinnedPool, device: torch.device, timeout_s: float) -> None:
        self._pool = pool
        self.device = device
        self._timeout_s = timeout_s  # the group's: what a wait without its own limit allows
        self._blocks: list[Block] = []
        self._copied = False

    def empty(self, shape: tuple[int, ...] | torch.Size, dtype: torch.dtype) -> torch.Tensor:
        """A host tensor from the pool, held until the operation finishes."""
        shape = tuple(int(d) for d in shape)
        numel = 1
        for d in shape:
            numel *= d
        block = self._pool.take(numel * dtype.itemsize, self.device)
        self._blocks.append(block)
        return block.view(shape, dtype)

    def copy_in(self, tensor: torch.Tensor) -> torch.Tensor:
        """A host copy of ``tensor`` (queued on its device's current stream)."""
        host = self.empty(tensor.shape, tensor.dtype)
        host.copy_(tensor, non_blocking=self.device.type == "cuda")
        self._copied = True
        return host

    def inputs_ready(self) -> None:
        """Wait until the copies of :meth:`copy_in` have landed in host memory."""
        if self._copied:
            event = _current_event(self.device)
            if event is not None:
                event.synchronize()

    def to_device(self, host: torch.Tensor, into: torch.Tensor | None = None) -> torch.Tensor:
        """``host`` copied to the device: into ``into`` (in place) or a new tensor."""
        out = (
            into
            if into is not None
            else torch.empty(host.shape, dtype=host.dtype, device=self.device)
        )
        out.copy_(host, non_blocking=self.device.type == "cuda")
        return out

    def release(self) -> None:
        """Give the blocks back once the copies queued so far have read them."""
        event = _current_event(self.device)
        for block in self._blocks:
            self._pool.give_back(block, event)
        self._blocks = []

    def handle(
        self,
        inner: Handle,
        *,
        into: torch.Tensor | None = None,
        result: Callable[[Any], Any] | None = None,
    ) -> Handle:
        """A handle over ``inner`` (the host operation) that, at wait, copies its result to
        the device (into ``into``, or as a new tensor; a None result stays None) and gives
        the blocks back. ``result`` (optional) maps the host result first."""

        def finish() -> Any:
            host = inner.wait()
            if result is not None:
                host = result(host)
            out = None if host is None else self.to_device(host, into)
            self.release()
            return out

        return Handle(
            inner.is_completed,
            finish,
            what=f"staged operation on {self.device}",
            timeout_s=self._timeout_s,
            block=inner.wait,
        )
