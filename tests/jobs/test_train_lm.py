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
from tolerance import assert_close, assert_same, sum_tol

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "examples" / "train_lm.py"
# Small and quick: ~1.5 s of CPU per run of 30 steps, plus start-up.
SMALL: dict[str, Any] = dict(
    max_bytes=400_000,
    block_size=32,
    batch_size=16,
    n_layer=1,
    n_head=2,
    d_model=32,
    max_steps=30,
    eval_every=15,
    eval_batches=2,
)


def _argv(cfg: dict[str, Any]) -> list[str]:
    return [f"--{k.replace('_', '-')}={v}" for k, v in cfg.items()]


def test_defaults_and_every_option() -> None:
    assert parse_args([]) == LMConfig()
    argv = (
        "--text-dir /t --max-bytes 9 --tokenizer auto --bpe-file /b --block-size 8 "
        "--batch-size 4 --n-layer 3 --n-head 2 --d-model 16 --dropout 0.1 --max-steps 7 --lr 0.01 "
        "--weight-decay 0 --placement sharded --emb-optimizer sgd --emb-lr 0.5 --zero-stage 2 "
        "--bucket-mb 1 --eval-every 3 --eval-batches 2 --seed 4 --backend gloo "
        "--validate-comm --threads 2 --metrics-out m.jsonl --no-verbose --ps redis://h:1/0 "
        "--cache-rows 0 --checkpoint-dir ck --checkpoint-every 3 "
        "--checkpoint-keep 1 --resume --log-every 2 --no-progress --ngram 4 --ngram-rows 0 "
        "--ngram-splits 2 --ngram-placement hybrid --ngram-capacity 100 --ngram-max-age 5"
    )
    assert parse_args(argv.split()) == LMConfig(
        text_dir="/t", max_bytes=9, tokenizer="auto", bpe_file="/b", block_size=8, batch_size=4,
        n_layer=3, n_head=2, d_model=16, dropout=0.1, max_steps=7, lr=0.01, weight_decay=0.0,
        placement="sharded", emb_optimizer="sgd", emb_lr=0.5, zero_stage=2, bucket_mb=1.0,
        eval_every=3, eval_batches=2, seed=4, backend="gloo", validate_comm=True, threads=2,
        metrics_out="m.jsonl", verbose=False, ps="redis://h:1/0", cache_rows=0,
        checkpoint_dir="ck", checkpoint_every=3, checkpoint_keep=1,
        resume=True, log_every=2, progress=False, ngram=4, ngram_rows=0, ngram_splits=2,
        ngram_placement="hybrid", ngram_capacity=100, ngram_max_age=5,
    )  # fmt: skip
    assert parse_args(["--compression", "topk"]).compression == "topk"
    fields = set(LMConfig.__dataclass_fields__)
    for action in build_parser()._actions:
        if action.dest not in ("help", "config"):
            assert action.dest in fields and action.help, action.dest  # --help explains it


