"""The language-model example: options, falling validation loss, and N ranks = one process.

Every rank count trains on the same global batches (each rank takes its slice), the
token rows are kept equal by the embedding collection and the dense gradients are
averaged, so 2 and 4 ranks under mpirun (and 2 under gloo) must reproduce the
single-process validation losses up to float summation order.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

import comm
from hybridrec.lm.config import LMConfig
from hybridrec.lm.job import build_parser, parse_args, train
from hybridrec.lm.model import embed_tokens, token_table
from multiproc import run_ranks

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "examples" / "train_lm.py"
# Small and quick: ~1.5 s of CPU per run of 30 steps, plus start-up.
SMALL: dict[str, Any] = dict(
    max_bytes=400_000,
    block_size=32,
    batch_size=16,
    n_layer=1,
    n_head=2,
    d_model=32,
    steps=30,
    eval_every=15,
    eval_batches=2,
)


def _argv(cfg: dict[str, Any]) -> list[str]:
    return [f"--{k.replace('_', '-')}={v}" for k, v in cfg.items()]


def test_defaults_and_every_option() -> None:
    assert parse_args([]) == LMConfig()
    argv = (
        "--text-dir /t --max-bytes 9 --tokenizer auto --bpe-file /b --block-size 8 "
        "--batch-size 4 --n-layer 3 --n-head 2 --d-model 16 --dropout 0.1 --steps 7 --lr 0.01 "
        "--weight-decay 0 --placement sharded --emb-optimizer sgd --emb-lr 0.5 --zero-stage 2 "
        "--bucket-mb 1 --eval-every 3 --eval-batches 2 --seed 4 --backend gloo "
        "--validate-comm --threads 2 --metrics-out m.jsonl --no-verbose --ps redis://h:1/0 "
        "--cache-rows 0 --checkpoint-dir ck --checkpoint-every 3 "
        "--checkpoint-keep 1 --resume --log-every 2 --no-progress"
    )
    assert parse_args(argv.split()) == LMConfig(
        text_dir="/t", max_bytes=9, tokenizer="auto", bpe_file="/b", block_size=8, batch_size=4,
        n_layer=3, n_head=2, d_model=16, dropout=0.1, steps=7, lr=0.01, weight_decay=0.0,
        placement="sharded", emb_optimizer="sgd", emb_lr=0.5, zero_stage=2, bucket_mb=1.0,
        eval_every=3, eval_batches=2, seed=4, backend="gloo", validate_comm=True, threads=2,
        metrics_out="m.jsonl", verbose=False, ps="redis://h:1/0", cache_rows=0,
        checkpoint_dir="ck", checkpoint_every=3, checkpoint_keep=1,
        resume=True, log_every=2, progress=False,
    )  # fmt: skip
    assert parse_args(["--compression", "topk"]).compression == "topk"
    fields = set(LMConfig.__dataclass_fields__)
    for action in build_parser()._actions:
        if action.dest not in ("help", "config"):
            assert action.dest in fields and action.help, action.dest  # --help explains it


@pytest.mark.parametrize(
    ("kw", "pattern"),
    [
        (dict(steps=0), "steps must be >= 1, got 0"),
        (dict(lr=0.0), "lr must be > 0, got 0.0"),
        (dict(tokenizer="bpe"), "tokenizer must be 'byte', 'gpt2' or 'auto', got 'bpe'"),
        (dict(zero_stage=3), "zero_stage must be 0, 1 or 2, got 3"),
        (dict(seed=-1), "seed must be >= 0, got -1"),
        (dict(cache_rows=5, placement="sharded"), "a cache needs placement 'hybrid'"),
        (dict(zero_stage=1, compression="fp16"), "ZeRO stage 1 reduces gradients itself"),
    ],
)
def test_config_validation(kw: dict[str, object], pattern: str) -> None:
    with pytest.raises(ValueError, match=pattern):
        LMConfig(**kw)  # type: ignore[arg-type]


def test_token_lookup_is_unpooled_rows() -> None:
    import torch

    from embedding import EmbeddingCollection
    from ps import InProcessStore

    ec = EmbeddingCollection([token_table(LMConfig(d_model=8), 50)], store=InProcessStore())
    idx = torch.tensor([[3, 7, 3], [0, 49, 7]])
    emb = embed_tokens(ec, idx)  # [2, 3, 8]
    rows = ec.rows("token_embedding", torch.arange(50))  # [50, 8]
    torch.testing.assert_close(emb, rows[idx])


@pytest.mark.timeout(120)
def test_validation_loss_falls_alone(tmp_path: Path) -> None:
    out = tmp_path / "m.jsonl"
    cfg = LMConfig(**SMALL, metrics_out=str(out), verbose=False, log_every=5)  # type: ignore[arg-type]
    result = train(cfg, comm.LocalGroup())
    losses = [e["val_loss"] for e in result["evals"]]
    assert [e["step"] for e in result["evals"]] == [0, 15, 30]
    assert losses[0] > 5.0  # ~ln(256): uniform over bytes at the start
    assert losses[1] < losses[0] - 1.5 and losses[2] < losses[1]
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    kinds = ["eval"] + ["step"] * 3 + ["eval"] + ["step"] * 3 + ["eval", "final"]
    assert [r["kind"] for r in rows] == kinds
    assert [r["step"] for r in rows if r["kind"] == "step"] == [5, 10, 15, 20, 25, 30]
    assert rows[-1]["val_loss"] == losses[-1]
    assert out.with_suffix(".png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def single_state_bytes(nprocs: int) -> float:
    """Upper bound of one rank's sharded AdamW state: 2 moments of ceil(N / nprocs) fp32
    elements of the SMALL GPT, plus the step counter."""
    from dense.gpt import GPT, GPTConfig

    n = GPT(
        GPTConfig(vocab_size=256, block_size=32, n_layer=1, n_head=2, d_model=32)
    ).num_parameters()
    return 2 * 4 * -(-n // nprocs) + 8


@pytest.fixture(scope="module")
def single_process_losses() -> list[float]:
    cfg = LMConfig(**SMALL, verbose=False)  # type: ignore[arg-type]
    return [e["val_loss"] for e in train(cfg, comm.LocalGroup())["evals"]]


@pytest.mark.timeout(240)
@pytest.mark.parametrize(
    ("backend", "nprocs", "placement", "zero_stage"),
    [("mpi", 2, "hybrid", 0), ("mpi", 4, "hybrid", 1), ("gloo", 2, "sharded", 2)],
)
def test_ranks_match_one_process(
    backend: str,
    nprocs: int,
    placement: str,
    zero_stage: int,
    tmp_path: Path,
    single_process_losses: list[float],
) -> None:
    """The script under mpirun / gloo: loss falls and equals the one-process run's.

    (The token table's placement and the ZeRO stage change where rows and optimizer
    state live, not the arithmetic, so they are compared with the same reference.)
    """
    out = tmp_path / "m.jsonl"
    args = [
        *_argv(SMALL),
        f"--backend={backend}",
        f"--placement={placement}",
        f"--zero-stage={zero_stage}",
        f"--metrics-out={out}",
    ]
    text = "\n".join(run_ranks(SCRIPT, nprocs, backend, args=args, timeout=220))
    assert f"{nprocs} ranks: {nprocs} workers ({backend}), zero stage {zero_stage}" in text, text
    assert "final val loss" in text, text
    final = json.loads(out.read_text().splitlines()[-1])
    assert final["kind"] == "final" and final["world_size"] == nprocs
    losses = [e["val_loss"] for e in final["evals"]]
    assert losses[-1] < losses[0] - 1.5  # falls
    assert losses == pytest.approx(single_process_losses, abs=2e-3)
    if zero_stage:  # AdamW state (two moments) sharded: ~1/N of the unsharded bytes per rank
        assert final["dense_optimizer_state_bytes"] <= single_state_bytes(nprocs)
