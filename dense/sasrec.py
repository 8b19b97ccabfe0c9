"""SASRec (Kang & McAuley, "Self-Attentive Sequential Recommendation", ICDM 2018), as RecBole
builds it, over a batch of jagged item sequences.

The blocks are RecBole's ``TransformerEncoder``: post-LayerNorm, causal multi-head softmax
self-attention, a feed-forward ``D -> inner_dim -> D``; the input is the item vectors plus a
learned absolute position embedding, then a LayerNorm and dropout. It is the same block as
``torch.nn.TransformerEncoderLayer(norm_first=False, batch_first=True)`` (the tests compare
the two with copied weights).

The ITEM embedding is not part of this module (it lives in an embedding collection, like the
GPT's token table): ``forward`` takes the looked-up rows of the input items, jagged, and
returns one hidden vector per input position. The caller scores them against item rows
(tied table: ``logits = h @ item_rows.T``) for the next item::

    offsets  = [0, 3, 5]              two sequences, of 3 and 2 items
    item_vecs  [5, D]                 rows of a0 a1 a2 | b0 b1
    h = model(item_vecs, offsets)     [5, D]: h[2] has seen a0..a2 and predicts a3

Positions (``SASRecConfig.positions``): ``"first"`` counts them from the START of each
(capped) sequence, 0 for the oldest item, as RecBole does (it left-aligns its sequences):
the same sequence gets the same positions alone or in a batch with longer ones, and the
hidden state after item ``t`` depends on items ``<= t`` alone. ``"last"`` anchors the
NEWEST item at ``max_seq_len - 1``, as the paper's own code does (it left-pads each
sequence to ``max_seq_len``): an evaluation query and the last input of a training
window then sit at the same position, and an item's position says how many inputs of
its sequence follow it (their number, never their items, so training every position at
once still predicts each next item from earlier items only).

Example::

    model = SASRec(SASRecConfig(dim=64, max_seq_len=50))
    h = model(item_table(items), offsets)         # [N, D]
    logits = h @ item_table.weight.T              # [N, V]: next item at each position
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from dense.seq_common import POSITION_ALIGNS, empty_output, jagged_index

# The feed-forward activations RecBole offers (its "swish" is SiLU); "gelu" is the exact erf one.
ACTIVATIONS: dict[str, type[nn.Module]] = {
    "gelu": nn.GELU,
    "relu": nn.ReLU,
    "silu": nn.SiLU,
    "tanh": nn.Tanh,
    "sigmoid": nn.Sigmoid,
}


@dataclass(kw_only=True, slots=True)
class SASRecConfig:
    """Shape of a SASRec encoder (defaults: RecBole's SASRec).

    ``dim`` D (a multiple of ``n_head``), the longest input ``max_seq_len`` (rows of the
    position embedding), ``n_layer`` blocks of ``n_head`` heads with a feed-forward of width
    ``inner_dim`` and activation ``act``; ``dropout`` on the input and on each residual
    branch (RecBole's hidden dropout), ``attn_dropout`` on the attention weights;
    ``positions`` "first" or "last": which end of a sequence the learned positions count
    from (the module docstring).
    """

    dim: int = 64
    max_seq_len: int = 50
    n_layer: int = 2
    n_head: int = 2
    inner_dim: int = 256
    dropout: float = 0.5
    attn_dropout: float = 0.5
    layer_norm_eps: float = 1e-12
    act: str = "gelu"
    positions: str = "first"

    def __post_init__(self) -> None:
        for name in ("dim", "max_seq_len", "n_layer", "n_head", "inner_dim"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                raise ValueError(f"SASRecConfig: {name} must be an int > 0, got {v!r}")
        if self.dim % self.n_head != 0:
            raise ValueError(
                f"SASRecConfig: dim {self.dim} must be a multiple of n_head {self.n_head} "
                "(each head gets dim / n_head channels)"
            )
        for name in ("dropout", "attn_dropout"):
            v = getattr(self, name)
            if not isinstance(v, int | float) or isinstance(v, bool) or not 0.0 <= v < 1.0:
                raise ValueError(f"SASRecConfig: {name} must be in [0, 1), got {v!r}")
        eps = self.layer_norm_eps
        if not isinstance(eps, int | float) or isinstance(eps, bool) or not eps > 0:
            raise ValueError(f"SASRecConfig: layer_norm_eps must be > 0, got {eps!r}")
        if self.positions not in POSITION_ALIGNS:
            raise ValueError(
                f"SASRecConfig: positions must be one of {POSITION_ALIGNS}, got {self.positions!r}"
            )
        if self.act not in ACTIVATIONS:
            raise ValueError(
                f"SASRecConfig: act must be one of {sorted(ACTIVATIONS)}, got {self.act!r}"
            )


class SASRecAttention(nn.Module):
    """Multi-head softmax self-attention, then ``LayerNorm(x + dropout(proj(attn)))``."""

    def __init__(self, cfg: SASRecConfig) -> None:
        super().__init__()
        self.n_head = cfg.n_head
        self.attn_dropout = cfg.attn_dropout
        self.qkv = nn.Linear(cfg.dim, 3 * cfg.dim)  # q, k, v at once (RecBole: three Linears)
        self.proj = nn.Linear(cfg.dim, cfg.dim)
        self.drop = nn.Dropout(cfg.dropout)
        self.ln = nn.LayerNorm(cfg.dim, eps=cfg.layer_norm_eps)

    def forward(self, x: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape  # [B, T, D]
        h = self.n_head
        q, k, v = self.qkv(x).split(d, dim=2)  # each [B, T, D]
        # [B, T, D] -> [B, H, T, D/H]: heads become a batch dimension.
        q = q.view(b, t, h, d // h).transpose(1, 2)
        k = k.view(b, t, h, d // h).transpose(1, 2)
        v = v.view(b, t, h, d // h).transpose(1, 2)
        # softmax(q k^T / sqrt(D/H), over the allowed keys) v; allowed: [B, 1, T, T] bool.
        y = F.scaled_dot_product_attention(
            q, k, v, attn_mask=allowed, dropout_p=self.attn_dropout if self.training else 0.0
        )  # [B, H, T, D/H]
        y = y.transpose(1, 2).contiguous().view(b, t, d)  # [B, T, D]: heads side by side
        return self.ln(x + self.drop(self.proj(y)))  # post-LN residual


class SASRecFeedForward(nn.Module):
    """Position-wise ``D -> inner_dim -> act -> D``, then ``LayerNorm(x + dropout(.))``."""

    def __init__(self, cfg: SASRecConfig) -> None:
        super().__init__()
        self.fc = nn.Linear(cfg.dim, cfg.inner_dim)
        self.act = ACTIVATIONS[cfg.act]()
        self.proj = nn.Linear(cfg.inner_dim, cfg.dim)
        self.drop = nn.Dropout(cfg.dropout)
        self.ln = nn.LayerNorm(cfg.dim, eps=cfg.layer_norm_eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ln(x + self.drop(self.proj(self.act(self.fc(x)))))  # [B, T, D]


class SASRecBlock(nn.Module):
    """One post-LN transformer block (RecBole's ``TransformerLayer``)."""

    def __init__(self, cfg: SASRecConfig) -> None:
        super().__init__()
        self.attn = SASRecAttention(cfg)
        self.ff = SASRecFeedForward(cfg)

    def forward(self, x: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
        return self.ff(self.attn(x, allowed))  # [B, T, D]


class SASRec(nn.Module):
    """The encoder above the item embedding:
    ``forward(item_vecs [N, D], offsets [B + 1], times=None) -> [N, D]``.

    Row ``i`` of the output is the hidden state after input row ``i``; it depends only on
    that row and the earlier rows of the same sequence. ``times`` is accepted for the
    common encoder signature (HSTU uses it) and ignored.
    """

    def __init__(self, cfg: SASRecConfig) -> None:
        super().__init__()
        if not isinstance(cfg, SASRecConfig):
            raise TypeError(f"SASRec: cfg must be a SASRecConfig, got {type(cfg).__name__}")
        self.cfg = cfg
        self.pos_emb = nn.Embedding(cfg.max_seq_len, cfg.dim)
        self.ln = nn.LayerNorm(cfg.dim, eps=cfg.layer_norm_eps)
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList([SASRecBlock(cfg) for _ in range(cfg.n_layer)])
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """RecBole's ``_init_weights``: N(0, 0.02) Linear and Embedding weights, zero
        biases, LayerNorm weight 1 and bias 0."""
        for m in self.modules():
            if isinstance(m, nn.Linear | nn.Embedding):
                nn.init.normal_(m.weight, mean=0.0, std=0.02)
            if isinstance(m, nn.Linear | nn.LayerNorm) and m.bias is not None:
                nn.init.zeros_(m.bias)
            if isinstance(m, nn.LayerNorm):
                nn.init.ones_(m.weight)

    def forward(
        self, item_vecs: torch.Tensor, offsets: torch.Tensor, times: torch.Tensor | None = None
    ) -> torch.Tensor:
        del times  # SASRec has no notion of time
        idx = jagged_index(
            "SASRec", item_vecs, offsets, dim=self.cfg.dim, max_seq_len=self.cfg.max_seq_len
        )
        if idx.t_max == 0:  # no rows at all (B == 0 or every sequence empty)
            return empty_output(self, item_vecs)
        t = idx.t_max
        x = idx.pad(item_vecs)  # [B, T, D], zeros at padding
        pos = idx.positions(self.cfg.positions, self.cfg.max_seq_len)  # [T] or [B, T]
        x = self.drop(self.ln(x + self.pos_emb(pos)))  # [B, T, D] (+ [T, D] or [B, T, D])
        # Query i may attend to key j iff j <= i and j is a real item. A padding query
        # also attends to itself, so that an empty sequence's rows (no real key at all)
        # still have one key and the softmax no NaN; real queries always see themselves.
        causal = torch.ones(t, t, dtype=torch.bool, device=x.device).tril()  # [T, T]
        eye = torch.eye(t, dtype=torch.bool, device=x.device)  # [T, T]
        allowed = (causal & idx.valid[:, None, :]) | eye  # [B, T, T]
        allowed = allowed[:, None]  # [B, 1, T, T]: the same for every head
        for block in self.blocks:
            x = block(x, allowed)  # [B, T, D]
        return idx.unpad(x)  # [N, D]

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())
