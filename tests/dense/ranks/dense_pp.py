"""Rank script: dense.Pipeline over the world group equals one process on the global batch.

For each schedule (gpipe, 1f1b, bidirectional; the world size is the number of stages)
every rank builds the same GPT (4 layers x 32, vocabulary 64, T 16) from one seed, keeps
its stage(s) and trains STEPS steps of AdamW on a batch of 8 in 4 micro-batches; in this
process the whole GPT trains on the same global batches with the same optimizer. After
every step the loss (on every rank) and the input gradient (on the ranks holding a first
stage) match the reference; after the last step every local parameter does, within a few
times the reference's own fp32 rounding error, measured by a float64 twin of it
(``tests/support/tolerance.py``; losses at least within the cross entropy's own rounding bound,
``tests/support/tolerance.py``: micro-batches of 2 run other matmul shapes than the batch;
weights plus what the gradients' rounding does through AdamW, ``AdamDrift`` there).

The tied cases put a token embedding (64 x 32) in front of stage 0 and tie the head to
it, as GPT-2 does: in the reference it is ONE parameter used twice; in the pipeline the
copies on stage 0 and the last stage (and their replicas under the bidirectional
schedule) have their gradients summed.

Every step issues the point-to-point groups of ``p2p_program`` (the order that holds under
nccl) as one ``group.p2p_async`` call each, and on torch.distributed (gloo here) each is one
``dist.batch_isend_irecv``, the call that makes them one group on nccl: both are counted.

Then the bad inputs, each a ValueError on every rank: more stages than layers, an
unknown schedule, the bidirectional schedule on 1 stage, a tied parameter name that
stage 0 does not have, a batch that the micro-batches do not divide (only the first
and last stages hold tensors; the others learn it from the step's agreement).

At 4 ranks also PP x TP = 2 x 2 on a ``comm.DeviceMesh``: the GPT split by
``apply_tensor_parallel`` over each ``tp`` pair, then into 2 stages over each ``pp`` pair,
the loss the vocabulary-parallel cross entropy; losses, the input gradient and the final
weights (gathered to full shapes) equal one process, 1F1B and bidirectional.

Backend from ``HYBRIDREC_TEST_BACKEND`` (set by tests/support/multiproc.py).
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import comm
from dense import (
    GPT,
    GPTConfig,
    Pipeline,
    apply_tensor_parallel,
    gpt_loss,
    split_gpt,
    stages_for_rank,
    tp_full_state_dict,
    tp_gpt_loss,
)
from dense.pipeline_schedules import Exchange
from tests.support.tolerance import AdamDrift, assert_close, cross_entropy_tol, replay_tol

CFG = GPTConfig(vocab_size=64, block_size=16, n_layer=4, n_head=2, d_model=32)
BATCH, SEQ, MICRO, STEPS = 8, 16, 4, 5
# eps 1e-5, not 1e-8: Adam divides each gradient by its own scale, so an element whose
# gradient is near zero (the key bias of attention has exactly zero gradient: softmax
# ignores a constant added to every key) turns rounding noise of ~1e-10, which differs
# between a micro-batched and a whole-batch backward, into steps of up to lr; eps bounds
# that amplification so the comparison measures the pipeline, not the noise.
HYPER = {"lr": 1e-2, "betas": (0.9, 0.95), "eps": 1e-5, "weight_decay": 0.1}
WHY = "a few times the one-process reference's fp32 rounding error, measured in float64"


def fail(group: comm.ProcessGroup, msg: str) -> None:
    raise AssertionError(f"rank {group.rank}/{group.size} ({group.backend}): {msg}")


def batch(step: int, tokens: bool) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(100 + step)
    if tokens:
        inputs = torch.randint(0, CFG.vocab_size, (BATCH, SEQ), generator=gen)  # [B, T] ids
    else:
        inputs = torch.randn(BATCH, SEQ, CFG.d_model, generator=gen)  # [B, T, D] vectors
    return inputs, torch.randint(0, CFG.vocab_size, (BATCH, SEQ), generator=gen)


class TiedLM(nn.Module):
    """The reference of the tied cases: one token table, also the head's weight."""

    def __init__(self, embed: nn.Embedding, gpt: GPT) -> None:
        super().__init__()
        self.embed, self.gpt = embed, gpt
        self.gpt.head.weight = self.embed.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.gpt(self.embed(tokens))  # [B, T, V]


