"""The fused local lookup: one gather+pool for many tables, and a backward fused
with the optimizer that never builds a dense gradient.

Layout (like FBGEMM's table-batched embedding): the tables of one *fused group*
(same ``dim``, same optimizer config) are stacked into one flat weight::

    weight [R, D]      R = sum of the tables' rows; table t owns rows
                       [base[t], base[t] + num_rows[t])
    state  [R, S]      the ps optimizer's per-row state (S = optimizer.state_dim(D))
    clocks [R]         int64, how many updates each row received (as a ps store counts)

A row-major ``[R, D]`` weight per group (rather than one 1-D buffer for every
dim, as FBGEMM does) keeps each group a plain 2-D tensor that ``embedding_bag``
reads directly; a collection rarely has more than two or three distinct dims.

Forward of a group is ONE ``embedding_bag(mode="sum")`` call over every feature
of the batch: ids are offset by their table's base, "mean" bags become
per-id weights ``1/len``, and unpooled (``pooling="none"``) features are bags of
exactly one id.

Backward (:func:`segment_sum` + :func:`apply_optimizer`): the gradient of every
id is ``w_i * grad_out[bag_i]``; ids are sorted, and the gradients of equal ids
are summed by another ``embedding_bag`` call whose "weight" is ``grad_out`` and
whose bags are the runs of equal ids (so the ``[N, D]`` per-id gradient is never
materialised either). The ps optimizer's own ``apply`` then updates the gathered
touched rows and state, which are scattered back in place: the same math as the
parameter server, so local and hybrid tables train identically.

On CUDA with triton installed, the same two steps are Triton kernels
(:mod:`embedding.kernels`, ``docs/kernels.md``): an autotuned gather+pool, and a
backward fused with the update of every ps optimizer (the rows variant after the
data-parallel exchange). The CPU paths above are unchanged.

Narrow rows (a group of fp16 or bf16 tables, :attr:`FusedGroup.keys` set): the lookup
widens each row and pools in float32 (the C pass :func:`ps.kernels.narrow_rows.pool`;
``F.embedding_bag`` on a narrow weight would return the narrow type), so the outputs
are float32 as for float32 tables. An update is computed in float32 on widened copies
and written back stochastically rounded (:mod:`ps.rounding`), keyed by the row's table
seed, its id in the table and its clock after the update: the bits the ps store's
engine gives the same row for the same summed gradient. Row-wise Adagrad runs the
narrow C pass (:func:`ps.kernels.narrow_rows.rowwise_adagrad_parts_`: the float32
kernel's step on the widened row, then the rounding).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from comm import ProcessGroup, boundary
from embedding.checks import sequence_lengths
from embedding.config import TableConfig
from embedding.jagged import KeyedJaggedIds, offsets_from_lengths
from embedding.kernels import FUSED_OPTIMIZERS, use_triton
from ps import Optimizer, RowWiseAdagrad
from ps.kernels import narrow_rows
from ps.kernels import rowwise_adagrad as cpu_kernel
from ps.kernels.narrow_rows import RoundingKeys


@dataclass(slots=True)
class GroupBatch:
    """One fused group's share of a batch, ready for the lookup.

    ``ids`` int64 ``[N]`` are flat rows (table base added), ``offsets`` int64
    ``[nbags + 1]`` delimit the bags, ``weights`` float ``[N]`` or None (the
    per-id factors: user weights times ``1/len`` of mean bags).
    """

    ids: torch.Tensor
    offsets: torch.Tensor
    weights: torch.Tensor | None

    @property
    def num_bags(self) -> int:
        return int(self.offsets.numel()) - 1

    def kernel_offsets(self) -> torch.Tensor | None:
        """``offsets`` for the C kernels (:mod:`ps.kernels.rowwise_adagrad`), or None when every bag
        holds exactly one id (bag ``p`` is id ``p``: the kernel needs no bag map)."""
        lengths = self.offsets[1:] - self.offsets[:-1]  # [nbags]
        one_each = self.ids.numel() == self.num_bags and bool((lengths == 1).all())
        return None if one_each else self.offsets

    def kernel_weights(self) -> torch.Tensor | None:
        """``weights`` as the C kernels read them: float32, contiguous (or None)."""
        return None if self.weights is None else self.weights.to(torch.float32).contiguous()


def kernel_parts(parts: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Per-feature gradients ``[n_f, D]`` as the C kernels read them in place: float32
    with each row's elements contiguous (any row stride, e.g. views of ``[B, N, D]``)."""
    return [p.float() if p.stride(-1) == 1 else p.float().contiguous() for p in parts]


