"""The process-group interface every backend implements.

A ``ProcessGroup`` is a set of ``size`` processes; this one is number ``rank``.
Every collective has two forms:

* ``group.allreduce(t)``: blocks until done and returns the result;
* ``group.allreduce_async(t)``: returns a :class:`Handle` at once; ``handle.wait()``
  blocks (at most the group's timeout) and returns the same result.

Tensors are contiguous torch tensors on the CPU or a CUDA device, with every
backend: nccl moves CUDA tensors itself; mpi and gloo stage them through pinned
host buffers (``comm/staging.py``). A result lives on its input's device.
Collectives that say "in place" write into the tensor they were given and also
return it.

Backends implement the ``_*_async`` primitives; the public methods here do the
argument checks once, so every backend reports bad input with the same words.
"""

from __future__ import annotations

import enum
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from typing import Literal, NamedTuple

import torch

from comm.handle import Handle
from comm.staging import Alloc, PinnedPool, StagedOp, host_empty
from comm.validate import (
    check_avg_dtype,
    check_contiguous,
    check_rank,
    check_recv_splits,
    check_signatures,
    check_splits,
    signature_row,
    signature_rows,
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


class P2POp(NamedTuple):
    """One operation of :meth:`ProcessGroup.p2p_async`: ``"send"`` ``tensor`` to rank
    ``peer``, or ``"recv"`` into ``tensor`` (in place) from ``peer``. ``tag`` tells
    messages apart on mpi and gloo; nccl ignores it."""

    kind: Literal["send", "recv"]
    tensor: torch.Tensor
    peer: int
    tag: int = 0


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
    _pool: PinnedPool | None = None  # created on the first staged operation

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

    # ------------------------------------------------------------------ checks

    def _agree(
        self,
        op: str,
        tensor: object,
        local_checks: Callable[[], None],
        *,
        skip_first_dim: bool = False,
        extra: Callable[[], list[int]] | None = None,
        extra_len: int = 0,
    ) -> list[list[int]] | None:
        """Run this rank's argument checks; with ``validate`` on, agree with every rank.

        Without validation a bad argument raises here, on this rank only (its peers
        then wait until their timeout). With validation every rank contributes one
        row ``[error flag, tensor signature, *extra()]`` to a single small allgather,
        so a bad argument on any rank, or a dtype/shape mismatch between ranks,
        raises ``ValueError`` on every rank before any data moves. Returns the
        gathered rows (None when nothing was gathered).
        """
        if not (self.validate and self.size > 1):
            local_checks()
            return None
        error: ValueError | TypeError | None = None
        try:
            local_checks()
        except (ValueError, TypeError) as e:
            error = e
        ok_tensor = tensor if error is None and isinstance(tensor, torch.Tensor) else None
        tail = extra() if (error is None and extra is not None) else [0] * extra_len
        row = signature_row(ok_tensor, error is not None, skip_first_dim, tail)
        table = signature_rows(self.rank, self._allgather_ints(row), error is not None)
        if error is not None:
            raise error
        check_signatures(op, "tensor", table)
        return table

    # ------------------------------------------------------------------ public API

    def allreduce_async(self, tensor: torch.Tensor, op: ReduceOp | str = "sum") -> Handle:
        """In place: every rank ends with the elementwise reduction over ranks."""

        def local() -> None:
            check_contiguous(self.rank, "allreduce", "tensor", tensor)
            if rop is ReduceOp.AVG:
                check_avg_dtype(self.rank, "allreduce", tensor)

        rop = ReduceOp.parse(op)
        self._agree("allreduce", tensor, local)
        return self._allreduce_async(tensor, rop)

    def allreduce(self, tensor: torch.Tensor, op: ReduceOp | str = "sum") -> torch.Tensor:
        return self.allreduce_async(tensor, op).wait()

    def broadcast_async(self, tensor: torch.Tensor, root: int = 0) -> Handle:
        """In place: every rank ends with ``root``'s tensor."""

        def local() -> None:
            check_rank(self.rank, self.size, "broadcast", "root", root)
            check_contiguous(self.rank, "broadcast", "tensor", tensor)

        table = self._agree("broadcast", tensor, local, extra=lambda: [root], extra_len=1)
        if table is not None and any(row[-1] != root for row in table):
            roots = [row[-1] for row in table]
            raise ValueError(f"broadcast: ranks disagree on root: {roots} (one per rank)")
        return self._broadcast_async(tensor, root)

    def broadcast(self, tensor: torch.Tensor, root: int = 0) -> torch.Tensor:
        return self.broadcast_async(tensor, root).wait()

    def allgather_async(self, tensor: torch.Tensor) -> Handle:
        """Every rank's tensor (same shape everywhere), stacked: ``[size, *tensor.shape]``."""
        self._agree(
            "allgather", tensor, lambda: check_contiguous(self.rank, "allgather", "tensor", tensor)
        )
        return self._allgather_async(tensor)

    def allgather(self, tensor: torch.Tensor) -> torch.Tensor:
        return self.allgather_async(tensor).wait()

    def allgatherv_async(self, tensor: torch.Tensor) -> Handle:
        """Every rank's rows concatenated in rank order; row counts may differ.

        ``tensor`` is ``[n_rank, *tail]`` (1-D or row-major N-D, same tail and dtype
        everywhere); the result is ``[sum(n_rank), *tail]``. The row counts travel in
        the validation allgather, or in one small allgather of their own.
        """

        def local() -> None:
            check_contiguous(self.rank, "allgatherv", "tensor", tensor)
            if tensor.dim() == 0:
                raise ValueError(f"allgatherv: rank {self.rank} passed a 0-d tensor; it needs rows")

        table = self._agree(
            "allgatherv", tensor, local, skip_first_dim=True,
            extra=lambda: [int(tensor.shape[0])], extra_len=1,
        )  # fmt: skip
        if table is not None:
            counts = [row[-1] for row in table]
        elif self.size == 1:
            counts = [int(tensor.shape[0])]
        else:
            mine = torch.tensor([tensor.shape[0]], dtype=torch.int64)
            counts = [int(c) for c in self._allgather_async(mine).wait().flatten().tolist()]
        return self._allgatherv_async(tensor, counts)

    def allgatherv(self, tensor: torch.Tensor) -> torch.Tensor:
        return self.allgatherv_async(tensor).wait()

    def reduce_scatter_async(self, tensor: torch.Tensor, op: ReduceOp | str = "sum") -> Handle:
        """Reduce ``[size * n, *tail]`` over ranks; rank ``r`` gets rows ``[r*n, (r+1)*n)``."""

        def local() -> None:
            check_contiguous(self.rank, "reduce_scatter", "tensor", tensor)
            if tensor.dim() == 0 or tensor.shape[0] % self.size != 0:
                raise ValueError(
                    f"reduce_scatter: rank {self.rank} passed a tensor of shape "
                    f"{tuple(tensor.shape)}; its first dimension must be a multiple of the "
                    f"group size {self.size}"
                )
            if rop is ReduceOp.AVG:
                check_avg_dtype(self.rank, "reduce_scatter", tensor)

        rop = ReduceOp.parse(op)
        self._agree("reduce_scatter", tensor, local)
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
        None it is learned from the peers; when given it is checked against what
        the peers send if ``validate`` is on. With validation, signatures and all
        splits travel in one small allgather; without it and without
        ``recv_splits``, the counts travel in one small alltoall.
        """
        send: list[int] = []
        recv: list[int] | None = None
        n = self.size

        def local() -> None:
            nonlocal send, recv
            check_contiguous(self.rank, "alltoallv", "tensor", tensor)
            if tensor.dim() == 0:
                raise ValueError(
                    f"alltoallv: rank {self.rank} passed a 0-d tensor; it needs rows to split"
                )
            send = check_splits(
                self.rank, n, "alltoallv", "send_splits", send_splits, int(tensor.shape[0])
            )
            if recv_splits is not None:
                recv = check_splits(self.rank, n, "alltoallv", "recv_splits", recv_splits, None)

        table = self._agree(
            "alltoallv", tensor, local, skip_first_dim=True,
            extra=lambda: send + (recv if recv is not None else [-1] * n), extra_len=2 * n,
        )  # fmt: skip
        if n == 1:
            return self._alltoallv_async(tensor, send, send)
        if table is not None:
            # Row q's columns [-2n, -n) are what q sends to each peer; [-n:] what q expects.
            sends = [row[len(row) - 2 * n : len(row) - n] for row in table]
            check_recv_splits(self.rank, "alltoallv", sends, [row[len(row) - n :] for row in table])
            learned = [sends[p][self.rank] for p in range(n)]
        elif recv is None:
            learned = self._exchange_splits(send)
        else:
            learned = recv
        return self._alltoallv_async(tensor, send, learned)

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
        check_rank(self.rank, self.size, "send", "dst", dst)
        check_contiguous(self.rank, "send", "tensor", tensor)
        if dst == self.rank:
            raise ValueError(f"send: rank {self.rank} cannot send to itself (dst={dst})")
        return self._send_async(tensor, dst, tag)

    def send(self, tensor: torch.Tensor, dst: int, tag: int = 0) -> None:
        self.send_async(tensor, dst, tag).wait()

    def recv_async(self, tensor: torch.Tensor, src: int, tag: int = 0) -> Handle:
        """Point-to-point receive into ``tensor`` (in place)."""
        check_rank(self.rank, self.size, "recv", "src", src)
        check_contiguous(self.rank, "recv", "tensor", tensor)
        if src == self.rank:
            raise ValueError(f"recv: rank {self.rank} cannot receive from itself (src={src})")
        return self._recv_async(tensor, src, tag)

    def recv(self, tensor: torch.Tensor, src: int, tag: int = 0) -> torch.Tensor:
        return self.recv_async(tensor, src, tag).wait()

    def p2p_async(self, ops: Sequence[P2POp]) -> list[Handle]:
        """Issue the sends and receives ``ops`` together, as one group; one handle per op,
        in order (a send's result is None, a receive's its tensor).

        Why a group: nccl ignores tags and runs point-to-point operations in issue order,
        the k-th send from rank a to rank b meeting the k-th receive on b from a, and a
        send waits until the peer runs that receive (a rendezvous). Two ranks that each
        send to the other before receiving from it wait forever; issued as one group on
        each rank, the four operations run together. Groups still run one after another
        in issue order, so the peers must issue matching groups in a matching order
        (``dense.pipeline_schedules.simulate(..., p2p="nccl")`` checks a pipeline's).
        mpi and gloo match by tag and run the same operations one by one.
        """
        for op in ops:
            if not isinstance(op, P2POp) or op.kind not in ("send", "recv"):
                raise ValueError(
                    f"p2p: rank {self.rank} passed {op!r}; expected P2POp('send' | 'recv', ...)"
                )
            what = "dst" if op.kind == "send" else "src"
            check_rank(self.rank, self.size, f"p2p {op.kind}", what, op.peer)
            check_contiguous(self.rank, f"p2p {op.kind}", "tensor", op.tensor)
            if op.peer == self.rank:
                way = "to" if op.kind == "send" else "from"
                raise ValueError(
                    f"p2p {op.kind}: rank {self.rank} cannot {op.kind} {way} itself "
                    f"({what}={op.peer})"
                )
        return self._p2p_async(list(ops)) if ops else []

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

    def _on_host(
        self,
        tensor: torch.Tensor,
        host_op: Callable[[torch.Tensor, Alloc], Handle],
        *,
        read: bool = True,
        in_place: bool = False,
    ) -> Handle:
        """Run ``host_op(host_tensor, alloc)`` (a host-memory collective) on ``tensor``.

        A CPU tensor goes as it is. A device tensor is staged (:meth:`_staged`).
        """
        if tensor.is_cpu:  # (is_cpu: 0.1 us, .device: 0.7)
            return host_op(tensor, host_empty)
        return self._staged(tensor, host_op, read=read, in_place=in_place)

    def _staged(
        self,
        tensor: torch.Tensor,
        host_op: Callable[[torch.Tensor, Alloc], Handle],
        *,
        read: bool,
        in_place: bool,
    ) -> Handle:
        """``host_op`` on a pinned host copy of ``tensor``: copied to a pinned block when the
        operation reads it (``read``), outputs allocated in pinned blocks, and at wait the
        result copied back into ``tensor`` (``in_place``) or to a new tensor on its device
        (a None result stays None)."""
        if self._pool is None:
            self._pool = PinnedPool()
        st = StagedOp(self._pool, tensor.device, self.timeout_s)
        host = st.copy_in(tensor) if read else st.empty(tensor.shape, tensor.dtype)
        st.inputs_ready()
        return st.handle(host_op(host, st.empty), into=tensor if in_place else None)

    @property
    def staging_pool(self) -> PinnedPool | None:
        """The pinned host blocks this group stages device tensors through (None until the
        first staged operation)."""
        return self._pool

    def _allgather_ints(self, row: list[int]) -> list[list[int]]:
        """Every rank's ``row`` (same length everywhere), for the argument checks.

        Backends may override this with a cheaper path: it runs before every
        validated collective, so its fixed cost is what small messages pay.
        """
        out: torch.Tensor = self._allgather_async(torch.tensor(row, dtype=torch.int64)).wait()
        return out.tolist()  # type: ignore[no-any-return]

    def _exchange_splits(self, send: list[int]) -> list[int]:
        """Alltoall of the counts: element ``p`` of the result is what peer ``p`` sends here."""
        counts = torch.tensor(send, dtype=torch.int64)  # [size]
        ones = [1] * self.size
        got: torch.Tensor = self._alltoallv_async(counts, ones, ones).wait()
        return [int(x) for x in got.tolist()]

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

    def _p2p_async(self, ops: list[P2POp]) -> list[Handle]:
        """The operations one by one, in order: enough for backends that match by tag."""
        return [
            self._send_async(op.tensor, op.peer, op.tag)
            if op.kind == "send"
            else self._recv_async(op.tensor, op.peer, op.tag)
            for op in ops
        ]

    @abstractmethod
    def _split(self, color: int, key: int) -> ProcessGroup: ...
