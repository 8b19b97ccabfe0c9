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

* outputs and the first loss (computed before any update): bit for bit at W = 2, else
  within a bound from the per-rank replicas' rounding and the MLP (``output_tol``);
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
from hybridrec.checkpoint.model_state import load_model, save_model
from hybridrec.checkpoint.run_checkpoint import load_checkpoint, save_checkpoint
from hybridrec.checkpoint.state_folder import read_state
from ps.mpi.server import serve_mpi
from ps.mpi.store import MPIStore
from tests.support.tolerance import assert_close, assert_same, sum_tol

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
    return probe(net, group, b)[0]


def probe(net: Net, group: comm.ProcessGroup, b: tuple) -> tuple[list[float], torch.Tensor]:  # type: ignore[type-arg]
    """The outputs on ``b`` (``[GLOBAL_BATCH]``, in sample order) and the largest ``|z|``
    of each MLP input column over the global batch (``[4 DIM + 3]``): ``Net.forward``'s
    operations, split to see ``z``."""
    kjt, x, _ = mine(group, b)
    with torch.no_grad():
        a = net.emb(kjt.select(["fl", "fs", "fr"]))
        h = net.shared(kjt.select(["fh"]))
        z = torch.cat([a["fl"], a["fs"], a["fr"], h["fh"], x], dim=1)
        out = net.dense(z).squeeze(1).contiguous()
    zabs = group.allgatherv(z.abs().contiguous()).amax(dim=0)
    return group.allgatherv(out).tolist(), zabs


def adam_ratio(steps: int, betas: tuple[float, float] = (0.9, 0.999)) -> float:
    """The largest ``|m_hat| / sqrt(v_hat)`` of Adam's first ``steps`` steps: by
    Cauchy-Schwarz ``|m_t| <= sqrt(v_t) (1 - b1) / sqrt(1 - b2) sqrt(sum_k<t (b1^2 / b2)^k)``,
    times the bias corrections ``sqrt(1 - b2^t) / (1 - b1^t)`` (1 at the first step)."""
    b1, b2 = betas
    return max(
        (1 - b2**t) ** 0.5 / (1 - b1**t) * (1 - b1) / (1 - b2) ** 0.5
        * sum((b1 * b1 / b2) ** k for k in range(t)) ** 0.5
        for t in range(1, steps + 1)
    )  # fmt: skip


def output_tol(net: Net, path: Path, train: list, zabs: torch.Tensor) -> float:  # type: ignore[type-arg]
    """How far the outputs at M != 2 workers may be from the saving run's.

    Only table ``rep`` differs: rank m serves saved rank (m mod 2)'s per-rank replica,
    which got the same SGD gradients as the other replica but grouped into other pushes
    (and summed in the cache's pending sums in another order). The local, sharded and
    shared rows are one copy, resharded bit for bit, and a sample's bag is pooled in the
    same order at any worker count. A replica's row is ``w0 - lr sum_i g_i`` over the
    ``n`` occurrences of its id in the training batches: two evaluations of that sum are
    ``sum_tol(float32, n + 1, |w0| + lr sum_i |g_i|)`` apart per element. The gradient
    of one occurrence is ``(sigmoid - y) / b`` (at most ``1 / b``, ``b`` = 4 samples per
    rank when saving) times ``sum_j |W2_j| |W1_jc|`` at the weights of that step, each
    within ``TRAIN_BEFORE`` Adam steps of ``lr adam_ratio`` of the loaded ones; ``|w0|``
    is at most the row now plus ``lr sum_i |g_i|``. A bag sums at most 3 rows, so its
    ``DIM`` inputs of ``z`` move by at most 3 times that, and the MLP (Linear, ReLU,
    Linear) is ``||W1||_2 ||W2||_2``-Lipschitz (ReLU is 1-Lipschitz). On top: each side
    evaluates the MLP on its own batch split (other GEMM blockings), per hidden unit
    ``sum_tol(float32, 4 DIM + 4, sum_c |W1_jc| |z_c| + |b1_j|)``, carried by ``|W2|``,
    plus the output's own ``sum_tol(float32, 9, sum_j |W2_j| |h_j| + |b2|)``."""
    mlp = net.dense.module if isinstance(net.dense, DataParallel) else net.dense
    w1, b1 = mlp[0].weight.detach().double(), mlp[0].bias.detach().double()  # [8, 19], [8]
    w2, b2 = mlp[2].weight.detach().double(), mlp[2].bias.detach().double()  # [1, 8], [1]
    shift = TRAIN_BEFORE * 0.05 * adam_ratio(TRAIN_BEFORE)  # Adam lr 0.05 (make_opt)
    rep = slice(2 * DIM, 3 * DIM)  # the columns of z from table rep
    grad = float(((w2.abs() + shift).T * (w1[:, rep].abs() + shift)).sum(0).max()) / (
        GLOBAL_BATCH // 2
    )
    counts = torch.zeros(ROWS)
    for kjt, _, _ in train[:TRAIN_BEFORE]:
        counts += torch.bincount(kjt["fr"].ids, minlength=ROWS).float()
    n = int(counts.max())
    now = 0.0
    for r in (0, 1):
        replica = ps.InProcessStore()
        replica.load(path / "ranks" / f"{r:05d}" / "stores" / "s000")
        now = max(now, float(replica.pull("rep", torch.arange(ROWS)).rows.abs().max()))
    lr_g = 0.3 * n * grad  # SGD lr 0.3 (Net)
    row = sum_tol(torch.float32, n + 1, now + 2 * lr_g)
    lip = float(torch.linalg.matrix_norm(w1, 2) * torch.linalg.matrix_norm(w2, 2))
    moved = lip * (DIM**0.5) * 3 * row
    zb = zabs.double()
    hid = w1.abs() @ zb + b1.abs()  # [8] magnitude of each hidden sum
    first = sum(abs(float(w)) * sum_tol(torch.float32, 4 * DIM + 4, m)
                for w, m in zip(w2[0].tolist(), hid.tolist(), strict=True))  # fmt: skip
    # |h_j| <= sum_c |W1_jc| |z_c| + |b1_j| (ReLU only shrinks it)
    second = sum_tol(torch.float32, 9, float(w2.abs()[0] @ hid) + float(b2.abs()))
    return moved + first + second


