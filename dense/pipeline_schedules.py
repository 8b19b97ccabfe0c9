"""Pipeline schedules as plain data: which forward and backward each rank runs, in order.

A schedule for ``p`` stages and ``m`` micro-batches is one list of :class:`Action` per
rank. ``Action("F", mb, stage, pipe)`` runs the forward of micro-batch ``mb`` through
``stage`` of pipeline ``pipe``; ``"B"`` its backward. The executor
(:class:`dense.pipeline.Pipeline`) follows each rank's list in order and blocks only on
the receives an action needs, so a schedule is correct when every rank's order is
consistent with the data dependencies:

* ``F(mb, s)`` needs ``F(mb, s - 1)`` (the activation it receives);
* ``B(mb, s)`` needs ``F(mb, s)`` on the same rank and ``B(mb, s + 1)`` (the gradient it
  receives); ``B(mb, p - 1)`` starts from the loss.

:func:`simulate` replays a schedule with a cost per forward and per backward (no
communication time) and raises ``ValueError`` on a deadlock; it also gives the ideal
idle time of every rank, the "bubble" a measured run is compared with.

Point-to-point order: :func:`p2p_program` turns each rank's actions into what the
executor issues: the actions, with :class:`Exchange` groups (sends and receives issued
together) between them, each message sent and received at the moment of the ideal
timeline when its receiver needs it. nccl ignores tags, matches the k-th send from
rank a to rank b with the k-th receive on b from a, makes each send wait for that receive
(a rendezvous) and runs a rank's groups one after another in issue order; an order that
only works because tags tell messages apart (receives posted ahead of the sends that
must go first, or two neighbours that each send before receiving) hangs there.
``simulate(schedule, p2p="nccl")`` replays the program under exactly those rules and
raises ``ValueError`` naming the ranks and operations stuck, or the first message that
would land in the wrong buffer.

The schedules (rank ``r``, stage ``s``; with one pipeline stage ``s`` lives on rank ``s``)::

    gpipe   all m forwards, then all m backwards.           bubble (p-1)/(m+p-1)
    1f1b    p-1-s forwards (warm-up), then one forward and one backward in turn,
            then the remaining backwards (cool-down). Same bubble as GPipe, but at
            most p - s micro-batches' activations held at once instead of m.
    bidirectional (Chimera)  two pipelines over the same ranks in opposite directions:
            "down" (pipe 0) has stage s on rank s, "up" (pipe 1) has stage s on rank
            p-1-s. Micro-batches 0 .. m/2-1 go down, m/2 .. m-1 go up, so both ends
            start at once and the fill/drain bubbles of one pipeline are filled by the
            other. Every rank holds two stages (s and p-1-s); the two replicas of a
            stage are on ranks s and p-1-s and their gradients are summed before the
            optimizer step. Built by a greedy list schedule (backward first, then the
            oldest ready forward), replayed by :func:`simulate` in the tests.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal, NamedTuple

SCHEDULES = ("gpipe", "1f1b", "bidirectional")
# Relative costs of one stage's forward and backward (a backward is about two forwards).
FORWARD_COST = 1.0
BACKWARD_COST = 2.0


class Action(NamedTuple):
    """One step of a rank's program: ``kind`` "F" or "B" of micro-batch ``mb`` at
    ``stage`` of pipeline ``pipe`` (0, or 1 for the up pipeline of the bidirectional schedule)."""

    kind: Literal["F", "B"]
    mb: int
    stage: int
    pipe: int = 0


class Message(NamedTuple):
    """A tensor an action sends to another rank, of pipeline ``pipe``: ``"act"``, the
    output of ``F(mb, stage)`` for ``stage + 1``, or ``"grad"``, the input gradient of
    ``B(mb, stage)`` for ``stage - 1``. Every message of a step is one ``[b, T, D]``
    tensor, so two operations on the same message have the same size."""

    role: Literal["act", "grad"]
    mb: int
    stage: int
    pipe: int = 0


class P2P(NamedTuple):
    """One point-to-point operation of a rank: ``"send"`` ``msg`` to rank ``peer``, or
    ``"recv"`` it from rank ``peer``."""

    kind: Literal["send", "recv"]
    peer: int
    msg: Message


class Exchange(NamedTuple):
    """Point-to-point operations a rank issues together, as one group (one
    ``ProcessGroup.p2p_async`` call)."""

    ops: tuple[P2P, ...]


@dataclass(frozen=True, slots=True)
class Schedule:
    """A schedule: ``actions[r]`` is rank ``r``'s program.

    ``pipes`` is 1 (GPipe, 1F1B) or 2 (bidirectional); micro-batch ``mb`` travels through
    pipeline :meth:`pipe_of` and its stage ``s`` runs on rank :meth:`rank_of`.
    """

    name: str
    stages: int
    microbatches: int
    pipes: int
    actions: tuple[tuple[Action, ...], ...]

    def pipe_of(self, mb: int) -> int:
        return 0 if self.pipes == 1 else int(mb >= self.microbatches // 2)

    def rank_of(self, pipe: int, stage: int) -> int:
        return stage if pipe == 0 else self.stages - 1 - stage

    def stages_of(self, rank: int) -> list[tuple[int, int]]:
        """The ``(pipe, stage)`` pairs rank ``rank`` holds, pipe 0 first."""
        return [(pipe, self.rank_of(pipe, rank)) for pipe in range(self.pipes)]

    def microbatches_of(self, pipe: int) -> list[int]:
        return [mb for mb in range(self.microbatches) if self.pipe_of(mb) == pipe]

    def ranks_of(self, msg: Message) -> tuple[int, int]:
        """``(sender, receiver)`` of ``msg``."""
        to = msg.stage + 1 if msg.role == "act" else msg.stage - 1
        return self.rank_of(msg.pipe, msg.stage), self.rank_of(msg.pipe, to)


def make_schedule(name: str, stages: int, microbatches: int) -> Schedule:
    """The schedule ``name`` ("gpipe", "1f1b" or "bidirectional") for ``stages`` stages
    and ``microbatches`` micro-batches; ``ValueError`` naming the value on bad input."""
    for what, v in (("stages", stages), ("microbatches", microbatches)):
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise ValueError(f"pipeline schedule: {what} must be an int >= 1, got {v!r}")
    if name == "gpipe":
        return _one_pipe(name, stages, microbatches, _gpipe_rank)
    if name == "1f1b":
        return _one_pipe(name, stages, microbatches, _one_f_one_b_rank)
    if name == "bidirectional":
        return bidirectional(stages, microbatches)
    raise ValueError(f"pipeline schedule: unknown schedule {name!r}; expected one of {SCHEDULES}")


def _one_pipe(
    name: str, p: int, m: int, program: Callable[[int, int, int], list[Action]]
) -> Schedule:
    actions = tuple(tuple(program(p, m, s)) for s in range(p))
    return Schedule(name=name, stages=p, microbatches=m, pipes=1, actions=actions)


def _gpipe_rank(p: int, m: int, s: int) -> list[Action]:
    return [Action("F", mb, s) for mb in range(m)] + [Action("B", mb, s) for mb in range(m)]


def _one_f_one_b_rank(p: int, m: int, s: int) -> list[Action]:
    warmup = min(p - 1 - s, m)  # forwards in flight before the first backward reaches s
    out = [Action("F", mb, s) for mb in range(warmup)]
    for i in range(m - warmup):  # steady state: F of the newest, B of the oldest
        out += [Action("F", warmup + i, s), Action("B", i, s)]
    out += [Action("B", mb, s) for mb in range(m - warmup, m)]  # cool-down
    return out


def bidirectional(p: int, m: int) -> Schedule:
    """Chimera-style: two pipelines in opposite directions, half the micro-batches each.

    ``p`` must be 2 or 4 and ``m`` even (each direction gets ``m / 2``). The order on each
    rank comes from a greedy list schedule with :data:`FORWARD_COST` / :data:`BACKWARD_COST`:
    a free rank runs a ready backward first (that frees activations, as 1F1B does), else the
    ready forward of the oldest micro-batch; within a (pipe, stage) forwards and backwards go
    in micro-batch order.
    """
    if p not in (2, 4):
        raise ValueError(
            f"bidirectional schedule: needs 2 or 4 pipeline stages, got {p} "
            "(each rank pairs stage s of one direction with stage p-1-s of the other)"
        )
    if m < 2 or m % 2 != 0:
        raise ValueError(
            f"bidirectional schedule: microbatches must be even and >= 2 (half go each "
            f"way), got {m}"
        )
    shell = Schedule(name="bidirectional", stages=p, microbatches=m, pipes=2, actions=())
    done: dict[Action, float] = {}  # action -> finish time
    # Per (pipe, stage): the micro-batches still to go forward / backward, in order.
    todo_f = {(pp, s): shell.microbatches_of(pp) for pp in range(2) for s in range(p)}
    todo_b = {k: list(v) for k, v in todo_f.items()}
    free_at = [0.0] * p
    programs: list[list[Action]] = [[] for _ in range(p)]
    total = 2 * m * p
    now = 0.0
    while len(done) < total:
        started = False
        for r in range(p):
            if free_at[r] > now:
                continue
            pick = _greedy_pick(shell, r, now, done, todo_f, todo_b)
            if pick is None:
                continue
            cost = FORWARD_COST if pick.kind == "F" else BACKWARD_COST
            (todo_f if pick.kind == "F" else todo_b)[(pick.pipe, pick.stage)].pop(0)
            done[pick] = now + cost
            free_at[r] = now + cost
            programs[r].append(pick)
            started = True
        if not started:  # advance to the next time something finishes
            later = [t for t in [*done.values(), *free_at] if t > now]
            assert later, "bidirectional: greedy schedule stuck"  # internal invariant
            now = min(later)
    return Schedule(
        name="bidirectional",
        stages=p,
        microbatches=m,
        pipes=2,
        actions=tuple(tuple(a) for a in programs),
    )


def _greedy_pick(
    shell: Schedule,
    rank: int,
    now: float,
    done: dict[Action, float],
    todo_f: dict[tuple[int, int], list[int]],
    todo_b: dict[tuple[int, int], list[int]],
) -> Action | None:
    def finished(a: Action) -> bool:
        return a in done and done[a] <= now

    forwards, backwards = [], []
    for pipe, stage in shell.stages_of(rank):
        if todo_b[(pipe, stage)]:
            b = Action("B", todo_b[(pipe, stage)][0], stage, pipe)
            if all(finished(d) for d in dependencies(b, shell.stages)):
                backwards.append(b)
        if todo_f[(pipe, stage)]:
            f = Action("F", todo_f[(pipe, stage)][0], stage, pipe)
            if all(finished(d) for d in dependencies(f, shell.stages)):
                forwards.append(f)
    # Backward first; among equals the micro-batch that entered first (down and up
    # pipelines interleave: local index within its pipe, then pipe).
    key = lambda a: (a.mb - shell.microbatches_of(a.pipe)[0], a.pipe)  # noqa: E731
    if backwards:
        return min(backwards, key=key)
    if forwards:
        return min(forwards, key=key)
    return None


def dependencies(action: Action, stages: int) -> list[Action]:
    """The actions whose results ``action`` needs (see the module docstring)."""
    kind, mb, s, pipe = action
    if kind == "F":
        return [Action("F", mb, s - 1, pipe)] if s > 0 else []
    deps = [Action("F", mb, s, pipe)]
    if s < stages - 1:
        deps.append(Action("B", mb, s + 1, pipe))
    return deps


def output_of(action: Action, stages: int) -> Message | None:
    """What ``action`` sends: a forward's output (not from the last stage) or a
    backward's input gradient (not from stage 0)."""
    kind, mb, s, pipe = action
    if kind == "F":
        return Message("act", mb, s, pipe) if s < stages - 1 else None
    return Message("grad", mb, s, pipe) if s > 0 else None


