"""Columns -> features: the one encoding step that every reader's columns go through.

A reader parses its format into columns (a label's text, numbers with NaN for a missing
one, a sparse field's text or raw integers); the encoders here turn them into the
features a model reads:

* :class:`LabelEncoder`: a label's text -> 1.0 (click) or 0.0, by a rule: ``"0/1"`` or a
  comparison such as ``">= 4"``.
* :class:`DenseEncoder`: a number -> one dense feature: a missing number filled in,
  ``log1p(max(x, 0))`` if ``log``, then standardized with training-split statistics if
  ``standardize``; or a value's count of training rows (``counts``).
* Sparse encoders, one feature each: a field's text is one value or several
  (``separator``: a multi-value bag, mean-pooled), each optionally cut to ``prefix``
  characters, and each value becomes one id:

  - :class:`HashEncoder`: ``splitmix64(raw * 32 + salt) mod rows`` (the hashing trick;
    ``rows`` None: the sign bit cleared, a raw id for a dynamic table), ``raw`` the
    value read as a hex integer (``encoding = "hex"``) or its text's 8-byte BLAKE2b
    digest, either cut to 58 bits so that ``raw * 32 + salt`` fits in an int64;
  - :class:`VocabEncoder`: a value's row in a vocabulary (rows from 1; row 0 for a
    value not in it);
  - :class:`BucketEncoder`: a number -> 1 + how many bucket edges are <= it.

Every encoder is a dataclass whose fields are its whole state, learned (a vocabulary,
standardization statistics, fill values, counts) or configured (hash settings, the log
flag, the separator); ``to_state()`` gives plain JSON-able data and ``from_state()``
rebuilds an encoder that encodes exactly as the one it came from. :class:`Encoders`
holds a data set's label, dense and sparse encoders together.

Two ways to apply them, one per way a reader holds its data:

* streamed rows (the tabular and Criteo readers): a record is checked as it is parsed
  (:meth:`LabelEncoder.clicked`, a sparse encoder's :meth:`~HashEncoder.bag`, so that a
  bad record can be skipped alone); :meth:`Encoders.encode` encodes a batch's columns
  into a :class:`~hybridrec.datasets.ctr.Batch` (:meth:`Encoders.batch` from parsed
  rows of bags) and :class:`RowFit` learns the vocabularies and statistics in one pass
  over the training rows. Dense values are standardized in float64, then rounded to
  float32.
* whole columns held in memory (RecBole, MovieLens, synthetic): :func:`sparse_feature`
  encodes a column into a :class:`~hybridrec.datasets.ctr.SparseFeature`;
  :func:`fit_standardization` and :func:`dense_matrix` encode the dense columns into one
  float32 ``[N, D]`` matrix. Values are rounded to float32 first and standardized in
  float32 with the statistics of that float32 matrix's training rows.
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import operator
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

import numpy as np
import torch

from embedding import KeyedJaggedIds
from hybridrec.datasets.ctr import Batch, SparseFeature
from ps.routing import splitmix64

# Raw values keep 58 bits, so that ``value * 32 + salt`` fits in an int64.
MASK58 = (1 << 58) - 1

RULES: dict[str, Callable[[float, float], bool]] = {
    ">=": operator.ge,
    ">": operator.gt,
    "<=": operator.le,
    "<": operator.lt,
    "==": operator.eq,
    "!=": operator.ne,
}

# A parsed streamed row, what :meth:`Encoders.batch` encodes: the label (1.0 or 0.0),
# the dense columns' numbers (NaN: missing) and each sparse column's bag (what its
# encoder's ``bag`` gives: raw ints to hash, or values to look up).
Row = tuple[float, list[float], list[list[Any]]]


def string_id(token: str) -> int:
    """A text value -> a 58-bit int (the low bits of its 8-byte BLAKE2b digest)."""
    return (
        int.from_bytes(hashlib.blake2b(token.encode(), digest_size=8).digest(), "little") & MASK58
    )


def hash_categorical(values: torch.Tensor, salt: int, num_rows: int | None) -> torch.Tensor:
    """Raw values int64 ``[N]`` (58 bits at most) of the sparse feature numbered ``salt``
    -> ids int64 ``[N]``: the same value in two features lands on unrelated rows."""
    mixed = splitmix64(values * 32 + salt)  # int64, any sign
    if num_rows is None:
        return mixed & 0x7FFF_FFFF_FFFF_FFFF
    return torch.remainder(mixed, num_rows)


def _text(v: Any) -> str | None:
    return None if v is None else v if isinstance(v, str) else str(v)


def _state(obj: Any) -> dict[str, Any]:
    """An encoder's init fields as JSON-able data (lists and dicts copied, so that the
    state and the encoder never share one)."""
    out: dict[str, Any] = {}
    for f in dataclasses.fields(obj):
        if f.init:
            v = getattr(obj, f.name)
            out[f.name] = list(v) if isinstance(v, list) else dict(v) if isinstance(v, dict) else v
    return out


def _from_state(cls: Any, state: dict[str, Any]) -> Any:
    known = [f.name for f in dataclasses.fields(cls) if f.init]
    unknown = [k for k in state if k not in known]
    if unknown:
        raise ValueError(f"{cls.__name__} state: unknown key(s) {unknown}; known keys: {known}")
    return cls(**state)


@dataclass(kw_only=True, slots=True)
class LabelEncoder:
    """A label column's text -> a click, 1.0 or 0.0 (``clicked``)."""

    column: str
    rule: str = "0/1"  # "0/1": the value is 0 or 1; else "OP NUMBER", e.g. ">= 4"
    # The rule parsed once: (comparison, threshold); None for "0/1".
    _compare: tuple[Callable[[float, float], bool], float] | None = field(
        init=False, repr=False, compare=False, default=None
    )

    def __post_init__(self) -> None:
        rule = self.rule.strip()
        if rule == "0/1":
            return
        for op in sorted(RULES, key=len, reverse=True):
            if rule.startswith(op):
                try:
                    self._compare = (RULES[op], float(rule[len(op) :]))
                    return
                except ValueError:
                    break
        raise ValueError(
            f"label rule {self.rule!r}: expected '0/1' or a comparison such as '>= 4' "
            f"(one of {', '.join(RULES)} then a number)"
        )

    def clicked(self, value: str | None) -> float:
        """``value`` (the column's text; None: missing, 0.0) -> 1.0 or 0.0; ``ValueError``
        if it does not fit the rule."""
        if self._compare is None:
            if value is None:
                return 0.0
            if value.strip() not in ("0", "1"):
                raise ValueError(f"label {self.column!r} must be 0 or 1, got {value!r}")
            return float(value.strip())
        if value is None:
            return 0.0
        try:
            x = float(value)
        except ValueError:
            raise ValueError(f"label {self.column!r} must be a number, got {value!r}") from None
        compare, threshold = self._compare
        return 1.0 if compare(x, threshold) else 0.0

    def to_state(self) -> dict[str, Any]:
        return _state(self)

    @classmethod
    def from_state(cls, state: dict[str, Any]) -> LabelEncoder:
        return _from_state(cls, state)  # type: ignore[no-any-return]


