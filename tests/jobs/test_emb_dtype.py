"""``--emb-dtype`` / ``--emb-dtype-of``: the jobs' tables stored as fp32, fp16 or bf16 rows.

* the options parse into every job's ``TableConfig``s (DLRM, the GPT's token and n-gram
  tables, the sequence job's item table), from the command line and a config file;
* a bad value or an override of a table the job does not have is one line naming the
  table, the value and the choices;
* one-process DLRM runs with bf16 rows, local and hybrid (in-process store), and GPT
  and sequence runs with bf16 tables in the store, against the same runs with fp32 rows;
* a checkpoint of fp32 rows resumed with bf16 rows (local, hybrid, sharded): the run goes
  on, says in one line that the rows convert, and holds the saved rows rounded to bf16
  (against torch's own conversion of the fp32 run's rows); evaluated with other types,
  the same line;
* the bytes-per-row table of docs/embedding.md against ``ps.TableSpec.row_bytes``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

import comm
import ps
from hybridrec.checkpoint.row_dtypes import converted_rows
from hybridrec.cli import commands
from hybridrec.cli.errors import show_tracebacks
from hybridrec.cli.evaluate import main as evaluate_main
from hybridrec.cli.options import parse_config
from hybridrec.dlrm.config import DLRMJobConfig
from hybridrec.dlrm.data import Feature
from hybridrec.dlrm.job import DLRMJob, resolve_dtypes
from hybridrec.dlrm.job import parse_args as dlrm_args
from hybridrec.dlrm.model import dlrm_tables
from hybridrec.launch.existing_tables import prepare_tables
from hybridrec.launch.job_cache import with_row_dtypes
from hybridrec.lm.config import LMConfig
from hybridrec.lm.job import LMJob
from hybridrec.lm.model import input_tables, ngram_config
from hybridrec.seq.config import SeqConfig
from hybridrec.seq.job import SeqJob
from hybridrec.seq.model import item_table
from ps import InProcessStore
from resume_runs import losses

FEATURES = [Feature("user", 40), Feature("item", 60), Feature("genre", 20, multi=True)]
TINY = [
    "--data", "synthetic", "--synthetic-samples", "400", "--synthetic-rows", "50",
    "--batch-size", "50", "--backend", "local", "--no-progress",
]  # fmt: skip
RUN = dict(
    data="synthetic", synthetic_samples=1_500, synthetic_rows=200, batch_size=100, epochs=1,
    dim=8, bottom_mlp=[16, 8], top_mlp=[16, 1], progress=False, log_every=1, backend="local",
)  # fmt: skip


# ---------------------------------------------------------------- the options


def test_dlrm_options_give_each_table_its_dtype() -> None:
    cfg = dlrm_args(["--emb-dtype", "bf16", "--emb-dtype-of", "item=fp16", "genre=fp32"])
    dtypes = resolve_dtypes(cfg, FEATURES)
    assert dtypes == {"user": "bf16", "item": "fp16", "genre": "fp32"}
    tables = dlrm_tables(FEATURES, dim=8, emb_lr=0.1, dtypes=dtypes)
    assert [(t.name, t.dtype, t.to_spec().dtype) for t in tables] == [
        ("user", "bf16", "bf16"), ("item", "fp16", "fp16"), ("genre", "fp32", "fp32")
    ]  # fmt: skip
    plain = dlrm_tables(FEATURES, dim=8, emb_lr=0.1, dtypes=resolve_dtypes(dlrm_args([]), FEATURES))
    assert {t.dtype for t in plain} == {"fp32"}  # the default: the rows as before


def test_gpt_token_and_ngram_tables_take_the_dtype() -> None:
    cfg = LMConfig(d_model=8, ngram=3, ngram_splits=2, emb_dtype="fp16",
                   emb_dtype_of=["ngram3_1=bf16", "token_embedding=fp32"])  # fmt: skip
    tables = input_tables(cfg, 50, ngram_config(cfg))
    assert {t.name: t.dtype for t in tables} == {
        "token_embedding": "fp32", "ngram2_0": "fp16", "ngram2_1": "fp16",
        "ngram3_0": "fp16", "ngram3_1": "bf16",
    }  # fmt: skip
    only = input_tables(LMConfig(d_model=8, emb_dtype="bf16"), 50, None)
    assert [(t.name, t.dtype) for t in only] == [("token_embedding", "bf16")]


def test_sequence_item_table_takes_the_dtype() -> None:
    cfg = SeqConfig(emb_dtype_of=["items=bf16"])
    (table,) = with_row_dtypes(cfg, [item_table(cfg, 30)])
    assert (table.name, table.dtype, table.to_spec().dtype) == ("items", "bf16", "bf16")


def test_config_file_keys(tmp_path: Path) -> None:
    path = tmp_path / "run.toml"
    path.write_text('emb-dtype = "fp16"\nemb_dtype_of = ["user=bf16"]\n', encoding="utf-8")
    cfg = parse_config(DLRMJobConfig, ["--config", str(path)], "t")
    assert resolve_dtypes(cfg, FEATURES) == {"user": "bf16", "item": "fp16", "genre": "fp16"}
    # the command line over the file
    cfg = parse_config(DLRMJobConfig, ["--config", str(path), "--emb-dtype", "fp32"], "t")
    assert resolve_dtypes(cfg, FEATURES)["item"] == "fp32"


# ---------------------------------------------------------------- errors


@pytest.fixture
def _no_tracebacks() -> Any:
    show_tracebacks(False)
    yield
    show_tracebacks(False)


@pytest.mark.usefixtures("_no_tracebacks")
@pytest.mark.parametrize(
    ("argv", "words"),
    [
        (["--emb-dtype-of", "user=fp8"],
         ["--emb-dtype-of", "table 'user'", "fp32, fp16, bf16", "'fp8'"]),
        (["--emb-dtype-of", "user"], ["--emb-dtype-of", "TABLE=fp32|fp16|bf16", "'user'"]),
        (["--emb-dtype", "int8"], ["--emb-dtype", "'int8'", "'fp32', 'fp16', 'bf16'"]),
        # known only once the data is read: the job stops before it builds a table
        (["--emb-dtype-of", "nope=bf16"], ["nope=bf16", "no table 'nope'", "cat0, cat1"]),
    ],
)  # fmt: skip
def test_bad_values_are_one_line_naming_table_value_and_choices(
    argv: list[str], words: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as info:
        commands.main(["train-dlrm", *TINY, *argv])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1 and err.startswith("hybridrec: error: "), err
    for word in words:
        assert word in err, (word, err)


def test_an_override_of_another_jobs_table_names_the_tables() -> None:
    cfg = LMConfig(d_model=8, emb_dtype_of=["items=bf16"])
    with pytest.raises(ValueError, match=r"emb_dtype_of items=bf16: no table 'items'; the tables "
                       r"are token_embedding$"):  # fmt: skip
        input_tables(cfg, 50, None)


def test_a_store_table_of_another_type_names_both_types() -> None:
    """A shared store (Redis) keeps its tables' types: reusing one with another type is
    refused naming both, and the way to convert it from a checkpoint."""
    store = InProcessStore()
    (table,) = dlrm_tables(FEATURES[:1], dim=8, emb_lr=0.1, dtypes={"user": "fp32"})
    store.create_table(table.to_spec())
    narrow = dlrm_tables(FEATURES[:1], dim=8, emb_lr=0.1, dtypes={"user": "bf16"})[0].to_spec()
    with pytest.raises(ValueError) as info:
        prepare_tables(store, [narrow], comm.LocalGroup(), "reuse")
    msg = str(info.value)
    assert "table 'user'" in msg and "dtype 'fp32' vs 'bf16'" in msg, msg
    assert "--resume --existing-tables replace loads the checkpoint's rows" in msg, msg
    assert prepare_tables(store, [narrow], comm.LocalGroup(), "replace") == []
    assert "user" not in store.tables()  # dropped: the collection creates it as bf16


# ---------------------------------------------------------------- runs


def _run(tmp_path: Path, name: str, **extra: Any) -> tuple[DLRMJob, dict[str, Any], InProcessStore]:
    store = InProcessStore()
    cfg = DLRMJobConfig(**{**RUN, "metrics_out": str(tmp_path / f"{name}.jsonl"), **extra})
    job = DLRMJob(cfg, comm.LocalGroup(), store)
    return job, job.close(job.trainer.fit()), store


@pytest.mark.timeout(240)
@pytest.mark.parametrize("placement", ["local", "hybrid"])
def test_dlrm_trains_bf16_rows(placement: str, tmp_path: Path) -> None:
    """The run completes with bf16 rows where the placement keeps them; its losses follow
    the fp32 run's. A gate, not a rounding bound: each update is rounded to bf16's 8
    significant bits (stochastically, so unbiased), which moves a logit by far less than
    0.01 over these 12 steps (measured: under 1e-3)."""
    _, want, _ = _run(tmp_path, "fp32", placement=placement)
    job, got, store = _run(tmp_path, "bf16", placement=placement, emb_dtype="bf16")
    assert got["steps"] == want["steps"] == 12
    base, narrow = losses(tmp_path / "fp32.jsonl"), losses(tmp_path / "bf16.jsonl")
    assert sorted(base) == sorted(narrow) == list(range(1, 13))
    assert all(abs(narrow[s] - base[s]) < 0.01 for s in base), (narrow, base)
    assert narrow != base  # the rows were rounded: not the fp32 run again
    ids = torch.arange(200)
    if placement == "hybrid":
        assert store.spec("cat0").dtype == "bf16"
        rows = store.pull("cat0", ids).rows  # float32, widened exactly
    else:
        state = job.model.embeddings.state_dict()
        assert state["local.cat0.weight"].dtype == torch.bfloat16
        rows = state["local.cat0.weight"].float()
    assert torch.equal(rows, rows.to(torch.bfloat16).float())  # every value a bf16 one
    memory = got["memory"]["parts"][f"{placement}_tables"]
    assert memory["dtypes"] == ["bf16"] and memory["weights_bytes"] == 26 * 200 * 8 * 2


LM = dict(
    max_bytes=400_000, block_size=32, batch_size=16, n_layer=1, n_head=2, d_model=32,
    max_steps=30, eval_every=15, eval_batches=2, ngram=2, ngram_rows=4096, verbose=False,
    progress=False,
)  # fmt: skip
SEQ = dict(
    data="synthetic", synthetic_items=300, synthetic_users=96, synthetic_length=14,
    synthetic_zipf=0.6, max_seq_len=12, dim=16, n_layer=1, n_head=2, batch_size=16, epochs=3,
    patience=0, lr=1e-2, emb_lr=1e-2, eval_batch_size=40, dropout=0.0, verbose=False,
    progress=False, placement="hybrid", batch_unit="users", train_context=0,
)  # fmt: skip


@pytest.mark.timeout(240)
def test_gpt_and_sequence_jobs_train_bf16_rows() -> None:
    """The GPT's token and n-gram tables and the sequence job's item table in bf16, in
    the in-process store: the runs complete and follow the fp32 runs (a gate, as for
    DLRM: rounding to 8 significant bits per update, unbiased; measured 2e-4 on the
    validation loss and 3e-4 on the epoch losses)."""
    results: dict[str, Any] = {}
    for dtype in ("fp32", "bf16"):
        store = InProcessStore()
        lm = LMJob(LMConfig(**LM, emb_dtype=dtype), comm.LocalGroup(), store)  # type: ignore[arg-type]
        got = lm.close(lm.trainer.fit())
        assert {store.spec(t).dtype for t in ("token_embedding", "ngram2")} == {dtype}
        assert got["memory"]["parts"]["hybrid_tables"]["dtypes"] == [dtype]
        results["lm", dtype] = got["val_loss"]
        store = InProcessStore()
        seq = SeqJob(SeqConfig(**SEQ, emb_dtype=dtype), comm.LocalGroup(), store)  # type: ignore[arg-type]
        got = seq.close(seq.trainer.fit())
        assert store.spec("items").dtype == dtype
        results["seq", dtype] = [e["train_loss"] for e in got["epochs"]]
    assert abs(results["lm", "bf16"] - results["lm", "fp32"]) < 0.02, results
    assert len(results["seq", "bf16"]) == len(results["seq", "fp32"]) == 3
    for narrow, wide in zip(results["seq", "bf16"], results["seq", "fp32"], strict=True):
        assert abs(narrow - wide) < 0.02, results


def _rows(job: DLRMJob, store: InProcessStore, table: str) -> torch.Tensor:
    """A table's rows as float32 ``[200, 8]``, wherever the job keeps them."""
    if job.model.embeddings.hybrid is not None:
        return store.pull(table, torch.arange(200)).rows
    state = job.model.embeddings.state_dict()
    (key,) = [k for k in state if k.endswith(f".{table}.weight")]
    return state[key].float()


