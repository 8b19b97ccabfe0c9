"""Server-side optimizers: small configs plus the update they apply to touched rows.

A store keeps, per table, the weights ``[rows, dim]`` and an optimizer state
``[rows, state_dim(dim)]`` (float32). A push sums the gradients of duplicate ids,
gathers the touched rows and their state, calls :meth:`Optimizer.apply` on those
copies once per unique row, and writes them back; an optimizer never sees the
whole table and never loops over ids.

All optimizers are **lazy**: a row that is not in a push does not change at all
(no momentum decay, no Adam moment decay, no weight decay). This is what
``torch.optim.SparseAdam`` does, and what a per-row optimizer that only steps
when its row has a gradient would do; it differs from a dense ``torch.optim``
optimizer stepping the whole table with zero gradients on untouched rows.

State layouts (columns of the ``[U, S]`` state, ``D`` = dim):

=================  ===============================  ================================
optimizer          state columns                    initial state
=================  ===============================  ================================
SGD                none (momentum 0) / ``buf[D]``   zeros
RowWiseAdagrad     ``acc[1]``                       ``initial_accumulator``
Adagrad            ``sum[D]``                       ``initial_accumulator``
Adam               ``m[D] | v[D] | step[1]``        zeros
FTRL               ``z[D] | n[D]``                  zeros
=================  ===============================  ================================

A *counted* push (:meth:`Optimizer.apply_counted`) stands for ``k`` updates of a row
at once: a cache under a write bound sums a row's gradients ``g_1 .. g_k`` and sends
the sum ``G``, the count ``k`` and, where the optimizer's accumulator needs more than
the sum, the statistic ``S`` (:meth:`Optimizer.stat_dim`): ``sum_i mean(g_i ** 2)``
per row for row-wise Adagrad, ``sum_i g_i ** 2`` per element for Adagrad, Adam and
FTRL. The store then applies ``k`` sub-steps of the mean gradient ``G / k`` with
``S / k`` in place of its square, so every accumulator grows by exactly ``S`` (and
Adam's step count by ``k``), as with ``k`` separate pushes; what differs from those
is only the order of the gradients within the ``k`` (exact when they are equal; see
docs/cache.md for each optimizer's bound). Plain SGD needs only the sum.

Every config serialises to a JSON-ready dict (:meth:`Optimizer.to_json`) and
back (:func:`optimizer_from_json`), for checkpoint manifests and wire messages;
nothing is pickled.
"""

from __future__ import annotations

import json
import math
from abc import ABC, abstractmethod
from dataclasses import dataclass, fields
from typing import Any, ClassVar

import torch


