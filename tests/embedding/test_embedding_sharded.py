"""Model-parallel sharded tables (embedding.sharded.ShardedTables).

* Real processes (tests/embedding/ranks/embedding_sharded.py, launched with the other embedding
  and dense rank checks by tests/support/rank_battery.py) at 1, 2 and 4 ranks, under mpirun
  and gloo: training on local batches equals one process trained on the global batch
  (plain EmbeddingBag + optimizers in plain torch, within a few times the reference's
  fp32 rounding error, measured in float64); bad input raises ValueError
  on every rank without a hang; the same through EmbeddingCollection with sharded and
  local tables side by side.
* In one process (a LocalGroup): random jagged batches against
  ``torch.nn.EmbeddingBag`` + ``torch.optim.SGD``, and the argument checks.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

import comm
import ps
from embedding.config import TableConfig
from embedding.jagged import KeyedJaggedIds
from embedding.sharded import ShardedTables
from embedding.sharding_plan import ShardingPlan
from rank_battery import BATTERY_TIMEOUT_S, EMBEDDING_CASES, RankBattery
from tolerance import assert_close, assert_same, sum_tol

pytestmark = pytest.mark.numerics  # rerun under each ATEN_CPU_CAPABILITY


@pytest.mark.timeout(BATTERY_TIMEOUT_S)
@pytest.mark.parametrize(("backend", "nprocs"), EMBEDDING_CASES)
def test_sharded_matches_single_process(
    backend: str, nprocs: int, rank_battery: RankBattery
) -> None:
    lines = []
    for rank in range(nprocs):
        for what in ("plain: ok sharded training", "weighted: ok sharded training"):
            lines.append(f"rank {rank}/{nprocs} {what}")
        lines.append(f"rank {rank}/{nprocs}: ok sharded bad input")
        lines.append(f"rank {rank}/{nprocs}: ok sharded collection")
    rank_battery.expect(backend, nprocs, lines)


# ------------------------------------------------------------------ one process


def _tables(pooling: str) -> list[TableConfig]:
    return [
        TableConfig(
            name="a", num_rows=12, dim=3, feature_names=["f", "g"], pooling=pooling,  # type: ignore[arg-type]
            placement="sharded", optimizer=ps.SGD(lr=0.3),
        ),
        TableConfig(
            name="b", num_rows=5, dim=2, feature_names=["h"], pooling=pooling,  # type: ignore[arg-type]
            placement="sharded", optimizer=ps.SGD(lr=0.7),
        ),
    ]  # fmt: skip


bags = st.lists(st.lists(st.integers(0, 4), max_size=4), min_size=1, max_size=5)


@settings(max_examples=25, deadline=None)
@given(
    f=bags,
    g=bags,
    h=bags,
    pooling=st.sampled_from(["sum", "mean"]),
    weighted=st.booleans(),
)
def test_random_batches_match_embedding_bag(
    f: list[list[int]], g: list[list[int]], h: list[list[int]], pooling: str, weighted: bool
) -> None:
    b = min(len(f), len(g), len(h))
    lists = {"f": f[:b], "g": g[:b], "h": h[:b]}
    if weighted:
        pooling = "sum"
    cfgs = _tables(pooling)
    weights = None
    if weighted:
        weights = {
            k: [[0.5 + 0.25 * i for i in range(len(s))] for s in v] for k, v in lists.items()
        }
    kjt = KeyedJaggedIds.from_lists(lists, weights)
    model = ShardedTables(cfgs, comm.LocalGroup())
    refs = {}
    for c in cfgs:
        bag = torch.nn.EmbeddingBag(c.num_rows or 0, c.dim, mode=pooling)  # type: ignore[arg-type]
        with torch.no_grad():
            bag.weight.copy_(c.to_spec().initial_rows(torch.arange(c.num_rows or 0)))
        refs[c.name] = bag
    opts = {c.name: torch.optim.SGD(refs[c.name].parameters(), lr=c.optimizer.lr) for c in cfgs}  # type: ignore[attr-defined]
    got = model(kjt)
    want = {}
    for c in cfgs:
        for feat in c.feature_names:
            s = kjt[feat]
            want[feat] = refs[c.name](s.ids, s.offsets()[:-1], per_sample_weights=s.weights)
    assert list(got) == kjt.keys
    proj = {k: torch.linspace(-1, 1, v.numel()).view_as(v) for k, v in want.items()}
    sum((got[k] * proj[k]).sum() for k in got).backward()
    sum((want[k] * proj[k]).sum() for k in want).backward()
    mags = _magnitudes(cfgs, kjt, refs, proj, pooling)
    for c in cfgs:
        w0 = refs[c.name].weight.detach().clone()
        opts[c.name].step()
        for feat in c.feature_names:
            # n <= 4 products w_i * row_i summed, 1/len and its product: 6 roundings.
            tol = sum_tol(torch.float32, 6, mags[feat])
            assert_close(
                got[feat].detach(),
                want[feat].detach(),
                atol=tol,
                what=f"output {feat}",
                why="one pooling in two orders",
            )
        # Row r: w0 - lr * sum_i c_i, one term c_i per use of r (weight or 1/len times the
        # output's gradient; the shards sum them in another order), then lr * g and the
        # difference: uses - 1 additions + 6 roundings (1/len, two products, lr * g, the
        # difference, one spare) over |w0| + lr * sum_i |c_i|.
        ids = torch.cat([kjt[f].ids for f in c.feature_names])
        uses = int(torch.unique(ids, return_counts=True)[1].max()) if ids.numel() else 0
        tol = sum_tol(torch.float32, uses + 5, float(w0.abs().max()) + mags[c.name])
        assert_close(
            model.full_table(c.name),
            refs[c.name].weight.detach(),
            atol=tol,
            what=f"table {c.name}",
            why="one SGD step, gradients summed in two orders",
        )


def _magnitudes(
    cfgs: list[TableConfig],
    kjt: KeyedJaggedIds,
    refs: dict[str, torch.nn.EmbeddingBag],
    proj: dict[str, torch.Tensor],
    pooling: str,
) -> dict[str, float]:
    """In float64 with every value replaced by its absolute value: per feature the
    largest ``sum_i |w_i| |row_i|`` of a bag, per table the largest ``lr * sum_i |c_i|``
    of a row (the terms of its SGD step)."""
    out = {}
    for c in cfgs:
        w = refs[c.name].weight.detach().double().abs()
        grad = torch.zeros_like(w, requires_grad=True)
        for feat in c.feature_names:
            s = kjt[feat]
            psw = None if s.weights is None else s.weights.double().abs()
            starts = s.offsets()[:-1]
            pooled = F.embedding_bag(s.ids, w, starts, mode=pooling, per_sample_weights=psw)
            out[feat] = float(pooled.max()) if pooled.numel() else 0.0
            used = F.embedding_bag(s.ids, grad, starts, mode=pooling, per_sample_weights=psw)
            (used * proj[feat].double().abs()).sum().backward()
        assert grad.grad is not None
        out[c.name] = c.optimizer.lr * float(grad.grad.max())  # type: ignore[attr-defined]
    return out


def test_sequence_output_and_eval_mode() -> None:
    cfg = TableConfig(
        name="tok",
        num_rows=9,
        dim=4,
        feature_names=["seq"],
        pooling="none",
        placement="sharded",
        optimizer=ps.SGD(lr=1.0),
    )
    model = ShardedTables([cfg], comm.LocalGroup())
    kjt = KeyedJaggedIds.from_lists({"seq": [[1, 2, 1], [8, 0, 0]]})
    w0 = model.full_table("tok").clone()
    model.eval()
    out = model(kjt)["seq"]  # [B, T, D]
    assert out.shape == (2, 3, 4) and not out.requires_grad
    assert_same(
        out,
        F.embedding(kjt.ids, w0).view(2, 3, 4),
        what="sequence output",
        why="a lookup without pooling copies the rows",
    )
    model.train()
    model(kjt)["seq"].sum().backward()  # every id's row gets a gradient of ones per use
    counts = torch.bincount(kjt.ids, minlength=9).float().unsqueeze(1)
    assert_same(
        model.full_table("tok"),
        w0 - counts,
        what="rows after one SGD step",
        why="the gradients are use counts, exact integers, and lr = 1 makes the step "
        "w0 - count: one rounding, fused multiply-add or not",
    )
    assert model.full_clocks("tok").tolist() == [1, 1, 1, 0, 0, 0, 0, 0, 1]


def test_bad_input_names_feature_table_and_numbers() -> None:
    model = ShardedTables(_tables("mean"), comm.LocalGroup())
    with pytest.raises(ValueError, match=r"feature 'g' has id 12, .* table 'a' with 12 rows"):
        model(KeyedJaggedIds.from_lists({"f": [[1]], "g": [[12]]}))
    with pytest.raises(ValueError, match=r"feature 'h' has id -1"):
        model(KeyedJaggedIds.from_lists({"h": [[-1]]}))
    with pytest.raises(ValueError, match=r"feature 'zz' is not in any sharded table"):
        model(KeyedJaggedIds.from_lists({"zz": [[1]]}))
    with pytest.raises(ValueError, match=r"per-id weights.*'mean'"):
        model(KeyedJaggedIds.from_lists({"f": [[1]]}, {"f": [[2.0]]}))
    with pytest.raises(TypeError, match="expected a KeyedJaggedIds"):
        model({"f": torch.tensor([1])})  # type: ignore[arg-type]
    seq = TableConfig(
        name="s", num_rows=4, dim=2, feature_names=["q"], pooling="none", placement="sharded"
    )
    with pytest.raises(ValueError, match=r"'q' .* pooling='none'.*lengths \[1, 2\]"):
        ShardedTables([seq], comm.LocalGroup())(KeyedJaggedIds.from_lists({"q": [[1], [1, 2]]}))
    # The module still works after rejected batches.
    out = model(KeyedJaggedIds.from_lists({"f": [[1, 1]], "g": [[]], "h": [[4]]}))
    assert out["g"].abs().sum() == 0  # empty bag -> zeros


def test_construction_errors() -> None:
    group = comm.LocalGroup()
    cfgs = _tables("sum")
    with pytest.raises(ValueError, match="needs at least one TableConfig"):
        ShardedTables([], group)
    with pytest.raises(ValueError, match="table name 'a' appears twice"):
        ShardedTables([cfgs[0], cfgs[0]], group)
    with pytest.raises(TypeError, match="comm.ProcessGroup"):
        ShardedTables(cfgs, None)  # type: ignore[arg-type]
    two = ShardingPlan.build(cfgs, 2)
    with pytest.raises(ValueError, match="plan is for 2 ranks, the group has 1"):
        ShardedTables(cfgs, group, plan=two)
    with pytest.raises(ValueError, match=r"plan covers tables \['a'\]"):
        ShardedTables(cfgs, group, plan=ShardingPlan.build(cfgs[:1], 1))
