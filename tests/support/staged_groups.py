"""CPU tensors through the staging path of device tensors, so that path runs without a GPU.

The process groups hand a CPU tensor to the library as it is and stage only device
tensors (``ProcessGroup._on_host``). To run the staging path (``ProcessGroup._staged``:
pinned blocks, the copies in and out, the pool's reuse) on CPU tensors, a test turns the
group it was given into a test-only subclass of its own backend class whose ``_on_host``
stages every tensor, and back. Everything else is the real group: the subclass only
overrides that one method, and the product keeps no switch for tests.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

import comm
from comm.handle import Handle
from comm.staging import Alloc

# backend class (MPIGroup, TorchGroup, ...) -> its test-only subclass that stages everything
_STAGING: dict[type[comm.ProcessGroup], type[comm.ProcessGroup]] = {}


def _stage_every_tensor(
    self: comm.ProcessGroup,
    tensor: torch.Tensor,
    host_op: Callable[[torch.Tensor, Alloc], Handle],
    *,
    read: bool = True,
    in_place: bool = False,
) -> Handle:
    """``ProcessGroup._on_host`` that takes the device path for CPU tensors too."""
    return self._staged(tensor, host_op, read=read, in_place=in_place)


def _backend_class(group: comm.ProcessGroup) -> type[comm.ProcessGroup]:
    cls = type(group)
    return cls.__bases__[0] if cls in _STAGING.values() else cls


def force_staging(group: comm.ProcessGroup, on: bool) -> None:
    """With ``on``, every tensor ``group`` moves (CPU tensors too) goes through the staging
    path; off, ``group`` is an instance of its backend class again. Sub-groups made by
    ``split`` are plain groups of the backend."""
    plain = _backend_class(group)
    if not on:
        group.__class__ = plain
        return
    if plain not in _STAGING:
        _STAGING[plain] = type(
            f"Staging{plain.__name__}",
            (plain,),
            {"_on_host": _stage_every_tensor, "__module__": __name__},
        )
    group.__class__ = _STAGING[plain]
