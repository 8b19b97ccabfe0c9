"""dense.pipeline: the schedules on their own, the GPT split, the pipeline in one process,
and on real ranks (tests/dense/ranks/dense_pp.py, in the launches of tests/support/rank_battery.py:
every schedule equals one process on the global batch at 2 and 4 ranks, gloo and mpi)."""

from __future__ import annotations

import copy
from collections import deque

import pytest
import torch

import comm
from dense import GPT, GPTConfig, Pipeline, gpt_loss, split_gpt, stages_for_rank
from dense.pipeline_schedules import (
    Action,
    Schedule,
    dependencies,
    make_schedule,
    max_in_flight,
    simulate,
)
from rank_battery import BATTERY_TIMEOUT_S, PIPELINE_CASES, RankBattery
from tolerance import AdamDrift, assert_close, assert_same, cross_entropy_tol, replay_tol

pytestmark = pytest.mark.numerics  # rerun under each ATEN_CPU_CAPABILITY

CFG = GPTConfig(vocab_size=64, block_size=16, n_layer=4, n_head=2, d_model=32)

WHY = "a few times the one-process reference's fp32 rounding error, measured in float64"


def cases() -> list[tuple[str, int, int]]:
    out = [(n, p, m) for n in ("gpipe", "1f1b") for p in (1, 2, 3, 4) for m in range(1, 9)]
    return out + [("bidirectional", p, m) for p in (2, 4) for m in (2, 4, 6, 8)]


def acyclic(s: Schedule) -> bool:
    """Independent of ``simulate``: the graph of each rank's program order plus the data
    dependencies has no cycle (Kahn's algorithm), i.e. the programs cannot deadlock."""
    edges: dict[Action, list[Action]] = {a: [] for acts in s.actions for a in acts}
    indeg = dict.fromkeys(edges, 0)
    for acts in s.actions:
        for before, after in zip(acts, acts[1:], strict=False):
            edges[before].append(after)
            indeg[after] += 1
    for a in edges:
        for d in dependencies(a, s.stages):
            edges[d].append(a)
            indeg[a] += 1
    ready = deque(a for a, n in indeg.items() if n == 0)
    seen = 0
    while ready:
        a = ready.popleft()
        seen += 1
        for b in edges[a]:
            indeg[b] -= 1
            if indeg[b] == 0:
                ready.append(b)
    return seen == len(edges)


@pytest.mark.parametrize(("name", "p", "m"), cases())
def test_schedule_runs_every_action_once_in_dependency_order(name: str, p: int, m: int) -> None:
    s = make_schedule(name, p, m)
    assert sum(len(a) for a in s.actions) == 2 * p * m
    for r, acts in enumerate(s.actions):
        # On each stage, every micro-batch's forward comes before its backward.
        pos = {a: i for i, a in enumerate(acts)}
        for a in acts:
            assert s.rank_of(a.pipe, a.stage) == r
            if a.kind == "B":
                assert pos[Action("F", a.mb, a.stage, a.pipe)] < pos[a]
    assert acyclic(s)
    sim = simulate(s)  # raises on a deadlock; check it against the dependencies
    for a, t in sim.start.items():
        cost = {"F": 1.0, "B": 2.0}
        for d in dependencies(a, p):
            assert sim.start[d] + cost[d.kind] <= t


def test_orders_that_cannot_run_are_rejected() -> None:
    good = make_schedule("1f1b", 2, 2)
    # A backward before its own forward on a stage.
    early_b = (Action("F", 0, 1), Action("B", 1, 1), Action("F", 1, 1), Action("B", 0, 1))
    with pytest.raises(ValueError, match="comes before"):
        simulate(Schedule("early", 2, 2, 1, (good.actions[0], early_b)))
    # Each rank waits for the other: rank 0's B(0) needs stage 1's B(0), which stage 1
    # runs after F(1), which needs rank 0's F(1), which comes after rank 0's B(0).
    r0 = (Action("F", 0, 0), Action("B", 0, 0), Action("F", 1, 0), Action("B", 1, 0))
    r1 = (Action("F", 1, 1), Action("B", 1, 1), Action("F", 0, 1), Action("B", 0, 1))
    circular = Schedule("circular", 2, 2, 1, (r0, r1))
    assert not acyclic(circular)
    with pytest.raises(ValueError, match="deadlocks: rank 0 at .*rank 1 at"):
        simulate(circular)
    # Unusual but valid: stage 1 takes micro-batch 1 first and waits for it.
    r1_swapped = (Action("F", 1, 1), Action("F", 0, 1), Action("B", 0, 1), Action("B", 1, 1))
    r0_gpipe = (Action("F", 0, 0), Action("F", 1, 0), Action("B", 0, 0), Action("B", 1, 0))
    swapped = Schedule("swapped", 2, 2, 1, (r0_gpipe, r1_swapped))
    assert acyclic(swapped)
    simulate(swapped)
    # A stage on the wrong rank.
    with pytest.raises(ValueError, match="belongs to rank 1"):
        simulate(Schedule("moved", 2, 2, 1, (good.actions[1], good.actions[0])))