def input_of(action: Action, stages: int) -> Message | None:
    """What ``action`` receives: a forward's input (not on stage 0) or the gradient of a
    backward's output (not on the last stage)."""
    kind, mb, s, pipe = action
    if kind == "F":
        return Message("act", mb, s - 1, pipe) if s > 0 else None
    return Message("grad", mb, s + 1, pipe) if s < stages - 1 else None


Program = tuple[tuple[Action | Exchange, ...], ...]


def p2p_program(schedule: Schedule) -> Program:
    """What each rank issues, in order (``program[r]``): its actions, and between them
    :class:`Exchange` groups of sends and receives. :class:`dense.pipeline.Pipeline`
    runs exactly this.

    Every message is placed at one moment of :func:`simulate`'s ideal timeline (costs
    :data:`FORWARD_COST` / :data:`BACKWARD_COST`, the same on every rank): the start of
    the action that needs it. The receiver receives it just before that action; the
    sender sends it right after the last of its own actions finished by that moment (the
    one that made it, or a later one). A rank's operations of one moment form one group,
    issued after only actions that are done by that moment. Every rank then meets its
    messages in the order of their moments, the k-th send from a to b and the k-th
    receive on b from a are the same message, and the groups of one moment meet each
    other: nothing waits for a group its peer issues later, so the program runs under
    nccl's rules (see :func:`simulate`), and as fast as the ideal timeline allows.
    1F1B over 2 stages and 2 micro-batches::

        rank 0:  F0 [send act 0]  F1 [recv grad 0, send act 1]  B0 [recv grad 1] B1
        rank 1:  [recv act 0] F0 B0 [recv act 1, send grad 0] F1 B1 [send grad 1]

    (the steady-state groups are Megatron-LM's ``send_forward_recv_backward``). Issued
    one by one, rank 0's ``send act 1`` and rank 1's ``send grad 0`` would each wait for
    a receive the other issues only after its send: a deadlock under nccl.
    """
    p = schedule.stages
    start = simulate(schedule).start
    cost = {"F": FORWARD_COST, "B": BACKWARD_COST}
    # Per rank: (moment, operation) of each message it sends or receives.
    events: list[list[tuple[float, P2P]]] = [[] for _ in range(p)]
    for acts in schedule.actions:
        for a in acts:
            msg = input_of(a, p)
            if msg is not None:
                src, dst = schedule.ranks_of(msg)
                events[src].append((start[a], P2P("send", dst, msg)))
                events[dst].append((start[a], P2P("recv", src, msg)))
    programs = []
    for r, acts in enumerate(schedule.actions):
        ends = [start[a] + cost[a.kind] for a in acts]
        by_moment: dict[float, list[P2P]] = {}
        for t, op in sorted(events[r]):
            by_moment.setdefault(t, []).append(op)
        items: list[Action | Exchange] = []
        k = 0  # actions placed so far
        for t, ops in sorted(by_moment.items()):
            while k < len(acts) and ends[k] <= t:  # the actions done by moment t
                items.append(acts[k])
                k += 1
            items.append(Exchange(tuple(ops)))
        items.extend(acts[k:])
        programs.append(tuple(items))
    return tuple(programs)