@dataclass(kw_only=True, slots=True)
class DenseEncoder:
    """A number -> one dense feature: ``fill`` for a missing number (NaN), then
    ``log1p(max(x, 0))`` if ``log``, then ``(x - mean) / std`` (identity while not
    ``standardize``: mean 0, std 1)."""

    name: str
    log: bool = False
    standardize: bool = False  # mean and std come from the training split
    mean: float = 0.0
    std: float = 1.0
    fill: float = 0.0  # the value of a missing number
    # A value's count of training rows: the feature of a column's text (its number is
    # the count, 0 for a value no training row has); None: the column is numbers.
    counts: dict[str, int] | None = None

    def numbers(self, x: np.ndarray) -> np.ndarray:
        """float64 ``[N]`` (NaN: missing) -> float64 ``[N]`` filled and logged, not yet
        standardized."""
        if np.isnan(x).any():
            x = np.where(np.isnan(x), self.fill, x)
        if self.log:
            x = np.log1p(np.maximum(x, 0.0))
        return x

    def count(self, values: Sequence[str]) -> np.ndarray:
        """Each value's count of training rows, float64 ``[N]`` (``counts`` must be set)."""
        if self.counts is None:
            raise ValueError(f"dense feature {self.name!r} has no counts to look values up in")
        counts = self.counts
        return np.asarray([counts.get(v, 0) for v in values], dtype=np.float64)

    def to_state(self) -> dict[str, Any]:
        return _state(self)

    @classmethod
    def from_state(cls, state: dict[str, Any]) -> DenseEncoder:
        return _from_state(cls, state)  # type: ignore[no-any-return]