def build(tied: bool) -> tuple[GPT, nn.Embedding | None]:
    torch.manual_seed(7)
    gpt = GPT(CFG)
    if not tied:
        return gpt, None
    embed = nn.Embedding(CFG.vocab_size, CFG.d_model)  # [V, D]
    with torch.no_grad():
        nn.init.normal_(embed.weight, std=0.02)  # GPT-2's init of the tied table
        gpt.head.weight.copy_(embed.weight)  # the copies start equal
    return gpt, embed


class Reference:
    """One process on the global batch: ``model`` in fp32 and ``model64``, its float64 twin
    (the same init, data and steps), each with its AdamW."""

    def __init__(self, model: nn.Module) -> None:
        self.model, self.model64 = model, copy.deepcopy(model).double()  # ties kept
        self.opt = torch.optim.AdamW(self.model.parameters(), **HYPER)  # type: ignore[arg-type]
        self.opt64 = torch.optim.AdamW(self.model64.parameters(), **HYPER)  # type: ignore[arg-type]
        self.drift = AdamDrift(HYPER["lr"], HYPER["eps"])  # by id of the fp32 parameter

    def weight_tol(self, p: torch.Tensor, p64: torch.Tensor) -> float:
        """The weights' own replayed rounding plus what the gradients' does through Adam."""
        return replay_tol(p.detach(), p64.detach()) + self.drift[id(p)]

    def step(
        self, inputs: torch.Tensor, targets: torch.Tensor, grad: bool
    ) -> tuple[float, float, torch.Tensor | None, torch.Tensor | None]:
        """(loss, tolerance of a loss, input gradient, its float64 twin)."""
        out = []
        logits64 = None
        for model in (self.model, self.model64):
            x = (
                inputs
                if not inputs.is_floating_point()
                else inputs.to(next(model.parameters()).dtype)
            )
            x = x.clone().requires_grad_(grad)
            logits = model(x)
            loss = gpt_loss(logits, targets)
            loss.backward()
            out.append((loss.detach(), x.grad))
            logits64 = logits.detach()
        assert logits64 is not None
        # The gradients' tolerance (each summed over MICRO micro-batches in the pipeline: at
        # least that many roundings of its magnitude), carried by Adam to the weights.
        for p, p64 in zip(self.model.parameters(), self.model64.parameters(), strict=True):
            assert p.grad is not None and p64.grad is not None
            self.drift.step(id(p), replay_tol(p.grad, p64.grad, floor_terms=MICRO))
        for opt in (self.opt, self.opt64):
            opt.step()
            opt.zero_grad()
        (loss32, g32), (loss64, g64) = out
        # At least the cross entropy's own bound: one measured error of a scalar is a poor
        # sample, and the micro-batches' forward runs other shapes.
        tol = max(replay_tol(loss32, loss64), cross_entropy_tol(logits64, targets))
        return float(loss32), tol, g32, g64


class P2PCalls:
    """Counts, while entered, ``group.p2p_async`` calls and (torch.distributed groups)
    ``dist.batch_isend_irecv`` calls."""

    def __init__(self, group: comm.ProcessGroup) -> None:
        self.group, self.grouped, self.batched = group, 0, 0

    def __enter__(self) -> P2PCalls:
        grouped, batched = self.group.p2p_async, dist.batch_isend_irecv

        def count_grouped(*args: Any, **kwargs: Any) -> Any:
            self.grouped += 1
            return grouped(*args, **kwargs)

        def count_batched(*args: Any, **kwargs: Any) -> Any:
            self.batched += 1
            return batched(*args, **kwargs)

        self._restore = batched
        self.group.p2p_async = count_grouped  # type: ignore[method-assign]
        dist.batch_isend_irecv = count_batched
        return self

    def __exit__(self, *exc: object) -> None:
        del self.group.p2p_async  # the class's method again
        dist.batch_isend_irecv = self._restore


def close(group: comm.ProcessGroup, what: str, got: torch.Tensor | float,
          want: torch.Tensor | float, atol: float) -> None:  # fmt: skip
    try:
        assert_close(got, want, atol=atol, what=what, why=WHY)
    except AssertionError as e:
        fail(group, str(e).splitlines()[0])