@dataclass(slots=True)
class FusedGroup:
    """The flat storage of the tables that share one dim, one optimizer and one row type.

    ``keys`` None: float32 rows; else the rows are ``keys.dtype`` (fp16 or bf16) and
    ``keys`` says how an update of each row is rounded (its table's seed and its id).
    """

    dim: int
    optimizer: Optimizer
    weight: torch.Tensor  # [R, D] float32, or keys.dtype
    state: torch.Tensor  # [R, S] float32
    clocks: torch.Tensor  # [R] int64
    keys: RoundingKeys | None = None

    def __post_init__(self) -> None:
        # A narrow weight without its keys would be updated in the narrow type itself.
        if self.keys is None and self.weight.dtype != torch.float32:
            raise ValueError(
                f"FusedGroup: a {self.weight.dtype} weight needs the RoundingKeys of its "
                "tables (fp16/bf16 rows are updated in float32 and rounded back), got none"
            )
        if self.keys is not None and self.keys.dtype != self.weight.dtype:
            raise ValueError(
                f"FusedGroup: rounding keys of {self.keys.dtype} for a {self.weight.dtype} weight"
            )


def group_batch(
    kjt: KeyedJaggedIds, feats: Sequence[tuple[TableConfig, str]], bases: Sequence[int]
) -> GroupBatch:
    """The bags of ``feats`` (``(table config, feature)`` pairs, in output order) as one
    :class:`GroupBatch`: ids offset by their feature's ``bases[k]``, one bag per sample
    for pooled features ("mean" as per-id weights ``1/len``) and one bag per id for
    unpooled ones. ``kjt`` holds the features; the ids are checked by the caller."""
    device = kjt.ids.device
    if not feats:
        empty = torch.zeros(0, dtype=torch.int64, device=device)
        return GroupBatch(empty, torch.zeros(1, dtype=torch.int64, device=device), None)
    names = [f for _, f in feats]
    sub = kjt if names == kjt.keys else kjt.select(names)
    k, b = len(names), kjt.batch_size
    per_key = sub.lengths.view(k, b).sum(dim=1)  # [K] ids per key
    n = sub.ids.numel()
    if any(bases):
        base = boundary.constant(tuple(bases), device)  # [K], the same every step
        ids = sub.ids + torch.repeat_interleave(base, per_key, output_size=n)  # [N]
    else:
        ids = sub.ids
    unpooled = any(c.pooling == "none" for c, _ in feats)
    mean = any(c.pooling == "mean" for c, _ in feats)
    starts = sub.key_starts() if (unpooled or mean) else []  # host ints, measured once
    counts = [starts[i + 1] - starts[i] for i in range(k)] if starts else []
    if not unpooled:
        offsets = sub.offsets()  # [K * B + 1]
    else:
        pieces = [
            torch.ones(counts[i], dtype=torch.int64, device=device)
            if cfg.pooling == "none"
            else sub.lengths[i * b : (i + 1) * b]
            for i, (cfg, _) in enumerate(feats)
        ]
        offsets = offsets_from_lengths(torch.cat(pieces))
    weights = sub.weights
    if mean:
        scale = torch.ones(n, dtype=torch.float32, device=device)  # [N]
        start = 0
        for i, (cfg, _) in enumerate(feats):
            if cfg.pooling == "mean":
                lens = sub.lengths[i * b : (i + 1) * b]  # [B]
                inv = 1.0 / lens.clamp(min=1).to(torch.float32)  # [B]
                scale[start : start + counts[i]] = torch.repeat_interleave(
                    inv, lens, output_size=counts[i]
                )
            start += counts[i]
        weights = scale if weights is None else weights.to(torch.float32) * scale
    elif weights is not None:
        weights = weights.to(torch.float32)
    return GroupBatch(ids, offsets, weights)


