"""Rank script: dense.DataParallel equals one process on the global batch.

Cases (``argv[1]``):

* ``main``: every rank starts from a DIFFERENT random init (so the broadcast from
  rank 0 matters), trains STEPS steps of SGD with momentum on its slice of the
  global batch through a DataParallel with tiny buckets; a plain torch copy of
  rank 0's init trains on the whole global batch in the same process. Gradients
  and weights agree after every step within a few times that reference's own fp32
  rounding error, measured by replaying it in float64 (``tests/support/tolerance.py``: the
  ranks sum their gradients in another order than one process's backward), and all
  replicas are bit-identical. One branch of the model is used only on some ranks in some
  steps (unused parameters: zeros, no hang). Then the overlap check: on a deeper
  MLP, early buckets' allreduces are issued before backward reaches the input.
  Then bad input: bucket_mb <= 0 on one rank, or different parameter shapes on
  different ranks, raise ValueError on every rank.
* ``codec NAME...``: the same training through each ``comm.compression`` codec;
  ``none`` as the plain allreduce (the same tolerance), the fp16 and bf16 casts within a
  few of their unit roundoffs (relative to the largest gradient), the random and
  sparsifying codecs only finite and with identical replicas.

Backend from ``HYBRIDREC_TEST_BACKEND`` (set by tests/support/multiproc.py).
"""

from __future__ import annotations

import copy
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

import comm
from dense import DataParallel
from tests.support.tolerance import (
    assert_close,
    assert_same,
    gamma,
    replay_tol,
    sum_tol,
    unit_roundoff,
)

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


WHY = "a few times the one-process reference's fp32 rounding error, measured in float64"
# The casting codecs: the dtype every rank's gradient is rounded to. Their error is not
# the CPU's rounding but the cast's, so each step is checked on its own (see cast_step):
# from the same weights and momentum, the averaged gradient is within u of that dtype of
# sum_r |g_r| (g_r: slice r's part of the global gradient), and the weights within lr
# times that. (Along the whole run the casts' errors compound through the weights.)
CAST_DTYPE: dict[str, torch.dtype] = {"fp16": torch.float16, "bf16": torch.bfloat16}
LR, MOMENTUM = 0.1, 0.9
# The random and sparsifying codecs: unbiased or error-fed but far from the average in
# one step; checked only for finite values and identical replicas (their accuracy is
# comm.compression's test).
EXACT_CODECS = ("none",)


def uses_extra(step: int, rank: int) -> bool:
    return (step + rank) % 3 == 0  # at 1 rank: unused in some steps everywhere


def fail(group: comm.ProcessGroup, msg: str) -> None:
    raise AssertionError(f"rank {group.rank}/{group.size} ({group.backend}): {msg}")


def check_replicas_equal(group: comm.ProcessGroup, module: nn.Module) -> None:
    flat = torch.cat([p.detach().reshape(-1) for p in module.parameters()])
    every = group.allgather(flat)  # [size, n]
    for r in range(1, group.size):
        try:
            assert_same(every[r], every[0], what=f"replica {r} vs replica 0 after a step",
                        why="every rank applies the same averaged gradient bits with the "
                        "same optimizer to the same broadcast weights")  # fmt: skip
        except AssertionError as e:
            fail(group, str(e))


@dataclass(frozen=True)
class Reference:
    """One process on the global batch (the mean over ranks of each rank's mean loss on its
    slice), in float32 and replayed in float64: per step the gradients (before the
    optimizer step) and the weights (after it), by parameter name."""

    grads: list[dict[str, torch.Tensor]]
    weights: list[dict[str, torch.Tensor]]
    grads64: list[dict[str, torch.Tensor]]
    weights64: list[dict[str, torch.Tensor]]