class Optimizer(ABC):
    """Base of every optimizer config; subclasses are frozen dataclasses."""

    __slots__ = ()

    #: Stable short name, the ``"type"`` in :meth:`to_json`.
    kind: ClassVar[str] = ""

    @property
    def name(self) -> str:
        """Short stable name (``"sgd"``, ``"adam"``, ...)."""
        return self.kind

    @abstractmethod
    def state_dim(self, dim: int) -> int:
        """Number of float32 state columns a row of width ``dim`` needs (0: stateless)."""

    @abstractmethod
    def apply(self, rows: torch.Tensor, state: torch.Tensor, grads: torch.Tensor) -> None:
        """Update ``rows`` and ``state`` in place.

        ``rows`` ``[U, D]``, ``state`` ``[U, state_dim(D)]`` and ``grads`` ``[U, D]``
        (float32) hold one entry per unique touched row; duplicate ids were summed
        by the store before this call, and ``grads`` is finite.
        """

    def initial_state(self, dim: int) -> torch.Tensor:
        """The state ``[state_dim(dim)]`` float32 every row starts with (zeros by default)."""
        return torch.zeros(self.state_dim(dim), dtype=torch.float32)

    def stat_dim(self, dim: int) -> int:
        """Float32 columns of the statistic a counted push carries per row besides the
        sum: 0 (the sum is enough), 1 (``sum_i mean(g_i ** 2)``) or ``dim``
        (``sum_i g_i ** 2``). See the module docstring."""
        return dim

    def sums_exactly(self) -> bool:
        """Whether one update with the sum of ``k`` gradients is the ``k`` updates (plain
        SGD): a counted push then needs no count, and every store takes it plain."""
        return False

    def apply_counted(
        self,
        rows: torch.Tensor,
        state: torch.Tensor,
        grads: torch.Tensor,
        counts: torch.Tensor,
        stats: torch.Tensor,
    ) -> None:
        """:meth:`apply` for rows that stand for ``counts`` ``[U]`` (int64, >= 1) updates
        each: ``grads`` ``[U, D]`` their gradients' sums, ``stats`` ``[U, stat_dim(D)]``
        the statistic (module docstring). Rows with a count of 1 take :meth:`apply`
        itself, bit for bit; the others ``k`` sub-steps of the mean gradient."""
        one = counts == 1
        if self.sums_exactly() or bool(one.all()):
            self.apply(rows, state, grads)
            return
        if not bool(one.any()):  # every row counted: no split
            self._substeps(rows, state, grads, counts, stats)
            return
        for sel, counted in ((torch.nonzero(one).squeeze(1), False),
                             (torch.nonzero(~one).squeeze(1), True)):  # fmt: skip
            if sel.numel() == 0:
                continue
            r, st, g = rows[sel], state[sel], grads[sel]  # copies [K, D], [K, S], [K, D]
            if counted:
                self._substeps(r, st, g, counts[sel], stats[sel])
            else:
                self.apply(r, st, g)
            rows[sel], state[sel] = r, st

    def _substeps(
        self,
        rows: torch.Tensor,
        state: torch.Tensor,
        grads: torch.Tensor,
        counts: torch.Tensor,
        stats: torch.Tensor,
    ) -> None:
        """``counts[u]`` (>= 2) sub-steps of row ``u`` with the mean gradient and the mean
        statistic; rows with fewer sub-steps left drop out as the others go on."""
        k = counts.to(torch.float32).unsqueeze(1)  # [K, 1]
        mean_g, mean_sq = grads / k, stats / k  # [K, D], [K, stat_dim]
        for j in range(int(counts.max())):
            live = torch.nonzero(counts > j).squeeze(1)  # [L]
            if live.numel() == counts.numel():
                self._substep(rows, state, mean_g, mean_sq)
                continue
            r, st = rows[live], state[live]
            self._substep(r, st, mean_g[live], mean_sq[live])
            rows[live], state[live] = r, st

    def _substep(
        self, rows: torch.Tensor, state: torch.Tensor, grads: torch.Tensor, squares: torch.Tensor
    ) -> None:
        """One update as :meth:`apply` with gradient ``grads`` ``[K, D]``, where the
        accumulator takes ``squares`` ``[K, stat_dim]`` in place of the gradient's square."""
        raise NotImplementedError(f"{type(self).__name__}: no counted update")

    def to_json(self) -> dict[str, Any]:
        """A JSON-ready dict ``{"type": kind, **fields}`` that :func:`optimizer_from_json` reads."""
        out: dict[str, Any] = {"type": self.kind}
        for f in fields(self):  # type: ignore[arg-type]
            v = getattr(self, f.name)
            out[f.name] = list(v) if isinstance(v, tuple) else v
        return out

    @staticmethod
    def from_json(data: dict[str, Any] | str) -> Optimizer:
        """Same as :func:`optimizer_from_json`."""
        return optimizer_from_json(data)


_REGISTRY: dict[str, type[Optimizer]] = {}


def _register(cls: type[Optimizer]) -> type[Optimizer]:
    _REGISTRY[cls.kind] = cls
    return cls


def optimizer_from_json(data: dict[str, Any] | str) -> Optimizer:
    """Rebuild an optimizer config from :meth:`Optimizer.to_json` output (dict or JSON text).

    Raises ValueError for an unknown ``"type"`` or unknown fields, and the
    config's own ValueError/TypeError for bad values.
    """
    if isinstance(data, str):
        data = json.loads(data)
    if not isinstance(data, dict):
        raise TypeError(f"optimizer JSON must be an object, got {type(data).__name__}")
    kind = data.get("type")
    cls = _REGISTRY.get(kind) if isinstance(kind, str) else None
    if cls is None:
        raise ValueError(f"optimizer JSON: unknown type {kind!r}; known: {sorted(_REGISTRY)}")
    allowed = {f.name for f in fields(cls)}  # type: ignore[arg-type]
    kwargs = {k: v for k, v in data.items() if k != "type"}
    unknown = sorted(set(kwargs) - allowed)
    if unknown:
        raise ValueError(
            f"optimizer JSON: {kind!r} has no fields {unknown}; known: {sorted(allowed)}"
        )
    for k, v in kwargs.items():
        if isinstance(v, list):
            kwargs[k] = tuple(v)
    return cls(**kwargs)


