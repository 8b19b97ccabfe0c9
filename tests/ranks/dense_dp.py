"""Rank script: dense.DataParallel equals one process on the global batch.

Cases (``argv[1]``):

* ``main``: every rank starts from a DIFFERENT random init (so the broadcast from
  rank 0 matters), trains STEPS steps of SGD with momentum on its slice of the
  global batch through a DataParallel with tiny buckets; a plain torch copy of
  rank 0's init trains on the whole global batch in the same process. Gradients
  and weights must agree to 1e-5 after every step, and all replicas must be
  bit-identical. One branch of the model is used only on some ranks in some
  steps (unused parameters: zeros, no hang). Then the overlap check: on a deeper
  MLP, early buckets' allreduces are issued before backward reaches the input.
  Then bad input: bucket_mb <= 0 on one rank, or different parameter shapes on
  different ranks, raise ValueError on every rank.
* ``codec NAME...``: the same training through each ``comm.compression`` codec;
  ``none`` must match exactly (1e-5), lossy codecs loosely (the weights move
  the same way: relative error < 0.2).

Backend from ``HYBRIDREC_TEST_BACKEND`` (set by tests/multiproc.py).
"""

from __future__ import annotations

import time

import torch
from torch import nn

import comm
from dense import DataParallel

GLOBAL_BATCH = 8  # divisible by 1, 2 and 4 ranks
STEPS = 5
IN = 6


class Net(nn.Module):
    """An MLP plus an ``extra`` head that a rank uses only in some steps."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(IN, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh())
        self.head = nn.Linear(16, 1)
        self.extra = nn.Linear(IN, 1)
        self.frozen = nn.Parameter(torch.ones(3), requires_grad=False)

    def forward(self, x: torch.Tensor, use_extra: bool) -> torch.Tensor:
        out = self.head(self.body(x)).squeeze(1)  # [B]
        if use_extra:
            out = out + self.extra(x).squeeze(1)
        return out


# Relative gradient tolerance per codec; None: unbiased-but-noisy codecs, checked only
# for finite values and identical replicas (their accuracy is comm.compression's test).
CODEC_TOL: dict[str, float | None] = {"none": 1e-5, "fp16": 2e-3, "bf16": 2e-2}


def uses_extra(step: int, rank: int) -> bool:
    return (step + rank) % 3 == 0  # at 1 rank: unused in some steps everywhere


def fail(group: comm.ProcessGroup, msg: str) -> None:
    raise AssertionError(f"rank {group.rank}/{group.size} ({group.backend}): {msg}")


def check_replicas_equal(group: comm.ProcessGroup, module: nn.Module) -> None:
    flat = torch.cat([p.detach().reshape(-1) for p in module.parameters()])
    every = group.allgather(flat)  # [size, n]
    if not all(torch.equal(every[0], every[r]) for r in range(group.size)):
        fail(group, "replicas differ after a step")


def train_and_compare(group: comm.ProcessGroup, compression: str | None, tol: float | None) -> None:
    rank, size = group.rank, group.size
    local = GLOBAL_BATCH // size
    torch.manual_seed(100)
    ref = Net()  # rank 0's init, trained on the global batch in this process
    torch.manual_seed(100 + rank)
    mine = Net()
    dp = DataParallel(mine, group, bucket_mb=300 / 2**20, compression=compression)
    if len(dp.buckets) < 3:
        fail(group, f"expected several buckets, got {len(dp.buckets)}")
    if dp.synced_parameters and any(p is mine.frozen for p in dp.synced_parameters):
        fail(group, "a requires_grad=False parameter is synced")
    for a, b in zip(mine.parameters(), ref.parameters(), strict=True):
        if not torch.equal(a, b):
            fail(group, "parameters differ from rank 0's init after wrapping")
    opt = torch.optim.SGD(mine.parameters(), lr=0.1, momentum=0.9)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    gen = torch.Generator().manual_seed(7)
    for step in range(STEPS):
        x = torch.randn(GLOBAL_BATCH, IN, generator=gen)
        y = torch.randn(GLOBAL_BATCH, generator=gen)
        # Reference: the mean over ranks of each rank's mean loss on its slice (= global mean).
        ref_loss = torch.zeros(())
        for r in range(size):
            sl = slice(r * local, (r + 1) * local)
            pred = ref(x[sl], uses_extra(step, r))
            ref_loss = ref_loss + ((pred - y[sl]) ** 2).mean() / size
        ref_loss.backward()
        for p in ref.parameters():
            if p.requires_grad and p.grad is None:
                p.grad = torch.zeros_like(p)  # DataParallel's contract: unused -> zeros
        sl = slice(rank * local, (rank + 1) * local)
        loss = ((dp(x[sl], uses_extra(step, rank)) - y[sl]) ** 2).mean()
        loss.backward()
        dp.finish()  # no-op: the autograd callback already finished
        for (name, a), b in zip(mine.named_parameters(), ref.parameters(), strict=True):
            if not a.requires_grad:
                continue
            if a.grad is None or b.grad is None:
                fail(group, f"step {step}: {name} has no gradient after finish()")
            assert a.grad is not None and b.grad is not None
            if not bool(torch.isfinite(a.grad).all()):
                fail(group, f"step {step}: gradient of {name} is not finite")
            if tol is None:
                continue
            err = float((a.grad - b.grad).abs().max() / (b.grad.abs().max() + 1e-12))
            if err > tol:
                fail(group, f"step {step}: gradient of {name} off by {err:.3g} (relative)")
        opt.step()
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
        check_replicas_equal(group, mine)
        if tol is None:
            continue
        for (name, a), b in zip(mine.named_parameters(), ref.parameters(), strict=True):
            err = float((a.detach() - b.detach()).abs().max())
            if err > (1e-5 if tol <= 1e-5 else 10 * tol):
                fail(group, f"step {step}: weight {name} differs from reference by {err:.3g}")
    if compression is not None and dp.codec is None:
        fail(group, "compression was asked for but no codec is in use")


def check_overlap(group: comm.ProcessGroup) -> None:
    """Early buckets' collectives are issued before backward reaches the first layer."""
    torch.manual_seed(3)
    layers: list[nn.Module] = []
    for _ in range(6):
        layers += [nn.Linear(128, 128), nn.ReLU()]
    model = nn.Sequential(*layers, nn.Linear(128, 1))
    dp = DataParallel(model, group, bucket_mb=0.07)  # ~one 64 KB weight per bucket
    x = torch.randn(64, 128, requires_grad=True)
    seen: dict[str, float] = {}

    def input_grad_hook(grad: torch.Tensor) -> None:
        seen.setdefault("end", time.perf_counter())

    x.register_hook(input_grad_hook)
    dp(x).sum().backward()
    end = seen["end"]
    order = [b for b, _ in dp.last_launches]
    if order != list(range(len(dp.buckets))):
        fail(group, f"buckets issued out of order: {order}")
    early = [b for b, t in dp.last_launches if t < end]
    if len(early) < len(dp.buckets) // 2:
        fail(
            group,
            f"only buckets {early} of {len(dp.buckets)} were issued before backward ended",
        )


