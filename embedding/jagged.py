"""The jagged batch of sparse ids: the only way ids travel between layers.

Imports only torch and :mod:`comm.device` at runtime
(:meth:`KeyedJaggedIds.bucketize_by_rank` imports :mod:`embedding.jagged_dist` when
called), so loaders, collections and jobs can all depend on it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from comm import boundary
from comm.device import exact_device

if TYPE_CHECKING:  # only for annotations (see the module docstring)
    from embedding.jagged_dist import IdBuckets
    from embedding.sharding_plan import ShardingPlan


def offsets_from_lengths(lengths: torch.Tensor) -> torch.Tensor:
    """``[n]`` lengths -> ``[n + 1]`` int64 offsets starting at 0."""
    out = torch.zeros(lengths.numel() + 1, dtype=torch.int64, device=lengths.device)
    torch.cumsum(lengths, dim=0, out=out[1:])
    return out


@dataclass(slots=True, frozen=True)
class JaggedIds:
    """The ids of one feature for a batch: sample ``b`` owns
    ``ids[offsets[b]:offsets[b + 1]]`` (``lengths[b]`` of them).

    ``ids`` int64 ``[N]``, ``lengths`` int64 ``[B]``, ``weights`` float ``[N]`` or None.
    Built by :meth:`KeyedJaggedIds.key_slice`; the tensors are views, not copies.
    """

    ids: torch.Tensor
    lengths: torch.Tensor
    weights: torch.Tensor | None = None

    @property
    def batch_size(self) -> int:
        return int(self.lengths.numel())

    def offsets(self) -> torch.Tensor:
        """``[B + 1]`` int64: where each sample's ids start (and the total at the end)."""
        return offsets_from_lengths(self.lengths)

    def __len__(self) -> int:
        return self.batch_size

    def to_lists(self) -> list[list[int]]:
        """Per-sample id lists (for tests and debugging; loops in Python)."""
        return [chunk.tolist() for chunk in torch.split(self.ids, self.lengths.tolist())]


