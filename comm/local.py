"""The single-process group: size 1, no dependencies, every collective a copy."""

from __future__ import annotations

import torch

from comm.group import ProcessGroup, ReduceOp
from comm.handle import Handle


class LocalGroup(ProcessGroup):
    """``rank 0`` of ``size 1``: what a laptop run and unit tests use.

    Results follow the same contract as the distributed backends (in place where
    they are in place, fresh tensors where they allocate), so code written against
    a group runs unchanged here.
    """

    backend = "local"

    def __init__(self, *, timeout_s: float = 300.0, validate: bool = True) -> None:
        super().__init__(0, 1, timeout_s=timeout_s, validate=validate)

    def _allreduce_async(self, tensor: torch.Tensor, op: ReduceOp) -> Handle:
        return Handle.completed(tensor, "allreduce")

    def _broadcast_async(self, tensor: torch.Tensor, root: int) -> Handle:
        return Handle.completed(tensor, "broadcast")

    def _allgather_async(self, tensor: torch.Tensor) -> Handle:
        return Handle.completed(tensor.unsqueeze(0).clone(), "allgather")

    def _allgatherv_async(self, tensor: torch.Tensor, counts: list[int]) -> Handle:
        return Handle.completed(tensor.clone(), "allgatherv")

    def _reduce_scatter_async(self, tensor: torch.Tensor, op: ReduceOp) -> Handle:
        return Handle.completed(tensor.clone(), "reduce_scatter")

    def _alltoallv_async(self, tensor: torch.Tensor, send: list[int], recv: list[int]) -> Handle:
        return Handle.completed(tensor.clone(), "alltoallv")

    def _barrier_async(self) -> Handle:
        return Handle.completed(None, "barrier")

    def _send_async(self, tensor: torch.Tensor, dst: int, tag: int) -> Handle:
        raise AssertionError("unreachable: dst is checked to be another rank")

    def _recv_async(self, tensor: torch.Tensor, src: int, tag: int) -> Handle:
        raise AssertionError("unreachable: src is checked to be another rank")

    def _split(self, color: int, key: int) -> ProcessGroup:
        return LocalGroup(timeout_s=self.timeout_s, validate=self.validate)
