"""Rank script: dense.ZeroOptimizer equals the unsharded torch optimizer.

Cases (``argv[1]``):

* ``train``: for Adam and AdamW, stage 1 and 2: every rank starts from a
  different init (the constructor broadcasts rank 0's), trains STEPS steps on its
  slice of the global batch; a plain torch optimizer on a copy of rank 0's init
  trains on the whole global batch in this process. Weights agree to 1e-5 after
  every step; optimizer state per rank is about 1/size of the unsharded state.
* ``save DIR``: SAVE_STEPS steps of AdamW (stage 2), then rank 0 writes the model
  (``DIR/model/*.npy``) and the global optimizer state (``save_zero_state``).
* ``load DIR``: at any rank count, read both back, train LOAD_STEPS more steps and
  compare with an unsharded AdamW that trained SAVE_STEPS + LOAD_STEPS steps.

The model has float32 and float64 parameters (one flat vector per dtype) with
element counts that do not divide by 4 (padding). Backend from
``HYBRIDREC_TEST_BACKEND`` (set by tests/multiproc.py).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

import comm
from dense import ZeroOptimizer, load_zero_state, save_zero_state

GLOBAL_BATCH = 8
STEPS = 4
SAVE_STEPS = 3
LOAD_STEPS = 3
IN = 5
HYPER: dict[str, Any] = {"lr": 0.05, "betas": (0.8, 0.95), "eps": 1e-6, "weight_decay": 0.1}


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.l1 = nn.Linear(IN, 7)
        self.l2 = nn.Linear(7, 1)
        self.scale = nn.Parameter(torch.rand(3, dtype=torch.float64) + 0.5)  # [3] float64

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.l1(x))  # [B, 7]
        return self.l2(h).squeeze(1) * self.scale.sum().float()  # [B]


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


def ref_step(model: nn.Module, opt: torch.optim.Optimizer, step: int) -> None:
    x, y = batch(step)
    ((model(x) - y) ** 2).mean().backward()
    opt.step()
    opt.zero_grad()


def compare(group: comm.ProcessGroup, what: str, mine: nn.Module, ref: nn.Module) -> None:
    for (name, a), b in zip(mine.named_parameters(), ref.parameters(), strict=True):
        err = float((a.detach() - b.detach()).abs().max())
        if err > 1e-5:
            fail(group, f"{what}: {name} differs from the unsharded optimizer by {err:.3g}")
    flat = torch.cat([p.detach().double().reshape(-1) for p in mine.parameters()])
    every = group.allgather(flat)
    if not all(torch.equal(every[0], every[r]) for r in range(group.size)):
        fail(group, f"{what}: replicas differ")


def case_train(group: comm.ProcessGroup) -> None:
    for cls in (torch.optim.Adam, torch.optim.AdamW):
        for stage in (1, 2):
            what = f"{cls.__name__} stage {stage}"
            torch.manual_seed(100)
            ref = Net()
            torch.manual_seed(100 + group.rank)
            mine = Net()
            opt = ZeroOptimizer(cls, mine.parameters(), group, stage=stage, **HYPER)
            ref_opt = cls(ref.parameters(), **HYPER)
            for step in range(STEPS):
                local_step(group, mine, opt, step)
                ref_step(ref, ref_opt, step)
                compare(group, f"{what} step {step}", mine, ref)
            full = sum(
                v.numel() * v.element_size()
                for st in ref_opt.state.values()
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
    torch.manual_seed(100)
    ref = Net()
    ref_opt = torch.optim.AdamW(ref.parameters(), **HYPER)
    for step in range(SAVE_STEPS):
        ref_step(ref, ref_opt, step)
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
        ref_step(ref, ref_opt, step)
        compare(group, f"resumed step {step}", mine, ref)
    # And the state round-trips: saving again gives the unsharded optimizer's state.
    state = opt.state_dict()["tensors"]
    for i, p in enumerate(ref.parameters()):
        for key in ("exp_avg", "exp_avg_sq", "step"):
            want = ref_opt.state[p][key]
            err = float((state[f"{i}/{key}"].double() - want.double()).abs().max())
            if err > 1e-5:
                fail(group, f"state {i}/{key} differs from the unsharded optimizer by {err:.3g}")


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
    from rank_main import run_main

    run_main(run)
