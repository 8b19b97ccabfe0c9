"""Tensor parallelism (dense.tensor_parallel, dense.vocab_parallel).

On real processes (tests/dense/ranks/dense_tp.py, launched with the other dense rank checks by
tests/support/rank_battery.py, gloo and MPI at 1, 2 and 4 ranks): 5 AdamW steps of a token table
+ GPT split over tp = all ranks, and dp 2 x tp 2 at 4 ranks, equal one process on the
global batch (losses and gathered weights within a few times its measured rounding); the
vocabulary-parallel loss and table equal torch's with their gradients; the allreduced
bytes equal the analytic count; bad shapes and ids raise on every rank. In this process (a
1-rank group): the converted GPT equals the plain one, the loss and the table equal
torch's, and the argument errors.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import comm
from dense import (
    GPT,
    ColumnParallelLinear,
    GPTConfig,
    RowParallelLinear,
    TPStats,
    VocabParallelEmbedding,
    apply_tensor_parallel,
    gpt_loss,
    tp_full_state_dict,
    tp_gpt_loss,
    tp_stats,
    vocab_parallel_cross_entropy,
)
from dense.tensor_parallel import check_tensor_parallel
from rank_battery import BATTERY_TIMEOUT_S, DENSE_CASES, RankBattery
from tolerance import (
    assert_close,
    assert_same,
    cross_entropy_grad_tol,
    cross_entropy_tol,
    replay_tol,
)

pytestmark = pytest.mark.numerics  # rerun under each ATEN_CPU_CAPABILITY

CFG = GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=4, d_model=32)


@pytest.mark.timeout(BATTERY_TIMEOUT_S)
@pytest.mark.parametrize(("backend", "nprocs"), DENSE_CASES)
def test_tensor_parallel_matches_one_process(
    backend: str, nprocs: int, rank_battery: RankBattery
) -> None:
    meshes = [f"tp dp 1 x tp {nprocs}: ok"] + (["tp dp 2 x tp 2: ok"] if nprocs == 4 else [])
    lines = [f"rank {r}/{nprocs} {backend} {what}" for r in range(nprocs) for what in meshes]
    lines += [f"rank {r}/{nprocs} {backend} tp: ok" for r in range(nprocs)]
    rank_battery.expect(backend, nprocs, lines)


def test_one_rank_gpt_equals_the_plain_gpt() -> None:
    group = comm.LocalGroup()
    torch.manual_seed(0)
    ref = GPT(CFG)
    ref64 = copy.deepcopy(ref).double()  # the same computation in float64: the tolerances
    torch.manual_seed(0)
    stats = TPStats()
    gpt = apply_tensor_parallel(GPT(CFG), group, stats=stats)
    assert tp_stats(gpt) is stats
    layers = dict(gpt.named_modules())
    assert isinstance(layers["blocks.0.attn.qkv"], ColumnParallelLinear)
    assert isinstance(layers["blocks.0.mlp.proj"], RowParallelLinear)
    x = torch.randn(2, 16, 32)
    targets = torch.randint(0, 64, (2, 16))
    logits64 = ref64(x.double())
    gpt_loss(logits64, targets).backward()
    want = gpt_loss(ref(x), targets)
    got = tp_gpt_loss(gpt(x), targets, group, stats=stats)
    # The same layers at one rank; the loss is the vocabulary-parallel cross entropy, whose
    # sums run in another order than F.cross_entropy's (its bound); the gradients flow back
    # from there through fp32 layers: a few times the reference's own rounding error.
    assert_close(got, want, atol=cross_entropy_tol(logits64, targets), what="loss",
                 why="the cross entropy's rounding bound in two orders")  # fmt: skip
    want.backward()
    got.backward()
    for (name, a), (other, b), b64 in zip(
        gpt.named_parameters(), ref.named_parameters(), ref64.parameters(), strict=True
    ):
        assert name == other
        assert a.grad is not None and b.grad is not None and b64.grad is not None
        why = "a few times the reference's fp32 rounding error, measured in float64"
        tol = replay_tol(b.grad, b64.grad)
        assert_close(a.grad, b.grad, atol=tol, what=f"{name} grad", why=why)
    full = tp_full_state_dict(gpt)
    for name, t in ref.state_dict().items():
        assert_same(full[name], t, what=name, why="gathered copies of the same init")
    assert stats.bytes_allreduced == 0 and stats.allreduces == 0  # nothing moves at 1 rank


def test_cross_entropy_and_table_equal_torch_at_one_rank() -> None:
    group = comm.LocalGroup()
    gen = torch.Generator().manual_seed(3)
    logits = (4 * torch.randn(3, 5, 16, generator=gen)).requires_grad_()
    mine = logits.detach().clone().requires_grad_()
    targets = torch.randint(0, 16, (3, 5), generator=gen)
    want = F.cross_entropy(logits.reshape(-1, 16), targets.reshape(-1))
    got = vocab_parallel_cross_entropy(mine, targets, group)
    why = "the cross entropy's rounding bound in two orders"
    tol = cross_entropy_tol(logits, targets)
    assert_close(got, want, atol=tol, what="cross entropy", why=why)
    (3 * want).backward()
    (3 * got).backward()
    assert mine.grad is not None and logits.grad is not None
    tol = cross_entropy_grad_tol(15, 16, upstream=3.0)
    assert_close(mine.grad, logits.grad, atol=tol, what="cross entropy gradient", why=why)

    emb = nn.Embedding(16, 4)
    table = VocabParallelEmbedding(emb, group)
    upstream = torch.randn(3, 5, 4, generator=gen)
    assert_same(table(targets), emb(targets), what="rows", why="one rank: copies of the rows")
    (table(targets) * upstream).sum().backward()
    (emb(targets) * upstream).sum().backward()
    assert table.weight.grad is not None and emb.weight.grad is not None
    assert_same(table.weight.grad, emb.weight.grad, what="table gradient",
                why="the same upstream rows summed in the same order")  # fmt: skip


def test_bf16_logits_give_the_float32_loss_and_its_gradient_rounded_once() -> None:
    """The loss and softmax run in float32 for bf16 logits: the loss is float32 of the
    same logits (bf16 values are exact in float32) and the gradient is the float32
    gradient rounded to bf16 once; computed in bf16, p - 1 at p = 0.99 would be ~40 %
    off."""
    group = comm.LocalGroup()
    gen = torch.Generator().manual_seed(5)
    logits = (6 * torch.randn(4, 3, 32, generator=gen)).bfloat16()
    targets = logits.float().argmax(dim=2)  # confident predictions: p close to 1
    ref = logits.float().requires_grad_()
    mine = logits.clone().requires_grad_()
    want = F.cross_entropy(ref.reshape(-1, 32), targets.reshape(-1))
    got = vocab_parallel_cross_entropy(mine, targets, group)
    assert got.dtype == torch.float32
    why = "float32 loss of the same (bf16-exact) logits, summed in two orders"
    assert_close(got, want, atol=cross_entropy_tol(ref, targets), what="bf16 loss", why=why)
    want.backward()
    got.backward()
    assert mine.grad is not None and ref.grad is not None and mine.grad.dtype == torch.bfloat16
    # One bf16 rounding of the float32 gradient (half an ulp: 2**-9 relative), on top of
    # the float32 rounding bound.
    g32 = ref.grad
    tol = cross_entropy_grad_tol(31, 32, upstream=1.0) + float(g32.abs().max()) * 2.0**-8
    assert_close(mine.grad.float(), g32, atol=tol, what="bf16 gradient", why="rounded once")


def test_bad_input() -> None:
    group = comm.LocalGroup()
    with pytest.raises(ValueError, match="n_head = 4 is not divisible by the tp group size 3"):
        check_tensor_parallel(GPT(CFG), 3)
    odd = GPTConfig(vocab_size=65, block_size=4, n_layer=1, n_head=2, d_model=4)
    with pytest.raises(ValueError, match="vocab_size = 65 is not divisible by the tp group size 2"):
        check_tensor_parallel(GPT(odd), 2)
    gpt = apply_tensor_parallel(GPT(CFG), group)
    with pytest.raises(ValueError, match="already tensor parallel"):
        apply_tensor_parallel(gpt, group)
    with pytest.raises(TypeError, match="expected a dense.GPT"):
        apply_tensor_parallel(nn.Linear(2, 2), group)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="not tensor parallel"):
        tp_stats(GPT(CFG))
    with pytest.raises(ValueError, match="chunks must be an int >= 1 dividing out_features 8"):
        ColumnParallelLinear(nn.Linear(2, 8), group, chunks=3)
    with pytest.raises(ValueError, match="padding_idx and max_norm are not supported"):
        VocabParallelEmbedding(nn.Embedding(8, 2, padding_idx=0), group)
    logits = torch.zeros(2, 3, 8)
    with pytest.raises(ValueError, match=r"token ids must be in \[0, 8\), got values in \[0, 9\]"):
        vocab_parallel_cross_entropy(logits, torch.tensor([[0, 1, 9], [0, 0, 0]]), group)
    with pytest.raises(TypeError, match="token ids must be int64, got torch.int32"):
        vocab_parallel_cross_entropy(logits, torch.zeros(2, 3, dtype=torch.int32), group)
    with pytest.raises(ValueError, match=r"local_logits must be \[B, T, V/tp\]"):
        vocab_parallel_cross_entropy(logits[0], torch.zeros(2, 3, dtype=torch.int64), group)
    with pytest.raises(ValueError, match=r"token ids must be in \[0, 8\), got values in \[-1, 0\]"):
        VocabParallelEmbedding(nn.Embedding(8, 2), group)(torch.tensor([-1, 0]))