@dataclass(slots=True)
class Simulation:
    """The replay of a schedule: ``makespan`` and per rank ``busy`` and ``idle`` time
    (idle = makespan - busy), and every action's start time."""

    makespan: float
    busy: list[float]
    idle: list[float]
    start: dict[Action, float] = field(default_factory=dict)

    @property
    def bubble(self) -> float:
        """Idle fraction over all ranks: sum(idle) / (ranks * makespan)."""
        return sum(self.idle) / (len(self.idle) * self.makespan)


def simulate(
    schedule: Schedule,
    forward_cost: float = FORWARD_COST,
    backward_cost: float = BACKWARD_COST,
    *,
    p2p: Literal["free", "nccl"] = "free",
    program: Program | None = None,
) -> Simulation:
    """Replay ``schedule``: each rank runs its actions in order, an action starts when its
    rank is free and its dependencies have finished. Checks that every (pipe,
    micro-batch, stage) runs F and B exactly once on the rank that holds the stage;
    ``ValueError`` naming the problem, or the ranks stuck if the orders deadlock.

    ``p2p="free"``: messages need no order (tags tell them apart, as on mpi and gloo).
    ``p2p="nccl"``: the ranks issue ``program`` (default :func:`p2p_program`, what the
    executor issues) under nccl's rules: tags ignored, the k-th send from rank a to rank
    b meets the k-th receive on b from a (``ValueError`` if they are not the same
    message), each rank's groups run one at a time in issue order, a group starts once
    the rank's actions before it are done and completes when each of its operations has
    met its peer's while both groups run (a rendezvous; messages take no time), and an
    action waits for the group that receives its input. One stream per rank is what
    grouped operations get (they run on the group's communicator); single sends and
    receives on nccl get one per peer pair, which only matters with more than one peer.
    Also checks that ``program`` is ``schedule``'s actions, sends each output once after
    the action that makes it and receives each input once before the action that needs it.
    """
    check_coverage(schedule)
    cost = {"F": forward_cost, "B": backward_cost}
    if p2p == "nccl":
        return _simulate_nccl(schedule, cost, p2p_program(schedule) if program is None else program)
    if p2p != "free" or program is not None:
        raise ValueError(
            f"simulate: p2p must be 'free' or 'nccl' (a program only with 'nccl'), got "
            f"{p2p!r}{' with a program' if program is not None else ''}"
        )
    p = schedule.stages
    finish: dict[Action, float] = {}
    start: dict[Action, float] = {}
    pos = [0] * p
    free_at = [0.0] * p
    # Sweep the ranks, running each as far as its next action's inputs allow, until
    # nothing moves; times are exact because a finish time never changes once set.
    progressed = True
    while progressed:
        progressed = False
        for r in range(p):
            while pos[r] < len(schedule.actions[r]):
                a = schedule.actions[r][pos[r]]
                deps = dependencies(a, p)
                if not all(d in finish for d in deps):
                    break
                t0 = max([free_at[r], *(finish[d] for d in deps)])
                start[a] = t0
                finish[a] = free_at[r] = t0 + cost[a.kind]
                pos[r] += 1
                progressed = True
    stuck = [r for r in range(p) if pos[r] < len(schedule.actions[r])]
    if stuck:
        waits = ", ".join(f"rank {r} at {schedule.actions[r][pos[r]]}" for r in stuck)
        raise ValueError(f"schedule {schedule.name!r} deadlocks: {waits}")
    makespan = max(free_at)
    busy = [sum(cost[a.kind] for a in acts) for acts in schedule.actions]
    return Simulation(makespan, busy, [makespan - b for b in busy], start)


