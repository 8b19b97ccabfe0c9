"""Rank script: the DLRM example trained on N ranks equals one process on the global batch.

Every rank builds the example's model (with a rank-dependent dense init, so the
broadcast from rank 0 is what makes the replicas equal), trains ``STEPS`` steps on
its slice of each global batch, and then

* checks that every replica holds the same dense weights and embedding rows, bit for
  bit (every rank applies the same allreduced dense gradient and the same allgathered
  row updates);
* rank 0 trains a second model in-process on a ``LocalGroup`` with the whole global
  batches and compares each dense parameter and each table's rows within a few times
  that one-process run's own fp32 rounding error, measured by replaying it in float64
  (``Replay64``, ``tests/support/tolerance.py``: the ranks sum the gradients in another order,
  and Adam amplifies that where a gradient is near zero); both with the dot
  interaction and with DCN-v2's cross network. The test runs 2 and 4 ranks: there a
  rank's mean over its B / N samples and the average over ranks rescale by powers of
  two, exactly, so the runs differ from the one process only in the order of the sums,
  which the replayed tolerance covers (3 ranks round 1 / 16 and 1 / 3 besides, and can
  exceed it);
* checks ``dense.allreduce_gradients`` with a parameter that has no gradient on
  some ranks and ``dense.broadcast_parameters`` on buffers, and runs the whole
  ``train()`` with bit-identical metrics on every rank.

Backend: ``comm.init("auto")`` (mpirun -> mpi, torchrun-style env -> gloo).
Prints ``rank R/N: ok dlrm train``.
"""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from torch import nn

import comm
from comm import ProcessGroup
from dense import DataParallel, allreduce_gradients, broadcast_parameters
from hybridrec.datasets.ctr import Batch, gather_batch
from hybridrec.dlrm.config import DLRMJobConfig
from hybridrec.dlrm.data import InMemorySource, open_source
from hybridrec.dlrm.job import make_optimizer, train, train_step
from hybridrec.dlrm.model import DLRM, build_dlrm
from ps import RowWiseAdagrad
from tests.support.tolerance import assert_close, assert_same, replay_tol, sum_tol

STEPS = 6
CFG = DLRMJobConfig(
    data="synthetic",
    synthetic_samples=3_000,
    synthetic_rows=300,
    batch_size=48,  # divisible by 1, 2, 3 and 4 ranks
    dim=8,
    bottom_mlp=[16, 8],
    top_mlp=[16, 1],
    lr=0.01,
    emb_lr=0.1,
    seed=5,
    epochs=2,
    verbose=False,
)


def source(group: ProcessGroup) -> InMemorySource:
    src = open_source(CFG, group)
    assert isinstance(src, InMemorySource)
    return src


def build(group: ProcessGroup, seed: int, interaction: str = "dot") -> DLRM:
    assert CFG.dim is not None and CFG.top_mlp is not None
    return build_dlrm(
        source(group).data, dim=CFG.dim, emb_lr=CFG.emb_lr, bottom_mlp=CFG.bottom_mlp,
        top_mlp=CFG.top_mlp, seed=seed, group=group, interaction=interaction,
        dcn_layers=2, dcn_rank=4,
    )  # fmt: skip


WHY = "a few times the one-process run's fp32 rounding error, measured in float64"


def state_parts(model: DLRM) -> dict[str, torch.Tensor]:
    """Each dense parameter and each table's rows, by name."""
    dense = model.dense.module if isinstance(model.dense, DataParallel) else model.dense
    parts = {f"dense {n}": p.detach() for n, p in dense.named_parameters()}
    for table in model.embeddings.tables:
        assert table.num_rows is not None
        ids = torch.arange(table.num_rows)
        parts[f"table {table.name}"] = model.embeddings.rows(table.name, ids)
    return parts


def flat_state(model: DLRM) -> torch.Tensor:
    """Dense parameters and all embedding rows, flattened: ``[P]``."""
    return torch.cat([t.reshape(-1) for t in state_parts(model).values()])


