"""dense.pipeline_schedules under nccl's point-to-point rules: ``simulate(..., p2p="nccl")``
catches the orders that only tags made work, and ``p2p_program`` (what ``Pipeline`` issues)
is safe for every schedule. The multi-rank runs of that program (gloo and mpi, 2 and 4
ranks, against one process) are in tests/dense/ranks/dense_pp.py, which also counts its
grouped calls."""

from __future__ import annotations

import pytest
import torch

import comm
from comm.group import P2POp
from dense.pipeline_schedules import (
    P2P,
    Action,
    Exchange,
    Message,
    Program,
    Schedule,
    input_of,
    make_schedule,
    output_of,
    p2p_program,
    simulate,
)

pytestmark = pytest.mark.timeout(120)


def cases() -> list[tuple[str, int, int]]:
    out = [(n, p, m) for n in ("gpipe", "1f1b") for p in range(1, 9) for m in (1, 2, 3, 4, 7, 16)]
    return out + [("bidirectional", p, m) for p in (2, 4) for m in (2, 4, 6, 8, 16)]


def tagged_program(s: Schedule, ahead: int) -> Program:
    """An order that relies on tags: each receive posted on its own ``ahead`` actions
    before the action that needs it, each send on its own right after the action that
    makes its tensor (``ahead=1``: no receive ahead)."""
    p = s.stages
    programs = []
    for acts in s.actions:
        items: list[Action | Exchange] = []
        posted = 0
        for i, a in enumerate(acts):
            while posted < min(i + ahead, len(acts)):
                msg = input_of(acts[posted], p)
                posted += 1
                if msg is not None:
                    items.append(Exchange((P2P("recv", s.ranks_of(msg)[0], msg),)))
            items.append(a)
            out = output_of(a, p)
            if out is not None:
                items.append(Exchange((P2P("send", s.ranks_of(out)[1], out),)))
        programs.append(tuple(items))
    return tuple(programs)


@pytest.mark.parametrize("ahead", [1, 4])
@pytest.mark.parametrize("m", [2, 4, 8])
def test_tagged_order_of_1f1b_deadlocks_under_nccl(m: int, ahead: int) -> None:
    # Two stages: one peer pair, so the verdict holds for per-pair streams (single nccl
    # sends and receives) as for one stream per rank. Posted ahead, rank 0's receive of
    # grad 0 stands before its send of act 0 on the pair; not ahead, in the steady state
    # both ranks send before they receive: each waits for an operation the other issues
    # later.
    s = make_schedule("1f1b", 2, m)
    tagged = tagged_program(s, ahead)
    simulate(s)  # fine while tags tell the messages apart
    with pytest.raises(ValueError, match=r"deadlocks under nccl.*rank 0 in group .*rank 1 in"):
        simulate(s, p2p="nccl", program=tagged)
    simulate(s, p2p="nccl")  # the executor's program


def test_deadlock_message_names_both_sends_of_the_steady_state() -> None:
    s = make_schedule("1f1b", 2, 2)
    with pytest.raises(ValueError) as err:
        simulate(s, p2p="nccl", program=tagged_program(s, 1))
    text = str(err.value)
    assert "rank 0 in group [send act(mb 1, stage 0) to rank 1] waits" in text
    assert "rank 1 in group [send grad(mb 0, stage 1) to rank 0] waits" in text
    assert "rank 1 issues recv act(mb 1, stage 0) from rank 0 in a later group" in text


def test_tagged_order_of_bidirectional_mixes_up_messages_under_nccl() -> None:
    # Rank 1 sends the down pipe's activations and the up pipe's gradients to rank 2 in
    # its own order; rank 2 receives them in another: without tags they swap buffers.
    s = make_schedule("bidirectional", 4, 8)
    with pytest.raises(ValueError, match="send 2 from rank 1 to rank 2 .*wrong buffer"):
        simulate(s, p2p="nccl", program=tagged_program(s, 4))


@pytest.mark.parametrize(("name", "p", "m"), cases())
def test_every_schedule_program_runs_under_nccl_at_the_ideal_pace(
    name: str, p: int, m: int
) -> None:
    s = make_schedule(name, p, m)
    program = p2p_program(s)
    for r in range(p):  # the rank's actions, in the schedule's order
        assert tuple(x for x in program[r] if isinstance(x, Action)) == s.actions[r]
        assert all(x.ops for x in program[r] if isinstance(x, Exchange))
    free, nccl = simulate(s), simulate(s, p2p="nccl")
    # Rendezvous costs nothing here: the program follows the ideal timeline.
    assert nccl.start == free.start and nccl.makespan == free.makespan
    # Whether it deadlocks does not depend on the costs the order was built with.
    for f, b in ((1.0, 1.0), (1.0, 5.0), (3.0, 1.0)):
        simulate(s, f, b, p2p="nccl")


