"""Independent references for the PS optimizers, for tests of any store.

``reference(optimizer, w0, pushes)`` replays pushes (``ids`` int64 ``[N]``,
``grads`` float32 ``[N, D]``, duplicates summed) on a dense copy ``w0``
``[R, D]`` of a table and returns ``(rows [R, D], state [R, S])`` float64 in the
store's state layout (see ``ps.optimizers``); ``dtype=torch.float32`` runs the same
computation with every tensor in float32. Each optimizer is checked against
something that does not share our code:

* SGD: ``torch.optim.SGD`` on the dense copy (a zero gradient leaves plain SGD
  rows unchanged); with momentum, one ``torch.optim.SGD`` per row stepped only
  when its row is touched (lazy: dense torch SGD would keep moving untouched
  rows by their decaying momentum buffer);
* Adagrad: ``torch.optim.Adagrad`` on the dense copy (zero gradients change nothing);
* Adam: one ``torch.optim.SparseAdam`` per row (per-row step counts), stepped
  with a sparse gradient when the row is touched; with weight decay the
  published rule written out element-wise;
* row-wise Adagrad and FTRL-proximal: the published rules written out element-wise.

Tolerances (``tests/support/tolerance.py``): a store runs in float32 with its own kernels (fused
multiply-adds or not, duplicates summed in another order), and Adam / Adagrad / FTRL
amplify a rounding difference over the pushes, so :class:`Replay` runs the reference in
float32 and in float64 and derives every tolerance from the float32 run's own rounding
error (:func:`tolerance.replay_tol`). :class:`RecordingStore` is an in-process store that
remembers its pushes, to give the tolerance of another store compared with it.
"""

from __future__ import annotations

import math
from collections import defaultdict
from typing import Any

import torch

import ps
from comm import Handle

# pytest's test modules import this module by its bare name (tests/ is on sys.path), rank
# scripts as ``tests.support.ps_reference`` (the repository root is).
try:
    from tolerance import assert_close, assert_same, replay_tol
except ModuleNotFoundError:
    from tests.support.tolerance import assert_close, assert_same, replay_tol

Push = tuple[torch.Tensor, torch.Tensor]


def summed(push: Push, dtype: torch.dtype = torch.float64) -> dict[int, torch.Tensor]:
    """``{id: summed gradient [D]}`` of one push, summed in ``dtype`` (ids in first-seen
    order)."""
    ids, grads = push
    out: dict[int, torch.Tensor] = defaultdict(lambda: torch.zeros(grads.shape[1], dtype=dtype))
    for i, g in zip(ids.tolist(), grads.to(dtype), strict=True):
        out[i] = out[i] + g
    return dict(out)


