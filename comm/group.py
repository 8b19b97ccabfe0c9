"""The process-group interface every backend implements.

A ``ProcessGroup`` is a set of ``size`` processes; this one is number ``rank``.
Every collective has two forms:

* ``group.allreduce(t)``: blocks until done and returns the result;
* ``group.allreduce_async(t)``: returns a :class:`Handle` at once; ``handle.wait()``
  blocks (at most the group's timeout) and returns the same result.

Tensors are CPU (or CUDA for nccl) torch tensors, contiguous. Collectives that
say "in place" write into the tensor they were given and also return it.

Backends implement the ``_*_async`` primitives; the public methods here do the
argument checks once, so every backend reports bad input with the same words.
"""

from __future__ import annotations

import enum
from abc import ABC, abstractmethod
from collections.abc import Sequence

import torch

from comm.handle import Handle
from comm.validate import (
    check_contiguous,
    check_rank,
    check_same_across_ranks,
    check_splits,
    exchange_splits,
)


class ReduceOp(enum.Enum):
    SUM = "sum"
    AVG = "avg"
    MAX = "max"

    @classmethod
    def parse(cls, op: ReduceOp | str) -> ReduceOp:
        if isinstance(op, ReduceOp):
            return op
        try:
            return cls(str(op).lower())
        except ValueError:
            names = ", ".join(repr(o.value) for o in cls)
            raise ValueError(f"unknown reduce op {op!r}; expected one of {names}") from None


