"""dense.DataParallel and the plain helpers.

Multi-rank (tests/dense/ranks/dense_dp.py on real processes, mpirun and gloo, 1/2/4 ranks,
launched with the other embedding and dense rank checks by tests/support/rank_battery.py):
same gradients and weights as one process on the global batch (1e-5), replicas
identical, unused parameters give zeros without a hang, early buckets' allreduces are
issued before backward ends, bad input raises ValueError on every rank. Compression
through comm.compression codecs when that package is present. Single-process: bucket
assignment, the size-1 no-ops, errors.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch
from torch import nn

import comm
from dense import DataParallel, allreduce_gradients, assign_buckets, broadcast_parameters
from rank_battery import BATTERY_TIMEOUT_S, CODECS, DENSE_CASES, RankBattery
from tolerance import assert_same

pytestmark = pytest.mark.numerics  # rerun under each ATEN_CPU_CAPABILITY


@pytest.mark.timeout(BATTERY_TIMEOUT_S)
@pytest.mark.parametrize(("backend", "nprocs"), DENSE_CASES)
def test_data_parallel_matches_global_batch(
    backend: str, nprocs: int, rank_battery: RankBattery
) -> None:
    lines = [f"rank {rank}/{nprocs} {backend} main: ok" for rank in range(nprocs)]
    rank_battery.expect(backend, nprocs, lines)


HAS_COMPRESSION = importlib.util.find_spec("comm.compression") is not None


@pytest.mark.skipif(not HAS_COMPRESSION, reason="comm.compression not present")
@pytest.mark.timeout(BATTERY_TIMEOUT_S)
def test_data_parallel_with_every_codec(rank_battery: RankBattery) -> None:
    lines = [f"rank {rank}/2 mpi codec: ok" for rank in range(2)]
    lines += [f"rank {rank}: codec {name} ok" for rank in range(2) for name in CODECS]
    rank_battery.expect("mpi", 2, lines)


def test_buckets_reverse_order_cap_and_one_dtype_each() -> None:
    params = [
        torch.zeros(100),  # 400 B
        torch.zeros(10, dtype=torch.float64),  # 80 B
        torch.zeros(50),  # 200 B
        torch.zeros(300),  # 1200 B: over the cap, its own bucket
        torch.zeros(20),  # 80 B
    ]
    buckets = assign_buckets(params, 500)
    for b in buckets:
        assert len({params[i].dtype for i in b.params}) == 1
        assert b.nbytes <= 500 or len(b.params) == 1
        assert list(b.params) == sorted(b.params, reverse=True)
        assert b.offsets[0] == 0 and b.numel == sum(b.numels)
    covered = sorted(i for b in buckets for i in b.params)
    assert covered == list(range(len(params)))
    # The last registered parameter is in the first bucket (its gradient is ready first).
    assert 4 in buckets[0].params
    float32 = [b.params for b in buckets if b.dtype == torch.float32]
    assert float32 == [(4,), (3,), (2,), (0,)]  # 200 + 400 B > 500 B
    wider = [b.params for b in assign_buckets(params, 600) if b.dtype == torch.float32]
    assert wider == [(4,), (3,), (2, 0)]  # now they fit together
    # A small first bucket (as torch DDP) starts communicating early; the rest are big.
    small_first = assign_buckets(params, 10_000, first_bucket_bytes=100)
    assert [b.params for b in small_first] == [(4,), (3, 2, 0), (1,)]
    with pytest.raises(ValueError, match="bucket_bytes must be an int >= 1, got 0"):
        assign_buckets(params, 0)


def test_size_one_is_a_no_op() -> None:
    torch.manual_seed(0)
    module = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Linear(4, 1))
    module(torch.randn(5, 3)).sum().backward()
    params = [p.detach().clone() for p in module.parameters()]
    grads = [p.grad.clone() for p in module.parameters() if p.grad is not None]
    group = comm.LocalGroup()
    broadcast_parameters(module, group)
    allreduce_gradients(module, group)
    why = "one rank: nothing is sent, the tensors are left as they are"
    for p, want in zip(module.parameters(), params, strict=True):
        assert_same(p.detach(), want, what="parameter after broadcast", why=why)
    got = [p.grad for p in module.parameters() if p.grad is not None]
    for g, w in zip(got, grads, strict=True):
        assert_same(g, w, what="gradient after allreduce", why=why)


def test_local_wrapper_keeps_gradients_and_handles_no_sync_and_ignore() -> None:
    torch.manual_seed(0)
    ref = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2))
    model = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2))
    model.load_state_dict(ref.state_dict())
    dp = DataParallel(model, comm.LocalGroup(), bucket_mb=1e-4, ignore=["0.bias"])
    assert all(p is not model[0].bias for p in dp.synced_parameters)
    x = torch.randn(6, 3)
    with dp.no_sync():
        dp(x).sum().backward()
    assert dp.last_launches == []
    dp(x).sum().backward()
    dp.finish()
    ref(x).sum().backward()
    ref(x).sum().backward()
    for a, b in zip(model.parameters(), ref.parameters(), strict=True):
        assert a.grad is not None and b.grad is not None
        assert_same(a.grad, b.grad, what="gradient",
                    why="the same two backward passes accumulated in the same order; the "
                    "average over one rank is a division by 1")  # fmt: skip
    assert len(dp.last_launches) == len(dp.buckets)
    assert "module.0.weight" in dp.state_dict()


def test_finish_without_any_gradient_and_unused_parameters() -> None:
    model = nn.Linear(3, 1)
    dp = DataParallel(model, comm.LocalGroup())
    with torch.no_grad():
        dp(torch.randn(2, 3))
    dp.finish()  # no grad-enabled forward: nothing to do
    assert model.weight.grad is None
    out = dp(torch.randn(2, 3))
    out.detach().sum()  # this step's loss does not touch the parameters
    dp.finish()  # runs the round with zeros (peers would be waiting for it)
    assert model.weight.grad is not None and not model.weight.grad.any()


def test_bad_arguments() -> None:
    group = comm.LocalGroup()
    with pytest.raises(ValueError, match="bucket_mb must be > 0 MiB, got -1"):
        DataParallel(nn.Linear(2, 2), group, bucket_mb=-1)
    with pytest.raises(TypeError, match="bucket_mb must be a number"):
        DataParallel(nn.Linear(2, 2), group, bucket_mb="big")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="does not have"):
        DataParallel(nn.Linear(2, 2), group, ignore=["nope"])
    with pytest.raises(TypeError, match="must be an nn.Module"):
        DataParallel(lambda x: x, group)  # type: ignore[arg-type]
