"""Rank script: sharded tables trained on local batches equal one process on the global batch.

Modes (first argument):

* ``train``: every rank builds the same global batches (same seed), runs its
  slice of the samples through :class:`embedding.sharded.ShardedTables` with a
  local mean loss and backward. After every step, every table (gathered from its
  shards), the row-wise Adagrad accumulators and the clocks are compared with a
  single-process reference built from plain ``torch.nn.EmbeddingBag`` /
  ``F.embedding`` and optimizers written in plain torch, trained on the whole
  global batch with the global mean loss; this rank's pooled outputs are
  compared with the reference's outputs for the same samples. Two scenarios: sum
  and mean pooling without weights, and all-sum with per-id weights. One table
  is split row-wise, the others are placed whole; two features share a table;
  a sequence table (pooling "none") is in both; one step has whole ranks with no
  ids at all. Every comparison is within a few times the reference's own fp32 rounding
  error, measured by replaying it in float64 (``tests/support/tolerance.py``), and never below
  the worst case of the last step alone (:func:`last_step_terms`).
* ``bad``: out-of-range ids on one rank, an unknown feature on rank 0 and
  ranks that disagree on the plan must raise ValueError on every rank (no hang),
  and the module must keep working afterwards.

Backend from ``HYBRIDREC_TEST_BACKEND`` (set by tests/support/multiproc.py).
"""

from __future__ import annotations

import dataclasses
from typing import Literal

import torch
import torch.nn.functional as F

import comm
import ps
from embedding.config import TableConfig
from embedding.jagged import KeyedJaggedIds
from embedding.sharded import ShardedTables
from embedding.sharding_plan import ShardingPlan
from tests.support.tolerance import assert_close, assert_same, replay_tol, sum_tol

GLOBAL_BATCH = 8  # divisible by 1, 2 and 4 ranks
STEPS = 3
EMPTY_STEP = 2  # the first half of this step's samples have no ids at all
SEQ_LEN = 3
ROW_WISE_THRESHOLD = 50  # "big" (60 rows) is split over all ranks
MAX_BAG = 4  # ids per sample and feature: at most 4
WHY = "a few times the one-process reference's fp32 rounding error, measured in float64"
# At most this many roundings in the update of one element by these optimizers (Adam: m,
# v, sqrt(v), + eps, the step size, the quotient, its product and the sum), plus 2 for the
# loss's mean (a local mean averaged over the ranks, or one global mean).
UPDATE_ROUNDINGS = 10


def tables(weighted: bool) -> list[TableConfig]:
    mean: Literal["sum", "mean"] = "sum" if weighted else "mean"
    return [
        TableConfig(
            name="items", num_rows=40, dim=8, feature_names=["clicked", "bought"],
            pooling="sum", placement="sharded", optimizer=ps.RowWiseAdagrad(lr=0.1),
        ),
        TableConfig(
            name="users", num_rows=15, dim=4, feature_names=["user"], pooling=mean,
            placement="sharded", optimizer=ps.SGD(lr=0.5),
        ),
        TableConfig(
            name="big", num_rows=60, dim=6, feature_names=["query", "doc"], pooling=mean,
            placement="sharded", optimizer=ps.Adam(lr=0.05),
        ),
        TableConfig(
            name="cats", num_rows=7, dim=3, feature_names=["cat"], pooling="sum",
            placement="sharded", optimizer=ps.SGD(lr=0.3),
        ),
        TableConfig(
            name="tokens", num_rows=30, dim=5, feature_names=["seq"], pooling="none",
            placement="sharded", optimizer=ps.RowWiseAdagrad(lr=0.2),
        ),
    ]  # fmt: skip


def global_batch(
    cfgs: list[TableConfig], gen: torch.Generator, step: int, weighted: bool
) -> KeyedJaggedIds:
    ids: dict[str, list[list[int]]] = {}
    weights: dict[str, list[list[float]]] = {}
    for cfg in cfgs:
        assert cfg.num_rows is not None
        for feat in cfg.feature_names:
            samples, ws = [], []
            for b in range(GLOBAL_BATCH):
                n = int(torch.randint(0, 5, (1,), generator=gen))
                if cfg.pooling == "none":
                    n = 0 if step == EMPTY_STEP else SEQ_LEN
                # Small id ranges except for the row-wise table: many repeats.
                hi = cfg.num_rows if cfg.name == "big" else min(9, cfg.num_rows)
                row = torch.randint(0, hi, (n,), generator=gen)
                if step == EMPTY_STEP and b < GLOBAL_BATCH // 2:
                    row = row[:0]
                samples.append(row.tolist())
                ws.append((torch.rand(row.numel(), generator=gen) + 0.5).tolist())
            ids[feat], weights[feat] = samples, ws
    return KeyedJaggedIds.from_lists(ids, weights if weighted else None)


