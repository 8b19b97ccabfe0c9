"""``hybridrec export`` and :class:`hybridrec.serving.Predictor`.

* fp32 tables: the predictor's probabilities equal the training model's forward (the
  model ``hybridrec evaluate`` would load, ``eval()`` under no_grad) bit for bit: the
  same rows pooled by the same ``embedding_bag(mode="sum")`` per bag (a bag's sum runs
  over its ids in order whatever other bags share the call), then the same
  ``DLRMDense`` code on the same weights and batch shapes.
* fp16 within 1e-3 of fp32's probabilities; int8 tables in at most 0.3x the bytes, test
  AUC within 0.003 of fp32's.
* A hybrid-placement run behind a cache exports too (its rows read from the store).
* Memory-mapped tables, with and without a hot-row cache, and rows loaded into a real
  redis-server score as the in-memory tables bit for bit: the same float32 rows (fp16
  and int8 decoded by one formula), summed per bag in the same order.
* Tampered or truncated files, unknown features, ids out of a table's range and dense
  features of the wrong dtype or shape are refused with errors naming them.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import comm
from embedding import KeyedJaggedIds
from hybridrec.cli import commands
from hybridrec.cli.evaluate import saved_options, saved_run
from hybridrec.cli.export import main as export_main
from hybridrec.cli.options import parse_config
from hybridrec.datasets.ctr import Batch
from hybridrec.dlrm.config import DLRMJobConfig
from hybridrec.dlrm.job import DLRMJob, train
from hybridrec.serving import ChecksumError, Predictor, load_into_redis
from hybridrec.train.click_metrics import roc_auc
from ps import InProcessStore
from redis_server import redis_cluster, redis_server
from tolerance import assert_same

# dim 64: an int8 row (D codes + 8 bytes of scale and bias) is 0.28 of a float32 row.
SMALL = dict(
    data="synthetic", synthetic_samples=4_000, synthetic_rows=200, batch_size=100, epochs=2,
    dim=64, bottom_mlp=[16, 64], top_mlp=[16, 1], verbose=False, progress=False,
)  # fmt: skip


def _export(ckpt: Path, out: Path, tables: str = "fp32") -> Predictor:
    export_main(["--checkpoint", str(ckpt), "--out", str(out), "--tables", tables,
                 "--no-verbose", "--no-progress"])  # fmt: skip
    return Predictor(out)


def _training_model(ckpt: Path) -> DLRMJob:
    """The job ``hybridrec evaluate`` builds for ``ckpt``, its saved model loaded."""
    run = saved_run(str(ckpt), None, [])  # type: ignore[arg-type]  # a checkpoint is given
    cfg = parse_config(DLRMJobConfig, [], "", base=saved_options(run.meta["config"], DLRMJobConfig))
    job = DLRMJob(cfg, comm.LocalGroup(), InProcessStore(), saved_config=run.meta["config"])
    job.load_saved(run.model)
    job.model.eval()
    return job


def _test_batches(job: DLRMJob) -> list[Batch]:
    return list(job.source.eval_batches("test"))


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    tmp = tmp_path_factory.mktemp("export")
    ckpt = tmp / "ckpt"
    result = train(DLRMJobConfig(**SMALL, checkpoint_dir=str(ckpt)), comm.LocalGroup())
    job = _training_model(ckpt)
    batches = _test_batches(job)
    with torch.no_grad():
        probs = torch.cat([torch.sigmoid(job.model(b)) for b in batches])
    labels = torch.cat([b.labels for b in batches])
    preds = {t: _export(ckpt, tmp / t, t) for t in ("fp32", "fp16", "int8")}
    return dict(tmp=tmp, ckpt=ckpt, result=result, batches=batches, probs=probs,
                labels=labels, preds=preds)  # fmt: skip


def _scores(pred: Predictor, batches: list[Batch]) -> torch.Tensor:
    return torch.cat([pred.predict(b) for b in batches])


@pytest.mark.timeout(300)
def test_fp32_export_equals_the_training_forward_bit_for_bit(run: dict[str, Any]) -> None:
    got = _scores(run["preds"]["fp32"], run["batches"])
    assert got.shape == (400,)
    assert_same(
        got, run["probs"], what="fp32 export vs training forward",
        why="the same rows, the same embedding_bag per bag, the same DLRMDense code",
    )  # fmt: skip
    # The model exported is the one the run tested: its test AUC.
    auc = roc_auc(run["labels"].numpy(), got.double().numpy())
    assert abs(auc - run["result"]["test_auc"]) < 1e-9


@pytest.mark.timeout(300)
def test_fp16_and_int8_tables(run: dict[str, Any]) -> None:
    fp32, fp16, int8 = (run["preds"][t] for t in ("fp32", "fp16", "int8"))
    p32 = _scores(fp32, run["batches"])
    p16 = _scores(fp16, run["batches"])
    assert float((p16 - p32).abs().max()) <= 1e-3
    assert fp16.table_bytes() == fp32.table_bytes() // 2
    assert int8.table_bytes() <= 0.3 * fp32.table_bytes()
    p8 = _scores(int8, run["batches"])
    y = run["labels"].numpy()
    auc32, auc8 = roc_auc(y, p32.double().numpy()), roc_auc(y, p8.double().numpy())
    assert abs(auc8 - auc32) <= 0.003, (auc8, auc32)
    assert auc32 > 0.6  # a model that learned something, so the comparison means something


@pytest.mark.timeout(300)
def test_export_holds_no_pickle_and_the_dense_program_matches(run: dict[str, Any]) -> None:
    folder = run["tmp"] / "int8"
    manifest = json.loads((folder / "manifest.json").read_text())
    assert manifest["format"] == "hybridrec-serving/1"
    assert set(manifest["versions"]) >= {"hybridrec", "torch"}
    for name, doc in manifest["files"].items():
        assert (folder / name).stat().st_size == doc["bytes"]
        assert name.endswith((".npy", ".json")) or name == "dense_program.pt2", name
        if name.endswith(".npy"):
            np.load(folder / name, allow_pickle=False)  # refuses object arrays
    table = next(iter(manifest["tables"].values()))
    assert table["dtype"] == "int8" and table["bytes_per_row"] == 64 + 8
    # The torch.export program (for consumers outside hybridrec) scores as the predictor.
    assert manifest["dense_program"]["file"] == "dense_program.pt2", manifest["dense_program"]
    program = torch.export.load(str(folder / "dense_program.pt2")).module()
    pred, batch = run["preds"]["int8"], run["batches"][0]
    pooled = torch.stack(
        [pred.tables[f["table"]].pool(batch.sparse.key_slice(f["name"]), f["pooling"])
         for f in pred.features], dim=1,
    )  # fmt: skip
    want = pred.logits(batch)
    with torch.no_grad():
        got = program(batch.dense, pooled)
    assert float((got - want).abs().max()) < 1e-4  # the torch interaction, another order


@pytest.mark.timeout(300)
def test_hybrid_placement_with_a_cache_exports(tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    small = dict(SMALL, dim=8, bottom_mlp=[16, 8], epochs=1, synthetic_samples=2_000)
    extra = dict(placement="hybrid", cache_rows=64, read_bound=2, write_bound=2)
    train(DLRMJobConfig(**small, **extra, checkpoint_dir=str(ckpt)), comm.LocalGroup())
    pred = _export(ckpt, tmp_path / "out")
    job = _training_model(ckpt)  # hybrid tables behind the cache, settled: the store's rows
    batches = _test_batches(job)
    with torch.no_grad():
        want = torch.cat([torch.sigmoid(job.model(b)) for b in batches])
    got = _scores(pred, batches)
    # Hybrid tables pool the pulled unique rows in another order than a local
    # embedding_bag: the sums of <= 1 row per bag here are exact, but the dense part
    # may take another kernel path; a few float32 roundings of O(1) probabilities.
    assert float((got - want).abs().max()) <= 1e-6


@pytest.mark.timeout(120)
def test_tampered_or_truncated_files_are_refused(run: dict[str, Any], tmp_path: Path) -> None:
    import shutil

    folder = tmp_path / "copy"
    shutil.copytree(run["tmp"] / "fp16", folder)
    rows = folder / "tables" / "t000.rows.npy"
    data = bytearray(rows.read_bytes())
    data[-1] ^= 0xFF  # one row value changed, size kept
    rows.write_bytes(bytes(data))
    with pytest.raises(ChecksumError, match=r"t000\.rows\.npy: sha256 .* changed after export"):
        Predictor(folder)
    rows.write_bytes(bytes(data[:-2]))
    with pytest.raises(ChecksumError, match=r"t000\.rows\.npy: \d+ bytes, the manifest says"):
        Predictor(folder)
    (folder / "manifest.json").unlink()
    with pytest.raises(FileNotFoundError, match="not a model export"):
        Predictor(folder)


@pytest.mark.timeout(120)
def test_bad_inputs_get_clear_errors(run: dict[str, Any]) -> None:
    pred = run["preds"]["fp32"]
    batch = run["batches"][0]
    sp = batch.sparse
    first = pred.feature_names[0]
    renamed = KeyedJaggedIds(["nope", *sp.keys[1:]], sp.ids, sp.lengths)
    with pytest.raises(ValueError, match="unknown feature 'nope'; this model's features are"):
        pred.predict(renamed, batch.dense)
    ids = sp.ids.clone()
    ids[0] = 200  # the tables have 200 rows
    with pytest.raises(ValueError, match=rf"feature '{first}': id 200 is out of range for "
                       rf"table '{first}', whose ids are \[0, 200\)"):  # fmt: skip
        pred.predict(KeyedJaggedIds(sp.keys, ids, sp.lengths), batch.dense)
    ids[0] = -3
    with pytest.raises(ValueError, match="id -3 is out of range"):
        pred.predict(KeyedJaggedIds(sp.keys, ids, sp.lengths), batch.dense)
    with pytest.raises(
        TypeError, match="dense features must be a float32 tensor, got torch.float64"
    ):
        pred.predict(sp, batch.dense.double())
    with pytest.raises(ValueError, match=r"dense features must be \[B, num_dense\]"):
        pred.predict(sp, batch.dense[:, :3])
    with pytest.raises(ValueError, match="lacks the features"):
        pred.predict(sp.select(sp.keys[1:]), batch.dense)
    with pytest.raises(ValueError, match="no data encoders"):
        pred.predict_rows([(0.0, [], [])])


@pytest.mark.timeout(60)
def test_export_help_and_errors(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    with pytest.raises(SystemExit) as info:
        commands.main(["export", "--help"])
    assert info.value.code == 0
    out = capsys.readouterr().out
    assert "--tables {fp32,fp16,int8}" in out and "--out" in out
    with pytest.raises(SystemExit) as info:
        commands.main(["export", "--checkpoint", str(tmp_path)])
    assert info.value.code == 2
    assert "neither a checkpoint" in capsys.readouterr().err


@pytest.mark.timeout(300)
def test_mapped_tables_and_hot_rows_score_as_in_memory(run: dict[str, Any]) -> None:
    batches = run["batches"]
    for t in ("fp32", "int8"):
        folder = run["tmp"] / t
        in_memory = run["preds"][t]
        assert in_memory.tables_in_memory  # 26 x 200 rows fit any budget
        want = _scores(in_memory, batches)
        mapped = Predictor(folder, memory_budget=0)  # over the budget: memory-mapped
        assert not mapped.tables_in_memory
        assert torch.equal(_scores(mapped, batches), want), t
        hot = Predictor(folder, tables_in_memory=False, hot_rows=32)
        assert torch.equal(_scores(hot, batches), want), t
        assert torch.equal(_scores(hot, batches), want), t  # the second pass: mostly hits
        stats = hot.cache_stats()
        assert len(stats) == len(in_memory.tables)
        assert sum(s["hits"] for s in stats.values()) > 0
        assert all(s["slots"] == 32 for s in stats.values())
    with pytest.raises(ValueError, match="hot_rows must be an int > 0"):
        Predictor(run["tmp"] / "fp32", tables_in_memory=False, hot_rows=0)


@pytest.mark.timeout(300)
def test_rows_from_redis_score_as_in_memory(run: dict[str, Any]) -> None:
    batches = run["batches"]
    secret = "s3rv1ng-pw"
    with redis_server(password=secret) as srv:
        url = f"redis://:{secret}@{srv.host}:{srv.port}/0"
        with pytest.raises(ValueError, match="no table .* under prefix 'serving'") as info:
            Predictor(run["tmp"] / "fp32", redis_url=url)
        assert secret not in str(info.value) and "***" in str(info.value)
        for t in ("fp32", "int8"):  # int8: decoded into float32 rows on the way in
            folder = run["tmp"] / t
            names = load_into_redis(folder, url, prefix=f"serving-{t}")
            assert names == list(run["preds"][t].tables)
            pred = Predictor(folder, redis_url=url, redis_prefix=f"serving-{t}")
            try:
                assert not pred.tables_in_memory and pred.redis is not None
                got = _scores(pred, batches)
            finally:
                pred.close()
            assert torch.equal(got, _scores(run["preds"][t], batches)), t
        # Another model's tables under the prefix: refused, naming the table.
        small = dict(SMALL, synthetic_rows=100, synthetic_samples=1_000, epochs=1)
        other = run["tmp"] / "other"
        train(DLRMJobConfig(**small, checkpoint_dir=str(other / "ckpt")), comm.LocalGroup())
        _export(other / "ckpt", other / "fp32")
        load_into_redis(other / "fp32", url, prefix="serving-other")
        with pytest.raises(ValueError, match="has 100 rows of dim 64, the export 200") as info:
            Predictor(run["tmp"] / "fp32", redis_url=url, redis_prefix="serving-other")
        assert secret not in str(info.value)


@pytest.mark.timeout(300)
def test_rows_from_a_redis_cluster_score_as_in_memory(run: dict[str, Any]) -> None:
    """The same tables on a 3-master Redis Cluster (``?cluster=1``, as ``--ps`` takes
    it): the rows spread over the masters, the scores those of the files bit for bit."""
    with redis_cluster(3) as cluster:
        url = f"redis://{cluster.host}:{cluster.port}/0?cluster=1"
        folder = run["tmp"] / "fp16"
        load_into_redis(folder, url, prefix="serving-c")
        keys = [n.client().dbsize() for n in cluster.nodes]
        assert all(k > 0 for k in keys), keys  # every master holds some of the rows
        pred = Predictor(folder, redis_url=url, redis_prefix="serving-c")
        try:
            got = _scores(pred, run["batches"])
        finally:
            pred.close()
        assert torch.equal(got, _scores(run["preds"]["fp16"], run["batches"]))


@pytest.mark.timeout(300)
def test_raw_tabular_rows_score_as_the_run_encodes_them(tmp_path: Path) -> None:
    """``predict_rows`` on raw rows of a file equals the training model on the reader's
    batches of it: the same saved encoders, one batch each way, the same model."""
    from hybridrec.cli.evaluate import job_config
    from hybridrec.dlrm.evaluate import predictions
    from tabular_clicks import CLICKS_SCHEMA, write_clicks

    users = [f"u{i}" for i in range(20)]
    write_clicks(tmp_path / "train.csv", 800, 1, users)
    write_clicks(tmp_path / "new.csv", 120, 2, [*users, "unseen"])
    (tmp_path / "schema.json").write_text(json.dumps(CLICKS_SCHEMA))
    ckpt = tmp_path / "ckpt"
    cfg = DLRMJobConfig(
        **{**SMALL, "data": "tabular"}, data_path=[str(tmp_path / "train.csv")],
        schema=str(tmp_path / "schema.json"), checkpoint_dir=str(ckpt), keep_best=False,
    )  # fmt: skip
    train(cfg, comm.LocalGroup())
    pred = _export(ckpt, tmp_path / "model")
    lines = (tmp_path / "new.csv").read_text().splitlines()[1:]
    rows = []
    for line in lines:
        label, age, user, item = line.split(",")
        rows.append((float(label), [float(age)], [[user], [item]]))
    got = pred.predict_rows(rows)  # [120]
    run = saved_run(str(ckpt), None, [])  # type: ignore[arg-type]
    cls, job_cfg = job_config(run, ["--data-test-path", str(tmp_path / "new.csv")], "test")
    job = cls(job_cfg, comm.LocalGroup(), InProcessStore(), saved_config=run.meta["config"])
    job.load_saved(run.model)
    want, _, _ = predictions(job.model, job.source.eval_batches("test"), job.group, False,
                             job.feed)  # fmt: skip
    assert_same(got, want, what="raw rows vs the reader's batches",
                why="the same encoders and model on one batch of the same rows")  # fmt: skip


@pytest.mark.timeout(300)
def test_dynamic_tables_export_their_ids(tmp_path: Path) -> None:
    """A Criteo run with dynamic tables (rows made on first sight): the export keeps each
    table's ids, scores the validation lines as the training model does, and an id never
    trained reads as the table's initial row, as the store would give it."""
    import random

    from criteo_fixture import write_criteo_fixture
    from hybridrec.datasets.criteo import NUM_CAT, NUM_INT

    rng = random.Random(5)

    def line() -> list[str]:
        ints = [str(rng.randint(0, 40)) for _ in range(NUM_INT)]
        return [
            str(rng.randint(0, 1)),
            *ints,
            *(f"{rng.getrandbits(7):08x}" for _ in range(NUM_CAT)),
        ]

    write_criteo_fixture(tmp_path / "day0.tsv", [line() for _ in range(500)])
    write_criteo_fixture(tmp_path / "day1.tsv", [line() for _ in range(150)])
    ckpt = tmp_path / "ckpt"
    cfg = DLRMJobConfig(
        **{**SMALL, "data": "criteo", "epochs": 1}, criteo_path=[str(tmp_path / "day0.tsv")],
        criteo_val_path=[str(tmp_path / "day1.tsv")], criteo_rows=0, placement="hybrid",
        checkpoint_dir=str(ckpt), keep_best=False,
    )  # fmt: skip
    train(cfg, comm.LocalGroup())
    pred = _export(ckpt, tmp_path / "model")
    assert any((tmp_path / "model" / "tables").glob("*.ids.npy"))
    job = _training_model(ckpt)
    batches = list(job.source.eval_batches("val"))
    with torch.no_grad():
        want = torch.cat([torch.sigmoid(job.model(b)) for b in batches])
    got = torch.cat([pred.predict(b) for b in batches])
    why = "the same rows (trained or initial) summed per bag in the same order"
    assert_same(got, want, what="dynamic tables' export vs training forward", why=why)
