"""Rank script: dense.ZeroOptimizer equals the unsharded torch optimizer.

Cases (``argv[1]``):

* ``train``: for Adam and AdamW, stage 1 and 2: every rank starts from a
  different init (the constructor broadcasts rank 0's), trains STEPS steps on its
  slice of the global batch; a plain torch optimizer on a copy of rank 0's init
  trains on the whole global batch in this process, and a float64 twin of it (the same
  computation in float64) measures its fp32 rounding error. Weights agree after every
  step within a few times that error (``tests/support/tolerance.py``: the ranks average their
  gradients in another order, and Adam amplifies that where a gradient is near zero);
  optimizer state per rank is about 1/size of the unsharded state.
* ``save DIR``: SAVE_STEPS steps of AdamW (stage 2), then rank 0 writes the model
  (``DIR/model/*.npy``) and the global optimizer state (``save_zero_state``).
* ``load DIR``: at any rank count, read both back, train LOAD_STEPS more steps and
  compare with an unsharded AdamW that trained SAVE_STEPS + LOAD_STEPS steps.

The model has float32 and float64 parameters (one flat vector per dtype) with
element counts that do not divide by 4 (padding). Backend from
``HYBRIDREC_TEST_BACKEND`` (set by tests/support/multiproc.py).
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

import comm
from dense import ZeroOptimizer, load_zero_state, save_zero_state
from tests.support.tolerance import assert_close, assert_same, replay_tol, sum_tol

GLOBAL_BATCH = 8
STEPS = 4
SAVE_STEPS = 3
LOAD_STEPS = 3
IN = 5
HYPER: dict[str, Any] = {"lr": 0.05, "betas": (0.8, 0.95), "eps": 1e-6, "weight_decay": 0.1}
WHY = "a few times the one-process reference's fp32 rounding error, measured in float64"


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.l1 = nn.Linear(IN, 7)
        self.l2 = nn.Linear(7, 1)
        self.scale = nn.Parameter(torch.rand(3, dtype=torch.float64) + 0.5)  # [3] float64

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.l1(x))  # [B, 7]
        return self.l2(h).squeeze(1) * self.scale.sum().to(h.dtype)  # [B]


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 + step)
    return torch.randn(GLOBAL_BATCH, IN, generator=gen), torch.randn(GLOBAL_BATCH, generator=gen)


def fail(group: comm.ProcessGroup, msg: str) -> None:
    raise AssertionError(f"rank {group.rank}/{group.size} ({group.backend}): {msg}")


def local_step(group: comm.ProcessGroup, model: nn.Module, opt: ZeroOptimizer, step: int) -> None:
    x, y = batch(step)
    local = GLOBAL_BATCH // group.size
    sl = slice(group.rank * local, (group.rank + 1) * local)
    ((model(x[sl]) - y[sl]) ** 2).mean().backward()
    opt.step()
    opt.zero_grad()


class Reference:
    """The unsharded optimizer on the whole global batch, in fp32 (``model``, ``opt``) and
    its float64 twin (``model64``, ``opt64``: the same init, data and steps)."""

    def __init__(self, cls: type[torch.optim.Optimizer]) -> None:
        torch.manual_seed(100)
        self.model = Net()  # rank 0's init
        self.model64 = copy.deepcopy(self.model).double()
        self.opt = cls(self.model.parameters(), **HYPER)
        self.opt64 = cls(self.model64.parameters(), **HYPER)

    def step(self, step: int) -> None:
        x, y = batch(step)
        for model, opt in ((self.model, self.opt), (self.model64, self.opt64)):
            dt = model.l1.weight.dtype
            ((model(x.to(dt)) - y.to(dt)) ** 2).mean().backward()
            opt.step()
            opt.zero_grad()


def close(group: comm.ProcessGroup, what: str, got: torch.Tensor, want: torch.Tensor,
          want64: torch.Tensor) -> None:  # fmt: skip
    """``got`` within a few times the reference's own rounding error (``replay_tol``).

    The float64 parameter (and its state) is stepped by a gradient computed in fp32, a sum
    over the batch, so it is no more accurate than that sum: its tolerance is at least
    :func:`sum_tol` in float32 of GLOBAL_BATCH terms of its magnitude (its own float64
    rounding is far below, and one measured error of a 3-element tensor is a poor sample)."""
    tol = replay_tol(want.detach(), want64.detach())
    if want.dtype == torch.float64:
        tol = max(tol, sum_tol(torch.float32, GLOBAL_BATCH, float(want64.abs().max())))
    try:
        assert_close(got.detach(), want.detach(), atol=tol, what=what, why=WHY)
    except AssertionError as e:
        fail(group, str(e).splitlines()[0])


def compare(group: comm.ProcessGroup, what: str, mine: nn.Module, ref: Reference) -> None:
    for (name, a), b, b64 in zip(
        mine.named_parameters(), ref.model.parameters(), ref.model64.parameters(), strict=True
    ):
        close(group, f"{what}: {name} vs the unsharded optimizer", a, b, b64)
    flat = torch.cat([p.detach().double().reshape(-1) for p in mine.parameters()])
    every = group.allgather(flat)
    for r in range(1, group.size):
        try:
            assert_same(every[r], every[0], what=f"{what}: replica {r} vs replica 0",
                        why="every rank gathers the same updated shards")  # fmt: skip
        except AssertionError as e:
            fail(group, str(e))


def case_train(group: comm.ProcessGroup) -> None:
    for cls in (torch.optim.Adam, torch.optim.AdamW):
        for stage in (1, 2):
            what = f"{cls.__name__} stage {stage}"
            ref = Reference(cls)
            torch.manual_seed(100 + group.rank)
            mine = Net()
            opt = ZeroOptimizer(cls, mine.parameters(), group, stage=stage, **HYPER)
            for step in range(STEPS):
                local_step(group, mine, opt, step)
                ref.step(step)
                compare(group, f"{what} step {step}", mine, ref)
            full = sum(
                v.numel() * v.element_size()
                for st in ref.opt.state.values()
                for v in st.values()
                if v.dim() > 0
            )
            # Per dtype: two moments of ceil(N/size) elements, plus a 0-d step each.
            bound = full / group.size + 2 * 2 * 8 * (group.size - 1) + 2 * 8
            got = opt.state_bytes()
            if not full / group.size <= got <= bound:
                fail(group, f"{what}: state_bytes {got} not ~ {full} / {group.size}")
            print(f"rank {group.rank} {what}: ok, state {got} B of {full} B", flush=True)


def case_save(group: comm.ProcessGroup, out: Path) -> None:
    torch.manual_seed(100 + group.rank)
    mine = Net()
    opt = ZeroOptimizer(torch.optim.AdamW, mine.parameters(), group, stage=2, **HYPER)
    for step in range(SAVE_STEPS):
        local_step(group, mine, opt, step)
    state = opt.state_dict()  # collective
    if group.rank == 0:
        save_zero_state(state, out / "optimizer")
        (out / "model").mkdir(parents=True, exist_ok=True)
        for name, p in mine.named_parameters():
            np.save(out / "model" / f"{name}.npy", p.detach().numpy(), allow_pickle=False)
    group.barrier()


def case_load(group: comm.ProcessGroup, src: Path) -> None:
    ref = Reference(torch.optim.AdamW)
    for step in range(SAVE_STEPS):
        ref.step(step)
    mine = Net()
    with torch.no_grad():
        for name, p in mine.named_parameters():
            arr = np.load(src / "model" / f"{name}.npy", allow_pickle=False)
            p.copy_(torch.from_numpy(arr))
    compare(group, "after loading the model", mine, ref)
    opt = ZeroOptimizer(torch.optim.AdamW, mine.parameters(), group, stage=1, **HYPER)
    opt.load_state_dict(load_zero_state(src / "optimizer"))
    for step in range(SAVE_STEPS, SAVE_STEPS + LOAD_STEPS):
        local_step(group, mine, opt, step)
        ref.step(step)
        compare(group, f"resumed step {step}", mine, ref)
    # And the state round-trips: saving again gives the unsharded optimizer's state.
    state = opt.state_dict()["tensors"]
    for i, (p, p64) in enumerate(
        zip(ref.model.parameters(), ref.model64.parameters(), strict=True)
    ):
        for key in ("exp_avg", "exp_avg_sq", "step"):
            want, want64 = ref.opt.state[p][key], ref.opt64.state[p64][key]
            close(group, f"state {i}/{key} vs the unsharded optimizer", state[f"{i}/{key}"],
                  want, want64)  # fmt: skip


def run(group: comm.ProcessGroup, args: list[str]) -> None:
    """Case ``args[0]`` (train, save DIR, load DIR) on ``group`` (also called by battery.py)."""
    case = args[0]
    if case == "train":
        case_train(group)
    elif case == "save":
        case_save(group, Path(args[1]))
    elif case == "load":
        case_load(group, Path(args[1]))
    else:
        raise ValueError(f"unknown case {case!r}")
    print(f"rank {group.rank}/{group.size} {group.backend} {case}: ok", flush=True)


if __name__ == "__main__":  # tests may import this file for its helpers
    from tests.support.ranks.rank_main import run_main

    run_main(run)