class Reference:
    """The single-process model: plain EmbeddingBag / embedding + optimizers in plain torch."""

    def __init__(self, cfgs: list[TableConfig], dtype: torch.dtype = torch.float32) -> None:
        self.cfgs = cfgs
        self.dtype = dtype
        self.bags: dict[str, torch.nn.EmbeddingBag] = {}
        self.state: dict[str, dict[str, torch.Tensor]] = {}
        self.clocks: dict[str, torch.Tensor] = {}
        self.sgd: dict[str, torch.optim.SGD] = {}
        for cfg in cfgs:
            assert cfg.num_rows is not None
            mode = "sum" if cfg.pooling == "none" else cfg.pooling
            bag = torch.nn.EmbeddingBag(cfg.num_rows, cfg.dim, mode=mode, dtype=dtype)
            with torch.no_grad():  # the same deterministic init as the sharded shards
                bag.weight.copy_(cfg.to_spec().initial_rows(torch.arange(cfg.num_rows)))
            self.bags[cfg.name] = bag
            self.clocks[cfg.name] = torch.zeros(cfg.num_rows, dtype=torch.int64)
            rows, d = cfg.num_rows, cfg.dim
            if isinstance(cfg.optimizer, ps.SGD):
                self.sgd[cfg.name] = torch.optim.SGD(bag.parameters(), lr=cfg.optimizer.lr)
            elif isinstance(cfg.optimizer, ps.RowWiseAdagrad):
                self.state[cfg.name] = {"acc": torch.zeros(rows, dtype=dtype)}
            elif isinstance(cfg.optimizer, ps.Adam):
                self.state[cfg.name] = {
                    "m": torch.zeros(rows, d, dtype=dtype),
                    "v": torch.zeros(rows, d, dtype=dtype),
                    "t": torch.zeros(rows, dtype=torch.float64),
                }  # fmt: skip

    def forward(self, kjt: KeyedJaggedIds) -> dict[str, torch.Tensor]:
        out = {}
        b = kjt.batch_size
        for cfg in self.cfgs:
            bag = self.bags[cfg.name]
            for feat in cfg.feature_names:
                s = kjt[feat]
                weights = None if s.weights is None else s.weights.to(self.dtype)
                if cfg.pooling == "none":
                    rows = F.embedding(s.ids, bag.weight)  # [B * T, D]
                    if weights is not None:
                        rows = rows * weights.unsqueeze(1)
                    out[feat] = rows.view(b, -1, cfg.dim)
                else:
                    out[feat] = bag(s.ids, s.offsets()[:-1], per_sample_weights=weights)
        return out

    @torch.no_grad()
    def step(self, kjt: KeyedJaggedIds) -> None:
        for cfg in self.cfgs:
            w = self.bags[cfg.name].weight
            assert w.grad is not None
            g = w.grad
            touched = torch.zeros(w.shape[0], dtype=torch.bool)
            for feat in cfg.feature_names:
                touched[kjt[feat].ids] = True
            self.clocks[cfg.name] += touched.long()
            opt = cfg.optimizer
            if isinstance(opt, ps.SGD):
                self.sgd[cfg.name].step()
            elif isinstance(opt, ps.RowWiseAdagrad):
                acc = self.state[cfg.name]["acc"]
                acc[touched] += g[touched].pow(2).mean(dim=1)
                w[touched] -= opt.lr * g[touched] / (acc[touched].sqrt() + opt.eps).unsqueeze(1)
            elif isinstance(opt, ps.Adam):
                st = self.state[cfg.name]
                b1, b2 = opt.betas
                m, v, t = st["m"], st["v"], st["t"]
                t[touched] += 1
                m[touched] = b1 * m[touched] + (1 - b1) * g[touched]
                v[touched] = b2 * v[touched] + (1 - b2) * g[touched] ** 2
                tt = t[touched]
                size = (opt.lr * torch.sqrt(1 - b2**tt) / (1 - b1**tt)).to(w.dtype).unsqueeze(1)
                w[touched] -= size * m[touched] / (v[touched].sqrt() + opt.eps)
            else:
                raise AssertionError(f"no reference for {opt}")
            w.grad = None


