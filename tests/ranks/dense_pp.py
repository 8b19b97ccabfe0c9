"""Rank script: dense.Pipeline over the world group equals one process on the global batch.

For each schedule (gpipe, 1f1b, bidirectional; the world size is the number of stages)
every rank builds the same GPT (4 layers x 32, vocabulary 64, T 16) from one seed, keeps
its stage(s) and trains STEPS steps of AdamW on a batch of 8 in 4 micro-batches; in this
process the whole GPT trains on the same global batches with the same optimizer. After
every step the loss (on every rank) and the input gradient (on the ranks holding a first
stage) match the reference; after the last step every local parameter does, to 1e-5.

The tied cases put a token embedding (64 x 32) in front of stage 0 and tie the head to
it, as GPT-2 does: in the reference it is ONE parameter used twice; in the pipeline the
copies on stage 0 and the last stage (and their replicas under the bidirectional
schedule) have their gradients summed.

Then the bad inputs, each a ValueError on every rank: more stages than layers, an
unknown schedule, the bidirectional schedule on 1 stage, a tied parameter name that
stage 0 does not have, a batch that the micro-batches do not divide (only the first
and last stages hold tensors; the others learn it from the step's agreement).

At 4 ranks also PP x TP = 2 x 2 on a ``comm.DeviceMesh``: the GPT split by
``apply_tensor_parallel`` over each ``tp`` pair, then into 2 stages over each ``pp`` pair,
the loss the vocabulary-parallel cross entropy; losses, the input gradient and the final
weights (gathered to full shapes) equal one process, 1F1B and bidirectional.

Backend from ``HYBRIDREC_TEST_BACKEND`` (set by tests/multiproc.py).
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import torch
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

CFG = GPTConfig(vocab_size=64, block_size=16, n_layer=4, n_head=2, d_model=32)
BATCH, SEQ, MICRO, STEPS = 8, 16, 4, 5
# eps 1e-5, not 1e-8: Adam divides each gradient by its own scale, so an element whose
# gradient is near zero (the key bias of attention has exactly zero gradient: softmax
# ignores a constant added to every key) turns rounding noise of ~1e-10, which differs
# between a micro-batched and a whole-batch backward, into steps of up to lr; eps bounds
# that amplification so the comparison measures the pipeline, not the noise.
HYPER = {"lr": 1e-2, "betas": (0.9, 0.95), "eps": 1e-5, "weight_decay": 0.1}
TOL = 1e-5


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


def check_schedule(group: comm.ProcessGroup, schedule: str, tied: bool) -> None:
    what = f"{schedule}{' tied' if tied else ''}"
    p, last = group.size, group.size - 1
    gpt, embed = build(tied)
    ref_gpt, ref_embed = copy.deepcopy(gpt), copy.deepcopy(embed)
    ref: nn.Module = TiedLM(ref_embed, ref_gpt) if ref_embed is not None else ref_gpt
    ref_names = {  # stage parameter name -> the reference's tensor
        n if ref_embed is None or n.startswith("embed.") else n.removeprefix("gpt."): t
        for n, t in ref.named_parameters(remove_duplicate=False)
    }
    ties = [{0: "embed.weight", last: "head.weight"}] if tied else []
    stages = stages_for_rank(gpt, group, schedule, embed=embed)
    pipe = Pipeline(stages, group, MICRO, schedule, tied=ties)
    opt = torch.optim.AdamW(pipe.parameters(), **HYPER)  # type: ignore[arg-type]
    ref_opt = torch.optim.AdamW(ref.parameters(), **HYPER)  # type: ignore[arg-type]
    held = {s for _, s in pipe.schedule.stages_of(group.rank)}
    busy = idle = 0.0
    for step in range(STEPS):
        inputs, targets = batch(step, tokens=tied)
        ref_in = inputs.clone().requires_grad_(not tied)
        ref_loss_t = gpt_loss(ref(ref_in), targets)
        ref_loss_t.backward()
        ref_loss = float(ref_loss_t.detach())
        ref_opt.step()
        ref_opt.zero_grad()

        mine = inputs.clone().requires_grad_(not tied)
        loss = pipe.step(mine if 0 in held else None, targets if last in held else None)
        if abs(float(loss) - ref_loss) > TOL:
            fail(group, f"{what} step {step}: loss {float(loss)} != one process {ref_loss}")
        if 0 in held and not tied:
            check_input_grad(group, f"{what} step {step}", pipe, mine, ref_in)
        opt.step()
        opt.zero_grad()
        busy, idle = busy + pipe.last_stats.busy_s, idle + pipe.last_stats.idle_s
        if not 0 < pipe.last_stats.busy_s <= pipe.last_stats.step_s:
            fail(group, f"{what}: implausible stats {pipe.last_stats}")
    worst, worst_name = 0.0, ""
    for stage_module in stages:
        for name, t in stage_module.named_parameters():
            err = float((t.detach() - ref_names[name].detach()).abs().max())
            if err >= worst:
                worst, worst_name = err, name
            if err > TOL:
                fail(group, f"{what}: stage {stage_module.stage} {name} differs by {err:.3g}")
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
    ref = copy.deepcopy(gpt)
    apply_tensor_parallel(gpt, tp)
    stages = stages_for_rank(gpt, pp, schedule)
    pipe = Pipeline(stages, pp, MICRO, schedule, loss_fn=lambda out, y: tp_gpt_loss(out, y, tp))
    opt = torch.optim.AdamW(pipe.parameters(), **HYPER)  # type: ignore[arg-type]
    ref_opt = torch.optim.AdamW(ref.parameters(), **HYPER)  # type: ignore[arg-type]
    held = {s for _, s in pipe.schedule.stages_of(pp.rank)}
    what = f"pp 2 x tp 2 {schedule}"
    for step in range(STEPS):
        inputs, targets = batch(step, tokens=False)
        ref_in = inputs.clone().requires_grad_(True)
        ref_loss_t = gpt_loss(ref(ref_in), targets)
        ref_loss_t.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        mine = inputs.clone().requires_grad_(True)
        loss = pipe.step(mine if 0 in held else None, targets if 1 in held else None)
        if abs(float(loss) - float(ref_loss_t.detach())) > TOL:
            fail(world, f"{what} step {step}: loss {float(loss)} != {float(ref_loss_t)}")
        if 0 in held:
            check_input_grad(pp, f"{what} step {step}", pipe, mine, ref_in)
        opt.step()
        opt.zero_grad()
    want = dict(ref.named_parameters())
    worst = 0.0
    for stage_module in stages:
        for name, t in tp_full_state_dict(stage_module).items():  # collective over tp
            if name in want:
                worst = max(worst, float((t - want[name].detach()).abs().max()))
    if worst > TOL:
        fail(world, f"{what}: final weights differ by {worst:.3g}")
    pipe.close()
    print(f"rank {world.rank}/{world.size} {world.backend} {what}: ok ({worst:.1g})", flush=True)


def check_input_grad(
    group: comm.ProcessGroup, what: str, pipe: Pipeline, mine: torch.Tensor, ref: torch.Tensor
) -> None:
    """The input gradient of the micro-batches this rank fed in (all of them, or one
    pipe's half under the bidirectional schedule); zero rows for the others."""
    assert mine.grad is not None and ref.grad is not None
    b = BATCH // MICRO
    fed = {
        mb
        for mb in range(MICRO)
        if pipe.schedule.rank_of(pipe.schedule.pipe_of(mb), 0) == group.rank
    }
    for mb in range(MICRO):
        rows = slice(mb * b, (mb + 1) * b)
        want = ref.grad[rows] if mb in fed else torch.zeros_like(ref.grad[rows])
        err = float((mine.grad[rows] - want).abs().max())
        if err > TOL:
            fail(group, f"{what}: inputs.grad of micro-batch {mb} differs by {err:.3g}")


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
    from rank_main import run_main

    run_main(run)
