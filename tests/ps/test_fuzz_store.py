"""Random sequences of good and bad store requests (hypothesis), on the in-process store and Redis.

Each example makes one table (fixed or dynamic, random width and optimizer) and
runs up to 8 requests drawn from: pushes (repeated ids), plain and conditional
pulls, clocks/state reads, and ~20 kinds of bad request (unknown table, ids of
the wrong type/dtype/shape/range, gradients of the wrong type/dtype/shape or with
NaN/Inf, half a conditional pull, bad bounds, a second create of the same table).

* every bad request raises ValueError or TypeError whose message names the table
  (or the unknown name) and nothing changes: rows, optimizer state and clocks of
  every id the example uses, and every counter of ``stats()``, are the same before
  and after;
* after the sequence, rows and state equal the independent optimizer references
  of ``tests/support/ps_reference.py`` replaying the good pushes (tolerances from the
  reference's float32 run against its float64 one), and clocks count them.

Redis gets the same requests with an in-process store as its reference (fewer
examples: each one is a few round trips to a real ``redis-server``). Counts:
600 in-process + 200 Redis sequences; the tests assert how many ran.
"""

from __future__ import annotations

import math
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import ps
from ps.redis.store import RedisStore
from ps_reference import Replay
from redis_server import RedisServer, redis_server

pytestmark = pytest.mark.timeout(240)

INPROCESS_EXAMPLES = 600
REDIS_EXAMPLES = 200
SETTINGS = {
    "deadline": None,
    "derandomize": True,
    "database": None,
    "suppress_health_check": [HealthCheck.too_slow, HealthCheck.data_too_large],
}

OPTIMIZERS = [
    ps.SGD(lr=0.5),
    ps.SGD(lr=0.1, momentum=0.9),
    ps.RowWiseAdagrad(lr=0.1),
    ps.Adagrad(lr=0.1, initial_accumulator=0.1),
    ps.Adam(lr=0.05),
    ps.FTRL(alpha=0.1, l1=0.01, l2=0.01),
]
DYNAMIC_IDS = [-(2**63), -7, 0, 3, 2**40 + 1, 2**63 - 1]  # a dynamic table's id pool


@dataclass(slots=True)
class Case:
    """One example: the table and the ids it may touch."""

    spec: ps.TableSpec
    universe: list[int]  # every id the example may use (fixed: 0..num_rows-1)
    pushes: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)

    @property
    def name(self) -> str:
        return self.spec.name


@st.composite
def cases(draw: st.DrawFn) -> Case:
    dynamic = draw(st.booleans())
    num_rows = None if dynamic else draw(st.integers(1, 12))
    spec = ps.TableSpec(
        name=draw(st.sampled_from(["t", "items", "user ids", "ü-表"])),
        num_rows=num_rows,
        dim=draw(st.integers(1, 4)),
        optimizer=draw(st.sampled_from(OPTIMIZERS)),
    )
    universe = DYNAMIC_IDS if num_rows is None else list(range(num_rows))
    return Case(spec=spec, universe=universe)


def _ids(draw: st.DrawFn, case: Case, max_size: int = 6) -> torch.Tensor:
    values = draw(st.lists(st.sampled_from(case.universe), min_size=0, max_size=max_size))
    return torch.tensor(values, dtype=torch.int64)


def _grads(draw: st.DrawFn, n: int, dim: int) -> torch.Tensor:
    # Multiples of 1/8 in [-2, 2]: every store sums and applies them without rounding noise.
    values = draw(st.lists(st.integers(-16, 16), min_size=n * dim, max_size=n * dim))
    return torch.tensor(values, dtype=torch.float32).reshape(n, dim) / 8


# A request: (kind, function of the store). Good kinds return a value to compare; bad
# kinds must raise ValueError/TypeError and change nothing.
Request = tuple[str, Callable[[ps.Store], Any]]


