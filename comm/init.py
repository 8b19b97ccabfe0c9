"""Starting a process group: the one place that reads the launcher's environment.

``comm.init("auto")`` picks the backend from how the process was started:

=====================  ==========================================  ===============
launcher               environment seen                            backend
=====================  ==========================================  ===============
``mpirun`` / mpiexec   PMI_RANK/PMI_SIZE (MPICH, Intel MPI),       ``mpi``
                       OMPI_COMM_WORLD_RANK/SIZE (Open MPI),
                       PMIX_RANK (PMIx launchers)
``torchrun``           RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT  ``nccl`` with
                       (TORCHELASTIC_RUN_ID)                       CUDA, else ``gloo``
plain ``python``       none of the above                           ``local``
=====================  ==========================================  ===============

``gloo``/``nccl`` may also be asked for under ``mpirun``: rank and size come from
the MPI launcher's variables, and the rendezvous address from MASTER_ADDR /
MASTER_PORT when set, else rank 0 picks a free port and tells the others over
MPI (typed buffers, no pickle).

A job whose rendezvous address is loopback (every rank on this host: mpirun
found them all on one node, or MASTER_ADDR is 127.0.0.1) listens on loopback
only: rank 0's rendezvous store binds 127.0.0.1 (torch's own ``tcp://`` store
binds every interface), and gloo's sockets use the loopback interface
(``GLOO_SOCKET_IFNAME``, unless already set).

Every world group of more than one rank gets the abort hook of
``comm/failures.py``: an uncaught exception on one rank ends the whole job.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch

from comm.failures import install_abort_hook
from comm.group import ProcessGroup
from comm.local import LocalGroup

BACKENDS = ("auto", "local", "mpi", "gloo", "nccl")

_MPI_RANK_VARS = ("OMPI_COMM_WORLD_RANK", "PMI_RANK", "PMIX_RANK", "MV2_COMM_WORLD_RANK")
_MPI_SIZE_VARS = ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "MV2_COMM_WORLD_SIZE")
_MPI_LOCAL_VARS = ("OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID", "MV2_COMM_WORLD_LOCAL_RANK")
_MPI_LOCAL_SIZE_VARS = (
    "OMPI_COMM_WORLD_LOCAL_SIZE",
    "MPI_LOCALNRANKS",
    "MV2_COMM_WORLD_LOCAL_SIZE",
)


@dataclass(frozen=True, slots=True, kw_only=True)
class LaunchEnv:
    """How this process was started, read once from the environment."""

    launcher: str  # "mpirun" | "torchrun" | "none"
    rank: int = 0
    size: int = 1
    local_rank: int = 0
    local_size: int = 1  # ranks of the job on this host
    master_addr: str | None = None
    master_port: int | None = None


def _first_int(env: Mapping[str, str], names: tuple[str, ...]) -> int | None:
    for name in names:
        if name in env:
            try:
                return int(env[name])
            except ValueError:
                raise ValueError(
                    f"launcher variable {name}={env[name]!r} is not an integer"
                ) from None
    return None


def usable_cores() -> int:
    """The cores this process may run on (its CPU affinity where the OS has one), at
    least 1: what the ranks on a host (``LaunchEnv.local_size``) share."""
    if hasattr(os, "sched_getaffinity"):
        return max(1, len(os.sched_getaffinity(0)))
    return max(1, os.cpu_count() or 1)


def detect_launch(env: Mapping[str, str] | None = None) -> LaunchEnv:
    """Read the launcher from ``env`` (default ``os.environ``)."""
    env = os.environ if env is None else env
    port = env.get("MASTER_PORT")
    addr = env.get("MASTER_ADDR")
    if "RANK" in env and "WORLD_SIZE" in env:
        return LaunchEnv(
            launcher="torchrun",
            rank=int(env["RANK"]),
            size=int(env["WORLD_SIZE"]),
            local_rank=int(env.get("LOCAL_RANK", "0")),
            local_size=int(env.get("LOCAL_WORLD_SIZE", "1")),
            master_addr=addr,
            master_port=int(port) if port else None,
        )
    rank = _first_int(env, _MPI_RANK_VARS)
    if rank is not None:
        size = _first_int(env, _MPI_SIZE_VARS)
        return LaunchEnv(
            launcher="mpirun",
            rank=rank,
            size=size if size is not None else 1,
            local_rank=_first_int(env, _MPI_LOCAL_VARS) or 0,
            local_size=_first_int(env, _MPI_LOCAL_SIZE_VARS) or 1,
            master_addr=addr,
            master_port=int(port) if port else None,
        )
    return LaunchEnv(launcher="none")


def init(
    backend: str = "auto",
    *,
    timeout_s: float = 300.0,
    validate: bool = True,
    env: Mapping[str, str] | None = None,
) -> ProcessGroup:
    """Start (or join) the world process group and return it.

    ``timeout_s`` bounds every wait (and the torch.distributed rendezvous);
    ``validate`` turns on the cross-rank argument checks (see ProcessGroup).
    """
    if backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}; expected one of {', '.join(BACKENDS)}")
    launch = detect_launch(env)
    if backend == "auto":
        if launch.launcher == "mpirun":
            backend = "mpi"
        elif launch.launcher == "torchrun":
            backend = "nccl" if torch.cuda.is_available() else "gloo"
        else:
            backend = "local"
    if backend == "local":
        if launch.size > 1:
            raise ValueError(
                f"backend 'local' is a single process, but the launcher started {launch.size} "
                f"ranks ({launch.launcher}); use backend 'auto', 'mpi' or 'gloo'"
            )
        return LocalGroup(timeout_s=timeout_s, validate=validate)
    if backend == "mpi":
        try:
            from comm.mpi import MPIGroup
        except ImportError as e:  # pragma: no cover - mpi4py is a dependency
            raise RuntimeError(f"backend 'mpi' needs mpi4py and an MPI library: {e}") from e
        group: ProcessGroup = MPIGroup(timeout_s=timeout_s, validate=validate)
    else:
        group = _init_torch(backend, launch, timeout_s=timeout_s, validate=validate)
    if group.size > 1:
        install_abort_hook(group, group.rank)
    return group


def _init_torch(
    backend: str, launch: LaunchEnv, *, timeout_s: float, validate: bool
) -> ProcessGroup:
    import torch.distributed as dist

    from comm.torch_dist import TorchGroup

    device = None
    if backend == "nccl":
        if not torch.cuda.is_available():
            raise RuntimeError("backend 'nccl' needs CUDA; use 'gloo' on CPU")
        device = torch.device("cuda", launch.local_rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        addr, port = launch.master_addr, launch.master_port
        if port is None or addr is None:
            addr, port = _agree_on_address(launch, addr)
        timeout = timedelta(seconds=timeout_s)
        if _is_loopback(addr) and backend == "gloo":
            _gloo_on_loopback()
        if _is_loopback(addr) and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
            # torch's tcp:// store would listen on every interface; every rank
            # reaches it through loopback, so bind it there (under torchrun the
            # agent hosts the store, not rank 0).
            store = _loopback_store(port, launch, timeout)
            dist.init_process_group(
                backend,
                store=store,
                rank=launch.rank,
                world_size=launch.size,
                timeout=timeout,
                device_id=device,  # NCCL: its communicators for this rank's GPU
            )
        else:
            dist.init_process_group(
                backend,
                init_method=f"tcp://{addr}:{port}",
                rank=launch.rank,
                world_size=launch.size,
                timeout=timeout,
                device_id=device,  # NCCL: its communicators for this rank's GPU
            )
    return TorchGroup(None, device=device, timeout_s=timeout_s, validate=validate)


def _is_loopback(addr: str) -> bool:
    return addr == "localhost" or addr.startswith("127.")


def _loopback_store(port: int, launch: LaunchEnv, timeout: timedelta) -> Any:
    """The rendezvous store at 127.0.0.1:``port``; rank 0 hosts it, listening on loopback only."""
    import torch.distributed as dist

    if launch.rank != 0:
        return dist.TCPStore("127.0.0.1", port, launch.size, False, timeout=timeout)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", port))  # the store's server calls listen() on it
    except OSError as e:
        sock.close()
        raise RuntimeError(f"rendezvous: rank 0 cannot listen on 127.0.0.1:{port}: {e}") from e
    fd = sock.detach()  # the store's server owns the socket from here on
    return dist.TCPStore("127.0.0.1", port, launch.size, True, timeout=timeout, master_listen_fd=fd)


def _gloo_on_loopback() -> None:
    """Point gloo's sockets at the loopback interface (by default gloo uses the address
    the host name resolves to, which may face the network)."""
    if "GLOO_SOCKET_IFNAME" in os.environ:
        return  # the user chose an interface
    name = _loopback_interface()
    if name is not None:
        os.environ["GLOO_SOCKET_IFNAME"] = name  # read by gloo when the group is created


def _loopback_interface() -> str | None:
    """The loopback interface's name (Linux: the one flagged IFF_LOOPBACK), else None."""
    iff_loopback = 0x8
    try:
        names = sorted(name for _, name in socket.if_nameindex())
    except OSError:
        return None
    for name in names:
        try:
            flags = int(Path(f"/sys/class/net/{name}/flags").read_text(), 16)
        except (OSError, ValueError):
            continue
        if flags & iff_loopback:
            return name
    return None