def loss_tol(out_tol: float, outs: list[float]) -> float:
    """The first loss, ``mean_i BCE(z_i, y_i)`` averaged over the ranks' means: BCE with
    logits is 1-Lipschitz in ``z_i``, so the outputs move it by ``out_tol``; its own
    evaluation (``max(z, 0) - z y + log1p(exp(-|z|))``, 5 roundings of terms at most
    ``|z| + 1``) and the means of ``GLOBAL_BATCH`` terms in two groupings add
    ``sum_tol(float32, GLOBAL_BATCH + 5 + 4, mean_i (|z_i| + 1))``."""
    mag = sum(abs(o) + 1.0 for o in outs) / len(outs)
    return out_tol + sum_tol(torch.float32, GLOBAL_BATCH + 9, mag)


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
        probe_batch = batch(gen)
        path = root / variant
        if mode == "save":
            save_and_record(variant, root, group, store, train, probe_batch)
        net = Net(variant, group, store)
        opt = make_opt(variant, net, group)
        if variant == "topk":
            check_run_checkpoint(root / "run" / "step-00000003", net, opt, group)
        doc = load_model(path, net, opt, group=group)  # type: ignore[arg-type]
        assert doc["world_size"] == 2, doc
        ref = json.loads((root / f"{variant}.ref.json").read_text())
        check_state(variant, net, group, path, ref)
        outs, zabs = probe(net, group, probe_batch)
        got = {"outputs": outs, "losses": [step(net, opt, group, b) for b in train[TRAIN_BEFORE:]]}
        out_tol = 0.0 if group.size == 2 else output_tol(net, path, train, zabs)
        compare(variant, group, got, ref, out_tol)
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


def compare(variant: str, group: comm.ProcessGroup, got: dict, ref: dict, out_tol: float) -> None:  # type: ignore[type-arg]
    """At the saving worker count everything repeats the saving run's arithmetic: bit for
    bit. At another count the outputs and the first loss (no update yet) within
    :func:`output_tol` and :func:`loss_tol`."""

    def close(a: list[float], b: list[float], what: str, tol: float) -> None:
        err = max(abs(x - y) for x, y in zip(a, b, strict=True))
        if group.rank == 0:
            print(f"{variant} at {group.size}: {what} off by {err:.3g}, tolerance {tol:.3g}")
        assert err <= tol, f"{variant} at {group.size} workers: {what} off by {err:.3g}: {a} {b}"

    two = group.size == 2
    close(got["outputs"], ref["outputs"], "outputs", out_tol)
    first = 0.0 if two else loss_tol(out_tol, ref["outputs"])
    close(got["losses"][:1], ref["losses"][:1], "first loss", first)
    if variant != "topk" or two:
        close(got["losses"], ref["losses"], "losses", 0.0 if two else 1e-5)


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
