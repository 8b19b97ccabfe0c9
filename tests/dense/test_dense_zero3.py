"""dense.Zero3 (ZeRO stage 3) on real processes (launched with the other dense rank checks
by tests/support/rank_battery.py; tests/dense/ranks/dense_zero3.py): equals one process on
the global batch, memory ~1/N, checkpoints across stages and rank counts, errors on every rank. Plus
single-process checks of when units are gathered, prefetched, reduced and freed, gradient
accumulation, activation recomputation and the argument errors."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

import comm
from comm.handle import Handle
from dense import GPT, GPTConfig, Zero3, gpt_loss
from rank_battery import BATTERY_TIMEOUT_S, DENSE_CASES, RankBattery
from tolerance import AdamDrift, assert_close, replay_tol

pytestmark = pytest.mark.numerics  # rerun under each ATEN_CPU_CAPABILITY

CHECKS = ("train", "twice", "checkpoint", "errors")


@pytest.mark.timeout(BATTERY_TIMEOUT_S)
@pytest.mark.parametrize(("backend", "nprocs"), DENSE_CASES)
def test_zero3_matches_one_process(backend: str, nprocs: int, rank_battery: RankBattery) -> None:
    lines = [
        f"rank {rank}/{nprocs} {backend} zero3 {check}: ok"
        for rank in range(nprocs)
        for check in CHECKS
    ]
    rank_battery.expect(backend, nprocs, lines)


class RecordingGroup(comm.LocalGroup):
    """A one-process group that logs which unit each gather and reduce-scatter is for."""

    def __init__(self) -> None:
        super().__init__()
        self.log: list[tuple[str, str]] = []
        self.names: dict[int, str] = {}  # shard data pointer -> unit name
        self.sizes: dict[int, str] = {}  # padded flat length -> unit name

    def allgather_async(self, tensor: torch.Tensor) -> Handle:
        self.log.append(("gather", self.names[tensor.data_ptr()]))
        return super().allgather_async(tensor)

    def reduce_scatter_async(self, tensor: torch.Tensor, op: Any = "sum") -> Handle:
        self.log.append(("reduce", self.sizes[tensor.numel()]))
        return super().reduce_scatter_async(tensor, op)


def _gpt(n_layer: int = 2) -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=16, block_size=4, n_layer=n_layer, n_head=2, d_model=8))


def test_units_gathered_prefetched_reduced_and_freed_in_order() -> None:
    group = RecordingGroup()
    z = Zero3(_gpt(), group, torch.optim.SGD, lr=0.1)
    assert [u.name for u in z.units] == ["pos_emb", "blocks.0", "blocks.1", "ln_f", "head"]
    group.names = {f.shard.data_ptr(): u.name for u in z.units for f in u.flats}
    # Flat lengths: pos_emb 32, each block 872, ln_f 16, head 128: a reduce-scatter says
    # which unit by its length ("blocks.*" for either block).
    group.sizes = {f.full.numel(): u.name.replace(".0", ".*").replace(".1", ".*")
                   for u in z.units for f in u.flats}  # fmt: skip
    live: list[tuple[str, bool]] = []
    for u in z.units:
        # Registered after Zero3's hooks: see the unit while it computes, then after.
        u.module.register_forward_pre_hook(lambda m, a, u=u: group.log.append(("compute", u.name)))
        u.module.register_forward_hook(lambda m, a, o, u=u: live.append((u.name, u.gathered)))
    loss = gpt_loss(z(torch.randn(2, 4, 8, requires_grad=True)), torch.zeros(2, 4).long())
    forward, group.log = group.log, []
    loss.backward()
    # Forward: each unit's gather is issued while the unit before it is about to compute.
    assert forward == [
        ("gather", "pos_emb"), ("gather", "blocks.0"), ("compute", "pos_emb"),
        ("gather", "blocks.1"), ("compute", "blocks.0"), ("gather", "ln_f"),
        ("compute", "blocks.1"), ("gather", "head"), ("compute", "ln_f"), ("compute", "head"),
    ]  # fmt: skip
    assert all(not gathered for _, gathered in live), live  # freed right after its forward
    # Backward: gathered again in reverse, the next one prefetched before this one's
    # gradients are reduce-scattered.
    assert group.log == [
        ("gather", "head"), ("gather", "ln_f"), ("reduce", "head"),
        ("gather", "blocks.1"), ("reduce", "ln_f"), ("gather", "blocks.0"),
        ("reduce", "blocks.*"), ("gather", "pos_emb"), ("reduce", "blocks.*"),
        ("reduce", "pos_emb"),
    ]  # fmt: skip
    assert all(u.flats[0].full.untyped_storage().nbytes() == 0 for u in z.units)
    assert all(p.numel() == 0 for p in z.model.parameters())
    assert all(f.shard.grad is not None for u in z.units for f in u.flats)


def _batch(step: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(step)
    x, y = torch.randn(4, 4, 8, generator=gen), torch.randint(0, 16, (4, 4), generator=gen)
    return x.to(dtype), y


def _train(model: nn.Module, opt: Any, steps: int, micro: int, recompute: bool) -> list[float]:
    losses = []
    for step in range(steps):
        x, y = _batch(step, torch.float32)
        total = 0.0
        for mb in range(micro):  # gradient accumulation: the losses of the micro-batches add up
            sl = slice(mb * 4 // micro, (mb + 1) * 4 // micro)
            if recompute:
                out = checkpoint(model, x[sl], use_reentrant=False)
            else:
                out = model(x[sl])
            loss = gpt_loss(out, y[sl]) / micro
            loss.backward()
            total += float(loss.detach())
        opt.step()
        opt.zero_grad()
        losses.append(total)
    return losses


@pytest.mark.parametrize(("micro", "recompute"), [(1, False), (2, False), (1, True)])
def test_accumulation_and_recomputation_match_plain_adamw(micro: int, recompute: bool) -> None:
    ref = _gpt(3)
    model = copy.deepcopy(ref)
    ref64 = copy.deepcopy(ref).double()  # the same computation in float64: the tolerances
    hyper = {"lr": 0.01, "eps": 1e-8}
    refs = [(r, torch.optim.AdamW(r.parameters(), **hyper)) for r in (ref, ref64)]
    drift = AdamDrift(hyper["lr"], hyper["eps"])
    want: list[list[float]] = [[], []]
    for step in range(3):  # the plain AdamW run, in float32 and float64
        for k, (r, _opt) in enumerate(refs):
            x, y = _batch(step, next(r.parameters()).dtype)
            loss = gpt_loss(r(x), y)
            loss.backward()
            want[k].append(float(loss.detach()))
        # Micro-batches sum each gradient in two halves (two more roundings of its size),
        # and AdamW carries a gradient's error to the weights (tests/support/tolerance.py).
        for (name, p), p64 in zip(ref.named_parameters(), ref64.parameters(), strict=True):
            assert p.grad is not None and p64.grad is not None
            drift.step(name, replay_tol(p.grad, p64.grad, floor_terms=2 * micro))
        for _, opt in refs:
            opt.step()
            opt.zero_grad()
    z = Zero3(model, comm.LocalGroup(), torch.optim.AdamW, **hyper)
    got = _train(model, z, 3, micro, recompute)
    why = "a few times the plain run's fp32 rounding error, measured in float64"
    for step, (a, b, b64) in enumerate(zip(got, *want, strict=True)):
        tol = replay_tol(torch.tensor(b), torch.tensor(b64), floor_terms=2 * micro + 4)
        assert_close(a, b, atol=tol, what=f"step {step} loss", why=why)
    full = z.full_state_dict()
    want64 = ref64.state_dict()
    assert set(full) == set(want64)
    for name, t in ref.state_dict().items():
        tol = replay_tol(t, want64[name]) + drift[name]
        assert_close(full[name], t, atol=tol, what=name, why=why + ", plus Adam's drift")
    with torch.no_grad():  # evaluation: gathered and freed, nothing hooked
        z(torch.randn(1, 4, 8))
    assert all(p.numel() == 0 for p in model.parameters())


def test_full_state_dict_round_trip_with_a_plain_model() -> None:
    plain = _gpt()
    z = Zero3(_gpt(), comm.LocalGroup(), torch.optim.SGD, lr=0.1)
    with torch.no_grad():
        for p in plain.parameters():
            p.add_(torch.randn_like(p))
    z.load_full_state_dict(plain.state_dict())
    got = z.full_state_dict()
    assert list(got) == list(plain.state_dict())
    for name, t in plain.state_dict().items():
        assert torch.equal(got[name], t), name
    x = torch.randn(2, 4, 8)
    torch.testing.assert_close(z(x), plain(x))
    with pytest.raises(ValueError, match=r"missing keys \['head.weight'\]"):
        z.load_full_state_dict({k: v for k, v in got.items() if k != "head.weight"})


def test_memory_is_reported() -> None:
    z = Zero3(_gpt(), comm.LocalGroup(), torch.optim.AdamW, lr=0.01)
    _train(z.model, z, 1, 1, False)
    n = sum(f.numel for u in z.units for f in u.flats)
    # Parameters, gradients and Adam's two moments, plus one 0-d float32 step per shard.
    assert z.memory_bytes() == 4 * 4 * n + 4 * len(z.units)
    assert z.unsharded_bytes() == 4 * 4 * n + 4 * len(list(z.model.parameters()))
    assert z.memory_bytes() < z.peak_memory_bytes()


class _Shared(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(2, 2)
        self.b = nn.Linear(2, 2)
        self.b.bias = self.a.bias


class _RootAlsoInUnit(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(2, 2)
        self.w = self.a.weight


def test_bad_arguments() -> None:
    group = comm.LocalGroup()
    with pytest.raises(ValueError, match="the model has no parameters"):
        Zero3(nn.ReLU(), group, torch.optim.SGD, lr=0.1)
    with pytest.raises(ValueError, match="a.bias is shared by units 'a' and 'b'"):
        Zero3(_Shared(), group, torch.optim.SGD, lr=0.1)
    with pytest.raises(ValueError, match="parameter w of the model itself is also in unit 'a'"):
        Zero3(_RootAlsoInUnit(), group, torch.optim.SGD, lr=0.1)
    frozen = nn.Linear(2, 2)
    frozen.bias.requires_grad_(False)
    with pytest.raises(ValueError, match="parameter bias is frozen"):
        Zero3(frozen, group, torch.optim.SGD, lr=0.1)
    ints = nn.Linear(2, 2)
    ints.register_parameter("count", nn.Parameter(torch.zeros(2, dtype=torch.int64), False))
    with pytest.raises(TypeError, match="parameter count has dtype torch.int64, not floating"):
        Zero3(ints, group, torch.optim.SGD, lr=0.1)
    with pytest.raises(TypeError, match="must be an nn.Module, got list"):
        Zero3([nn.Linear(2, 2)], group, torch.optim.SGD)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="torch.optim.Optimizer subclass"):
        Zero3(nn.Linear(2, 2), group, dict)  # type: ignore[arg-type]
    z = Zero3(nn.Linear(2, 2), group, torch.optim.SGD, lr=0.1)
    with pytest.raises(ValueError, match="expected \\{'meta'"):
        z.load_state_dict({})
    with pytest.raises(ValueError, match="format 'other'"):
        z.load_state_dict({"meta": {"format": "other"}, "tensors": {}})
