"""One DLRM job, three launchers: ``python``, ``mpirun -n 2`` and ``torchrun --nproc_per_node
2`` train on the same global batches, so they must report the same losses and metrics; and
``mpirun -n 3 --ps mpi`` (2 workers + 1 parameter-server rank) trains past the popularity
baseline.

Every run writes its metrics file; the comparison is of the step-loss lines (the global
batch's loss, averaged over the ranks) and the final validation/test metrics.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from multiproc import ROOT, free_port, mpirun_path, rank_env

SCRIPT = ROOT / "examples" / "train_dlrm.py"
# 24 MovieLens steps of 256 (the dense part under DataParallel), eval of val and test; the
# small dot-interaction model (what these tests prove is the launchers, not the model).
ARGS = [
    "--max-steps", "24", "--log-every", "4", "--no-progress", "--eval-batch-size", "2048",
    "--interaction", "dot", "--dim", "16", "--top-mlp", "64", "32", "1",
]  # fmt: skip


def _launch(cmd: list[str], args: list[str], timeout: float) -> subprocess.CompletedProcess[str]:
    cmd = [*cmd, str(SCRIPT), *args]
    return subprocess.run(
        cmd, cwd=ROOT, env=rank_env(), capture_output=True, text=True, timeout=timeout
    )


def _run(
    cmd: list[str], out: Path, args: list[str] = ARGS, timeout: float = 200, header: str = ""
) -> list[dict[str, Any]]:
    """Run the script; its metrics lines. ``header``: text its output must hold."""
    run = _launch(cmd, [*args, "--metrics-out", str(out)], timeout)
    assert run.returncode == 0, f"{cmd}\n{run.stdout}\n{run.stderr}"
    assert header in run.stdout, run.stdout
    return [json.loads(line) for line in out.read_text().splitlines()]


def _summary(rows: list[dict[str, Any]]) -> dict[str, float]:
    out = {f"loss@{r['step']}": r["loss"] for r in rows if r["kind"] == "step"}
    final = rows[-1]
    assert final["kind"] == "final"
    for key in ("test_auc", "test_logloss", "val_auc", "val_logloss"):
        out[key] = final[key]
    out["train_loss"] = final["epochs"][-1]["train_loss"]
    return out


@pytest.mark.timeout(600)
def test_python_mpirun_and_torchrun_agree(tmp_path: Path) -> None:
    torchrun = Path(sys.executable).parent / "torchrun"
    runs = {
        "python": _run([sys.executable], tmp_path / "py.jsonl", header="1 rank: 1 worker (local)"),
        "mpirun": _run(
            [mpirun_path(), "-n", "2", sys.executable],
            tmp_path / "mpi.jsonl",
            header="2 ranks: 2 workers (mpi)",
        ),  # fmt: skip
        "torchrun": _run(
            [str(torchrun), "--nproc_per_node", "2", "--master-port", str(free_port())],
            tmp_path / "tr.jsonl",
        ),
    }
    assert [r["world_size"] for r in (runs[k][-1] for k in runs)] == [1, 2, 2]
    want = _summary(runs["python"])
    assert len([k for k in want if k.startswith("loss@")]) == 6
    for name in ("mpirun", "torchrun"):
        got = _summary(runs[name])
        assert got.keys() == want.keys()
        for key in want:
            # A gate, not a rounding bound (docs/numerics.md, "Whole jobs across worker counts").
            assert got[key] == pytest.approx(want[key], abs=1e-5), (name, key, got, want)


@pytest.mark.timeout(400)
def test_mpi_parameter_server_ranks_train(tmp_path: Path) -> None:
    cmd = [mpirun_path(), "-n", "3", sys.executable]
    args = [*ARGS, "--ps", "mpi", "--max-steps", "150"]  # the later --max-steps wins
    rows = _run(cmd, tmp_path / "ps.jsonl", args, 380, header="3 ranks: 2 workers + 1 PS server")
    final = rows[-1]
    assert final["world_size"] == 2 and final["steps"] == 150  # 2 workers + 1 server
    assert final["config"]["ps"] == "mpi"
    # Rows travel through the server: every logged step moved rows.
    moved = [r["ps_rows_moved"] for r in rows if r["kind"] == "step"]
    assert moved == sorted(moved) and moved[0] > 0, moved
    # Measured: test AUC ~0.759 vs popularity 0.699 after 150 steps.
    assert final["test_auc"] > final["popularity_auc"] + 0.03, final


@pytest.mark.timeout(300)
def test_two_workers_share_a_redis_store_and_resume_from_it(tmp_path: Path) -> None:
    """``--ps redis://``: both workers' hybrid tables in one Redis (created once, by rank
    0); the checkpoint holds the Redis tables and a resumed run loads them back."""
    from redis_server import redis_server

    args = [
        "--data", "synthetic", "--synthetic-samples", "3000", "--synthetic-rows", "200",
        "--batch-size", "100", "--dim", "8", "--no-progress", "--log-every", "6",
        "--checkpoint-dir", str(tmp_path / "ck"), "--lr", "0.01",
    ]  # fmt: skip
    cmd = [mpirun_path(), "-n", "2", sys.executable]
    out = tmp_path / "r.jsonl"
    with redis_server() as srv:
        first = _run(cmd, out, [*args, "--ps", srv.url, "--epochs", "1"], timeout=140)
        keys = srv.client().dbsize()
        # A fresh job on the same Redis finds the first one's tables: both workers stop
        # instead of training on from those rows, and the job says so in one line.
        again = _launch(cmd, [*args, "--ps", srv.url, "--checkpoint-dir", str(tmp_path / "x")], 140)
        refused = again.stdout + again.stderr
        assert again.returncode != 0 and srv.client().dbsize() == keys, (again.returncode, refused)
        assert refused.count("already holds table(s) 'cat0'") == 1, refused
        assert "Traceback" not in refused, refused
        srv.client().flushdb()  # the resumed run must get its rows from the checkpoint
        rows = _run(cmd, out, [*args, "--ps", srv.url, "--epochs", "2", "--resume"], 140)
    assert first[-1]["world_size"] == 2 and first[-1]["steps"] == 24 and keys > 0
    store = tmp_path / "ck" / "step-00000024" / "model" / "stores" / "s000" / "manifest.json"
    assert json.loads(store.read_text())["writer"] == "RedisStore"
    steps = [r for r in rows if r["kind"] == "step"]
    assert [r["step"] for r in steps] == [6, 12, 18, 24, 30, 36, 42, 48]
    assert all(r["ps_rows_moved"] > 0 for r in steps)
    assert steps[-1]["loss"] < steps[0]["loss"] - 0.2, steps
    assert rows[-1]["steps"] == 48 and rows[-1]["test_auc"] > 0.55
