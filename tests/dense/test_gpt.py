"""dense.gpt: shapes, causality, attention vs an explicit-mask reference, overfitting, errors."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from dense.gpt import GPT, CausalSelfAttention, GPTConfig, gpt_loss
from tolerance import assert_close, assert_same, cross_entropy_tol, replay_tol

pytestmark = pytest.mark.numerics  # rerun under each ATEN_CPU_CAPABILITY

SMALL: dict[str, Any] = dict(vocab_size=32, block_size=16, n_layer=2, n_head=2, d_model=16)


def test_shapes_and_parameter_count() -> None:
    torch.manual_seed(0)
    model = GPT(GPTConfig(**SMALL))
    logits = model(torch.randn(3, 10, 16))  # [B, T, D]
    assert logits.shape == (3, 10, 32)
    d, v, t, n = 16, 32, 16, 2
    per_block = (
        (2 * 2 * d) + (d * 3 * d + 3 * d) + (d * d + d) + (d * 4 * d + 4 * d) + (4 * d * d + d)
    )
    assert model.num_parameters() == t * d + n * per_block + 2 * d + d * v


def test_attention_matches_explicit_mask_reference() -> None:
    torch.manual_seed(1)
    cfg = GPTConfig(**SMALL)
    attn = CausalSelfAttention(cfg)
    x = torch.randn(2, 7, 16)  # [B, T, D]
    b, t, d, h = 2, 7, 16, 2

    def explicit(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        w_qkv, b_qkv = attn.qkv.weight.to(dtype), attn.qkv.bias.to(dtype)
        q, k, v = (x.to(dtype) @ w_qkv.T + b_qkv).split(d, dim=2)
        q, k, v = (z.view(b, t, h, d // h).transpose(1, 2) for z in (q, k, v))
        scores = q @ k.transpose(-2, -1) / math.sqrt(d // h)  # [B, H, T, T]
        mask = torch.ones(t, t, dtype=torch.bool).tril()
        scores = scores.masked_fill(~mask, float("-inf"))
        y = (scores.softmax(-1) @ v).transpose(1, 2).reshape(b, t, d)
        return y @ attn.proj.weight.to(dtype).T + attn.proj.bias.to(dtype)

    ref, ref64 = explicit(x, torch.float32), explicit(x, torch.float64)
    # The module's fused attention sums in another order: a few times the explicit fp32
    # reference's own rounding error, measured against the same steps in float64.
    tol = replay_tol(ref.detach(), ref64.detach())
    why = "a few times the reference's measured fp32 rounding"
    assert_close(attn(x).detach(), ref.detach(), atol=tol, what="attention", why=why)


def test_causal_future_does_not_change_past() -> None:
    torch.manual_seed(2)
    model = GPT(GPTConfig(**SMALL)).eval()
    x = torch.randn(2, 12, 16)
    for t in (0, 5, 10):
        y = x.clone()
        y[:, t + 1 :] = torch.randn_like(y[:, t + 1 :])  # change every position after t
        a, b = model(x), model(y)
        # Each prefix row sees the same inputs and exact zeros from the masked future (a
        # softmax weight of exactly 0), through the same kernels on the same shapes.
        assert_same(a[:, : t + 1], b[:, : t + 1], what=f"outputs up to {t}",
                    why="the future is masked to exact zeros")  # fmt: skip
        assert not torch.allclose(a[:, t + 1 :], b[:, t + 1 :])  # changed by O(1), not rounding


def test_tiny_model_overfits_a_fixed_sequence() -> None:
    torch.manual_seed(3)
    cfg = GPTConfig(vocab_size=16, block_size=12, n_layer=1, n_head=2, d_model=32)
    model = GPT(cfg)
    tok_table = torch.nn.Embedding(16, 32)  # stands in for the sparse token table
    seq = torch.randint(0, 16, (4, 13), generator=torch.Generator().manual_seed(0))
    inputs, targets = seq[:, :-1], seq[:, 1:]  # [4, 12] each
    opt = torch.optim.AdamW([*model.parameters(), *tok_table.parameters()], lr=1e-2)
    losses = []
    for _ in range(150):
        loss = gpt_loss(model(tok_table(inputs)), targets)
        losses.append(float(loss.detach()))
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert losses[0] > math.log(16) - 0.5  # starts near uniform
    assert losses[-1] < 0.1


def test_gpt_loss_is_mean_cross_entropy() -> None:
    logits = torch.randn(2, 3, 5)
    targets = torch.randint(0, 5, (2, 3))
    ref = -F.log_softmax(logits, -1).gather(-1, targets[..., None]).mean()
    why = "the cross entropy's rounding bound in two orders"
    tol = cross_entropy_tol(logits, targets)
    assert_close(gpt_loss(logits, targets), ref, atol=tol, what="gpt_loss", why=why)
    with pytest.raises(ValueError, match=r"targets \[B, T\]"):
        gpt_loss(logits, targets[:, :2])
    with pytest.raises(TypeError, match="int64"):
        gpt_loss(logits, targets.int())


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (dict(vocab_size=0), "vocab_size must be an int > 0, got 0"),
        (dict(n_layer=-1), "n_layer must be an int > 0, got -1"),
        (dict(d_model=30, n_head=4), "d_model 30 must be a multiple of n_head 4"),
        (dict(dropout=1.0), r"dropout must be in \[0, 1\), got 1.0"),
        (dict(block_size=2.5), "block_size must be an int > 0, got 2.5"),
    ],
)
def test_bad_config(kwargs: dict[str, object], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        GPTConfig(**kwargs)  # type: ignore[arg-type]


def test_bad_inputs() -> None:
    model = GPT(GPTConfig(**SMALL))
    with pytest.raises(ValueError, match=r"sequence length 17 must be in \[1, block_size=16\]"):
        model(torch.randn(1, 17, 16))
    with pytest.raises(ValueError, match=r"must be \[B, T, d_model=16\], got shape \(1, 4, 8\)"):
        model(torch.randn(1, 4, 8))
    with pytest.raises(TypeError, match="bias must be a bool"):
        GPTConfig(bias=1)  # type: ignore[arg-type]