def mean_loss(pooled: dict[str, torch.Tensor], proj: dict[str, torch.Tensor]) -> torch.Tensor:
    """Mean over samples of sum_f <pooled_f, proj_f> (sequence outputs summed over T)."""
    batch = next(iter(pooled.values())).shape[0]
    total = torch.zeros(())
    for feat, p in pooled.items():
        q = p.sum(dim=1) if p.dim() == 3 else p  # [B, D]
        total = total + (q * proj[feat]).sum()
    return total / batch


def check_close(
    what: str, got: torch.Tensor, want: torch.Tensor, want64: torch.Tensor, floor_terms: int
) -> None:
    """``got`` (a fp32 run on the ranks) against the fp32 reference ``want``, within
    :func:`replay_tol` of the reference and its float64 replay ``want64``."""
    got, want, want64 = got.detach(), want.detach(), want64.detach()
    if got.shape != want.shape:
        raise AssertionError(f"{what}: shape {tuple(got.shape)} != {tuple(want.shape)}")
    tol = replay_tol(want, want64, floor_terms=floor_terms)
    assert_close(got.float(), want, atol=tol, what=what, why=WHY)


def ps_state(ref: Reference, cfg: TableConfig) -> torch.Tensor:
    """The reference's optimizer state of ``cfg`` in the ps layout ``[rows, S]``."""
    st = ref.state[cfg.name]
    if isinstance(cfg.optimizer, ps.RowWiseAdagrad):
        return st["acc"].unsqueeze(1)
    assert isinstance(cfg.optimizer, ps.Adam)
    return torch.cat([st["m"], st["v"], st["t"].to(st["m"].dtype).unsqueeze(1)], dim=1)


def state_terms(cfg: TableConfig, occ: int) -> int:
    """The ``floor_terms`` of an optimizer state: a mean of squares over ``dim`` doubles
    the relative error of a gradient of ``occ`` terms."""
    return 2 * occ + cfg.dim + UPDATE_ROUNDINGS


def max_occurrences(cfgs: list[TableConfig], kjt: KeyedJaggedIds) -> dict[str, int]:
    """Per table, the most times one id occurs in ``kjt``: the terms of its row gradient."""
    out = {}
    for cfg in cfgs:
        ids = torch.cat([kjt[f].ids for f in cfg.feature_names])
        out[cfg.name] = int(torch.unique(ids, return_counts=True)[1].max()) if ids.numel() else 0
    return out


def pool_tol(ref64: Reference, kjt: KeyedJaggedIds, feat: str, cfg: TableConfig) -> float:
    """Two fp32 poolings of ``feat`` over the same rows: up to :data:`MAX_BAG` products
    ``w_i * row_i`` summed, plus the rounding of ``1/len`` and of its product with a
    weight, over the largest ``sum_i |w_i| |row_i|`` of a bag (in float64)."""
    s = kjt[feat]
    if s.ids.numel() == 0:
        return 0.0
    w = ref64.bags[cfg.name].weight.detach().abs()
    weights = None if s.weights is None else s.weights.to(torch.float64).abs()
    mode = "sum" if cfg.pooling == "none" else cfg.pooling
    offsets = s.offsets()[:-1] if cfg.pooling != "none" else torch.arange(s.ids.numel())
    mags = F.embedding_bag(s.ids, w, offsets, mode=mode, per_sample_weights=weights)
    return sum_tol(torch.float32, MAX_BAG + 2, float(mags.max()))