@pytest.mark.timeout(240)
@pytest.mark.parametrize("placement", ["local", "hybrid", "sharded"])
def test_fp32_checkpoint_resumed_as_bf16(
    placement: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The fp32 run's checkpoint at step 6, resumed with ``--emb-dtype bf16``: first with
    nothing left to train, so the rows are the checkpoint's: torch's conversion of the
    fp32 run's rows (round to nearest, as every placement loads them); then on to step
    12, whose losses follow the fp32 run's (the gate of :func:`test_dlrm_trains_bf16_rows`)."""
    ck = tmp_path / "ck"
    stop = dict(placement=placement, checkpoint_dir=str(ck), max_steps=6)
    job, first, store = _run(tmp_path, "a", **stop)
    saved = {t: _rows(job, store, t) for t in ("cat0", "cat25")}
    capsys.readouterr()
    job, again, store = _run(tmp_path, "b", **stop, resume=True, emb_dtype="bf16")
    out = capsys.readouterr().out
    assert again["already_finished"] and again["steps"] == first["steps"] == 6
    lines = [line for line in out.splitlines() if "converted" in line]
    assert lines == [
        f"resuming {ck / 'step-00000006'}: the embedding rows are converted as they load: "
        "cat0, cat1, cat2, cat3 and 22 more fp32 -> bf16"
    ], out
    for table, rows in saved.items():
        assert torch.equal(_rows(job, store, table), rows.to(torch.bfloat16).float()), table
    if placement == "hybrid":
        assert store.spec("cat0").dtype == "bf16"
    assert not list(ck.rglob(".rows-as-*"))  # the converted copy of a store is gone
    _run(tmp_path, "a", placement=placement, checkpoint_dir=str(ck), resume=True,
         emb_dtype="bf16")  # fmt: skip
    _run(tmp_path, "full", placement=placement)
    got, want = losses(tmp_path / "a.jsonl"), losses(tmp_path / "full.jsonl")
    assert sorted(got) == sorted(want) == list(range(1, 13))
    assert all(got[s] == want[s] for s in range(1, 7))  # the fp32 steps, as they were
    assert all(abs(got[s] - want[s]) < 0.01 for s in range(7, 13)), (got, want)


@pytest.mark.timeout(240)
def test_evaluate_with_other_row_types_says_so(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    ck = tmp_path / "ck"
    _run(tmp_path, "a", placement="hybrid", checkpoint_dir=str(ck))
    capsys.readouterr()
    evaluate_main(["--checkpoint", str(ck), "--emb-dtype-of", "cat3=fp16", "--split", "val"])
    out = capsys.readouterr().out
    assert "the embedding rows are converted as they load: cat3 fp32 -> fp16" in out, out
    assert "val AUC" in out
    # with the run's own types nothing converts: no line
    evaluate_main(["--checkpoint", str(ck), "--split", "val"])
    assert "converted" not in capsys.readouterr().out
    assert not list(ck.rglob(".rows-as-*"))


def test_conversion_line_of_checkpoints_without_types() -> None:
    """A run configuration without ``row_dtypes`` was saved before rows had a type: fp32."""
    now = {"user": "fp16", "item": "fp32", "genre": "bf16"}
    assert converted_rows({"job": "dlrm"}, now) == (
        "the embedding rows are converted as they load: user fp32 -> fp16; genre fp32 -> bf16"
    )
    assert converted_rows(None, now) is None  # a fresh run: nothing loads
    assert converted_rows({"row_dtypes": now}, now) is None  # the same types
    saved = {"row_dtypes": {"user": "bf16", "item": "fp32"}}  # no genre: the load says so
    assert converted_rows(saved, now) == (
        "the embedding rows are converted as they load: user bf16 -> fp16"
    )


def test_the_bytes_per_row_table_of_the_docs() -> None:
    """docs/embedding.md's bytes per row at dim 64, against ``ps.TableSpec.row_bytes``."""
    doc = Path(__file__).resolve().parents[2] / "docs" / "embedding.md"
    text = doc.read_text(encoding="utf-8")
    optimizers = {
        "`SGD`": ps.SGD(lr=0.1), "`SGD(momentum=0.9)`": ps.SGD(lr=0.1, momentum=0.9),
        "`RowWiseAdagrad`": ps.RowWiseAdagrad(lr=0.1), "`Adagrad`": ps.Adagrad(lr=0.1),
        "`Adam`": ps.Adam(lr=0.1), "`FTRL`": ps.FTRL(alpha=0.1),
    }  # fmt: skip
    rows = {}
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip("|").split("|")]
        if cells[0] in optimizers:
            rows[cells[0]] = cells[1:]
    assert sorted(rows) == sorted(optimizers)
    for name, opt in optimizers.items():
        want = {
            d: ps.TableSpec(name="t", num_rows=1, dim=64, optimizer=opt, dtype=d).row_bytes
            for d in ("fp32", "fp16", "bf16")
        }  # type: ignore[arg-type]
        saved = round(100 * (1 - want["fp16"] / want["fp32"]))
        assert rows[name] == [
            str(opt.state_dim(64)), str(want["fp32"]), str(want["fp16"]), str(want["bf16"]),
            f"{saved} %",
        ], name  # fmt: skip
