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
    schedule: Schedule, forward_cost: float = FORWARD_COST, backward_cost: float = BACKWARD_COST
) -> Simulation:
    """Replay ``schedule``: each rank runs its actions in order, an action starts when its
    rank is free and its dependencies have finished (communication is free). Checks that
    every (pipe, micro-batch, stage) runs F and B exactly once on the rank that holds the
    stage; ``ValueError`` naming the problem, or the ranks stuck if the orders deadlock."""
    check_coverage(schedule)
    p = schedule.stages
    cost = {"F": forward_cost, "B": backward_cost}
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