class Replay64:
    """The one-process run of :func:`run_steps` replayed in float64 in plain torch: the
    same initial dense weights and rows (copied from a fresh model), the same batches,
    ``embedding_bag`` per feature, autograd, the dense optimizer from ``torch.optim`` and
    row-wise Adagrad written out. Its distance to the fp32 run measures that run's own
    rounding error (:func:`tests.support.tolerance.replay_tol`)."""

    def __init__(self, fresh: DLRM) -> None:
        self.dense = copy.deepcopy(fresh.dense).double()
        cls = torch.optim.Adam if CFG.dense_optimizer == "adam" else torch.optim.Adagrad
        self.opt = cls(self.dense.parameters(), lr=CFG.lr, weight_decay=CFG.weight_decay)
        self.tables = {t.name: t for t in fresh.embeddings.tables}
        self.rows: dict[str, torch.Tensor] = {}
        self.acc: dict[str, torch.Tensor] = {}
        for name, t in self.tables.items():
            assert t.num_rows is not None and isinstance(t.optimizer, RowWiseAdagrad)
            ids = torch.arange(t.num_rows)
            self.rows[name] = fresh.embeddings.rows(name, ids).double()
            self.acc[name] = torch.full((t.num_rows,), t.optimizer.initial_accumulator).double()

    def step(self, batch: Batch) -> None:
        kjt = batch.sparse
        leaves = {n: w.clone().requires_grad_() for n, w in self.rows.items()}
        pooled = []
        for feat in kjt.keys:
            (name,) = [n for n, t in self.tables.items() if feat in t.feature_names]
            j = kjt[feat]
            mode = self.tables[name].pooling
            pooled.append(F.embedding_bag(j.ids, leaves[name], j.offsets()[:-1], mode=mode))
        logits = self.dense(batch.dense.double(), pooled)
        loss = F.binary_cross_entropy_with_logits(logits, batch.labels.double())
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        self.opt.step()
        for name, t in self.tables.items():
            ids = [kjt[f].ids for f in t.feature_names if f in kjt]
            grad = leaves[name].grad
            if not ids or grad is None:
                continue
            touched = torch.unique(torch.cat(ids))
            g = grad[touched]  # [U, D]
            opt = t.optimizer
            assert isinstance(opt, RowWiseAdagrad)
            self.acc[name][touched] += (g * g).mean(dim=1)
            self.rows[name][touched] -= (
                opt.lr * g / (self.acc[name][touched].sqrt() + opt.eps)[:, None]
            )

    def parts(self) -> dict[str, torch.Tensor]:
        """Like :func:`state_parts`."""
        parts = {f"dense {n}": p.detach() for n, p in self.dense.named_parameters()}
        return parts | {f"table {n}": w for n, w in self.rows.items()}


def run_steps(model: DLRM, group: ProcessGroup) -> None:
    """STEPS steps of the example's train_step (dense part under dense.DataParallel)."""
    src = source(group)
    opt = make_optimizer(CFG, model, group)
    for idx in src.local_batches(epoch=0)[:STEPS]:
        train_step(model, opt, gather_batch(src.data, idx))


def check_matches_single_process(group: ProcessGroup, interaction: str = "dot") -> None:
    # differs per rank before the broadcast
    model = build(group, seed=CFG.seed + group.rank, interaction=interaction)
    broadcast_parameters(model.dense, group)
    run_steps(model, group)
    mine = flat_state(model)

    replicas = group.allgather(mine)  # [size, P]
    for r in range(group.size):
        assert_same(
            replicas[r], replicas[0], what=f"{interaction}: rank {r}'s replica vs rank 0's",
            why="every rank steps with the same allreduced dense gradient and applies the "
            "same allgathered row gradients in the same order",
        )  # fmt: skip

    if group.rank == 0:
        local = comm.LocalGroup()
        ref = build(local, seed=CFG.seed, interaction=interaction)
        run_steps(ref, local)
        fresh = build(local, CFG.seed, interaction=interaction)
        assert not torch.equal(flat_state(ref), flat_state(fresh)), "no update"
        replay = Replay64(fresh)
        for idx in source(local).local_batches(epoch=0)[:STEPS]:
            replay.step(gather_batch(source(local).data, idx))
        want, want64 = state_parts(ref), replay.parts()
        got = state_parts(model)
        # One tolerance per kind, from the largest measured error over all its elements
        # (a single small tensor's measured error can be small by chance): the dense part
        # (Adam moves every parameter by about lr per step whatever its scale, so their
        # rounding errors are of one size) and the embedding rows (one row-wise Adagrad).
        tols = {}
        for kind in ("dense", "table"):
            names = [n for n in want if n.startswith(kind)]
            flat, flat64 = (torch.cat([p[n].reshape(-1) for n in names]) for p in (want, want64))
            tols[kind] = replay_tol(flat, flat64)
        for name, w in want.items():
            tol = tols[name.split()[0]]
            assert_close(got[name], w, atol=tol, what=f"{interaction}: {name}", why=WHY)


