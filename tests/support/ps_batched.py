"""Checks of batched requests (``pull_many`` / ``push_many``) for any store.

:func:`check_batched` drives a store under test and the in-process store side by side:
the in-process one gets the same work one table at a time (``pull`` / ``push``), the
independent reference for the batched path. It returns nothing and raises
AssertionError on the first difference. Stores run it in their own test files (the
MPI one inside an ``mpirun`` worker rank), so one set of checks pins every store.
"""

from __future__ import annotations

import torch

import ps
from ps import PullRequest, PushRequest

# pytest's test modules import this module by its bare name (tests/ is on sys.path), rank
# scripts as ``tests.support.ps_batched`` (the repository root is).
try:
    from ps_reference import RecordingStore
    from tolerance import assert_close, assert_same
except ModuleNotFoundError:
    from tests.support.ps_reference import RecordingStore
    from tests.support.tolerance import assert_close, assert_same

WHY = "4 x the float32 reference's error against its float64 replay (ps_reference.Replay)"


def _specs(prefix: str) -> list[ps.TableSpec]:
    return [
        ps.TableSpec(name=f"{prefix}a", num_rows=50, dim=4, optimizer=ps.RowWiseAdagrad(lr=0.1)),
        ps.TableSpec(name=f"{prefix}b", num_rows=80, dim=8, optimizer=ps.Adam(lr=0.01)),
        ps.TableSpec(name=f"{prefix}c", num_rows=None, dim=4, optimizer=ps.SGD(lr=0.5)),
    ]


def check_batched(store: ps.Store, prefix: str, *, servers: int, steps: int = 4) -> None:
    """Pulls and pushes of three tables (fixed and dynamic, three optimizers) in batches
    equal the same work one table at a time on an in-process store; a batch with one
    bad request changes nothing; every batch is one message per server it reaches."""
    ref = RecordingStore()  # remembers the pushes, for the tolerances
    specs = _specs(prefix)
    for spec in specs:
        store.create_table(spec)
        ref.create_table(spec)
    gen = torch.Generator().manual_seed(7)

    def ids_for(spec: ps.TableSpec, n: int) -> torch.Tensor:
        high = spec.num_rows if spec.num_rows is not None else 1 << 40
        return torch.randint(0, high, (n,), generator=gen)  # duplicates included

    def same(a: ps.PullResult, b: ps.PullResult, table: str, ids: torch.Tensor, what: str) -> None:
        """``a`` (the store's pull of ``ids``) against ``b`` (the reference's): rows within
        the replay tolerance of the pushes so far (the store's kernels and summation order
        may differ), clocks and positions exactly."""
        assert torch.equal(a.clocks, b.clocks), what
        assert (a.positions is None) == (b.positions is None), what
        if a.positions is not None and b.positions is not None:
            assert torch.equal(a.positions, b.positions), what
            ids = ids[b.positions]
        assert_close(a.rows, b.rows, atol=ref.rows_tol(table, ids), what=what, why=WHY)

    before = store.request_counts()
    assert before["servers"] == servers, before
    batches = 0
    for step in range(steps):
        ids = [ids_for(s, 30 + 7 * i) for i, s in enumerate(specs)]
        pulls = [PullRequest(s.name, i) for s, i in zip(specs, ids, strict=True)]
        got = store.pull_many(pulls)
        assert len(got) == len(specs)
        for spec, i, g in zip(specs, ids, got, strict=True):
            same(g, ref.pull(spec.name, i), spec.name, i, f"step {step} pull {spec.name}")
        # Conditional pulls: callers' clocks one behind for half the ids; on odd steps
        # with the returned rows' optimizer state (what a cache installs with them): for
        # every table (the state rides in the pull's reply) or, every other time, for
        # all but the first (a store may fetch it apart).
        conds = []
        for k, (spec, i) in enumerate(zip(specs, ids, strict=True)):
            c = ref.clocks(spec.name, i) - (torch.arange(i.numel()) % 2)
            state = step % 2 == 1 and (step % 4 == 1 or k > 0)
            conds.append(PullRequest(spec.name, i, c, 0, with_state=state))
        got = store.pull_many(conds)
        for r, g in zip(conds, got, strict=True):
            want = ref.pull(r.table, r.ids, clocks=r.clocks, bound=r.bound)
            same(g, want, r.table, r.ids, f"step {step} conditional pull {r.table}")
            assert (g.state is not None) == r.with_state, (step, r.table)
            if g.state is not None:
                assert g.positions is not None
                now = store.state(r.table, r.ids[g.positions])  # nothing pushed since
                why = "the same rows' state read twice, nothing changed between"
                assert_same(g.state, now, what=f"step {step} state of {r.table}", why=why)
        grads = [
            torch.randn(i.numel(), s.dim, generator=gen) for s, i in zip(specs, ids, strict=True)
        ]
        store.push_many(
            [PushRequest(s.name, i, g) for s, i, g in zip(specs, ids, grads, strict=True)]
        )
        for s, i, g in zip(specs, ids, grads, strict=True):
            ref.push(s.name, i, g)
        batches += 1

    after = store.request_counts()
    pulls_sent = after["pull_messages"] - before["pull_messages"]
    pushes_sent = after["push_messages"] - before["push_messages"]
    # Each batch reaches every server (30+ random ids per table), once.
    assert pulls_sent == 2 * batches * servers, (pulls_sent, batches, servers)
    assert pushes_sent == batches * servers, (pushes_sent, batches, servers)

    # A batch with one bad request (an id out of range in the last table's place) is
    # refused whole: the good tables' pushes are not applied either.
    probe = [ids_for(s, 10) for s in specs]
    rows_before = [store.pull(s.name, i).rows for s, i in zip(specs, probe, strict=True)]
    bad = [
        PushRequest(specs[0].name, probe[0], torch.ones(10, specs[0].dim)),
        PushRequest(specs[1].name, torch.tensor([3, 80]), torch.ones(2, specs[1].dim)),
    ]
    try:
        store.push_many(bad)
    except ValueError as e:
        assert specs[1].name in str(e) and "80" in str(e), e
    else:
        raise AssertionError("push_many with an out-of-range id did not raise")
    for s, i, r in zip(specs, probe, rows_before, strict=True):
        got = store.pull(s.name, i).rows
        assert_same(got, r, what=f"{s.name} after a refused batch", why="it writes nothing")
    try:
        store.pull_many([PullRequest(specs[0].name, probe[0]), PullRequest("nope", probe[0])])
    except ValueError as e:
        assert "nope" in str(e), e
    else:
        raise AssertionError("pull_many of an unknown table did not raise")

    # Final state equal, row for row.
    for s in specs:
        i = torch.arange(s.num_rows) if s.num_rows is not None else torch.cat(probe)
        same(store.pull(s.name, i), ref.pull(s.name, i), s.name, i, f"final {s.name}")
    for s in specs:
        store.drop_table(s.name)