def feature_sizes(
    kjt: KeyedJaggedIds, feats: Sequence[tuple[TableConfig, str]]
) -> tuple[list[int], list[int]]:
    """``(seq, sizes)`` of a group's features (bags laid out by :func:`group_batch`):
    ``seq[k]`` the ids per sample of unpooled feature ``k`` (checked equal for every
    sample; -1 for pooled ones) and ``sizes[k]`` its rows of the lookup (``B`` or
    ``B * T``)."""
    return groups_feature_sizes(kjt, [feats])[0]


def groups_feature_sizes(
    kjt: KeyedJaggedIds, groups: Sequence[Sequence[tuple[TableConfig, str]]]
) -> list[tuple[list[int], list[int]]]:
    """:func:`feature_sizes` of each group, the sequence lengths of every unpooled
    feature of every group read back at once (one host sync on a GPU, none without
    unpooled features)."""
    b = kjt.batch_size
    unpooled = [
        (cfg, feat, kjt.key_slice(feat).lengths)
        for feats in groups
        for cfg, feat in feats
        if cfg.pooling == "none"
    ]
    lengths = iter(sequence_lengths(unpooled))
    out = []
    for feats in groups:
        seq = [next(lengths) if cfg.pooling == "none" else -1 for cfg, _ in feats]
        out.append((seq, [b if t < 0 else b * t for t in seq]))
    return out


def name_parts(
    parts: Sequence[torch.Tensor],
    kjt: KeyedJaggedIds,
    feats: Sequence[tuple[TableConfig, str]],
    seq: Sequence[int],
) -> dict[str, torch.Tensor]:
    """``{feature: [B, D]}`` (``[B, T, D]`` for unpooled features) from the parts of
    a lookup split by :func:`feature_sizes`."""
    b = kjt.batch_size
    out: dict[str, torch.Tensor] = {}
    for (cfg, feat), t, part in zip(feats, seq, parts, strict=True):
        out[feat] = part if t < 0 else part.view(b, t, cfg.dim)
    return out


def lookup(weight: torch.Tensor, batch: GroupBatch) -> torch.Tensor:
    """``[nbags, D]`` float32: the weighted sum of each bag's rows (zeros for empty bags).

    On CUDA with triton installed, the Triton gather+pool kernel
    (:mod:`embedding.kernels.triton_pool`); elsewhere ``F.embedding_bag``, or for narrow
    rows :func:`narrow_lookup`.
    """
    if use_triton(weight):
        from embedding.kernels.triton_pool import pooled_lookup

        return pooled_lookup(
            weight,
            batch.ids,
            batch.offsets,
            mode="sum",
            per_sample_weights=batch.weights,
            validate=False,
        )
    if weight.dtype != torch.float32:
        return narrow_lookup(weight, batch)
    return F.embedding_bag(
        batch.ids,
        weight,
        batch.offsets,
        mode="sum",
        per_sample_weights=batch.weights,
        include_last_offset=True,
    )