@dataclass(kw_only=True, slots=True)
class _Sparse:
    """What every sparse encoder shares: how a field's text splits into values."""

    kind: ClassVar[str] = ""  # the state's tag of each kind of sparse encoder
    name: str
    separator: str | None = None  # several values per field split by this; None: one value
    prefix: int | None = None  # keep the first N characters of each value

    def tokens(self, v: Any) -> list[str]:
        """A field (text, None for missing, or a Parquet list) -> its values, empty ones
        dropped."""
        if v is None:
            return []
        if isinstance(v, list):  # a Parquet list column
            out = [str(x) for x in v if x is not None and str(x) != ""]
        else:
            t = str(v)
            if self.separator is None:
                out = [t] if t != "" else []
            else:
                out = [x for x in t.split(self.separator) if x != ""]
        if self.prefix is not None:
            out = [t[: self.prefix] for t in out]
        return out

    def to_state(self) -> dict[str, Any]:
        return {"kind": self.kind, **_state(self)}


@dataclass(kw_only=True, slots=True)
class HashEncoder(_Sparse):
    """Values -> ids by hashing (see the module docstring)."""

    kind: ClassVar[str] = "hash"
    salt: int  # the feature's number among the sparse features
    rows: int | None = 100_000  # table rows; None: raw ids for a dynamic table
    encoding: str = "string"  # a value as "string" (any text, digested) or "hex" (an integer)

    @property
    def num_rows(self) -> int | None:
        return self.rows

    def bag(self, v: Any) -> list[int]:
        """A field -> the raw 58-bit ints of its values; ``ValueError`` if a hex one is not."""
        tokens = self.tokens(v)
        if self.encoding != "hex":
            return [string_id(t) for t in tokens]
        try:
            return [int(t, 16) & MASK58 for t in tokens]
        except ValueError:
            raise ValueError(f"column {self.name!r} must be hex, got {_text(v)!r}") from None

    def ids(self, raw: Sequence[int] | np.ndarray) -> torch.Tensor:
        """Raw ints (``bag``'s; a list or an int64 array) -> ids int64 ``[N]``."""
        if isinstance(raw, np.ndarray):
            values = np.ascontiguousarray(raw, dtype=np.int64)
        else:
            values = np.fromiter(raw, dtype=np.int64, count=len(raw))
        return hash_categorical(torch.from_numpy(values), self.salt, self.rows)


@dataclass(kw_only=True, slots=True)
class VocabEncoder(_Sparse):
    """Values -> rows of a vocabulary: ``vocab[i]`` is row ``i + 1``; row 0 is a value not
    in it."""

    kind: ClassVar[str] = "vocab"
    vocab: list[str] = field(default_factory=list)
    _row: dict[str, int] = field(init=False, repr=False, compare=False, default_factory=dict)

    def __post_init__(self) -> None:
        self.vocab = list(self.vocab)
        self._row = {t: i + 1 for i, t in enumerate(self.vocab)}

    @property
    def num_rows(self) -> int:
        return len(self.vocab) + 1

    def bag(self, v: Any) -> list[str]:
        return self.tokens(v)

    def ids(self, tokens: Sequence[str]) -> torch.Tensor:
        row = self._row
        found = (row.get(t, 0) for t in tokens)
        return torch.from_numpy(np.fromiter(found, dtype=np.int64, count=len(tokens)))

    def fitted(self, tokens: Iterable[str], *, numbers_first: bool = False) -> VocabEncoder:
        """This encoder with the vocabulary of ``tokens``, in sorted order: by text, or
        with ``numbers_first`` the values made of digits first, numerically."""
        if numbers_first:
            order = sorted(
                set(tokens), key=lambda t: (not t.isdigit(), int(t) if t.isdigit() else 0, t)
            )
        else:
            order = sorted(set(tokens))
        return dataclasses.replace(self, vocab=order)


