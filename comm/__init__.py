"""comm: process groups and collectives on torch tensors (MPI, torch.distributed, local).

Quick use::

    import comm
    group = comm.init()              # "auto": mpirun -> mpi, torchrun -> gloo/nccl, else local
    t = torch.ones(4)
    group.allreduce(t, op="avg")     # in place, returns t
    h = group.alltoallv_async(rows, send_splits=[2, 3])
    received = h.wait()              # [sum(recv_splits), *rows.shape[1:]]

Tensors may live on the CPU or a CUDA device with every backend (mpi and gloo stage
CUDA tensors through pinned host memory, ``comm/staging.py``); results come back on
the input's device.

An uncaught exception on any rank of a multi-rank group prints that rank's
traceback and ends the whole job (see comm/failures.py); ``comm.abort(code)``
does the same on purpose.
"""

from comm.agreement import agree, run_on_rank0, shared_token
from comm.device import (
    DEVICE_CHOICES,
    cuda_available,
    default_device,
    resolve_device,
    worker_device,
)
from comm.failures import abort, running_job
from comm.group import ProcessGroup, ReduceOp
from comm.handle import CommTimeoutError, Handle
from comm.init import LaunchEnv, detect_launch, init, usable_cores
from comm.local import LocalGroup
from comm.mesh import DeviceMesh
from comm.topology import Role, Topology

__all__ = [
    "CommTimeoutError",
    "DeviceMesh",
    "Handle",
    "LaunchEnv",
    "LocalGroup",
    "ProcessGroup",
    "ReduceOp",
    "Role",
    "Topology",
    "abort",
    "agree",
    "run_on_rank0",
    "running_job",
    "shared_token",
    "DEVICE_CHOICES",
    "cuda_available",
    "default_device",
    "resolve_device",
    "worker_device",
    "detect_launch",
    "usable_cores",
    "init",
]