class KeyedJaggedIds:
    """Sparse ids of ``K`` features for ``B`` samples, in three flat tensors.

    ``lengths`` is key-major, like torchrec's ``KeyedJaggedTensor``: the ``B``
    lengths of key 0, then the ``B`` lengths of key 1, and so on. ``ids`` holds
    the ids in the same order. Example with keys ``["f1", "f2"]`` and ``B = 3``::

                    sample 0     sample 1   sample 2
        "f1":       [ 7, 2 ]     [ ]        [ 4 ]
        "f2":       [ 9 ]        [ 1, 1 ]   [ 3, 5, 6 ]

        keys    = ["f1", "f2"]
        ids     = [ 7, 2,  4,  9,  1, 1,  3, 5, 6 ]       # [N]      N = 9
        lengths = [ 2, 0, 1,   1, 2, 3 ]                  # [K * B]  key-major
        offsets = [ 0, 2, 2, 3,   4, 6, 9 ]               # [K * B + 1]
                    |-- f1 --|    |-- f2 --|

    ``weights`` (optional, float ``[N]``) gives each id a weight, used by
    ``sum`` pooling (``pooled = sum_i weights[i] * row[ids[i]]``).

    Reshaping by key (none of these touch the samples)::

        kjt.select(["f2"])        keys ["f2"],       ids [9, 1, 1, 3, 5, 6], lengths [1, 2, 3]
        kjt.permute(["f2", "f1"]) keys ["f2", "f1"], ids [9, 1, 1, 3, 5, 6, 7, 2, 4]
        kjt.split([["f1"], ["f2"]])           -> [select(["f1"]), select(["f2"])]
        KeyedJaggedIds.concat([a, b])         -> keys of a then b (same batch size)
        kjt.sample_slice(1, 3)                -> samples 1, 2 of every key

    Per-table dedup (unique ids + inverse) is :func:`embedding.dedup.dedup_per_table`;
    splitting by owner rank for an alltoallv is :meth:`bucketize_by_rank`.

    Build one from Python lists with :meth:`from_lists`; select one key with
    ``kjt["f1"]`` (a :class:`JaggedIds`). ``len(kjt)`` is the number of keys.
    """

    __slots__ = ("_keys", "_ids", "_lengths", "_weights", "_index", "_offsets", "_starts")

    def __init__(
        self,
        keys: Sequence[str],
        ids: torch.Tensor,
        lengths: torch.Tensor,
        weights: torch.Tensor | None = None,
    ) -> None:
        keys = list(keys)
        if not all(isinstance(k, str) for k in keys):
            raise TypeError(f"KeyedJaggedIds: keys must be strings, got {keys!r}")
        index = {k: i for i, k in enumerate(keys)}
        if len(index) != len(keys):
            dups = sorted({k for k in keys if keys.count(k) > 1})
            raise ValueError(f"KeyedJaggedIds: duplicate keys {dups} in {keys}")
        if not isinstance(ids, torch.Tensor) or ids.dtype != torch.int64:
            what = ids.dtype if isinstance(ids, torch.Tensor) else type(ids).__name__
            raise TypeError(f"KeyedJaggedIds: ids must be an int64 tensor, got {what}")
        if (
            not isinstance(lengths, torch.Tensor)
            or lengths.is_floating_point()
            or (lengths.dtype in (torch.bool, torch.complex64, torch.complex128))
        ):
            what = lengths.dtype if isinstance(lengths, torch.Tensor) else type(lengths).__name__
            raise TypeError(f"KeyedJaggedIds: lengths must be an integer tensor, got {what}")
        if ids.dim() != 1 or lengths.dim() != 1:
            raise ValueError(
                f"KeyedJaggedIds: ids and lengths must be 1-D, got shapes "
                f"{tuple(ids.shape)} and {tuple(lengths.shape)}"
            )
        lengths = lengths.to(torch.int64)
        n_len = int(lengths.numel())
        if (len(keys) == 0 and n_len != 0) or (len(keys) > 0 and n_len % len(keys) != 0):
            raise ValueError(
                f"KeyedJaggedIds: {n_len} lengths is not a multiple of the {len(keys)} keys "
                "(lengths are key-major: batch_size per key)"
            )
        if n_len > 0 and bool((lengths < 0).any()):
            pos = int(torch.nonzero(lengths < 0)[0, 0])
            raise ValueError(
                f"KeyedJaggedIds: lengths must be >= 0, got {int(lengths[pos])} at position {pos}"
            )
        total = int(lengths.sum())
        if total != ids.numel():
            raise ValueError(
                f"KeyedJaggedIds: lengths add up to {total} but there are {ids.numel()} ids"
            )
        if weights is not None:
            if not isinstance(weights, torch.Tensor) or not weights.is_floating_point():
                what = weights.dtype if isinstance(weights, torch.Tensor) else type(weights)
                raise TypeError(f"KeyedJaggedIds: weights must be a float tensor, got {what}")
            if tuple(weights.shape) != tuple(ids.shape):
                raise ValueError(
                    f"KeyedJaggedIds: weights have shape {tuple(weights.shape)}, expected "
                    f"{tuple(ids.shape)} (one per id)"
                )
        self._keys = keys
        self._ids = ids
        self._lengths = lengths
        self._weights = weights
        self._index = index
        self._offsets: torch.Tensor | None = None
        self._starts: list[int] | None = None  # see key_starts

    @classmethod
    def _trusted(
        cls,
        source: KeyedJaggedIds,
        ids: torch.Tensor,
        lengths: torch.Tensor,
        weights: torch.Tensor | None,
        keys: list[str] | None = None,
        starts: list[int] | None = None,
    ) -> KeyedJaggedIds:
        """A batch with ``source``'s keys (or ``keys``, with their id ``starts``) and the
        same values in other tensors (a copy on another device, pinned, a selection of
        checked keys): no checks, which would read device values."""
        out = cls.__new__(cls)
        out._keys = source._keys if keys is None else keys
        out._ids = ids
        out._lengths = lengths
        out._weights = weights
        out._index = source._index if keys is None else {k: i for i, k in enumerate(keys)}
        out._offsets = None
        out._starts = source._starts if keys is None else starts
        return out

    # ------------------------------------------------------------ construction

    @classmethod
    def from_lists(
        cls,
        ids: Mapping[str, Sequence[Sequence[int]]],
        weights: Mapping[str, Sequence[Sequence[float]]] | None = None,
    ) -> KeyedJaggedIds:
        """``{"f1": [[7, 2], [], [4]], "f2": [[9], [1, 1], [3, 5, 6]]}`` -> a batch of 3.

        ``weights``, if given, has the same keys and nesting as ``ids``.
        """
        keys = list(ids)
        sizes = {k: len(ids[k]) for k in keys}
        if len(set(sizes.values())) > 1:
            raise ValueError(
                f"KeyedJaggedIds.from_lists: every key needs the same number of samples, "
                f"got {sizes}"
            )
        lengths = [len(sample) for k in keys for sample in ids[k]]
        flat = [int(i) for k in keys for sample in ids[k] for i in sample]
        w_tensor = None
        if weights is not None:
            if set(weights) != set(keys):
                raise ValueError(
                    f"KeyedJaggedIds.from_lists: weights keys {sorted(weights)} differ from "
                    f"ids keys {sorted(keys)}"
                )
            w_lengths = [len(s) for k in keys for s in weights[k]]
            if w_lengths != lengths:
                raise ValueError(
                    "KeyedJaggedIds.from_lists: weights must have the same nesting as ids, "
                    f"got sample lengths {w_lengths} for lengths {lengths}"
                )
            w_tensor = torch.tensor(
                [float(w) for k in keys for s in weights[k] for w in s], dtype=torch.float32
            )
        return cls(
            keys,
            torch.tensor(flat, dtype=torch.int64),
            torch.tensor(lengths, dtype=torch.int64),
            w_tensor,
        )

    # ------------------------------------------------------------ accessors

    @property
    def keys(self) -> list[str]:
        return list(self._keys)

    @property
    def ids(self) -> torch.Tensor:
        """int64 ``[N]``, key-major."""
        return self._ids

    @property
    def lengths(self) -> torch.Tensor:
        """int64 ``[K * B]``, key-major."""
        return self._lengths

    @property
    def weights(self) -> torch.Tensor | None:
        """float ``[N]`` or None."""
        return self._weights

    @property
    def batch_size(self) -> int:
        return int(self._lengths.numel()) // len(self._keys) if self._keys else 0

    def offsets(self) -> torch.Tensor:
        """int64 ``[K * B + 1]``: ``ids[offsets[i]:offsets[i + 1]]`` is bag ``i``."""
        if self._offsets is None:
            self._offsets = offsets_from_lengths(self._lengths)
        return self._offsets

    def __len__(self) -> int:
        return len(self._keys)

    def __contains__(self, key: object) -> bool:
        return key in self._index

    def __repr__(self) -> str:
        w = "" if self._weights is None else ", weighted"
        return (
            f"KeyedJaggedIds(keys={self._keys}, batch_size={self.batch_size}, "
            f"num_ids={self._ids.numel()}{w})"
        )

    def key_starts(self) -> list[int]:
        """``K + 1`` Python ints: key ``k``'s ids are ``ids[starts[k]:starts[k + 1]]``.

        Computed once per batch (one read of ``K`` sums, a host sync on a GPU) and kept
        by :meth:`to` and :meth:`pin_memory`, so a batch measured on the host and then
        moved slices its keys on the device without reading device memory."""
        if self._starts is None:
            per_key = self.ids_per_key()  # [K]
            counts = per_key.tolist() if per_key.is_cpu else boundary.read(per_key)
            starts = [0]
            for n in counts:
                starts.append(starts[-1] + int(n))
            self._starts = starts
        return self._starts

    def key_slice(self, key: str) -> JaggedIds:
        """The ids of one key (views into this batch's tensors)."""
        try:
            k = self._index[key]
        except KeyError:
            raise KeyError(f"key {key!r} not in this batch; keys: {self._keys}") from None
        b = self.batch_size
        starts = self.key_starts()
        start, stop = starts[k], starts[k + 1]
        w = None if self._weights is None else self._weights[start:stop]
        return JaggedIds(self._ids[start:stop], self._lengths[k * b : (k + 1) * b], w)

    def __getitem__(self, key: str) -> JaggedIds:
        return self.key_slice(key)

    def to(self, device: torch.device | str, non_blocking: bool = False) -> KeyedJaggedIds:
        """The batch on ``device`` (``self`` if it is there already). The values are not
        checked again (they were when this batch was built), so moving reads nothing
        back from a device."""
        device = exact_device(device)
        here = self._ids.device == device and self._lengths.device == device
        if here and (self._weights is None or self._weights.device == device):
            return self
        w = None if self._weights is None else self._weights.to(device, non_blocking=non_blocking)
        return KeyedJaggedIds._trusted(
            self,
            self._ids.to(device, non_blocking=non_blocking),
            self._lengths.to(device, non_blocking=non_blocking),
            w,
        )

    @property
    def device(self) -> torch.device:
        return self._ids.device

    def is_pinned(self) -> bool:
        return self._ids.is_pinned()

    def pin_memory(self) -> KeyedJaggedIds:
        """A copy in page-locked host memory (for ``to("cuda", non_blocking=True)``).

        Without an accelerator there is nothing to pin for (torch refuses): the batch is
        returned as it is, as torch's DataLoader does with ``pin_memory=True`` on CPU.
        """
        if not torch.cuda.is_available() or self._ids.is_cuda or self.is_pinned():
            return self
        w = None if self._weights is None else self._weights.pin_memory()
        return KeyedJaggedIds._trusted(self, self._ids.pin_memory(), self._lengths.pin_memory(), w)

    # ------------------------------------------------------------ by key

    def ids_per_key(self) -> torch.Tensor:
        """int64 ``[K]``: how many ids each key has in the batch."""
        k, b = len(self._keys), self.batch_size
        if k == 0:
            return torch.zeros(0, dtype=torch.int64, device=self._ids.device)
        return self._lengths.view(k, b).sum(dim=1)

    def select(self, keys: Sequence[str]) -> KeyedJaggedIds:
        """A batch of only ``keys``, in that order (any subset; copies the ids).

        ``select(kjt.keys)`` returns ``self``; unknown keys raise KeyError naming them.
        """
        keys = list(keys)
        missing = [k for k in keys if k not in self._index]
        if missing:
            raise KeyError(f"keys {missing} not in this batch; keys: {self._keys}")
        if keys == self._keys:
            return self
        if len(set(keys)) != len(keys):
            raise ValueError(f"select: duplicate keys in {keys}")
        b = self.batch_size
        order = [self._index[k] for k in keys]
        if not order:
            empty = self._ids[:0]
            w0 = None if self._weights is None else self._weights[:0]
            return KeyedJaggedIds([], empty, self._lengths[:0], w0)
        starts = self.key_starts()  # K + 1 Python ints, one sync per batch
        ids = torch.cat([self._ids[starts[i] : starts[i + 1]] for i in order])
        lengths = torch.cat([self._lengths[i * b : (i + 1) * b] for i in order])
        w = None
        if self._weights is not None:
            w = torch.cat([self._weights[starts[i] : starts[i + 1]] for i in order])
        new_starts = [0]
        for i in order:
            new_starts.append(new_starts[-1] + starts[i + 1] - starts[i])
        # Parts of a checked batch: checking again would read the lengths back (a sync).
        return KeyedJaggedIds._trusted(self, ids, lengths, w, keys=keys, starts=new_starts)

    def permute(self, keys: Sequence[str]) -> KeyedJaggedIds:
        """The same batch with its keys in the order ``keys`` (a permutation of ``keys``)."""
        if sorted(keys) != sorted(self._keys):
            raise ValueError(f"permute: {list(keys)} is not a permutation of the keys {self._keys}")
        return self.select(keys)

    def split(self, groups: Sequence[Sequence[str]]) -> list[KeyedJaggedIds]:
        """One batch per key group (each group's keys in the order given).

        The groups must be disjoint; together they need not cover every key.
        """
        seen: set[str] = set()
        for g in groups:
            dup = seen.intersection(g)
            if dup:
                raise ValueError(f"split: keys {sorted(dup)} are in more than one group")
            seen.update(g)
        return [self.select(g) for g in groups]

    @staticmethod
    def concat(batches: Sequence[KeyedJaggedIds]) -> KeyedJaggedIds:
        """Several batches of the same samples with disjoint keys, as one (keys in order).

        Either every batch has weights or none does.
        """
        batches = list(batches)
        if not batches:
            raise ValueError("concat: needs at least one KeyedJaggedIds")
        sizes = [kjt.batch_size for kjt in batches if len(kjt) > 0]
        if len(set(sizes)) > 1:
            raise ValueError(f"concat: batches have different batch sizes {sizes}")
        keys = [k for kjt in batches for k in kjt._keys]
        if len(set(keys)) != len(keys):
            dups = sorted({k for k in keys if keys.count(k) > 1})
            raise ValueError(f"concat: keys {dups} appear in more than one batch")
        weighted = [kjt._weights is not None for kjt in batches if len(kjt) > 0]
        if any(weighted) and not all(weighted):
            raise ValueError(
                f"concat: either every batch has weights or none does, got weighted={weighted}"
            )
        ids = torch.cat([kjt._ids for kjt in batches])
        lengths = torch.cat([kjt._lengths for kjt in batches])
        w = None
        if any(weighted):
            w = torch.cat([kjt._weights for kjt in batches if kjt._weights is not None])
        return KeyedJaggedIds(keys, ids, lengths, w)

    def bucketize_by_rank(
        self, plan: ShardingPlan, tables: Mapping[str, Sequence[str]]
    ) -> IdBuckets:
        """Each table's unique ids (features of a table deduplicated together, in the
        order of ``tables``) ordered by owner rank under ``plan``, ready for an
        alltoallv: delegates to :func:`embedding.jagged_dist.bucketize`.

        ``tables`` maps table name -> its feature names; every table must have a
        feature in the batch (its ids may be empty).
        """
        from embedding.jagged_dist import bucketize, dedup

        names = list(tables)
        uniques = []
        for name in names:
            parts = [self.key_slice(f).ids for f in tables[name] if f in self._index]
            if not parts:
                raise ValueError(
                    f"bucketize_by_rank: no feature of table {name!r} ({list(tables[name])}) "
                    f"in this batch; keys: {self._keys}"
                )
            uniques.append(dedup(torch.cat(parts))[0])
        return bucketize(plan, names, uniques)

    def sample_slice(self, start: int, stop: int) -> KeyedJaggedIds:
        """Samples ``[start, stop)`` of every key (how a data-parallel rank takes its share)."""
        b = self.batch_size
        if not (isinstance(start, int) and isinstance(stop, int) and 0 <= start <= stop <= b):
            raise ValueError(
                f"sample_slice: need 0 <= start <= stop <= batch_size {b}, got [{start}, {stop})"
            )
        k = len(self._keys)
        lengths = self._lengths.view(k, b)[:, start:stop].reshape(-1)  # [K * (stop - start)]
        sample = torch.arange(k * b, device=self._ids.device) % b  # [K * B]
        sample_of_id = torch.repeat_interleave(sample, self._lengths)  # [N]
        keep = (sample_of_id >= start) & (sample_of_id < stop)  # [N]
        w = None if self._weights is None else self._weights[keep]
        return KeyedJaggedIds(self._keys, self._ids[keep], lengths, w)