@dataclass(kw_only=True, slots=True)
class BucketEncoder(_Sparse):
    """Numbers -> 1 + how many of the sorted ``edges`` are <= each (0: no value)."""

    kind: ClassVar[str] = "buckets"
    edges: list[float] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.edges = sorted(float(e) for e in self.edges)

    @property
    def num_rows(self) -> int:
        return len(self.edges) + 2

    def bag(self, v: Any) -> list[str]:
        return self.tokens(v)

    def ids(self, tokens: Sequence[str]) -> torch.Tensor:
        try:
            x = np.array([float(t) for t in tokens], dtype=np.float64)
        except ValueError:
            raise ValueError("buckets need numbers") from None
        edges = np.array(self.edges, dtype=np.float64)
        return torch.from_numpy(np.searchsorted(edges, x, side="right") + 1)


SparseEncoder = HashEncoder | VocabEncoder | BucketEncoder
_SPARSE: dict[str, type[SparseEncoder]] = {
    c.kind: c for c in (HashEncoder, VocabEncoder, BucketEncoder)
}


def sparse_from_state(state: dict[str, Any]) -> SparseEncoder:
    """A sparse encoder from its ``to_state()`` (the ``kind`` key says which)."""
    rest = dict(state)
    kind = rest.pop("kind", None)
    if kind not in _SPARSE:
        raise ValueError(f"sparse encoder state: kind must be one of {list(_SPARSE)}, got {kind!r}")
    return _from_state(_SPARSE[kind], rest)  # type: ignore[no-any-return]


@dataclass(kw_only=True, slots=True)
class Encoders:
    """A data set's encoders: its label (None: every label 0), dense and sparse features,
    in the order of a :data:`Row`'s values."""

    label: LabelEncoder | None = None
    dense: list[DenseEncoder] = field(default_factory=list)
    sparse: list[SparseEncoder] = field(default_factory=list)

    def num_rows(self) -> list[int | None]:
        """Rows of each sparse feature's table (None: a dynamic table)."""
        return [e.num_rows for e in self.sparse]

    def dense_numbers(self, numbers: np.ndarray) -> np.ndarray:
        """Dense numbers float64 ``[B, D]`` (NaN: missing) filled and logged, float64
        ``[B, D]`` in C order."""
        if not self.dense:
            return numbers
        return np.stack([e.numbers(numbers[:, j]) for j, e in enumerate(self.dense)], axis=1)

    def encode(
        self, labels: np.ndarray, numbers: np.ndarray, sparse: list[tuple[Any, np.ndarray]]
    ) -> Batch:
        """Columns -> a :class:`Batch`. ``labels`` float32 ``[B]``; ``numbers`` float64
        ``[B, D]`` (NaN: missing), standardized in float64, then rounded to float32;
        per sparse feature, its values of all rows in row order (a list or an int64
        array) and their counts per row, int64 ``[B]``; ids come out key-major."""
        dense = torch.from_numpy(self.dense_numbers(numbers))  # [B, D] float64
        mean = torch.tensor([e.mean for e in self.dense], dtype=torch.float64)
        std = torch.tensor([e.std for e in self.dense], dtype=torch.float64)
        ids = [enc.ids(values) for enc, (values, _) in zip(self.sparse, sparse, strict=True)]
        return Batch(
            dense=((dense - mean) / std).to(torch.float32),
            sparse=KeyedJaggedIds(
                [e.name for e in self.sparse],
                torch.cat(ids),
                torch.from_numpy(np.concatenate([n for _, n in sparse])),  # [K * B]
            ),
            labels=torch.from_numpy(labels),
        )

    def batch(self, rows: list[Row]) -> Batch:
        """Parsed rows (:data:`Row`) -> a :class:`Batch` (:meth:`encode` of their columns)."""
        b = len(rows)
        numbers = np.asarray([r[1] for r in rows], dtype=np.float64).reshape(b, len(self.dense))
        sparse = []  # per feature: (its values in row order, lengths [B])
        for k in range(len(self.sparse)):
            bags = [r[2][k] for r in rows]  # one per row
            values = list(itertools.chain.from_iterable(bags))
            sparse.append((values, np.fromiter(map(len, bags), dtype=np.int64, count=b)))
        return self.encode(np.asarray([r[0] for r in rows], dtype=np.float32), numbers, sparse)

    def to_state(self) -> dict[str, Any]:
        return {
            "label": None if self.label is None else self.label.to_state(),
            "dense": [e.to_state() for e in self.dense],
            "sparse": [e.to_state() for e in self.sparse],
        }

    @classmethod
    def from_state(cls, state: dict[str, Any]) -> Encoders:
        label = state.get("label")
        return cls(
            label=None if label is None else LabelEncoder.from_state(label),
            dense=[DenseEncoder.from_state(d) for d in state.get("dense", [])],
            sparse=[sparse_from_state(s) for s in state.get("sparse", [])],
        )


