"""The one place that decides which device tensors live on."""

from __future__ import annotations

import torch

from comm.group import ProcessGroup


def default_device(group: ProcessGroup | None = None) -> torch.device:
    """CUDA (this rank's GPU) when the group moves CUDA tensors (nccl), else CPU.

    The CPU is the default everywhere else on purpose: the MPI and gloo backends,
    the parameter server and the caches all work on host memory.
    """
    device = getattr(group, "device", None)
    return device if isinstance(device, torch.device) else torch.device("cpu")
