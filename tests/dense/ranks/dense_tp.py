"""Rank script: tensor parallelism (dense.tensor_parallel, dense.vocab_parallel) equals one
process.

One case, ``all`` (launched with the other dense rank checks by tests/support/rank_battery.py):

* ``errors``: a GPT whose heads or vocabulary do not divide over tp, a vocabulary-parallel
  table of such a vocabulary, and targets or ids outside the vocabulary raise a ValueError
  naming the value, on every rank (each rank catches its own).
* ``vocab``: on tp = all ranks, vocab_parallel_cross_entropy and VocabParallelEmbedding
  against torch's cross entropy and embedding on the full tensors (same seed everywhere):
  the loss and its gradient within the cross entropy's rounding bound
  (``tests/support/tolerance.py``), the embedding and its gradient bit for bit; the
  allreduced bytes are 3*N*4 (loss) and N*D*4 (table).
* ``train``: a token table + GPT (2 layers x 32 wide, 4 heads, vocabulary 64, T 16) built
  with the same seed on every rank, the table made vocabulary-parallel and the GPT converted
  by apply_tensor_parallel; 5 AdamW steps on the global batch split over dp (DataParallel
  on the mesh's dp group averages the gradients). An unconverted copy trains in this
  process on the whole global batch, and a float64 twin of it measures its rounding error;
  losses and the gathered final weights agree within a few times that error (losses at
  least within the cross entropy's own bound).
  The TP bytes of one step equal the analytic count (see expected_bytes). Meshes:
  tp = all ranks, and at 4 ranks also dp 2 x tp 2.

Backend from ``HYBRIDREC_TEST_BACKEND`` (set by tests/support/multiproc.py).
"""

from __future__ import annotations

import copy
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import comm
from dense import GPT, DataParallel, GPTConfig, gpt_loss
from dense.tensor_parallel import TPStats, apply_tensor_parallel, tp_full_state_dict
from dense.vocab_parallel import VocabParallelEmbedding, tp_gpt_loss, vocab_parallel_cross_entropy
from tests.support.tolerance import (
    assert_close,
    assert_same,
    cross_entropy_grad_tol,
    cross_entropy_tol,
    replay_tol,
)

CFG = GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=4, d_model=32)
GLOBAL_BATCH, T = 4, 16
STEPS = 5
SEED = 1234
# eps well above gradient noise: the keys' bias has a gradient that is 0 in exact arithmetic
# (softmax ignores a constant added to every score of a query) and ~1e-8 in float32, which
# Adam with a tiny eps would turn into updates of +-lr in random directions.
HYPER: dict[str, Any] = {"lr": 1e-3, "betas": (0.9, 0.95), "eps": 1e-4, "weight_decay": 0.1}
FLOAT = 4  # bytes per float32 element
WHY = "a few times the one-process reference's fp32 rounding error, measured in float64"


def fail(group: comm.ProcessGroup, msg: str) -> None:
    raise AssertionError(f"rank {group.rank}/{group.size} ({group.backend}): {msg}")


def expect_error(group: comm.ProcessGroup, what: str, match: str, fn: Any) -> None:
    try:
        fn()
    except ValueError as e:
        if match not in str(e):
            fail(group, f"{what}: error {e!r} does not say {match!r}")
        return
    fail(group, f"{what}: no ValueError")


