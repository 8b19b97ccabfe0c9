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

Notes for a training loop:

* The residual stream is full on every tp rank, so the gradient of ``tok_emb`` (and
  of every replicated parameter) is the same on all tp ranks: a token table outside
  the GPT gets the same gradient from each tp rank of a data-parallel replica (apply
  it once per replica, not once per rank).
* Dropout: seed every tp rank the same (the residual dropout after a reduce must drop
  the same elements on all of them).
* Checkpoints: :func:`tp_full_state_dict` gives the unconverted GPT's state dict; load
  it into a full GPT and convert again, at any tp.

Example (4 ranks: dp 2 x tp 2)::

    mesh = comm.DeviceMesh(group, {"dp": 2, "tp": 2})
    tp_group, stats = mesh.group("tp"), TPStats()
    torch.manual_seed(0)                                  # the same init on every rank
    gpt = apply_tensor_parallel(GPT(cfg), tp_group, stats=stats)
    model = DataParallel(gpt, mesh.group("dp"))           # averages over dp only
    logits = model(tok_emb)                               # [B/dp, T, V/tp]
    loss = tp_gpt_loss(logits, targets, tp_group, stats=stats)
    loss.backward()
    stats.bytes_of("attn", "mlp")                         # 4 * n_layer * B/dp*T*D*4 bytes
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from dense.gpt import GPT, MLP, Block, CausalSelfAttention
from dense.tp_layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    TPStats,
    VocabParallelHead,
    copy_to_tp,
    reduce_from_tp,
    split_count,
)

if TYPE_CHECKING:  # only the type: the group is passed in by the caller
    from comm.group import ProcessGroup

__all__ = [
    "ColumnParallelLinear",
    "RowParallelLinear",
    "TPStats",
    "TensorParallelAttention",
    "TensorParallelMLP",
    "VocabParallelHead",
    "apply_tensor_parallel",
    "check_tensor_parallel",
    "copy_to_tp",
    "reduce_from_tp",
    "tp_full_state_dict",
    "tp_stats",
]


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
        self.n_head = split_count("TensorParallelAttention", "n_head", attn.n_head, group.size)
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
