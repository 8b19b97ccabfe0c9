"""Rank script: dense.Zero3 (ZeRO stage 3) equals one process on the global batch.

``run(group, ["all", DIR])`` runs every check on one group (also called by battery.py):

* ``train``: a GPT of 3 blocks x 32 built with the same seed on every rank, wrapped in
  Zero3 with AdamW, trains 5 steps, each rank on its slice of the global batch; a plain
  ``torch.optim.AdamW`` on the same GPT trains on the whole global batch in this
  process. Losses (averaged over ranks), the input gradients and the final weights
  agree within a few times the reference's own fp32 rounding error, measured by replaying
  it in float64 (``tests/support/tolerance.py``: the ranks sum in another order than one
  process, and Adam amplifies that where a gradient is near zero). Then Adam and SGD
  with momentum, 2 steps each. Between steps no unit holds its full parameters, and
  ``memory_bytes()`` is ~1/size of the unsharded bytes.
* ``twice``: a model whose unit ``a`` runs twice per forward, unit ``unused`` never, and
  a parameter registered on the model itself: the same comparison (3 steps of AdamW).
* ``checkpoint``: Zero3 on half the ranks (``group.split``) trains 3 steps and rank 0
  saves its global optimizer state (``save_zero_state``) and full model tensors; Zero3 on
  all ranks and a stage 1 ``ZeroOptimizer`` on one process each load them and train 2
  more steps: losses and weights equal the uninterrupted 5-step run. Then the other way:
  a stage 2 ``ZeroOptimizer`` on all ranks saves, Zero3 on half the ranks resumes.
* ``errors``: a model without parameters, a parameter shared by two units, a frozen
  parameter on rank 0 only, ranks disagreeing on the model, a bad optimizer class: a
  clear error on every rank, and the group still works afterwards.

Backend from ``HYBRIDREC_TEST_BACKEND`` (set by tests/support/multiproc.py).
"""

from __future__ import annotations

import copy
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

import comm
from dense import GPT, GPTConfig, Zero3, ZeroOptimizer, gpt_loss, load_zero_state, save_zero_state
from tests.support.tolerance import assert_close, assert_same, replay_tol

CFG = GPTConfig(vocab_size=48, block_size=8, n_layer=3, n_head=4, d_model=32)
GLOBAL_BATCH = 8  # sequences; divisible by 1, 2 and 4 ranks
STEPS = 5
SAVE_STEPS = 3
ADAMW: dict[str, Any] = {"lr": 0.01, "betas": (0.8, 0.95), "eps": 1e-6, "weight_decay": 0.1}
WHY = "a few times the one-process reference's fp32 rounding error, measured in float64"


def fail(group: comm.ProcessGroup, msg: str) -> None:
    raise AssertionError(f"rank {group.rank}/{group.size} ({group.backend}): {msg}")


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The global batch of ``step``: token vectors [B, T, D] and targets [B, T]."""
    gen = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(GLOBAL_BATCH, CFG.block_size, CFG.d_model, generator=gen)
    y = torch.randint(0, CFG.vocab_size, (GLOBAL_BATCH, CFG.block_size), generator=gen)
    return x, y


def gpt() -> GPT:
    torch.manual_seed(7)
    return GPT(CFG)


def my_slice(group: comm.ProcessGroup) -> slice:
    n = GLOBAL_BATCH // group.size
    return slice(group.rank * n, (group.rank + 1) * n)


def sharded_step(group: comm.ProcessGroup, opt: Any, model: nn.Module, step: int) -> float:
    """One step on this rank's slice (``opt`` a Zero3 or a ZeroOptimizer); the global loss."""
    x, y = batch(step)
    sl = my_slice(group)
    loss = gpt_loss(model(x[sl]), y[sl])
    loss.backward()
    opt.step()
    opt.zero_grad()
    return float(group.allreduce(loss.detach().reshape(1), op="avg")[0])


@dataclass(frozen=True)
class Reference:
    """One process on the global batch, in float32 and replayed in float64: losses, input
    gradients ``[B, T, D]`` per step, final weights."""

    losses: list[float]
    grads: list[torch.Tensor]
    final: dict[str, torch.Tensor]
    losses64: list[float]
    grads64: list[torch.Tensor]
    final64: dict[str, torch.Tensor]


