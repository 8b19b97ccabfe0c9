"""The building blocks of tensor parallelism: the two autograd functions that move data
between the ranks of a ``tp`` group, the column- and row-parallel linear layers made from
a full ``nn.Linear``, the vocabulary-parallel head, and :class:`TPStats`, the count of the
bytes they allreduce. :mod:`dense.tensor_parallel` assembles them into a GPT (read its
docstring for the plan).

* :func:`copy_to_tp`: identity forward, allreduce (sum) of the gradient in backward;
* :func:`reduce_from_tp`: allreduce (sum) forward, identity backward.

Column-parallel: ``W [out, in]`` split by rows (output features); the input enters
through ``copy_to_tp``. Row-parallel: ``W`` split by columns (input features); the
partial outputs leave through ``reduce_from_tp``, then the bias is added once::

    column-parallel, rank r of tp:           row-parallel, rank r of tp:
    W_r = W[r*out/tp : (r+1)*out/tp, :]      W_r = W[:, r*in/tp : (r+1)*in/tp]
    y_r = x W_r^T + b_r   [..., out/tp]      y = sum_r x_r W_r^T + b   [..., out], every rank
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import nn

if TYPE_CHECKING:  # only the type: the group is passed in by the caller
    from comm.group import ProcessGroup


@dataclass(slots=True)
class TPStats:
    """Payload bytes and count of the tensor-parallel allreduces since the last reset.

    ``bytes_by_site`` splits the bytes by where they were reduced: ``"attn"`` and
    ``"mlp"`` (the blocks: ``B*T*D`` elements in forward and in backward each),
    ``"head"`` (the head's input gradient, ``B*T*D``), ``"loss"`` (max, sum-exp and
    target logit: ``3*B*T``), ``"embedding"`` (the vocabulary-parallel token table's
    output, ``B*T*D``). Nothing is counted on a 1-rank group (nothing moves).
    """

    bytes_allreduced: int = 0
    allreduces: int = 0
    bytes_by_site: dict[str, int] = field(default_factory=dict)

    def add(self, site: str, tensor: torch.Tensor) -> None:
        n = tensor.numel() * tensor.element_size()
        self.bytes_allreduced += n
        self.allreduces += 1
        self.bytes_by_site[site] = self.bytes_by_site.get(site, 0) + n

    def bytes_of(self, *sites: str) -> int:
        """Bytes allreduced at ``sites``: ``bytes_of("attn", "mlp")`` is the blocks' share,
        ``4 * n_layer * B*T*D * element size`` per training step."""
        return sum(self.bytes_by_site.get(site, 0) for site in sites)

    def reset(self) -> None:
        self.bytes_allreduced = 0
        self.allreduces = 0
        self.bytes_by_site = {}


def allreduce_counted(
    tensor: torch.Tensor, group: ProcessGroup, stats: TPStats, site: str, op: str = "sum"
) -> torch.Tensor:
    """Allreduce ``tensor`` in place over ``group`` (contiguous) and count it."""
    if group.size > 1:
        group.allreduce(tensor, op=op)
        stats.add(site, tensor)
    return tensor


class _CopyToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: ProcessGroup, stats: TPStats, site: str) -> Any:
        ctx.group, ctx.stats, ctx.site = group, stats, site
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        g = grad.clone(memory_format=torch.contiguous_format)  # the reduce writes in place
        return allreduce_counted(g, ctx.group, ctx.stats, ctx.site), None, None, None


class _ReduceFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: ProcessGroup, stats: TPStats, site: str) -> Any:
        out = x.clone(memory_format=torch.contiguous_format)
        return allreduce_counted(out, group, stats, site)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        return grad, None, None, None


def copy_to_tp(x: torch.Tensor, group: ProcessGroup, stats: TPStats, site: str) -> torch.Tensor:
    """Identity forward; the gradient is summed over ``group`` in backward."""
    out: torch.Tensor = _CopyToTP.apply(x, group, stats, site)
    return out


def reduce_from_tp(x: torch.Tensor, group: ProcessGroup, stats: TPStats, site: str) -> torch.Tensor:
    """Sum over ``group`` forward; the gradient passes through unchanged."""
    out: torch.Tensor = _ReduceFromTP.apply(x, group, stats, site)
    return out


def split_count(what: str, name: str, value: int, tp: int) -> int:
    if value % tp != 0:
        raise ValueError(f"{what}: {name} {value} is not divisible by the tp group size {tp}")
    return value // tp


class ColumnParallelLinear(nn.Module):
    """This rank's slice of the OUTPUT features of a full ``nn.Linear``.

    ``forward(x [..., in]) -> [..., out/tp]``; the input goes through
    :func:`copy_to_tp`. ``chunks`` > 1 treats the output as that many equal blocks
    each split over tp (the fused qkv ``[3D, D]``: this rank keeps its rows of q, of
    k and of v), so ``weight`` is ``[out/tp, in]``: block c's rows
    ``[c*out/chunks + r*n, c*out/chunks + (r+1)*n)`` for ``n = out/(chunks*tp)``.
    """

    def __init__(
        self,
        linear: nn.Linear,
        group: ProcessGroup,
        *,
        chunks: int = 1,
        stats: TPStats | None = None,
        site: str = "linear",
    ) -> None:
        super().__init__()
        if not isinstance(linear, nn.Linear):
            raise TypeError(f"ColumnParallelLinear: expected an nn.Linear, got {type(linear)}")
        out, inp = linear.weight.shape
        tp, rank = group.size, group.rank
        if not isinstance(chunks, int) or chunks < 1 or out % chunks != 0:
            raise ValueError(
                f"ColumnParallelLinear: chunks must be an int >= 1 dividing out_features {out}, "
                f"got {chunks!r}"
            )
        per = split_count("ColumnParallelLinear", "out_features / chunks", out // chunks, tp)
        self.group, self.stats, self.site = group, stats if stats is not None else TPStats(), site
        self.chunks, self.in_features, self.out_features = chunks, inp, out
        w = linear.weight.detach().view(chunks, tp, per, inp)[:, rank]  # [chunks, per, in]
        self.weight = nn.Parameter(w.reshape(chunks * per, inp).clone())  # [out/tp, in]
        self.bias: nn.Parameter | None = None
        if linear.bias is not None:
            b = linear.bias.detach().view(chunks, tp, per)[:, rank]
            self.bias = nn.Parameter(b.reshape(-1).clone())  # [out/tp]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = copy_to_tp(x, self.group, self.stats, self.site)  # [..., in]
        return F.linear(x, self.weight, self.bias)  # [..., out/tp]

    def _gather(self, local: torch.Tensor) -> torch.Tensor:
        tail = local.shape[1:]
        every = self.group.allgather(local.detach().contiguous().view(self.chunks, -1, *tail))
        # [tp, chunks, per, *tail] -> [chunks, tp, per, *tail] -> [out, *tail]
        return every.transpose(0, 1).reshape(self.out_features, *tail)

    def full_parameters(self) -> dict[str, torch.Tensor]:
        """Collective over the tp group: ``{"weight": [out, in], "bias": [out]}``."""
        out = {"weight": self._gather(self.weight)}
        if self.bias is not None:
            out["bias"] = self._gather(self.bias)
        return out

    def extra_repr(self) -> str:
        return (
            f"in={self.in_features}, out={self.out_features} (this rank "
            f"{self.weight.shape[0]}, chunks={self.chunks}), tp={self.group.size}"
        )


class RowParallelLinear(nn.Module):
    """This rank's slice of the INPUT features of a full ``nn.Linear``.

    ``forward(x_local [..., in/tp]) -> [..., out]``: the partial products are summed
    over tp by :func:`reduce_from_tp`, then the (full, replicated) bias is added
    once. ``weight`` is ``[out, in/tp]``: columns ``[r*in/tp, (r+1)*in/tp)``.
    """

    def __init__(
        self,
        linear: nn.Linear,
        group: ProcessGroup,
        *,
        stats: TPStats | None = None,
        site: str = "linear",
    ) -> None:
        super().__init__()
        if not isinstance(linear, nn.Linear):
            raise TypeError(f"RowParallelLinear: expected an nn.Linear, got {type(linear)}")
        out, inp = linear.weight.shape
        tp, rank = group.size, group.rank
        per = split_count("RowParallelLinear", "in_features", inp, tp)
        self.group, self.stats, self.site = group, stats if stats is not None else TPStats(), site
        self.in_features, self.out_features = inp, out
        w = linear.weight.detach().view(out, tp, per)[:, rank]  # [out, in/tp]
        self.weight = nn.Parameter(w.clone())
        self.bias: nn.Parameter | None = None
        if linear.bias is not None:
            self.bias = nn.Parameter(linear.bias.detach().clone())  # [out], replicated

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = reduce_from_tp(F.linear(x, self.weight), self.group, self.stats, self.site)
        return y if self.bias is None else y + self.bias  # [..., out]

    def full_parameters(self) -> dict[str, torch.Tensor]:
        """Collective over the tp group: ``{"weight": [out, in], "bias": [out]}``."""
        every = self.group.allgather(self.weight.detach().contiguous())  # [tp, out, in/tp]
        out = {"weight": every.permute(1, 0, 2).reshape(self.out_features, self.in_features)}
        if self.bias is not None:
            out["bias"] = self.bias.detach().clone()
        return out

    def extra_repr(self) -> str:
        return (
            f"in={self.in_features} (this rank {self.weight.shape[1]}), "
            f"out={self.out_features}, tp={self.group.size}"
        )


class VocabParallelHead(ColumnParallelLinear):
    """The output head split over the vocabulary: ``forward(x [B, T, D]) -> logits
    [B, T, V/tp]`` for vocabulary ids ``[vocab_start, vocab_end)``. Pair it with
    :func:`dense.vocab_parallel.vocab_parallel_cross_entropy`."""

    def __init__(
        self, head: nn.Linear, group: ProcessGroup, *, stats: TPStats | None = None
    ) -> None:
        super().__init__(head, group, stats=stats, site="head")
        self.vocab_size = self.out_features
        self.vocab_start = group.rank * (self.vocab_size // group.size)
        self.vocab_end = self.vocab_start + self.vocab_size // group.size
