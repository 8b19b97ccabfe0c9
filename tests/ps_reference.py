"""Independent references for the PS optimizers, for tests of any store.

``reference(optimizer, w0, pushes)`` replays pushes (``ids`` int64 ``[N]``,
``grads`` float32 ``[N, D]``, duplicates summed) on a dense copy ``w0``
``[R, D]`` of a table and returns ``(rows [R, D], state [R, S])`` float64 in the
store's state layout (see ``ps.optimizers``). Each optimizer is checked against
something that does not share our code:

* SGD: ``torch.optim.SGD`` on the dense copy (a zero gradient leaves plain SGD
  rows unchanged); with momentum, one ``torch.optim.SGD`` per row stepped only
  when its row is touched (lazy: dense torch SGD would keep moving untouched
  rows by their decaying momentum buffer);
* Adagrad: ``torch.optim.Adagrad`` on the dense copy (zero gradients change nothing);
* Adam: one ``torch.optim.SparseAdam`` per row (per-row step counts), stepped
  with a sparse gradient when the row is touched; with weight decay the
  published rule written out in Python floats;
* row-wise Adagrad and FTRL-proximal: the published rules in plain Python floats.
"""

from __future__ import annotations

import math
from collections import defaultdict

import torch

import ps

Push = tuple[torch.Tensor, torch.Tensor]


def summed(push: Push) -> dict[int, list[float]]:
    """``{id: summed gradient}`` of one push, in plain floats (ids in first-seen order)."""
    ids, grads = push
    out: dict[int, list[float]] = defaultdict(lambda: [0.0] * grads.shape[1])
    for i, g in zip(ids.tolist(), grads.double().tolist(), strict=True):
        out[i] = [a + b for a, b in zip(out[i], g, strict=True)]
    return dict(out)


def _dense_grad(push: Push, shape: torch.Size) -> torch.Tensor:
    ids, grads = push
    return torch.zeros(shape, dtype=torch.float64).index_add_(0, ids, grads.double())