def check_allreduce_gradients(group: ProcessGroup) -> None:
    lin = nn.Linear(3, 2)
    extra = nn.Parameter(torch.zeros(4, dtype=torch.float64))
    module = nn.Module()
    module.lin = lin
    module.extra = extra
    r = float(group.rank)
    lin.weight.grad = torch.full((2, 3), r)
    lin.bias.grad = torch.arange(2.0) * (r + 1)
    if group.rank == 0:  # the other ranks have no gradient for `extra`
        extra.grad = torch.ones(4, dtype=torch.float64)
    allreduce_gradients(module, group)
    n = group.size
    mean_r = sum(range(n)) / n
    assert lin.weight.grad is not None and lin.bias.grad is not None and extra.grad is not None
    # The sums of small integers are exact; the average rounds 1 / n and the product (or
    # the quotient), the expected values round once: two roundings of the result.
    why = "an exact sum of integers, averaged: two roundings"
    w_tol, b_tol = sum_tol(torch.float32, 2, mean_r), sum_tol(torch.float32, 2, mean_r + 1)
    assert_close(lin.weight.grad, torch.full((2, 3), mean_r), atol=w_tol, what="weight", why=why)
    want = torch.arange(2.0) * (mean_r + 1)
    assert_close(lin.bias.grad, want, atol=b_tol, what="bias", why=why)
    want = torch.full((4,), 1.0 / n, dtype=torch.float64)
    assert_close(extra.grad, want, atol=sum_tol(torch.float64, 2, 1.0 / n), what="extra", why=why)


def check_broadcast_parameters(group: ProcessGroup) -> None:
    """Parameters and buffers (float and int) all end up as rank 0's."""
    module = nn.BatchNorm1d(3)
    r = float(group.rank)
    assert module.running_mean is not None and module.num_batches_tracked is not None
    with torch.no_grad():
        module.weight.fill_(r + 1)
        module.running_mean.fill_(r + 2)
        module.num_batches_tracked.fill_(group.rank + 3)
    broadcast_parameters(module, group)
    assert torch.equal(module.weight.detach(), torch.full((3,), 1.0))
    assert torch.equal(module.running_mean, torch.full((3,), 2.0))
    assert int(module.num_batches_tracked) == 3


def check_train_end_to_end(group: ProcessGroup) -> None:
    cfg = DLRMJobConfig(**{**{f: getattr(CFG, f) for f in CFG.__slots__}, "max_steps": 40})
    metrics = train(cfg, group)
    assert metrics["steps"] == 40 and metrics["world_size"] == group.size
    values = torch.tensor(
        [metrics["test_auc"], metrics["test_logloss"], metrics["epochs"][-1]["train_loss"]],
        dtype=torch.float64,
    )
    table = group.allgather(values)  # [size, 3]
    for r in range(group.size):
        assert_same(
            table[r], table[0], what=f"rank {r}'s metrics vs rank 0's",
            why="every rank computes them from the same allgathered scores and the same "
            "allreduced loss sums",
        )  # fmt: skip
    assert 0.5 < metrics["test_auc"] <= 1.0, metrics["test_auc"]


def run_checks(group: ProcessGroup) -> None:
    """Every check of this script on ``group`` (a 1-rank run calls it in-process)."""
    check_allreduce_gradients(group)
    check_broadcast_parameters(group)
    check_matches_single_process(group)
    check_matches_single_process(group, interaction="dcn")
    check_train_end_to_end(group)


def main() -> None:
    torch.set_num_threads(1)
    group = comm.init("auto", timeout_s=120.0)
    try:
        run_checks(group)
    finally:
        group.close()
    print(f"rank {group.rank}/{group.size}: ok dlrm train", flush=True)


if __name__ == "__main__":
    main()
