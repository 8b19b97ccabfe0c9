"""Rank script: one save of a whole model at N workers loads at M workers.

Run as ``mpirun -n W+1 python model_checkpoint.py save|load <dir>``: the last rank is
a parameter server (a shared ``ps.MPIStore``), the other W ranks are workers. The
model holds every placement at once:

* collection ``emb``: a local table (RowWiseAdagrad), a sharded table (Adam) and a
  hybrid table in a per-rank in-process store behind a cache (read bound 0, write
  bound 2: rows are pending in the cache when the model is saved);
* collection ``shared``: a hybrid table in the shared MPI store, created by the
  library from rank 0 while the other workers wait (no set-up by the script);
* a dense MLP, trained three ways (one model per variant, same embeddings):
  ``topk`` (``DataParallel`` with the top-k codec, whose error-feedback residuals are
  saved, + Adam), ``zero1`` and ``zero2`` (``ZeroOptimizer`` stage 1 / 2 with Adam).

``save`` (W = 2) trains 3 steps on a global batch of 8 split over the workers, saves
with ``save_model``, then records what happens next: the outputs on a fixed batch and
the next 2 global step losses, plus the codec's total pending correction, in
``<dir>/<variant>.ref.json``; then it loads like ``load`` does. ``load`` builds the
model fresh (new servers, new stores) at W workers, loads it and compares:

* outputs and the first loss (computed before any update): equal at every W (1e-5);
* the second loss (after one update): equal at every W for ZeRO; for top-k only at
  W = 2, where each rank gets its residuals back exactly, while at another W the
  codec's pending correction ``sum_r residual_r / W`` must equal the saved one;
* at W = 2 each rank's cache holds exactly what the saving rank's held.

Hybrid tables use SGD, so two workers' pushes to the shared store commute (up to
rounding). Every worker prints ``rank R: ok``; any failed check raises.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

import cache
import comm
import ps
from dense import DataParallel, ZeroOptimizer
from embedding import EmbeddingCollection, KeyedJaggedIds, RowWiseAdagrad, TableConfig
from hybridrec.checkpoint import load_checkpoint, save_checkpoint
from hybridrec.model_state import load_model, save_model
from hybridrec.state_files import read_state
from ps.mpi.server import serve_mpi
from ps.mpi.store import MPIStore
from tests.tolerance import assert_close, assert_same, sum_tol

GLOBAL_BATCH, ROWS, DIM = 8, 20, 4
VARIANTS = ("topk", "zero1", "zero2")
TRAIN_BEFORE, TRAIN_AFTER = 3, 2


class Net(nn.Module):
    def __init__(self, variant: str, group: comm.ProcessGroup, shared_store: ps.Store) -> None:
        super().__init__()
        cfg = cache.CacheConfig(capacity_rows=12, read_bound=0, write_bound=2)
        self.cached = cache.CachedStore(ps.InProcessStore(), cfg)
        self.emb = EmbeddingCollection(
            [
                TableConfig(name="loc", num_rows=ROWS, dim=DIM, feature_names=["fl"],
                            optimizer=RowWiseAdagrad(lr=0.1)),
                TableConfig(name="shd", num_rows=ROWS, dim=DIM, feature_names=["fs"],
                            optimizer=ps.Adam(lr=0.05), placement="sharded"),
                TableConfig(name="rep", num_rows=ROWS, dim=DIM, feature_names=["fr"],
                            optimizer=ps.SGD(lr=0.3), placement="hybrid"),
            ],
            store=self.cached, group=group,
        )  # fmt: skip
        self.shared = EmbeddingCollection(
            [TableConfig(name=f"{variant}_shr", num_rows=ROWS, dim=DIM, feature_names=["fh"],
                         optimizer=ps.SGD(lr=0.3), placement="hybrid")],
            store=shared_store, group=group,
        )  # fmt: skip
        torch.manual_seed(7)  # every rank the same weights (DataParallel/ZeRO broadcast too)
        mlp = nn.Sequential(nn.Linear(4 * DIM + 3, 8), nn.ReLU(), nn.Linear(8, 1))
        self.dense: nn.Module = (
            DataParallel(mlp, group, compression=_topk()) if variant == "topk" else mlp
        )

    def forward(self, kjt: KeyedJaggedIds, x: torch.Tensor) -> torch.Tensor:
        a = self.emb(kjt.select(["fl", "fs", "fr"]))
        b = self.shared(kjt.select(["fh"]))
        z = torch.cat([a["fl"], a["fs"], a["fr"], b["fh"], x], dim=1)
        return self.dense(z).squeeze(1)  # [B]


def _topk() -> object:
    from comm.compression import TopK

    return TopK(ratio=0.25)


def batch(gen: torch.Generator) -> tuple[KeyedJaggedIds, torch.Tensor, torch.Tensor]:
    lists = {
        f: [
            torch.randint(0, ROWS, (int(torch.randint(1, 4, (1,), generator=gen)),),
                          generator=gen).tolist()
            for _ in range(GLOBAL_BATCH)
        ]
        for f in ("fl", "fs", "fr", "fh")
    }  # fmt: skip
    x = torch.randn(GLOBAL_BATCH, 3, generator=gen)
    y = (torch.rand(GLOBAL_BATCH, generator=gen) > 0.5).float()
    return KeyedJaggedIds.from_lists(lists), x, y


def mine(group: comm.ProcessGroup, b: tuple[KeyedJaggedIds, torch.Tensor, torch.Tensor]):  # noqa: ANN201
    per = GLOBAL_BATCH // group.size
    lo, hi = group.rank * per, (group.rank + 1) * per
    kjt, x, y = b
    return kjt.sample_slice(lo, hi), x[lo:hi], y[lo:hi]


def step(net: Net, opt: object, group: comm.ProcessGroup, b: tuple) -> float:  # type: ignore[type-arg]
    kjt, x, y = mine(group, b)
    loss = F.binary_cross_entropy_with_logits(net(kjt, x), y)
    # The shared store is asynchronous: without this, a fast worker's push could reach a
    # row before a slow worker's pull of this step, and losses would vary run to run.
    group.barrier()
    opt.zero_grad(set_to_none=True)  # type: ignore[attr-defined]
    loss.backward()
    if isinstance(net.dense, DataParallel):
        net.dense.finish()
    opt.step()  # type: ignore[attr-defined]
    return float(group.allreduce(loss.detach().reshape(1), op="avg"))


def outputs(net: Net, group: comm.ProcessGroup, b: tuple) -> list[float]:  # type: ignore[type-arg]
    kjt, x, _ = mine(group, b)
    with torch.no_grad():
        out = net(kjt, x).contiguous()
    return group.allgatherv(out).tolist()  # [GLOBAL_BATCH], in sample order


def pending(net: Net, group: comm.ProcessGroup) -> list[float]:
    """The codec's correction still to come in the averaged gradient: sum_r r_r / size."""
    assert isinstance(net.dense, DataParallel)
    res = net.dense.codec_state()["residuals"]
    flat = torch.cat([res[n].reshape(-1) for n in sorted(res)]) if res else torch.zeros(0)
    return (group.allreduce(flat.contiguous(), op="sum") / group.size).tolist()


