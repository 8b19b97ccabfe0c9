"""The MPI store under real ``mpirun`` jobs: server ranks, worker ranks, no mocks.

The rank scripts (``tests/ps/ranks/ps_mpi_*.py``) compare against independent
references: exact sums of known gradients (concurrency), an InProcessStore fed
the same requests (optimizers, dynamic tables, conditional pulls, bad input),
and in-process checkpoints (save from 2 servers, load into 3 and back).
Launches are few and small: the CI machine has 2 cores and the 6-rank job is
oversubscribed 3x.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from multiproc import ROOT, mpirun_path, rank_env, run_ranks
from ps.mpi import wire
from ps.mpi.server import round_robin

SCRIPT = "ps_mpi_store.py"


def _oks(outs: list[str], role: str) -> list[int]:
    return sorted(int(r) for r in re.findall(rf"rank (\d+): ok {role}", "\n".join(outs)))


@pytest.mark.timeout(10)
def test_wire_messages_round_trip() -> None:
    """Header, int64 payloads, text and error replies; no MPI needed."""
    text = "tâble ✓".encode()
    meta = wire.message(
        wire.header(wire.Op.LOOKUP, 7, table=3, arg=len(text)), wire.pack_bytes(text)
    )
    assert meta.dtype == np.int64 and meta.size == wire.HEADER_LEN + 2
    head = wire.check_header(meta, "test")
    assert list(head[1:4]) == [wire.Op.LOOKUP, 7, 3]
    assert wire.unpack_bytes(meta[wire.HEADER_LEN :], int(head[wire.W_ARG])) == text
    ids = np.array([5, -1, 2**62], dtype=np.int64)
    meta = wire.message(wire.header(wire.Op.PULL, 1, n=3), ids, ids + 1)
    assert meta[wire.HEADER_LEN :].tolist() == [*ids.tolist(), *(ids + 1).tolist()]
    for exc in (ValueError("bad id 9"), TypeError("ids must be int64"), KeyError("x")):
        err = wire.error_message(wire.Op.PUSH, 4, exc)
        assert int(err[wire.W_OP]) == wire.Op.ERROR and int(err[wire.W_ID]) == 4
        want = {ValueError: ValueError, TypeError: TypeError}.get(type(exc), RuntimeError)
        with pytest.raises(want, match="^server rank 2: " + re.escape(str(exc)) + "$"):
            wire.raise_if_error(err, "server rank 2")
    with pytest.raises(ValueError, match="magic"):
        wire.check_header(np.zeros(wire.HEADER_LEN, dtype=np.int64), "test")
    older = np.zeros(wire.HEADER_LEN, dtype=np.int64)
    older[wire.W_MAGIC] = (wire.MAGIC << 16) | (wire.PROTOCOL - 1)
    with pytest.raises(ValueError, match=f"protocol {wire.PROTOCOL - 1}, this side protocol"):
        wire.check_header(older, "test")
    with pytest.raises(ValueError, match="shorter than a header"):
        wire.check_header(np.zeros(3, dtype=np.int64), "test")
    with pytest.raises(ValueError, match="bytes"):
        wire.unpack_bytes(np.zeros(1, dtype=np.int64), 9)
    tags = {wire.reply_tags(i, 32767) for i in range(1000)}
    assert len(tags) == 1000 and all(16 <= t[0] < t[1] <= 32767 for t in tags)


@pytest.mark.timeout(10)
def test_pull_reply_parts_are_checked() -> None:
    """A ``PULL_MANY`` reply's table of contents is read after its header, and a reply
    with another number of parts is refused, naming the server."""
    toc = np.array([[3, 0], [2, wire.FLAG_POSITIONS]], dtype=np.int64)
    reply = wire.message(wire.header(wire.Op.PULL_MANY, 5, n=2), toc, np.arange(5))
    body, got = wire.pull_reply_parts(reply, 2, server=1)
    assert got.tolist() == toc.tolist() and body[4:].tolist() == list(range(5))
    with pytest.raises(RuntimeError, match="server rank 1 has 2 parts for a request of 3"):
        wire.pull_reply_parts(reply, 3, server=1)
    err = wire.pull_part_error(1, 4, False, "t0", 3)
    assert "4 rows (positions: False) for table 't0' where 3 were asked" in str(err)


@pytest.mark.timeout(10)
def test_servers_take_workers_round_robin() -> None:
    """After serving worker w a server looks at the workers after w first, so a worker
    with many requests in flight cannot starve the others."""
    workers = [0, 1, 2, 3]
    assert round_robin(workers, -1) == [0, 1, 2, 3]
    assert round_robin(workers, 1) == [2, 3, 0, 1]
    assert round_robin(workers, 3) == [0, 1, 2, 3]
    # Four workers all with requests waiting: one turn each, whoever MPI probes first.
    waiting = {0: 5, 1: 5, 2: 5, 3: 5}
    served, last = [], -1
    while any(waiting.values()):
        w = next(w for w in round_robin(workers, last) if waiting[w])
        waiting[w] -= 1
        served.append(w)
        last = w
    assert served == [0, 1, 2, 3] * 5


@pytest.mark.timeout(120)
def test_one_server_matches_inprocess() -> None:
    """1 worker + 1 server: every optimizer, dynamic tables, eviction, bad input."""
    outs = run_ranks(SCRIPT, 2, "mpi", ["--servers", "1", "--phase", "single"], timeout=100)
    assert _oks(outs, "worker") == [0] and _oks(outs, "server") == [1], outs


@pytest.mark.timeout(300)
def test_four_workers_two_servers_then_reshard_to_three(tmp_path: Path) -> None:
    """4 workers + 2 servers (concurrency, optimizers, bad input, save), then a new job with
    1 worker + 3 servers loads that checkpoint, and checkpoints go back and forth with the
    in-process store."""
    args = ["--servers", "2", "--phase", "main", "--dir", str(tmp_path)]
    outs = run_ranks(SCRIPT, 6, "mpi", args, timeout=150)
    assert _oks(outs, "worker") == [0, 1, 2, 3] and _oks(outs, "server") == [4, 5], outs
    manifest = json.loads((tmp_path / "mpi2" / "manifest.json").read_text())
    writers = {p["name"][:5] for t in manifest["tables"] for p in t["parts"]}
    assert writers == {"s0000", "s0001"}, writers  # both servers wrote parts
    args = ["--servers", "3", "--phase", "reload", "--dir", str(tmp_path)]
    outs = run_ranks(SCRIPT, 4, "mpi", args, timeout=120)
    assert _oks(outs, "worker") == [0] and _oks(outs, "server") == [1, 2, 3], outs


def _mpirun(
    flags: list[str], nprocs: int, script: Path, timeout: float, args: tuple[str, ...] = ()
) -> tuple[int, str, str, float]:
    """``mpirun FLAGS -n N python SCRIPT ARGS`` with launcher flags that ``run_ranks`` does
    not take; returns (exit code, stdout, stderr, seconds). Any exit code is allowed here."""
    env = rank_env(inherit=False)
    cmd = [mpirun_path(), *flags, "-n", str(nprocs), sys.executable, str(script), *args]
    t0 = time.monotonic()
    p = subprocess.Popen(
        cmd,
        env=env,
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,  # so a timeout can kill mpirun and every rank
    )
    try:
        out, err = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        out, err = p.communicate()
        raise AssertionError(f"{script.name}: timed out after {timeout:g} s\n{out}{err}") from None
    return p.returncode, out, err, time.monotonic() - t0


DEAD = ROOT / "tests" / "ps" / "ranks" / "ps_mpi_dead.py"


@pytest.mark.timeout(90)
def test_dead_server_raises_on_the_worker_naming_its_rank() -> None:
    """With the launcher told not to kill the job, the worker's wait gives up after
    request_timeout_s (2 s) with CommTimeoutError naming rank 2, and close() still releases
    the living server."""
    code, out, err, _ = _mpirun(["-disable-auto-cleanup"], 3, DEAD, timeout=80)
    out += err
    assert "rank 0: ok detected dead server rank 2" in out, out
    assert "no reply from server rank(s) [2]" in out, out
    assert "rank 1: ok server returned" in out, out
    assert code != 0, (code, out)  # the dead rank's exit code (3) ends up in the job's


@pytest.mark.timeout(90)
def test_dead_server_ends_the_job_under_the_default_launcher() -> None:
    """MPICH's default: a rank that exits without MPI_Finalize takes the job down at once
    (no hang). The job's exit code is the dead rank's 3, or 9 when the launcher's kill of
    the others is what it reports (then with a "BAD TERMINATION" banner naming the PID; the
    launcher does not name the rank, and no rank lives on to do it)."""
    code, out, err, seconds = _mpirun([], 3, DEAD, timeout=80)
    out += err
    assert code != 0, (code, out)
    assert "ok detected" not in out, out  # nobody outlived the dead server
    assert seconds < 60, seconds


@pytest.mark.timeout(120)
def test_benchmark_quick_runs() -> None:
    """The MPI benchmark module runs (figures are not checked here: a shared CI machine)."""
    bench = ROOT / "benchmarks" / "_ps_bench_mpi.py"
    code, out, err, _ = _mpirun([], 2, bench, timeout=100, args=("--quick",))
    assert code == 0, out + err
    result = json.loads(out.strip().splitlines()[-1])
    figures = result["figures"]["rows_per_s"]
    assert all(v > 0 for v in figures.values()), figures
    assert set(result["targets"]) == {
        "mpi_pull_rows_s",
        "mpi_push_rows_s",
        "server_overhead_us_per_message",
        "fp16_mpi_pull_speedup",
        "fp16_mpi_push_speedup",
    }
    assert {"fp16_pull", "fp16_push"} <= set(figures), figures
    fp16 = result["figures"]["fp16_mpi"]  # fp16 / fp32 rows/s, paired by round
    assert {"fp16_mpi_pull_speedup", "fp16_mpi_push_speedup"} <= set(fp16), fp16
    assert min(fp16.values()) > 0, fp16
    server = result["figures"]["server"]  # the server's busy time covers the rows' kernels
    assert all(v > 0 for v in server["busy_us_per_message"].values()), server
    counted = result["figures"]["counted_k1_vs_plain"]  # every optimizer of the part
    assert set(counted) == {"counted_rowwise", "counted_adam"} and min(counted.values()) > 0


LOST = ROOT / "tests" / "ps" / "ranks" / "ps_mpi_lost_worker.py"


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    ("fate", "flags"), [("hangs", []), ("dies", ["-disable-auto-cleanup"])], ids=["hangs", "dies"]
)
def test_server_names_a_dead_or_hung_worker_and_stops(fate: str, flags: list[str]) -> None:
    """2 workers + 1 server (after the workers raced to create one table): worker 1 hangs
    (sleeps) or dies (exits; the launcher told to keep the others) without its goodbye.
    The server raises naming worker rank 1 and its silence after worker_timeout_s (3 s),
    and the job ends instead of waiting for the goodbye forever."""
    code, out, err, seconds = _mpirun(flags, 3, LOST, timeout=100, args=("--fate", fate))
    out += err
    assert "rank 0: ok worker 9 lifecycle checks" in out, out
    assert "rank 1: ok worker 9 lifecycle checks" in out, out
    found = re.search(
        r"rank 2: stopped after [\d.]+ s: .*worker rank 1 sent no request and no goodbye "
        r"for ([\d.]+) s",
        out,
    )
    assert found, out
    assert 3.0 <= float(found.group(1)) < 30.0, found.group(0)
    assert "worker_timeout_s=3" in out and "died or hangs" in out, out
    assert code != 0, (code, out)
    assert seconds < 90, seconds
