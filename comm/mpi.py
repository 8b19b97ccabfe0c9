"""The MPI backend: mpi4py's upper-case (buffer) methods straight on torch tensors.

No pickle: every message is a typed buffer. CPU tensors are read and written in
place; CUDA tensors are staged through pinned host blocks (``comm/staging.py``).
Every operation is the non-blocking MPI call (``Iallreduce``, ``Ialltoallv``, ...)
so that waits can time out; the blocking and non-blocking paths measured the same
bandwidth with MPICH (see docs/architecture.md).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch
from mpi4py import MPI

from comm.failures import exception_in_flight, release_abort_hook
from comm.group import ProcessGroup, ReduceOp
from comm.handle import Handle
from comm.staging import Alloc

# torch dtype -> (MPI datatype, whether MPI can reduce it). Half types travel as
# 16-bit integers (MPI has no standard half type) and are reduced in float32.
_MPI_TYPES: dict[torch.dtype, Any] = {
    torch.float32: MPI.FLOAT,
    torch.float64: MPI.DOUBLE,
    torch.int64: MPI.INT64_T,
    torch.int32: MPI.INT32_T,
    torch.int16: MPI.INT16_T,
    torch.int8: MPI.INT8_T,
    torch.uint8: MPI.UINT8_T,
    torch.complex64: MPI.C_FLOAT_COMPLEX,
    torch.complex128: MPI.C_DOUBLE_COMPLEX,
}
_RAW_VIEW = {torch.float16: torch.int16, torch.bfloat16: torch.int16, torch.bool: torch.uint8}
_MPI_OPS = {ReduceOp.SUM: MPI.SUM, ReduceOp.AVG: MPI.SUM, ReduceOp.MAX: MPI.MAX}


def _buf(t: torch.Tensor, count: Any = None) -> list[Any]:
    """An mpi4py buffer spec for a contiguous CPU tensor (zero copy).

    The tensor is handed over as a numpy view: mpi4py reads a numpy array's buffer
    in ~6 us, a torch tensor (through DLPack) in ~40 us, which dominated small
    messages.
    """
    assert t.is_cpu, "device tensors are staged before they reach MPI"
    raw = t.view(_RAW_VIEW[t.dtype]) if t.dtype in _RAW_VIEW else t
    mtype = _MPI_TYPES.get(raw.dtype)
    if mtype is None:
        raise TypeError(f"the mpi backend does not support dtype {t.dtype}")
    arr = raw.detach().numpy()
    return [arr, mtype] if count is None else [arr, count, mtype]


def _reducible(t: torch.Tensor) -> bool:
    return t.dtype in _MPI_TYPES


class MPIGroup(ProcessGroup):
    """A process group over an MPI communicator (default ``MPI.COMM_WORLD``)."""

    backend = "mpi"

    def __init__(
        self,
        mpi_comm: Any = None,
        *,
        timeout_s: float = 300.0,
        validate: bool = True,
    ) -> None:
        self._comm = MPI.COMM_WORLD if mpi_comm is None else mpi_comm
        super().__init__(
            self._comm.Get_rank(), self._comm.Get_size(), timeout_s=timeout_s, validate=validate
        )

    @property
    def mpi_comm(self) -> Any:
        """The underlying mpi4py communicator, for code that talks MPI directly."""
        return self._comm

    def _handle(self, req: Any, finish: Any, what: str) -> Handle:
        return Handle(
            req.Test, finish, what=f"mpi {what} on rank {self.rank}", timeout_s=self.timeout_s
        )

    def _allgather_ints(self, row: list[int]) -> list[list[int]]:
        # numpy buffers and no torch allocation: this runs before every validated call.
        mine = np.asarray(row, dtype=np.int64)
        out = np.empty((self.size, mine.size), dtype=np.int64)
        req = self._comm.Iallgather([mine, MPI.INT64_T], [out, MPI.INT64_T])
        self._handle(req, lambda: None, "allgather (argument check)").wait()
        return out.tolist()  # type: ignore[no-any-return]

    # Each primitive is a host path ``_host_*(tensor, alloc, ...)`` run by ``_on_host``:
    # a CPU tensor takes it at once (outputs from torch.empty); a device tensor is
    # staged through pinned blocks (copied in, outputs allocated there, the result
    # copied back at wait).

    def _allreduce_async(self, tensor: torch.Tensor, op: ReduceOp) -> Handle:
        return self._on_host(tensor, lambda t, a: self._host_allreduce(t, a, op), in_place=True)

    def _host_allreduce(self, tensor: torch.Tensor, alloc: Alloc, op: ReduceOp) -> Handle:
        # Half and bool tensors are reduced in a float32/uint8 working copy.
        work = tensor if _reducible(tensor) else tensor.to(_reduce_dtype(tensor))
        req = self._comm.Iallreduce(MPI.IN_PLACE, _buf(work), _MPI_OPS[op])
        size = self.size

        def finish() -> torch.Tensor:
            if op is ReduceOp.AVG:
                work.div_(size)
            if work is not tensor:
                tensor.copy_(work)
            return tensor

        return self._handle(req, finish, "allreduce")

    def _broadcast_async(self, tensor: torch.Tensor, root: int) -> Handle:
        # Staged, only the root's bytes need to reach the host.
        return self._on_host(
            tensor,
            lambda t, a: self._host_broadcast(t, a, root),
            read=self.rank == root,
            in_place=True,
        )

    def _host_broadcast(self, tensor: torch.Tensor, alloc: Alloc, root: int) -> Handle:
        req = self._comm.Ibcast(_buf(tensor), root=root)
        return self._handle(req, lambda: tensor, "broadcast")

    def _allgather_async(self, tensor: torch.Tensor) -> Handle:
        return self._on_host(tensor, self._host_allgather)

    def _host_allgather(self, tensor: torch.Tensor, alloc: Alloc) -> Handle:
        out = alloc((self.size, *tensor.shape), tensor.dtype)
        req = self._comm.Iallgather(_buf(tensor), _buf(out))
        return self._handle(req, lambda: out, "allgather")

    def _allgatherv_async(self, tensor: torch.Tensor, counts: list[int]) -> Handle:
        return self._on_host(tensor, lambda t, a: self._host_allgatherv(t, a, counts))

    def _host_allgatherv(self, tensor: torch.Tensor, alloc: Alloc, counts: list[int]) -> Handle:
        tail = tuple(tensor.shape[1:])
        row = math.prod(tail)
        out = alloc((sum(counts), *tail), tensor.dtype)
        elems = [c * row for c in counts]
        req = self._comm.Iallgatherv(_buf(tensor), _buf(out, (elems, _displs(elems))))
        return self._handle(req, lambda: out, "allgatherv")

    def _reduce_scatter_async(self, tensor: torch.Tensor, op: ReduceOp) -> Handle:
        return self._on_host(tensor, lambda t, a: self._host_reduce_scatter(t, a, op))

    def _host_reduce_scatter(self, tensor: torch.Tensor, alloc: Alloc, op: ReduceOp) -> Handle:
        n = tensor.shape[0] // self.size
        work = tensor if _reducible(tensor) else tensor.to(_reduce_dtype(tensor))
        out = alloc((n, *tensor.shape[1:]), work.dtype)
        req = self._comm.Ireduce_scatter_block(_buf(work), _buf(out), _MPI_OPS[op])
        size = self.size

        def finish() -> torch.Tensor:
            if op is ReduceOp.AVG:
                out.div_(size)
            return out if out.dtype == tensor.dtype else out.to(tensor.dtype)

        return self._handle(req, finish, "reduce_scatter")

    def _alltoallv_async(self, tensor: torch.Tensor, send: list[int], recv: list[int]) -> Handle:
        return self._on_host(tensor, lambda t, a: self._host_alltoallv(t, a, send, recv))

    def _host_alltoallv(
        self, tensor: torch.Tensor, alloc: Alloc, send: list[int], recv: list[int]
    ) -> Handle:
        tail = tuple(tensor.shape[1:])
        row = math.prod(tail)  # elements per row
        out = alloc((sum(recv), *tail), tensor.dtype)
        scounts = [s * row for s in send]
        rcounts = [r * row for r in recv]
        req = self._comm.Ialltoallv(
            _buf(tensor, (scounts, _displs(scounts))),
            _buf(out, (rcounts, _displs(rcounts))),
        )
        return self._handle(req, lambda: out, "alltoallv")

    def _barrier_async(self) -> Handle:
        return self._handle(self._comm.Ibarrier(), lambda: None, "barrier")

    def _send_async(self, tensor: torch.Tensor, dst: int, tag: int) -> Handle:
        # A staged block is kept until the send completes.
        return self._on_host(tensor, lambda t, a: self._host_send(t, a, dst, tag))

    def _host_send(self, tensor: torch.Tensor, alloc: Alloc, dst: int, tag: int) -> Handle:
        req = self._comm.Isend(_buf(tensor), dest=dst, tag=tag)
        return self._handle(req, lambda: None, f"send to rank {dst}")

    def _recv_async(self, tensor: torch.Tensor, src: int, tag: int) -> Handle:
        return self._on_host(
            tensor, lambda t, a: self._host_recv(t, a, src, tag), read=False, in_place=True
        )

    def _host_recv(self, tensor: torch.Tensor, alloc: Alloc, src: int, tag: int) -> Handle:
        req = self._comm.Irecv(_buf(tensor), source=src, tag=tag)
        return self._handle(req, lambda: tensor, f"recv from rank {src}")

    def _split(self, color: int, key: int) -> ProcessGroup:
        return MPIGroup(
            self._comm.Split(color, key), timeout_s=self.timeout_s, validate=self.validate
        )

    def close(self) -> None:
        if not exception_in_flight():  # on the way out of a failure the hook must stay
            release_abort_hook(self)
        if self._comm not in (MPI.COMM_WORLD, MPI.COMM_SELF, MPI.COMM_NULL):
            self._comm.Free()
        self._comm = MPI.COMM_NULL


def _displs(counts: list[int]) -> list[int]:
    out, acc = [], 0
    for c in counts:
        out.append(acc)
        acc += c
    return out


def _reduce_dtype(t: torch.Tensor) -> torch.dtype:
    return torch.uint8 if t.dtype == torch.bool else torch.float32
