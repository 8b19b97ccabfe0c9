"""Rank script: sharded tables of fp16 and bf16 rows equal one process bit for bit.

Modes (first argument; ``all`` runs each):

* ``train``: every rank builds the same global batches (same seed) and trains its
  slice of the samples through :class:`embedding.sharded.ShardedTables` (local mean
  loss, backward). The reference is one :class:`ps.InProcessStore` holding every table
  whole (the same ``TableSpec``, dtype included), pushed each step the row gradients
  of the global batch computed in float64. The loss is linear in the outputs with
  dyadic projections (multiples of 1/8), dyadic per-id weights and power-of-two batch
  sizes, so every row gradient is a short sum of dyadic numbers: exact in float32 in
  any order. Both sides then run the same float32 update on the same inputs and round
  it with the same bits (keyed by the table's row id and the row's clock), so after
  every step the tables (their narrow bits), the optimizer state and the clocks must
  be *equal*, at 1, 2 and 4 ranks alike; the pooled outputs, one float32 pooling of the
  same rows in another layout, within the rounding of that pooling. A second reference,
  the same tables placed "local" in one EmbeddingCollection trained on the global batch
  (its own narrow engine), must hold the same rows after every step too. Scenarios: every
  table fp16, every table bf16, and fp16, bf16 and float32 tables side by side (the
  rows then travel as bytes). One table is split row-wise (its shards' local
  rows are not its ids), the others placed whole; two features share a table; one
  step has ranks without any ids. Each rank prints a digest of the final tables, which
  the test compares across rank counts and backends.
* ``wire``: the rows of the output dist travel in the stored type: the tensor each
  rank receives back is float16/bfloat16 (bytes when the types differ) with 2
  bytes per element of a narrow row, 4 per float32 one; gradients travel as float32.
* ``checkpoint DIR``: ``save`` writes float32 rows and a spec recording the dtype; the
  files load bit for bit into another plan and into a store, and training resumed from
  them equals training on; the state dict holds rows in their type and round-trips.

Backend from ``HYBRIDREC_TEST_BACKEND`` (set by tests/support/multiproc.py).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Callable
from pathlib import Path
from typing import Literal

import torch
import torch.nn.functional as F

import comm
import ps
from embedding.collection import EmbeddingCollection
from embedding.config import TableConfig
from embedding.jagged import KeyedJaggedIds
from embedding.sharded import ShardedTables
from ps.checkpoint import read_checkpoint
from tests.support.tolerance import assert_close, assert_same, sum_tol

GLOBAL_BATCH = 8  # divisible by 1, 2 and 4 ranks; a power of two (exact means)
STEPS = 4
EMPTY_STEP = 2  # the first half of this step's samples have no ids at all
ROW_WISE_THRESHOLD = 50  # "big" (60 rows) is split over all ranks
MAX_BAG = 4
WEIGHTS = (0.5, 1.0, 2.0)  # per-id weights: dyadic, so products and sums stay exact
RowDtype = Literal["fp32", "fp16", "bf16"]
SCENARIOS: dict[str, tuple[RowDtype, RowDtype, RowDtype]] = {
    # (items, big, users) row types; "cats" is float32 in the mixed scenario only
    "fp16": ("fp16", "fp16", "fp16"),
    "bf16": ("bf16", "bf16", "bf16"),
    "mixed": ("fp16", "bf16", "fp16"),
}
EXACT = (
    "row gradients are short sums of dyadic numbers (exact in float32 in any order), "
    "so both sides run the same float32 update on the same values and round it with the "
    "same bits"
)


def tables(scenario: str) -> list[TableConfig]:
    items, big, users = SCENARIOS[scenario]
    out = [
        TableConfig(
            name="items", num_rows=40, dim=8, feature_names=["clicked", "bought"],
            pooling="sum", placement="sharded", optimizer=ps.RowWiseAdagrad(lr=0.05),
            dtype=items,
        ),
        TableConfig(
            name="big", num_rows=60, dim=6, feature_names=["query"], pooling="sum",
            placement="sharded", optimizer=ps.Adam(lr=0.01), dtype=big,
        ),
        TableConfig(
            name="users", num_rows=15, dim=5, feature_names=["user"], pooling="sum",
            placement="sharded", optimizer=ps.SGD(lr=0.01), dtype=users,
        ),
    ]  # fmt: skip
    if scenario == "mixed":
        out.append(
            TableConfig(
                name="cats",
                num_rows=7,
                dim=3,
                feature_names=["cat"],
                pooling="sum",
                placement="sharded",
                optimizer=ps.SGD(lr=0.3),
            )  # fmt: skip
        )
    return out


def global_batch(cfgs: list[TableConfig], gen: torch.Generator, step: int) -> KeyedJaggedIds:
    """The same weighted batch of :data:`GLOBAL_BATCH` samples on every rank."""
    ids: dict[str, list[list[int]]] = {}
    weights: dict[str, list[list[float]]] = {}
    for cfg in cfgs:
        assert cfg.num_rows is not None
        hi = cfg.num_rows if cfg.name == "big" else min(9, cfg.num_rows)  # many repeats
        for feat in cfg.feature_names:
            samples, ws = [], []
            for b in range(GLOBAL_BATCH):
                n = int(torch.randint(0, MAX_BAG + 1, (1,), generator=gen))
                if step == EMPTY_STEP and b < GLOBAL_BATCH // 2:
                    n = 0
                samples.append(torch.randint(0, hi, (n,), generator=gen).tolist())
                pick = torch.randint(0, len(WEIGHTS), (n,), generator=gen).tolist()
                ws.append([WEIGHTS[k] for k in pick])
            ids[feat], weights[feat] = samples, ws
    return KeyedJaggedIds.from_lists(ids, weights)


def projections(cfgs: list[TableConfig], gen: torch.Generator) -> dict[str, torch.Tensor]:
    """Per feature ``[GLOBAL_BATCH, D]`` multiples of 1/8 in [-1, 1]."""
    return {
        f: torch.randint(-8, 9, (GLOBAL_BATCH, c.dim), generator=gen).float() / 8
        for c in cfgs
        for f in c.feature_names
    }


def mean_loss(pooled: dict[str, torch.Tensor], proj: dict[str, torch.Tensor]) -> torch.Tensor:
    """Mean over this rank's samples of ``sum_f <pooled_f, proj_f>``."""
    batch = next(iter(pooled.values())).shape[0]
    total = torch.zeros(())
    for feat, p in pooled.items():
        total = total + (p * proj[feat]).sum()
    return total / batch