WHOLE = (
    "fixed row-wise Adagrad tables pushed sorted distinct ids: every store applies each "
    "row's update in the same C row step (rowwise_adagrad.c) on its own row, and pulls "
    "copy rows, so the bits match the in-process store's"
)


def check_whole_batches(store: ps.Store, prefix: str, folder: str | None, *, steps: int = 5) -> int:
    """Batched messages of the kind an MPI server serves whole in C (fixed row-wise
    Adagrad tables; pushes of sorted distinct ids, as the cache and the hybrid tables
    send them): bit for bit what the in-process store gives for the same requests,
    plain and conditional pulls alike, and after a save and a load of the store
    (``folder``: an empty folder for the checkpoint; None: no save, for a worker that
    shares the store with others). Returns the batched requests sent."""
    dims = [(500, 4), (300, 16), (200, 33)]
    specs = [
        ps.TableSpec(name=f"{prefix}{i}", num_rows=r, dim=d, optimizer=ps.RowWiseAdagrad(lr=0.1))
        for i, (r, d) in enumerate(dims)
    ]
    ref = ps.InProcessStore()
    for spec in specs:
        store.create_table(spec)
        ref.create_table(spec)
    gen = torch.Generator().manual_seed(len(prefix))

    def same_pulls(requests: list[PullRequest], what: str) -> None:
        for r, g in zip(requests, store.pull_many(requests), strict=True):
            w = ref.pull(r.table, r.ids, clocks=r.clocks, bound=r.bound)
            assert torch.equal(g.clocks, w.clocks), what
            assert (g.positions is None) == (w.positions is None), what
            if g.positions is not None and w.positions is not None:
                assert torch.equal(g.positions, w.positions), what
            assert_same(g.rows, w.rows, what=f"{what} {r.table}", why=WHOLE)

    sent = 0
    for step in range(steps):
        if folder is not None and step == steps - 2:  # save, push, the load undoes it
            store.save(folder)
            store.push_many(
                [PushRequest(s.name, torch.arange(30), torch.ones(30, s.dim)) for s in specs]
            )
            store.load(folder)
            sent += 1
        ids = [torch.randint(0, s.num_rows or 1, (60,), generator=gen) for s in specs]
        same_pulls(
            [PullRequest(s.name, i) for s, i in zip(specs, ids, strict=True)], f"step {step}"
        )
        behind = [
            ref.clocks(s.name, i) - torch.arange(i.numel()) % 3
            for s, i in zip(specs, ids, strict=True)
        ]
        conditional = [
            PullRequest(s.name, i, c, step % 2) for s, i, c in zip(specs, ids, behind, strict=True)
        ]
        same_pulls(conditional, f"step {step} conditional")
        pushes = []
        for s, i in zip(specs, ids, strict=True):
            u = torch.unique(i)  # sorted, distinct
            pushes.append(PushRequest(s.name, u, torch.randn(u.numel(), s.dim, generator=gen)))
        store.push_many(pushes)
        for p in pushes:
            ref.push(p.table, p.ids, p.grads)
        sent += 3
    every = [PullRequest(s.name, torch.arange(s.num_rows or 0)) for s in specs]
    same_pulls(every, "every row at the end")
    for s, r in zip(specs, every, strict=True):
        assert torch.equal(store.state(s.name, r.ids), ref.state(s.name, r.ids)), s.name
        store.drop_table(s.name)
    return sent + 1