def make_opt(variant: str, net: Net, group: comm.ProcessGroup) -> object:
    params = list(net.dense.parameters())
    if variant == "topk":
        return torch.optim.Adam(params, lr=0.05)
    return ZeroOptimizer(torch.optim.Adam, params, group, stage=int(variant[-1]), lr=0.05)


def run(mode: str, root: Path, group: comm.ProcessGroup, store: ps.Store) -> None:
    """``save``: train, save, record what follows, then also load into a fresh model at
    this count (the saved tables already exist in the live shared store: reused, then
    overwritten by the load). ``load``: load into a fresh model and compare."""
    for variant in VARIANTS:
        gen = torch.Generator().manual_seed(100 + VARIANTS.index(variant))
        train = [batch(gen) for _ in range(TRAIN_BEFORE + TRAIN_AFTER)]
        probe = batch(gen)
        path = root / variant
        if mode == "save":
            save_and_record(variant, root, group, store, train, probe)
        net = Net(variant, group, store)
        opt = make_opt(variant, net, group)
        if variant == "topk":
            check_run_checkpoint(root / "run" / "step-00000003", net, opt, group)
        doc = load_model(path, net, opt, group=group)  # type: ignore[arg-type]
        assert doc["world_size"] == 2, doc
        ref = json.loads((root / f"{variant}.ref.json").read_text())
        check_state(variant, net, group, path, ref)
        got = {
            "outputs": outputs(net, group, probe),
            "losses": [step(net, opt, group, b) for b in train[TRAIN_BEFORE:]],
        }
        compare(variant, group, got, ref)
        group.barrier()