def _bad(draw: st.DrawFn, case: Case) -> tuple[str, Callable[[ps.Store], Any], str]:
    """A bad request: (kind, call, text its error must contain)."""
    t, spec = case.name, case.spec
    d = spec.dim
    ids = _ids(draw, case, 4)
    n = int(ids.numel())
    good_g = _grads(draw, n, d)
    kind = draw(
        st.sampled_from(
            [
                "unknown table",
                "table not a str",
                "ids list",
                "ids int32",
                "ids float",
                "ids 2-D",
                "ids out of range",
                "grads float64",
                "grads list",
                "grads rows",
                "grads width",
                "grads 1-D",
                "grads nan",
                "grads inf",
                "clocks only",
                "bound only",
                "bound negative",
                "bound float",
                "clocks int32",
                "clocks shape",
                "create twice",
                "push to unknown",
            ]
        )
    )
    named = repr(t)
    if kind == "unknown table":
        other = draw(st.sampled_from(["nope", "T", t + " ", ""]))
        return kind, lambda s: s.pull(other, ids), repr(other)
    if kind == "table not a str":
        not_str: object = draw(st.sampled_from([3, None, b"t"]))
        return kind, lambda s: s.pull(not_str, ids), repr(not_str)  # type: ignore[arg-type]
    if kind == "push to unknown":
        return kind, lambda s: s.push("missing", ids, good_g), "'missing'"
    if kind == "ids list":
        return kind, lambda s: s.pull(t, ids.tolist()), named  # type: ignore[arg-type]
    if kind == "ids int32":
        return kind, lambda s: s.push(t, ids.to(torch.int32), good_g), named
    if kind == "ids float":
        return kind, lambda s: s.pull(t, ids.to(torch.float32)), named
    if kind == "ids 2-D":
        return kind, lambda s: s.pull(t, ids.reshape(1, -1)), named
    if kind == "ids out of range":
        if spec.num_rows is None:  # every int64 is a valid id of a dynamic table
            return kind, lambda s: s.pull(t, ids.to(torch.int16)), named
        bad_id = draw(st.sampled_from([-1, spec.num_rows, spec.num_rows + 5, -(2**63)]))
        at = draw(st.integers(0, n))
        bad = torch.cat([ids[:at], torch.tensor([bad_id]), ids[at:]])
        g = _grads(draw, n + 1, d)
        op = draw(st.sampled_from(["pull", "push", "clocks", "state"]))
        calls: dict[str, Callable[[ps.Store], Any]] = {
            "pull": lambda s: s.pull(t, bad),
            "push": lambda s: s.push(t, bad, g),
            "clocks": lambda s: s.clocks(t, bad),
            "state": lambda s: s.state(t, bad),
        }
        return f"{kind} ({op})", calls[op], str(bad_id)
    if kind == "grads float64":
        return kind, lambda s: s.push(t, ids, good_g.double()), named
    if kind == "grads list":
        return kind, lambda s: s.push(t, ids, good_g.tolist()), named  # type: ignore[arg-type]
    if kind == "grads rows":
        more_rows = _grads(draw, n + 1, d)
        return kind, lambda s: s.push(t, ids, more_rows), named
    if kind == "grads width":
        wider = _grads(draw, n, d + 1)
        return kind, lambda s: s.push(t, ids, wider), named
    if kind == "grads 1-D":
        return kind, lambda s: s.push(t, ids, torch.zeros(n * d)), named
    if kind in ("grads nan", "grads inf"):
        if n == 0:
            ids, n = torch.tensor([case.universe[0]]), 1
        g = _grads(draw, n, d)
        g[draw(st.integers(0, n - 1)), draw(st.integers(0, d - 1))] = (
            math.nan if kind == "grads nan" else -math.inf
        )
        return kind, lambda s: s.push(t, ids, g), named
    clocks = torch.zeros(n, dtype=torch.int64)
    if kind == "clocks only":
        return kind, lambda s: s.pull(t, ids, clocks=clocks), named
    if kind == "bound only":
        return kind, lambda s: s.pull(t, ids, bound=0), named
    if kind == "bound negative":
        return kind, lambda s: s.pull(t, ids, clocks=clocks, bound=-1), named
    if kind == "bound float":
        return kind, lambda s: s.pull(t, ids, clocks=clocks, bound=1.0), named  # type: ignore[arg-type]
    if kind == "clocks int32":
        return kind, lambda s: s.pull(t, ids, clocks=clocks.int(), bound=0), named
    if kind == "clocks shape":
        longer = torch.zeros(n + 1, dtype=torch.int64)
        return kind, lambda s: s.pull(t, ids, clocks=longer, bound=0), named
    assert kind == "create twice"
    return kind, lambda s: s.create_table(spec), named


