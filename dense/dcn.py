"""The low-rank cross network of DCN-v2 (Wang et al., 2021), the feature interaction
of MLPerf's current DLRM benchmark (DLRM-DCNv2).

For an input ``x0 [B, W]`` (the bottom MLP's output and the pooled embeddings,
concatenated), layer ``l`` computes::

    x_{l+1} = x0 * (U_l (V_l^T x_l) + b_l) + x_l        U_l, V_l [W, r], b_l [W]

so each layer multiplies every feature by a learned low-rank (rank ``r``) linear
function of all of them: explicit crosses of bounded degree (``L`` layers give
degree ``L + 1``) at ``2 W r`` weights a layer instead of the full-rank ``W^2``.
The output keeps the width ``W`` and goes to the top MLP.
"""

from __future__ import annotations

import math
from typing import cast

import torch
from torch import nn


class CrossLayer(nn.Module):
    """One low-rank cross layer: ``x0 * (U (V^T x) + b) + x``, shapes ``[B, W]``.

    ``V`` is the ``down`` projection ``W -> r`` (no bias), ``U`` the ``up`` projection
    ``r -> W`` with the bias ``b``. Init: Xavier-normal weights for both projections,
    zero bias, so a fresh layer starts near the identity plus a small cross term.
    """

    def __init__(self, width: int, rank: int) -> None:
        super().__init__()
        self.down = nn.Linear(width, rank, bias=False)  # V^T: [r, W]
        self.up = nn.Linear(rank, width)  # U: [W, r], b: [W]
        with torch.no_grad():
            self.down.weight.normal_(0.0, math.sqrt(2.0 / (width + rank)))
            self.up.weight.normal_(0.0, math.sqrt(2.0 / (width + rank)))
            self.up.bias.zero_()

    def forward(self, x0: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return x0 * self.up(self.down(x)) + x  # [B, W]


class CrossNetwork(nn.Module):
    """``num_layers`` :class:`CrossLayer` s of rank ``rank`` on inputs ``[B, width]``."""

    def __init__(self, width: int, num_layers: int, rank: int) -> None:
        super().__init__()
        for name, value in (("width", width), ("num_layers", num_layers), ("rank", rank)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"CrossNetwork: {name} must be an int >= 1, got {value!r}")
        self.width = width
        self.layers = nn.ModuleList(CrossLayer(width, rank) for _ in range(num_layers))

    def forward(self, x0: torch.Tensor) -> torch.Tensor:
        if x0.dim() != 2 or x0.shape[1] != self.width:
            raise ValueError(
                f"CrossNetwork: input must be [B, {self.width}], got shape {tuple(x0.shape)}"
            )
        x = x0
        for layer in self.layers:
            x = layer(x0, x)
        return x  # [B, width]

    @property
    def cross_layers(self) -> list[CrossLayer]:
        return [cast(CrossLayer, layer) for layer in self.layers]