def narrow_lookup(weight: torch.Tensor, batch: GroupBatch) -> torch.Tensor:
    """:func:`lookup` of a narrow (fp16/bf16) ``weight`` ``[R, D]``: float32 ``[nbags, D]``,
    pooled in float32 by the C pass where it runs (one read of each narrow row), else by
    ``F.embedding_bag`` over the gathered rows widened (``[N, D]`` float32)."""
    ids = batch.ids.contiguous()
    out = narrow_rows.pool(weight, ids, batch.offsets.contiguous(), batch.kernel_weights())
    if out is not None:
        return out
    rows = weight.index_select(0, ids).to(torch.float32)  # [N, D]
    return F.embedding_bag(
        torch.arange(ids.numel(), device=ids.device),
        rows,
        batch.offsets,
        mode="sum",
        per_sample_weights=batch.weights,
        include_last_offset=True,
    )


def segment_sum(
    ids: torch.Tensor, src: torch.Tensor, src_index: torch.Tensor, weights: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Coalesce per unique id: ``(unique ids [U] sorted, sums [U, D])`` where
    ``sums[u] = sum over i with ids[i] == unique[u] of weights[i] * src[src_index[i]]``.

    ``ids``, ``src_index`` int64 ``[N]``, ``src`` ``[M, D]``, ``weights`` ``[N]`` or
    None (all ones). Runs as a sort plus one ``embedding_bag`` whose bags are the
    runs of equal ids, so no ``[N, D]`` temporary is built.
    """
    srt, perm = torch.sort(ids)  # [N], [N]
    uniq, counts = torch.unique_consecutive(srt, return_counts=True)  # [U], [U]
    return uniq, sorted_segment_sum(perm, counts, src, src_index, weights)


def sorted_segment_sum(
    perm: torch.Tensor,
    counts: torch.Tensor,
    src: torch.Tensor,
    src_index: torch.Tensor | None,
    weights: torch.Tensor | None,
) -> torch.Tensor:
    """``[U, D]``: segment ``u`` sums ``weights[p] * src[src_index[p]]`` over the
    positions ``p = perm[i]`` of its run (``counts[u]`` consecutive entries of
    ``perm``). ``src_index`` None: ``src`` rows are the positions themselves. One
    ``embedding_bag`` whose bags are the runs; no ``[N, D]`` temporary."""
    idx = perm if src_index is None else src_index[perm]  # [N]
    w = None if weights is None else weights[perm].to(src.dtype)
    return F.embedding_bag(
        idx,
        src,
        offsets_from_lengths(counts),
        mode="sum",
        per_sample_weights=w,
        include_last_offset=True,
    )  # [U, D]


def row_gradients(batch: GroupBatch, grad_out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The coalesced gradient of a lookup: ``(unique flat rows [U], grads [U, D])``."""
    bag_lengths = batch.offsets[1:] - batch.offsets[:-1]  # [nbags]
    bag_of_id = torch.repeat_interleave(
        torch.arange(batch.num_bags, device=grad_out.device),
        bag_lengths,
        output_size=batch.ids.numel(),  # known: no read of the lengths back from a device
    )  # [N]
    return segment_sum(batch.ids, grad_out, bag_of_id, batch.weights)


def apply_optimizer(group: FusedGroup, rows: torch.Tensor, grads: torch.Tensor) -> None:
    """Apply the group's optimizer to the distinct flat ``rows`` [U] with ``grads`` [U, D]
    in place: gather the touched rows and state, run the ps optimizer's ``apply``
    on the copies (the exact math of the parameter server), scatter them back.
    Row-wise Adagrad (the torch fallback of the C kernel) writes in place instead.
    Narrow rows: the copies are widened, and written back rounded with the keys of
    the rows' clocks after this update (the ps store's order of operations)."""
    if rows.numel() == 0:
        return
    opt = group.optimizer
    if group.keys is not None:
        w = group.weight.index_select(0, rows).to(torch.float32)  # [U, D] widened copies
        s = group.state.index_select(0, rows)  # [U, S]
        opt.apply(w, s, grads.to(torch.float32))
        group.clocks.index_add_(0, rows, torch.ones_like(rows))
        versions = group.clocks.index_select(0, rows)  # [U] the clocks after the update
        group.weight.index_copy_(0, rows, narrow_rows.round_rows(w, group.keys, rows, versions))
        if s.shape[1] > 0:
            group.state.index_copy_(0, rows, s)
        return
    if isinstance(opt, RowWiseAdagrad) and group.state.shape[1] == 1:
        # The same formula without gathering and scattering [U, D] rows: the state
        # is updated by index_add_ (rows are distinct), the step added by index_add_.
        acc = group.state[:, 0]  # [R] view
        acc.index_add_(0, rows, grads.to(torch.float32).square().mean(dim=1))
        denom = acc.index_select(0, rows).sqrt_().add_(opt.eps)  # [U]
        step = grads.to(torch.float32) / denom.unsqueeze(1)  # [U, D]
        group.weight.index_add_(0, rows, step, alpha=-opt.lr)
        group.clocks.index_add_(0, rows, torch.ones_like(rows))
        return
    w = group.weight.index_select(0, rows)  # [U, D]
    s = group.state.index_select(0, rows)  # [U, S]
    group.optimizer.apply(w, s, grads.to(torch.float32))
    group.weight.index_copy_(0, rows, w)
    if s.shape[1] > 0:
        group.state.index_copy_(0, rows, s)
    group.clocks.index_add_(0, rows, torch.ones_like(rows))


class FusedLookupFunction(torch.autograd.Function):
    """Lookup of every fused group in one autograd node; the backward updates the rows.

    One node for all groups (rather than one per group) means the backward runs
    once whenever any output is used, so data-parallel ranks always enter the
    same collectives in the same order.
    """

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: torch.autograd.function.FunctionCtx,
        anchor: torch.Tensor,
        groups: list[FusedGroup],
        batches: list[GroupBatch],
        group: ProcessGroup,
        splits: list[list[int]],
    ) -> tuple[torch.Tensor, ...]:
        """Each group's ``[nbags, D]`` lookup, split by ``splits`` (rows per feature;
        ``[0]`` for a group without features): the outputs are the parts of all
        groups in order, so autograd hands back one gradient per feature and the
        C backward reads them in place (a split done outside this node would
        concatenate them into a ``[nbags, D]`` copy first, ~4 ms per DLRM step)."""
        ctx.groups = groups  # type: ignore[attr-defined]
        ctx.batches = batches  # type: ignore[attr-defined]
        ctx.comm = group  # type: ignore[attr-defined]
        ctx.splits = splits  # type: ignore[attr-defined]
        parts: list[torch.Tensor] = []
        for g, b, sizes in zip(groups, batches, splits, strict=True):
            parts.extend(lookup(g.weight, b).split(sizes))
        return tuple(parts)

    @staticmethod
    def backward(  # type: ignore[override]
        ctx: torch.autograd.function.FunctionCtx, *grad_parts: torch.Tensor
    ) -> tuple[None, ...]:
        groups: list[FusedGroup] = ctx.groups  # type: ignore[attr-defined]
        batches: list[GroupBatch] = ctx.batches  # type: ignore[attr-defined]
        pg: ProcessGroup = ctx.comm  # type: ignore[attr-defined]
        splits: list[list[int]] = ctx.splits  # type: ignore[attr-defined]
        start = 0
        for g, b, sizes in zip(groups, batches, splits, strict=True):
            parts = grad_parts[start : start + len(sizes)]  # [rows_f, D] each
            start += len(sizes)
            if pg.size == 1 and _cpu_rowwise_adagrad_parts(g, b, parts):
                continue
            grad = (parts[0] if len(parts) == 1 else torch.cat(parts)).contiguous()  # [nbags, D]
            triton_update = _use_triton_update(g)
            if triton_update and pg.size == 1:
                from embedding.kernels.triton_optimizers import fused_backward_

                fused_backward_(
                    g.weight, g.state, b.ids, b.offsets, grad, g.optimizer,
                    mode="sum", per_sample_weights=b.weights, clocks=g.clocks, validate=False,
                    rounding=g.keys,
                )  # fmt: skip
                continue
            rows, grads = row_gradients(b, grad)  # [U], [U, D]
            if pg.size > 1:
                rows, grads = _combine_ranks(pg, rows, grads)
                if _cpu_rowwise_adagrad_rows(g, rows, grads):
                    continue
            if triton_update:
                from embedding.kernels.triton_optimizers import apply_rows_

                apply_rows_(
                    g.weight, g.state, rows, grads.to(torch.float32).contiguous(), g.optimizer,
                    clocks=g.clocks, rounding=g.keys,
                )  # fmt: skip
                continue
            apply_optimizer(g, rows, grads)
        return None, None, None, None, None


