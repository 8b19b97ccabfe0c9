"""Bucket assignment for bucketed gradient allreduce.

Gradients become ready during backward roughly in the reverse of the order in
which the parameters were registered (the last layer's gradients come first).
So parameters are walked in REVERSE registration order and packed into buckets
of at most ``bucket_bytes`` bytes each, one dtype per bucket (a bucket is one
flat buffer, one collective). A parameter larger than the cap gets a bucket of
its own. Every rank computes the same assignment from the same module, so the
k-th collective means the same bucket everywhere.

Example, four float32 parameters registered as ``w0 (4 KB), b0, w1 (4 KB), b1``
with a 5 KB cap::

    reverse order: b1, w1, b0, w0
    bucket 0: [b1, w1]   offsets [0, n(b1)]
    bucket 1: [b0, w0]
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True)
class Bucket:
    """One flat gradient buffer: which parameters, where each one sits in it.

    ``params`` are indices into the parameter list given to :func:`assign_buckets`;
    parameter ``params[j]`` occupies ``[offsets[j], offsets[j] + numels[j])`` of the
    flat buffer of ``numel`` elements of ``dtype``.
    """

    index: int
    dtype: torch.dtype
    params: tuple[int, ...]
    offsets: tuple[int, ...]
    numels: tuple[int, ...]
    numel: int

    @property
    def nbytes(self) -> int:
        return self.numel * _itemsize(self.dtype)


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def assign_buckets(
    params: Sequence[torch.Tensor], bucket_bytes: int, first_bucket_bytes: int | None = None
) -> list[Bucket]:
    """Pack ``params`` into buckets of at most ``bucket_bytes`` bytes, reverse order.

    One bucket is open per dtype; a parameter that would overflow its dtype's open
    bucket closes it and opens a new one. Buckets are numbered in the order they
    were opened, which is (approximately) the order their gradients become ready.
    ``first_bucket_bytes`` (default: ``bucket_bytes``) caps bucket 0 alone: a small
    first bucket starts communicating early in backward (torch DDP uses 1 MiB).
    """
    for name, value in (("bucket_bytes", bucket_bytes), ("first_bucket_bytes", first_bucket_bytes)):
        if value is None and name == "first_bucket_bytes":
            continue
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"assign_buckets: {name} must be an int >= 1, got {value!r}")
    first_cap = bucket_bytes if first_bucket_bytes is None else first_bucket_bytes
    # dtype -> (order key, member indices, member numels, bytes so far)
    open_: dict[torch.dtype, tuple[int, list[int], list[int], int]] = {}
    closed: list[tuple[int, torch.dtype, list[int], list[int]]] = []
    opened = 0
    for i in reversed(range(len(params))):
        p = params[i]
        n = p.numel()
        size = n * p.element_size()
        cur = open_.get(p.dtype)
        cap = first_cap if cur is not None and cur[0] == 0 else bucket_bytes
        if cur is not None and cur[1] and cur[3] + size > cap:
            closed.append((cur[0], p.dtype, cur[1], cur[2]))
            cur = None
        if cur is None:
            cur = (opened, [], [], 0)
            opened += 1
        cur[1].append(i)
        cur[2].append(n)
        open_[p.dtype] = (cur[0], cur[1], cur[2], cur[3] + size)
    for dtype, (key, members, numels, _) in open_.items():
        closed.append((key, dtype, members, numels))
    closed.sort(key=lambda c: c[0])
    buckets = []
    for index, (_, dtype, members, numels) in enumerate(closed):
        offsets = [0]
        for n in numels[:-1]:
            offsets.append(offsets[-1] + n)
        buckets.append(
            Bucket(
                index=index,
                dtype=dtype,
                params=tuple(members),
                offsets=tuple(offsets),
                numels=tuple(numels),
                numel=sum(numels),
            )
        )
    return buckets