def check_schedule(group: comm.ProcessGroup, schedule: str, tied: bool) -> None:
    what = f"{schedule}{' tied' if tied else ''}"
    p, last = group.size, group.size - 1
    gpt, embed = build(tied)
    ref_gpt, ref_embed = copy.deepcopy(gpt), copy.deepcopy(embed)
    ref = Reference(TiedLM(ref_embed, ref_gpt) if ref_embed is not None else ref_gpt)

    def by_stage_name(model: nn.Module) -> dict[str, torch.Tensor]:
        """Stage parameter name -> the reference's tensor."""
        return {
            n if ref_embed is None or n.startswith("embed.") else n.removeprefix("gpt."): t
            for n, t in model.named_parameters(remove_duplicate=False)
        }

    ref_names, ref64_names = by_stage_name(ref.model), by_stage_name(ref.model64)
    ties = [{0: "embed.weight", last: "head.weight"}] if tied else []
    stages = stages_for_rank(gpt, group, schedule, embed=embed)
    pipe = Pipeline(stages, group, MICRO, schedule, tied=ties)
    opt = torch.optim.AdamW(pipe.parameters(), **HYPER)  # type: ignore[arg-type]
    held = {s for _, s in pipe.schedule.stages_of(group.rank)}
    busy = idle = 0.0
    for step in range(STEPS):
        inputs, targets = batch(step, tokens=tied)
        ref_loss, loss_tol, ref_grad, ref_grad64 = ref.step(inputs, targets, grad=not tied)

        mine = inputs.clone().requires_grad_(not tied)
        with P2PCalls(group) as calls:
            loss = pipe.step(mine if 0 in held else None, targets if last in held else None)
        groups = sum(isinstance(item, Exchange) for item in pipe.program)
        torch_dist = group.backend in ("gloo", "nccl")
        if calls.grouped != groups or calls.batched != (groups if torch_dist else 0):
            fail(
                group,
                f"{what} step {step}: {calls.grouped} p2p_async and {calls.batched} "
                f"batch_isend_irecv calls for the program's {groups} groups",
            )
        close(group, f"{what} step {step}: loss vs one process", float(loss), ref_loss, loss_tol)
        if 0 in held and not tied:
            assert ref_grad is not None and ref_grad64 is not None
            check_input_grad(group, f"{what} step {step}", pipe, mine, ref_grad, ref_grad64)
        opt.step()
        opt.zero_grad()
        busy, idle = busy + pipe.last_stats.busy_s, idle + pipe.last_stats.idle_s
        if not 0 < pipe.last_stats.busy_s <= pipe.last_stats.step_s:
            fail(group, f"{what}: implausible stats {pipe.last_stats}")
    worst, worst_name = 0.0, ""
    for stage_module in stages:
        for name, t in stage_module.named_parameters():
            want = ref_names[name].detach()
            err = float((t.detach() - want).abs().max())
            if err >= worst:
                worst, worst_name = err, name
            tol = ref.weight_tol(ref_names[name], ref64_names[name])
            close(group, f"{what}: stage {stage_module.stage} {name}", t.detach(), want, tol)
    pipe.close()
    print(
        f"rank {group.rank}/{p} {group.backend} {what}: ok (weights within {worst:.1g} "
        f"at {worst_name}; busy {busy:.3f} s, idle {idle:.3f} s over {STEPS} steps)",
        flush=True,
    )


def check_pp_tp(world: comm.ProcessGroup, schedule: str) -> None:
    """PP x TP = 2 x 2 over the 4 ranks against one process on the global batch."""
    mesh = comm.DeviceMesh(world, {"pp": 2, "tp": 2})
    pp, tp = mesh.group("pp"), mesh.group("tp")
    gpt, _ = build(tied=False)
    ref = Reference(copy.deepcopy(gpt))
    apply_tensor_parallel(gpt, tp)
    stages = stages_for_rank(gpt, pp, schedule)
    pipe = Pipeline(stages, pp, MICRO, schedule, loss_fn=lambda out, y: tp_gpt_loss(out, y, tp))
    opt = torch.optim.AdamW(pipe.parameters(), **HYPER)  # type: ignore[arg-type]
    held = {s for _, s in pipe.schedule.stages_of(pp.rank)}
    what = f"pp 2 x tp 2 {schedule}"
    for step in range(STEPS):
        inputs, targets = batch(step, tokens=False)
        ref_loss, loss_tol, ref_grad, ref_grad64 = ref.step(inputs, targets, grad=True)
        mine = inputs.clone().requires_grad_(True)
        loss = pipe.step(mine if 0 in held else None, targets if 1 in held else None)
        close(world, f"{what} step {step}: loss vs one process", float(loss), ref_loss, loss_tol)
        if 0 in held:
            assert ref_grad is not None and ref_grad64 is not None
            check_input_grad(pp, f"{what} step {step}", pipe, mine, ref_grad, ref_grad64)
        opt.step()
        opt.zero_grad()
    want = dict(ref.model.named_parameters())
    want64 = dict(ref.model64.named_parameters())
    worst = 0.0
    for stage_module in stages:
        for name, t in tp_full_state_dict(stage_module).items():  # collective over tp
            if name in want:
                worst = max(worst, float((t - want[name].detach()).abs().max()))
                tol = ref.weight_tol(want[name], want64[name])
                close(world, f"{what}: final {name}", t, want[name].detach(), tol)
    pipe.close()
    print(f"rank {world.rank}/{world.size} {world.backend} {what}: ok ({worst:.1g})", flush=True)


