"""The one place that decides which device a worker's tensors live on.

A job resolves its ``--device`` once with :func:`resolve_device` and hands the result
down (``EmbeddingCollection(device=...)``, ``model.to(device)``); a module built
without a device asks :func:`default_device`. Parameter-server ranks, stores and
caches stay on the host whatever the workers use.
"""

from __future__ import annotations

import torch

from comm.group import ProcessGroup

DEVICE_CHOICES = ("auto", "cpu", "cuda")


def cuda_available() -> bool:
    """Whether torch sees a CUDA device (False on CPU-only builds)."""
    return torch.cuda.is_available() and torch.cuda.device_count() > 0


def resolve_device(requested: str = "auto", local_rank: int = 0) -> torch.device:
    """The device of a worker rank: ``requested`` is ``auto`` (this rank's GPU when CUDA
    is there, else the CPU), ``cpu``, ``cuda`` (this rank's GPU: ``local_rank`` modulo
    the GPUs on the host, so several ranks may share one) or ``cuda:N``.

    Asking for CUDA where torch sees none is an error naming the device asked for.
    """
    req = requested.strip().lower()
    if req == "cpu":
        return torch.device("cpu")
    if req == "auto":
        if not cuda_available():
            return torch.device("cpu")
        req = "cuda"
    if req == "cuda" or req.startswith("cuda:"):
        if not cuda_available():
            raise _no_cuda(requested)
        count = torch.cuda.device_count()
        if req == "cuda":
            index = local_rank % count
        else:
            try:
                index = int(req.split(":", 1)[1])
            except ValueError:
                raise ValueError(f"device {requested!r}: expected cuda:N with N an int") from None
            if not 0 <= index < count:
                raise ValueError(f"device {requested!r}: this host has CUDA devices 0..{count - 1}")
        return torch.device("cuda", index)
    raise ValueError(f"device {requested!r}: expected one of {DEVICE_CHOICES} or cuda:N")


def worker_device(
    requested: str, group: ProcessGroup, local_rank: int | None = None
) -> torch.device:
    """The device a worker rank of ``group`` trains on (see :func:`resolve_device`).

    An nccl group already holds this rank's GPU: ``auto`` and ``cuda`` mean that one,
    and ``cpu`` is an error (nccl moves CUDA tensors only). ``local_rank`` defaults to
    the launcher's (``torchrun``'s ``LOCAL_RANK``, ``mpirun``'s local rank variables).
    A CUDA device becomes this process's current device.
    """
    own = getattr(group, "device", None)
    if isinstance(own, torch.device) and own.type == "cuda":
        if requested.strip().lower() == "cpu":
            raise ValueError(
                "device 'cpu' with the nccl backend: nccl moves CUDA tensors only; "
                "use --backend gloo (or mpi) to train on the CPU"
            )
        return own
    if local_rank is None:
        from comm.init import detect_launch

        local_rank = detect_launch().local_rank
    device = resolve_device(requested, local_rank)
    if device.type == "cuda":
        # This rank's GPU becomes the current one (as comm.init does for nccl): Triton
        # launches its kernels on the current device's stream, whatever device the
        # tensors are on, and "cuda" without an index means the current device.
        torch.cuda.set_device(device)
    return device


def _no_cuda(requested: object) -> RuntimeError:
    return RuntimeError(
        f"device {str(requested)!r} asked for, but torch sees no CUDA device "
        f"(torch {torch.__version__}, CUDA build: {torch.version.cuda or 'none'}); "
        "use --device cpu or auto"
    )


def exact_device(device: torch.device | str) -> torch.device:
    """``device`` with its index: plain ``"cuda"`` is the current CUDA device, so it
    compares equal to the device of a tensor placed there. CUDA without CUDA is an error
    naming the device."""
    device = torch.device(device)
    if device.type == "cuda" and not cuda_available():
        raise _no_cuda(device)
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


def module_device(
    group: ProcessGroup | None = None, device: torch.device | str | None = None
) -> torch.device:
    """Where a module of ``group`` computes: ``device`` (exact) when given, else
    :func:`default_device` of the group."""
    return default_device(group) if device is None else exact_device(device)


def default_device(group: ProcessGroup | None = None) -> torch.device:
    """The device of a module built without one: the group's GPU when the group moves
    CUDA tensors (nccl), else the CPU.

    The CPU is the default everywhere else on purpose: the MPI and gloo backends and
    the parameter server work on host memory (a cache is given its device); a job that
    trains on a GPU over them says so (:func:`resolve_device`), and the groups stage its
    CUDA tensors through host memory.
    """
    device = getattr(group, "device", None)
    return device if isinstance(device, torch.device) else torch.device("cpu")
