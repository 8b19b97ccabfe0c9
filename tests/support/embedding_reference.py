"""An independent reference for embedding collections: one dense torch module per table.

``nn.EmbeddingBag`` (or ``nn.Embedding`` for ``pooling="none"``) per table, each
feature looked up separately (no dedup, no fusion), the dense ``.grad`` from
autograd, and the optimizer from ``torch.optim`` (SGD, Adagrad) or written out by
hand on the rows the batch touched (row-wise Adagrad; lazy Adam with a per-row
step count, which is neither ``torch.optim.Adam`` nor ``SparseAdam``: SparseAdam
counts steps per tensor, not per row). Initial rows come from the table spec's
initializer, as every placement's do.

``Reference(tables, dtype=torch.float64)`` replays the same computation in float64 (same
initial rows, same batches, every tensor in float64): :class:`Replayed` runs both and
derives each comparison's tolerance from the fp32 reference's own rounding error
(``tests/support/tolerance.py``).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import nn

import ps
from embedding import KeyedJaggedIds, TableConfig
from tolerance import REPLAY_FACTOR, replay_tol, sum_tol


class Reference:
    def __init__(self, tables: list[TableConfig], dtype: torch.dtype = torch.float32) -> None:
        self.dtype = dtype
        self.tables = {t.name: t for t in tables}
        self.table_of = {f: t.name for t in tables for f in t.feature_names}
        self.mods: dict[str, nn.Module] = {}
        self.weight: dict[str, torch.Tensor] = {}
        self.acc: dict[str, torch.Tensor] = {}
        self.adam: dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}
        self.torch_opt: dict[str, torch.optim.Optimizer] = {}
        self.out_grads: dict[str, torch.Tensor] = {}  # the last backward's, per feature
        for t in tables:
            assert t.num_rows is not None
            spec = t.to_spec()
            mod: nn.Embedding | nn.EmbeddingBag
            if t.pooling == "none":
                mod = nn.Embedding(t.num_rows, t.dim, dtype=dtype)
            else:
                mod = nn.EmbeddingBag(t.num_rows, t.dim, mode=t.pooling, dtype=dtype)
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
                self.acc[t.name] = torch.full((t.num_rows,), opt.initial_accumulator, dtype=dtype)
            elif isinstance(opt, ps.Adam):
                z = torch.zeros(t.num_rows, t.dim, dtype=dtype)
                self.adam[t.name] = (z.clone(), z.clone(), torch.zeros(t.num_rows, dtype=dtype))
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
            weights = None if j.weights is None else j.weights.to(self.dtype)
            t = self.tables[self.table_of[feat]]
            mod = self.mods[t.name]
            if t.pooling == "none":
                b = j.batch_size
                rows = mod(j.ids)  # [N, D]
                if weights is not None:
                    rows = rows * weights.unsqueeze(1)
                out[feat] = rows.view(b, j.ids.numel() // b if b else 0, t.dim)
            else:
                # bag starts [B]; per-id weights only in sum mode
                out[feat] = mod(j.ids, j.offsets()[:-1], per_sample_weights=weights)
            if out[feat].requires_grad:
                out[feat].register_hook(self._keep(feat))
        self.out_grads = {}
        return out

    def _keep(self, feat: str) -> Callable[[torch.Tensor], None]:
        def keep(g: torch.Tensor) -> None:
            self.out_grads[feat] = g.detach()

        return keep

    def grad_magnitude(self, kjt: KeyedJaggedIds, name: str) -> torch.Tensor:
        """``[rows, D]``: each element's ``sum_i |w_i| |t_i|`` over the occurrences of its
        row in ``kjt`` (``t_i`` the gradient of the output the occurrence pools into,
        ``w_i`` its weight, ``1/len`` for a mean), after the last backward: what bounds
        the rounding of the row's gradient in any order, however its terms cancel."""
        t = self.tables[name]
        out = torch.zeros(t.num_rows or 0, t.dim, dtype=torch.float64)
        for feat in t.feature_names:
            if feat not in kjt or feat not in self.out_grads:
                continue
            j = kjt[feat]
            grads = self.out_grads[feat].to(torch.float64).abs()
            if t.pooling == "none":
                per_id = grads.reshape(-1, t.dim)  # [N, D]
            else:
                lengths = j.offsets()[1:] - j.offsets()[:-1]  # [B]
                per_id = grads.repeat_interleave(lengths, dim=0)  # [N, D]
                if t.pooling == "mean":
                    per_id = per_id / lengths.repeat_interleave(lengths).unsqueeze(1)
            if j.weights is not None:
                per_id = per_id * j.weights.to(torch.float64).abs().unsqueeze(1)
            out.index_add_(0, j.ids, per_id)
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


# At most this many roundings in the update of one element by any optimizer here (Adam:
# m, v, sqrt(v), + eps, the step size, the quotient, its product and the sum).
UPDATE_ROUNDINGS = 8