def train(group: comm.ProcessGroup, weighted: bool) -> None:
    rank, size = group.rank, group.size
    local = GLOBAL_BATCH // size
    cfgs = tables(weighted)
    model = ShardedTables(cfgs, group, row_wise_threshold_rows=ROW_WISE_THRESHOLD)
    assert size == 1 or model.plan.table("big").row_wise, model.plan.describe()
    ref = Reference(cfgs)
    ref64 = Reference(cfgs, dtype=torch.float64)
    gen = torch.Generator().manual_seed(99 + int(weighted))
    proj = {
        f: torch.randn(GLOBAL_BATCH, c.dim, generator=gen) for c in cfgs for f in c.feature_names
    }
    tag = f"rank {rank}/{size} {'weighted' if weighted else 'plain'}"
    occ: dict[str, int] = {}
    for step in range(STEPS):
        kjt = global_batch(cfgs, gen, step, weighted)
        mine = kjt.sample_slice(rank * local, (rank + 1) * local)
        if step == EMPTY_STEP and rank < size // 2:
            assert mine.ids.numel() == 0  # this rank asks for nothing, but still serves
        my_proj = {f: p[rank * local : (rank + 1) * local] for f, p in proj.items()}
        got = model(mine)
        want, want64 = ref.forward(kjt), ref64.forward(kjt)
        if list(got) != mine.keys:
            raise AssertionError(f"{tag}: output keys {list(got)} != batch keys {mine.keys}")
        table_of = {f: c for c in cfgs for f in c.feature_names}
        for feat, g in got.items():
            sl = slice(rank * local, (rank + 1) * local)
            what = f"{tag} step {step} output {feat}"
            tol = max(
                replay_tol(want[feat][sl].detach(), want64[feat][sl].detach()),
                pool_tol(ref64, kjt, feat, table_of[feat]),
            )
            assert_close(g.detach(), want[feat][sl].detach(), atol=tol, what=what, why=WHY)
        mean_loss(got, my_proj).backward()
        mean_loss(want, proj).backward()
        mean_loss(want64, proj).backward()
        ref.step(kjt)
        ref64.step(kjt)
        occ = {name: max(n, occ.get(name, 0)) for name, n in max_occurrences(cfgs, kjt).items()}
        for cfg in cfgs:
            check_close(
                f"{tag} step {step} table {cfg.name}",
                model.full_table(cfg.name),
                ref.bags[cfg.name].weight,
                ref64.bags[cfg.name].weight,
                occ[cfg.name] + UPDATE_ROUNDINGS,
            )
            if step != STEPS - 1:
                continue  # state and clocks once at the end: fewer collectives, same cover
            clocks = model.full_clocks(cfg.name)
            if not torch.equal(clocks, ref.clocks[cfg.name]):
                raise AssertionError(
                    f"{tag} step {step} table {cfg.name}: clocks {clocks.tolist()} != "
                    f"{ref.clocks[cfg.name].tolist()}"
                )
            if isinstance(cfg.optimizer, ps.RowWiseAdagrad):
                state = model.full_state(cfg.name)[:, 0]
                check_close(
                    f"{tag} step {step} table {cfg.name} accumulators",
                    state,
                    ref.state[cfg.name]["acc"],
                    ref64.state[cfg.name]["acc"],
                    state_terms(cfg, occ[cfg.name]),
                )
            if isinstance(cfg.optimizer, ps.Adam):
                state = model.full_state(cfg.name)
                d = cfg.dim
                check_close(
                    f"{tag} step {step} {cfg.name} adam m",
                    state[:, :d],
                    ref.state[cfg.name]["m"],
                    ref64.state[cfg.name]["m"],
                    occ[cfg.name] + UPDATE_ROUNDINGS,
                )
                assert_same(
                    state[:, 2 * d],
                    ref.state[cfg.name]["t"].float(),
                    what=f"{tag} step {step} {cfg.name} adam t",
                    why="step counts: small integers, exact in float32",
                )
    for cfg in cfgs:
        assert int(ref.clocks[cfg.name].sum()) > 0, f"table {cfg.name} never trained"
    print(f"{tag}: ok sharded training ({group.backend})", flush=True)


def expect_value_error(what: str, fn: object, *needles: str) -> str:
    try:
        fn()  # type: ignore[operator]
    except ValueError as e:
        text = str(e)
        missing = [n for n in needles if n not in text]
        if missing:
            raise AssertionError(f"{what}: error {text!r} lacks {missing}") from e
        return text
    raise AssertionError(f"{what}: no ValueError raised")