class RowFit:
    """One pass over the training rows, batch by batch (``add``): the vocabularies of
    the :class:`VocabEncoder` s and the standardization statistics (``fitted``)."""

    def __init__(self, encoders: Encoders) -> None:
        self.encoders = encoders
        self.rows = 0
        d = len(encoders.dense)
        self._total = np.zeros(d)  # [D] float64
        self._total_sq = np.zeros(d)  # [D]
        self._tokens: dict[int, set[str]] = {
            k: set() for k, e in enumerate(encoders.sparse) if isinstance(e, VocabEncoder)
        }

    def add(self, rows: list[Row]) -> None:
        b, d = len(rows), len(self.encoders.dense)
        numbers = np.asarray([r[1] for r in rows], dtype=np.float64).reshape(b, d)
        dense = self.encoders.dense_numbers(numbers)  # [B, D]
        self._total += dense.sum(axis=0)
        self._total_sq += (dense**2).sum(axis=0)
        self.rows += len(rows)
        for k, bag in self._tokens.items():
            for r in rows:
                bag.update(r[2][k])

    def fitted(self) -> Encoders:
        """The encoders with what the rows added decide (at least one row)."""
        n = self.rows
        mean = self._total / n
        # The sample standard deviation (n - 1), as fit_standardization takes it.
        var = (self._total_sq - n * mean**2) / max(n - 1, 1)
        std = np.sqrt(np.maximum(var, 0.0)).clip(min=1e-6)
        dense = [
            dataclasses.replace(e, mean=float(mean[j]), std=float(std[j])) if e.standardize else e
            for j, e in enumerate(self.encoders.dense)
        ]
        sparse = [
            e.fitted(self._tokens[k]) if isinstance(e, VocabEncoder) else e
            for k, e in enumerate(self.encoders.sparse)
        ]
        return dataclasses.replace(self.encoders, dense=dense, sparse=sparse)


# ---- whole columns held in memory


class Column:
    """One column held in memory: its text per row, and its distinct values with each
    row's index among them (worked out once; a feature is worked out once per distinct
    value, then gathered)."""

    def __init__(self, values: Sequence[str]) -> None:
        self.values = values
        self._distinct: tuple[list[str], np.ndarray] | None = None

    @property
    def distinct(self) -> tuple[list[str], np.ndarray]:
        """The distinct values ``[U]`` and, per row, its value's index among them ``[N]``."""
        if self._distinct is None:
            uniq, inverse = np.unique(np.asarray(self.values, dtype=str), return_inverse=True)
            self._distinct = [str(u) for u in uniq.tolist()], inverse.reshape(-1).astype(np.int64)
        return self._distinct


def _column(values: Column | Sequence[str]) -> Column:
    return values if isinstance(values, Column) else Column(values)


def train_counts(values: Column | Sequence[str], train: np.ndarray) -> dict[str, int]:
    """How many of the training rows ``train`` (indices ``[N_train]``) hold each value."""
    uniq, inv = _column(values).distinct
    counts = np.bincount(inv[train], minlength=len(uniq))  # [U]
    return {u: int(c) for u, c in zip(uniq, counts.tolist(), strict=True) if c}


