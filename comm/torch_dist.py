"""The torch.distributed backend (gloo on CPU, nccl on CUDA).

gloo moves host memory: CUDA tensors given to a gloo group are staged through
pinned host blocks (``comm/staging.py``), as in the MPI backend.

Each operation is issued with ``async_op=True`` and wrapped in a :class:`Handle`
that polls ``Work.is_completed()`` so waits can time out. Gloo lacks an average
reduction, so "avg" is a sum followed by a division, as in the MPI backend.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from comm.failures import exception_in_flight, release_abort_hook
from comm.group import P2POp, ProcessGroup, ReduceOp
from comm.handle import Handle, timeout_error
from comm.staging import Alloc

_TORCH_OPS = {
    ReduceOp.SUM: dist.ReduceOp.SUM,
    ReduceOp.AVG: dist.ReduceOp.SUM,
    ReduceOp.MAX: dist.ReduceOp.MAX,
}


class TorchGroup(ProcessGroup):
    """A process group over a torch.distributed group (``pg=None``: the world)."""

    def __init__(
        self,
        pg: Any = None,
        *,
        global_ranks: list[int] | None = None,
        device: torch.device | None = None,
        timeout_s: float = 300.0,
        validate: bool = True,
    ) -> None:
        if not dist.is_initialized():
            raise RuntimeError("torch.distributed is not initialized; use comm.init('gloo')")
        self._pg = pg
        self.backend = str(dist.get_backend(pg))
        rank, size = dist.get_rank(pg), dist.get_world_size(pg)
        self._global_ranks = global_ranks if global_ranks is not None else list(range(size))
        # nccl moves CUDA tensors only; small CPU tensors (signatures, counts) are staged
        # to the device. Other backends (gloo) move host memory.
        self.device = device if device is not None else torch.device("cpu")
        self._device_backend = self.backend == "nccl"
        super().__init__(rank, size, timeout_s=timeout_s, validate=validate)

    @property
    def torch_group(self) -> Any:
        """The underlying torch.distributed group (None means the default world group)."""
        return self._pg

    # ------------------------------------------------------------------ helpers

    def _stage(self, t: torch.Tensor) -> torch.Tensor:
        """nccl: ``t`` on the group's device (gloo: host tensors arrive here already)."""
        return t.to(self.device) if self._device_backend and t.device != self.device else t

    def _handle(self, work: Any, finish: Callable[[], Any], what: str) -> Handle:
        label = f"{self.backend} {what} on rank {self.rank}"

        def block(limit: float) -> None:
            # Work.wait re-raises errors the backend recorded; past the limit gloo
            # raises "Timed out ..." (and closes the connection: the group is dead).
            try:
                work.wait(timeout=timedelta(seconds=limit))
            except RuntimeError as e:
                if "timed out" in str(e).lower() or "timeout" in str(e).lower():
                    raise timeout_error(label, limit) from e
                raise

        # nccl: a wait without a timeout only makes the current stream wait (Work.wait()
        # with a timeout would block the host until the GPU is done); its watchdog, set
        # to the group's timeout at init, ends a job whose peer is gone.
        ordered = work.wait if self._device_backend else None
        return Handle(
            work.is_completed, finish, what=label, timeout_s=self.timeout_s, block=block,
            ordered=ordered,
        )  # fmt: skip

    # --------------------------------------------------------------- primitives
    #
    # nccl moves CUDA tensors: a CPU tensor is staged to the group's device (``_stage``)
    # and results go back to the input's device. gloo moves host memory: each primitive
    # runs through ``_on_host``, which hands CPU tensors over as they are and stages a
    # CUDA tensor through pinned blocks (copied in, outputs allocated there with
    # ``alloc``, the result copied back at wait).

    def _run(
        self,
        tensor: torch.Tensor,
        op: Callable[[torch.Tensor, Alloc], Handle],
        *,
        read: bool = True,
        in_place: bool = False,
    ) -> Handle:
        if self._device_backend:
            return op(tensor, self._device_empty)
        return self._on_host(tensor, op, read=read, in_place=in_place)

    def _device_empty(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        return torch.empty(shape, dtype=dtype, device=self.device)

    def _allreduce_async(self, tensor: torch.Tensor, op: ReduceOp) -> Handle:
        size = self.size

        def run(t: torch.Tensor, _: Alloc) -> Handle:
            work_t = self._stage(t)
            work = dist.all_reduce(work_t, op=_TORCH_OPS[op], group=self._pg, async_op=True)

            def finish() -> torch.Tensor:
                if op is ReduceOp.AVG:
                    work_t.div_(size)
                return _unstaged(work_t, t)

            return self._handle(work, finish, "allreduce")

        return self._run(tensor, run, in_place=True)

    def _broadcast_async(self, tensor: torch.Tensor, root: int) -> Handle:
        def run(t: torch.Tensor, _: Alloc) -> Handle:
            work_t = self._stage(t)
            work = dist.broadcast(work_t, group=self._pg, group_src=root, async_op=True)

            def finish() -> torch.Tensor:
                return _unstaged(work_t, t)

            return self._handle(work, finish, "broadcast")

        # Staged, only the root's bytes need to reach the host.
        return self._run(tensor, run, read=self.rank == root, in_place=True)

    def _allgather_async(self, tensor: torch.Tensor) -> Handle:
        def run(t: torch.Tensor, alloc: Alloc) -> Handle:
            src = self._stage(t)
            out = alloc((self.size, *t.shape), t.dtype)
            # all_gather into views of one buffer: supported by gloo and nccl alike.
            work = dist.all_gather(list(out.unbind(0)), src, group=self._pg, async_op=True)
            return self._handle(work, lambda: out.to(t.device), "allgather")

        return self._run(tensor, run)

    def _allgatherv_async(self, tensor: torch.Tensor, counts: list[int]) -> Handle:
        # No variable-size allgather in torch.distributed: pad every rank to the
        # largest row count, gather, then keep each rank's real rows.
        def run(t: torch.Tensor, alloc: Alloc) -> Handle:
            src = self._stage(t)
            tail = tuple(t.shape[1:])
            most = max(counts)
            padded = src
            if src.shape[0] != most:
                padded = alloc((most, *tail), t.dtype)  # the padding rows are never read
                padded[: src.shape[0]] = src
            out = alloc((self.size, most, *tail), t.dtype)
            work = dist.all_gather(list(out.unbind(0)), padded, group=self._pg, async_op=True)

            def finish() -> torch.Tensor:
                rows = alloc((sum(counts), *tail), t.dtype)  # [sum(counts), *tail]
                lo = 0
                for r in range(self.size):
                    rows[lo : lo + counts[r]] = out[r, : counts[r]]
                    lo += counts[r]
                return rows.to(t.device)

            return self._handle(work, finish, "allgatherv")

        return self._run(tensor, run)

    def _reduce_scatter_async(self, tensor: torch.Tensor, op: ReduceOp) -> Handle:
        n = tensor.shape[0] // self.size
        lo = self.rank * n
        size = self.size

        def run(t: torch.Tensor, alloc: Alloc) -> Handle:
            if self._device_backend:
                src = self._stage(t)
                out = alloc((n, *t.shape[1:]), t.dtype)
                work = dist.reduce_scatter_tensor(
                    out, src, op=_TORCH_OPS[op], group=self._pg, async_op=True
                )
            else:
                # gloo has no reduce_scatter: allreduce a copy and keep this rank's rows
                # (a staged tensor is a private copy already).
                full = t.clone() if t is tensor else t
                work = dist.all_reduce(full, op=_TORCH_OPS[op], group=self._pg, async_op=True)
                out = full

            def finish() -> torch.Tensor:
                res = out if out.shape[0] == n else out[lo : lo + n].clone()
                if op is ReduceOp.AVG:
                    res.div_(size)
                return res.to(t.device)

            return self._handle(work, finish, "reduce_scatter")

        return self._run(tensor, run)

    def _alltoallv_async(self, tensor: torch.Tensor, send: list[int], recv: list[int]) -> Handle:
        def run(t: torch.Tensor, alloc: Alloc) -> Handle:
            src = self._stage(t)
            out = alloc((sum(recv), *t.shape[1:]), t.dtype)
            work = dist.all_to_all_single(
                out, src, output_split_sizes=recv, input_split_sizes=send,
                group=self._pg, async_op=True,
            )  # fmt: skip
            return self._handle(work, lambda: out.to(t.device), "alltoallv")

        return self._run(tensor, run)

    def _barrier_async(self) -> Handle:
        # NCCL: name this rank's GPU, or a group whose first op is a barrier guesses one
        # (on a multi-GPU host, possibly another rank's).
        on_gpu = self._device_backend and self.device.index is not None
        ids = [self.device.index] if on_gpu else None
        work = dist.barrier(group=self._pg, async_op=True, device_ids=ids)
        return self._handle(work, lambda: None, "barrier")

    def _send_async(self, tensor: torch.Tensor, dst: int, tag: int) -> Handle:
        def run(t: torch.Tensor, _: Alloc) -> Handle:
            work = dist.isend(self._stage(t), group=self._pg, group_dst=dst, tag=tag)
            return self._handle(work, lambda: None, f"send to rank {dst}")

        return self._run(tensor, run)  # a staged block is kept until it is sent

    def _recv_async(self, tensor: torch.Tensor, src: int, tag: int) -> Handle:
        def run(t: torch.Tensor, _: Alloc) -> Handle:
            buf = self._stage(t)
            work = dist.irecv(buf, group=self._pg, group_src=src, tag=tag)

            def finish() -> torch.Tensor:
                return _unstaged(buf, t)

            return self._handle(work, finish, f"recv from rank {src}")

        return self._run(tensor, run, read=False, in_place=True)

    def _p2p_async(self, ops: list[P2POp]) -> list[Handle]:
        # One dist.batch_isend_irecv: on nccl a single coalesced group on the group's
        # communicator (its one stream), so a send and a receive with the same peer run
        # together; gloo issues them one by one and matches by tag. Each op is staged
        # first (its handle is made then), and bound to the work once the batch is issued.
        pending: list[_BatchWork] = []
        torch_ops: list[Any] = []

        def prepare(op: P2POp) -> Handle:
            def run(t: torch.Tensor, _: Alloc) -> Handle:
                buf = self._stage(t)
                fn = dist.isend if op.kind == "send" else dist.irecv
                torch_ops.append(
                    dist.P2POp(fn, buf, group=self._pg, tag=op.tag, group_peer=op.peer)
                )
                work = _BatchWork()
                pending.append(work)
                if op.kind == "send":
                    return self._handle(work, lambda: None, f"send to rank {op.peer}")
                return self._handle(work, lambda: _unstaged(buf, t), f"recv from rank {op.peer}")

            if op.kind == "send":
                return self._run(op.tensor, run)  # a staged block is kept until it is sent
            return self._run(op.tensor, run, read=False, in_place=True)

        handles = [prepare(op) for op in ops]
        works = dist.batch_isend_irecv(torch_ops)
        # One work per op (gloo), or one for the whole coalesced group (nccl).
        per_op = len(works) == len(pending)
        for i, work in enumerate(pending):
            work.bind([works[i]] if per_op else list(works))
        return handles

    def _split(self, color: int, key: int) -> ProcessGroup:
        # On the whole world, torch.distributed needs every rank to call new_group for
        # every new group, in the same order: learn all (color, key) pairs, then create
        # them all. A sub-group's ranks cannot do that (the other ranks are elsewhere,
        # perhaps splitting their own sub-group at the same moment: groups named by the
        # world's counter would then collide), so each rank creates only its own group,
        # named from its ranks, with the members alone (use_local_synchronization).
        mine = torch.tensor([color, key], dtype=torch.int64)
        table = self._allgather_async(mine).wait().tolist()  # [size, 2]
        whole_world = len(self._global_ranks) == dist.get_world_size()
        result: TorchGroup | None = None
        for c in sorted({row[0] for row in table}):
            if not whole_world and c != color:
                continue
            by_key = [
                r for _, r in sorted((row[1], r) for r, row in enumerate(table) if row[0] == c)
            ]
            # torch orders a new group's ranks by global rank; say so if key asked otherwise.
            if c == color and by_key != sorted(by_key):
                warnings.warn(
                    "split: torch.distributed orders sub-group ranks by global rank; the "
                    f"keys asked for order {by_key}",
                    stacklevel=3,
                )
            ranks = [self._global_ranks[r] for r in sorted(by_key)]
            pg = dist.new_group(
                ranks=ranks, backend=self.backend, use_local_synchronization=not whole_world
            )
            if c == color:
                result = TorchGroup(
                    pg, global_ranks=ranks, device=self.device,
                    timeout_s=self.timeout_s, validate=self.validate,
                )  # fmt: skip
        assert result is not None
        return result

    def close(self) -> None:
        if exception_in_flight():
            # On the way out of a failure: peers may be blocked in a collective that
            # waits for this rank, so a barrier would hold this rank (up to 30 s)
            # before the abort hook could end the job. Leave the group to the exit.
            return
        release_abort_hook(self)
        if not dist.is_initialized():
            return
        # Let every rank's outstanding work finish before the backend's threads go
        # away (gloo aborts the process if it is torn down with work in flight).
        try:
            self._barrier_async().wait(timeout=min(self.timeout_s, 30.0))
        except Exception:  # a dead peer must not keep us from releasing resources
            pass
        if self._pg is None:
            dist.destroy_process_group()
        else:
            dist.destroy_process_group(self._pg)


class _BatchWork:
    """The torch.distributed work of one op of a :meth:`TorchGroup._p2p_async` batch,
    bound once the batch is issued: done when every work it is bound to is."""

    __slots__ = ("_works",)

    def __init__(self) -> None:
        self._works: list[Any] = []

    def bind(self, works: list[Any]) -> None:
        self._works = works

    def is_completed(self) -> bool:
        return all(w.is_completed() for w in self._works)

    def wait(self, timeout: timedelta | None = None) -> None:
        for w in self._works:
            if timeout is None:
                w.wait()
            else:
                w.wait(timeout=timeout)


def _unstaged(work: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """``t`` holding the result the backend left in ``work`` (its staged copy, or ``t``)."""
    if work is not t:
        t.copy_(work)
    return t