def _simulate_nccl(schedule: Schedule, cost: dict[str, float], program: Program) -> Simulation:
    """:func:`simulate` with ``p2p="nccl"``: see there."""
    p, name = schedule.stages, schedule.name
    groups, before, recv_in = _check_program(schedule, program)
    # Pair every send with the receive nccl gives it: the k-th of each (sender, receiver).
    channel: dict[tuple[str, int, int], list[tuple[int, int, P2P]]] = {}
    for r in range(p):
        for g, ex in enumerate(groups[r]):
            for op in ex.ops:
                src, dst = (r, op.peer) if op.kind == "send" else (op.peer, r)
                channel.setdefault((op.kind, src, dst), []).append((r, g, op))
    mates: dict[tuple[int, int, P2P], tuple[int, int, P2P]] = {}
    for (kind, src, dst), sends in channel.items():
        if kind != "send":
            continue
        recvs = channel.get(("recv", src, dst), [])
        for k, (send, recv) in enumerate(zip(sends, recvs, strict=True)):
            if send[2].msg != recv[2].msg:
                raise ValueError(
                    f"schedule {name!r} under nccl (tags ignored): send {k} from rank {src} "
                    f"to rank {dst} is {_say(send[2])}, but receive {k} on rank {dst} is "
                    f"{_say(recv[2])}: the tensor would land in the wrong buffer"
                )
            mates[send] = recv
            mates[recv] = send
    acts = schedule.actions
    started: list[list[float | None]] = [[None] * len(groups[r]) for r in range(p)]
    done: list[list[float | None]] = [[None] * len(groups[r]) for r in range(p)]
    ends: list[list[float]] = [[] for _ in range(p)]  # finish time of each action run
    start: dict[Action, float] = {}
    gi = [0] * p  # each rank's next group
    progressed = True
    while progressed:  # sweep until nothing moves; times never change once set
        progressed = False
        for r in range(p):
            moved = True
            while moved:
                moved = False
                g = gi[r]
                if g < len(groups[r]) and started[r][g] is None:
                    prev = done[r][g - 1] if g else 0.0
                    n = before[r][g]  # actions issued before the group
                    if prev is not None and len(ends[r]) >= n:
                        started[r][g] = max(prev, ends[r][n - 1] if n else 0.0)
                        moved = True
                t_group = started[r][g] if g < len(groups[r]) else None
                if t_group is not None:
                    ts = [
                        started[q][gq]
                        for q, gq, _ in (mates[(r, g, op)] for op in groups[r][g].ops)
                    ]
                    if all(t is not None for t in ts):
                        done[r][g] = max([t_group, *(t for t in ts if t is not None)])
                        gi[r] += 1
                        moved = True
                k = len(ends[r])
                if k < len(acts[r]):
                    a = acts[r][k]
                    rg = recv_in[r].get(k)
                    t_in = 0.0 if rg is None else done[r][rg]
                    if t_in is not None:
                        t0 = max(ends[r][-1] if k else 0.0, t_in)
                        start[a] = t0
                        ends[r].append(t0 + cost[a.kind])
                        moved = True
                progressed = progressed or moved
    stuck = [r for r in range(p) if gi[r] < len(groups[r]) or len(ends[r]) < len(acts[r])]
    if stuck:
        raise ValueError(
            f"schedule {name!r} deadlocks under nccl point-to-point (tags ignored, each "
            "send waits for its peer's matching receive, groups run in issue order): "
            + "; ".join(_stuck(schedule, groups, started, gi, ends, mates, r) for r in stuck)
        )
    makespan = max(max([0.0, *ends[r], *(t for t in done[r] if t is not None)]) for r in range(p))
    busy = [sum(cost[a.kind] for a in acts[r]) for r in range(p)]
    return Simulation(makespan, busy, [makespan - b for b in busy], start)


