"""The jagged batch of sparse ids: the only way ids travel between layers.

Imports only torch, so every layer (loaders, caches, collections, comm hooks)
can depend on it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch


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

    Build one from Python lists with :meth:`from_lists`; select one key with
    ``kjt["f1"]`` (a :class:`JaggedIds`). ``len(kjt)`` is the number of keys.
    """

    __slots__ = ("_keys", "_ids", "_lengths", "_weights", "_index", "_offsets")

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

    def key_slice(self, key: str) -> JaggedIds:
        """The ids of one key (views into this batch's tensors)."""
        try:
            k = self._index[key]
        except KeyError:
            raise KeyError(f"key {key!r} not in this batch; keys: {self._keys}") from None
        b = self.batch_size
        offsets = self.offsets()
        start, stop = int(offsets[k * b]), int(offsets[(k + 1) * b])
        w = None if self._weights is None else self._weights[start:stop]
        return JaggedIds(self._ids[start:stop], self._lengths[k * b : (k + 1) * b], w)

    def __getitem__(self, key: str) -> JaggedIds:
        return self.key_slice(key)

    def to(self, device: torch.device | str, non_blocking: bool = False) -> KeyedJaggedIds:
        w = None if self._weights is None else self._weights.to(device, non_blocking=non_blocking)
        return KeyedJaggedIds(
            self._keys,
            self._ids.to(device, non_blocking=non_blocking),
            self._lengths.to(device, non_blocking=non_blocking),
            w,
        )

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
