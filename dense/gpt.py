"""A GPT-style decoder (the dense part of a language model), readable like a reference.

The blocks follow GPT-2 / nanoGPT: pre-LayerNorm, causal multi-head self-attention,
a GELU MLP of width ``4 * d_model``, residual connections, a learned position
embedding, a final LayerNorm and a linear head to the vocabulary.

The TOKEN embedding is not part of this module. ``GPT.forward`` takes the token
vectors ``tok_emb [B, T, D]`` that an embedding collection produced (in the
examples: a parameter-server-backed table of which only the rows of the tokens in
the batch move) and returns logits ``[B, T, V]``. That keeps ``dense`` free of
``embedding`` (the import direction is ``comm <- dense``) and lets the token table
be sparse while everything here is dense and data parallel.

Weight tying (GPT-2 reuses the token table as the output head) is therefore not
used: the head needs all ``V`` rows on every step (the softmax runs over the
whole vocabulary), so tying it to the sparse table would pull the full table each
step and defeat "only the batch's rows move", and the same weights would then be
updated twice, by the table's server-side optimizer and by the dense optimizer.
The head is an ordinary dense ``nn.Linear`` here.

Example::

    cfg = GPTConfig(vocab_size=256, block_size=64, n_layer=2, n_head=4, d_model=64)
    model = GPT(cfg)
    tok_emb = torch.randn(8, 64, 64)          # [B, T, D] from the token table
    logits = model(tok_emb)                   # [B, T, V]
    loss = gpt_loss(logits, targets)          # targets: [B, T] int64
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(kw_only=True, slots=True)
class GPTConfig:
    """Shape of a GPT decoder.

    ``vocab_size`` V (the head's output width), ``block_size`` the longest context
    T, ``n_layer`` blocks of ``n_head`` heads over width ``d_model`` D (a multiple
    of ``n_head``), ``dropout`` on attention weights and residual branches, ``bias``
    in the Linear and LayerNorm layers.
    """

    vocab_size: int = 256
    block_size: int = 128
    n_layer: int = 2
    n_head: int = 4
    d_model: int = 128
    dropout: float = 0.0
    bias: bool = True

    def __post_init__(self) -> None:
        for name in ("vocab_size", "block_size", "n_layer", "n_head", "d_model"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                raise ValueError(f"GPTConfig: {name} must be an int > 0, got {v!r}")
        if self.d_model % self.n_head != 0:
            raise ValueError(
                f"GPTConfig: d_model {self.d_model} must be a multiple of n_head {self.n_head} "
                "(each head gets d_model / n_head channels)"
            )
        if not isinstance(self.dropout, int | float) or not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"GPTConfig: dropout must be in [0, 1), got {self.dropout!r}")
        if not isinstance(self.bias, bool):
            raise TypeError(f"GPTConfig: bias must be a bool, got {type(self.bias).__name__}")


class CausalSelfAttention(nn.Module):
    """Multi-head self-attention where position t attends to positions <= t only."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.n_head = cfg.n_head
        self.dropout = cfg.dropout
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model, bias=cfg.bias)  # q, k, v at once
        self.proj = nn.Linear(cfg.d_model, cfg.d_model, bias=cfg.bias)
        self.resid_drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape  # [B, T, D]
        h = self.n_head
        q, k, v = self.qkv(x).split(d, dim=2)  # each [B, T, D]
        # [B, T, D] -> [B, H, T, D/H]: heads become a batch dimension.
        q = q.view(b, t, h, d // h).transpose(1, 2)
        k = k.view(b, t, h, d // h).transpose(1, 2)
        v = v.view(b, t, h, d // h).transpose(1, 2)
        # softmax(q k^T / sqrt(D/H) + causal mask) v, fused; the mask hides the future.
        y = F.scaled_dot_product_attention(
            q, k, v, dropout_p=self.dropout if self.training else 0.0, is_causal=True
        )  # [B, H, T, D/H]
        y = y.transpose(1, 2).contiguous().view(b, t, d)  # [B, T, D]: heads side by side
        return self.resid_drop(self.proj(y))


class MLP(nn.Module):
    """Position-wise feed-forward: D -> 4D -> GELU -> D."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.fc = nn.Linear(cfg.d_model, 4 * cfg.d_model, bias=cfg.bias)
        self.act = nn.GELU()
        self.proj = nn.Linear(4 * cfg.d_model, cfg.d_model, bias=cfg.bias)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.proj(self.act(self.fc(x))))  # [B, T, D]


class Block(nn.Module):
    """One decoder block: pre-LayerNorm attention and MLP, each added to the residual."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.d_model, bias=cfg.bias)
        self.attn = CausalSelfAttention(cfg)
        self.ln2 = nn.LayerNorm(cfg.d_model, bias=cfg.bias)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))  # [B, T, D]
        x = x + self.mlp(self.ln2(x))  # [B, T, D]
        return x


class GPT(nn.Module):
    """The decoder above the token embedding: ``forward(tok_emb [B, T, D]) -> logits [B, T, V]``.

    Holds the position embedding (``block_size x D``, small and dense), the blocks,
    the final LayerNorm and the output head; see the module docstring for why the
    token embedding lives outside.
    """

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        if not isinstance(cfg, GPTConfig):
            raise TypeError(f"GPT: cfg must be a GPTConfig, got {type(cfg).__name__}")
        self.cfg = cfg
        self.pos_emb = nn.Embedding(cfg.block_size, cfg.d_model)
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList([Block(cfg) for _ in range(cfg.n_layer)])
        self.ln_f = nn.LayerNorm(cfg.d_model, bias=cfg.bias)
        self.head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """GPT-2 init: N(0, 0.02) weights, zero biases, and the projections that write
        into the residual stream scaled by ``1/sqrt(2 * n_layer)`` so the residual's
        variance does not grow with depth."""
        for m in self.modules():
            if isinstance(m, nn.Linear):
                nn.init.normal_(m.weight, mean=0.0, std=0.02)
                if m.bias is not None:
                    nn.init.zeros_(m.bias)
            elif isinstance(m, nn.Embedding):
                nn.init.normal_(m.weight, mean=0.0, std=0.02)
            elif isinstance(m, nn.LayerNorm):
                nn.init.ones_(m.weight)
                if m.bias is not None:
                    nn.init.zeros_(m.bias)
        for block in self.blocks:
            assert isinstance(block, Block)
            for proj in (block.attn.proj, block.mlp.proj):
                nn.init.normal_(proj.weight, mean=0.0, std=0.02 / math.sqrt(2 * self.cfg.n_layer))

    def forward(self, tok_emb: torch.Tensor) -> torch.Tensor:
        if tok_emb.dim() != 3 or tok_emb.shape[2] != self.cfg.d_model:
            raise ValueError(
                f"GPT: tok_emb must be [B, T, d_model={self.cfg.d_model}], "
                f"got shape {tuple(tok_emb.shape)}"
            )
        t = tok_emb.shape[1]
        if not 0 < t <= self.cfg.block_size:
            raise ValueError(
                f"GPT: sequence length {t} must be in [1, block_size={self.cfg.block_size}]"
            )
        pos = torch.arange(t, device=tok_emb.device)  # [T]
        x = self.drop(tok_emb + self.pos_emb(pos))  # [B, T, D] (+ [T, D] broadcast)
        for block in self.blocks:
            x = block(x)  # [B, T, D]
        return self.head(self.ln_f(x))  # [B, T, V]

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())


def gpt_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross entropy in nats per token.

    ``logits [B, T, V]`` (position t predicts token t + 1) against ``targets [B, T]``.
    """
    if logits.dim() != 3 or targets.shape != logits.shape[:2]:
        raise ValueError(
            f"gpt_loss: logits must be [B, T, V] and targets [B, T], got logits "
            f"{tuple(logits.shape)} and targets {tuple(targets.shape)}"
        )
    if targets.dtype != torch.int64:
        raise TypeError(f"gpt_loss: targets must be int64 token ids, got {targets.dtype}")
    v = logits.shape[2]
    return F.cross_entropy(logits.reshape(-1, v), targets.reshape(-1))