def _check_program(
    schedule: Schedule, program: Program
) -> tuple[list[list[Exchange]], list[list[int]], list[dict[int, int]]]:
    """Check ``program`` against ``schedule`` (see :func:`simulate`); per rank its groups,
    how many actions come before each group, and action index -> the group receiving
    its input."""
    p, name = schedule.stages, schedule.name
    if len(program) != p:
        raise ValueError(f"schedule {name!r}: a program of {len(program)} ranks for {p} stages")
    groups: list[list[Exchange]] = []
    before: list[list[int]] = []
    recv_in: list[dict[int, int]] = []
    for r, items in enumerate(program):
        mine: list[Exchange] = []
        counts: list[int] = []  # per group: the actions before it
        needs: dict[int, int] = {}  # action index -> the group receiving its input
        made: set[Message] = set()  # outputs of the actions run so far
        sent: set[Message] = set()
        got: dict[Message, int] = {}  # received message -> its group
        inputs = {input_of(a, p) for a in schedule.actions[r]}
        n = 0
        for item in items:
            if isinstance(item, Exchange):
                for op in item.ops:
                    src, dst = schedule.ranks_of(op.msg)
                    if op.kind == "send":
                        why = (
                            f"rank {src} sends it to rank {dst}" if (src, dst) != (r, op.peer)
                            else "sent twice" if op.msg in sent
                            else "sent before the action that makes it" if op.msg not in made
                            else ""
                        )  # fmt: skip
                    else:
                        why = (
                            "no action of this rank needs it" if op.msg not in inputs
                            else f"rank {dst} receives it from rank {src}"
                            if (src, dst) != (op.peer, r)
                            else "received twice" if op.msg in got
                            else ""
                        )  # fmt: skip
                    if why:
                        raise ValueError(f"schedule {name!r}: rank {r} cannot {_say(op)}: {why}")
                    if op.kind == "send":
                        sent.add(op.msg)
                    else:
                        got[op.msg] = len(mine)
                mine.append(item)
                counts.append(n)
                continue
            if n >= len(schedule.actions[r]) or item != schedule.actions[r][n]:
                raise ValueError(
                    f"schedule {name!r}: rank {r}'s program runs {item} as action {n}, the "
                    "schedule another"
                )
            needed = input_of(item, p)
            if needed is not None:
                if needed not in got:
                    raise ValueError(
                        f"schedule {name!r}: rank {r} runs {item} before receiving its input"
                    )
                needs[n] = got[needed]
            out = output_of(item, p)
            if out is not None:
                made.add(out)
            n += 1
        if n != len(schedule.actions[r]) or made != sent:
            raise ValueError(
                f"schedule {name!r}: rank {r}'s program runs {n} of "
                f"{len(schedule.actions[r])} actions and leaves {sorted(made - sent)} unsent"
            )
        groups.append(mine)
        before.append(counts)
        recv_in.append(needs)
    return groups, before, recv_in


