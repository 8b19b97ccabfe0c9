"""Rank script: fp16 and bf16 tables over the MPI store against the in-process store.

Run as ``mpirun -n N python ps_mpi_narrow.py --servers S --dir D``: the last ``S``
ranks serve, the others are workers, each with its share of the tables. The wire
carries a narrow table's rows and gradients in the table's type, so the reference is
an :class:`ps.InProcessStore` with the same specs fed the same gradients *rounded to
the table's type first* (``grads.to(dtype)``, round to nearest: what the worker sends):
both stores then run the same float32 update on the same rows and round it
stochastically with the same key (table id, clock), so rows, optimizer state and
clocks must agree bit for bit, and pulls return float32 rows that are exact in the
table's type. Every table is pushed and pulled one table at a time and in batches
that mix fp32, fp16 and bf16 tables (plain and counted pushes, plain, conditional and
with-state pulls). Then: a gradient past fp16's range is refused naming the table and
row (or dropped under ``nan_policy="skip"``); requests only a server can refuse (a
wrong row type, Inf in fp16 bits); a checkpoint saved through MPI keeps the dtype and
the rows, in an in-process store and loaded back; with ``--protocol`` a worker of
another protocol version is refused with the clear message.

Every rank prints ``rank R: ok <role> ...`` at the end; any failed check raises.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
import torch

import comm
import ps
from ps import PullRequest, PushRequest
from ps.mpi import wire
from ps.mpi.server import serve_mpi
from ps.mpi.store import MPIStore
from tests.support.tolerance import assert_same

ROWS = 60
WHY = (
    "the same float32 update on the same rows (gradients rounded to the table's type "
    "on both sides), stochastically rounded with the same (table id, clock) key"
)
OPTIMIZERS: dict[str, ps.Optimizer] = {
    "sgd": ps.SGD(lr=0.1),
    "rowwise": ps.RowWiseAdagrad(lr=0.1),
    "adam": ps.Adam(lr=0.01),
}


def narrow_specs() -> list[ps.TableSpec]:
    """fp16 and bf16, every optimizer, fixed and dynamic; odd and even widths (a part of
    an odd number of 16-bit values ends in a padded word)."""
    out = []
    for dtype in ("fp16", "bf16"):
        for k, (name, opt) in enumerate(OPTIMIZERS.items()):
            for rows in (ROWS, None):
                out.append(
                    ps.TableSpec(
                        name=f"{dtype}_{name}_{'fixed' if rows else 'dyn'}",
                        num_rows=rows,
                        dim=7 if k % 2 == 0 else 8,
                        optimizer=opt,
                        dtype=dtype,  # type: ignore[arg-type]
                    )
                )
    return out


def rounded(spec: ps.TableSpec, grads: torch.Tensor) -> torch.Tensor:
    """``grads`` as the wire carries them for ``spec``, back in float32."""
    return grads.to(spec.torch_dtype).to(torch.float32) if spec.narrow else grads


def ref_request(ref: ps.Store, r: PushRequest) -> PushRequest:
    """The reference's copy of push ``r``: its gradients rounded to the table's type."""
    return PushRequest(r.table, r.ids, rounded(ref.spec(r.table), r.grads), r.counts, r.stats)


def expected_rows(spec: ps.TableSpec, ids: torch.Tensor, want: ps.PullResult) -> torch.Tensor:
    """The rows the MPI store must return where ``want`` is the reference's pull of
    ``ids``: a row no push has reached yet (clock 0, a dynamic table's absent row
    included) reads as its initial value in the table's type (what a table stores for
    it, rounded to nearest), computed here from the spec; every other row as the
    reference's."""
    fresh = want.clocks == 0  # [N]
    if want.positions is not None:
        ids = ids[want.positions]
    out = want.rows.clone()
    out[fresh] = spec.initial_rows(ids[fresh]).to(spec.torch_dtype).to(torch.float32)
    return out


def same(what: str, store: ps.Store, ref: ps.Store, table: str, ids: torch.Tensor) -> None:
    """Rows (float32, exact in the table's type), clocks and state bit for bit."""
    spec = store.spec(table)
    got, want = store.pull(table, ids), ref.pull(table, ids)
    assert got.rows.dtype == torch.float32, f"{what}: pulled {got.rows.dtype}"
    assert_same(got.rows, expected_rows(spec, ids, want), what=f"{what}: rows", why=WHY)
    exact = got.rows.to(spec.torch_dtype).to(torch.float32)
    assert_same(exact, got.rows, what=f"{what}: exact", why="rows stored in the table's type")
    assert torch.equal(got.clocks, want.clocks), f"{what}: clocks"
    assert_same(store.state(table, ids), ref.state(table, ids), what=f"{what}: state", why=WHY)


