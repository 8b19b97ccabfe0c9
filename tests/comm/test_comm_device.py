"""Device tensors through every process group, and the dense trainers on the device.

Multi-rank (real mpirun / torch.distributed processes):

* ``tests/comm/ranks/comm_device.py``: every collective on device tensors equals the same
  collective on CPU tensors, bit for bit, with results on the input's device; the
  staging pool reuses its blocks; CPU tensors never reach it.
* ``tests/dense/ranks/dense_device.py``: DataParallel (plain, fp16, TernGrad), ZeroOptimizer
  stages 1 and 2 and Zero3 with the model on the device equal one process on the
  global batch (1e-5).

On CPU both run at 2 ranks over mpi and gloo inside the shared rank battery, with
``force_staging`` (tests/support/staged_groups.py) sending CPU tensors through the
staging path of CUDA tensors.
Marked ``gpu``: the same scripts with CUDA tensors, 2 ranks sharing one GPU over mpi
and over gloo (staged through pinned memory), and 1 rank over nccl.

In process: the pinned pool's logic (size classes, reuse, dtype views, waiting for a
pending copy), a staged operation end to end, ``Handle``'s stream-ordered wait, the
local group and every compression codec on each device (equal to the CPU results).
"""

from __future__ import annotations

import json

import pytest
import torch

import comm
from comm.compression import compressed_allreduce, get_codec
from comm.handle import Handle
from comm.staging import MIN_BLOCK_BYTES, PinnedPool, StagedOp, size_class
from multiproc import run_ranks
from rank_battery import BATTERY_TIMEOUT_S, DEVICE_CASES, RankBattery
from tolerance import assert_close, sum_tol

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


# --------------------------------------------------------------------- multi-rank, CPU


@pytest.mark.timeout(BATTERY_TIMEOUT_S)
@pytest.mark.parametrize(("backend", "nprocs"), DEVICE_CASES)
def test_staged_collectives_equal_direct(
    backend: str, nprocs: int, rank_battery: RankBattery
) -> None:
    lines = [f"rank {r}/{nprocs} {backend} comm_device cpu: ok" for r in range(nprocs)]
    rank_battery.expect(backend, nprocs, lines)


@pytest.mark.timeout(BATTERY_TIMEOUT_S)
@pytest.mark.parametrize(("backend", "nprocs"), DEVICE_CASES)
def test_staged_dense_trainers_equal_global_batch(
    backend: str, nprocs: int, rank_battery: RankBattery
) -> None:
    lines = [f"rank {r}/{nprocs} {backend} dense_device cpu: ok" for r in range(nprocs)]
    rank_battery.expect(backend, nprocs, lines)


# --------------------------------------------------------------------- multi-rank, GPU

_GPU_RUNS: dict[tuple[str, int], str] = {}


def _gpu_launch(backend: str, nprocs: int) -> str:
    """One launch per (backend, ranks) runs both scripts on CUDA tensors."""
    key = (backend, nprocs)
    if key not in _GPU_RUNS:
        checks = [json.dumps([script, "cuda"]) for script in ("comm_device", "dense_device")]
        _GPU_RUNS[key] = "\n".join(run_ranks("battery.py", nprocs, backend, checks, timeout=240))
    return _GPU_RUNS[key]


GPU_CASES = [("mpi", 2), ("gloo", 2), ("nccl", 1)]  # nccl needs a GPU per rank


@pytest.mark.gpu
@pytest.mark.timeout(300)
@pytest.mark.parametrize(("backend", "nprocs"), GPU_CASES)
def test_cuda_collectives_equal_cpu(backend: str, nprocs: int) -> None:
    text = _gpu_launch(backend, nprocs)
    for r in range(nprocs):
        assert f"rank {r}/{nprocs} {backend} comm_device cuda: ok" in text, text


@pytest.mark.gpu
@pytest.mark.timeout(300)
@pytest.mark.parametrize(("backend", "nprocs"), GPU_CASES)
def test_cuda_dense_trainers_equal_global_batch(backend: str, nprocs: int) -> None:
    text = _gpu_launch(backend, nprocs)
    for r in range(nprocs):
        assert f"rank {r}/{nprocs} {backend} dense_device cuda: ok" in text, text


# ------------------------------------------------------------------------ the pool


class Copy:
    """A pending copy: done once ``finish()`` ran; records whether the pool waited."""

    def __init__(self) -> None:
        self.done = False
        self.waited = False

    def query(self) -> bool:
        return self.done

    def synchronize(self) -> None:
        self.waited = True
        self.done = True