def _free_port(host: str) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def _agree_on_address(launch: LaunchEnv, addr: str | None) -> tuple[str, int]:
    """Rendezvous address when the launcher gave none: rank 0 picks, MPI tells the rest."""
    if launch.size == 1:
        host = addr or "127.0.0.1"
        return host, _free_port(host)
    if launch.launcher != "mpirun":
        raise ValueError(
            f"{launch.size} ranks but no MASTER_ADDR/MASTER_PORT set; start with torchrun or "
            "mpirun, or set both variables"
        )
    from mpi4py import MPI

    world = MPI.COMM_WORLD
    # [port, address bytes...]: a fixed-size int64 buffer, so no pickle is needed.
    msg = torch.zeros(257, dtype=torch.int64)
    all_local = _all_local(world)  # collective: every rank takes part
    if world.Get_rank() == 0:
        host = addr or ("127.0.0.1" if all_local else socket.gethostname())
        raw = host.encode()[:256]
        msg[0] = _free_port("" if host != "127.0.0.1" else host)
        msg[1 : 1 + len(raw)] = torch.tensor(list(raw), dtype=torch.int64)
    world.Bcast([msg, MPI.INT64_T], root=0)
    host = bytes(int(b) for b in msg[1:].tolist() if b).decode()
    return host, int(msg[0])


def _all_local(world: object) -> bool:
    """True when every rank runs on this host (then loopback is enough)."""
    from mpi4py import MPI

    comm = world  # type: ignore[assignment]
    node = comm.Split_type(MPI.COMM_TYPE_SHARED)  # type: ignore[attr-defined]
    try:
        return bool(node.Get_size() == comm.Get_size())  # type: ignore[attr-defined]
    finally:
        node.Free()