def _replay(
    size: int, dtype: torch.dtype
) -> tuple[list[dict[str, torch.Tensor]], list[dict[str, torch.Tensor]]]:
    local = GLOBAL_BATCH // size
    torch.manual_seed(100)
    ref = Net().to(dtype)  # rank 0's init
    opt = torch.optim.SGD(ref.parameters(), lr=LR, momentum=MOMENTUM)
    gen = torch.Generator().manual_seed(7)
    grads, weights = [], []
    for step in range(STEPS):
        x = torch.randn(GLOBAL_BATCH, IN, generator=gen).to(dtype)
        y = torch.randn(GLOBAL_BATCH, generator=gen).to(dtype)
        loss = torch.zeros((), dtype=dtype)
        for r in range(size):
            sl = slice(r * local, (r + 1) * local)
            pred = ref(x[sl], uses_extra(step, r))
            loss = loss + ((pred - y[sl]) ** 2).mean() / size
        loss.backward()
        for p in ref.parameters():
            if p.requires_grad and p.grad is None:
                p.grad = torch.zeros_like(p)  # DataParallel's contract: unused -> zeros
        grads.append({n: p.grad.clone() for n, p in ref.named_parameters() if p.grad is not None})
        opt.step()
        opt.zero_grad()
        weights.append({n: p.detach().clone() for n, p in ref.named_parameters()})
    return grads, weights


def reference(size: int) -> Reference:
    g32, w32 = _replay(size, torch.float32)
    g64, w64 = _replay(size, torch.float64)
    return Reference(g32, w32, g64, w64)


def check(
    group: comm.ProcessGroup,
    what: str,
    got: torch.Tensor,
    want: torch.Tensor,
    atol: float,
    why: str,
) -> None:
    try:
        assert_close(got.detach(), want, atol=atol, what=what, why=why)
    except AssertionError as e:
        fail(group, str(e).splitlines()[0])


class CastStep:
    """One step of the casting codec ``cast`` checked on its own: before the step, a copy
    of this rank's model and optimizer takes the step with the global batch's gradient
    summed from each rank's slice in fp32 (``shadow``), and the tolerances follow.

    DataParallel's average is ``sum_r fl(G_r) / size`` (``G_r``: rank r's gradient of its
    mean loss, ``size`` times its part ``g_r`` of the global one), so it is within
    ``u * sum_r |g_r|`` of ``sum_r g_r`` (plus half the cast dtype's subnormal spacing),
    plus fp32's rounding of both sums and the scaling (``gamma_{size+3}`` of the same
    magnitude). SGD's new buffer ``0.9 m + g`` starts from the same ``m``, so the weights
    are within ``lr`` times that, plus the update's own roundings."""

    def __init__(
        self,
        mine: nn.Module,
        opt: torch.optim.Optimizer,
        cast: torch.dtype,
        shadow: nn.Module,
        slice_loss: Callable[[nn.Module, int], torch.Tensor],
        size: int,
    ) -> None:
        """``shadow``: a fresh model like ``mine`` (its weights are loaded here);
        ``slice_loss(model, r)``: rank r's mean loss on its slice."""
        self.shadow = shadow
        self.shadow.load_state_dict(mine.state_dict())
        shadow_opt = torch.optim.SGD(self.shadow.parameters(), lr=LR, momentum=MOMENTUM)
        shadow_opt.load_state_dict(copy.deepcopy(opt.state_dict()))  # the buffers: copies
        params = [p for p in self.shadow.parameters() if p.requires_grad]
        total = [torch.zeros_like(p) for p in params]
        mag = [torch.zeros_like(p) for p in params]
        for r in range(size):
            loss = slice_loss(self.shadow, r) / size
            parts: Any = torch.autograd.grad(loss, params, allow_unused=True)
            for t, m, g in zip(total, mag, parts, strict=True):
                if g is not None:
                    t.add_(g)
                    m.add_(g.abs())
        names = [n for n, p in self.shadow.named_parameters() if p.requires_grad]
        self.grads = dict(zip(names, total, strict=True))
        rel = unit_roundoff(cast) + gamma(size + 3, torch.float32)
        floor = unit_roundoff(cast) * float(torch.finfo(cast).tiny)  # subnormals: absolute
        self.grad_tol = {n: rel * float(m.max()) + floor for n, m in zip(names, mag, strict=True)}
        for p, g in zip(params, total, strict=True):
            p.grad = g.clone()
        shadow_opt.step()

    def weight_tol(self, name: str) -> float:
        w = float(dict(self.shadow.named_parameters())[name].detach().abs().max())
        # the buffer update, the lr product, the subtraction: 3 roundings of the weights
        return LR * self.grad_tol.get(name, 0.0) + sum_tol(torch.float32, 3, w)