@pytest.mark.parametrize(
    ("kw", "pattern"),
    [
        (dict(max_steps=0), "max_steps must be >= 1, got 0"),
        (dict(lr=0.0), "lr must be > 0, got 0.0"),
        (dict(tokenizer="bpe"), "tokenizer must be 'byte', 'gpt2' or 'auto', got 'bpe'"),
        (dict(zero_stage=4), "zero_stage must be 0, 1, 2 or 3, got 4"),
        (dict(seed=-1), "seed must be >= 0, got -1"),
        (dict(cache_rows=5, placement="sharded"), "a cache needs placement 'hybrid'"),
        (dict(zero_stage=1, compression="fp16"), "ZeRO stage 1 reduces gradients itself"),
        (dict(ngram=0), r"ngram must be >= 1 \(1 = no n-gram tables\), got 0"),
        (dict(ngram=3, ngram_rows=0, ngram_placement="sharded"), "needs ngram_placement 'hybrid'"),
        (dict(ngram=3, ngram_capacity=9), "ngram_capacity 9 bounds dynamic n-gram tables"),
        (dict(ngram=3, ngram_splits=3), "ngram_splits must divide d_model 64"),
        (dict(ngram=3, ngram_placement="lattice"), "ngram_placement must be 'hybrid', 'sharded'"),
        (
            dict(placement="local", ngram=3, ngram_placement="local", cache_rows=5),
            "a cache needs placement 'hybrid' for the token or n-gram tables, got 'local' and",
        ),
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
    assert_same(emb, rows[idx], what="token rows", why="an unpooled lookup copies the rows")


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
    # A gate, not a rounding bound (docs/numerics.md, "Whole jobs across worker counts").
    assert losses == pytest.approx(single_process_losses, abs=2e-3)
    if zero_stage:  # AdamW state (two moments) sharded: ~1/N of the unsharded bytes per rank
        assert final["dense_optimizer_state_bytes"] <= single_state_bytes(nprocs)


# ------------------------------------------------------------ hashed n-gram input tables

NGRAM: dict[str, Any] = dict(SMALL, ngram=3, ngram_rows=4096, ngram_splits=2)


def test_ngram_one_is_the_plain_model_bit_for_bit() -> None:
    """``--ngram 1``: no n-gram tables, and the model's logits are the GPT's on the token
    rows, exactly; the n-gram options are then inert (the same losses to the bit)."""
    import torch

    from hybridrec.lm.job import LMJob
    from ps import InProcessStore

    cfg = LMConfig(**SMALL, verbose=False)  # type: ignore[arg-type]
    job = LMJob(cfg, comm.LocalGroup(), InProcessStore())
    model = job.model
    assert model.ngrams is None and [t.name for t in model.embeddings.tables] == ["token_embedding"]
    idx = torch.randint(0, 256, (3, 32), generator=torch.Generator().manual_seed(1))
    rows = model.embeddings.rows("token_embedding", torch.arange(256))  # [V, D]
    with torch.no_grad():
        assert_same(model(idx), model.gpt(rows[idx]), what="logits",
                    why="the lookup copies the rows into a tensor of the same shape, and the "
                    "same GPT runs on it")  # fmt: skip
    plain = train(cfg, comm.LocalGroup())["evals"]
    inert = LMConfig(**SMALL, verbose=False, ngram=1, ngram_rows=7, ngram_splits=2)  # type: ignore[arg-type]
    assert [e["val_loss"] for e in train(inert, comm.LocalGroup())["evals"]] == [
        e["val_loss"] for e in plain
    ]


def test_ngram_input_is_token_row_plus_ngram_rows() -> None:
    """The input vector of each position = its token row + for n = 2, 3 the sub-table rows
    of its hashed n-gram id concatenated (looked up here by hand, ``ngram_ids``)."""
    import torch

    from embedding import EmbeddingCollection, ngram_ids
    from hybridrec.lm.model import embed_tokens, ngram_config
    from ps import InProcessStore

    cfg = LMConfig(d_model=8, ngram=3, ngram_rows=50, ngram_splits=2)
    ngrams = ngram_config(cfg)
    assert ngrams is not None
    tables = [token_table(cfg, 20), *ngrams.tables()]
    ec = EmbeddingCollection(tables, store=InProcessStore())
    # Give the zero-started n-gram rows values, so a wrong lookup cannot pass.
    for t in tables[1:]:
        ec.store.push(t.name, torch.arange(50), torch.randn(50, 4))
    idx = torch.randint(0, 20, (2, 6), generator=torch.Generator().manual_seed(3))
    expect = ec.rows("token_embedding", torch.arange(20))[idx]  # [2, 6, 8]
    magnitude = expect.abs()
    for n in (2, 3):
        parts = [
            ec.rows(f"ngram{n}_{s}", torch.arange(50))[ngram_ids(idx, n, rows=50, seed=s)]
            for s in (0, 1)
        ]  # each [2, 6, 4]
        expect = expect + torch.cat(parts, dim=-1)
        magnitude = magnitude + torch.cat(parts, dim=-1).abs()
    # Three rows summed, possibly in another order: two roundings.
    tol = sum_tol(torch.float32, 2, float(magnitude.max()))
    with torch.no_grad():
        got = embed_tokens(ec, idx, ngrams)
    assert_close(got, expect, atol=tol, what="input vectors", why="a sum of 3 rows in 2 orders")


@pytest.fixture(scope="module")
def ngram_losses() -> list[float]:
    cfg = LMConfig(**NGRAM, verbose=False)  # type: ignore[arg-type]
    return [e["val_loss"] for e in train(cfg, comm.LocalGroup())["evals"]]


@pytest.mark.timeout(120)
def test_ngram_tables_train_and_log(
    tmp_path: Path, ngram_losses: list[float], single_process_losses: list[float]
) -> None:
    """With n-gram tables the loss falls below the token-only model's at equal steps;
    step lines log the n-gram rows of a batch and the store's rows moved; the summary
    gives both per step and the loss per byte."""
    out = tmp_path / "m.jsonl"
    # Without the sparse pipeline (whose rows pulled again count as moved) every distinct
    # row is moved exactly twice; the fixture ran with the default (auto: pipelined where
    # a core is free), and one worker's pipelined run is bit-exact with the unpipelined one.
    cfg = LMConfig(
        **NGRAM, verbose=False, metrics_out=str(out), log_every=10, sparse_pipeline="off"
    )  # type: ignore[arg-type]
    final = train(cfg, comm.LocalGroup())
    assert [e["val_loss"] for e in final["evals"]] == ngram_losses  # deterministic
    assert ngram_losses[-1] < single_process_losses[-1] - 0.05
    steps = [json.loads(x) for x in out.read_text().splitlines() if '"step"' in x[:20]]
    # 16 windows x 32 positions per step: at most 512 distinct ids per n-gram sub-table.
    assert steps and all(0 < r["ngram_rows"] <= 4 * 512 for r in steps)
    assert all(r["ps_rows_moved"] > 0 for r in steps)
    assert 0 < final["ngram_rows_per_step"] <= 4 * 512
    # Uncached hybrid tables: every distinct row is pulled once and pushed once per step
    # (exactly: 2 T / s and 2 (T / s) round alike, the factor 2 being exact).
    assert final["ngram_rows_moved_per_step"] == 2 * final["ngram_rows_per_step"]
    assert final["val_nats_per_byte"] == final["val_loss"]  # bytes: one token per byte


@pytest.mark.timeout(120)
def test_cached_ngram_tables_at_bounds_zero_equal_uncached(ngram_losses: list[float]) -> None:
    """The hot-row cache in front of the n-gram tables (a tenth of their rows, LFU) at
    bounds (0, 0) serves what the store holds, so training follows the uncached run;
    the rows it moves per step are fewer."""
    cfg = LMConfig(
        **NGRAM, verbose=False, cache_fraction=0.1, cache_policy="lfu", sparse_pipeline="off"
    )  # type: ignore[arg-type]
    final = train(cfg, comm.LocalGroup())
    # Bit for bit (docs/numerics.md): with one worker every push is the uncached push and
    # every reused row is refreshed from the store, so both runs call the same store kernel
    # on the same rows in the same order (the pipelined fixture too: it pools the rows the
    # unpipelined step pulls). Off here: the rows it pulls again would count as moved.
    assert [e["val_loss"] for e in final["evals"]] == ngram_losses
    assert 0 < final["cache_hit_rate"] < 1
    assert 0 < final["ngram_rows_moved_per_step"] < 2 * final["ngram_rows_per_step"]


@pytest.mark.timeout(120)
def test_dynamic_ngram_tables_hold_only_seen_ngrams() -> None:
    """``--ngram-rows 0``: dynamic tables keyed by 63-bit n-gram ids get rows only for the
    n-grams of the training batches (counted here from the same windows), and with
    ``--ngram-capacity`` never more than that many."""
    import torch

    from embedding import ngram_ids
    from hybridrec.datasets.text import (
        get_batch,
        load_corpus,
        make_tokenizer,
        split_tokens,
        tokenize,
    )
    from hybridrec.lm.job import LMJob
    from ps import InProcessStore

    small = dict(SMALL, max_steps=6, eval_every=6, ngram=3, ngram_rows=0)
    store = InProcessStore()
    job = LMJob(LMConfig(**small, verbose=False), comm.LocalGroup(), store)  # type: ignore[arg-type]
    job.close(job.trainer.fit())
    text = load_corpus(None, max_bytes=SMALL["max_bytes"]).text
    tokens = split_tokens(tokenize(text, make_tokenizer("byte", None))).train
    seen: dict[int, set[int]] = {2: set(), 3: set()}
    for step in range(6):
        x, _ = get_batch(tokens, step=step, seed=0, global_batch=16, block_size=32)
        for n in (2, 3):
            seen[n] |= set(ngram_ids(x, n, rows=None, seed=0).reshape(-1).tolist())
    stats = store.stats()
    assert stats["ngram2"]["rows"] == len(seen[2]) and stats["ngram3"]["rows"] == len(seen[3])
    assert store.spec("ngram3").dynamic
    capped = LMConfig(**small, verbose=False, ngram_capacity=300)  # type: ignore[arg-type]
    store = InProcessStore()
    job = LMJob(capped, comm.LocalGroup(), store)
    job.close(job.trainer.fit())
    assert all(store.stats()[t]["rows"] == 300 for t in ("ngram2", "ngram3"))
    assert len(seen[3]) > 300 and torch.isfinite(torch.tensor(job.trainer.evals[-1]["val_loss"]))


@pytest.mark.timeout(240)
@pytest.mark.parametrize(
    ("backend", "nprocs", "placement", "ngram_placement"),
    [
        ("mpi", 2, "hybrid", "local"),
        ("mpi", 4, "local", "hybrid"),
        ("gloo", 2, "hybrid", "sharded"),
    ],
)
def test_ngram_ranks_match_one_process(
    backend: str,
    nprocs: int,
    placement: str,
    ngram_placement: str,
    tmp_path: Path,
    ngram_losses: list[float],
) -> None:
    """N ranks with n-gram tables (replicated local or hybrid, or sharded over the ranks)
    train on the same global batches as one process, to the same losses."""
    out = tmp_path / "m.jsonl"
    args = [
        *_argv(NGRAM),
        f"--backend={backend}",
        f"--placement={placement}",
        f"--ngram-placement={ngram_placement}",
        f"--metrics-out={out}",
    ]
    text = "\n".join(run_ranks(SCRIPT, nprocs, backend, args=args, timeout=220))
    assert (
        f"n-gram tables n = 2..3: 4096 rows x 32 each, 2 sub-tables of 16 per n ({ngram_placement}"
        in text
    ), text
    final = json.loads(out.read_text().splitlines()[-1])
    assert final["world_size"] == nprocs
    # A gate, not a rounding bound (docs/numerics.md, "Whole jobs across worker counts").
    assert [e["val_loss"] for e in final["evals"]] == pytest.approx(ngram_losses, abs=2e-3)


# ------------------------------------------------------------ tensor, pipeline, ZeRO-3

MODEL_PARALLEL: dict[str, Any] = dict(NGRAM, n_layer=2, max_steps=20, eval_every=10)


@pytest.fixture(scope="module")
def model_parallel_losses() -> list[float]:
    cfg = LMConfig(**MODEL_PARALLEL, verbose=False)  # type: ignore[arg-type]
    return [e["val_loss"] for e in train(cfg, comm.LocalGroup())["evals"]]


@pytest.mark.timeout(240)
@pytest.mark.parametrize(
    ("backend", "nprocs", "options", "mesh"),
    [
        ("mpi", 2, ["--tp=2"], "dp 1 x pp 1 x tp 2"),
        ("gloo", 2, ["--pp=2", "--schedule=bidirectional"], "dp 1 x pp 2 x tp 1"),
        ("mpi", 4, ["--pp=2", "--tp=2", "--schedule=gpipe"], "dp 1 x pp 2 x tp 2"),
        ("gloo", 4, ["--pp=2", "--zero-stage=1", "--microbatches=4"], "dp 2 x pp 2 x tp 1"),
        ("mpi", 4, ["--tp=2", "--zero-stage=3", "--ngram-placement=sharded"], "dp 2 x pp 1 x tp 2"),
    ],
)
def test_model_parallel_matches_one_process(
    backend: str,
    nprocs: int,
    options: list[str],
    mesh: str,
    tmp_path: Path,
    model_parallel_losses: list[float],
) -> None:
    """Tensor parallel, pipelines (each schedule) and ZeRO-3, alone and composed on a
    mesh, with the token and n-gram tables looked up on the first stages: the same
    validation losses as one process on the global batch."""
    out = tmp_path / "m.jsonl"
    args = [*_argv(MODEL_PARALLEL), f"--backend={backend}", f"--metrics-out={out}", *options]
    text = "\n".join(run_ranks(SCRIPT, nprocs, backend, args=args, timeout=220))
    assert f"mesh {mesh}" in text, text
    final = json.loads(out.read_text().splitlines()[-1])
    assert final["world_size"] == nprocs
    losses = [e["val_loss"] for e in final["evals"]]
    # A gate, not a rounding bound (docs/numerics.md, "Whole jobs across worker counts").
    assert losses == pytest.approx(model_parallel_losses, abs=2e-3)
    assert losses[-1] < losses[0] - 1.5


@pytest.mark.parametrize(
    ("kw", "pattern"),
    [
        (dict(tp=3), "n_head 4 is not divisible by tp 3"),
        (dict(pp=3, n_layer=2), "pp 3 stages but only n_layer 2 blocks"),
        (dict(pp=3, n_layer=3, schedule="bidirectional"), "bidirectional schedule needs pp 2 or 4"),
        (dict(microbatches=-1), "microbatches must be >= 0"),
        (dict(pp=2, n_layer=2, zero_stage=3), "--zero-stage 3 with --pp 2"),
    ],
)
def test_model_parallel_options_are_checked(kw: dict[str, object], pattern: str) -> None:
    with pytest.raises(ValueError, match=pattern):
        LMConfig(**kw)  # type: ignore[arg-type]


def test_model_parallel_needs_a_mesh_that_fits() -> None:
    """Checks that need the world and the vocabulary: clear errors before any training."""
    from hybridrec.lm.job import LMJob
    from ps import InProcessStore

    def job(**kw: Any) -> None:
        LMJob(LMConfig(**{**SMALL, "verbose": False, **kw}), comm.LocalGroup(), InProcessStore())

    with pytest.raises(ValueError, match=r"--tp 2 x --pp 1 = 2 ranks per model replica does not"):
        job(tp=2)
    with pytest.raises(ValueError, match=r"16 windows each, which must be a whole multiple of"):
        job(microbatches=3)


@pytest.mark.timeout(120)
def test_zero3_checkpoint_resumes_at_stage_one(tmp_path: Path) -> None:
    """A ZeRO-3 run's checkpoint (the global optimizer state and the gathered weights)
    resumes under ZeRO stage 1 and ends where the uninterrupted run ends."""
    base = dict(MODEL_PARALLEL, max_steps=20, verbose=False, checkpoint_dir=str(tmp_path / "ck"))
    first = train(LMConfig(**{**base, "max_steps": 10, "zero_stage": 3}), comm.LocalGroup())  # type: ignore[arg-type]
    assert first["steps"] == 10
    resumed = train(LMConfig(**{**base, "zero_stage": 1, "resume": True}), comm.LocalGroup())  # type: ignore[arg-type]
    plain = train(LMConfig(**{**base, "checkpoint_dir": None}), comm.LocalGroup())  # type: ignore[arg-type]
    # Bit for bit, although the three optimizers lay the weights out differently: at one
    # worker every reduction over ranks is a copy, ZeRO-1's shard and ZeRO-3's flat buffer
    # are all the parameters back to back, and AdamW is elementwise. ATen's elementwise
    # kernels run a vectorised body (fused multiply-adds on AVX2 and AVX-512) and a scalar
    # tail, which may round differently; every dense parameter's size is a multiple of 32
    # (2 x the 16 float lanes of AVX-512, the widest body's step), so each tensor is all
    # body, a view at a multiple of 32 elements keeps its 64-byte alignment, and every
    # element gets the same operations in every layout.
    import torch

    from hybridrec.lm.job import LMJob
    from ps import InProcessStore

    job = LMJob(LMConfig(**{**base, "checkpoint_dir": None}), comm.LocalGroup(), InProcessStore())  # type: ignore[arg-type]
    sizes = [p.numel() for p in job.model.parameters()]
    assert all(n % 32 == 0 for n in sizes), sizes
    assert_same(torch.tensor(resumed["val_loss"]), torch.tensor(plain["val_loss"]),
                what="val loss", why="the same elementwise AdamW on every element")  # fmt: skip


@pytest.mark.timeout(120)
def test_default_ngram_tables_fit_a_laptop_and_the_memory_block_says_so(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """``--ngram 3`` with the default rows: the memory block printed at the start names
    the hybrid tables' size, and it stays under 0.5 GB."""
    cfg = parse_args(
        [
            "--ngram",
            "3",
            "--max-steps",
            "1",
            "--eval-every",
            "1",
            "--eval-batches",
            "1",
            "--max-bytes",
            "20000",
            "--no-progress",
            "--backend",
            "local",
        ]
    )
    train(cfg, comm.LocalGroup())
    out = capsys.readouterr().out
    (line,) = [x for x in out.splitlines() if x.strip().startswith("hybrid tables")]
    size, unit = line.split()[2:4]
    mb = float(size) * {"kB": 1e-3, "MB": 1.0, "GB": 1e3}[unit]
    assert 100 < mb < 500, line  # two tables of 256 Ki rows x 64 with Adam state