@st.composite
def programs(draw: st.DrawFn) -> tuple[Case, list[tuple[str, Any]]]:
    """A case and up to 8 steps: ("push", (ids, grads)), ("pull", (ids, clocks, bound)),
    ("read", ids) or ("bad", (kind, call, text))."""
    case = draw(cases())
    steps: list[tuple[str, Any]] = []
    for _ in range(draw(st.integers(1, 8))):
        what = draw(st.sampled_from(["push", "push", "pull", "read", "bad", "bad"]))
        if what == "push":
            ids = _ids(draw, case)
            steps.append(("push", (ids, _grads(draw, int(ids.numel()), case.spec.dim))))
        elif what == "pull":
            ids = _ids(draw, case)
            if draw(st.booleans()):
                clocks = torch.tensor(
                    draw(st.lists(st.integers(0, 3), min_size=len(ids), max_size=len(ids))),
                    dtype=torch.int64,
                )
                steps.append(("pull", (ids, clocks, draw(st.integers(0, 2)))))
            else:
                steps.append(("pull", (ids, None, None)))
        elif what == "read":
            steps.append(("read", _ids(draw, case)))
        else:
            steps.append(("bad", _bad(draw, case)))
    return case, steps


def _snapshot(store: ps.Store, case: Case) -> tuple[Any, ...]:
    ids = torch.tensor(case.universe, dtype=torch.int64)
    got = store.pull(case.name, ids)
    return (
        store.tables(),
        got.rows.clone(),
        got.clocks.clone(),
        store.state(case.name, ids).clone(),
    )


def _stats(store: ps.Store) -> dict[str, dict[str, int | float]]:
    return {k: dict(v) for k, v in store.stats().items()}


def _assert_same(before: tuple[Any, ...], after: tuple[Any, ...], what: str) -> None:
    assert before[0] == after[0], f"{what}: tables {before[0]} -> {after[0]}"
    for i, label in ((1, "rows"), (2, "clocks"), (3, "state")):
        assert torch.equal(before[i], after[i]), f"{what}: {label} changed"


def _run_bad(store: ps.Store, case: Case, bad: tuple[str, Callable[[ps.Store], Any], str]) -> None:
    kind, call, text = bad
    before = _snapshot(store, case)
    stats_before = _stats(store)
    with pytest.raises((ValueError, TypeError)) as info:
        call(store)
    stats_after = _stats(store)
    assert text in str(info.value), f"{kind}: {text} not in message: {info.value}"
    assert stats_before == stats_after, f"{kind}: stats changed {stats_before} -> {stats_after}"
    _assert_same(before, _snapshot(store, case), kind)


def _run(store: ps.Store, case: Case, steps: list[tuple[str, Any]]) -> Iterator[tuple[str, Any]]:
    """Apply ``steps``; yields each good step's result (for comparing two stores)."""
    store.create_table(case.spec)
    for what, arg in steps:
        if what == "push":
            store.push(case.name, *arg)
            case.pushes.append(arg)
            yield what, None
        elif what == "pull":
            ids, clocks, bound = arg
            got = store.pull(case.name, ids, clocks=clocks, bound=bound)
            yield what, got
        elif what == "read":
            yield what, (store.clocks(case.name, arg), store.state(case.name, arg))
        else:
            _run_bad(store, case, arg)
            yield what, None