class ProcessGroup(ABC):
    """``size`` processes talking to each other; this one is ``rank``.

    ``timeout_s`` bounds every ``Handle.wait()`` that is not given its own timeout:
    a peer that died or never joins raises :class:`comm.CommTimeoutError` instead of
    hanging. ``validate`` exchanges a small signature (dtype, shape, split sizes)
    before each collective so that mismatches across ranks raise ``ValueError`` on
    every rank instead of corrupting memory or hanging; it costs one tiny
    collective per call and can be switched off for tight loops.
    """

    backend: str
    # Where this group's tensors live; only nccl groups use CUDA.
    device: torch.device = torch.device("cpu")

    def __init__(self, rank: int, size: int, *, timeout_s: float, validate: bool) -> None:
        if size < 1 or not 0 <= rank < size:
            raise ValueError(f"bad process group: rank {rank} of size {size}")
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0 seconds, got {timeout_s}")
        self.rank = rank
        self.size = size
        self.timeout_s = float(timeout_s)
        self.validate = validate

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(backend={self.backend!r}, rank={self.rank}, size={self.size})"
        )

    # ------------------------------------------------------------------ public API

    def allreduce_async(self, tensor: torch.Tensor, op: ReduceOp | str = "sum") -> Handle:
        """In place: every rank ends with the elementwise reduction over ranks."""
        rop = ReduceOp.parse(op)
        check_contiguous(self, "allreduce", "tensor", tensor)
        if rop is ReduceOp.AVG and not (tensor.is_floating_point() or tensor.is_complex()):
            raise TypeError(
                f"allreduce: op 'avg' needs a floating-point tensor, rank {self.rank} "
                f"passed {tensor.dtype}"
            )
        if self.validate and self.size > 1:
            check_same_across_ranks(self, "allreduce", "tensor", tensor)
        return self._allreduce_async(tensor, rop)

    def allreduce(self, tensor: torch.Tensor, op: ReduceOp | str = "sum") -> torch.Tensor:
        return self.allreduce_async(tensor, op).wait()

    def broadcast_async(self, tensor: torch.Tensor, root: int = 0) -> Handle:
        """In place: every rank ends with ``root``'s tensor."""
        check_rank(self, "broadcast", "root", root)
        check_contiguous(self, "broadcast", "tensor", tensor)
        if self.validate and self.size > 1:
            check_same_across_ranks(self, "broadcast", "tensor", tensor)
        return self._broadcast_async(tensor, root)

    def broadcast(self, tensor: torch.Tensor, root: int = 0) -> torch.Tensor:
        return self.broadcast_async(tensor, root).wait()

    def allgather_async(self, tensor: torch.Tensor) -> Handle:
        """Every rank's tensor (same shape everywhere), stacked: ``[size, *tensor.shape]``."""
        check_contiguous(self, "allgather", "tensor", tensor)
        if self.validate and self.size > 1:
            check_same_across_ranks(self, "allgather", "tensor", tensor)
        return self._allgather_async(tensor)

    def allgather(self, tensor: torch.Tensor) -> torch.Tensor:
        return self.allgather_async(tensor).wait()

    def allgatherv_async(self, tensor: torch.Tensor) -> Handle:
        """Every rank's rows concatenated in rank order; row counts may differ.

        ``tensor`` is ``[n_rank, *tail]`` (1-D or row-major N-D, same tail and dtype
        everywhere); the result is ``[sum(n_rank), *tail]``. The row counts are
        learned with one small allgather before the data moves.
        """
        check_contiguous(self, "allgatherv", "tensor", tensor)
        if tensor.dim() == 0:
            raise ValueError(f"allgatherv: rank {self.rank} passed a 0-d tensor; it needs rows")
        if self.size == 1:
            return self._allgatherv_async(tensor, [int(tensor.shape[0])])
        if self.validate:
            check_same_across_ranks(self, "allgatherv", "tensor", tensor, skip_first_dim=True)
        mine = torch.tensor([tensor.shape[0]], dtype=torch.int64, device=tensor.device)
        counts = [int(c) for c in self._allgather_async(mine).wait().flatten().tolist()]
        return self._allgatherv_async(tensor, counts)

    def allgatherv(self, tensor: torch.Tensor) -> torch.Tensor:
        return self.allgatherv_async(tensor).wait()

    def reduce_scatter_async(self, tensor: torch.Tensor, op: ReduceOp | str = "sum") -> Handle:
        """Reduce ``[size * n, *tail]`` over ranks; rank ``r`` gets rows ``[r*n, (r+1)*n)``."""
        rop = ReduceOp.parse(op)
        check_contiguous(self, "reduce_scatter", "tensor", tensor)
        if tensor.dim() == 0 or tensor.shape[0] % self.size != 0:
            raise ValueError(
                f"reduce_scatter: rank {self.rank} passed a tensor of shape "
                f"{tuple(tensor.shape)}; its first dimension must be a multiple of the "
                f"group size {self.size}"
            )
        if rop is ReduceOp.AVG and not tensor.is_floating_point():
            raise TypeError(
                f"reduce_scatter: op 'avg' needs a floating-point tensor, rank {self.rank} "
                f"passed {tensor.dtype}"
            )
        if self.validate and self.size > 1:
            check_same_across_ranks(self, "reduce_scatter", "tensor", tensor)
        return self._reduce_scatter_async(tensor, rop)

    def reduce_scatter(self, tensor: torch.Tensor, op: ReduceOp | str = "sum") -> torch.Tensor:
        return self.reduce_scatter_async(tensor, op).wait()

    def alltoallv_async(
        self,
        tensor: torch.Tensor,
        send_splits: Sequence[int],
        recv_splits: Sequence[int] | None = None,
    ) -> Handle:
        """Personalised exchange with variable sizes.

        ``tensor`` is ``[sum(send_splits), *tail]`` (1-D, or row-major 2-D and up);
        rows ``send_splits[:p]`` .. go to peer ``p`` in order. The result is
        ``[sum(recv_splits), *tail]``: peer 0's rows first. When ``recv_splits`` is
        None it is learned from the peers (one small alltoall of the counts); when
        given it is checked against what the peers send if ``validate`` is on.
        """
        check_contiguous(self, "alltoallv", "tensor", tensor)
        if tensor.dim() == 0:
            raise ValueError(
                f"alltoallv: rank {self.rank} passed a 0-d tensor; it needs rows to split"
            )
        send = check_splits(self, "alltoallv", "send_splits", send_splits, int(tensor.shape[0]))
        if recv_splits is not None:
            recv: list[int] | None = check_splits(
                self, "alltoallv", "recv_splits", recv_splits, None
            )
        else:
            recv = None
        if self.size > 1 and (recv is None or self.validate):
            if self.validate:
                # dtype and row shape must agree; the row count may differ per rank.
                check_same_across_ranks(self, "alltoallv", "tensor", tensor, skip_first_dim=True)
            learned = exchange_splits(self, send)
            if recv is not None and recv != learned:
                bad = next(p for p in range(self.size) if recv[p] != learned[p])
                raise ValueError(
                    f"alltoallv: rank {self.rank} expects recv_splits[{bad}]={recv[bad]} rows "
                    f"from rank {bad}, but rank {bad} sends {learned[bad]} "
                    f"(recv_splits={recv}, peers send {learned})"
                )
            recv = learned
        if recv is None:  # size 1
            recv = send
        return self._alltoallv_async(tensor, send, recv)

    def alltoallv(
        self,
        tensor: torch.Tensor,
        send_splits: Sequence[int],
        recv_splits: Sequence[int] | None = None,
    ) -> torch.Tensor:
        return self.alltoallv_async(tensor, send_splits, recv_splits).wait()

    def barrier_async(self) -> Handle:
        return self._barrier_async()

    def barrier(self) -> None:
        self.barrier_async().wait()

    def send_async(self, tensor: torch.Tensor, dst: int, tag: int = 0) -> Handle:
        """Point-to-point send; the peer must post a matching ``recv`` of the same size."""
        check_rank(self, "send", "dst", dst)
        check_contiguous(self, "send", "tensor", tensor)
        if dst == self.rank:
            raise ValueError(f"send: rank {self.rank} cannot send to itself (dst={dst})")
        return self._send_async(tensor, dst, tag)

    def send(self, tensor: torch.Tensor, dst: int, tag: int = 0) -> None:
        self.send_async(tensor, dst, tag).wait()

    def recv_async(self, tensor: torch.Tensor, src: int, tag: int = 0) -> Handle:
        """Point-to-point receive into ``tensor`` (in place)."""
        check_rank(self, "recv", "src", src)
        check_contiguous(self, "recv", "tensor", tensor)
        if src == self.rank:
            raise ValueError(f"recv: rank {self.rank} cannot receive from itself (src={src})")
        return self._recv_async(tensor, src, tag)

    def recv(self, tensor: torch.Tensor, src: int, tag: int = 0) -> torch.Tensor:
        return self.recv_async(tensor, src, tag).wait()

    def split(self, color: int, key: int | None = None) -> ProcessGroup:
        """Collective: ranks passing the same ``color`` form a new group.

        Ranks in the new group are ordered by ``key`` (default: the rank here).
        Example: ``group.split(0 if is_server else 1)`` gives the servers their group
        and the workers theirs.
        """
        if not isinstance(color, int) or color < 0:
            raise ValueError(
                f"split: rank {self.rank} passed color={color!r}; expected an int >= 0"
            )
        return self._split(color, self.rank if key is None else int(key))

    def close(self) -> None:  # noqa: B027 - most backends have nothing to release
        """Release backend resources; the group is unusable afterwards."""

    def __enter__(self) -> ProcessGroup:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------- backend primitives

    @abstractmethod
    def _allreduce_async(self, tensor: torch.Tensor, op: ReduceOp) -> Handle: ...

    @abstractmethod
    def _broadcast_async(self, tensor: torch.Tensor, root: int) -> Handle: ...

    @abstractmethod
    def _allgather_async(self, tensor: torch.Tensor) -> Handle: ...

    @abstractmethod
    def _allgatherv_async(self, tensor: torch.Tensor, counts: list[int]) -> Handle: ...

    @abstractmethod
    def _reduce_scatter_async(self, tensor: torch.Tensor, op: ReduceOp) -> Handle: ...

    @abstractmethod
    def _alltoallv_async(
        self, tensor: torch.Tensor, send: list[int], recv: list[int]
    ) -> Handle: ...

    @abstractmethod
    def _barrier_async(self) -> Handle: ...

    @abstractmethod
    def _send_async(self, tensor: torch.Tensor, dst: int, tag: int) -> Handle: ...

    @abstractmethod
    def _recv_async(self, tensor: torch.Tensor, src: int, tag: int) -> Handle: ...

    @abstractmethod
    def _split(self, color: int, key: int) -> ProcessGroup: ...