def check_input_grad(
    group: comm.ProcessGroup,
    what: str,
    pipe: Pipeline,
    mine: torch.Tensor,
    ref_grad: torch.Tensor,
    ref_grad64: torch.Tensor,
) -> None:
    """The input gradient of the micro-batches this rank fed in (all of them, or one
    pipe's half under the bidirectional schedule); zero rows for the others (exactly:
    a tolerance of 0 there)."""
    assert mine.grad is not None
    b = BATCH // MICRO
    fed = {
        mb
        for mb in range(MICRO)
        if pipe.schedule.rank_of(pipe.schedule.pipe_of(mb), 0) == group.rank
    }
    for mb in range(MICRO):
        rows = slice(mb * b, (mb + 1) * b)
        if mb in fed:
            want, tol = ref_grad[rows], replay_tol(ref_grad[rows], ref_grad64[rows])
        else:
            want, tol = torch.zeros_like(ref_grad[rows]), 0.0
        close(group, f"{what}: inputs.grad of micro-batch {mb}", mine.grad[rows], want, tol)


def expect_error(
    group: comm.ProcessGroup, what: str, needle: str, fn: Callable[[], object]
) -> None:
    try:
        fn()
    except ValueError as e:
        if needle not in str(e):
            fail(group, f"{what}: error {e!r} does not say {needle!r}")
        return
    fail(group, f"{what}: no ValueError")


def check_errors(group: comm.ProcessGroup) -> None:
    gpt, _ = build(tied=False)
    expect_error(
        group,
        "more stages than layers",
        "8 pipeline stages but the GPT has only 4 layers",
        lambda: split_gpt(gpt, 8, group.rank),
    )
    stages = stages_for_rank(gpt, group, "1f1b")
    expect_error(
        group,
        "unknown schedule",
        "unknown schedule 'zigzag'",
        lambda: Pipeline(stages, group, MICRO, "zigzag"),
    )
    single = comm.LocalGroup()
    expect_error(
        group,
        "bidirectional on 1 stage",
        "needs 2 or 4 pipeline stages, got 1",
        lambda: Pipeline(split_gpt(gpt, 1, 0), single, MICRO, "bidirectional"),
    )
    # A tied name that only the first stage can check: every rank raises, none splits.
    expect_error(
        group,
        "tied name missing on stage 0",
        "bad arguments on rank(s) [0]",
        lambda: Pipeline(stages, group, MICRO, tied=[{0: "nope", group.size - 1: "head.weight"}]),
    )
    # A batch of 6 in 4 micro-batches: only the first and last stages hold tensors.
    pipe = Pipeline(stages, group, MICRO, "1f1b")
    inputs, targets = batch(0, tokens=False)
    held = {s for _, s in pipe.schedule.stages_of(group.rank)}
    expect_error(
        group,
        "batch not divisible",
        "batch size 6 is not divisible by microbatches 4",
        lambda: pipe.step(
            inputs[:6] if 0 in held else None, targets[:6] if group.size - 1 in held else None
        ),
    )
    # The pipeline is still usable after the error (nothing was left in flight).
    pipe.step(inputs if 0 in held else None, targets if group.size - 1 in held else None)
    pipe.close()
    print(f"rank {group.rank}/{group.size} {group.backend} errors: ok", flush=True)


def run(group: comm.ProcessGroup, args: list[str]) -> None:
    """Every check: schedules ``args`` (default: all), the tied cases, the errors."""
    schedules = args or ["gpipe", "1f1b", "bidirectional"]
    for schedule in schedules:
        check_schedule(group, schedule, tied=False)
    for schedule in ("1f1b", "bidirectional"):
        if schedule in schedules:
            check_schedule(group, schedule, tied=True)
    check_errors(group)
    if group.size == 4:
        for schedule in ("1f1b", "bidirectional"):
            check_pp_tp(group, schedule)
    print(f"rank {group.rank}/{group.size} {group.backend} dense_pp: ok", flush=True)


if __name__ == "__main__":  # tests may import this file for its helpers
    from tests.support.ranks.rank_main import run_main

    run_main(run)