def fill_value(how: str, x: np.ndarray, train: np.ndarray, own: Sequence[float]) -> float:
    """The number a missing value (NaN in ``x``, float64 ``[N]``) becomes: "zero"; "mean"
    of the training rows ``train`` that have one; "median" of ``own``, the numbers of
    the column's own file (0 where there are none)."""
    if how == "zero":
        return 0.0
    if how == "median":
        return float(np.median(own)) if len(own) else 0.0
    seen = x[train][~np.isnan(x[train])]
    return float(seen.mean()) if len(seen) else 0.0


def _float32_columns(
    encoders: list[DenseEncoder], numbers: list[np.ndarray], n: int
) -> torch.Tensor:
    if not encoders:
        return torch.zeros((n, 0), dtype=torch.float32)
    cols = [e.numbers(x) for e, x in zip(encoders, numbers, strict=True)]  # [N] float64 each
    return torch.from_numpy(np.stack(cols, axis=1).astype(np.float32))  # [N, D]


def fit_standardization(
    encoders: list[DenseEncoder], numbers: list[np.ndarray], train: torch.Tensor
) -> list[DenseEncoder]:
    """The encoders with the mean and sample std of the training rows ``train`` (float32
    statistics of the float32 ``[N_train, D_s]`` matrix of the standardized columns,
    std at least 1e-6)."""
    scaled = [j for j, e in enumerate(encoders) if e.standardize]
    if not scaled:
        return list(encoders)
    n = len(numbers[0])
    block = _float32_columns(encoders, numbers, n)[:, scaled].contiguous()[train]  # [N_train, D_s]
    mean = block.mean(dim=0).tolist()
    std = block.std(dim=0).clamp_min(1e-6).tolist()
    out = list(encoders)
    for i, j in enumerate(scaled):
        out[j] = dataclasses.replace(encoders[j], mean=mean[i], std=std[i])
    return out


def dense_matrix(encoders: list[DenseEncoder], numbers: list[np.ndarray], n: int) -> torch.Tensor:
    """Dense columns (float64 ``[N]`` each, NaN: missing) -> float32 ``[N, D]``: filled,
    logged, rounded to float32, the standardized columns then standardized in float32."""
    dense = _float32_columns(encoders, numbers, n)  # [N, D]
    scaled = [j for j, e in enumerate(encoders) if e.standardize]
    if scaled:
        mean = torch.tensor([encoders[j].mean for j in scaled], dtype=torch.float32)
        std = torch.tensor([encoders[j].std for j in scaled], dtype=torch.float32)
        part = dense[:, scaled].contiguous()  # [N, D_s]
        part.sub_(mean).div_(std)
        dense[:, scaled] = part
    return dense


def sparse_feature(encoder: SparseEncoder, values: Column | Sequence[str]) -> SparseFeature:
    """A column's text, one field per sample -> its feature: ids ``[N, L]`` padded with 0
    and lengths ``[N]``; a one-value feature holds exactly one id per sample (a missing
    value is id 0)."""
    uniq, inv = _column(values).distinct
    bags: list[list[Any]] = [encoder.bag(v) for v in uniq]  # per distinct value
    flat = encoder.ids([t for b in bags for t in b]).tolist()
    width = max(1, max(len(b) for b in bags))
    ids = np.zeros((len(uniq), width), dtype=np.int64)  # [U, L], 0-padded
    lengths = np.array([len(b) for b in bags], dtype=np.int64)  # [U]
    pos = 0
    for i, b in enumerate(bags):
        ids[i, : len(b)] = flat[pos : pos + len(b)]
        pos += len(b)
    if encoder.separator is None:
        lengths[:] = 1
    num_rows = encoder.num_rows
    if num_rows is None:
        raise ValueError(f"sparse feature {encoder.name!r}: a data set in memory needs a row count")
    return SparseFeature(
        name=encoder.name,
        ids=torch.from_numpy(ids[inv]),  # [N, L]
        lengths=torch.from_numpy(lengths[inv]),  # [N]
        num_rows=num_rows,
    )