@pytest.mark.parametrize("p", [1, 2, 3, 4])
@pytest.mark.parametrize("m", [1, 2, 4, 8])
def test_memory_gpipe_holds_m_and_1f1b_at_most_p_minus_s(p: int, m: int) -> None:
    gpipe, ofob = make_schedule("gpipe", p, m), make_schedule("1f1b", p, m)
    for s in range(p):
        assert max_in_flight(gpipe, s) == m
        assert max_in_flight(ofob, s) == min(p - s, m)


@pytest.mark.parametrize("p", [2, 3, 4])
@pytest.mark.parametrize("m", [2, 4, 8])
def test_bubble_of_gpipe_and_1f1b_is_the_textbook_one(p: int, m: int) -> None:
    for name in ("gpipe", "1f1b"):
        for f, b in ((1.0, 1.0), (1.0, 2.0)):
            sim = simulate(make_schedule(name, p, m), f, b)
            assert sim.bubble == pytest.approx((p - 1) / (m + p - 1))
            assert sim.makespan == pytest.approx((m + p - 1) * (f + b))


@pytest.mark.parametrize(("p", "m"), [(2, 2), (2, 4), (4, 4), (4, 8), (4, 16)])
def test_bidirectional_pairs_stages_and_halves_the_bubble(p: int, m: int) -> None:
    s = make_schedule("bidirectional", p, m)
    assert [s.pipe_of(mb) for mb in range(m)] == [0] * (m // 2) + [1] * (m // 2)
    for r in range(p):
        assert s.stages_of(r) == [(0, r), (1, p - 1 - r)]
        assert {(a.pipe, a.stage) for a in s.actions[r]} == {(0, r), (1, p - 1 - r)}
    # Below 1F1B's at the same p and m (both ends of the pipe start at once).
    assert simulate(s).bubble < simulate(make_schedule("1f1b", p, m)).bubble


def test_schedule_errors_name_the_value() -> None:
    with pytest.raises(ValueError, match="unknown schedule 'zigzag'"):
        make_schedule("zigzag", 2, 4)
    with pytest.raises(ValueError, match="needs 2 or 4 pipeline stages, got 3"):
        make_schedule("bidirectional", 3, 4)
    with pytest.raises(ValueError, match="microbatches must be even and >= 2.*got 5"):
        make_schedule("bidirectional", 2, 5)
    with pytest.raises(ValueError, match="stages must be an int >= 1, got 0"):
        make_schedule("1f1b", 0, 4)
    with pytest.raises(ValueError, match="microbatches must be an int >= 1, got 0"):
        make_schedule("gpipe", 2, 0)


# ---------------------------------------------------------------------------- split_gpt


def test_split_gpt_balanced_contiguous_and_sharing_the_tensors() -> None:
    torch.manual_seed(0)
    gpt = GPT(GPTConfig(vocab_size=64, block_size=16, n_layer=5, n_head=2, d_model=32))
    assert [list(split_gpt(gpt, 3, s).layers) for s in range(3)] == [[0, 1], [2, 3], [4]]
    assert [len(split_gpt(gpt, 5, s).layers) for s in range(5)] == [1] * 5
    first, middle, last = (split_gpt(gpt, 3, s) for s in range(3))
    assert first.pos_emb is gpt.pos_emb and first.head is None
    assert middle.pos_emb is None and middle.head is None and middle.ln_f is None
    assert last.head is gpt.head and last.ln_f is gpt.ln_f and last.pos_emb is None
    # The same tensors under the GPT's own names: the stages' state dicts cover the GPT's.
    full = dict(gpt.named_parameters())
    names = [n for st in (first, middle, last) for n, _ in st.named_parameters()]
    assert sorted(names) == sorted(full)
    for st in (first, middle, last):
        for n, t in st.named_parameters():
            assert t is full[n]
    x = torch.randn(2, 16, 32)
    h = x
    for st in (first, middle, last):
        h = st(h)
    assert_same(h, gpt(x), what="stages in a row vs the GPT",
                why="the same modules run the same operations on the same tensors")  # fmt: skip


def test_split_gpt_errors() -> None:
    gpt = GPT(CFG)
    with pytest.raises(ValueError, match="5 pipeline stages but the GPT has only 4 layers"):
        split_gpt(gpt, 5, 0)
    with pytest.raises(ValueError, match=r"stage must be in \[0, 2\), got 2"):
        split_gpt(gpt, 2, 2)
    with pytest.raises(TypeError, match="expected a dense.GPT"):
        split_gpt(torch.nn.Linear(2, 2), 1, 0)  # type: ignore[arg-type]


# --------------------------------------------------------------- the pipeline, one process


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_one_rank_pipeline_equals_the_whole_model(schedule: str) -> None:
    group = comm.LocalGroup()
    torch.manual_seed(3)
    gpt = GPT(CFG)
    ref = copy.deepcopy(gpt)
    ref64 = copy.deepcopy(gpt).double()  # the same computation in float64: the tolerances
    pipe = Pipeline(stages_for_rank(gpt, group, schedule), group, 4, schedule)
    hyper = {"lr": 1e-2, "eps": 1e-5}
    opt = torch.optim.AdamW(pipe.parameters(), **hyper)  # type: ignore[arg-type]
    ref_opts = [(r, torch.optim.AdamW(r.parameters(), **hyper)) for r in (ref, ref64)]
    drift = AdamDrift(hyper["lr"], hyper["eps"])
    for step in range(3):
        gen = torch.Generator().manual_seed(step)
        x = torch.randn(8, 16, 32, generator=gen)
        y = torch.randint(0, 64, (8, 16), generator=gen)
        mine = x.clone().requires_grad_()
        loss = pipe.step(mine, y)
        # The micro-batches of 2 run other matmul shapes than the batch of 8: a few times
        # the reference's own fp32 rounding error, measured in float64 (losses at least
        # the cross entropy's own bound: one scalar's measured error is a poor sample).
        losses, grads, logits64 = [], [], torch.empty(0)
        for r, _ in ref_opts:
            theirs = x.to(r.head.weight.dtype, copy=True).requires_grad_()
            logits = r(theirs)
            ref_loss = gpt_loss(logits, y)
            ref_loss.backward()
            losses.append(ref_loss.detach())
            grads.append(theirs.grad)
            logits64 = logits.detach()
        # The gradients' tolerance (summed over 4 micro-batches: at least 4 roundings of their
        # magnitude), carried by Adam to the weights.
        for (name, p), p64 in zip(ref.named_parameters(), ref64.parameters(), strict=True):
            assert p.grad is not None and p64.grad is not None
            drift.step(name, replay_tol(p.grad, p64.grad, floor_terms=4))
        for _, r_opt in ref_opts:
            r_opt.step()
            r_opt.zero_grad()
        tol = max(replay_tol(*losses), cross_entropy_tol(logits64, y))
        assert_close(float(loss), losses[0], atol=tol, what=f"step {step} loss", why=WHY)
        assert mine.grad is not None and grads[0] is not None and grads[1] is not None
        tol = replay_tol(grads[0], grads[1])
        assert_close(mine.grad, grads[0], atol=tol, what=f"step {step} input grad", why=WHY)
        opt.step()
        opt.zero_grad()
        stats = pipe.last_stats
        assert 0 < stats.busy_s <= stats.step_s and stats.recv_wait_s == 0.0
        assert 0 <= stats.bubble < 1
    for (name, a), b, b64 in zip(
        gpt.named_parameters(), ref.parameters(), ref64.parameters(), strict=True
    ):
        # The weights' own replayed rounding plus what the gradients' does through Adam
        # (tests/support/tolerance.py: AdamW divides gradients near zero by eps).
        tol = replay_tol(b.detach(), b64.detach()) + drift[name]
        assert_close(a, b, atol=tol, what=name, why=WHY + ", plus Adam's drift")


def test_pipeline_errors() -> None:
    group = comm.LocalGroup()
    gpt = GPT(CFG)
    stages = stages_for_rank(gpt, group, "1f1b")
    with pytest.raises(ValueError, match="unknown schedule 'zigzag'"):
        Pipeline(stages, group, 4, "zigzag")
    with pytest.raises(ValueError, match="needs 2 or 4 pipeline stages, got 1"):
        Pipeline(stages, group, 4, "bidirectional")
    with pytest.raises(ValueError, match="puts 1 stage"):
        Pipeline([*stages, *stages], group, 4)
    with pytest.raises(ValueError, match="must hold stage 0 of 1"):
        Pipeline(split_gpt(gpt, 2, 0), group, 4)
    with pytest.raises(ValueError, match=r"tied\[0\] names stage 1; expected \[0, 1\)"):
        Pipeline(stages, group, 4, tied=[{0: "pos_emb.weight", 1: "head.weight"}])
    with pytest.raises(ValueError, match="at least two stages"):
        Pipeline(stages, group, 4, tied=[{0: "head.weight"}])
    pipe = Pipeline(stages, group, 4)
    x, y = torch.randn(6, 16, 32), torch.randint(0, 64, (6, 16))
    with pytest.raises(ValueError, match="batch size 6 is not divisible by microbatches 4"):
        pipe.step(x, y)
    with pytest.raises(ValueError, match="needs targets"):
        pipe.step(x, None)
    with pytest.raises(ValueError, match=r"inputs \[B, T\] \(6, 16\) and targets \(8, 16\)"):
        pipe.step(x, torch.randint(0, 64, (8, 16)))


# ---------------------------------------------------------------------- on real ranks

CHECKS = ["gpipe", "1f1b", "bidirectional", "1f1b tied", "bidirectional tied", "errors"]


@pytest.mark.timeout(BATTERY_TIMEOUT_S)
@pytest.mark.parametrize(("backend", "nprocs"), PIPELINE_CASES)
def test_pipeline_equals_one_process_on_real_ranks(
    backend: str, nprocs: int, rank_battery: RankBattery
) -> None:
    lines = [f"rank {r}/{nprocs} {backend} {check}: ok" for r in range(nprocs) for check in CHECKS]
    rank_battery.expect(backend, nprocs, lines)
