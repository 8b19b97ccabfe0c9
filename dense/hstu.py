"""HSTU (Zhai et al., "Actions Speak Louder than Words: Trillion-Parameter Sequential
Transducers for Generative Recommendations", ICML 2024) over a batch of jagged item sequences.

Each layer (the paper's equations 1-3), on the residual stream ``X [B, T, D]``::

    U, V, Q, K = split(SiLU(f1(LayerNorm(X))))        f1: D -> H * (2 dv + 2 dqk), no bias
    A = SiLU(Q K^T + rab(p, t)) / max_seq_len         pointwise per (i, j), no softmax;
                                                      0 where j > i or j is padding
    X = X + f2(dropout(LayerNorm(A V) * U))           f2: H * dv -> D

``rab`` is a relative attention bias, per layer and shared by the heads (as the reference
implementation, github.com/facebookresearch/generative-recommenders): a learned bias per
relative position ``i - j`` (``position_bias``) plus, with ``time_buckets > 0``, a learned
bias per bucket of the time gap between query ``i``'s and key ``j``'s timestamps::

    bucket(i, j) = floor(ln(max(|t_i - t_j|, 1)) / 0.301), clamped to [0, time_buckets - 1]

(logarithmic: one bucket per factor e^0.301 = 1.35 of the gap; 128 buckets reach far past
any real gap in seconds). The reference takes the gap from the timestamp of the item
being predicted (the query's NEXT item); here only the inputs' times are given, so it is
the query's own timestamp.

The input is, as the reference's preprocessor, ``item_vecs * sqrt(D)`` plus a learned
absolute position embedding (from the start of the sequence, 0 = the oldest item, so that
outputs stay causal), then dropout. The two LayerNorms have no learned scale or bias (as
the reference; ``f1`` and ``f2`` absorb them).

Two choices the paper's equations leave open, made as the reference does:

* ``A`` is divided by the configured ``max_seq_len``, not the batch's longest sequence:
  the reference divides by its fixed padded length, and a batch-dependent divisor would
  change a sequence's outputs with the other sequences of its batch.
* No final LayerNorm and no normalisation of the output: the reference's encoder has none
  either, it hands the residual stream to an output postprocessor that L2-normalises it
  (its training configs also L2-normalise the item rows and divide the dot products by a
  temperature of 0.05). That choice is the caller's: ``F.normalize(h, dim=-1)`` for the
  reference's scoring, or a plain ``h @ item_rows.T``.

The ITEM embedding is not part of this module (see :mod:`dense.sasrec`)::

    model = HSTU(HSTUConfig(dim=64, max_seq_len=50))
    h = model(item_table(items), offsets, times)  # [N, D]; times [N] int64 seconds
    logits = h @ item_table.weight.T              # [N, V]: next item at each position
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from dense.seq_common import POSITION_ALIGNS, empty_output, jagged_index

# The reference's bucket width in ln(seconds): bucket = floor(ln(gap) / 0.301).
TIME_BUCKET_LOG_WIDTH = 0.301


@dataclass(kw_only=True, slots=True)
class HSTUConfig:
    """Shape of an HSTU encoder.

    ``dim`` D, the longest input ``max_seq_len``, ``n_layer`` layers of ``n_head`` heads;
    per head ``attn_dim`` channels of Q and K and ``linear_dim`` of V and U (``None``:
    ``dim // n_head``, then ``dim`` must be a multiple of ``n_head``); ``dropout`` on the
    input and before each layer's output projection; ``time_buckets`` buckets of the
    log time gap in the attention bias (0: no time bias, ``times`` not needed);
    ``position_bias`` the relative position bias; ``layer_norm_eps`` of the LayerNorms;
    ``positions`` which end of a sequence the learned absolute positions count from
    ("first": 0 for the oldest item; "last": ``max_seq_len - 1`` for the newest, see
    :meth:`dense.seq_common.JaggedIndex.positions`).
    """

    dim: int = 64
    max_seq_len: int = 50
    n_layer: int = 2
    n_head: int = 2
    attn_dim: int | None = None
    linear_dim: int | None = None
    dropout: float = 0.2
    time_buckets: int = 128
    position_bias: bool = True
    layer_norm_eps: float = 1e-6
    positions: str = "first"

    def __post_init__(self) -> None:
        for name in ("dim", "max_seq_len", "n_layer", "n_head"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                raise ValueError(f"HSTUConfig: {name} must be an int > 0, got {v!r}")
        for name in ("attn_dim", "linear_dim"):
            v = getattr(self, name)
            if v is None:
                if self.dim % self.n_head != 0:
                    raise ValueError(
                        f"HSTUConfig: dim {self.dim} must be a multiple of n_head "
                        f"{self.n_head} when {name} is None (its default is dim // n_head)"
                    )
            elif not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                raise ValueError(f"HSTUConfig: {name} must be None or an int > 0, got {v!r}")
        tb = self.time_buckets
        if not isinstance(tb, int) or isinstance(tb, bool) or tb < 0:
            raise ValueError(f"HSTUConfig: time_buckets must be an int >= 0, got {tb!r}")
        if not isinstance(self.position_bias, bool):
            raise TypeError(
                f"HSTUConfig: position_bias must be a bool, got {type(self.position_bias).__name__}"
            )
        p = self.dropout
        if not isinstance(p, int | float) or isinstance(p, bool) or not 0.0 <= p < 1.0:
            raise ValueError(f"HSTUConfig: dropout must be in [0, 1), got {p!r}")
        eps = self.layer_norm_eps
        if not isinstance(eps, int | float) or isinstance(eps, bool) or not eps > 0:
            raise ValueError(f"HSTUConfig: layer_norm_eps must be > 0, got {eps!r}")
        if self.positions not in POSITION_ALIGNS:
            raise ValueError(
                f"HSTUConfig: positions must be one of {POSITION_ALIGNS}, got {self.positions!r}"
            )

    @property
    def qk_dim(self) -> int:
        """Channels of Q and K per head (``attn_dim`` or ``dim // n_head``)."""
        return self.attn_dim if self.attn_dim is not None else self.dim // self.n_head

    @property
    def v_dim(self) -> int:
        """Channels of V and U per head (``linear_dim`` or ``dim // n_head``)."""
        return self.linear_dim if self.linear_dim is not None else self.dim // self.n_head


def time_gap_buckets(times: torch.Tensor, n_buckets: int) -> torch.Tensor:
    """``times [B, T]`` int64 seconds -> ``[B, T, T]`` int64 bucket of ``|t_i - t_j|``.

    The gap is exact in int64; its log is taken in float32 whatever the model's dtype, so
    that a float64 replay of the model gets the same buckets."""
    gap = (times[:, :, None] - times[:, None, :]).abs().clamp(min=1)  # [B, T, T] >= 1
    bucket = torch.floor(torch.log(gap.to(torch.float32)) / TIME_BUCKET_LOG_WIDTH)
    return bucket.long().clamp(0, n_buckets - 1)


class RelativeBias(nn.Module):
    """``rab(p, t)``: one layer's attention bias, shared by its heads (the reference's
    ``RelativeBucketedTimeAndPositionBasedBias``). ``None`` parts are absent."""

    def __init__(self, cfg: HSTUConfig) -> None:
        super().__init__()
        self.pos_w: nn.Parameter | None = None
        self.time_w: nn.Parameter | None = None
        if cfg.position_bias:  # one weight per i - j in [0, max_seq_len - 1]
            self.pos_w = nn.Parameter(torch.empty(cfg.max_seq_len))
        if cfg.time_buckets > 0:  # one weight per time-gap bucket
            self.time_w = nn.Parameter(torch.empty(cfg.time_buckets))

    def forward(self, rel_pos: torch.Tensor, buckets: torch.Tensor | None) -> torch.Tensor | None:
        """``rel_pos [T, T]``, ``buckets [B, T, T]`` (or None) -> ``[B or 1, T, T]`` or None."""
        bias: torch.Tensor | None = None
        if self.pos_w is not None:
            bias = self.pos_w[rel_pos][None]  # [1, T, T]
        if self.time_w is not None:
            assert buckets is not None  # HSTU.forward checked times
            t_bias = self.time_w[buckets]  # [B, T, T]
            bias = t_bias if bias is None else bias + t_bias
        return bias


class HSTULayer(nn.Module):
    """One HSTU layer (module docstring): pointwise SiLU attention gated by ``U``."""

    def __init__(self, cfg: HSTUConfig) -> None:
        super().__init__()
        self.n_head, self.qk_dim, self.v_dim = cfg.n_head, cfg.qk_dim, cfg.v_dim
        self.scale = 1.0 / cfg.max_seq_len
        h = cfg.n_head
        self.ln_in = nn.LayerNorm(cfg.dim, eps=cfg.layer_norm_eps, elementwise_affine=False)
        self.f1 = nn.Linear(cfg.dim, h * (2 * self.v_dim + 2 * self.qk_dim), bias=False)
        self.rab = RelativeBias(cfg)
        self.ln_attn = nn.LayerNorm(
            h * self.v_dim, eps=cfg.layer_norm_eps, elementwise_affine=False
        )
        self.drop = nn.Dropout(cfg.dropout)
        self.f2 = nn.Linear(h * self.v_dim, cfg.dim)

    def forward(
        self,
        x: torch.Tensor,
        allowed: torch.Tensor,
        rel_pos: torch.Tensor,
        buckets: torch.Tensor | None,
    ) -> torch.Tensor:
        b, t, _ = x.shape  # [B, T, D]
        h, dqk, dv = self.n_head, self.qk_dim, self.v_dim
        uvqk = F.silu(self.f1(self.ln_in(x)))  # [B, T, H * (2 dv + 2 dqk)]
        u, v, q, k = uvqk.split([h * dv, h * dv, h * dqk, h * dqk], dim=2)
        # [B, T, H * c] -> [B, H, T, c]: heads become a batch dimension.
        q = q.view(b, t, h, dqk).transpose(1, 2)
        k = k.view(b, t, h, dqk).transpose(1, 2)
        v = v.view(b, t, h, dv).transpose(1, 2)
        s = q @ k.transpose(-2, -1)  # [B, H, T, T]: no 1/sqrt(dqk), as the paper
        bias = self.rab(rel_pos, buckets)  # [B or 1, T, T] or None
        if bias is not None:
            s = s + bias[:, None]  # the same bias for every head
        # Pointwise: each (i, j) weighs v_j on its own, nothing sums the weights to 1.
        a = torch.where(allowed, F.silu(s) * self.scale, 0.0)  # [B, H, T, T], 0 if masked
        y = (a @ v).transpose(1, 2).reshape(b, t, h * dv)  # [B, T, H * dv]
        return x + self.f2(self.drop(self.ln_attn(y) * u))  # [B, T, D]


class HSTU(nn.Module):
    """The encoder above the item embedding:
    ``forward(item_vecs [N, D], offsets [B + 1], times [N] or None) -> [N, D]``.

    Row ``i`` of the output is the hidden state after input row ``i``; it depends only on
    that row and the earlier rows (and their times) of the same sequence. ``times`` are
    the inputs' int64 timestamps in seconds, needed iff ``time_buckets > 0``.
    """

    def __init__(self, cfg: HSTUConfig) -> None:
        super().__init__()
        if not isinstance(cfg, HSTUConfig):
            raise TypeError(f"HSTU: cfg must be an HSTUConfig, got {type(cfg).__name__}")
        self.cfg = cfg
        self.pos_emb = nn.Embedding(cfg.max_seq_len, cfg.dim)
        self.drop = nn.Dropout(cfg.dropout)
        self.layers = nn.ModuleList([HSTULayer(cfg) for _ in range(cfg.n_layer)])
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """The reference's init: ``f1`` N(0, 0.02), ``f2`` Xavier-uniform (zero bias here;
        torch's default there), the relative biases N(0, 0.02), the position embedding a
        normal of std ``sqrt(1 / D)`` truncated at 2 std."""
        std = math.sqrt(1.0 / self.cfg.dim)
        nn.init.trunc_normal_(self.pos_emb.weight, mean=0.0, std=std, a=-2 * std, b=2 * std)
        for layer in self.layers:
            assert isinstance(layer, HSTULayer)
            nn.init.normal_(layer.f1.weight, mean=0.0, std=0.02)
            nn.init.xavier_uniform_(layer.f2.weight)
            nn.init.zeros_(layer.f2.bias)
            for w in (layer.rab.pos_w, layer.rab.time_w):
                if w is not None:
                    nn.init.normal_(w, mean=0.0, std=0.02)

    def forward(
        self, item_vecs: torch.Tensor, offsets: torch.Tensor, times: torch.Tensor | None = None
    ) -> torch.Tensor:
        cfg = self.cfg
        dev = item_vecs.device
        idx = jagged_index("HSTU", item_vecs, offsets, dim=cfg.dim, max_seq_len=cfg.max_seq_len)
        if cfg.time_buckets > 0:
            if times is None:
                raise ValueError(
                    f"HSTU: HSTUConfig.time_buckets={cfg.time_buckets} needs times [N] "
                    "(or set time_buckets=0 for no time bias)"
                )
            if times.shape != (item_vecs.shape[0],):
                raise ValueError(
                    f"HSTU: times must be [N={item_vecs.shape[0]}], got {tuple(times.shape)}"
                )
            if times.dtype != torch.int64:
                raise TypeError(f"HSTU: times must be int64 seconds, got {times.dtype}")
        if idx.t_max == 0:  # no rows at all (B == 0 or every sequence empty)
            return empty_output(self, item_vecs)
        t = idx.t_max
        pos = idx.positions(cfg.positions, cfg.max_seq_len)  # [T] or [B, T]
        x = idx.pad(item_vecs) * math.sqrt(cfg.dim) + self.pos_emb(pos)  # [B, T, D]
        x = self.drop(x)
        # Query i sees key j iff j <= i and j is a real item (padding queries see the
        # real keys before them; their rows are dropped at the end).
        causal = torch.ones(t, t, dtype=torch.bool, device=dev).tril()  # [T, T]
        allowed = (causal & idx.valid[:, None, :])[:, None]  # [B, 1, T, T]
        slot = torch.arange(t, device=dev)  # [T]: relative positions are either alignment's
        rel_pos = (slot[:, None] - slot[None, :]).clamp(0, cfg.max_seq_len - 1)  # [T, T]: i - j
        buckets = None
        if cfg.time_buckets > 0:
            assert times is not None
            buckets = time_gap_buckets(idx.pad(times.to(dev)), cfg.time_buckets)  # [B, T, T]
        for layer in self.layers:
            x = layer(x, allowed, rel_pos, buckets)  # [B, T, D]
        return idx.unpad(x)  # [N, D]

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())
