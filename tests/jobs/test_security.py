"""Security properties: no pickle anywhere we load, authenticated Redis, loopback by default.

(a) Source scan (``ast``, so comments and docstrings do not count) of the product
    packages and examples: no ``pickle``/``dill``/``cloudpickle``/``shelve``/
    ``marshal``/``joblib`` import (also through ``__import__`` or ``import_module``;
    this is the repository's one pickle scan), no ``eval``/``exec`` call, no ``torch.load``
    without ``weights_only=True``, no ``allow_pickle=True``, no ``yaml.load``, and
    no object-pickling (lower-case) mpi4py call on a communicator.
(b) A crafted pickle in a checkpoint folder (raw pickle bytes under a part's
    ``.npy`` name, and a real ``.npy`` holding an object array) is refused with a
    ValueError by every loader (in-process store, Redis store, the collection's
    local tables), the marker file its unpickling would create never appears, and
    the store's contents are unchanged.
(c) Redis with ``requirepass`` and ACL users: no, wrong or under-privileged
    credentials are :class:`ps.RedisAuthError` naming the address; TLS settings
    reach redis-py (``rediss://`` or ``ssl=True`` against a plain server fails fast
    with the address).
(d) Loopback: the Redis fixture listens on 127.0.0.1 only; our code opens no
    listening socket under MPI; the gloo rendezvous address defaults to 127.0.0.1.
"""

from __future__ import annotations

import ast
import importlib
import ipaddress
import json
import pickle
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch

import ps
from embedding import EmbeddingCollection, KeyedJaggedIds, TableConfig
from multiproc import ROOT, mpirun_path, rank_env
from ps.redis.store import RedisAuthError, RedisStore, RedisUnavailableError
from redis_server import RedisServer, redis_server

pytestmark = pytest.mark.timeout(120)

PRODUCT = ["comm", "ps", "cache", "embedding", "dense", "hybridrec", "examples"]
PICKLING_MODULES = {"pickle", "cPickle", "_pickle", "dill", "cloudpickle", "shelve", "marshal"}
PICKLING_MODULES |= {"joblib"}
# mpi4py's lower-case methods pickle Python objects; the upper-case ones send typed buffers.
MPI_PICKLING = {"send", "recv", "isend", "irecv", "bcast", "gather", "scatter", "allgather"}
MPI_PICKLING |= {"alltoall", "sendrecv", "reduce", "allreduce", "scan", "exscan", "ibcast"}


# ---------------------------------------------------------------- (a) source scan


def _product_files() -> list[Path]:
    files = [p for pkg in PRODUCT for p in sorted((ROOT / pkg).rglob("*.py"))]
    assert len(files) > 30, files  # the scan really sees the packages
    return files


def _kw(call: ast.Call, name: str) -> ast.expr | None:
    return next((k.value for k in call.keywords if k.arg == name), None)


def _is_true(node: ast.expr | None) -> bool:
    return isinstance(node, ast.Constant) and node.value is True


def _dotted(node: ast.expr) -> str:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return f"{_dotted(node.value)}.{node.attr}"
    if isinstance(node, ast.Call):
        return _dotted(node.func) + "()"
    return "?"