def test_size_classes() -> None:
    assert size_class(0) == size_class(1) == size_class(MIN_BLOCK_BYTES) == MIN_BLOCK_BYTES
    assert size_class(MIN_BLOCK_BYTES + 1) == 2 * MIN_BLOCK_BYTES
    assert size_class(3 << 20) == 4 << 20
    assert size_class(1 << 20) == 1 << 20


def test_pool_reuses_blocks_and_grows_by_class() -> None:
    pool = PinnedPool(pin=False)
    a = pool.take(1000)
    assert a.capacity == MIN_BLOCK_BYTES and pool.stats["allocated"] == 1
    pool.give_back(a, None)
    b = pool.take(3000)  # the same class: the same block again
    assert b is a and pool.stats == {
        "allocated": 1,
        "reused": 1,
        "waited": 0,
        "bytes": MIN_BLOCK_BYTES,
    }
    c = pool.take(3000)  # a is in use: a second block
    assert c is not b and pool.stats["allocated"] == 2
    big = pool.take(100_000)  # a larger class
    assert big.capacity == 131072 and pool.stats["bytes"] == 2 * MIN_BLOCK_BYTES + 131072
    for blk in (b, c, big):
        pool.give_back(blk, None)
    assert pool.free_blocks() == 3
    assert pool.take(120_000) is big  # larger sizes of a class reuse its block
    assert pool.stats["allocated"] == 3


def test_pool_prefers_finished_blocks_and_waits_for_a_pending_copy() -> None:
    pool = PinnedPool(pin=False)
    first, second = pool.take(10), pool.take(10)
    busy, idle = Copy(), Copy()
    idle.done = True
    pool.give_back(first, busy)  # its H2D copy still reads it
    pool.give_back(second, idle)
    assert pool.take(10) is second and not busy.waited  # the finished one, no wait
    assert pool.take(10) is first and busy.waited  # only the busy one left: wait for it
    assert pool.stats["waited"] == 1
    assert first.pending is None


def test_block_views_in_any_dtype_and_shape() -> None:
    pool = PinnedPool(pin=False)
    block = pool.take(64)
    f = block.view((2, 3), torch.float32)
    f.copy_(torch.arange(6, dtype=torch.float32).view(2, 3))
    assert f.is_contiguous() and f.data_ptr() == block.data.data_ptr()
    as_int = block.view((6,), torch.int32)  # the same bytes, another dtype
    assert torch.equal(as_int, torch.arange(6, dtype=torch.float32).view(torch.int32))
    for dtype in (torch.bfloat16, torch.float16, torch.bool, torch.complex128, torch.int64):
        assert block.view((), dtype).shape == () and block.view((0, 4), dtype).numel() == 0
    with pytest.raises(AssertionError):
        block.view((MIN_BLOCK_BYTES,), torch.float32)  # 4x the block


def test_pool_pins_only_with_cuda() -> None:
    assert PinnedPool().pin == torch.cuda.is_available()
    block = PinnedPool().take(10)
    assert block.data.is_pinned() == torch.cuda.is_available()


@pytest.mark.parametrize("device", DEVICES)
def test_staged_operation_round_trip(device: str) -> None:
    """copy_in -> a host operation -> copy back in place or as a new tensor; blocks return."""
    pool = PinnedPool()
    x = torch.arange(10, dtype=torch.float32, device=device)
    op = StagedOp(pool, x.device, timeout_s=5.0)
    host = op.copy_in(x)
    op.inputs_ready()
    assert host.device.type == "cpu" and torch.equal(host, x.cpu())
    assert host.is_pinned() == torch.cuda.is_available()
    host.mul_(2)  # the "collective"
    out = op.handle(Handle.completed(host), into=x).wait()
    assert out is x and torch.equal(x.cpu(), 2 * torch.arange(10.0))
    assert pool.free_blocks() == pool.stats["allocated"] == 1
    op2 = StagedOp(pool, x.device, timeout_s=5.0)
    h = op2.handle(Handle.completed(op2.empty((2, 2), torch.int64).fill_(7)))
    got = h.wait()
    assert got.device == x.device and torch.equal(got.cpu(), torch.full((2, 2), 7))
    assert pool.stats["allocated"] == 1 and pool.free_blocks() == 1  # reused the block


