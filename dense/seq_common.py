"""What the sequential encoders (:mod:`dense.sasrec`, :mod:`dense.hstu`) share: jagged <-> padded.

A batch of ``B`` jagged sequences is one ``[N, D]`` tensor of rows and ``offsets [B + 1]``
(sample ``b``'s rows are ``offsets[b]:offsets[b + 1]``, oldest first)::

    offsets = [0, 3, 3, 5]          B = 3, lengths [3, 0, 2], N = 5, T = 3
    rows    = [a0 a1 a2 | c0 c1]    [N, D]
    padded  = [[a0 a1 a2],          [B, T, D], zeros where valid is False
               [ .  .  .],
               [c0 c1  .]]
    valid   = [[1 1 1], [0 0 0], [1 1 0]]   [B, T] bool
    rows_b  = [0 0 0 2 2]           [N] the sample of each row
    rows_t  = [0 1 2 0 1]           [N] its position in the sample (0 = oldest)

The index tensors are computed on the device from ``offsets``; the only read back to the
host is one small tensor (``T``, and three numbers that validate ``offsets``), needed
because ``T`` is a shape.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

POSITION_ALIGNS = ("first", "last")  # what position 0 / max_seq_len - 1 is anchored to


@dataclass(frozen=True, slots=True)
class JaggedIndex:
    """Where each of the ``N`` jagged rows sits in the padded ``[B, T]`` layout."""

    batch: int  # B
    t_max: int  # T: the longest sequence (0 when N == 0)
    rows_b: torch.Tensor  # [N] int64: sample of each row
    rows_t: torch.Tensor  # [N] int64: position of each row in its sample, from the start
    valid: torch.Tensor  # [B, T] bool: True at real (not padding) positions
    lengths: torch.Tensor  # [B] int64: each sample's length

    def positions(self, align: str, max_seq_len: int) -> torch.Tensor:
        """The position-embedding index of each padded slot, ``[T]`` or ``[B, T]``.

        ``align="first"``: 0 for each sample's oldest item (RecBole's left-aligned
        layout), so an item's position does not depend on what follows it. ``"last"``:
        ``max_seq_len - 1`` for each sample's newest item (the original SASRec code's
        left-padded layout), so the newest input of a training window and the query of
        an evaluation sample share a position; an item's position then says how many
        inputs of its sample follow it (never which). Padding slots get a valid index
        (clamped); no real query attends to them."""
        t = torch.arange(self.t_max, device=self.valid.device)  # [T]
        if align == "first":
            return t
        start = max_seq_len - self.lengths  # [B]: the position of each oldest item
        return (start[:, None] + t[None, :]).clamp_(max=max_seq_len - 1)  # [B, T]

    def pad(self, values: torch.Tensor) -> torch.Tensor:
        """``[N, ...]`` -> ``[B, T, ...]``, zeros at padding positions (differentiable)."""
        out = values.new_zeros((self.batch, self.t_max, *values.shape[1:]))
        return out.index_put((self.rows_b, self.rows_t), values)

    def unpad(self, padded: torch.Tensor) -> torch.Tensor:
        """``[B, T, ...]`` -> ``[N, ...]``: the real positions, in jagged order."""
        return padded[self.rows_b, self.rows_t]


def jagged_index(
    who: str, item_vecs: torch.Tensor, offsets: torch.Tensor, *, dim: int, max_seq_len: int
) -> JaggedIndex:
    """Validate ``item_vecs [N, dim]`` and ``offsets [B + 1]`` (moved to ``item_vecs``'s
    device if elsewhere) and build the padded layout.

    ``who`` prefixes the error messages. Sequences longer than ``max_seq_len`` are refused
    (the caller keeps the most recent ``max_seq_len`` items of a longer history)."""
    if item_vecs.dim() != 2 or item_vecs.shape[1] != dim:
        raise ValueError(
            f"{who}: item_vecs must be [N, dim={dim}], got shape {tuple(item_vecs.shape)}"
        )
    if not item_vecs.is_floating_point():
        raise TypeError(f"{who}: item_vecs must be floating point, got {item_vecs.dtype}")
    if offsets.dim() != 1 or offsets.shape[0] < 1:
        raise ValueError(f"{who}: offsets must be [B + 1] with B >= 0, got {tuple(offsets.shape)}")
    if offsets.dtype != torch.int64:
        raise TypeError(f"{who}: offsets must be int64, got {offsets.dtype}")
    offsets = offsets.to(item_vecs.device)  # a no-op when already there
    n, b = item_vecs.shape[0], offsets.shape[0] - 1
    lengths = offsets[1:] - offsets[:-1]  # [B]
    # min and max over the lengths and a 0, so that they exist for B == 0; one read.
    with_zero = torch.cat([lengths, lengths.new_zeros(1)])
    stats = torch.stack([offsets[0], offsets[-1], with_zero.min(), with_zero.max()])
    first, last, shortest, longest = (int(v) for v in stats.tolist())
    if first != 0 or last != n:
        raise ValueError(
            f"{who}: offsets must run from 0 to N={n} (the rows of item_vecs), "
            f"got {first} .. {last}"
        )
    if shortest < 0:
        raise ValueError(f"{who}: offsets must be non-decreasing, a length is {shortest}")
    if longest > max_seq_len:
        raise ValueError(
            f"{who}: a sequence has {longest} items, more than max_seq_len={max_seq_len} "
            "(keep the most recent ones)"
        )
    dev = item_vecs.device
    rows_b = torch.repeat_interleave(torch.arange(b, device=dev), lengths, output_size=n)  # [N]
    rows_t = torch.arange(n, device=dev) - offsets[rows_b]  # [N]
    valid = torch.arange(longest, device=dev)[None, :] < lengths[:, None]  # [B, T]
    return JaggedIndex(
        batch=b, t_max=longest, rows_b=rows_b, rows_t=rows_t, valid=valid, lengths=lengths
    )


def empty_output(module: nn.Module, item_vecs: torch.Tensor) -> torch.Tensor:
    """The ``[0, D]`` output of an empty batch, tied to every parameter with weight 0.

    A data-parallel rank can get an empty batch; its backward must still give every
    parameter a gradient (zeros here) so that every rank allreduces the same buckets."""
    tie = torch.stack([p.sum() for p in module.parameters()]).sum() * 0.0  # [] exact 0
    return item_vecs[:0] + tie.to(item_vecs.dtype)  # [0, D]