def _replay(
    steps: int, opt_cls: type[torch.optim.Optimizer], dtype: torch.dtype, hyper: dict[str, Any]
) -> tuple[list[float], list[torch.Tensor], dict[str, torch.Tensor]]:
    model = gpt().to(dtype)
    opt = opt_cls(model.parameters(), **hyper)
    losses, grads = [], []
    for step in range(steps):
        x, y = batch(step)
        x = x.to(dtype).requires_grad_(True)
        loss = gpt_loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
        grads.append(x.grad.detach().clone())  # type: ignore[union-attr]
    return losses, grads, {k: v.detach().clone() for k, v in model.state_dict().items()}


def reference(steps: int, opt_cls: type[torch.optim.Optimizer], **hyper: Any) -> Reference:
    """One process on the global batch, in float32 and in float64."""
    r32 = _replay(steps, opt_cls, torch.float32, hyper)
    r64 = _replay(steps, opt_cls, torch.float64, hyper)
    return Reference(*r32, *r64)


def check(group: comm.ProcessGroup, what: str, got: Any, want: Any, want64: Any) -> None:
    """``got`` (this rank's fp32 run) against the fp32 reference, within the tolerance the
    reference's own rounding error gives (:func:`tests.support.tolerance.replay_tol`)."""
    want_t, want64_t = torch.as_tensor(want), torch.as_tensor(want64)
    tol = replay_tol(want_t, want64_t)
    try:
        assert_close(got, want_t, atol=tol, what=what, why=WHY)
    except AssertionError as e:
        fail(group, str(e).splitlines()[0])


def compare_weights(
    group: comm.ProcessGroup, what: str, got: dict[str, torch.Tensor], ref: Reference
) -> None:
    if set(got) != set(ref.final):
        fail(group, f"{what}: keys {sorted(got)} != {sorted(ref.final)}")
    for name, t in ref.final.items():
        check(group, f"{what}: {name}", got[name], t, ref.final64[name])


def compare_loss(
    group: comm.ProcessGroup, what: str, got: float, ref: Reference, step: int
) -> None:
    check(group, f"{what}: loss", got, ref.losses[step], ref.losses64[step])


def check_released(group: comm.ProcessGroup, what: str, z: Zero3) -> None:
    for unit in z.units:
        for flat in unit.flats:
            held = flat.full.untyped_storage().nbytes()
            if held or unit.gathered or unit.gathering:
                fail(group, f"{what}: unit {unit.name} holds {held} B of full parameters")
    if any(p.numel() for p in z.model.parameters()):
        fail(group, f"{what}: a model parameter still holds data between steps")


# ---------------------------------------------------------------------------- train


def case_train(group: comm.ProcessGroup) -> None:
    ref = reference(STEPS, torch.optim.AdamW, **ADAMW)
    z = Zero3(gpt(), group, torch.optim.AdamW, **ADAMW)
    sl = my_slice(group)
    for step in range(STEPS):
        x, y = batch(step)
        x_mine = x[sl].clone().requires_grad_(True)
        loss = gpt_loss(z(x_mine), y[sl])
        loss.backward()
        z.step()
        z.zero_grad()
        check_released(group, f"AdamW step {step}", z)
        got = float(group.allreduce(loss.detach().reshape(1), op="avg")[0])
        compare_loss(group, f"AdamW step {step}", got, ref, step)
        # d(mean of local means)/dx = d(local mean)/dx / size.
        assert x_mine.grad is not None
        check(group, f"AdamW step {step}: input gradient", x_mine.grad / group.size,
              ref.grads[step][sl], ref.grads64[step][sl])  # fmt: skip
    compare_weights(group, "AdamW final weights", z.full_state_dict(), ref)

    # Memory: the unsharded optimizer holds parameters, gradients and two moments of N
    # elements (plus a 0-d step per tensor); one rank of Zero3 holds 1/size of it plus
    # at most size - 1 padding elements per unit in each of the four.
    plain = sum(4 * p.numel() * p.element_size() + 4 for p in gpt().parameters())
    got_bytes = z.memory_bytes()
    slack = len(z.units) * (4 * 4 * (group.size - 1) + 4)
    if z.unsharded_bytes() != plain:
        fail(group, f"unsharded_bytes {z.unsharded_bytes()} != one process's {plain}")
    elements = sum(4 * p.numel() * p.element_size() for p in gpt().parameters())
    if not elements / group.size <= got_bytes <= plain / group.size + slack:
        fail(group, f"memory_bytes {got_bytes} not ~ {plain} / {group.size}")
    if got_bytes / plain > 1 / group.size + 0.05:
        fail(group, f"memory fraction {got_bytes / plain:.4f} > 1/{group.size} + 0.05")
    # Peak: at most two units' parameters (one computing, one prefetched) and one unit's
    # gradients twice (autograd's and the flat buffer being reduced) on top.
    largest = max(f.full.numel() * f.full.element_size() for u in z.units for f in u.flats)
    peak = z.peak_memory_bytes()
    if not got_bytes < peak <= got_bytes + 4 * largest:
        fail(group, f"peak_memory_bytes {peak} outside ({got_bytes}, {got_bytes + 4 * largest}]")
    print(
        f"rank {group.rank}/{group.size} zero3 memory: {got_bytes} B of {plain} B "
        f"({got_bytes / plain:.4f}), peak {peak} B",
        flush=True,
    )

    for cls, hyper in (
        (torch.optim.Adam, {"lr": 0.01, "betas": (0.9, 0.99)}),
        (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9, "weight_decay": 0.01}),
    ):
        ref = reference(2, cls, **hyper)
        model = gpt()
        z = Zero3(model, group, cls, **hyper)
        for step in range(2):
            got = sharded_step(group, z, model, step)
            compare_loss(group, f"{cls.__name__} step {step}", got, ref, step)
        compare_weights(group, f"{cls.__name__} final weights", z.full_state_dict(), ref)