def _cpu_rowwise_adagrad_parts(g: FusedGroup, b: GroupBatch, parts: Sequence[torch.Tensor]) -> bool:
    """Backward + row-wise Adagrad of one group in the C kernel (:mod:`ps.kernels.rowwise_adagrad`),
    reading the per-feature gradients ``parts`` in place: one sort, then one pass per
    unique row. False (nothing done) where it does not apply."""
    opt = g.optimizer
    kernel = cpu_kernel if g.keys is None else narrow_rows
    if not isinstance(opt, RowWiseAdagrad) or g.weight.is_cuda or not kernel.available():
        return False
    if b.ids.numel() == 0:
        return True
    srt, perm = cpu_kernel.sort_ids(b.ids)  # [N], [N]
    if g.keys is not None:
        return narrow_rows.rowwise_adagrad_parts_(
            g.weight, g.state, g.clocks, srt, perm, b.kernel_offsets(), kernel_parts(parts),
            lr=opt.lr, eps=opt.eps, keys=g.keys, weights=b.kernel_weights(),
        )  # fmt: skip
    return cpu_kernel.rowwise_adagrad_parts_(
        g.weight, g.state, g.clocks, srt, perm, b.kernel_offsets(), kernel_parts(parts),
        lr=opt.lr, eps=opt.eps, weights=b.kernel_weights(),
    )  # fmt: skip