class Replayed:
    """The reference in float32 (``ref``, what a placement is compared against) and its
    float64 replay (``ref64``), stepped together; the tolerances of a placement's outputs,
    rows and state against ``ref`` come from ``|ref - ref64|`` (:func:`replay_tol`: the
    placement sums the gradients of repeated ids in another order, its optimizer runs
    other kernels, fused multiply-adds or not, and Adam / Adagrad amplify that over the
    steps).

    The measured error of a small table can be small by chance (few elements, and the
    largest errors on the smallest values), so each tolerance is also never below the
    worst case of the last step alone (``floor_terms`` of :func:`replay_tol`): a row's
    gradient sums up to ``occ`` terms (the most occurrences of one id in a batch), and
    the update rounds at most :data:`UPDATE_ROUNDINGS` more times; an accumulator of
    squares doubles the gradient's relative error and adds a mean over ``dim``.

    Adam's step ``size * m / (sqrt(v) + eps)`` turns the absolute error ``d`` of a
    gradient near zero (a row whose occurrences nearly cancel) into one far above the
    replay's own: ``m`` (a weighted mean) and ``sqrt(v)`` (a weighted norm) each move by
    at most ``d`` and ``|m| <= sqrt(v) + eps``, so the step moves by at most ``2 size d /
    (sqrt(v) - d + eps)`` (the bound of
    :class:`tolerance.AdamDrift`, per element: ``2 lr d / eps`` where ``v`` is 0, nothing
    to speak of where the gradients are large). An Adam table's rows add that drift,
    summed over the steps, with ``d`` each step's gradient replay tolerance (the
    reference's measured ``|g - g64|``, times :data:`tolerance.REPLAY_FACTOR`)."""

    def __init__(self, tables: list[TableConfig]) -> None:
        self.ref = Reference(tables)
        self.ref64 = Reference(tables, dtype=torch.float64)
        self.occ = {t.name: 0 for t in tables}
        self.steps = 0  # optimizer steps taken
        # Adam tables: the drift bound of each element so far, [rows, dim]
        self.drift = {
            t.name: torch.zeros(t.num_rows or 0, t.dim, dtype=torch.float64)
            for t in tables
            if isinstance(t.optimizer, ps.Adam)
        }
        # Row-wise Adagrad tables: how far a run's accumulators may be from the reference's
        # because each step's gradient is only within d of it, [rows]
        self.acc_drift = {
            t.name: torch.zeros(t.num_rows or 0, dtype=torch.float64)
            for t in tables
            if isinstance(t.optimizer, ps.RowWiseAdagrad)
        }
        # ... and their rows, [rows, dim]
        self.rows_drift = {
            name: torch.zeros(len(acc), self.ref64.tables[name].dim, dtype=torch.float64)
            for name, acc in self.acc_drift.items()
        }

    def forward(
        self, kjt: KeyedJaggedIds
    ) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        return self.ref.forward(kjt), self.ref64.forward(kjt)

    def step(self, kjt: KeyedJaggedIds) -> None:
        for name, t in self.ref.tables.items():
            ids = [kjt[f].ids for f in t.feature_names if f in kjt]
            if ids and sum(i.numel() for i in ids):
                counts = torch.unique(torch.cat(ids), return_counts=True)[1]
                self.occ[name] = max(self.occ[name], int(counts.max()))
        self.steps += 1
        grad_tol = {}  # the Adam tables' gradient tolerance of this step
        for name in self.drift:
            g, g64 = self.ref.weight[name].grad, self.ref64.weight[name].grad
            if g is not None and g64 is not None:
                measured = REPLAY_FACTOR * float((g.double() - g64.double()).abs().max())
                # never below the bound of any order of addition (terms may cancel)
                mags = self.ref64.grad_magnitude(kjt, name)
                most = float(mags.max()) if mags.numel() else 0.0
                grad_tol[name] = max(measured, sum_tol(torch.float32, self.occ[name] + 2, most))
        d_acc: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}  # |g|, d per element
        for name, acc_drift in self.acc_drift.items():
            # A gradient whose terms nearly cancel (the same id twice in a bag with
            # weights of opposite sign) is only within d = sum_tol(its terms' magnitudes)
            # of the reference's in another order of addition, however small the
            # reference's own error was by chance; mean(g^2) then moves by at most
            # 2 |g| d + d^2 per element.
            g64 = self.ref64.weight[name].grad
            if g64 is None:
                continue
            d = sum_tol(torch.float32, self.occ[name] + 2, 1.0) * self.ref64.grad_magnitude(
                kjt, name
            )  # [rows, D]
            acc_drift += (2 * g64.detach().abs() * d + d * d).max(dim=1).values
            d_acc[name] = (g64.detach().abs(), d)
        self.ref.step(kjt)
        self.ref64.step(kjt)
        for name, (g_abs, d) in d_acc.items():
            # The row moves by lr g / (s + eps), s = sqrt(acc): a run's g within d and its
            # s within sqrt(acc_drift) (|sqrt(a) - sqrt(b)| <= sqrt(|a - b|)) moves it by
            # at most lr (d + |g| ds / (s - ds + eps)) / (s - ds + eps) per element.
            opt = self.ref64.tables[name].optimizer
            assert isinstance(opt, ps.RowWiseAdagrad)
            s_now = self.ref64.acc[name].sqrt().unsqueeze(1)  # [rows, 1]
            ds = self.acc_drift[name].sqrt().unsqueeze(1)
            low = (s_now - ds).clamp(min=0) + opt.eps
            self.rows_drift[name] += opt.lr * (d + g_abs * ds / low) / low  # 0 where untouched
        for name, d in grad_tol.items():
            opt = self.ref64.tables[name].optimizer
            assert isinstance(opt, ps.Adam)
            m, v, steps = self.ref64.adam[name]
            b1, b2 = opt.betas
            k = steps.clamp(min=1).unsqueeze(1)  # [rows, 1] the rows' step counts
            size = opt.lr * torch.sqrt(1 - b2**k) / (1 - b1**k)
            touched = (steps > 0).unsqueeze(1)  # rows never stepped have not moved
            # sqrt(v) is a weighted norm of the gradients: the run under test's is within d
            bound = 2 * size * d / ((v.sqrt() - d).clamp(min=0) + opt.eps)
            self.drift[name] += torch.where(touched, bound, torch.zeros_like(bound))

    def output_tol(
        self, kjt: KeyedJaggedIds, feat: str, want: torch.Tensor, want64: torch.Tensor
    ) -> float:
        """Output ``feat``: the replay's measured error, and never below the worst case of
        one pooling over the reference's current rows (:meth:`pool_tol`); after a step,
        plus what the rows' own tolerance can move a bag (:meth:`rows_effect`): the run
        under test pools its rows, which are only within :meth:`rows_tol` of these."""
        base = max(replay_tol(want.detach(), want64.detach()), self.pool_tol(kjt, feat))
        return base + self.rows_effect(kjt, feat)

    def rows_effect(self, kjt: KeyedJaggedIds, feat: str) -> float:
        """The most a bag of ``feat`` moves when every row moves by ``rows_tol``: the
        largest ``sum_i |w_i|`` of a bag (1 for a mean) times it; 0 before any step."""
        j = kjt[feat]
        name = self.ref64.table_of[feat]
        if j.ids.numel() == 0 or self.steps == 0:
            return 0.0
        t = self.ref64.tables[name]
        weights = (
            torch.ones(j.ids.numel(), dtype=torch.float64)
            if j.weights is None
            else j.weights.to(torch.float64).abs()
        )
        if t.pooling == "none":
            most = float(weights.max())
        else:
            ones = torch.ones(t.num_rows or 0, 1, dtype=torch.float64)
            sums = nn.functional.embedding_bag(
                j.ids, ones, j.offsets()[:-1], mode=t.pooling,
                per_sample_weights=weights if t.pooling == "sum" else None,
            )  # fmt: skip
            most = float(sums.max())
        return most * self.rows_tol(name)

    def pool_tol(self, kjt: KeyedJaggedIds, feat: str) -> float:
        """Two fp32 poolings of ``feat`` over the same rows (one ``embedding_bag`` per
        feature here; a fused bag with ``1/len`` weights in the placements): a sum of up
        to ``n`` products ``w_i * row_i`` per bag, plus the rounding of ``1/len`` and of its
        product with a user weight, so ``n + 2`` roundings, over the largest
        ``sum_i |w_i| |row_i|`` of any bag (in float64)."""
        j = kjt[feat]
        if j.ids.numel() == 0:
            return 0.0
        name = self.ref64.table_of[feat]
        t = self.ref64.tables[name]
        w = self.ref64.weight[name].detach().abs()
        weights = None if j.weights is None else j.weights.to(torch.float64).abs()
        if t.pooling == "none":
            rows = w[j.ids] if weights is None else w[j.ids] * weights.unsqueeze(1)
            return sum_tol(torch.float32, 2, float(rows.max()))
        mags = nn.functional.embedding_bag(
            j.ids, w, j.offsets()[:-1], mode=t.pooling, per_sample_weights=weights
        )
        longest = int((j.offsets()[1:] - j.offsets()[:-1]).max())
        return sum_tol(torch.float32, longest + 2, float(mags.max()))

    def rows_tol(self, name: str) -> float:
        """Table ``name``'s rows."""
        terms = self.occ[name] + UPDATE_ROUNDINGS
        w, w64 = self.ref.weight[name].detach(), self.ref64.weight[name].detach()
        drift = self.drift.get(name, self.rows_drift.get(name))
        extra = float(drift.max()) if drift is not None and drift.numel() else 0.0
        return replay_tol(w, w64, floor_terms=terms) + extra

    def state_tol(self, name: str) -> float:
        """Table ``name``'s optimizer state in the ps layout."""
        s, s64 = self.ref.state(name), self.ref64.state(name)
        assert s is not None and s64 is not None
        terms = 2 * self.occ[name] + self.ref.tables[name].dim + UPDATE_ROUNDINGS
        drift = self.acc_drift.get(name)
        extra = float(drift.max()) if drift is not None and drift.numel() else 0.0
        return replay_tol(s, s64, floor_terms=terms) + extra
