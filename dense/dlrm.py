"""The dense part of DLRM (Naumov et al., 2019) as a plain ``nn.Module``.

Data flow for a batch of ``B`` samples with ``F = num_sparse`` pooled embeddings
of width ``D = embedding_dim``::

    dense [B, num_dense] --bottom MLP--> x [B, D]
    sparse F x [B, D]  ----------------------------.
    stack(x, sparse...)                        -> T [B, F+1, D]
    T @ T^T                                    -> Z [B, F+1, F+1]
    strictly lower triangle of Z               -> P [B, (F+1)F/2]
    cat(x, P)                                  -> [B, D + (F+1)F/2]
    top MLP                                    -> logits [B]

The embeddings themselves live elsewhere (``embedding/``); this module only sees
their pooled ``[B, D]`` outputs, so it imports nothing but torch. Distribution
(data parallelism, ZeRO) wraps it from outside (``dense.data_parallel``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import nn


@dataclass(kw_only=True, slots=True)
class DLRMConfig:
    """Shape of the dense DLRM.

    ``bottom_mlp`` lists the output widths of the bottom MLP's layers; the last must
    equal ``embedding_dim`` so its output can interact with the embeddings.
    ``top_mlp`` lists the top MLP's output widths; the last must be 1 (the logit).
    """

    num_dense: int
    num_sparse: int
    embedding_dim: int
    bottom_mlp: list[int] = field(default_factory=lambda: [64, 16])
    top_mlp: list[int] = field(default_factory=lambda: [64, 1])

    def __post_init__(self) -> None:
        for name in ("num_dense", "num_sparse", "embedding_dim"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"DLRMConfig.{name} must be an int >= 1, got {value!r}")
        for name in ("bottom_mlp", "top_mlp"):
            widths = list(getattr(self, name))
            if not widths or any(not isinstance(w, int) or w < 1 for w in widths):
                raise ValueError(
                    f"DLRMConfig.{name} must be a non-empty list of ints >= 1, got {widths!r}"
                )
            setattr(self, name, widths)
        if self.bottom_mlp[-1] != self.embedding_dim:
            raise ValueError(
                f"DLRMConfig: the bottom MLP's last width ({self.bottom_mlp[-1]}, "
                f"bottom_mlp={self.bottom_mlp}) must equal embedding_dim "
                f"({self.embedding_dim}) so it can interact with the embeddings"
            )
        if self.top_mlp[-1] != 1:
            raise ValueError(
                f"DLRMConfig: the top MLP's last width must be 1 (one logit per sample), "
                f"got {self.top_mlp[-1]} (top_mlp={self.top_mlp})"
            )

    @property
    def num_interactions(self) -> int:
        """Pairs among the bottom output and the F embeddings: ``(F+1)F/2``."""
        n = self.num_sparse + 1
        return n * (n - 1) // 2

    @property
    def top_input_dim(self) -> int:
        return self.embedding_dim + self.num_interactions


def mlp(in_dim: int, widths: Sequence[int], *, last_activation: bool) -> nn.Sequential:
    """Linear layers of the given output widths with ReLU between them.

    Init follows the DLRM reference: weights ~ N(0, sqrt(2 / (fan_in + fan_out))),
    biases ~ N(0, sqrt(1 / fan_out)), which keeps activations of order one.
    """
    layers: list[nn.Module] = []
    prev = in_dim
    for i, width in enumerate(widths):
        linear = nn.Linear(prev, width)
        with torch.no_grad():
            linear.weight.normal_(0.0, math.sqrt(2.0 / (prev + width)))
            linear.bias.normal_(0.0, math.sqrt(1.0 / width))
        layers.append(linear)
        if i < len(widths) - 1 or last_activation:
            layers.append(nn.ReLU())
        prev = width
    return nn.Sequential(*layers)


def pairwise_interaction(features: torch.Tensor) -> torch.Tensor:
    """Dot products of every pair of distinct feature vectors.

    ``features`` is ``[B, N, D]``; the result is ``[B, N(N-1)/2]``, the strictly
    lower triangle of ``features @ features^T`` in row-major order: pairs
    (1,0), (2,0), (2,1), (3,0), ...
    """
    if features.dim() != 3:
        raise ValueError(
            f"pairwise_interaction expects [B, N, D], got shape {tuple(features.shape)}"
        )
    n = features.shape[1]
    z = torch.bmm(features, features.transpose(1, 2))  # [B, N, N]
    rows, cols = torch.tril_indices(n, n, offset=-1, device=features.device)
    return z[:, rows, cols]  # [B, N(N-1)/2]


class DLRMDense(nn.Module):
    """Bottom MLP, pairwise dot interaction and top MLP of DLRM.

    ``forward(dense, sparse)`` takes dense features ``[B, num_dense]`` and the
    pooled embeddings, either a list of ``num_sparse`` tensors ``[B, D]`` or one
    ``[B, num_sparse, D]`` tensor, and returns logits ``[B]``.
    """

    _tril_rows: torch.Tensor
    _tril_cols: torch.Tensor

    def __init__(self, config: DLRMConfig) -> None:
        super().__init__()
        self.config = config
        self.bottom = mlp(config.num_dense, config.bottom_mlp, last_activation=True)
        self.top = mlp(config.top_input_dim, config.top_mlp, last_activation=False)
        n = config.num_sparse + 1
        rows, cols = torch.tril_indices(n, n, offset=-1)
        # Not persistent: derived from the config, identical on every rank.
        self.register_buffer("_tril_rows", rows, persistent=False)
        self.register_buffer("_tril_cols", cols, persistent=False)

    def forward(
        self, dense: torch.Tensor, sparse: Sequence[torch.Tensor] | torch.Tensor
    ) -> torch.Tensor:
        cfg = self.config
        if dense.dim() != 2 or dense.shape[1] != cfg.num_dense:
            raise ValueError(
                f"DLRMDense: dense features must be [B, {cfg.num_dense}], "
                f"got shape {tuple(dense.shape)}"
            )
        batch = dense.shape[0]
        emb = self._stack_sparse(sparse, batch)  # [B, F, D]
        x = self.bottom(dense)  # [B, D]
        t = torch.cat([x.unsqueeze(1), emb], dim=1)  # [B, F+1, D]
        z = torch.bmm(t, t.transpose(1, 2))  # [B, F+1, F+1]
        pairs = z[:, self._tril_rows, self._tril_cols]  # [B, (F+1)F/2]
        top_in = torch.cat([x, pairs], dim=1)  # [B, D + (F+1)F/2]
        return self.top(top_in).squeeze(1)  # [B]

    def _stack_sparse(
        self, sparse: Sequence[torch.Tensor] | torch.Tensor, batch: int
    ) -> torch.Tensor:
        cfg = self.config
        want = (batch, cfg.num_sparse, cfg.embedding_dim)
        if isinstance(sparse, torch.Tensor):
            if tuple(sparse.shape) != want:
                raise ValueError(
                    f"DLRMDense: sparse must be [B, num_sparse, D] = {list(want)}, "
                    f"got shape {tuple(sparse.shape)}"
                )
            return sparse
        parts = list(sparse)
        if len(parts) != cfg.num_sparse:
            raise ValueError(
                f"DLRMDense: expected {cfg.num_sparse} pooled embeddings, got {len(parts)}"
            )
        for i, p in enumerate(parts):
            if tuple(p.shape) != (batch, cfg.embedding_dim):
                raise ValueError(
                    f"DLRMDense: pooled embedding {i} must be [B, D] = "
                    f"[{batch}, {cfg.embedding_dim}], got shape {tuple(p.shape)}"
                )
        return torch.stack(parts, dim=1)  # [B, F, D]