def test_program_of_1f1b_pairs_the_steady_state_sends_and_receives() -> None:
    act = lambda mb: Message("act", mb, 0)  # noqa: E731
    grad = lambda mb: Message("grad", mb, 1)  # noqa: E731
    r0, r1 = p2p_program(make_schedule("1f1b", 2, 2))
    assert r0 == (
        Action("F", 0, 0),
        Exchange((P2P("send", 1, act(0)),)),
        Action("F", 1, 0),
        Exchange((P2P("recv", 1, grad(0)), P2P("send", 1, act(1)))),
        Action("B", 0, 0),
        Exchange((P2P("recv", 1, grad(1)),)),
        Action("B", 1, 0),
    )
    assert r1 == (
        Exchange((P2P("recv", 0, act(0)),)),
        Action("F", 0, 1),
        Action("B", 0, 1),
        Exchange((P2P("recv", 0, act(1)), P2P("send", 0, grad(0)))),
        Action("F", 1, 1),
        Action("B", 1, 1),
        Exchange((P2P("send", 0, grad(1)),)),
    )


def test_nccl_mode_checks_the_program() -> None:
    s = make_schedule("gpipe", 2, 2)
    r0, r1 = p2p_program(s)
    a0, a1 = Message("act", 0, 0), Message("act", 1, 0)
    # Rank 1 receives act 1 first (tags would sort it out): it lands in act 0's buffer.
    swapped = [x for x in r1 if not isinstance(x, Exchange) or x.ops[0].kind != "recv"]
    swapped.insert(0, Exchange((P2P("recv", 0, a1), P2P("recv", 0, a0))))
    with pytest.raises(ValueError, match=r"send 0 from rank 0 to rank 1 is send act\(mb 0"):
        simulate(s, p2p="nccl", program=(r0, tuple(swapped)))
    # A send before the action that makes the tensor.
    early = (Exchange((P2P("send", 1, a0),)), *(x for x in r0 if x != r0[1]))
    with pytest.raises(ValueError, match="sent before the action that makes it"):
        simulate(s, p2p="nccl", program=(early, r1))
    # A receive missing, a wrong peer, an action out of order, an output never sent.
    no_recv = tuple(x for x in r1 if x != r1[0])
    with pytest.raises(ValueError, match="before receiving its input"):
        simulate(s, p2p="nccl", program=(r0, no_recv))
    wrong_peer = (Exchange((P2P("recv", 1, a0),)), *r1[1:])
    with pytest.raises(ValueError, match="rank 1 receives it from rank 0"):
        simulate(s, p2p="nccl", program=(r0, wrong_peer))
    with pytest.raises(ValueError, match="runs Action.*as action 0"):
        simulate(s, p2p="nccl", program=(r0[::-1], r1))
    unsent = tuple(x for x in r0 if not isinstance(x, Exchange) or x.ops[0].kind != "send")
    with pytest.raises(ValueError, match="unsent"):
        simulate(s, p2p="nccl", program=(unsent, r1))
    with pytest.raises(ValueError, match="a program of 1 ranks for 2 stages"):
        simulate(s, p2p="nccl", program=(r0,))
    with pytest.raises(ValueError, match="p2p must be 'free' or 'nccl'"):
        simulate(s, p2p="mpi")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="with a program"):
        simulate(s, program=(r0, r1))


def test_p2p_async_checks_its_operations() -> None:
    group = comm.LocalGroup()
    t = torch.zeros(4)
    assert group.p2p_async([]) == []
    with pytest.raises(ValueError, match=r"p2p send: rank 0 passed dst=1; expected a rank in"):
        group.p2p_async([P2POp("send", t, 1)])
    with pytest.raises(ValueError, match="p2p recv: rank 0 cannot recv from itself"):
        group.p2p_async([P2POp("recv", t, 0)])
    with pytest.raises(ValueError, match="p2p recv: rank 0 passed a non-contiguous tensor"):
        group.p2p_async([P2POp("recv", torch.zeros(4, 4).t(), 0)])
    with pytest.raises(ValueError, match="expected P2POp"):
        group.p2p_async([("send", t, 0)])  # type: ignore[list-item]