def _number(cls: str, field: str, value: object) -> float:
    if not isinstance(value, int | float) or isinstance(value, bool):
        raise TypeError(f"{cls}: {field} must be a number, got {type(value).__name__}")
    if not math.isfinite(value):
        raise ValueError(f"{cls}: {field} must be finite, got {value}")
    return float(value)


def _check_positive(cls: str, field: str, value: object) -> None:
    v = _number(cls, field, value)
    if not v > 0:
        raise ValueError(f"{cls}: {field} must be a finite number > 0, got {value}")


def _check_non_negative(cls: str, field: str, value: object) -> None:
    v = _number(cls, field, value)
    if not v >= 0:
        raise ValueError(f"{cls}: {field} must be a finite number >= 0, got {value}")


def _check_unit(cls: str, field: str, value: object) -> None:
    v = _number(cls, field, value)
    if not 0 <= v < 1:
        raise ValueError(f"{cls}: {field} must be in [0, 1), got {value}")


@_register
@dataclass(kw_only=True, slots=True, frozen=True)
class SGD(Optimizer):
    """SGD, optionally with (lazy) momentum, as ``torch.optim.SGD`` without dampening.

    For a touched row with (summed) gradient ``g``::

        momentum == 0:  w -= lr * g
        momentum  > 0:  buf = momentum * buf + g;  w -= lr * buf

    ``buf`` starts at zero, so the first step is ``buf = g`` exactly as in torch.
    Lazy: rows without a gradient keep their ``buf`` (torch's dense SGD would
    decay it with a zero gradient and still move the row).
    """

    kind: ClassVar[str] = "sgd"
    lr: float
    momentum: float = 0.0

    def __post_init__(self) -> None:
        _check_positive("SGD", "lr", self.lr)
        _check_unit("SGD", "momentum", self.momentum)

    def state_dim(self, dim: int) -> int:
        return dim if self.momentum > 0 else 0

    def apply(self, rows: torch.Tensor, state: torch.Tensor, grads: torch.Tensor) -> None:
        if self.momentum > 0:
            buf = state  # [U, D]
            buf.mul_(self.momentum).add_(grads)
            rows.add_(buf, alpha=-self.lr)
        else:
            rows.add_(grads, alpha=-self.lr)

    def stat_dim(self, dim: int) -> int:
        return 0

    def sums_exactly(self) -> bool:
        return self.momentum == 0  # k steps of g_i move the row by lr * sum_i g_i

    def _substep(
        self, rows: torch.Tensor, state: torch.Tensor, grads: torch.Tensor, squares: torch.Tensor
    ) -> None:
        self.apply(rows, state, grads)


@_register
@dataclass(kw_only=True, slots=True, frozen=True)
class RowWiseAdagrad(Optimizer):
    """Row-wise Adagrad (FBGEMM's ``EXACT_ROWWISE_ADAGRAD``): one accumulator per row.

    For a touched row with gradient ``g`` ``[D]``::

        s += mean(g ** 2)                    # scalar per row
        w -= lr * g / (sqrt(s) + eps)

    ``initial_accumulator`` is the value ``s`` starts from.
    """

    kind: ClassVar[str] = "rowwise_adagrad"
    lr: float
    eps: float = 1e-8
    initial_accumulator: float = 0.0

    def __post_init__(self) -> None:
        _check_positive("RowWiseAdagrad", "lr", self.lr)
        _check_positive("RowWiseAdagrad", "eps", self.eps)
        _check_non_negative("RowWiseAdagrad", "initial_accumulator", self.initial_accumulator)

    def state_dim(self, dim: int) -> int:
        return 1

    def apply(self, rows: torch.Tensor, state: torch.Tensor, grads: torch.Tensor) -> None:
        acc = state[:, 0]  # [U]
        acc.add_(grads.square().mean(dim=1))
        step = grads / (acc.sqrt() + self.eps).unsqueeze(1)  # [U, D]
        rows.add_(step, alpha=-self.lr)

    def initial_state(self, dim: int) -> torch.Tensor:
        return torch.full((1,), float(self.initial_accumulator), dtype=torch.float32)

    def stat_dim(self, dim: int) -> int:
        return 1

    def _substep(
        self, rows: torch.Tensor, state: torch.Tensor, grads: torch.Tensor, squares: torch.Tensor
    ) -> None:
        acc = state[:, 0]  # [K]
        acc.add_(squares[:, 0])
        rows.add_(grads / (acc.sqrt() + self.eps).unsqueeze(1), alpha=-self.lr)


