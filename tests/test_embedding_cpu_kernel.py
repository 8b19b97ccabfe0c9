"""The C kernel of the CPU fused backward (ps/cpu_kernel.py) against the ps math.

Reference: per-id gradients summed per unique row by ``index_add_`` in float64,
then ``ps.RowWiseAdagrad.apply`` (the parameter server's own update) on copies of
the touched rows; untouched rows must not change at all. Also the whole local
collection with the kernel vs with it disabled (the torch path), in subprocesses.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ps import RowWiseAdagrad, cpu_kernel

pytestmark = [
    pytest.mark.timeout(120),
    pytest.mark.skipif(not cpu_kernel.available(), reason="no C compiler: torch path only"),
]

ROOT = Path(__file__).resolve().parents[1]


def _reference(
    weight: torch.Tensor,
    state: torch.Tensor,
    ids: torch.Tensor,
    bag_of: torch.Tensor,
    grad: torch.Tensor,
    weights: torch.Tensor | None,
    opt: RowWiseAdagrad,
) -> tuple[torch.Tensor, torch.Tensor]:
    per_id = grad.double()[bag_of]  # [N, D]
    if weights is not None:
        per_id = per_id * weights.double().unsqueeze(1)
    rows = torch.unique(ids)  # [U]
    pos = torch.searchsorted(rows, ids)  # [N]
    g = torch.zeros(rows.numel(), grad.shape[1], dtype=torch.float64).index_add_(0, pos, per_id)
    w, s = weight.clone(), state.clone()
    wr, sr = w[rows], s[rows]
    opt.apply(wr, sr, g.float())
    w[rows], s[rows] = wr, sr
    return w, s


@pytest.mark.parametrize("n, weighted, threads", [(0, False, 1), (7, False, 1), (300, True, 1),
                                                  (9000, False, 2), (9000, True, 2)])  # fmt: skip
def test_kernel_equals_ps_rowwise_adagrad(n: int, weighted: bool, threads: int) -> None:
    gen = torch.Generator().manual_seed(n)
    rows, d, nbags = 5000, 24, max(1, n // 3)
    opt = RowWiseAdagrad(lr=0.05, eps=1e-6, initial_accumulator=0.1)
    weight = torch.randn(rows, d, generator=gen)
    state = torch.rand(rows, 1, generator=gen)
    clocks = torch.zeros(rows, dtype=torch.int64)
    hot = torch.randint(0, 40, (n,), generator=gen)  # many repeats, some rows in long runs
    ids = torch.where(torch.rand(n, generator=gen) < 0.5, hot, torch.randint(0, rows, (n,)))
    bag_of = torch.randint(0, nbags, (n,), generator=gen)
    grad = torch.randn(nbags, d, generator=gen)
    weights = torch.rand(n, generator=gen) + 0.5 if weighted else None
    want_w, want_s = _reference(weight, state, ids, bag_of, grad, weights, opt)
    srt, perm = torch.sort(ids)
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        ok = cpu_kernel.rowwise_adagrad_(
            weight, state, clocks, srt, grad, lr=opt.lr, eps=opt.eps, perm=perm,
            bag_of=bag_of, weights=weights,
        )  # fmt: skip
    finally:
        torch.set_num_threads(old)
    assert ok
    torch.testing.assert_close(weight, want_w, rtol=0, atol=1e-6)
    torch.testing.assert_close(state, want_s, rtol=1e-6, atol=1e-6)
    want_clocks = torch.zeros(rows, dtype=torch.int64)
    want_clocks[torch.unique(ids)] = 1
    assert torch.equal(clocks, want_clocks)


def test_kernel_rejects_what_it_cannot_handle() -> None:
    w = torch.zeros(4, 3)
    s = torch.zeros(4, 1)
    c = torch.zeros(4, dtype=torch.int64)
    ids = torch.tensor([0, 2])
    g = torch.ones(2, 3)
    assert not cpu_kernel.rowwise_adagrad_(w.t().contiguous().t(), s, c, ids, g, lr=1, eps=1)
    assert not cpu_kernel.rowwise_adagrad_(w.double(), s, c, ids, g, lr=1, eps=1)
    assert not cpu_kernel.rowwise_adagrad_(w, s, c, ids.int(), g, lr=1, eps=1)
    assert not cpu_kernel.rowwise_adagrad_(w, torch.zeros(4, 0), c, ids, g, lr=1, eps=1)
    assert torch.equal(w, torch.zeros(4, 3))


_TRAIN = """
import json
import torch
from embedding import EmbeddingCollection, KeyedJaggedIds, RowWiseAdagrad, TableConfig
torch.manual_seed(0)
ec = EmbeddingCollection([
    TableConfig(name="a", num_rows=3000, dim=16, feature_names=["x", "y"], pooling="mean",
                optimizer=RowWiseAdagrad(lr=0.1)),
    TableConfig(name="b", num_rows=500, dim=16, feature_names=["z"], pooling="sum",
                optimizer=RowWiseAdagrad(lr=0.2)),
])
for step in range(4):
    lists = {f: [torch.randint(0, 60, (int(torch.randint(0, 4, ())),)).tolist()
                 for _ in range(2000)] for f in ["x", "y", "z"]}
    out = ec(KeyedJaggedIds.from_lists(lists))
    sum((o * torch.randn_like(o)).sum() for o in out.values()).backward()
ids = torch.arange(500)
print(json.dumps([ec.local.rows(t, ids).tolist() for t in "ab"]))
print(json.dumps([ec.local.state(t, ids).tolist() for t in "ab"]))
"""


def test_collection_same_with_and_without_kernel() -> None:
    outs = []
    for flag in ("1", "0"):
        env = {**os.environ, "HYBRIDREC_CPU_KERNEL": flag, "PYTHONPATH": str(ROOT)}
        done = subprocess.run(
            [sys.executable, "-c", _TRAIN], capture_output=True, text=True, env=env, timeout=100
        )
        assert done.returncode == 0, done.stderr
        outs.append([torch.tensor(json.loads(line)) for line in done.stdout.splitlines()])
    for a, b in zip(*outs, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
