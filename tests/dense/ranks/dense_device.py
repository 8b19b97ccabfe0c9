"""Rank script: DataParallel, ZeRO stages 1 and 2 and Zero3 with the model on a device
equal one process on the global batch.

``run(group, [device])``: ``device`` is ``cuda`` (this rank's GPU by local rank: two
ranks may share one; over mpi and gloo the buckets and shards are staged through
pinned host blocks) or ``cpu``, where ``force_staging`` (tests/support/staged_groups.py)
sends the CPU tensors through that same staging path, so it runs without a GPU.

Every rank starts from a different init (the wrappers broadcast rank 0's), trains
STEPS steps on its slice of the global batch; a plain torch copy of rank 0's init,
on the same device, trains on the whole batch in this process, and a float64 twin of it
measures its rounding error. Weights (and for DataParallel the averaged gradients)
agree after every step within a few times that error (``tests/support/tolerance.py``), and
every gradient, shard and flat buffer lives on the device. DataParallel also runs with
the fp16 codec (each step within the bound of its casts from the same weights, see
``dense_dp.CastStep``) and TernGrad (finite, replicas identical): the codecs run on the
device. Staged runs check that the pool stops allocating after the first step (its
blocks are reused).
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

import comm
from dense import DataParallel, Zero3, ZeroOptimizer
from tests.dense.ranks.dense_dp import LR, MOMENTUM, CastStep
from tests.support.staged_groups import force_staging
from tests.support.tolerance import assert_close, assert_same, replay_tol

GLOBAL_BATCH = 8  # divisible by 1, 2 and 4 ranks
STEPS = 3
IN = 6
ADAM: dict[str, Any] = {"lr": 0.05, "betas": (0.8, 0.95), "eps": 1e-6}
WHY = "a few times the one-process reference's fp32 rounding error, measured in float64"


class Net(nn.Module):
    """Blocks in a ModuleList (one Zero3 unit each), a head, and a parameter of its own."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([nn.Linear(IN, 16), nn.Linear(16, 16), nn.Linear(16, 8)])
        self.head = nn.Linear(8, 1)
        self.gain = nn.Parameter(torch.tensor([1.5, 0.5]))  # [2]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = torch.tanh(block(x))
        return self.head(x).squeeze(1) * self.gain.sum()  # [B]


def fail(group: comm.ProcessGroup, what: str, msg: str) -> None:
    raise AssertionError(f"rank {group.rank}/{group.size} ({group.backend}) {what}: {msg}")