def row_gradients(
    cfg: TableConfig, kjt: KeyedJaggedIds, proj: dict[str, torch.Tensor]
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(ids [U], grads [U, D] float32)``: every row the global batch uses and the
    gradient of the global mean loss, summed in float64 (exact: see the module doc)."""
    assert cfg.num_rows is not None
    grad = torch.zeros(cfg.num_rows, cfg.dim, dtype=torch.float64)
    used = torch.zeros(cfg.num_rows, dtype=torch.bool)
    for feat in cfg.feature_names:
        s = kjt[feat]
        assert s.weights is not None
        sample = torch.repeat_interleave(torch.arange(kjt.batch_size), s.lengths)  # [N]
        terms = s.weights.double().unsqueeze(1) * proj[feat].double()[sample]  # [N, D]
        grad.index_add_(0, s.ids, terms / GLOBAL_BATCH)
        used[s.ids] = True
    ids = torch.nonzero(used).squeeze(1)
    g = grad[ids]
    assert torch.equal(g.float().double(), g), f"table {cfg.name}: a row gradient is not exact"
    return ids, g.float()


def reference_pool(
    rows: torch.Tensor, kjt: KeyedJaggedIds, feat: str, lo: int, hi: int
) -> torch.Tensor:
    """Samples ``[lo, hi)`` of ``feat`` pooled over the float32 ``rows`` ``[N, D]``."""
    s = kjt.sample_slice(lo, hi)[feat]
    return F.embedding_bag(s.ids, rows, s.offsets()[:-1], mode="sum", per_sample_weights=s.weights)


def check_equal(what: str, got: torch.Tensor, want: torch.Tensor) -> None:
    assert_same(got, want, what=what, why=EXACT)


def digest(model: ShardedTables, cfgs: list[TableConfig]) -> str:
    """A hash of every table's rows, optimizer state and clocks (collective)."""
    h = hashlib.sha256()
    for cfg in cfgs:
        for t in (
            model.full_table(cfg.name),
            model.full_state(cfg.name),
            model.full_clocks(cfg.name),
        ):
            h.update(t.contiguous().numpy().tobytes())
    return h.hexdigest()[:16]


def train(group: comm.ProcessGroup, scenario: str) -> None:
    rank, size = group.rank, group.size
    local = GLOBAL_BATCH // size
    cfgs = tables(scenario)
    tag = f"rank {rank}/{size} {scenario}"
    model = ShardedTables(cfgs, group, row_wise_threshold_rows=ROW_WISE_THRESHOLD)
    if size > 1 and not model.plan.table("big").row_wise:
        raise AssertionError(f"{tag}: table 'big' should be split row-wise")
    store = ps.InProcessStore()
    for cfg in cfgs:
        store.create_table(cfg.to_spec())
    whole = EmbeddingCollection([dataclasses.replace(c, placement="local") for c in cfgs])
    gen = torch.Generator().manual_seed(11)
    proj = projections(cfgs, gen)
    for step in range(STEPS):
        kjt = global_batch(cfgs, gen, step)
        mine = kjt.sample_slice(rank * local, (rank + 1) * local)
        my_proj = {f: p[rank * local : (rank + 1) * local] for f, p in proj.items()}
        got = model(mine)
        for cfg in cfgs:
            assert cfg.num_rows is not None
            rows = store.pull(cfg.name, torch.arange(cfg.num_rows)).rows  # [N, D] float32
            for feat in cfg.feature_names:
                want = reference_pool(rows, kjt, feat, rank * local, (rank + 1) * local)
                mags = reference_pool(rows.abs(), kjt, feat, rank * local, (rank + 1) * local)
                top = float(mags.max()) if mags.numel() else 0.0
                tol = sum_tol(torch.float32, MAX_BAG + 1, top)
                assert_close(
                    got[feat].detach(), want, atol=tol, what=f"{tag} step {step} output {feat}",
                    why="one float32 pooling of the same rows (its order may differ)",
                )  # fmt: skip
        mean_loss(got, my_proj).backward()
        mean_loss(whole(kjt), proj).backward()
        for cfg in cfgs:
            ids, grads = row_gradients(cfg, kjt, proj)
            store.push(cfg.name, ids, grads)
        for cfg in cfgs:
            assert cfg.num_rows is not None
            every = torch.arange(cfg.num_rows)
            what = f"{tag} step {step} table {cfg.name} ({cfg.dtype})"
            rows = model.full_table(cfg.name)
            check_equal(what, rows, store.pull(cfg.name, every).rows)
            check_equal(f"{what} vs local placement", rows, whole.rows(cfg.name, every))
            check_equal(f"{what} state", model.full_state(cfg.name), store.state(cfg.name, every))
            check_equal(
                f"{what} clocks", model.full_clocks(cfg.name), store.clocks(cfg.name, every)
            )
    for cfg in cfgs:
        if model.shard(cfg.name)[2].dtype != cfg.to_spec().torch_dtype:
            raise AssertionError(f"{tag}: table {cfg.name} is not stored as {cfg.dtype}")
        if int(store.clocks(cfg.name, torch.arange(cfg.num_rows or 0)).sum()) == 0:
            raise AssertionError(f"{tag}: table {cfg.name} never trained")
    print(f"{tag}: ok narrow sharded training digest {digest(model, cfgs)}", flush=True)


def record_alltoallv(
    group: comm.ProcessGroup,
) -> tuple[list[tuple[torch.dtype, int, int]], Callable[[], None]]:
    """Record ``(dtype, bytes sent, bytes received)`` of every alltoallv of ``group``;
    returns the list and a function that stops recording."""
    calls: list[tuple[torch.dtype, int, int]] = []
    inner = group.alltoallv

    def alltoallv(tensor: torch.Tensor, *args: object, **kwargs: object) -> torch.Tensor:
        out = inner(tensor, *args, **kwargs)  # type: ignore[arg-type]
        calls.append((tensor.dtype, tensor.numel() * tensor.itemsize, out.numel() * out.itemsize))
        return out

    group.alltoallv = alltoallv  # type: ignore[method-assign]
    return calls, lambda: delattr(group, "alltoallv")


def wire(group: comm.ProcessGroup) -> None:
    rank, size = group.rank, group.size
    local = GLOBAL_BATCH // size
    for scenario in ("fp16", "bf16", "mixed"):
        cfgs = tables(scenario)
        model = ShardedTables(cfgs, group, row_wise_threshold_rows=ROW_WISE_THRESHOLD)
        gen = torch.Generator().manual_seed(3)
        proj = projections(cfgs, gen)
        kjt = global_batch(cfgs, gen, 0)
        mine = kjt.sample_slice(rank * local, (rank + 1) * local)
        # Rows this rank gets back: its unique ids per table.
        elements = {2: 0, 4: 0}  # bytes per element -> elements received
        for cfg in cfgs:
            ids = torch.cat([mine[f].ids for f in cfg.feature_names])
            elements[cfg.to_spec().torch_dtype.itemsize] += torch.unique(ids).numel() * cfg.dim
        calls, stop = record_alltoallv(group)
        try:
            mean_loss(
                model(mine), {f: p[rank * local : (rank + 1) * local] for f, p in proj.items()}
            ).backward()
        finally:
            stop()
        want_dtype = {"fp16": torch.float16, "bf16": torch.bfloat16, "mixed": torch.uint8}[scenario]
        rows = [c for c in calls if c[0] != torch.int64]  # not the counts or the ids
        # forward: the rows (wire type), backward: their gradients (float32)
        if [c[0] for c in rows] != [want_dtype, torch.float32]:
            raise AssertionError(f"rank {rank}/{size} {scenario}: exchanged {calls}")
        got_bytes = rows[0][2]
        want_bytes = 2 * elements[2] + 4 * elements[4]
        if got_bytes != want_bytes or rows[1][1] != 4 * (elements[2] + elements[4]):
            raise AssertionError(
                f"rank {rank}/{size} {scenario}: rows came back in {got_bytes} bytes (expected "
                f"{want_bytes}: 2 per narrow element, 4 per float32 one), gradients went in "
                f"{rows[1][1]} (expected {4 * (elements[2] + elements[4])})"
            )
    print(f"rank {rank}/{size}: ok narrow sharded wire ({group.backend})", flush=True)


def train_steps(
    model: ShardedTables, cfgs: list[TableConfig], seed: int, steps: int, group: comm.ProcessGroup
) -> None:
    rank, local = group.rank, GLOBAL_BATCH // group.size
    gen = torch.Generator().manual_seed(seed)
    proj = projections(cfgs, gen)
    for step in range(steps):
        kjt = global_batch(cfgs, gen, step)
        mine = kjt.sample_slice(rank * local, (rank + 1) * local)
        my_proj = {f: p[rank * local : (rank + 1) * local] for f, p in proj.items()}
        mean_loss(model(mine), my_proj).backward()


def checkpoint(group: comm.ProcessGroup, root: Path) -> None:
    rank, size = group.rank, group.size
    tag = f"rank {rank}/{size}"
    path = root / f"{group.backend}-{size}"
    cfgs = tables("mixed")
    model = ShardedTables(cfgs, group, row_wise_threshold_rows=ROW_WISE_THRESHOLD)
    train_steps(model, cfgs, seed=5, steps=2, group=group)
    model.save(path)
    # The manifest records each table's row type; the parts hold float32 rows.
    manifest = json.loads((path / "manifest.json").read_text())
    recorded = {t["spec"]["name"]: t["spec"].get("dtype", "fp32") for t in manifest["tables"]}
    if recorded != {c.name: c.dtype for c in cfgs}:
        raise AssertionError(f"{tag}: the manifest records dtypes {recorded}")
    ckpt = read_checkpoint(path)
    # Another plan (every table whole on one rank): the same bits.
    other = ShardedTables(cfgs, group, row_wise_threshold_rows=None)
    other.load(path)
    store = ps.InProcessStore()
    store.load(path)
    for cfg in cfgs:
        assert cfg.num_rows is not None
        every = torch.arange(cfg.num_rows)
        what = f"{tag} checkpoint table {cfg.name} ({cfg.dtype})"
        want = model.full_table(cfg.name)
        if ckpt.spec(cfg.name).dtype != cfg.dtype:
            raise AssertionError(f"{what}: read back as {ckpt.spec(cfg.name).dtype}")
        check_equal(f"{what} file", ckpt.read_table(cfg.name).weights, want)
        check_equal(f"{what} loaded", other.full_table(cfg.name), want)
        check_equal(f"{what} state", other.full_state(cfg.name), model.full_state(cfg.name))
        check_equal(f"{what} clocks", other.full_clocks(cfg.name), model.full_clocks(cfg.name))
        check_equal(f"{what} in a store", store.pull(cfg.name, every).rows, want)
        if store.spec(cfg.name).dtype != cfg.dtype:
            raise AssertionError(f"{what}: the store loaded it as {store.spec(cfg.name).dtype}")
    # Training resumed from the files equals training on (rounding keyed by ids and clocks).
    train_steps(model, cfgs, seed=6, steps=2, group=group)
    train_steps(other, cfgs, seed=6, steps=2, group=group)
    for cfg in cfgs:
        check_equal(
            f"{tag} resumed table {cfg.name}",
            other.full_table(cfg.name),
            model.full_table(cfg.name),
        )
    # The state dict holds each table's rows in its type and loads back exactly.
    sd = model.state_dict()
    for cfg in cfgs:
        got = sd[f"{cfg.name}.weight"].dtype
        if got != cfg.to_spec().torch_dtype:
            raise AssertionError(f"{tag}: state dict rows of {cfg.name} are {got}")
    fresh = ShardedTables(cfgs, group, row_wise_threshold_rows=ROW_WISE_THRESHOLD)
    fresh.load_state_dict(sd)
    for cfg in cfgs:
        check_equal(
            f"{tag} state dict table {cfg.name}",
            fresh.full_table(cfg.name),
            model.full_table(cfg.name),
        )
    print(f"{tag}: ok narrow sharded checkpoint ({group.backend})", flush=True)


def run(group: comm.ProcessGroup, args: list[str]) -> None:
    """Run mode ``args[0]`` (``train``, ``wire``, ``checkpoint DIR`` or ``all DIR``)."""
    mode = args[0] if args else "train"
    if mode not in ("train", "wire", "checkpoint", "all"):
        raise ValueError(f"unknown mode {mode!r}")
    if GLOBAL_BATCH % group.size != 0:
        raise ValueError(f"global batch {GLOBAL_BATCH} does not split over {group.size}")
    if mode in ("train", "all"):
        for scenario in SCENARIOS:
            train(group, scenario)
    if mode in ("wire", "all"):
        wire(group)
    if mode in ("checkpoint", "all"):
        checkpoint(group, Path(args[1]))


if __name__ == "__main__":
    from tests.support.ranks.rank_main import run_main

    run_main(run)