def train_and_compare(group: comm.ProcessGroup, compression: str | None) -> None:
    rank, size = group.rank, group.size
    local = GLOBAL_BATCH // size
    ref = reference(size)
    torch.manual_seed(100)
    init = Net()  # rank 0's init
    torch.manual_seed(100 + rank)
    mine = Net()
    dp = DataParallel(mine, group, bucket_mb=300 / 2**20, compression=compression)
    if len(dp.buckets) < 3:
        fail(group, f"expected several buckets, got {len(dp.buckets)}")
    if dp.synced_parameters and any(p is mine.frozen for p in dp.synced_parameters):
        fail(group, "a requires_grad=False parameter is synced")
    for (name, a), b in zip(mine.named_parameters(), init.parameters(), strict=True):
        try:
            assert_same(a.detach(), b.detach(), what=f"{name} after wrapping vs rank 0's init",
                        why="the wrapper broadcasts rank 0's tensors: a copy")  # fmt: skip
        except AssertionError as e:
            fail(group, str(e))
    exact = compression is None or compression in EXACT_CODECS
    cast = CAST_DTYPE.get(compression or "")
    opt = torch.optim.SGD(mine.parameters(), lr=LR, momentum=MOMENTUM)
    gen = torch.Generator().manual_seed(7)
    for step in range(STEPS):
        x = torch.randn(GLOBAL_BATCH, IN, generator=gen)
        y = torch.randn(GLOBAL_BATCH, generator=gen)

        def slice_loss(
            model: nn.Module, r: int, x: torch.Tensor = x, y: torch.Tensor = y, step: int = step
        ) -> torch.Tensor:
            sl = slice(r * local, (r + 1) * local)
            return ((model(x[sl], uses_extra(step, r)) - y[sl]) ** 2).mean()

        shadow = None
        if cast is not None:
            shadow = CastStep(mine, opt, cast, Net(), slice_loss, size)
        sl = slice(rank * local, (rank + 1) * local)
        loss = ((dp(x[sl], uses_extra(step, rank)) - y[sl]) ** 2).mean()
        loss.backward()
        dp.finish()  # no-op: the autograd callback already finished
        for name, a in mine.named_parameters():
            if not a.requires_grad:
                continue
            if a.grad is None:
                fail(group, f"step {step}: {name} has no gradient after finish()")
            assert a.grad is not None
            if not bool(torch.isfinite(a.grad).all()):
                fail(group, f"step {step}: gradient of {name} is not finite")
            want, want64 = ref.grads[step][name], ref.grads64[step][name]
            what = f"step {step}: gradient of {name}"
            if exact:
                # floor: the rank average adds size - 1 additions and a division.
                tol = replay_tol(want, want64, floor_terms=size + 1)
                check(group, what, a.grad, want, tol, WHY)
            elif shadow is not None:
                why = f"{compression}: one cast per rank, from the same weights"
                check(group, what, a.grad, shadow.grads[name], shadow.grad_tol[name], why)
        opt.step()
        opt.zero_grad()
        check_replicas_equal(group, mine)
        for name, a in mine.named_parameters():
            want, want64 = ref.weights[step][name], ref.weights64[step][name]
            what = f"step {step}: weight {name}"
            if exact:
                check(group, what, a, want, replay_tol(want, want64), WHY)
            elif shadow is not None:
                why = f"{compression}: lr times the gradient's bound, from the same weights"
                want = dict(shadow.shadow.named_parameters())[name].detach()
                check(group, what, a, want, shadow.weight_tol(name), why)
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
        train_and_compare(group, None)
        check_overlap(group)
        check_bad_input(group)
    elif case == "codec":
        for name in args[1:]:
            train_and_compare(group, name)
            print(f"rank {group.rank}: codec {name} ok", flush=True)
    else:
        raise ValueError(f"unknown case {case!r}")
    print(f"rank {group.rank}/{group.size} {group.backend} {case}: ok", flush=True)


if __name__ == "__main__":  # tests may import this file for its helpers
    from tests.support.ranks.rank_main import run_main

    run_main(run)