def bad(group: comm.ProcessGroup) -> None:
    rank, size = group.rank, group.size
    cfgs = tables(weighted=False)
    model = ShardedTables(cfgs, group, row_wise_threshold_rows=ROW_WISE_THRESHOLD)
    gen = torch.Generator().manual_seed(5)
    good = global_batch(cfgs, gen, 0, False)
    lists = {f: good[f].to_lists() for f in good.keys}
    # 1) an id out of range on the last rank only: every rank names feature, table, id, rows.
    wrong = {f: [list(s) for s in v] for f, v in lists.items()}
    if rank == size - 1:
        wrong["bought"][0] = [3, 40]
    batch = KeyedJaggedIds.from_lists(wrong)
    expect_value_error(
        "out of range", lambda: model(batch), "'bought'", "'items'", "id 40", "40 rows",
        f"rank {size - 1}",
    )  # fmt: skip
    # 2) a feature no table has, on rank 0: rank 0 says which; the others say rank 0 failed.
    odd = dict(lists)
    if rank == 0:
        odd = {**lists, "nope": lists["user"]}
    batch = KeyedJaggedIds.from_lists(odd)
    needle = "'nope'" if rank == 0 else "rank 0 rejected its batch"
    expect_value_error("unknown feature", lambda: model(batch), needle)
    # 3) ranks that disagree on the plan (different thresholds) fail at construction.
    if size > 1:
        thr = ROW_WISE_THRESHOLD if rank == 0 else 1000
        expect_value_error(
            "plan mismatch",
            lambda: ShardedTables(cfgs, group, row_wise_threshold_rows=thr),
            "different sharding plan",
        )
    # 4) the module still works for everyone.
    out = model(good)
    sum(o.sum() for o in out.values()).backward()
    if not all(torch.isfinite(o).all() for o in out.values()):
        raise AssertionError("non-finite output after the errors")
    plan = ShardingPlan.build(cfgs, size, row_wise_threshold_rows=ROW_WISE_THRESHOLD)
    assert plan == model.plan
    print(f"rank {rank}/{size}: ok sharded bad input ({group.backend})", flush=True)


def collection(group: comm.ProcessGroup) -> None:
    """Through EmbeddingCollection: sharded and local tables side by side equal one
    process with every table local, trained on the global batch (within a few times that
    one process's fp32 rounding error, measured against the float64 :class:`Reference`
    on the same batches)."""
    from embedding.collection import EmbeddingCollection

    rank, size = group.rank, group.size
    local = GLOBAL_BATCH // size
    base = tables(weighted=False)
    mixed = [
        dataclasses.replace(c, placement="local") if c.name in ("users", "cats") else c
        for c in base
    ]
    flat = [dataclasses.replace(c, placement="local") for c in base]
    ec = EmbeddingCollection(mixed, group=group)
    ref = EmbeddingCollection(flat)
    ref64 = Reference(base, dtype=torch.float64)
    occ: dict[str, int] = {}
    assert isinstance(ec.sharded, ShardedTables)
    gen = torch.Generator().manual_seed(7)
    proj = {
        f: torch.randn(GLOBAL_BATCH, c.dim, generator=gen) for c in base for f in c.feature_names
    }
    for step in range(2):
        kjt = global_batch(base, gen, step, False)
        mine = kjt.sample_slice(rank * local, (rank + 1) * local)
        my_proj = {f: p[rank * local : (rank + 1) * local] for f, p in proj.items()}
        mean_loss(ec(mine), my_proj).backward()
        mean_loss(ref(kjt), proj).backward()
        mean_loss(ref64.forward(kjt), proj).backward()
        ref64.step(kjt)
        occ = {name: max(n, occ.get(name, 0)) for name, n in max_occurrences(base, kjt).items()}
        for c in mixed:
            assert c.num_rows is not None
            want = ref.rows(c.name, torch.arange(c.num_rows))
            if c.placement == "sharded":
                got = ec.sharded.full_table(c.name)
            else:
                got = ec.rows(c.name, torch.arange(c.num_rows))
            check_close(
                f"rank {rank}/{size} collection step {step} table {c.name}",
                got,
                want,
                ref64.bags[c.name].weight,
                occ[c.name] + UPDATE_ROUNDINGS,
            )
    print(f"rank {rank}/{size}: ok sharded collection ({group.backend})", flush=True)


def run(group: comm.ProcessGroup, args: list[str]) -> None:
    """Run mode ``args[0]`` (default "train") on ``group`` (also called by battery.py)."""
    mode = args[0] if args else "train"
    if mode not in ("train", "bad", "collection", "all"):
        raise ValueError(f"unknown mode {mode!r}")
    if GLOBAL_BATCH % group.size != 0:
        raise ValueError(f"global batch {GLOBAL_BATCH} does not split over {group.size}")
    if mode in ("train", "all"):
        train(group, weighted=False)
        train(group, weighted=True)
    if mode in ("bad", "all"):
        bad(group)
    if mode in ("collection", "all"):
        collection(group)


if __name__ == "__main__":  # tests may import this file for its helpers
    from tests.support.ranks.rank_main import run_main

    run_main(run)