def probe_ids(spec: ps.TableSpec) -> torch.Tensor:
    if spec.num_rows is not None:
        return torch.arange(spec.num_rows)
    return torch.cat([torch.arange(-5, ROWS), torch.tensor([2**40, -(2**50)])])


def pushes(spec: ps.TableSpec, gen: torch.Generator, n: int) -> PushRequest:
    """A push of ``n`` rows with repeated ids (dynamic tables: negative and huge ids too)."""
    ids = torch.randint(0, ROWS, (n,), generator=gen)
    if spec.num_rows is None:
        ids[::5] = torch.tensor([-3, 2**40, -(2**50), 7, -1])[torch.arange(ids[::5].numel()) % 5]
    return PushRequest(spec.name, ids, torch.randn(n, spec.dim, generator=gen))


def counted(spec: ps.TableSpec, r: PushRequest, gen: torch.Generator) -> PushRequest:
    """``r`` as a counted push (counts 1 to 3, their float32 statistics)."""
    n, q = r.ids.numel(), spec.optimizer.stat_dim(spec.dim)
    counts = torch.randint(1, 4, (n,), generator=gen)
    stats = torch.rand(n, q, generator=gen) * counts.unsqueeze(1)
    return PushRequest(r.table, r.ids, r.grads, counts, stats)


def equivalence(store: MPIStore, specs: list[ps.TableSpec], seed: int) -> ps.InProcessStore:
    """Single and batched pushes and pulls of ``specs`` (plus an fp32 table in every batch)
    on both stores; compared after every step. Returns the reference."""
    ref = ps.InProcessStore()
    wide = ps.TableSpec(name=f"fp32_{seed}", num_rows=ROWS, dim=5, optimizer=ps.SGD(lr=0.1))
    specs = [*specs, wide]
    for s in specs:
        store.create_table(s)
        ref.create_table(s)
        assert store.spec(s.name).dtype == s.dtype, s.name
    gen = torch.Generator().manual_seed(seed)
    clocks0 = {s.name: ref.clocks(s.name, probe_ids(s)) for s in specs}
    for step in range(6):
        reqs = [pushes(s, gen, 9 + 2 * step + k % 3) for k, s in enumerate(specs)]
        if step % 3 == 0:  # one table at a time
            for r in reqs:
                store.push(r.table, r.ids, r.grads)
                ref.push(r.table, r.ids, rounded(ref.spec(r.table), r.grads))
        else:  # every table in one batch (counted at step 4, where the optimizer takes it)
            if step == 4:
                reqs = [counted(s, r, gen) if s.optimizer.stat_dim(s.dim) else r
                        for s, r in zip(specs, reqs, strict=True)]  # fmt: skip
            store.push_many(reqs)
            ref.push_many([ref_request(ref, r) for r in reqs])
        for s in specs:
            same(f"{s.name} step {step}", store, ref, s.name, probe_ids(s))
    # batched pulls: plain, conditional and with the state, the tables mixed
    for bound in (0, 2):
        pulls = [PullRequest(s.name, probe_ids(s), clocks0[s.name], bound) for s in specs]
        for p, got, want in zip(pulls, store.pull_many(pulls), ref.pull_many(pulls), strict=True):
            assert want.positions is not None and got.positions is not None
            assert torch.equal(got.positions, want.positions), f"bound {bound}: positions"
            rows = expected_rows(ref.spec(p.table), p.ids, want)
            assert_same(got.rows, rows, what=f"{p.table} bound {bound}: rows", why=WHY)
            assert torch.equal(got.clocks, want.clocks), f"bound {bound}: clocks"
    for every in (True, False):  # the state riding in the pull's reply, or STATE messages
        pulls = [PullRequest(s.name, probe_ids(s), with_state=every or k % 2 == 0)
                 for k, s in enumerate(specs)]  # fmt: skip
        for p, got, want in zip(pulls, store.pull_many(pulls), ref.pull_many(pulls), strict=True):
            what = f"{p.table} with_state={p.with_state}"
            rows = expected_rows(ref.spec(p.table), p.ids, want)
            assert_same(got.rows, rows, what=f"{what}: rows", why=WHY)
            if p.with_state:
                assert got.state is not None and want.state is not None, what
                assert_same(got.state, want.state, what=f"{what}: state", why=WHY)
    for s in specs:
        a, b = store.stats()[s.name], ref.stats()[s.name]
        for key in ("rows", "rows_pushed", "rows_skipped_nan"):
            assert a[key] == b[key], f"{s.name}: stats {key} {a[key]} != {b[key]}"
    return ref


