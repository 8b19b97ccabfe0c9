"""One save for a whole model (hybridrec.checkpoint.model_state): what it restores, what it checks.

* At N -> M workers (tests/jobs/ranks/model_checkpoint.py under mpirun, a shared MPI store):
  saved at 2 workers, loaded at 1, 2 and 4, every placement in one model.
* In one process: a resumed run repeats the saving run bit for bit with a cache whose
  copies lag the store (read and write bounds 2) and a top-k codec; dropping the
  restored cache contents or the codec residuals changes the losses, so both matter.
* Structure checks, local <-> sharded placements, and shared-table creation.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Literal

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import cache
import comm
import ps
from dense import DataParallel, ZeroOptimizer
from embedding import EmbeddingCollection, KeyedJaggedIds, RowWiseAdagrad, TableConfig
from embedding.hybrid import create_table_once, create_tables
from hybridrec.checkpoint.model_state import load_model, save_model
from multiproc import run_ranks
from tolerance import assert_same

ROWS, DIM, BATCH = 30, 4, 8
Placement = Literal["local", "hybrid", "sharded"]


@pytest.mark.timeout(600)
def test_saved_at_two_workers_loads_at_one_two_and_four(tmp_path: Path) -> None:
    # mpirun -n W+1: the last rank serves the shared store.
    # The save run also loads at its own count (2 -> 2, bit for bit) into fresh modules.
    out = run_ranks("model_checkpoint.py", 3, "mpi", ["save", str(tmp_path)], timeout=200)
    assert out[0].count("ok worker save at 2") == 2, out[0]
    for workers in (1, 4):
        outs = run_ranks(
            "model_checkpoint.py", workers + 1, "mpi", ["load", str(tmp_path)], timeout=200
        )
        assert outs[0].count(f"ok worker load at {workers}") == workers, outs[0]
    doc = json.loads((tmp_path / "topk" / "model.json").read_text())
    assert doc["world_size"] == 2 and doc["optimizer"] == "torch"
    assert [c["name"] for c in doc["collections"]] == ["emb", "shared"]
    assert doc["collections"][0]["tables"] == {"loc": "local", "shd": "sharded", "rep": "hybrid"}
    assert doc["collections"][0]["cache"] == 0 and doc["collections"][1]["store_is_shared"]
    assert doc["data_parallel"] == {"dense": "topk"}
    zero = json.loads((tmp_path / "zero2" / "model.json").read_text())
    assert zero["optimizer"] == "zero" and (tmp_path / "zero2" / "zero" / "meta.json").is_file()


# ---------------------------------------------------------------- one process


class Net(nn.Module):
    """Local, sharded and cached hybrid tables, a dense MLP (DataParallel + top-k, or
    ZeRO-free plain) on one process."""

    def __init__(self, *, read_bound: int = 2, sharded: Placement = "sharded") -> None:
        super().__init__()
        group = comm.LocalGroup()
        self.cached = cache.CachedStore(
            ps.InProcessStore(),
            cache.CacheConfig(capacity_rows=10, read_bound=read_bound, write_bound=2),
        )
        self.emb = EmbeddingCollection(
            [
                TableConfig(name="loc", num_rows=ROWS, dim=DIM, feature_names=["a"],
                            optimizer=RowWiseAdagrad(lr=0.1)),
                TableConfig(name="shd", num_rows=ROWS, dim=DIM, feature_names=["b"],
                            optimizer=ps.Adam(lr=0.05), placement=sharded),
                TableConfig(name="hyb", num_rows=ROWS, dim=DIM, feature_names=["c"],
                            optimizer=ps.Adagrad(lr=0.2), placement="hybrid"),
            ],
            store=self.cached, group=group,
        )  # fmt: skip
        torch.manual_seed(3)
        mlp = nn.Sequential(nn.Linear(3 * DIM, 8), nn.ReLU(), nn.Linear(8, 1))
        self.dense = DataParallel(mlp, group, compression="topk")

    def forward(self, kjt: KeyedJaggedIds) -> torch.Tensor:
        e = self.emb(kjt)
        return self.dense(torch.cat([e["a"], e["b"], e["c"]], dim=1)).squeeze(1)


def batches(n: int) -> list[tuple[KeyedJaggedIds, torch.Tensor]]:
    gen = torch.Generator().manual_seed(11)
    out = []
    for _ in range(n):
        lists = {
            f: [torch.randint(0, ROWS, (2,), generator=gen).tolist() for _ in range(BATCH)]
            for f in "abc"
        }
        out.append(
            (KeyedJaggedIds.from_lists(lists), (torch.rand(BATCH, generator=gen) > 0.5).float())
        )
    return out


def train(net: Net, opt: torch.optim.Optimizer, data: list) -> list[float]:  # type: ignore[type-arg]
    losses = []
    for kjt, y in data:
        loss = F.binary_cross_entropy_with_logits(net(kjt), y)
        opt.zero_grad()
        loss.backward()
        net.dense.finish()
        opt.step()
        losses.append(float(loss.detach()))
    return losses


def fresh(**kw: object) -> tuple[Net, torch.optim.Optimizer]:
    net = Net(**kw)  # type: ignore[arg-type]
    return net, torch.optim.Adam(net.dense.parameters(), lr=0.05)


@pytest.mark.timeout(120)
@pytest.mark.numerics  # rerun under each ATEN_CPU_CAPABILITY
def test_one_process_resume_repeats_the_run_bit_for_bit(tmp_path: Path) -> None:
    data = batches(10)
    net, opt = fresh()
    train(net, opt, data[:5])
    save_model(tmp_path / "m", net, opt)
    hits = net.cached.cache_stats()["hyb"]["cached_rows"]
    assert hits > 0 and net.dense.codec.residuals  # something to restore
    want = train(net, opt, data[5:])

    net2, opt2 = fresh()
    load_model(tmp_path / "m", net2, opt2)
    # Exact: the load restores every bit the run continues from (weights, Adam's state, the
    # cache's rows and the codec's residuals), and the same process repeats the same ops.
    assert train(net2, opt2, data[5:]) == want

    cold, opt3 = fresh()  # the same load, then the cache emptied: a different run
    load_model(tmp_path / "m", cold, opt3)
    cold.cached.load_cache_state({})
    assert train(cold, opt3, data[5:]) != want  # lagging copies lost: not a rounding effect

    forgetful, opt4 = fresh()  # the same load, then the residuals dropped: a different run
    load_model(tmp_path / "m", forgetful, opt4)
    forgetful.dense.codec.reset()
    assert train(forgetful, opt4, data[5:]) != want

    again = save_model(tmp_path / "m", net, opt)  # a second save replaces the first
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m"] and again == tmp_path / "m"
    (tmp_path / "mine").mkdir()  # a folder that is not a save is never replaced
    with pytest.raises(FileExistsError, match="not a saved model"):
        save_model(tmp_path / "mine", net, opt)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m", "mine"]


@pytest.mark.numerics
def test_local_and_sharded_load_into_each_other(tmp_path: Path) -> None:
    net, opt = fresh(sharded="local")
    train(net, opt, batches(3))
    save_model(tmp_path / "m", net, opt)
    other, opt2 = fresh(sharded="sharded")
    load_model(tmp_path / "m", other, opt2)
    assert other.emb.sharded is not None
    want = net.emb.rows("shd", torch.arange(ROWS))
    got = other.emb.sharded.full_table("shd")  # type: ignore[operator]
    assert_same(got, want, what="sharded table", why="the load copies the saved rows")


def test_load_names_what_does_not_match(tmp_path: Path) -> None:
    net, opt = fresh()
    save_model(tmp_path / "m", net, opt)

    class Renamed(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.tables = Net().emb

    with pytest.raises(
        ValueError, match=r"saved embedding collections \['emb'\], this model has \['tables'\]"
    ):
        load_model(tmp_path / "m", Renamed())
    hybrid_now = Net()
    hybrid_now.emb = EmbeddingCollection(
        [TableConfig(name=n, num_rows=ROWS, dim=DIM, feature_names=[f], placement="hybrid")
         for n, f in (("loc", "a"), ("shd", "b"), ("hyb", "c"))]
    )  # fmt: skip
    with pytest.raises(ValueError, match=r"tables \['loc', 'shd'\] were saved as"):
        load_model(tmp_path / "m", hybrid_now)
    zero_net = Net()
    zero = ZeroOptimizer(torch.optim.Adam, zero_net.dense.parameters(), comm.LocalGroup())
    with pytest.raises(ValueError, match="holds a torch optimizer state"):
        load_model(tmp_path / "m", zero_net, zero)
    with pytest.raises(FileNotFoundError, match="no model.json"):
        load_model(tmp_path, net)
    load_model(tmp_path / "m", Net())  # no optimizer: the model alone


# ---------------------------------------------------------------- creating tables


def test_tables_are_reused_or_refused_with_both_shapes() -> None:
    store = ps.InProcessStore()
    spec = ps.TableSpec(name="t", num_rows=10, dim=4, optimizer=ps.SGD(lr=0.1))
    create_tables(store, [spec], comm.LocalGroup(), shared=True)
    create_table_once(store, spec)  # the same spec: reused
    assert store.tables() == ["t"]
    # The store's own error once its create_table takes exist_ok (ps.TableSpecMismatch,
    # a ValueError), else the collection's: either names the table and both dims.
    with pytest.raises(ValueError) as err:
        create_table_once(
            store, ps.TableSpec(name="t", num_rows=10, dim=8, optimizer=ps.SGD(lr=0.1))
        )
    assert "'t'" in str(err.value) and "4" in str(err.value) and "8" in str(err.value)
    with pytest.raises(ValueError, match="'t'"):  # through the collection
        EmbeddingCollection(
            [TableConfig(name="t", num_rows=10, dim=8, feature_names=["f"], placement="hybrid")],
            store=store,
        )
