"""Minimal synchronous data parallelism for dense modules.

Every rank holds a full replica of the module. Before training, rank ``root``'s
parameters (and buffers) are broadcast so all replicas start equal; after each
backward the gradients are averaged over ranks, so the same optimizer step keeps
the replicas equal. One collective per dtype per call: all tensors of a dtype are
flattened into one buffer.

(A bucketed DataParallel that overlaps the allreduce with backward replaces
``allreduce_gradients`` later; the contract stays the same.)
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

import torch
from torch import nn

if TYPE_CHECKING:  # only the type: the group is passed in by the caller
    from comm.group import ProcessGroup


def _by_dtype(tensors: Iterable[torch.Tensor]) -> dict[torch.dtype, list[torch.Tensor]]:
    groups: dict[torch.dtype, list[torch.Tensor]] = {}
    for t in tensors:
        groups.setdefault(t.dtype, []).append(t)
    return groups


@torch.no_grad()
def broadcast_parameters(module: nn.Module, group: ProcessGroup, root: int = 0) -> None:
    """Overwrite every parameter and buffer with rank ``root``'s values (collective).

    All ranks must hold modules of the same structure; a shape mismatch raises
    ``ValueError`` on every rank (the group's validation). No-op at size 1.
    """
    if group.size == 1:
        return
    tensors = [p.data for p in module.parameters()] + list(module.buffers())
    for same in _by_dtype(tensors).values():
        flat = torch.cat([t.reshape(-1) for t in same])  # [sum numel]
        group.broadcast(flat, root=root)
        offset = 0
        for t in same:
            n = t.numel()
            t.copy_(flat[offset : offset + n].view_as(t))
            offset += n


@torch.no_grad()
def allreduce_gradients(module: nn.Module, group: ProcessGroup) -> None:
    """Average ``.grad`` of every trainable parameter over ranks (collective).

    A parameter without a gradient on this rank contributes zeros, and gets the
    averaged gradient afterwards, so every rank steps the same parameters (a rank
    cannot know whether its peers saw that parameter). No-op at size 1.
    """
    if group.size == 1:
        return
    params = [p for p in module.parameters() if p.requires_grad]
    for param in params:
        if param.grad is not None and param.grad.is_sparse:
            raise TypeError(
                f"allreduce_gradients: parameter of shape {tuple(param.shape)} has a sparse "
                "gradient; only dense gradients are supported"
            )
    for same in _by_dtype(params).values():
        # [sum numel]: one buffer, one collective.
        flat = torch.cat(
            [(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in same]
        )
        group.allreduce(flat, op="avg")
        offset = 0
        for p in same:
            n = p.numel()
            g = flat[offset : offset + n].view_as(p)
            if p.grad is None:
                p.grad = g.clone()
            else:
                p.grad.copy_(g)
            offset += n