def batch(step: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(500 + step)
    x, y = torch.randn(GLOBAL_BATCH, IN, generator=gen), torch.randn(GLOBAL_BATCH, generator=gen)
    return x.to(device), y.to(device)


def slice_loss(
    group: comm.ProcessGroup,
    model: Callable[[torch.Tensor], torch.Tensor],
    step: int,
    dev: Any,
    rank: int,
) -> torch.Tensor:
    """Rank ``rank``'s mean loss on its slice of the batch of ``step``."""
    x, y = batch(step, dev)
    n = GLOBAL_BATCH // group.size
    sl = slice(rank * n, (rank + 1) * n)
    return ((model(x[sl]) - y[sl]) ** 2).mean()


def local_loss(
    group: comm.ProcessGroup, model: Callable[[torch.Tensor], torch.Tensor], step: int, dev: Any
) -> torch.Tensor:
    return slice_loss(group, model, step, dev, group.rank)


def ref_loss(group: comm.ProcessGroup, model: nn.Module, step: int, dev: Any) -> torch.Tensor:
    """The mean over ranks of each rank's mean loss on its slice (= the global mean), in
    the model's dtype."""
    x, y = batch(step, dev)
    dt = model.head.weight.dtype
    x, y = x.to(dt), y.to(dt)
    n = GLOBAL_BATCH // group.size
    total = torch.zeros((), device=dev, dtype=dt)
    for r in range(group.size):
        sl = slice(r * n, (r + 1) * n)
        total = total + ((model(x[sl]) - y[sl]) ** 2).mean() / group.size
    return total


def models(
    group: comm.ProcessGroup, device: torch.device
) -> tuple[nn.Module, nn.Module, nn.Module]:
    """(this rank's model with its own init, the reference with rank 0's init, its
    float64 twin), on device."""
    torch.manual_seed(100)
    ref = Net().to(device)
    torch.manual_seed(100 + group.rank)
    return Net().to(device), ref, copy.deepcopy(ref).double()


def compare(
    group: comm.ProcessGroup,
    what: str,
    mine: dict[str, torch.Tensor],
    want: dict[str, torch.Tensor],
    device: torch.device,
    tol: Callable[[str], tuple[float, str] | None],
) -> None:
    """Every tensor of ``mine`` is on ``device``, within ``tol(name)`` (a tolerance and its
    reason; None: any value) of ``want``, and the same on every rank."""
    for name, b in want.items():
        a = mine[name]
        if a.device != device:
            fail(group, what, f"{name} is on {a.device}, expected {device}")
        reason = tol(name)
        if reason is None:
            continue
        atol, why = reason
        try:
            assert_close(a.detach().cpu(), b.detach().cpu(), atol=atol, what=name, why=why)
        except AssertionError as e:
            fail(group, what, f"{str(e).splitlines()[0]}, against one process")
    flat = torch.cat([mine[n].detach().reshape(-1) for n in want])
    every = group.allgather(flat)  # [size, n]
    for r in range(1, group.size):
        try:
            assert_same(every[r], every[0], what=f"replica {r} vs replica 0",
                        why="every rank applies the same reduced bits in the same way")  # fmt: skip
        except AssertionError as e:
            fail(group, what, str(e))


def replayed(want: dict[str, torch.Tensor], want64: dict[str, torch.Tensor]) -> Any:
    """The tolerance of :func:`compare` from the reference and its float64 twin."""

    def tol(name: str) -> tuple[float, str]:
        return replay_tol(want[name].detach().cpu(), want64[name].detach().cpu()), WHY

    return tol


def params(model: nn.Module) -> dict[str, torch.Tensor]:
    return dict(model.named_parameters())


def grads(model: nn.Module) -> dict[str, torch.Tensor]:
    out = {}
    for name, p in model.named_parameters():
        assert p.grad is not None, f"{name} has no gradient"
        out[name] = p.grad
    return out


def pool_blocks(group: comm.ProcessGroup) -> int:
    pool = group.staging_pool
    return 0 if pool is None else pool.stats["allocated"]


def check_pool_steady(group: comm.ProcessGroup, what: str, allocated: list[int]) -> None:
    """``allocated``: the pool's block count after each step; constant after the first."""
    if len(set(allocated[1:])) > 1:
        fail(group, what, f"the staging pool kept allocating: blocks after each step {allocated}")


def check_data_parallel(group: comm.ProcessGroup, device: torch.device, codec: str | None) -> None:
    what = f"DataParallel codec={codec}"
    mine, ref, ref64 = models(group, device)
    dp = DataParallel(mine, group, bucket_mb=600 / 2**20, compression=codec)  # several buckets
    if len(dp.buckets) < 3:
        fail(group, what, f"expected several buckets, got {len(dp.buckets)}")
    opt = torch.optim.SGD(mine.parameters(), lr=LR, momentum=MOMENTUM)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=LR, momentum=MOMENTUM)
    ref64_opt = torch.optim.SGD(ref64.parameters(), lr=LR, momentum=MOMENTUM)

    def anything(name: str) -> None:
        return None  # TernGrad: random, only finite and the same on every rank

    def lr_times(s: CastStep) -> Callable[[str], tuple[float, str]]:
        return lambda n: (s.weight_tol(n), "fp16: lr times its gradient's bound")

    blocks = []
    for step in range(STEPS):
        shadow = None
        if codec == "fp16":  # checked one step at a time, see dense_dp.CastStep
            shadow_model = Net().to(device)
            shadow = CastStep(mine, opt, torch.float16, shadow_model,
                              lambda m, r, step=step: slice_loss(group, m, step, device, r),
                              group.size)  # fmt: skip
        local_loss(group, dp, step, device).backward()
        dp.finish()  # no-op: the autograd callback finished the round
        ref_loss(group, ref, step, device).backward()
        ref_loss(group, ref64, step, device).backward()
        if any(flat.device != device for flat in dp._flat):
            fail(group, what, "a bucket buffer is off the device")
        if shadow is not None:
            compare(group, f"{what} gradients, step {step}", grads(mine), shadow.grads, device,
                    lambda n, s=shadow: (s.grad_tol[n], "fp16: one cast per rank"))  # fmt: skip
        else:
            tol = replayed(grads(ref), grads(ref64)) if codec is None else anything
            compare(group, f"{what} gradients, step {step}", grads(mine), grads(ref), device, tol)
        for o in (opt, ref_opt, ref64_opt):
            o.step()
            o.zero_grad()
        if shadow is not None:
            compare(group, f"{what} weights, step {step}", params(mine), params(shadow.shadow),
                    device, lr_times(shadow))  # fmt: skip
        else:
            tol = replayed(params(ref), params(ref64)) if codec is None else anything
            compare(group, f"{what} weights, step {step}", params(mine), params(ref), device, tol)
        if not all(bool(torch.isfinite(p).all()) for p in mine.parameters()):
            fail(group, what, f"step {step}: weights not finite")
        blocks.append(pool_blocks(group))
    check_pool_steady(group, what, blocks)
    dp.remove_hooks()


