"""Megatron-style tensor parallelism for :class:`dense.GPT` over a ``tp`` process group.

Every rank of the ``tp`` group holds a slice of each big matrix and the whole
activations; two autograd functions move data between them:

* :func:`copy_to_tp`: identity forward, allreduce (sum) of the gradient in backward
  (each rank's slice contributes a part of the input's gradient);
* :func:`reduce_from_tp`: allreduce (sum) forward, identity backward (each rank
  holds a partial sum of the output).

A column-parallel linear keeps rows of ``W [out, in]`` (a slice of the OUTPUT
features) and takes the full input through ``copy_to_tp``; a row-parallel linear
keeps columns (a slice of the INPUT features) and sums its partial outputs with
``reduce_from_tp``. A block then needs one allreduce per sub-layer in forward and
one in backward::

    x [B,T,D] -> copy_to_tp -> qkv (column, this rank's heads) -> attention
              -> proj (row) -> reduce_from_tp -> + bias -> [B,T,D]     (attention)
    x [B,T,D] -> copy_to_tp -> fc (column) -> GELU -> proj (row)
              -> reduce_from_tp -> + bias -> [B,T,D]                   (MLP)

The head is column-parallel over the vocabulary (:class:`VocabParallelHead`): after
:func:`apply_tensor_parallel`, ``gpt(tok_emb)`` returns this rank's logits shard
``[B, T, V/tp]`` and the loss is :func:`dense.vocab_parallel.tp_gpt_loss`, which
never gathers the full logits. LayerNorms, the position embedding and the
row-parallel biases stay full on every rank; their gradients are identical on all
tp ranks by construction, so data parallelism over another group composes as usual.

The layers are built FROM the full ``nn.Linear`` (same init on every rank gives the
same model as one process); :func:`tp_full_state_dict` gathers the full shapes back
under the original names. Every allreduce's payload (bytes of the tensor reduced,
not the bytes a ring sends on the wire) is counted in a :class:`TPStats`.

Example (4 ranks: dp 2 x tp 2)::

    mesh = comm.DeviceMesh(group, {"dp": 2, "tp": 2})
    torch.manual_seed(0)
    gpt = apply_tensor_parallel(GPT(cfg), mesh.group("tp"), stats=stats)
    model = DataParallel(gpt, mesh.group("dp"))
    loss = tp_gpt_loss(model(tok_emb), targets, mesh.group("tp"), stats=stats)
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import nn

from dense.gpt import GPT, MLP, Block, CausalSelfAttention

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


def _split_count(what: str, name: str, value: int, tp: int) -> int:
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
        per = _split_count("ColumnParallelLinear", "out_features / chunks", out // chunks, tp)
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
        per = _split_count("RowParallelLinear", "in_features", inp, tp)
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


class TensorParallelAttention(nn.Module):
    """:class:`dense.gpt.CausalSelfAttention` split by heads: this rank runs
    ``n_head / tp`` heads (qkv column-parallel, three chunks) and ``proj`` is
    row-parallel over their outputs. One allreduce forward (proj), one backward
    (the input gradient)."""

    def __init__(
        self, attn: CausalSelfAttention, group: ProcessGroup, *, stats: TPStats | None = None
    ) -> None:
        super().__init__()
        stats = stats if stats is not None else TPStats()
        self.n_head = _split_count("TensorParallelAttention", "n_head", attn.n_head, group.size)
        self.dropout = attn.dropout
        self.qkv = ColumnParallelLinear(attn.qkv, group, chunks=3, stats=stats, site="attn")
        self.proj = RowParallelLinear(attn.proj, group, stats=stats, site="attn")
        self.resid_drop = attn.resid_drop

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape  # [B, T, D]
        h = self.n_head  # this rank's heads
        dl = self.qkv.weight.shape[0] // 3  # D / tp channels: h heads of D/H each
        q, k, v = self.qkv(x).split(dl, dim=2)  # each [B, T, D/tp]
        q = q.view(b, t, h, dl // h).transpose(1, 2)  # [B, H/tp, T, D/H]
        k = k.view(b, t, h, dl // h).transpose(1, 2)
        v = v.view(b, t, h, dl // h).transpose(1, 2)
        y = F.scaled_dot_product_attention(
            q, k, v, dropout_p=self.dropout if self.training else 0.0, is_causal=True
        )  # [B, H/tp, T, D/H]
        y = y.transpose(1, 2).contiguous().view(b, t, dl)  # [B, T, D/tp]
        return self.resid_drop(self.proj(y))  # [B, T, D] (dropout: same seed on tp ranks)


class TensorParallelMLP(nn.Module):
    """:class:`dense.gpt.MLP` as fc column-parallel -> GELU -> proj row-parallel."""

    def __init__(self, mlp: MLP, group: ProcessGroup, *, stats: TPStats | None = None) -> None:
        super().__init__()
        stats = stats if stats is not None else TPStats()
        self.fc = ColumnParallelLinear(mlp.fc, group, stats=stats, site="mlp")
        self.act = mlp.act
        self.proj = RowParallelLinear(mlp.proj, group, stats=stats, site="mlp")
        self.drop = mlp.drop

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.proj(self.act(self.fc(x))))  # [B, T, D], hidden [B, T, 4D/tp]


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


def check_tensor_parallel(gpt: GPT, tp: int) -> None:
    """ValueError unless ``gpt``'s shapes split over ``tp`` ranks (the same on every
    rank: it depends only on the config)."""
    cfg = gpt.cfg
    checks = [
        ("n_head", cfg.n_head, "each rank runs n_head / tp heads"),
        ("4 * d_model", 4 * cfg.d_model, "the MLP's hidden width is split over tp"),
        ("vocab_size", cfg.vocab_size, "the head and the loss are split over the vocabulary"),
    ]
    for name, value, why in checks:
        if value % tp != 0:
            raise ValueError(
                f"apply_tensor_parallel: {name} = {value} is not divisible by the tp group "
                f"size {tp} ({why}); expected a multiple of {tp}"
            )


def apply_tensor_parallel(gpt: GPT, tp_group: ProcessGroup, *, stats: TPStats | None = None) -> GPT:
    """Convert a full ``gpt`` in place to this rank's tensor-parallel part; returns it.

    Build the full GPT with the same seed on every rank first: each layer keeps its
    slice of those weights. Afterwards ``gpt(tok_emb [B, T, D])`` returns this rank's
    logits shard ``[B, T, V/tp]``: compute the loss with
    :func:`dense.vocab_parallel.tp_gpt_loss`. The allreduces are counted in
    ``stats`` (a new :class:`TPStats` when None; :func:`tp_stats` finds it).
    """
    if not isinstance(gpt, GPT):
        raise TypeError(f"apply_tensor_parallel: expected a dense.GPT, got {type(gpt).__name__}")
    if isinstance(gpt.head, VocabParallelHead):
        raise ValueError("apply_tensor_parallel: this GPT is already tensor parallel")
    check_tensor_parallel(gpt, tp_group.size)
    stats = stats if stats is not None else TPStats()
    for block in gpt.blocks:
        assert isinstance(block, Block)
        assert isinstance(block.attn, CausalSelfAttention) and isinstance(block.mlp, MLP)
        block.attn = TensorParallelAttention(block.attn, tp_group, stats=stats)  # type: ignore[assignment]
        block.mlp = TensorParallelMLP(block.mlp, tp_group, stats=stats)  # type: ignore[assignment]
    gpt.head = VocabParallelHead(gpt.head, tp_group, stats=stats)  # type: ignore[assignment]
    return gpt


def tp_stats(gpt: GPT) -> TPStats:
    """The :class:`TPStats` a tensor-parallel ``gpt`` counts its allreduces in."""
    if not isinstance(gpt.head, VocabParallelHead):
        raise ValueError("tp_stats: this GPT is not tensor parallel (apply_tensor_parallel)")
    return gpt.head.stats


@torch.no_grad()
def tp_full_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """Collective over the tp groups of ``model``'s parallel layers: its state dict with
    every parallel layer's parameters gathered to their full shapes, under the names
    of the unconverted model (``blocks.0.attn.qkv.weight [3D, D]``, ...)."""
    out = {name: t.detach().clone() for name, t in model.state_dict().items()}
    for prefix, module in model.named_modules():  # the same order on every rank
        gather = getattr(module, "full_parameters", None)
        if callable(gather):
            for key, full in gather().items():
                out[f"{prefix}.{key}" if prefix else key] = full
    return out
