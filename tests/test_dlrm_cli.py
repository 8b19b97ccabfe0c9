"""The DLRM example's command line: options fill TrainConfig; the script runs as a file."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from examples.train_dlrm import TrainConfig, parse_args

ROOT = Path(__file__).resolve().parent.parent


def test_defaults_and_every_option() -> None:
    assert parse_args([]) == TrainConfig()
    argv = (
        "--data synthetic --epochs 2 --batch-size 64 --lr 0.01 --dense-optimizer adagrad "
        "--emb-lr 0.2 --dim 8 --bottom-mlp 32 16 --top-mlp 8 --seed 3 --synthetic-rows 50 "
        "--synthetic-samples 500 --max-steps 7 --backend local --validate-comm --threads 2 "
        "--metrics-out m.jsonl"
    )
    cfg = parse_args(argv.split())
    assert cfg == TrainConfig(
        data="synthetic", epochs=2, batch_size=64, lr=0.01, dense_optimizer="adagrad",
        emb_lr=0.2, dim=8, bottom_mlp=[32, 16], top_mlp=[8], seed=3, synthetic_rows=50,
        synthetic_samples=500, max_steps=7, backend="local", validate_comm=True, threads=2,
        metrics_out="m.jsonl",
    )  # fmt: skip


@pytest.mark.parametrize(
    ("kw", "pattern"),
    [
        (dict(epochs=0), "epochs must be >= 1, got 0"),
        (dict(lr=0.0), "lr must be > 0, got 0.0"),
        (dict(data="criteo"), "data must be 'movielens' or 'synthetic', got 'criteo'"),
        (dict(max_steps=-1), "max_steps must be >= 0, got -1"),
    ],
)
def test_config_validation(kw: dict[str, object], pattern: str) -> None:
    with pytest.raises(ValueError, match=pattern):
        TrainConfig(**kw)  # type: ignore[arg-type]


@pytest.mark.timeout(120)
def test_script_runs_as_a_file(tmp_path: Path) -> None:
    out = tmp_path / "metrics.jsonl"
    cmd = [
        sys.executable, str(ROOT / "examples" / "train_dlrm.py"), "--data", "synthetic",
        "--synthetic-samples", "2000", "--synthetic-rows", "100", "--epochs", "2",
        "--batch-size", "100", "--backend", "local", "--metrics-out", str(out),
    ]  # fmt: skip
    run = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=110)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "test AUC" in run.stdout and "popularity AUC" in run.stdout
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["kind"] for r in rows] == ["epoch", "epoch", "final"]
    assert rows[-1]["steps"] == 2 * (1600 // 100)
