"""The DLRM example's command line: options fill DLRMJobConfig (also from TOML/JSON files),
--help explains every option, and the script runs as a file, writing metrics and a plot."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from hybridrec.cli.options import build_parser
from hybridrec.dlrm.config import DLRMJobConfig
from hybridrec.dlrm.job import main, parse_args
from multiproc import rank_env

ROOT = Path(__file__).resolve().parents[2]


def test_defaults_and_every_option() -> None:
    assert parse_args([]) == DLRMJobConfig()
    argv = (
        "--data synthetic --epochs 2 --batch-size 64 --lr 0.01 --dense-optimizer adagrad "
        "--emb-lr 0.2 --dim 8 --bottom-mlp 32 8 --top-mlp 8 1 --seed 3 --synthetic-rows 50 "
        "--synthetic-samples 500 --max-steps 7 --backend local --validate-comm --threads 2 "
        "--metrics-out m.jsonl --ps mpi:2 --placement hybrid --placement-of C1=sharded "
        "--cache-rows 10 --read-bound 2 --write-bound 1 --cache-policy lfu --compression fp16 "
        "--bucket-mb 4 --checkpoint-dir ck --checkpoint-every 5 --checkpoint-keep 3 --resume "
        "--log-every 2 --no-progress --no-verbose --eval-every 9 --eval-batch-size 100"
    )
    cfg = parse_args(argv.split())
    assert cfg == DLRMJobConfig(
        data="synthetic", epochs=2, batch_size=64, lr=0.01, dense_optimizer="adagrad",
        emb_lr=0.2, dim=8, bottom_mlp=[32, 8], top_mlp=[8, 1], seed=3, synthetic_rows=50,
        synthetic_samples=500, max_steps=7, backend="local", validate_comm=True, threads=2,
        metrics_out="m.jsonl", ps="mpi:2", placement="hybrid", placement_of=["C1=sharded"],
        cache_rows=10, read_bound=2, write_bound=1, cache_policy="lfu", compression="fp16",
        bucket_mb=4.0, checkpoint_dir="ck", checkpoint_every=5, checkpoint_keep=3, resume=True,
        log_every=2, progress=False, verbose=False, eval_every=9, eval_batch_size=100,
    )  # fmt: skip
    crit = parse_args(["--data", "criteo", "--criteo-path", "a.tsv", "b.gz", "--criteo-rows", "0"])
    assert (crit.criteo_path, crit.criteo_rows, crit.epochs) == (["a.tsv", "b.gz"], 0, 1)


def test_help_explains_every_option() -> None:
    parser = build_parser(DLRMJobConfig, "t")
    for action in parser._actions:
        if action.dest not in ("help", "config"):
            assert action.dest in DLRMJobConfig.__dataclass_fields__, action.dest
            assert action.help and len(action.help.split("(default")[0].strip()) > 8, action.dest


def test_config_file_then_command_line(tmp_path: Path) -> None:
    toml = tmp_path / "run.toml"
    toml.write_text('data = "synthetic"\nbatch-size = 64\ntop_mlp = [8, 1]\nps = "mpi:2"\n')
    cfg = parse_args(["--config", str(toml), "--batch-size", "32"])
    assert (cfg.data, cfg.batch_size, cfg.top_mlp, cfg.ps) == ("synthetic", 32, [8, 1], "mpi:2")
    (tmp_path / "run.json").write_text(json.dumps({"zero_stage": 2, "placement": "sharded"}))
    cfg = parse_args(["--config", str(tmp_path / "run.json")])
    assert (cfg.zero_stage, cfg.placement) == (2, "sharded")


@pytest.mark.parametrize(
    ("kw", "pattern"),
    [
        (dict(epochs=0), "epochs must be >= 1, got 0"),
        (dict(lr=0.0), "lr must be > 0, got 0.0"),
        (
            dict(data="avazu"),
            "data must be 'movielens', 'synthetic', 'criteo', 'tabular' or 'recbole', got 'avazu'",
        ),
        (dict(data="criteo"), "data 'criteo' needs --criteo-path"),
        (dict(max_steps=-1), "max_steps must be >= 0, got -1"),
        (dict(zero_stage=3), "zero_stage must be 0, 1 or 2, got 3"),
        (dict(compression="gzip"), "compression must be one of none, fp16.*got 'gzip'"),
        (dict(compression="fp16", zero_stage=1), "ZeRO stage 1 reduces gradients itself"),
        (dict(ps="etcd://x"), "expected 'local', 'mpi'"),
        (dict(placement_of=["user"]), "expected TABLE=local\\|hybrid\\|sharded, got 'user'"),
        (dict(resume=True), "resume needs checkpoint_dir"),
    ],
)
def test_config_validation(kw: dict[str, object], pattern: str) -> None:
    with pytest.raises(ValueError, match=pattern):
        DLRMJobConfig(**kw)  # type: ignore[arg-type]


def test_bad_placement_table_and_rank_count_are_named(capsys: pytest.CaptureFixture[str]) -> None:
    from comm import LocalGroup
    from hybridrec.dlrm.job import train

    cfg = DLRMJobConfig(data="synthetic", synthetic_samples=100, placement_of=["nope=sharded"])
    with pytest.raises(ValueError, match="placement_of: no table 'nope'; the tables are"):
        train(cfg, LocalGroup())
    with pytest.raises(SystemExit) as exit_info:  # a user error: one line, exit status 2
        main(["--ps", "mpi", "--backend", "local", "--data", "synthetic"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert (
        err.startswith("hybridrec: error: --ps mpi needs the MPI backend") and err.count("\n") == 1
    )


@pytest.mark.timeout(120)
def test_script_runs_as_a_file(tmp_path: Path) -> None:
    out = tmp_path / "metrics.jsonl"
    cmd = [
        sys.executable, str(ROOT / "examples" / "train_dlrm.py"), "--data", "synthetic",
        "--synthetic-samples", "2000", "--synthetic-rows", "100", "--epochs", "2",
        "--batch-size", "100", "--backend", "local", "--metrics-out", str(out),
        "--log-every", "4",
    ]  # fmt: skip
    run = subprocess.run(
        cmd, cwd=tmp_path, env=rank_env(), capture_output=True, text=True, timeout=110
    )
    assert run.returncode == 0, run.stdout + run.stderr
    assert "test AUC" in run.stdout and "popularity AUC" in run.stdout
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["kind"] for r in rows] == ["step"] * 4 + ["epoch"] + ["step"] * 4 + ["epoch", "final"]
    assert [r["step"] for r in rows if r["kind"] == "step"] == [4, 8, 12, 16, 20, 24, 28, 32]
    assert all(r["loss"] > 0 and r["samples_per_s"] > 0 for r in rows if r["kind"] == "step")
    assert rows[-1]["steps"] == 2 * (1600 // 100)
    assert out.with_suffix(".png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.timeout(120)
def test_the_console_shows_the_cache_hit_rate(tmp_path: Path) -> None:
    """With a cache, every epoch line says the hit rate so far (as the metrics file's
    epoch row does); without one it says nothing about a cache."""
    args = [
        sys.executable, "-m", "hybridrec", "train-dlrm", "--data", "synthetic",
        "--synthetic-samples", "2000", "--synthetic-rows", "100", "--epochs", "2",
        "--batch-size", "100", "--backend", "local", "--no-progress",
    ]  # fmt: skip
    runs = {}
    for name, extra in (("cached", ["--cache-fraction", "0.2"]), ("plain", [])):
        run = subprocess.run(
            [*args, *extra], cwd=tmp_path, env=rank_env(), capture_output=True, text=True,
            timeout=110,
        )  # fmt: skip
        assert run.returncode == 0, run.stdout + run.stderr
        runs[name] = [line for line in run.stdout.splitlines() if line.startswith("epoch ")]
    assert len(runs["cached"]) == 2 and all("cache hit rate " in x for x in runs["cached"])
    rates = [float(x.rsplit("cache hit rate ", 1)[1].rstrip("%")) for x in runs["cached"]]
    assert 0 < rates[0] <= rates[1] < 100, rates  # hot rows are found more as the cache fills
    assert runs["plain"] and not any("cache" in x for x in runs["plain"])


def test_help_groups_the_options_the_same_way_in_both_jobs() -> None:
    """``--help`` lists the options by group, the common ones first, every option in a
    named group (none left to "other options"), for the DLRM and the LM job alike."""
    from hybridrec.cli.job_options import HELP_GROUPS
    from hybridrec.lm.config import LMConfig

    titles = [f"{title} options:" for title, _ in HELP_GROUPS]
    for cls in (DLRMJobConfig, LMConfig):
        text = build_parser(cls, "x").format_help()
        seen = [line for line in text.splitlines() if line.endswith(" options:")]
        assert seen == titles, seen
        assert "other options:" not in text
    assert titles[:2] == ["data options:", "training options:"]