def expect_error(what: str, exc: type[Exception], fn: object, *needles: str) -> None:
    try:
        fn()  # type: ignore[operator]
    except exc as e:
        missing = [n for n in needles if n not in str(e)]
        assert not missing, f"{what}: message lacks {missing}: {e}"
    else:
        raise AssertionError(f"{what}: no {exc.__name__} raised")


def range_checks(store: MPIStore, prefix: str) -> int:
    """A gradient past fp16's largest value (65504) becomes Inf on the wire: refused
    naming the table and row, nothing applied; bf16 carries it; "skip" drops the row."""
    n = 0
    for dtype, policy in (("fp16", "raise"), ("bf16", "raise"), ("fp16", "skip")):
        spec = ps.TableSpec(name=f"{prefix}{dtype}_{policy}", num_rows=20, dim=4,
                            optimizer=ps.SGD(lr=1e-6), dtype=dtype, nan_policy=policy)  # type: ignore[arg-type]  # fmt: skip
        ref = ps.InProcessStore()
        store.create_table(spec)
        ref.create_table(spec)
        ids = torch.tensor([3, 11, 4])
        grads = torch.ones(3, 4)
        grads[1, 2] = 1e5  # finite in float32 and bf16; Inf in fp16
        every = torch.arange(20)
        if dtype == "fp16" and policy == "raise":
            request = PushRequest(spec.name, ids, grads)
            for what, fn in (
                ("fp16 overflow", lambda r=request: store.push(r.table, r.ids, r.grads)),
                ("fp16 overflow batch", lambda r=request: store.push_many([r])),
            ):
                expect_error(what, ValueError, fn, repr(spec.name), "row id 11", "Inf", "65504")
        else:
            store.push(spec.name, ids, grads)
            ref.push(spec.name, ids, rounded(spec, grads))  # fp16 "skip": Inf dropped there too
        same(f"{spec.name} after", store, ref, spec.name, every)
        skipped = store.stats()[spec.name]["rows_skipped_nan"]
        assert skipped == (1 if policy == "skip" else 0), (spec.name, skipped)
        n += 1
    return n


def raw_checks(store: MPIStore, prefix: str) -> int:
    """Requests only a server can refuse, made by hand (the worker would not send them)."""
    spec = ps.TableSpec(name=f"{prefix}raw", num_rows=20, dim=4, optimizer=ps.SGD(lr=0.1),
                        dtype="fp16")  # fmt: skip
    ref = ps.InProcessStore()
    store.create_table(spec)
    ref.create_table(spec)
    index = store._table(spec.name).index  # private: a test of the wire protocol
    every = torch.arange(20)
    home = int(torch.nonzero(ps.shard_of(every, len(index)) == 0)[0, 0])  # an id of server 0
    inf16 = np.full(4, np.inf, dtype=np.float16).view(np.float32)  # 4 fp16 Infs, 2 words
    cases = [
        ("fp32 rows to an fp16 table", wire.Op.PUSH, wire.width_word(4, "fp32"),
         np.ones(4, np.float32), ("fp32 rows", "holds fp16")),
        ("fp32 pull of an fp16 table", wire.Op.PULL, wire.width_word(4, "fp32"),
         None, ("fp32 rows", "holds fp16")),
        ("fp16 Inf at the server", wire.Op.PUSH, wire.width_word(4, "fp16"), inf16,
         (repr(spec.name), f"row id {home}", "NaN or Inf")),
        ("unknown row type", wire.Op.PUSH, 4 | (9 << 32), np.ones(2, np.float32),
         ("row type 9",)),
    ]  # fmt: skip
    for what, op, width, data, needles in cases:
        kw: dict[str, object] = dict(payload=(np.array([home]),), table=index[0], n=1, dim=width)
        if data is not None:
            kw["data"] = data

        def send(op: int = op, kw: dict[str, object] = kw, what: str = what) -> None:
            call = store._start(0, op, **kw)  # type: ignore[arg-type]
            store._handle([call], lambda: None, what).wait()

        expect_error(what, ValueError, send, *needles)
        same(f"after {what}", store, ref, spec.name, every)
    # the single-table PULL and PUSH (the store sends batches) carry fp16 values too
    grads16 = torch.full((1, 4), 0.5, dtype=torch.float16)
    call = store._start(0, wire.Op.PUSH, payload=(np.array([home]),), table=index[0], n=1,
                        dim=wire.width_word(4, "fp16"), data=wire.pack_values(grads16))  # fmt: skip
    store._handle([call], lambda: None, "single push").wait()
    ref.push(spec.name, torch.tensor([home]), grads16.float())
    same("after a single PUSH", store, ref, spec.name, every)
    reply = np.empty(2, dtype=np.float32)  # one row of 4 fp16 values: 2 words
    width = wire.width_word(4, "fp16")
    call = store._start(0, wire.Op.PULL, payload=(np.array([home]),), table=index[0], n=1,
                        dim=width, reply_words=1, reply_data=reply)  # fmt: skip
    store._handle([call], lambda: None, "single pull").wait()
    got = wire.unpack_values(reply, 4, "fp16").view(1, 4)
    want = ref.pull(spec.name, torch.tensor([home])).rows
    assert_same(got, want, what="single PULL", why=WHY)
    return len(cases) + 2