def test_stream_ordered_wait_without_timeout_only() -> None:
    """``ordered`` serves a wait without timeout; an explicit timeout waits on the host."""
    calls: list[str] = []

    def make() -> Handle:
        return Handle(
            lambda: True,
            lambda: "result",
            what="op",
            timeout_s=1.0,
            block=lambda limit: calls.append(f"block {limit:g}"),
            ordered=lambda: calls.append("ordered"),
        )

    h = make()
    assert h.stream_ordered and h.wait() == "result" and calls == ["ordered"]
    calls.clear()
    assert make().wait(timeout=2.0) == "result" and calls == ["block 2"]
    assert not Handle.completed(1).stream_ordered


# ------------------------------------------------------------- local group and codecs


@pytest.mark.parametrize("device", DEVICES)
def test_local_group_keeps_the_device(device: str) -> None:
    g = comm.LocalGroup()
    t = torch.arange(6.0, device=device).view(3, 2)
    assert g.allreduce(t, "avg") is t and g.broadcast(t) is t
    results = [
        g.allgather(t),
        g.allgatherv(t),
        g.reduce_scatter(t),
        g.alltoallv(t, [3]),
        g.allreduce_async(t).wait(),
    ]
    for r in results:
        assert r.device == t.device
    assert torch.equal(results[0][0], t) and torch.equal(results[3], t)


DETERMINISTIC_CODECS = ["none", "fp16", "bf16", "topk"]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", DETERMINISTIC_CODECS)
def test_deterministic_codecs_on_device_equal_cpu(device: str, name: str) -> None:
    x = torch.randn(1001, generator=torch.Generator().manual_seed(4))
    opts = {"ratio": 0.05} if name == "topk" else {}
    on_cpu, on_dev = get_codec(name, **opts), get_codec(name, **opts)
    for step in range(2):  # the second step uses top-k's residual
        xs = x * (step + 1)
        want = compressed_allreduce(comm.LocalGroup(), xs.clone(), on_cpu, key="b")
        got = compressed_allreduce(comm.LocalGroup(), xs.to(device), on_dev, key="b")
        assert got.device.type == device
        assert torch.equal(got.cpu(), want), name


@pytest.mark.parametrize("device", DEVICES)
def test_terngrad_on_device(device: str) -> None:
    x = torch.randn(1000, generator=torch.Generator().manual_seed(1), device="cpu")
    x[17] = 40.0  # clipped to 2.5 sigma
    enc = get_codec("terngrad", seed=2).encode(x.to(device), key="w")
    want = get_codec("terngrad", seed=2).encode(x, key="w")
    assert enc.scale is not None and want.scale is not None
    assert enc.payload.device.type == enc.scale.device.type == device
    # max |clipped| = c sigma, both in fp32: sigma within gamma_{n+4} of itself on each side
    # (n squared deviations summed, a division, a square root, the product by c).
    assert_close(enc.scale.cpu(), want.scale,
                 atol=sum_tol(torch.float32, x.numel() + 4, float(want.scale.abs().max())),
                 what="TernGrad scale on the device", why="two fp32 std of n values")  # fmt: skip
    d = get_codec("terngrad").decode(enc, 1000).cpu()
    s = float(enc.scale)
    assert set(d.unique().tolist()) <= {-s, 0.0, s}
    assert torch.all((d == 0) | (torch.sign(d) == torch.sign(x)))
    zeros = get_codec("terngrad").encode(torch.zeros(9, device=device), key="z")
    assert zeros.scale is not None and float(zeros.scale) == 0.0
    assert torch.equal(get_codec("terngrad").decode(zeros, 9).cpu(), torch.zeros(9))


@pytest.mark.parametrize("device", DEVICES)
def test_natural_compression_on_device(device: str) -> None:
    x = torch.exp2(torch.linspace(-30, 5, 500)) * torch.where(torch.arange(500) % 2 == 0, 1, -1)
    x[:3] = torch.tensor([0.0, 1.0, -0.75])
    codec = get_codec("natural", seed=1)
    enc = codec.encode(x.to(device), key="g")
    assert enc.scale is not None and enc.scale.device.type == device
    assert float(enc.scale) == 6.0  # 2^6 > max|x| = 2^5
    d = codec.decode(enc, 500).cpu().double()
    xs = x.double()
    nz = xs != 0
    assert torch.all(d[~nz] == 0) and torch.all(torch.sign(d[nz]) == torch.sign(xs[nz]))
    lo = torch.exp2(torch.floor(torch.log2(xs[nz].abs())))
    assert torch.all((d[nz].abs() == lo) | (d[nz].abs() == 2 * lo))
    empty = codec.encode(torch.zeros(4, device=device), key="z")
    assert empty.scale is not None and float(empty.scale) == 0.0
    assert torch.equal(codec.decode(empty, 4).cpu(), torch.zeros(4))