def _cpu_rowwise_adagrad_rows(g: FusedGroup, rows: torch.Tensor, grads: torch.Tensor) -> bool:
    """Row-wise Adagrad of distinct sorted ``rows`` [U] with ``grads`` [U, D] in the C kernel."""
    opt = g.optimizer
    if not isinstance(opt, RowWiseAdagrad) or g.weight.is_cuda:
        return False
    grads = grads.to(torch.float32).contiguous()
    if g.keys is not None:
        return narrow_rows.rowwise_adagrad_(
            g.weight, g.state, g.clocks, rows.contiguous(), grads, lr=opt.lr, eps=opt.eps,
            keys=g.keys,
        )  # fmt: skip
    return cpu_kernel.rowwise_adagrad_(
        g.weight, g.state, g.clocks, rows.contiguous(), grads, lr=opt.lr, eps=opt.eps
    )


def _use_triton_update(g: FusedGroup) -> bool:
    """The Triton fused backward (:mod:`embedding.kernels.triton_optimizers`) updates CUDA
    tables for every ps optimizer; CPU tables keep the C kernel and the torch path."""
    return g.optimizer.kind in FUSED_OPTIMIZERS and use_triton(g.weight)


def _combine_ranks(
    pg: ProcessGroup, rows: torch.Tensor, grads: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Replicated data parallel: every rank's coalesced row gradients, divided by the
    group size (the global loss is the mean of the ranks' mean losses), coalesced
    again, so every replica applies the identical update."""
    all_rows = pg.allgatherv(rows.contiguous())  # [sum U_r]
    all_grads = pg.allgatherv(grads.contiguous())  # [sum U_r, D]
    all_grads.div_(pg.size)
    index = torch.arange(all_rows.numel(), device=all_rows.device)
    return segment_sum(all_rows, all_grads, index, None)