# ---------------------------------------------------------------------------- twice


class Mixed(nn.Module):
    """A unit with float32 and float64 parameters (two flats) and one it never uses."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(6, 5)
        self.gain = nn.Parameter(torch.rand(5, dtype=torch.float64) + 0.5)  # [5] float64
        self.out = nn.Linear(5, 6)
        self.spare = nn.Parameter(torch.ones(4))  # no gradient: counts as zeros

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.tanh(self.fc(x) * self.gain.float()))  # [B, 6]


class Twice(nn.Module):
    """Unit ``a`` runs twice per forward, ``unused`` never; ``scale`` is the model's own."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.rand(6) + 0.5)  # [6]
        self.a = nn.Linear(6, 6)
        self.b = Mixed()
        self.unused = nn.Linear(6, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.b(torch.tanh(self.a(x)))  # [B, 6]
        return (self.a(h) * self.scale).sum(1)  # [B]


def case_twice(group: comm.ProcessGroup) -> None:
    torch.manual_seed(3)
    ref = Twice()
    model = copy.deepcopy(ref)
    ref64 = copy.deepcopy(ref).double()  # the same computation in float64: the tolerances
    ref_opt = torch.optim.AdamW(ref.parameters(), **ADAMW)
    ref64_opt = torch.optim.AdamW(ref64.parameters(), **ADAMW)
    z = Zero3(model, group, torch.optim.AdamW, **ADAMW)
    names = [u.name for u in z.units]
    if names != ["a", "b", "unused", "(root)"]:
        fail(group, f"units {names}, expected ['a', 'b', 'unused', '(root)']")
    sl = my_slice(group)
    for step in range(3):
        gen = torch.Generator().manual_seed(50 + step)
        x, y = torch.randn(GLOBAL_BATCH, 6, generator=gen), torch.randn(GLOBAL_BATCH, generator=gen)
        loss = ((z(x[sl]) - y[sl]) ** 2).mean()
        loss.backward()
        z.step()
        z.zero_grad()
        check_released(group, f"twice step {step}", z)
        ref_losses = []
        for net, opt in ((ref, ref_opt), (ref64, ref64_opt)):
            dt = next(net.parameters()).dtype
            ref_loss = ((net(x.to(dt)) - y.to(dt)) ** 2).mean()
            ref_loss.backward()
            # Zero3 (like ZeroOptimizer) counts a missing gradient in a unit that has
            # others as zeros; a unit without any gradient is skipped, as torch skips its
            # tensors.
            net.b.spare.grad = torch.zeros_like(net.b.spare)
            opt.step()
            opt.zero_grad()
            ref_losses.append(float(ref_loss.detach()))
        got = float(group.allreduce(loss.detach().reshape(1), op="avg")[0])
        check(group, f"twice step {step}: loss", got, *ref_losses)
    want64 = ref64.state_dict()
    full = z.full_state_dict()
    if set(full) != set(want64):
        fail(group, f"twice final weights: keys {sorted(full)} != {sorted(want64)}")
    for name, t in ref.state_dict().items():
        check(group, f"twice final weights: {name}", full[name], t, want64[name])
    if {f.dtype for f in z.units[1].flats} != {torch.float32, torch.float64}:
        fail(group, f"unit b has flats {[f.dtype for f in z.units[1].flats]}, expected two")

    # The optimizer state equals the one process's; the never-used unit has none, and a
    # stage 1 ZeroOptimizer (one flat for all) loads it with zeros there.
    state = z.state_dict()["tensors"]
    for i, (p, p64) in enumerate(zip(ref.parameters(), ref64.parameters(), strict=True)):
        for key in ("exp_avg", "exp_avg_sq", "step"):
            name = f"{i}/{key}"
            if p in ref_opt.state and name not in state:
                fail(group, f"state {name} missing")
            if p not in ref_opt.state and name in state:
                fail(group, f"state {name} present for a parameter the run never stepped")
            if name in state:
                check(group, f"state {name}", state[name], ref_opt.state[p][key],
                      ref64_opt.state[p64][key])  # fmt: skip
    plain = Twice()
    opt = ZeroOptimizer(torch.optim.AdamW, plain.parameters(), comm.LocalGroup(), **ADAMW)
    opt.load_state_dict({"meta": z.state_dict()["meta"], "tensors": state})
    back = opt.state_dict()["tensors"]
    for name, t in back.items():
        want = state.get(name, torch.zeros_like(t) if t.dim() else None)
        if want is not None:  # a copy of the same tensors, resharded
            assert_same(t, want, what=f"stage 1 reloaded state {name}", why="copied, not computed")


# ---------------------------------------------------------------------------- checkpoint


def save(group: comm.ProcessGroup, out: Path, state: dict[str, Any], model: dict[str, Any]) -> None:
    """Rank 0 of ``group`` writes the optimizer state and the model tensors under ``out``."""
    if group.rank == 0:
        shutil.rmtree(out, ignore_errors=True)  # nothing left from an earlier run
        save_zero_state(state, out / "optimizer")
        (out / "model").mkdir(parents=True, exist_ok=True)
        for name, t in model.items():
            np.save(out / "model" / f"{name}.npy", t.detach().numpy(), allow_pickle=False)


def load_model(src: Path) -> dict[str, torch.Tensor]:
    return {
        f.stem: torch.from_numpy(np.load(f, allow_pickle=False))
        for f in sorted((src / "model").glob("*.npy"))
    }


def case_checkpoint(group: comm.ProcessGroup, workdir: Path) -> None:
    ref = reference(STEPS, torch.optim.AdamW, **ADAMW)
    # Half the ranks (1 at 1 or 2 ranks): a different rank count from the full group.
    half = group.split(group.rank // max(1, group.size // 2), group.rank)
    stage3_dir = workdir / f"stage3-{group.backend}-{group.size}"
    model = gpt()
    z = Zero3(model, half, torch.optim.AdamW, **ADAMW)
    for step in range(SAVE_STEPS):
        compare_loss(group, f"save step {step}", sharded_step(half, z, model, step), ref, step)
    save(group, stage3_dir, z.state_dict(), z.full_state_dict())
    group.barrier()

    # Stage 3 at the full size resumes.
    model = gpt()
    z = Zero3(model, group, torch.optim.AdamW, **ADAMW)
    z.load_full_state_dict(load_model(stage3_dir))
    z.load_state_dict(load_zero_state(stage3_dir / "optimizer"))
    for step in range(SAVE_STEPS, STEPS):
        got = sharded_step(group, z, model, step)
        compare_loss(group, f"stage 3 at {group.size} resumed step {step}", got, ref, step)
    compare_weights(group, f"stage 3 at {group.size} resumed", z.full_state_dict(), ref)

    # Stage 1 on one process resumes from the same files.
    one = comm.LocalGroup()
    model = gpt()
    model.load_state_dict(load_model(stage3_dir))
    opt = ZeroOptimizer(torch.optim.AdamW, model.parameters(), one, stage=1, **ADAMW)
    opt.load_state_dict(load_zero_state(stage3_dir / "optimizer"))
    for step in range(SAVE_STEPS, STEPS):
        got = sharded_step(one, opt, model, step)
        compare_loss(group, f"stage 1 at 1 resumed step {step}", got, ref, step)
    compare_weights(group, "stage 1 at 1 resumed", model.state_dict(), ref)

    # The other way: stage 2 on all ranks saves, stage 3 on half the ranks resumes.
    stage2_dir = workdir / f"stage2-{group.backend}-{group.size}"
    model = gpt()
    opt = ZeroOptimizer(torch.optim.AdamW, model.parameters(), group, stage=2, **ADAMW)
    for step in range(SAVE_STEPS):
        sharded_step(group, opt, model, step)
    save(group, stage2_dir, opt.state_dict(), model.state_dict())
    group.barrier()
    model = gpt()
    z = Zero3(model, half, torch.optim.AdamW, **ADAMW)
    z.load_full_state_dict(load_model(stage2_dir))
    z.load_state_dict(load_zero_state(stage2_dir / "optimizer"))
    for step in range(SAVE_STEPS, STEPS):
        got = sharded_step(half, z, model, step)
        compare_loss(group, f"stage 2 -> stage 3 at {half.size} step {step}", got, ref, step)
    compare_weights(group, f"stage 2 -> stage 3 at {half.size}", z.full_state_dict(), ref)
    half.close()


# ---------------------------------------------------------------------------- errors


class TwoUnitsShare(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 4)
        self.b.weight = self.a.weight  # one parameter in units a and b


def expect_error(
    group: comm.ProcessGroup, what: str, make: Any, exc: type[Exception], text: str
) -> None:
    try:
        make()
    except exc as e:
        if text not in str(e):
            fail(group, f"{what}: error {e!r} does not say {text!r}")
        return
    fail(group, f"{what}: no {exc.__name__}")


def case_errors(group: comm.ProcessGroup) -> None:
    def frozen_on_rank0() -> nn.Module:
        m = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
        if group.rank == 0:
            m[1].bias.requires_grad_(False)
        return m

    on_rank0 = "is frozen" if group.rank == 0 else "rank(s) [0] rejected"
    cases: list[tuple[str, Any, type[Exception], str]] = [
        ("no parameters", lambda: nn.Sequential(nn.ReLU()), ValueError, "has no parameters"),
        ("shared parameter", TwoUnitsShare, ValueError, "a.weight is shared by units 'a' and 'b'"),
        ("frozen on rank 0", frozen_on_rank0, ValueError, on_rank0),
    ]
    if group.size > 1:
        cases.append(
            (
                "ranks disagree",
                lambda: nn.Sequential(nn.Linear(4, 4 + group.rank)),
                ValueError,
                "ranks disagree on the parameters",
            )
        )
    for what, make, exc, text in cases:
        expect_error(group, what, lambda m=make: Zero3(m(), group, torch.optim.AdamW), exc, text)
    expect_error(
        group,
        "bad optimizer class",
        lambda: Zero3(nn.Linear(2, 2), group, dict),  # type: ignore[arg-type]
        TypeError,
        "torch.optim.Optimizer subclass",
    )
    z = Zero3(nn.Linear(3, 2), group, torch.optim.AdamW)
    expect_error(
        group,
        "wrong optimizer state",
        lambda: z.load_state_dict(
            ZeroOptimizer(torch.optim.Adam, [nn.Parameter(torch.ones(3))], group).state_dict()
        ),
        ValueError,
        "state is for 'Adam'",
    )
    expect_error(
        group,
        "wrong model tensors",
        lambda: z.load_full_state_dict({"weight": torch.zeros(2, 3), "bias": torch.zeros(3)}),
        ValueError,
        "bias has shape (3,), expected (2,)",
    )
    group.barrier()  # the group still works


def run(group: comm.ProcessGroup, args: list[str]) -> None:
    """``all DIR``: every check above on ``group`` (files under DIR)."""
    if args[:1] != ["all"] or len(args) != 2:
        raise ValueError(f"expected arguments 'all DIR', got {args!r}")
    for name, case in (
        ("train", lambda: case_train(group)),
        ("twice", lambda: case_twice(group)),
        ("checkpoint", lambda: case_checkpoint(group, Path(args[1]))),
        ("errors", lambda: case_errors(group)),
    ):
        case()
        print(f"rank {group.rank}/{group.size} {group.backend} zero3 {name}: ok", flush=True)


if __name__ == "__main__":  # tests may import this file for its helpers
    from tests.support.ranks.rank_main import run_main

    run_main(run)