@_register
@dataclass(kw_only=True, slots=True, frozen=True)
class Adagrad(Optimizer):
    """Element-wise Adagrad, as ``torch.optim.Adagrad`` (no lr decay, no weight decay)::

    sum += g * g                          # [D] per row
    w   -= lr * g / (sqrt(sum) + eps)
    """

    kind: ClassVar[str] = "adagrad"
    lr: float
    eps: float = 1e-10
    initial_accumulator: float = 0.0

    def __post_init__(self) -> None:
        _check_positive("Adagrad", "lr", self.lr)
        _check_positive("Adagrad", "eps", self.eps)
        _check_non_negative("Adagrad", "initial_accumulator", self.initial_accumulator)

    def state_dim(self, dim: int) -> int:
        return dim

    def apply(self, rows: torch.Tensor, state: torch.Tensor, grads: torch.Tensor) -> None:
        acc = state  # [U, D]
        acc.addcmul_(grads, grads)
        rows.addcdiv_(grads, acc.sqrt().add_(self.eps), value=-self.lr)

    def initial_state(self, dim: int) -> torch.Tensor:
        return torch.full((dim,), float(self.initial_accumulator), dtype=torch.float32)

    def _substep(
        self, rows: torch.Tensor, state: torch.Tensor, grads: torch.Tensor, squares: torch.Tensor
    ) -> None:
        state.add_(squares)
        rows.addcdiv_(grads, state.sqrt().add_(self.eps), value=-self.lr)


@_register
@dataclass(kw_only=True, slots=True, frozen=True)
class Adam(Optimizer):
    """Lazy Adam with a per-row step count, the update of ``torch.optim.SparseAdam``.

    For a touched row with gradient ``g`` (``g += weight_decay * w`` first when
    ``weight_decay > 0``, L2 as in ``torch.optim.Adam``, applied to touched rows only)::

        t += 1                                # this row's own step count
        m  = b1 * m + (1 - b1) * g
        v  = b2 * v + (1 - b2) * g * g
        w -= lr * sqrt(1 - b2**t) / (1 - b1**t) * m / (sqrt(v) + eps)

    Rows without a gradient keep ``w``, ``m``, ``v`` and ``t`` unchanged. The step
    count is stored as float32 (exact up to 2**24 updates of one row).
    """

    kind: ClassVar[str] = "adam"
    lr: float = 1e-3
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.0

    def __post_init__(self) -> None:
        _check_positive("Adam", "lr", self.lr)
        if not isinstance(self.betas, tuple | list) or len(self.betas) != 2:
            raise ValueError(f"Adam: betas must be a pair (b1, b2), got {self.betas!r}")
        object.__setattr__(self, "betas", tuple(self.betas))
        _check_unit("Adam", "betas[0]", self.betas[0])
        _check_unit("Adam", "betas[1]", self.betas[1])
        _check_positive("Adam", "eps", self.eps)
        _check_non_negative("Adam", "weight_decay", self.weight_decay)

    def state_dim(self, dim: int) -> int:
        return 2 * dim + 1

    def apply(self, rows: torch.Tensor, state: torch.Tensor, grads: torch.Tensor) -> None:
        d = rows.shape[1]
        b1, b2 = float(self.betas[0]), float(self.betas[1])
        m, v, t = state[:, :d], state[:, d : 2 * d], state[:, 2 * d]  # [U, D], [U, D], [U]
        if self.weight_decay > 0:
            grads = grads.add(rows, alpha=self.weight_decay)
        t.add_(1.0)
        m.mul_(b1).add_(grads, alpha=1.0 - b1)
        v.mul_(b2).addcmul_(grads, grads, value=1.0 - b2)
        # Bias corrections per row in float64 (the reference computes them in Python floats).
        t64 = t.double()  # [U]
        size = self.lr * torch.sqrt(1.0 - b2**t64) / (1.0 - b1**t64)  # [U]
        rows.addcmul_(m / (v.sqrt() + self.eps), size.float().unsqueeze(1), value=-1.0)

    def _substep(
        self, rows: torch.Tensor, state: torch.Tensor, grads: torch.Tensor, squares: torch.Tensor
    ) -> None:
        d = rows.shape[1]
        b1, b2 = float(self.betas[0]), float(self.betas[1])
        m, v, t = state[:, :d], state[:, d : 2 * d], state[:, 2 * d]  # [K, D], [K, D], [K]
        if self.weight_decay > 0:  # E[(g + c)^2] = E[g^2] + 2 c E[g] + c^2, c = wd * w
            c = rows * self.weight_decay
            squares = squares + c * (2.0 * grads + c)
            grads = grads + c
        t.add_(1.0)
        m.mul_(b1).add_(grads, alpha=1.0 - b1)
        v.mul_(b2).add_(squares, alpha=1.0 - b2)
        t64 = t.double()  # [K]
        size = self.lr * torch.sqrt(1.0 - b2**t64) / (1.0 - b1**t64)  # [K]
        rows.addcmul_(m / (v.sqrt() + self.eps), size.float().unsqueeze(1), value=-1.0)