def _problems(path: Path) -> list[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    name = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path
    found = []
    for node in ast.walk(tree):
        where = f"{name}:{getattr(node, 'lineno', 0)}"
        if isinstance(node, ast.Import | ast.ImportFrom):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            if isinstance(node, ast.ImportFrom) and node.module:
                names.append(node.module)
            for module in names:
                if module.split(".")[0] in PICKLING_MODULES:
                    found.append(f"{where}: imports {module}")
        if not isinstance(node, ast.Call):
            continue
        func = _dotted(node.func)
        first = node.args[0] if node.args else None
        literal = first.value if isinstance(first, ast.Constant) else None
        dynamic = func in ("__import__", "importlib.import_module", "import_module")
        if dynamic and isinstance(literal, str) and literal.split(".")[0] in PICKLING_MODULES:
            found.append(f"{where}: imports {literal}")
        if func in ("eval", "exec", "builtins.eval", "builtins.exec", "compile"):
            found.append(f"{where}: calls {func}")
        if func.endswith("torch.load") and not _is_true(_kw(node, "weights_only")):
            found.append(f"{where}: torch.load without weights_only=True")
        if _is_true(_kw(node, "allow_pickle")):
            found.append(f"{where}: {func}(allow_pickle=True)")
        if func in ("yaml.load", "yaml.unsafe_load", "yaml.full_load"):
            found.append(f"{where}: {func}")
        if isinstance(node.func, ast.Attribute) and node.func.attr in MPI_PICKLING:
            receiver = _dotted(node.func.value).lower()
            if "comm" in receiver.split(".")[-1] or "world" in receiver:
                found.append(f"{where}: {func}() pickles its payload (use the upper-case form)")
        if isinstance(node.func, ast.Attribute) and node.func.attr == "listen":
            found.append(f"{where}: {func}() opens a listening socket")
    return found


def test_no_pickle_eval_or_exec_in_the_product_code() -> None:
    problems = [p for f in _product_files() for p in _problems(f)]
    assert not problems, "\n".join(problems)


def test_the_scan_catches_what_it_looks_for(tmp_path: Path) -> None:
    bad = tmp_path / "bad.py"
    bad.write_text(
        '"""pickle eval( torch.load( in a docstring is fine."""\n'
        "import pickle\n"
        "from cloudpickle import dumps\n"
        "import torch, numpy as np\n"
        "x = eval('1')\n"
        "exec('y = 2')\n"
        "torch.load('f')\n"
        "torch.load('f', weights_only=False)\n"
        "torch.load('f', weights_only=True)\n"
        "np.load('f', allow_pickle=True)\n"
        "self._comm.bcast(x)\n"
        "MPI.COMM_WORLD.send(x, dest=1)\n"
        "self._comm.Bcast([x, MPI.INT64_T])\n"
        "model.eval()\n"
        "__import__('pickle')\n"
        "importlib.import_module('dill.detect')\n"
        "importlib.import_module('json')\n"
    )
    found = _problems(bad)
    lines = sorted(int(p.split(":")[1]) for p in found)
    assert lines == [2, 3, 5, 6, 7, 8, 10, 11, 12, 15, 16], found


# ---------------------------------------------------------------- (b) crafted pickles


class _Boom:
    """Unpickling this creates ``marker``: proof that a loader unpickled it."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[object, tuple[str, str]]:
        return (open, (str(self.marker), "w"))


def _plant(path: Path, marker: Path, how: str) -> None:
    """Replace the first part's weights file of checkpoint ``path`` with a pickle."""
    manifest = json.loads((path / "manifest.json").read_text())
    weights = path / manifest["tables"][0]["parts"][0]["files"]["weights"]
    if how == "raw pickle":
        weights.write_bytes(pickle.dumps(_Boom(marker)))
    else:  # a genuine .npy whose header says dtype object: its body is a pickle
        with open(weights, "wb") as f:
            np.save(f, np.array([_Boom(marker), 1], dtype=object), allow_pickle=True)


SPEC = ps.TableSpec(name="t", num_rows=16, dim=4, optimizer=ps.RowWiseAdagrad(lr=0.1))


def _snapshot(store: ps.Store) -> list[torch.Tensor]:
    ids = torch.arange(16)
    return [store.pull("t", ids).rows, store.clocks("t", ids), store.state("t", ids)]


@pytest.fixture(scope="module")
def server() -> Iterator[RedisServer]:
    with redis_server() as srv:
        yield srv


@pytest.mark.parametrize("how", ["raw pickle", "object .npy"])
@pytest.mark.parametrize("kind", ["inprocess", "redis"])
def test_stores_refuse_a_pickle_in_a_checkpoint(
    tmp_path: Path, server: RedisServer, kind: str, how: str
) -> None:
    source = ps.InProcessStore()
    source.create_table(SPEC)
    source.push("t", torch.tensor([1, 2, 2]), torch.ones(3, 4))
    source.save(tmp_path / "ck")
    marker = tmp_path / "UNPICKLED"
    _plant(tmp_path / "ck", marker, how)
    if kind == "inprocess":
        store: ps.Store = ps.InProcessStore()
    else:
        store = RedisStore(server.url, prefix=f"sec-{kind}-{how.replace(' ', '')}", buckets=4)
    store.create_table(SPEC)
    store.push("t", torch.tensor([5]), torch.ones(1, 4))
    before = _snapshot(store)
    with pytest.raises(ValueError, match=r"weights.npy is not a plain .npy array"):
        store.load(tmp_path / "ck")
    assert not marker.exists(), "a pickle in the checkpoint was unpickled"
    for x, y in zip(before, _snapshot(store), strict=True):
        assert torch.equal(x, y), "a refused load changed the store"
    store.close()


def test_collection_local_tables_refuse_a_pickle(tmp_path: Path) -> None:
    cfg = TableConfig(name="t", num_rows=16, dim=4, feature_names=["f"])
    ec = EmbeddingCollection([cfg])
    out = ec(KeyedJaggedIds.from_lists({"f": [[1, 2], [3]]}))
    out["f"].sum().backward()
    ec.save(tmp_path / "ck")
    marker = tmp_path / "UNPICKLED"
    _plant(tmp_path / "ck", marker, "object .npy")
    fresh = EmbeddingCollection([cfg])
    before = fresh.rows("t", torch.arange(16))
    with pytest.raises(ValueError, match="not a plain .npy array"):
        fresh.load(tmp_path / "ck")
    assert not marker.exists()
    assert torch.equal(before, fresh.rows("t", torch.arange(16)))


# ---------------------------------------------------------------- (c) Redis auth and TLS


def test_redis_password_and_acl_users() -> None:
    with redis_server(password="s3cret", acl_user=("alice", "wonder")) as srv:
        address = f"127.0.0.1:{srv.port}"
        for kwargs in (
            {},
            {"password": "wrong"},
            {"username": "alice", "password": "s3cret"},  # alice's name, default's password
            {"username": "mallory", "password": "wonder"},
        ):
            t0 = time.monotonic()
            with pytest.raises(RedisAuthError, match=re.escape(address)):
                RedisStore(srv.url, **kwargs)  # type: ignore[arg-type]
            assert time.monotonic() - t0 < 5, kwargs
        with pytest.raises(RedisAuthError, match=re.escape(address)):
            RedisStore(f"redis://alice:nope@127.0.0.1:{srv.port}/0")
        with RedisStore(srv.url, password="s3cret") as s:
            s.create_table(SPEC)
        with RedisStore(srv.url, username="alice", password="wonder") as s:
            s.push("t", torch.tensor([3]), torch.ones(1, 4))
            assert s.clocks("t", torch.tensor([3])).tolist() == [1]


def test_redis_user_without_permission_on_the_keys_is_an_auth_error() -> None:
    """carol may log in but not touch the store's keys: Redis answers NOPERM."""
    restricted = ["--user", "carol", "on", ">c4rol", "~other:*", "+@all"]
    with redis_server(extra=restricted) as srv:
        store = RedisStore(srv.url, username="carol", password="c4rol", prefix="hybridrec")
        try:
            store.create_table(SPEC)
        except RedisAuthError as err:
            assert f"127.0.0.1:{srv.port}" in str(err) and "username/password" in str(err)
        else:
            raise AssertionError("a user without key permissions created a table")
        finally:
            store.close()


def test_tls_settings_reach_redis_py(server: RedisServer, tmp_path: Path) -> None:
    """No TLS server here: a TLS client against the plain server must fail fast, naming
    the address, whether TLS comes from ``rediss://`` or from ``ssl=True``."""
    address = f"127.0.0.1:{server.port}"
    for kwargs in (
        {"url": f"rediss://127.0.0.1:{server.port}/0", "ssl_cert_reqs": "none"},
        {"url": server.url, "ssl": True, "ssl_ca_certs": str(tmp_path / "missing-ca.pem")},
    ):
        t0 = time.monotonic()
        with pytest.raises((RedisUnavailableError, RedisAuthError)) as info:
            RedisStore(socket_timeout=1.0, connect_timeout=1.0, **kwargs)  # type: ignore[arg-type]
        assert address in str(info.value), info.value
        assert time.monotonic() - t0 < 10


# ---------------------------------------------------------------- (d) loopback


def _listen_addresses(port: int) -> list[str]:
    """Local addresses (hex, as /proc prints them) of LISTEN sockets on ``port``."""
    out = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            f = line.split()
            addr, hex_port = f[1].split(":")
            if f[3] == "0A" and int(hex_port, 16) == port:
                out.append(addr)
    return out


def test_redis_fixture_listens_on_loopback_only(server: RedisServer) -> None:
    bind = server.client().config_get("bind")["bind"]
    assert bind == "127.0.0.1", bind
    assert _listen_addresses(server.port) == ["0100007F"]  # 127.0.0.1, nothing else


def test_gloo_rendezvous_defaults_to_loopback() -> None:
    init = importlib.import_module("comm.init")  # the module (comm.init is the function)
    host, port = init._agree_on_address(init.LaunchEnv(launcher="none"), None)
    assert host == "127.0.0.1" and 0 < port < 65536
    source = Path(str(init.__file__)).read_text()
    assert 'addr or ("127.0.0.1" if all_local else' in source  # all ranks on one host


def _listeners(backend: str) -> str:
    cmd = [
        mpirun_path(),
        "-n",
        "2",
        sys.executable,
        str(ROOT / "tests/jobs/ranks/fault_loopback.py"),
    ]
    env = rank_env(inherit=False)
    res = subprocess.run(
        [*cmd, backend], env=env, cwd=ROOT, capture_output=True, text=True, timeout=90
    )
    out = res.stdout + res.stderr
    assert res.returncode == 0 and out.count(": ok") == 2, out
    return out


@pytest.mark.timeout(120)
def test_our_mpi_code_opens_no_listening_socket() -> None:
    out = _listeners("mpi")
    assert "listen" not in out, out


@pytest.mark.timeout(120)
def test_gloo_listens_on_loopback_only() -> None:
    # Every rank on this host: rank 0's rendezvous store and both ranks' gloo sockets
    # listen on loopback (torch's own tcp:// store would listen on '::', and gloo on
    # whatever the host name resolves to).
    out = _listeners("gloo")
    found = re.findall(r"rank (\d): listen (\S+):\d+", out)
    assert {rank for rank, _ in found} == {"0", "1"}, out  # the store (rank 0) and gloo pairs
    assert all(ipaddress.ip_address(a).is_loopback for _, a in found), out
