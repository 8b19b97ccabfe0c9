"""Rank script: the DLRM example trained on N ranks equals one process on the global batch.

Every rank builds the example's model (with a rank-dependent dense init, so the
broadcast from rank 0 is what makes the replicas equal), trains ``STEPS`` steps on
its slice of each global batch, and then

* checks that every replica holds the same dense weights and embedding rows;
* rank 0 trains a second model in-process on a ``LocalGroup`` with the whole global
  batches and compares dense weights and every embedding row (1e-5); both with the
  dot interaction and with DCN-v2's cross network;
* checks ``dense.allreduce_gradients`` with a parameter that has no gradient on
  some ranks and ``dense.broadcast_parameters`` on buffers, and runs the whole
  ``train()`` with identical metrics on every rank.

Backend: ``comm.init("auto")`` (mpirun -> mpi, torchrun-style env -> gloo).
Prints ``rank R/N: ok dlrm train``.
"""

from __future__ import annotations

import torch
from torch import nn

import comm
from comm import ProcessGroup
from dense import allreduce_gradients, broadcast_parameters
from hybridrec.datasets.ctr import gather_batch
from hybridrec.dlrm.config import TrainConfig
from hybridrec.dlrm.data import InMemorySource, open_source
from hybridrec.dlrm.job import make_optimizer, train, train_step
from hybridrec.dlrm.model import DLRM, build_dlrm

STEPS = 6
CFG = TrainConfig(
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


def flat_state(model: DLRM) -> torch.Tensor:
    """Dense parameters and all embedding rows, flattened: ``[P]``."""
    parts = [p.detach().reshape(-1) for p in model.dense.parameters()]
    for table in model.embeddings.tables:
        assert table.num_rows is not None
        ids = torch.arange(table.num_rows)
        parts.append(model.embeddings.rows(table.name, ids).reshape(-1))
    return torch.cat(parts)


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
        torch.testing.assert_close(replicas[r], replicas[0], rtol=0, atol=1e-6)

    if group.rank == 0:
        ref = build(comm.LocalGroup(), seed=CFG.seed, interaction=interaction)
        run_steps(ref, comm.LocalGroup())
        want = flat_state(ref)
        fresh = flat_state(build(comm.LocalGroup(), CFG.seed, interaction=interaction))
        assert not torch.equal(want, fresh), "no update"
        torch.testing.assert_close(mine, want, rtol=0, atol=1e-5)


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
    torch.testing.assert_close(lin.weight.grad, torch.full((2, 3), mean_r))
    torch.testing.assert_close(lin.bias.grad, torch.arange(2.0) * (mean_r + 1))
    torch.testing.assert_close(extra.grad, torch.full((4,), 1.0 / n, dtype=torch.float64))


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
    cfg = TrainConfig(**{**{f: getattr(CFG, f) for f in CFG.__slots__}, "max_steps": 40})
    metrics = train(cfg, group)
    assert metrics["steps"] == 40 and metrics["world_size"] == group.size
    values = torch.tensor(
        [metrics["test_auc"], metrics["test_logloss"], metrics["epochs"][-1]["train_loss"]],
        dtype=torch.float64,
    )
    table = group.allgather(values)  # [size, 3]
    for r in range(group.size):
        torch.testing.assert_close(table[r], table[0], rtol=0, atol=1e-12)
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