def save_and_record(
    variant: str,
    root: Path,
    group: comm.ProcessGroup,
    store: ps.Store,
    train: list,
    probe: tuple,  # type: ignore[type-arg]
) -> None:
    net = Net(variant, group, store)
    opt = make_opt(variant, net, group)
    for b in train[:TRAIN_BEFORE]:
        step(net, opt, group, b)
    save_model(root / variant, net, opt, group=group)  # type: ignore[arg-type]
    if variant == "topk":  # and the trainer's checkpoint, with a per-rank vector
        save_checkpoint(
            root / "run", 3, group=group, dense=net.dense, optimizer=opt,  # type: ignore[arg-type]
            embeddings=net.emb, meta={"epoch": 1}, rank_state=torch.tensor([group.rank, 7]),
        )  # fmt: skip
    ref = {
        "pending": pending(net, group) if variant == "topk" else [],
        "outputs": outputs(net, group, probe),
        "losses": [step(net, opt, group, b) for b in train[TRAIN_BEFORE:]],
    }
    if group.rank == 0:
        (root / f"{variant}.ref.json").write_text(json.dumps(ref))
    group.barrier()


def check_run_checkpoint(path: Path, net: Net, opt: object, group: comm.ProcessGroup) -> None:
    """The run checkpoint: per-rank vectors back at the saving count; at another count
    only with ``resize=True``, and then none."""
    kw = dict(group=group, dense=net.dense, optimizer=opt, embeddings=net.emb)
    if group.size == 2:
        meta, mine = load_checkpoint(path, **kw)  # type: ignore[arg-type]
        assert mine is not None and mine.tolist() == [group.rank, 7], mine
    else:
        try:
            load_checkpoint(path, **kw)  # type: ignore[arg-type]
        except ValueError as e:
            assert "written by 2 worker ranks" in str(e) and "resize=True" in str(e), e
        else:
            raise AssertionError("a checkpoint of 2 workers loaded at another count unasked")
        meta, mine = load_checkpoint(path, resize=True, **kw)  # type: ignore[arg-type]
        assert mine is None, mine
    assert meta["epoch"] == 1 and meta["world_size"] == 2 and meta["step"] == 3, meta


def check_state(variant: str, net: Net, group: comm.ProcessGroup, path: Path, ref: dict) -> None:  # type: ignore[type-arg]
    if group.size == 2:  # each rank has the saving rank's cache back, row for row
        saved = read_state(path / "ranks" / f"{group.rank:05d}" / "cache")["k000"]
        now = net.cached.cache_state()
        assert sorted(saved) == sorted(now), (sorted(saved), sorted(now))
        for table, state in saved.items():
            for key, t in state.items():
                assert_same(now[table][key], t, what=f"{variant} cache {table} {key}",
                            why="rank r loads the state saved rank r wrote")  # fmt: skip
            assert state["ids"].numel() > 0, (variant, table)
    if variant == "topk":
        got, want = pending(net, group), ref["pending"]
        assert len(got) == len(want) and any(abs(w) > 0 for w in want), (variant, want)
        # Saved: (r_0 + r_1) / 2, one rounding (the halving is exact). At the saving count
        # each rank has its own residual back and the same sum is taken: bit for bit. At M
        # workers each holds the mean m (one rounding) and the sum of M copies of m over M
        # adds at most M - 1 roundings of magnitude M |m|, divided by M.
        tol = (
            0.0
            if group.size == 2
            else sum_tol(torch.float32, group.size + 1, max(abs(w) for w in want))
        )
        assert_close(torch.tensor(got), torch.tensor(want), atol=tol,
                     what=f"{variant} at {group.size}: pending correction",
                     why="the saving run's sum, or M copies of its mean summed")  # fmt: skip


def compare(variant: str, group: comm.ProcessGroup, got: dict, ref: dict) -> None:  # type: ignore[type-arg]
    def close(a: list[float], b: list[float], what: str) -> None:
        err = max(abs(x - y) for x, y in zip(a, b, strict=True))
        # The same worker count repeats the saving run's arithmetic: bit for bit.
        tol = 0.0 if group.size == 2 else 1e-5
        assert err <= tol, f"{variant} at {group.size} workers: {what} off by {err:.3g}: {a} {b}"

    close(got["outputs"], ref["outputs"], "outputs")
    close(got["losses"][:1], ref["losses"][:1], "first loss")
    if variant != "topk" or group.size == 2:
        close(got["losses"], ref["losses"], "losses")


def main() -> None:
    mode, root = sys.argv[1], Path(sys.argv[2])
    group = comm.init("mpi", timeout_s=60.0)
    topology = comm.Topology(world_size=group.size, num_servers=1)
    workers = topology.role_group(group)
    if topology.role(group.rank) is comm.Role.SERVER:
        serve_mpi(group, topology)
        print(f"rank {group.rank}: ok server", flush=True)
        return
    with MPIStore(group, topology, request_timeout_s=60.0) as store:
        run(mode, root, workers, store)
    print(f"rank {group.rank}: ok worker {mode} at {workers.size}", flush=True)


if __name__ == "__main__":
    main()
