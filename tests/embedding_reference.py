"""An independent reference for embedding collections: one dense torch module per table.

``nn.EmbeddingBag`` (or ``nn.Embedding`` for ``pooling="none"``) per table, each
feature looked up separately (no dedup, no fusion), the dense ``.grad`` from
autograd, and the optimizer from ``torch.optim`` (SGD, Adagrad) or written out by
hand on the rows the batch touched (row-wise Adagrad; lazy Adam with a per-row
step count, which is neither ``torch.optim.Adam`` nor ``SparseAdam``: SparseAdam
counts steps per tensor, not per row). Initial rows come from the table spec's
initializer, as every placement's do.
"""

from __future__ import annotations

import math

import torch
from torch import nn

import ps
from embedding import KeyedJaggedIds, TableConfig


class Reference:
    def __init__(self, tables: list[TableConfig]) -> None:
        self.tables = {t.name: t for t in tables}
        self.table_of = {f: t.name for t in tables for f in t.feature_names}
        self.mods: dict[str, nn.Module] = {}
        self.weight: dict[str, torch.Tensor] = {}
        self.acc: dict[str, torch.Tensor] = {}
        self.adam: dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}
        self.torch_opt: dict[str, torch.optim.Optimizer] = {}
        for t in tables:
            assert t.num_rows is not None
            spec = t.to_spec()
            mod: nn.Embedding | nn.EmbeddingBag
            if t.pooling == "none":
                mod = nn.Embedding(t.num_rows, t.dim)
            else:
                mod = nn.EmbeddingBag(t.num_rows, t.dim, mode=t.pooling)
            w: torch.Tensor = mod.weight
            with torch.no_grad():
                w.copy_(spec.initial_rows(torch.arange(t.num_rows)))
            self.mods[t.name] = mod
            self.weight[t.name] = w
            opt = t.optimizer
            if isinstance(opt, ps.SGD):
                assert opt.momentum == 0
                self.torch_opt[t.name] = torch.optim.SGD([w], lr=opt.lr)
            elif isinstance(opt, ps.Adagrad):
                self.torch_opt[t.name] = torch.optim.Adagrad(
                    [w], lr=opt.lr, eps=opt.eps, initial_accumulator_value=opt.initial_accumulator
                )
            elif isinstance(opt, ps.RowWiseAdagrad):
                self.acc[t.name] = torch.full((t.num_rows,), opt.initial_accumulator)
            elif isinstance(opt, ps.Adam):
                z = torch.zeros(t.num_rows, t.dim)
                self.adam[t.name] = (z.clone(), z.clone(), torch.zeros(t.num_rows))
            else:
                raise AssertionError(f"no reference for {opt}")

    def state(self, name: str) -> torch.Tensor | None:
        """The optimizer state in the ps layout ``[rows, S]`` (None for torch.optim ones)."""
        if name in self.acc:
            return self.acc[name].unsqueeze(1)
        if name in self.adam:
            m, v, steps = self.adam[name]
            return torch.cat([m, v, steps.unsqueeze(1)], dim=1)
        return None

    def forward(self, kjt: KeyedJaggedIds) -> dict[str, torch.Tensor]:
        out = {}
        for feat in kjt.keys:
            j = kjt[feat]
            t = self.tables[self.table_of[feat]]
            mod = self.mods[t.name]
            if t.pooling == "none":
                b = j.batch_size
                rows = mod(j.ids)  # [N, D]
                if j.weights is not None:
                    rows = rows * j.weights.unsqueeze(1)
                out[feat] = rows.view(b, j.ids.numel() // b if b else 0, t.dim)
            else:
                # bag starts [B]; per-id weights only in sum mode
                out[feat] = mod(j.ids, j.offsets()[:-1], per_sample_weights=j.weights)
        return out

    def step(self, kjt: KeyedJaggedIds) -> None:
        for name, t in self.tables.items():
            w = self.weight[name]
            feats = [f for f in t.feature_names if f in kjt]
            if name in self.torch_opt:
                if w.grad is not None:
                    self.torch_opt[name].step()
                self.torch_opt[name].zero_grad()
                continue
            if not feats:
                w.grad = None
                continue
            touched = torch.unique(torch.cat([kjt[f].ids for f in feats]))
            grad = torch.zeros_like(w) if w.grad is None else w.grad
            g = grad[touched]  # [U, D]
            opt = t.optimizer
            with torch.no_grad():
                if isinstance(opt, ps.RowWiseAdagrad):
                    acc = self.acc[name]
                    acc[touched] += (g * g).mean(dim=1)
                    w[touched] -= opt.lr * g / (acc[touched].sqrt() + opt.eps).unsqueeze(1)
                else:
                    assert isinstance(opt, ps.Adam) and opt.weight_decay == 0
                    m, v, steps = self.adam[name]
                    b1, b2 = opt.betas
                    steps[touched] += 1
                    m[touched] = b1 * m[touched] + (1 - b1) * g
                    v[touched] = b2 * v[touched] + (1 - b2) * g * g
                    for row in touched.tolist():
                        k = float(steps[row])
                        size = opt.lr * math.sqrt(1 - b2**k) / (1 - b1**k)
                        w[row] -= size * m[row] / (v[row].sqrt() + opt.eps)
            w.grad = None