def _replay(case: Case, pushes: int | None = None) -> tuple[Replay, dict[int, int]]:
    """ps_reference's replay (float32 and float64) of the first ``pushes`` good pushes
    (all by default) on the example's universe, and each id's row in it."""
    position = {v: i for i, v in enumerate(case.universe)}
    w0 = case.spec.initial_rows(torch.tensor(case.universe, dtype=torch.int64))  # [R, D]
    replayed = [
        (torch.tensor([position[int(i)] for i in p_ids], dtype=torch.int64), g)
        for p_ids, g in case.pushes[:pushes]
    ]
    return Replay(case.spec.optimizer, w0, replayed), position


def _rows_of(position: dict[int, int], ids: torch.Tensor) -> torch.Tensor:
    return torch.tensor([position[int(i)] for i in ids], dtype=torch.int64)


def _check_reference(store: ps.Store, case: Case) -> None:
    """Rows and state equal ps_reference's optimizer replay (within the tolerances of its
    float32 run against its float64 one); clocks count the pushes."""
    ids = torch.tensor(case.universe, dtype=torch.int64)
    replay, position = _replay(case)
    got = store.pull(case.name, ids)
    replay.assert_rows(got.rows, case.name)
    replay.assert_state(store.state(case.name, ids), case.name)
    touched = torch.zeros(len(ids), dtype=torch.int64)
    for p_ids, _ in case.pushes:
        touched[torch.unique(_rows_of(position, p_ids))] += 1
    assert got.clocks.tolist() == touched.tolist()


def test_inprocess_store_requests() -> None:
    count = [0]

    @settings(max_examples=INPROCESS_EXAMPLES, **SETTINGS)  # type: ignore[arg-type]
    @given(programs())
    def run(program: tuple[Case, list[tuple[str, Any]]]) -> None:
        count[0] += 1
        case, steps = program
        case.pushes.clear()
        store = ps.InProcessStore()
        for what, got in _run(store, case, steps):
            if what == "pull" and got.positions is not None:
                assert torch.equal(got.positions, torch.sort(got.positions).values)
        _check_reference(store, case)

    run()
    assert count[0] >= INPROCESS_EXAMPLES, count[0]


@pytest.fixture(scope="module")
def server() -> Iterator[RedisServer]:
    with redis_server() as srv:
        yield srv


def test_redis_store_requests_match_inprocess(server: RedisServer) -> None:
    count = [0]
    # One client for every example (connecting and loading the scripts each time cost
    # more than the example); each example's table is dropped after it, even on failure.
    store = RedisStore(server.url, prefix=f"fuzz-{uuid.uuid4().hex[:8]}", buckets=4)

    @settings(max_examples=REDIS_EXAMPLES, **SETTINGS)  # type: ignore[arg-type]
    @given(programs())
    def run(program: tuple[Case, list[tuple[str, Any]]]) -> None:
        count[0] += 1
        case, steps = program
        case.pushes.clear()
        ref_case = Case(spec=case.spec, universe=case.universe)
        ref = ps.InProcessStore()
        try:
            got_steps = list(_run(store, case, steps))
            want_steps = list(_run(ref, ref_case, steps))
            pushed = 0  # good pushes before the step: the replay giving its tolerance
            for (what, got), (_, want), (_, arg) in zip(got_steps, want_steps, steps, strict=True):
                pushed += what == "push"
                if what == "pull":
                    assert torch.equal(got.clocks, want.clocks)
                    assert (got.positions is None) == (want.positions is None)
                    replay, position = _replay(case, pushed)
                    index = _rows_of(position, arg[0])
                    if got.positions is not None:
                        assert torch.equal(got.positions, want.positions)
                        index = index[got.positions]
                    replay.assert_rows(got.rows, "pull", want=want.rows, index=index)
                elif what == "read":
                    assert torch.equal(got[0], want[0])
                    replay, position = _replay(case, pushed)
                    index = _rows_of(position, arg)
                    replay.assert_state(got[1], "read", want=want[1], index=index)
            _check_reference(store, case)
        finally:
            if case.name in store.tables():
                store.drop_table(case.name)

    with store:
        run()
    assert count[0] >= REDIS_EXAMPLES, count[0]