def _dense_grad(push: Push, shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
    ids, grads = push
    return torch.zeros(shape, dtype=dtype).index_add_(0, ids, grads.to(dtype))


def reference(
    opt: ps.Optimizer, w0: torch.Tensor, pushes: list[Push], dtype: torch.dtype = torch.float64
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows and optimizer state after ``pushes``, computed in ``dtype``; see the module
    docstring."""
    rows, dim = w0.shape
    if isinstance(opt, ps.SGD) and opt.momentum == 0:
        w = torch.nn.Parameter(w0.to(dtype).clone())
        sgd = torch.optim.SGD([w], lr=opt.lr)
        for p in pushes:
            w.grad = _dense_grad(p, w.shape, dtype)
            sgd.step()
        return w.detach(), torch.zeros(rows, 0, dtype=dtype)
    if isinstance(opt, ps.SGD):
        params = [torch.nn.Parameter(w0[r].to(dtype).clone()) for r in range(rows)]
        opts = [torch.optim.SGD([p], lr=opt.lr, momentum=opt.momentum) for p in params]
        for p in pushes:
            for r, g in summed(p, dtype).items():
                params[r].grad = g
                opts[r].step()
        state = torch.zeros(rows, dim, dtype=dtype)
        for r, (p, o) in enumerate(zip(params, opts, strict=True)):
            if p in o.state:
                state[r] = o.state[p]["momentum_buffer"]
        return torch.stack([p.detach() for p in params]), state
    if isinstance(opt, ps.Adagrad):
        w = torch.nn.Parameter(w0.to(dtype).clone())
        ada = torch.optim.Adagrad(
            [w], lr=opt.lr, eps=opt.eps, initial_accumulator_value=opt.initial_accumulator
        )
        for p in pushes:
            w.grad = _dense_grad(p, w.shape, dtype)
            ada.step()
        return w.detach(), ada.state[w]["sum"].detach().clone()
    if isinstance(opt, ps.Adam) and opt.weight_decay == 0:
        return _sparse_adam(opt, w0, pushes, dtype)
    if isinstance(opt, ps.Adam):
        return _adam_by_hand(opt, w0, pushes, dtype)
    if isinstance(opt, ps.RowWiseAdagrad):
        return _rowwise_by_hand(opt, w0, pushes, dtype)
    if isinstance(opt, ps.FTRL):
        return _ftrl_by_hand(opt, w0, pushes, dtype)
    raise NotImplementedError(type(opt).__name__)


def _sparse_adam(
    opt: ps.Adam, w0: torch.Tensor, pushes: list[Push], dtype: torch.dtype
) -> tuple[torch.Tensor, ...]:
    rows, dim = w0.shape
    params = [torch.nn.Parameter(w0[r : r + 1].to(dtype).clone()) for r in range(rows)]
    opts = [torch.optim.SparseAdam([p], lr=opt.lr, betas=opt.betas, eps=opt.eps) for p in params]
    for p in pushes:
        for r, g in summed(p, dtype).items():
            values = g.unsqueeze(0)  # [1, D]
            index = torch.zeros(1, 1, dtype=torch.int64)
            params[r].grad = torch.sparse_coo_tensor(index, values, (1, dim), check_invariants=True)
            opts[r].step()
    state = torch.zeros(rows, 2 * dim + 1, dtype=dtype)
    for r, (p, o) in enumerate(zip(params, opts, strict=True)):
        if p in o.state:
            s = o.state[p]
            state[r, :dim] = s["exp_avg"][0]
            state[r, dim : 2 * dim] = s["exp_avg_sq"][0]
            state[r, 2 * dim] = float(s["step"])
    return torch.cat([p.detach() for p in params]), state


def _adam_by_hand(
    opt: ps.Adam, w0: torch.Tensor, pushes: list[Push], dtype: torch.dtype
) -> tuple[torch.Tensor, ...]:
    rows, dim = w0.shape
    b1, b2 = opt.betas
    w = w0.to(dtype).clone()
    m = torch.zeros(rows, dim, dtype=dtype)
    v = torch.zeros(rows, dim, dtype=dtype)
    t = [0] * rows
    for p in pushes:
        for r, g in summed(p, dtype).items():
            t[r] += 1
            size = opt.lr * math.sqrt(1 - b2 ** t[r]) / (1 - b1 ** t[r])
            gj = g + opt.weight_decay * w[r]
            m[r] = b1 * m[r] + (1 - b1) * gj
            v[r] = b2 * v[r] + (1 - b2) * gj * gj
            w[r] = w[r] - size * m[r] / (v[r].sqrt() + opt.eps)
    steps = torch.tensor(t, dtype=dtype)[:, None]
    return w, torch.cat([m, v, steps], dim=1)


def _rowwise_by_hand(
    opt: ps.RowWiseAdagrad, w0: torch.Tensor, pushes: list[Push], dtype: torch.dtype
) -> tuple[torch.Tensor, ...]:
    rows, dim = w0.shape
    w = w0.to(dtype).clone()
    s = torch.full((rows,), float(opt.initial_accumulator), dtype=dtype)
    for p in pushes:
        for r, g in summed(p, dtype).items():
            s[r] = s[r] + (g * g).sum() / dim
            w[r] = w[r] - opt.lr * g / (s[r].sqrt() + opt.eps)
    return w, s[:, None]


def _ftrl_by_hand(
    opt: ps.FTRL, w0: torch.Tensor, pushes: list[Push], dtype: torch.dtype
) -> tuple[torch.Tensor, ...]:
    """McMahan et al. 2013, Algorithm 1 (per coordinate), the row value as w_t."""
    rows, dim = w0.shape
    w = w0.to(dtype).clone()
    z = torch.zeros(rows, dim, dtype=dtype)
    n = torch.zeros(rows, dim, dtype=dtype)
    for p in pushes:
        for r, g in summed(p, dtype).items():
            sigma = ((n[r] + g * g).sqrt() - n[r].sqrt()) / opt.alpha
            z[r] = z[r] + (g - sigma * w[r])
            n[r] = n[r] + g * g
            shrunk = z[r] - torch.sign(z[r]) * opt.l1
            new = -shrunk / ((opt.beta + n[r].sqrt()) / opt.alpha + opt.l2)
            w[r] = torch.where(z[r].abs() <= opt.l1, torch.zeros_like(new), new)
    return w, torch.cat([z, n], dim=1)


# At most this many roundings in the update of one element by any optimizer here after
# its gradient is summed (FTRL's: sigma two square roots, a sum, a difference and a
# quotient; z a product and two sums; n a product and a sum; w a square root, a sum, two
# quotients, a product and two sums).
UPDATE_ROUNDINGS = 16


def state_blocks(opt: ps.Optimizer, dim: int) -> list[tuple[str, slice]]:
    """The named column blocks of ``opt``'s state ``[R, S]`` (compared one by one: their
    magnitudes differ, e.g. Adam's ``m`` and ``v``)."""
    if isinstance(opt, ps.Adam):
        return [("m", slice(0, dim)), ("v", slice(dim, 2 * dim)), ("steps", slice(2 * dim, None))]
    if isinstance(opt, ps.FTRL):
        return [("z", slice(0, dim)), ("n", slice(dim, None))]
    return [("state", slice(0, None))]


class Replay:
    """:func:`reference` of ``pushes`` in float32 (``rows32``, ``state32``: what a store
    is compared with) and in float64, and the tolerances of a float32 store against it
    (:func:`tolerance.replay_tol`).

    The measured error can be small by chance (few rows, the largest errors on the
    smallest values), so no tolerance is below the worst case of the last push alone
    (``floor_terms``): a row's gradient sums up to ``occ`` terms (the most occurrences of
    one id in a push), a square doubles that relative error, and the update rounds at
    most :data:`UPDATE_ROUNDINGS` more times; row-wise Adagrad's accumulator adds a mean
    over ``dim`` squares."""

    def __init__(self, opt: ps.Optimizer, w0: torch.Tensor, pushes: list[Push]) -> None:
        dim = w0.shape[1]
        self.opt = opt
        self.rows32, self.state32 = reference(opt, w0, pushes, torch.float32)
        self.rows64, self.state64 = reference(opt, w0, pushes, torch.float64)
        occ = max(
            (int(ids.unique(return_counts=True)[1].max()) for ids, _ in pushes if ids.numel()),
            default=1,
        )
        self.floor_terms = (
            2 * occ + UPDATE_ROUNDINGS + (dim if isinstance(opt, ps.RowWiseAdagrad) else 0)
        )
        self.blocks = state_blocks(opt, dim)

    def rows_tol(self, index: torch.Tensor | None = None) -> float:
        """The tolerance of a store's rows (reference rows ``index``) against ``rows32``."""
        sel = slice(None) if index is None else index
        return replay_tol(self.rows32[sel], self.rows64[sel], floor_terms=self.floor_terms)

    def assert_rows(
        self,
        got: torch.Tensor,
        what: str,
        want: torch.Tensor | None = None,
        index: torch.Tensor | None = None,
    ) -> None:
        """``got`` (a store's rows ``index`` of the reference) within :meth:`rows_tol` of
        ``want`` (default: the float32 reference's)."""
        sel = slice(None) if index is None else index
        assert_close(
            got,
            self.rows32[sel] if want is None else want,
            atol=self.rows_tol(index),
            what=f"{what} rows",
            why=WHY,
        )

    def assert_state(
        self,
        got: torch.Tensor,
        what: str,
        want: torch.Tensor | None = None,
        index: torch.Tensor | None = None,
    ) -> None:
        """Each block of ``got`` (state ``[N, S]``) within its tolerance of ``want``'s;
        Adam's step counts exactly (small integers, exact in float32)."""
        sel = slice(None) if index is None else index
        want = self.state32[sel] if want is None else want
        assert got.shape == want.shape, (what, tuple(got.shape), tuple(want.shape))
        for name, cols in self.blocks:
            if name == "steps":
                assert_same(
                    got[:, cols].float(),
                    want[:, cols].float(),
                    what=f"{what} {name}",
                    why="integer step counts, exact in float32",
                )
                continue
            tol = replay_tol(
                self.state32[sel][:, cols], self.state64[sel][:, cols], floor_terms=self.floor_terms
            )
            assert_close(got[:, cols], want[:, cols], atol=tol, what=f"{what} {name}", why=WHY)


WHY = (
    "4 x the float32 reference's distance to its float64 replay: the store sums duplicates "
    "in another order and its kernels may fuse multiply-adds"
)


def assert_matches_reference(
    store: ps.Store,
    table: str,
    key: torch.Tensor,
    opt: ps.Optimizer,
    w0: torch.Tensor,
    pushes: list[Push],
    rows: int,
) -> None:
    """``store``'s rows ``key`` after ``pushes`` equal :func:`reference` within the
    tolerances of :class:`Replay`, clocks count the pushes touching each row, and rows
    never pushed (``>= 10`` here) never moved (lazy)."""
    replay = Replay(opt, w0, pushes)
    got = store.pull(table, key)
    replay.assert_rows(got.rows, table)
    replay.assert_state(store.state(table, key), table)
    touched = torch.zeros(rows, dtype=torch.int64)
    for ids, _ in pushes:
        touched[torch.unique(ids)] += 1
    assert got.clocks.tolist() == touched.tolist()
    assert_same(
        got.rows[10:],
        w0[10:],
        what="untouched rows",
        why="lazy: rows never pushed keep their initial bits",
    )


class RecordingStore(ps.InProcessStore):
    """The in-process store, remembering every push it applied (rows with a non-finite
    gradient left out, as ``nan_policy="skip"`` drops them), so that :meth:`replay`
    gives the tolerances of another store's rows and state against this one's. Both are
    float32 runs of the same pushes, each about one reference rounding error from the
    exact result, which :func:`tolerance.replay_tol` covers. Eviction and loads are not
    replayed: use it only for tables that neither evict nor load."""

    def __init__(self) -> None:
        super().__init__()
        self.pushes: dict[str, list[Push]] = defaultdict(list)

    def _record(self, table: str, ids: torch.Tensor, grads: torch.Tensor) -> None:
        ok = torch.isfinite(grads).all(dim=1)
        self.pushes[table].append((ids[ok].clone(), grads[ok].clone()))

    def push_async(self, table: str, ids: torch.Tensor, grads: torch.Tensor) -> Handle:
        handle = super().push_async(table, ids, grads)
        self._record(table, ids, grads)
        return handle

    def push_groups_async(self, requests: Any) -> Handle:
        # A group push is cut into its tables' pushes (the base class's way), so they
        # are recorded as every other push is.
        return ps.Store.push_groups_async(self, requests)

    def push_many_async(self, requests: list[ps.PushRequest]) -> Handle:  # type: ignore[override]
        handle = super().push_many_async(requests)
        for r in requests:
            if r.counts is None:
                self._record(r.table, r.ids, r.grads)
                continue
            # A counted push, replayed as its sub-steps: push j holds the rows of more
            # than j updates, each with its mean gradient. The replay then rounds as the
            # store's sub-steps do (the tolerance is about rounding, not about the
            # squares the store uses in place of the mean's).
            mean = r.grads / r.counts.unsqueeze(1).float()
            for j in range(int(r.counts.max()) if r.counts.numel() else 0):
                live = r.counts > j
                self._record(r.table, r.ids[live], mean[live])
        return handle

    def drop_table(self, table: str) -> None:  # type: ignore[override]
        super().drop_table(table)
        self.pushes.pop(table, None)

    def replay(self, table: str, ids: torch.Tensor) -> tuple[Replay, torch.Tensor]:
        """The :class:`Replay` of ``table``'s pushes and the reference rows of ``ids``."""
        spec = self.spec(table)
        pushes = self.pushes[table]
        if spec.num_rows is not None:
            key = torch.arange(spec.num_rows)
        else:
            key = torch.cat([ids, *(p for p, _ in pushes)]).unique()
        w0 = spec.initial_rows(key)
        where = [(torch.searchsorted(key, p), g) for p, g in pushes]
        return Replay(spec.optimizer, w0, where), torch.searchsorted(key, ids)

    def rows_tol(self, table: str, ids: torch.Tensor) -> float:
        """The tolerance, after the pushes so far, of another store's rows ``ids``."""
        replay, index = self.replay(table, ids)
        return replay.rows_tol(index)

    def assert_pull_close(
        self, table: str, ids: torch.Tensor, got: torch.Tensor, want: torch.Tensor, what: str
    ) -> None:
        """Rows ``got`` of another store (ids ``ids``) against this store's ``want``."""
        replay, index = self.replay(table, ids)
        replay.assert_rows(got, what, want=want, index=index)

    def assert_state_close(
        self, table: str, ids: torch.Tensor, got: torch.Tensor, what: str
    ) -> None:
        """State ``got`` of another store (ids ``ids``) against this store's."""
        replay, index = self.replay(table, ids)
        replay.assert_state(got, what, want=self.state(table, ids), index=index)

    def assert_table(
        self,
        table: str,
        ids: torch.Tensor,
        rows: torch.Tensor,
        state: torch.Tensor,
        *,
        exact: str | None,
        what: str,
    ) -> None:
        """Another store's ``rows`` and ``state`` of ``ids`` against this store's: bit for
        bit where ``exact`` gives the reason, else within the replay's tolerance."""
        want = self.pull(table, ids).rows
        if exact is not None:
            assert_same(rows, want, what=f"{what} rows", why=exact)
            assert_same(state, self.state(table, ids), what=f"{what} state", why=exact)
        else:
            self.assert_pull_close(table, ids, rows, want, f"{what} rows")
            self.assert_state_close(table, ids, state, f"{what} state")