@_register
@dataclass(kw_only=True, slots=True, frozen=True)
class FTRL(Optimizer):
    """FTRL-proximal, per coordinate (McMahan et al. 2013, "Ad Click Prediction", Alg. 1).

    State per coordinate: ``z`` and ``n``. For a touched row with gradient ``g``
    (the stored row ``w`` is the weight the gradient was computed at)::

        sigma = (sqrt(n + g*g) - sqrt(n)) / alpha
        z    += g - sigma * w
        n    += g * g
        w     = 0                                                  if |z| <= l1
                -(z - sign(z) * l1) / ((beta + sqrt(n)) / alpha + l2)  otherwise

    The initial row enters only through ``sigma * w`` on the first update, as in
    TensorFlow's FTRL; afterwards ``w`` is a function of ``z`` and ``n``.
    """

    kind: ClassVar[str] = "ftrl"
    alpha: float
    beta: float = 1.0
    l1: float = 0.0
    l2: float = 0.0

    def __post_init__(self) -> None:
        _check_positive("FTRL", "alpha", self.alpha)
        _check_non_negative("FTRL", "beta", self.beta)
        _check_non_negative("FTRL", "l1", self.l1)
        _check_non_negative("FTRL", "l2", self.l2)

    def state_dim(self, dim: int) -> int:
        return 2 * dim

    def apply(self, rows: torch.Tensor, state: torch.Tensor, grads: torch.Tensor) -> None:
        d = rows.shape[1]
        z, n = state[:, :d], state[:, d:]  # [U, D] each
        n_new = n + grads * grads
        sigma = (n_new.sqrt() - n.sqrt()) / self.alpha
        z.add_(grads - sigma * rows)
        n.copy_(n_new)
        denom = (self.beta + n.sqrt()) / self.alpha + self.l2  # [U, D]
        shrunk = z - torch.sign(z) * self.l1
        w = torch.where(z.abs() <= self.l1, torch.zeros_like(z), -shrunk / denom)
        rows.copy_(w)

    def _substep(
        self, rows: torch.Tensor, state: torch.Tensor, grads: torch.Tensor, squares: torch.Tensor
    ) -> None:
        d = rows.shape[1]
        z, n = state[:, :d], state[:, d:]  # [K, D] each
        n_new = n + squares
        sigma = (n_new.sqrt() - n.sqrt()) / self.alpha
        z.add_(grads - sigma * rows)
        n.copy_(n_new)
        denom = (self.beta + n.sqrt()) / self.alpha + self.l2  # [K, D]
        shrunk = z - torch.sign(z) * self.l1
        rows.copy_(torch.where(z.abs() <= self.l1, torch.zeros_like(z), -shrunk / denom))


OPTIMIZERS: tuple[type[Optimizer], ...] = tuple(_REGISTRY.values())