def checkpoint_checks(store: MPIStore, ref: ps.InProcessStore, folder: Path) -> int:
    """Saved through MPI: the manifest keeps each dtype, an in-process store loads the
    same rows; changed and loaded back, the MPI store has them again."""
    store.save(folder / "mpi")
    local = ps.InProcessStore()
    local.load(folder / "mpi")
    names = ref.tables()
    for name in names:
        spec = ref.spec(name)
        assert local.spec(name) == spec and local.spec(name).dtype == spec.dtype, name
        ids = probe_ids(spec)
        if spec.num_rows is None:  # the rows a dynamic table holds (absent ones: above)
            ids = ids[ref.clocks(name, ids) > 0]
        same(f"{name} saved by MPI", local, ref, name, ids)
    for name in names:  # changed, then replaced by the load
        store.push(name, torch.tensor([1, 2]), torch.ones(2, ref.spec(name).dim))
    store.load(folder / "mpi")
    for name in names:
        assert store.spec(name).dtype == ref.spec(name).dtype, name
        same(f"{name} loaded by MPI", store, ref, name, probe_ids(ref.spec(name)))
    return len(names)


def protocol_check(store: MPIStore) -> None:
    """A worker of an older protocol asking this server: a clear error naming both."""
    new = wire.PROTOCOL, wire.MAGIC_VERSION
    old = new[0] - 1
    wire.PROTOCOL, wire.MAGIC_VERSION = old, (wire.MAGIC << 16) | old
    try:
        expect_error("old protocol", ValueError, store.tables, f"protocol {new[0]}",
                     f"protocol {old}", "run the same hybridrec version on every rank")  # fmt: skip
    finally:
        wire.PROTOCOL, wire.MAGIC_VERSION = new
    assert store.tables(), "the server serves on after a request of another version"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--servers", type=int, required=True)
    parser.add_argument("--dir", type=Path, required=True)
    parser.add_argument("--protocol", action="store_true", help="also the version check")
    args = parser.parse_args()
    group = comm.init("mpi")
    topology = comm.Topology(world_size=group.size, num_servers=args.servers)
    workers = topology.role_group(group)  # collective: the workers' (or servers') sub-group
    if topology.role(group.rank) is comm.Role.SERVER:
        stats = serve_mpi(group, topology)
        print(f"rank {group.rank}: ok server tables={len(stats)}", flush=True)
        return
    me, size = workers.rank, workers.size
    with MPIStore(group, topology, request_timeout_s=60.0) as store:
        mine = [s for k, s in enumerate(narrow_specs()) if k % size == me]
        ref = equivalence(store, mine, seed=me)
        n = len(mine) + range_checks(store, f"w{me}_") + raw_checks(store, f"w{me}_")
        workers.barrier()  # every worker's tables are final: one of them saves them all
        if me == 0:  # the checkpoint holds every table; this worker's are compared
            n += checkpoint_checks(store, ref, args.dir)
            if args.protocol:
                protocol_check(store)
                n += 1
        workers.barrier()
    print(f"rank {group.rank}: ok worker {n} checks", flush=True)


if __name__ == "__main__":
    main()