def case_errors(group: comm.ProcessGroup) -> None:
    tp = group.size
    if tp > 1:
        one_head = GPTConfig(vocab_size=64, block_size=8, n_layer=1, n_head=1, d_model=8)
        expect_error(group, "1 head", f"n_head = 1 is not divisible by the tp group size {tp}",
                     lambda: apply_tensor_parallel(GPT(one_head), group))  # fmt: skip
        odd_vocab = GPTConfig(vocab_size=65, block_size=8, n_layer=1, n_head=4, d_model=8)
        expect_error(group, "vocab 65", "vocab_size = 65 is not divisible by the tp group size",
                     lambda: apply_tensor_parallel(GPT(odd_vocab), group))  # fmt: skip
        expect_error(group, "table 65", "vocabulary size 65 is not divisible",
                     lambda: VocabParallelEmbedding(nn.Embedding(65, 4), group))  # fmt: skip
    logits = torch.zeros(2, 3, 64 // tp)
    bad = torch.tensor([[0, 1, 64], [2, 3, 4]])
    expect_error(group, "target 64", "token ids must be in [0, 64), got values in [0, 64]",
                 lambda: vocab_parallel_cross_entropy(logits, bad, group))  # fmt: skip
    expect_error(group, "targets [2, 2]", "targets [B, T], got local_logits (2, 3,",
                 lambda: vocab_parallel_cross_entropy(logits, bad[:, :2], group))  # fmt: skip
    table = VocabParallelEmbedding(nn.Embedding(64, 4), group)
    expect_error(group, "id -1", "token ids must be in [0, 64), got values in [-1, 63]",
                 lambda: table(bad - 1))  # fmt: skip


def case_vocab(group: comm.ProcessGroup) -> None:
    tp, r = group.size, group.rank
    v, d, n = 64, 8, 2 * 5
    shard = slice(r * v // tp, (r + 1) * v // tp)
    gen = torch.Generator().manual_seed(7)
    full = (3 * torch.randn(2, 5, v, generator=gen)).requires_grad_()
    targets = torch.randint(0, v, (2, 5), generator=gen)
    targets[0, :tp] = torch.arange(tp) * (v // tp)  # every rank owns some target
    local = full.detach()[:, :, shard].clone().requires_grad_()
    stats = TPStats()
    loss = vocab_parallel_cross_entropy(local, targets, group, stats=stats)
    ref = F.cross_entropy(full.reshape(-1, v), targets.reshape(-1))
    (2 * loss).backward()
    (2 * ref).backward()
    assert full.grad is not None and local.grad is not None
    why = "the cross entropy's rounding bound in two orders"
    close(group, "cross entropy", loss, ref, cross_entropy_tol(full, targets), why)
    close(group, "cross entropy gradient", local.grad, full.grad[:, :, shard],
          cross_entropy_grad_tol(n, v, upstream=2.0), why)  # fmt: skip
    if stats.bytes_by_site.get("loss", 0) != (3 * n * FLOAT if tp > 1 else 0):
        fail(group, f"loss bytes {stats.bytes_by_site} != 3 * {n} * 4")

    emb = nn.Embedding(v, d)
    with torch.no_grad():
        emb.weight.copy_(torch.randn(v, d, generator=gen))  # the same table on every rank
    table = VocabParallelEmbedding(emb, group, stats=stats)
    ids = torch.randint(0, v, (2, 5), generator=gen)
    upstream = torch.randn(2, 5, d, generator=gen)
    mine, want = table(ids), emb(ids)
    # Each row comes from the one rank holding it (times 1) plus the others' zeros.
    same(group, "embedding", mine, want, "one rank's copy of the row plus exact zeros")
    (mine * upstream).sum().backward()
    (want * upstream).sum().backward()
    assert table.weight.grad is not None and emb.weight.grad is not None
    why = "the shard's rows sum the same upstream rows in the same order, plus exact zeros"
    same(group, "embedding gradient", table.weight.grad, emb.weight.grad[shard], why)
    if stats.bytes_by_site.get("embedding", 0) != (n * d * FLOAT if tp > 1 else 0):
        fail(group, f"embedding bytes {stats.bytes_by_site} != {n} * {d} * 4")
    same(group, "gathered table", table.full_parameters()["weight"], emb.weight.detach(),
         "the shards are copies of the table's rows")  # fmt: skip


def close(
    group: comm.ProcessGroup, what: str, a: torch.Tensor, b: torch.Tensor, tol: float, why: str
) -> float:
    """``a`` within ``tol`` of the one-process ``b``; the largest difference."""
    try:
        assert_close(a.detach(), b.detach(), atol=tol, what=what, why=why)
    except AssertionError as e:
        fail(group, f"{str(e).splitlines()[0]}, against the one-process reference")
    return float((a.detach().double() - b.detach().double()).abs().max())


def same(group: comm.ProcessGroup, what: str, a: torch.Tensor, b: torch.Tensor, why: str) -> None:
    try:
        assert_same(a.detach(), b.detach(), what=what, why=why)
    except AssertionError as e:
        fail(group, str(e))


class LM(nn.Module):
    """Token table + GPT: ``forward(ids [B, T]) -> logits [B, T, V]`` (or V/tp after TP).

    Every parameter gets N(0, 0.3^2) added to GPT-2's init: at that init the attention
    barely changes the loss (weights of std 0.02), so a mistake in how the heads are
    split would hide under the tolerance."""

    def __init__(self) -> None:
        super().__init__()
        self.tok = nn.Embedding(CFG.vocab_size, CFG.d_model)
        self.gpt = GPT(CFG)
        with torch.no_grad():
            for p in self.parameters():
                p.add_(0.3 * torch.randn(p.shape))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.gpt(self.tok(ids))
        return out


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(100 + step)
    ids = torch.randint(0, CFG.vocab_size, (GLOBAL_BATCH, T + 1), generator=gen)
    return ids[:, :T], ids[:, 1:]  # inputs, next-token targets: [B, T] each


def expected_bytes(local_batch: int) -> dict[str, int]:
    """One step's TP allreduce payload at tp > 1, by site: per block, attention and MLP
    each one [b, T, D] forward and one backward; the head's input gradient [b, T, D];
    the token table's output [b, T, D]; the loss's max [b, T] and (sum-exp, target
    logit) [2, b, T]."""
    btd = local_batch * T * CFG.d_model * FLOAT
    return {
        "attn": 2 * CFG.n_layer * btd,
        "mlp": 2 * CFG.n_layer * btd,
        "head": btd,
        "embedding": btd,
        "loss": 3 * local_batch * T * FLOAT,
    }


def case_train(group: comm.ProcessGroup, dp: int) -> None:
    tp = group.size // dp
    mesh = comm.DeviceMesh(group, {"dp": dp, "tp": tp})
    tp_group, dp_group = mesh.group("tp"), mesh.group("dp")
    what = f"dp {dp} x tp {tp}"
    torch.manual_seed(SEED)
    ref = LM()
    ref64 = copy.deepcopy(ref).double()  # the same computation in float64: the tolerances
    torch.manual_seed(SEED)
    lm = LM()
    stats = TPStats()
    lm.tok = VocabParallelEmbedding(lm.tok, tp_group, stats=stats)  # type: ignore[assignment]
    apply_tensor_parallel(lm.gpt, tp_group, stats=stats)
    model: nn.Module = DataParallel(lm, dp_group) if dp > 1 else lm
    opt = torch.optim.AdamW(lm.parameters(), **HYPER)
    ref_opt = torch.optim.AdamW(ref.parameters(), **HYPER)
    ref64_opt = torch.optim.AdamW(ref64.parameters(), **HYPER)
    local = GLOBAL_BATCH // dp
    rows = slice(mesh.coord("dp") * local, (mesh.coord("dp") + 1) * local)
    loss_err = weight_err = 0.0
    for step in range(STEPS):
        ids, targets = batch(step)
        stats.reset()
        loss = tp_gpt_loss(model(ids[rows]), targets[rows], tp_group, stats=stats)
        loss.backward()
        if isinstance(model, DataParallel):
            model.finish()
        opt.step()
        opt.zero_grad()
        want = expected_bytes(local) if tp > 1 else {}
        blocks = 4 * CFG.n_layer * local * T * CFG.d_model * FLOAT if tp > 1 else 0
        if (
            stats.bytes_by_site != want
            or stats.bytes_allreduced != sum(want.values())
            or stats.bytes_of("attn", "mlp") != blocks
        ):
            fail(group, f"{what} step {step}: TP bytes {stats.bytes_by_site}, expected {want}")
        ref_losses, logits64 = [], None
        for net, net_opt in ((ref, ref_opt), (ref64, ref64_opt)):
            logits = net(ids)
            ref_loss = gpt_loss(logits, targets)
            ref_loss.backward()
            net_opt.step()
            net_opt.zero_grad()
            ref_losses.append(ref_loss.detach())
            logits64 = logits.detach()
        assert logits64 is not None
        global_loss = dp_group.allreduce(loss.detach().clone().reshape(1), op="avg")
        # At least the cross entropy's own bound: one measured error of a scalar is a poor
        # sample, and the TP loss sums the vocabulary in shards.
        tol = max(replay_tol(*ref_losses), cross_entropy_tol(logits64, targets))
        loss_err = max(loss_err, close(group, f"{what} step {step} loss", global_loss[0],
                                       ref_losses[0], tol, WHY))  # fmt: skip
    full = tp_full_state_dict(lm)  # collective over the tp group
    want_state = ref.state_dict()
    want64 = ref64.state_dict()
    if set(full) != set(want_state):
        fail(group, f"{what}: gathered names {sorted(full)} != {sorted(want_state)}")
    for name, t in want_state.items():
        if full[name].shape != t.shape:
            fail(
                group, f"{what}: {name} gathered as {tuple(full[name].shape)}, not {tuple(t.shape)}"
            )
        tol = replay_tol(t, want64[name])
        weight_err = max(weight_err, close(group, f"{what}: final {name}", full[name], t, tol, WHY))
    print(
        f"rank {group.rank}/{group.size} {group.backend} tp {what}: ok (largest difference "
        f"from one process: loss {loss_err:.2g}, weights {weight_err:.2g})",
        flush=True,
    )


def run(group: comm.ProcessGroup, args: list[str]) -> None:
    """Case ``args[0]`` (only ``all``) on ``group`` (also called by battery.py)."""
    if args != ["all"]:
        raise ValueError(f"unknown case {args!r}; expected ['all']")
    case_errors(group)
    case_vocab(group)
    case_train(group, dp=1)
    if group.size == 4:
        case_train(group, dp=2)
    print(f"rank {group.rank}/{group.size} {group.backend} tp: ok", flush=True)


if __name__ == "__main__":  # tests may import this file for its helpers
    from tests.support.ranks.rank_main import run_main

    run_main(run)