def _say(op: P2P) -> str:
    m = op.msg
    pipe = f", pipe {m.pipe}" if m.pipe else ""
    way = "to" if op.kind == "send" else "from"
    return f"{op.kind} {m.role}(mb {m.mb}, stage {m.stage}{pipe}) {way} rank {op.peer}"


def _stuck(
    schedule: Schedule,
    groups: list[list[Exchange]],
    started: list[list[float | None]],
    gi: list[int],
    ends: list[list[float]],
    mates: dict[tuple[int, int, P2P], tuple[int, int, P2P]],
    r: int,
) -> str:
    """Where rank ``r`` waits, for the deadlock message."""
    g = gi[r]
    # A stuck rank has started its next group: the action it waits at receives in that
    # group or a later one, which the program puts before the action.
    assert g < len(groups[r]) and started[r][g] is not None  # internal invariant
    ops = groups[r][g].ops
    waits = []
    for op in ops:
        q, gq, other = mates[(r, g, op)]
        if started[q][gq] is None:
            waits.append(f"{_say(op)} (rank {q} issues {_say(other)} in a later group)")
    return f"rank {r} in group [{', '.join(map(_say, ops))}] waits: {', '.join(waits)}"


def check_coverage(schedule: Schedule) -> None:
    """Every (pipe, micro-batch, stage) has exactly one F and one B, on the rank that
    holds that stage, and the F comes first; ``ValueError`` otherwise."""
    seen: dict[Action, tuple[int, int]] = {}
    for r, acts in enumerate(schedule.actions):
        for i, a in enumerate(acts):
            if a.kind not in ("F", "B"):
                raise ValueError(f"schedule {schedule.name!r}: rank {r} action {a}: bad kind")
            if schedule.pipe_of(a.mb) != a.pipe or schedule.rank_of(a.pipe, a.stage) != r:
                raise ValueError(
                    f"schedule {schedule.name!r}: rank {r} runs {a}, which belongs to rank "
                    f"{schedule.rank_of(schedule.pipe_of(a.mb), a.stage)}"
                )
            if a in seen:
                raise ValueError(f"schedule {schedule.name!r}: {a} appears twice")
            seen[a] = (r, i)
    for mb in range(schedule.microbatches):
        pipe = schedule.pipe_of(mb)
        for s in range(schedule.stages):
            f, b = Action("F", mb, s, pipe), Action("B", mb, s, pipe)
            if f not in seen or b not in seen:
                raise ValueError(f"schedule {schedule.name!r}: {f} or {b} is missing")
            if seen[f][1] > seen[b][1]:
                raise ValueError(f"schedule {schedule.name!r}: {b} comes before {f}")


def max_in_flight(schedule: Schedule, rank: int) -> int:
    """The most micro-batches whose forward ran on ``rank`` and whose backward has not:
    how many stage inputs (activations) the rank holds at once."""
    live = peak = 0
    for a in schedule.actions[rank]:
        live += 1 if a.kind == "F" else -1
        peak = max(peak, live)
    return peak