def check_zero(group: comm.ProcessGroup, device: torch.device, stage: int) -> None:
    what = f"ZeroOptimizer stage {stage}"
    mine, ref, ref64 = models(group, device)
    opt = ZeroOptimizer(torch.optim.Adam, mine.parameters(), group, stage=stage, **ADAM)
    ref_opts = [(r, torch.optim.Adam(r.parameters(), **ADAM)) for r in (ref, ref64)]
    blocks = []
    for step in range(STEPS):
        local_loss(group, mine, step, device).backward()
        opt.step()
        opt.zero_grad()
        for r, ref_opt in ref_opts:
            ref_loss(group, r, step, device).backward()
            ref_opt.step()
            ref_opt.zero_grad()
        compare(group, f"{what} step {step}", params(mine), params(ref), device,
                replayed(params(ref), params(ref64)))  # fmt: skip
        for flat in opt._flats:
            if flat.shard.device != device:
                fail(group, what, f"a shard is on {flat.shard.device}")
        for st in opt.optimizer.state.values():
            for key, v in st.items():
                if isinstance(v, torch.Tensor) and v.dim() and v.device != device:
                    fail(group, what, f"optimizer state {key} is on {v.device}")
        blocks.append(pool_blocks(group))
    check_pool_steady(group, what, blocks)
    # The global state gathers on the device and saves from there.
    state = opt.state_dict()
    if not state["tensors"] or any(
        t.dim() and t.device != device for t in state["tensors"].values()
    ):
        fail(group, what, "state_dict: no state, or state off the device")


def check_zero3(group: comm.ProcessGroup, device: torch.device) -> None:
    what = "Zero3"
    mine, ref, ref64 = models(group, device)
    z = Zero3(mine, group, torch.optim.AdamW, **ADAM)
    ref_opts = [(r, torch.optim.AdamW(r.parameters(), **ADAM)) for r in (ref, ref64)]
    blocks = []
    for step in range(STEPS):
        local_loss(group, z, step, device).backward()
        z.step()
        z.zero_grad()
        for r, ref_opt in ref_opts:
            ref_loss(group, r, step, device).backward()
            ref_opt.step()
            ref_opt.zero_grad()
        full = z.full_state_dict()
        compare(group, f"{what} step {step}", full, params(ref), device,
                replayed(params(ref), params(ref64)))  # fmt: skip
        for unit in z.units:
            for flat in unit.flats:
                if flat.shard.device != device or flat.full.device != device:
                    fail(group, what, f"unit {unit.name}: shard or flat buffer off {device}")
        blocks.append(pool_blocks(group))
    check_pool_steady(group, what, blocks)
    z.close()


def run(group: comm.ProcessGroup, args: list[str]) -> None:
    """``args[0]``: ``cpu`` or ``cuda`` (also called by battery.py)."""
    name = args[0] if args else "cpu"
    if name == "cpu":
        device = torch.device("cpu")
        force_staging(group, group.backend in ("mpi", "gloo"))  # the staged path
    else:
        device = comm.resolve_device(name, comm.detect_launch().local_rank)
    try:
        for codec in (None, "fp16", "terngrad"):
            check_data_parallel(group, device, codec)
        for stage in (1, 2):
            check_zero(group, device, stage)
        check_zero3(group, device)
    finally:
        force_staging(group, False)
    print(f"rank {group.rank}/{group.size} {group.backend} dense_device {name}: ok", flush=True)


if __name__ == "__main__":
    from tests.support.ranks.rank_main import run_main

    run_main(run)