def expect_value_error_everywhere(group: comm.ProcessGroup, what: str, make: object) -> None:
    try:
        make()  # type: ignore[operator]
    except ValueError as e:
        print(f"rank {group.rank}: {what}: ValueError: {e}", flush=True)
        return
    fail(group, f"{what}: no ValueError")


def check_bad_input(group: comm.ProcessGroup) -> None:
    rank = group.rank
    bad_rank = group.size - 1
    expect_value_error_everywhere(
        group,
        "bucket_mb <= 0",
        lambda: DataParallel(nn.Linear(4, 5), group, bucket_mb=0.0 if rank == bad_rank else 1.0),
    )
    if group.size > 1:
        expect_value_error_everywhere(
            group,
            "mismatched shapes",
            lambda: DataParallel(nn.Linear(4, 6 if rank == bad_rank else 5), group),
        )
    # The group still works afterwards: nothing half-done.
    t = torch.ones(3)
    group.allreduce(t)
    if not torch.equal(t, torch.full((3,), float(group.size))):
        fail(group, f"group broken after the errors: {t.tolist()}")


def run(group: comm.ProcessGroup, args: list[str]) -> None:
    """Case ``args[0]`` ("main" or "codec" NAME...) on ``group`` (also called by battery.py)."""
    case = args[0] if args else "main"
    if case == "main":
        train_and_compare(group, None, 1e-5)
        check_overlap(group)
        check_bad_input(group)
    elif case == "codec":
        for name in args[1:]:
            train_and_compare(group, name, CODEC_TOL.get(name))
            print(f"rank {group.rank}: codec {name} ok", flush=True)
    else:
        raise ValueError(f"unknown case {case!r}")
    print(f"rank {group.rank}/{group.size} {group.backend} {case}: ok", flush=True)


if __name__ == "__main__":  # tests may import this file for its helpers
    from rank_main import run_main

    run_main(run)
