"""The vocabulary split over a ``tp`` group: a token table and a cross-entropy loss.

Rank ``r`` of ``tp`` ranks owns the vocabulary ids ``[r*V/tp, (r+1)*V/tp)``: the
rows of the token table (:class:`VocabParallelEmbedding`) and the columns of the
logits (:class:`dense.tensor_parallel.VocabParallelHead` produces them).

:func:`vocab_parallel_cross_entropy` computes the mean cross entropy from the
logits shards without gathering the full ``[B, T, V]`` logits; per token, with
``z`` this rank's logits::

    m       = allreduce_max(max_v z)                 # [B, T], for a stable exp
    s, z_t  = allreduce_sum(sum_v exp(z - m),        # [B, T]
                            z[target] - m if this rank owns the target else 0)
    loss    = mean(log s - z_t)
    dloss/dz = (exp(z - m) / s - onehot(target on this shard)) / (B*T)

Two allreduces of ``B*T`` and ``2*B*T`` elements; backward is local.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import nn

from dense.tp_layers import TPStats, allreduce_counted, reduce_from_tp

if TYPE_CHECKING:  # only the type: the group is passed in by the caller
    from comm.group import ProcessGroup


def _check_ids(what: str, ids: torch.Tensor, vocab: int) -> None:
    if ids.dtype != torch.int64:
        raise TypeError(f"{what}: token ids must be int64, got {ids.dtype}")
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= vocab):
        raise ValueError(
            f"{what}: token ids must be in [0, {vocab}), got values in "
            f"[{int(ids.min())}, {int(ids.max())}]"
        )


class VocabParallelEmbedding(nn.Module):
    """This rank's rows ``[V/tp, D]`` of a full ``nn.Embedding`` (dense).

    ``forward(ids [...]) -> [..., D]``: ids this rank owns are looked up, the others
    give zeros, and the partial results are summed over tp (one allreduce of
    ``ids.numel() * D`` elements, counted as ``"embedding"``). Backward is local:
    each rank's rows get the gradients of their ids.
    """

    def __init__(
        self, embedding: nn.Embedding, group: ProcessGroup, *, stats: TPStats | None = None
    ) -> None:
        super().__init__()
        if not isinstance(embedding, nn.Embedding):
            raise TypeError(f"VocabParallelEmbedding: expected an nn.Embedding, got {embedding!r}")
        if embedding.padding_idx is not None or embedding.max_norm is not None:
            raise ValueError(
                "VocabParallelEmbedding: padding_idx and max_norm are not supported, got "
                f"padding_idx={embedding.padding_idx}, max_norm={embedding.max_norm}"
            )
        vocab, dim = embedding.weight.shape
        tp = group.size
        if vocab % tp != 0:
            raise ValueError(
                f"VocabParallelEmbedding: vocabulary size {vocab} is not divisible by the tp "
                f"group size {tp}; expected a multiple of {tp}"
            )
        self.group, self.stats = group, stats if stats is not None else TPStats()
        self.num_embeddings, self.embedding_dim = vocab, dim
        self.vocab_start = group.rank * (vocab // tp)
        self.vocab_end = self.vocab_start + vocab // tp
        rows = embedding.weight.detach()[self.vocab_start : self.vocab_end]
        self.weight = nn.Parameter(rows.clone())  # [V/tp, D]

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        _check_ids("VocabParallelEmbedding", ids, self.num_embeddings)
        local = ids - self.vocab_start
        mine = (local >= 0) & (local < self.weight.shape[0])  # [...]
        rows = F.embedding(torch.where(mine, local, 0), self.weight)  # [..., D]
        rows = rows * mine.unsqueeze(-1).to(rows.dtype)  # other ranks' ids: zeros
        return reduce_from_tp(rows, self.group, self.stats, "embedding")  # [..., D]

    def full_parameters(self) -> dict[str, torch.Tensor]:
        """Collective over the tp group: ``{"weight": [V, D]}``."""
        every = self.group.allgather(self.weight.detach().contiguous())  # [tp, V/tp, D]
        return {"weight": every.reshape(self.num_embeddings, self.embedding_dim)}

    def extra_repr(self) -> str:
        return (
            f"{self.num_embeddings}, {self.embedding_dim}, rows "
            f"[{self.vocab_start}, {self.vocab_end}), tp={self.group.size}"
        )


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any, logits: torch.Tensor, targets: torch.Tensor, group: ProcessGroup, stats: TPStats
    ) -> Any:
        # logits [N, V/tp] this rank's vocabulary columns, targets [N] global ids. The loss
        # and the softmax are computed in float32 whatever the logits' dtype: in bf16 a
        # probability of 0.99 minus its one-hot would be ~40 % off (8 mantissa bits).
        n, vl = logits.shape
        ctx.dtype = logits.dtype
        z = logits.detach().float()
        m = z.max(dim=1).values.contiguous()  # [N]
        allreduce_counted(m, group, stats, "loss", op="max")
        shifted = z - m.unsqueeze(1)  # [N, V/tp], <= 0
        exp = shifted.exp()
        local = targets - group.rank * vl
        mine = (local >= 0) & (local < vl)  # [N]: this rank owns the target
        idx = torch.where(mine, local, 0)
        z_t = shifted.gather(1, idx.unsqueeze(1)).squeeze(1)  # [N]
        pair = torch.stack([exp.sum(dim=1), torch.where(mine, z_t, 0.0)])  # [2, N]
        allreduce_counted(pair, group, stats, "loss")
        sum_exp, target_logit = pair[0], pair[1]
        ctx.save_for_backward(exp / sum_exp.unsqueeze(1), idx, mine)  # softmax shard
        return (sum_exp.log() - target_logit).mean()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        softmax, idx, mine = ctx.saved_tensors  # softmax float32 [N, V/tp]
        n = softmax.shape[0]
        g = softmax.clone()  # [N, V/tp]
        g[torch.arange(n, device=g.device), idx] -= mine.to(g.dtype)
        return (g * (grad.float() / n)).to(ctx.dtype), None, None, None


def vocab_parallel_cross_entropy(
    local_logits: torch.Tensor,
    targets: torch.Tensor,
    group: ProcessGroup,
    *,
    stats: TPStats | None = None,
) -> torch.Tensor:
    """Mean cross entropy (nats per token, like :func:`dense.gpt_loss`) from this rank's
    logits shard ``[B, T, V/tp]`` (vocabulary ids ``[rank*V/tp, (rank+1)*V/tp)``) and
    the global ``targets [B, T]`` (the same on every tp rank). Collective over
    ``group``; the full logits are never gathered. The result is the same on every
    rank; its gradient flows to ``local_logits`` only (softmax - onehot on the shard).
    Computed in float32 for any logits dtype (the loss is float32; the gradient is cast
    back to the logits' dtype once).
    """
    if local_logits.dim() != 3 or targets.shape != local_logits.shape[:2]:
        raise ValueError(
            "vocab_parallel_cross_entropy: local_logits must be [B, T, V/tp] and targets "
            f"[B, T], got local_logits {tuple(local_logits.shape)} and targets "
            f"{tuple(targets.shape)}"
        )
    if not local_logits.is_floating_point():
        raise TypeError(
            f"vocab_parallel_cross_entropy: logits must be floating point, got {local_logits.dtype}"
        )
    vl = local_logits.shape[2]
    _check_ids("vocab_parallel_cross_entropy: targets", targets, vl * group.size)
    stats = stats if stats is not None else TPStats()
    loss: torch.Tensor = _VocabParallelCrossEntropy.apply(
        local_logits.reshape(-1, vl), targets.reshape(-1), group, stats
    )
    return loss


def tp_gpt_loss(
    logits_shard: torch.Tensor,
    targets: torch.Tensor,
    group: ProcessGroup,
    *,
    stats: TPStats | None = None,
) -> torch.Tensor:
    """:func:`dense.gpt_loss` for a tensor-parallel GPT: ``logits_shard [B, T, V/tp]``
    (what ``gpt(tok_emb)`` returns after ``apply_tensor_parallel``) against
    ``targets [B, T]``. Pass the model's stats (``tp_stats(gpt)``) to count the
    loss's allreduces with the blocks'."""
    return vocab_parallel_cross_entropy(logits_shard, targets, group, stats=stats)