def reference(
    opt: ps.Optimizer, w0: torch.Tensor, pushes: list[Push]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows and optimizer state after ``pushes``; see the module docstring."""
    rows, dim = w0.shape
    if isinstance(opt, ps.SGD) and opt.momentum == 0:
        w = torch.nn.Parameter(w0.double().clone())
        sgd = torch.optim.SGD([w], lr=opt.lr)
        for p in pushes:
            w.grad = _dense_grad(p, w.shape)
            sgd.step()
        return w.detach(), torch.zeros(rows, 0, dtype=torch.float64)
    if isinstance(opt, ps.SGD):
        params = [torch.nn.Parameter(w0[r].double().clone()) for r in range(rows)]
        opts = [torch.optim.SGD([p], lr=opt.lr, momentum=opt.momentum) for p in params]
        for p in pushes:
            for r, g in summed(p).items():
                params[r].grad = torch.tensor(g, dtype=torch.float64)
                opts[r].step()
        state = torch.zeros(rows, dim, dtype=torch.float64)
        for r, (p, o) in enumerate(zip(params, opts, strict=True)):
            if p in o.state:
                state[r] = o.state[p]["momentum_buffer"]
        return torch.stack([p.detach() for p in params]), state
    if isinstance(opt, ps.Adagrad):
        w = torch.nn.Parameter(w0.double().clone())
        ada = torch.optim.Adagrad(
            [w], lr=opt.lr, eps=opt.eps, initial_accumulator_value=opt.initial_accumulator
        )
        for p in pushes:
            w.grad = _dense_grad(p, w.shape)
            ada.step()
        return w.detach(), ada.state[w]["sum"].detach().clone()
    if isinstance(opt, ps.Adam) and opt.weight_decay == 0:
        return _sparse_adam(opt, w0, pushes)
    if isinstance(opt, ps.Adam):
        return _adam_by_hand(opt, w0, pushes)
    if isinstance(opt, ps.RowWiseAdagrad):
        return _rowwise_by_hand(opt, w0, pushes)
    if isinstance(opt, ps.FTRL):
        return _ftrl_by_hand(opt, w0, pushes)
    raise NotImplementedError(type(opt).__name__)


def _sparse_adam(opt: ps.Adam, w0: torch.Tensor, pushes: list[Push]) -> tuple[torch.Tensor, ...]:
    rows, dim = w0.shape
    params = [torch.nn.Parameter(w0[r : r + 1].double().clone()) for r in range(rows)]
    opts = [torch.optim.SparseAdam([p], lr=opt.lr, betas=opt.betas, eps=opt.eps) for p in params]
    for p in pushes:
        for r, g in summed(p).items():
            values = torch.tensor([g], dtype=torch.float64)  # [1, D]
            index = torch.zeros(1, 1, dtype=torch.int64)
            params[r].grad = torch.sparse_coo_tensor(index, values, (1, dim), check_invariants=True)
            opts[r].step()
    state = torch.zeros(rows, 2 * dim + 1, dtype=torch.float64)
    for r, (p, o) in enumerate(zip(params, opts, strict=True)):
        if p in o.state:
            s = o.state[p]
            state[r, :dim] = s["exp_avg"][0]
            state[r, dim : 2 * dim] = s["exp_avg_sq"][0]
            state[r, 2 * dim] = float(s["step"])
    return torch.cat([p.detach() for p in params]), state


def _adam_by_hand(opt: ps.Adam, w0: torch.Tensor, pushes: list[Push]) -> tuple[torch.Tensor, ...]:
    rows, dim = w0.shape
    b1, b2 = opt.betas
    w = w0.double().tolist()
    m = [[0.0] * dim for _ in range(rows)]
    v = [[0.0] * dim for _ in range(rows)]
    t = [0] * rows
    for p in pushes:
        for r, g in summed(p).items():
            t[r] += 1
            size = opt.lr * math.sqrt(1 - b2 ** t[r]) / (1 - b1 ** t[r])
            for j in range(dim):
                gj = g[j] + opt.weight_decay * w[r][j]
                m[r][j] = b1 * m[r][j] + (1 - b1) * gj
                v[r][j] = b2 * v[r][j] + (1 - b2) * gj * gj
                w[r][j] -= size * m[r][j] / (math.sqrt(v[r][j]) + opt.eps)
    state = [m[r] + v[r] + [float(t[r])] for r in range(rows)]
    return torch.tensor(w, dtype=torch.float64), torch.tensor(state, dtype=torch.float64)


def _rowwise_by_hand(
    opt: ps.RowWiseAdagrad, w0: torch.Tensor, pushes: list[Push]
) -> tuple[torch.Tensor, ...]:
    rows, dim = w0.shape
    w = w0.double().tolist()
    s = [float(opt.initial_accumulator)] * rows
    for p in pushes:
        for r, g in summed(p).items():
            s[r] += sum(x * x for x in g) / dim
            for j in range(dim):
                w[r][j] -= opt.lr * g[j] / (math.sqrt(s[r]) + opt.eps)
    return torch.tensor(w, dtype=torch.float64), torch.tensor(s, dtype=torch.float64)[:, None]


def _ftrl_by_hand(opt: ps.FTRL, w0: torch.Tensor, pushes: list[Push]) -> tuple[torch.Tensor, ...]:
    """McMahan et al. 2013, Algorithm 1 (per coordinate), the row value as w_t."""
    rows, dim = w0.shape
    w = w0.double().tolist()
    z = [[0.0] * dim for _ in range(rows)]
    n = [[0.0] * dim for _ in range(rows)]
    for p in pushes:
        for r, g in summed(p).items():
            for i in range(dim):
                sigma = (math.sqrt(n[r][i] + g[i] * g[i]) - math.sqrt(n[r][i])) / opt.alpha
                z[r][i] += g[i] - sigma * w[r][i]
                n[r][i] += g[i] * g[i]
                if abs(z[r][i]) <= opt.l1:
                    w[r][i] = 0.0
                else:
                    sign = 1.0 if z[r][i] > 0 else -1.0
                    w[r][i] = -(z[r][i] - sign * opt.l1) / (
                        (opt.beta + math.sqrt(n[r][i])) / opt.alpha + opt.l2
                    )
    state = [z[r] + n[r] for r in range(rows)]
    return torch.tensor(w, dtype=torch.float64), torch.tensor(state, dtype=torch.float64)


def assert_matches_reference(
    store: ps.Store,
    table: str,
    key: torch.Tensor,
    opt: ps.Optimizer,
    w0: torch.Tensor,
    pushes: list[Push],
    rows: int,
) -> None:
    """``store``'s rows ``key`` after ``pushes`` equal :func:`reference` (rows 1e-6; state
    1e-6 relative, since e.g. FTRL's z or Adagrad's sums grow past 1), clocks count the
    pushes touching each row, and rows never pushed (``>= 10`` here) never moved (lazy)."""
    want_rows, want_state = reference(opt, w0, pushes)
    got = store.pull(table, key)
    torch.testing.assert_close(got.rows.double(), want_rows, rtol=0, atol=1e-6)
    torch.testing.assert_close(store.state(table, key).double(), want_state, rtol=1e-6, atol=1e-6)
    touched = torch.zeros(rows, dtype=torch.int64)
    for ids, _ in pushes:
        touched[torch.unique(ids)] += 1
    assert got.clocks.tolist() == touched.tolist()
    assert torch.equal(got.rows[10:], w0[10:])  # lazy: untouched rows never move
