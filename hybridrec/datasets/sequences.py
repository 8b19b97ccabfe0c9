"""Users' interaction histories as time-ordered sequences, split leave-one-out, in jagged batches.

For generative (next-item) recommenders. A data set is every user's interactions
sorted by time, all users' in one flat array with offsets (ties keep the file's
order)::

    user_vocab  ["1", "2", "7"]                 U = 3 users (sorted: numbers numerically)
    offsets     [0,          4,    6,        9]  [U + 1]
    items       [5, 2, 9, 0 | 3, 3 | 1, 8, 4]    [N] ids into item_vocab, oldest first
    times       [...]                            [N] seconds, int64

:class:`LeaveOneOut` splits each user with ``n >= 3`` interactions into a training
sequence (the first ``n - 2``), a validation target (the ``n - 1``-th) and a test
target (the last); users with fewer only train. :class:`SequenceBatches` deals the
samples to ranks as :class:`SeqBatch` es: jagged inputs (values + offsets, no
padding) with their targets.

The readers parse RecBole atomic files (:func:`read_recbole_sequences`, through
:func:`hybridrec.datasets.recbole.read_atomic`) and CSV/TSV/Parquet files
(:func:`read_tabular_sequences`, through :mod:`hybridrec.datasets.stream` and the
tabular reader's file formats); :func:`movielens_sequences` is MovieLens-100k from
the ``recbole`` package.
"""

from __future__ import annotations

import math
from array import array
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch

from hybridrec.datasets.encode import VocabEncoder
from hybridrec.datasets.movielens import movielens_dir
from hybridrec.datasets.recbole import atomic_files, read_atomic
from hybridrec.datasets.schema import Schema
from hybridrec.datasets.stream import RecordStream, decode_line
from hybridrec.datasets.tabular import file_format

Split = Literal["val", "test"]
SPLITS = ("val", "test")


# ---- the data set


@dataclass(frozen=True, slots=True)
class SequenceData:
    """Every user's interactions sorted by time (ties: file order), items encoded 0..V-1.

    User ``u``'s interactions are ``items[offsets[u]:offsets[u + 1]]``, oldest first
    (see the module docstring for the layout).
    """

    items: np.ndarray  # int64 [N] item ids in 0..num_items-1, user-major, oldest first
    times: np.ndarray  # int64 [N] timestamps (seconds; float timestamps rounded down)
    offsets: np.ndarray  # int64 [U+1]
    user_vocab: list[str]  # [U] raw user token of each user index
    item_vocab: list[str]  # [V] raw item token of each item id (recbole's vocabulary order)
    source: str  # one line for logs: "ml-100k (943 users, 1682 items, 100000 interactions)"

    def __post_init__(self) -> None:
        n, u = len(self.items), len(self.user_vocab)
        for name in ("items", "times", "offsets"):
            a = getattr(self, name)
            if not isinstance(a, np.ndarray) or a.dtype != np.int64 or a.ndim != 1:
                raise ValueError(f"SequenceData: {name} must be a 1-D int64 numpy array")
        if len(self.times) != n:
            raise ValueError(f"SequenceData: {n} items but {len(self.times)} times")
        off = self.offsets
        if len(off) != u + 1 or off[0] != 0 or off[-1] != n or (np.diff(off) < 0).any():
            raise ValueError(
                f"SequenceData: offsets must rise from 0 to {n} (the items) in {u + 1} "
                f"entries ({u} users), got {len(off)} entries from "
                f"{off[0] if len(off) else None} to {off[-1] if len(off) else None}"
            )
        if n and (self.items.min() < 0 or self.items.max() >= len(self.item_vocab)):
            raise ValueError(
                f"SequenceData: item ids must lie in 0..{len(self.item_vocab) - 1}, got "
                f"{self.items.min()}..{self.items.max()}"
            )

    @property
    def num_items(self) -> int:
        return len(self.item_vocab)

    @property
    def num_users(self) -> int:
        return len(self.user_vocab)

    @property
    def num_interactions(self) -> int:
        return len(self.items)

    def lengths(self) -> np.ndarray:
        """Each user's number of interactions, int64 ``[U]``."""
        return np.diff(self.offsets)


def _vocab(tokens: Sequence[str]) -> tuple[list[str], np.ndarray]:
    """The distinct ``tokens`` in the RecBole vocabulary's order (numbers numerically,
    then text) and each token's index in it, int64 ``[N]``."""
    uniq, inverse = np.unique(np.asarray(tokens, dtype=str), return_inverse=True)
    distinct = [str(t) for t in uniq.tolist()]
    vocab = VocabEncoder(name="sequence").fitted(distinct, numbers_first=True).vocab
    place = {t: i for i, t in enumerate(vocab)}
    rank = np.fromiter((place[t] for t in distinct), dtype=np.int64, count=len(distinct))
    return vocab, rank[inverse.reshape(-1)]


def sequences_from_columns(
    users: Sequence[str], items: Sequence[str], times: np.ndarray, name: str
) -> SequenceData:
    """Interactions given as columns (row ``i``: ``users[i]`` met ``items[i]`` at
    ``times[i]``, int64 seconds) grouped by user and sorted by time, ties in row order.
    ``name`` starts :attr:`SequenceData.source`."""
    if not len(users):
        raise ValueError(f"{name}: no interactions")
    user_vocab, uid = _vocab(users)
    item_vocab, iid = _vocab(items)
    times = np.asarray(times, dtype=np.int64)
    order = np.lexsort((times, uid))  # stable: equal (user, time) keep their row order
    counts = np.bincount(uid, minlength=len(user_vocab))
    offsets = np.zeros(len(user_vocab) + 1, dtype=np.int64)
    np.cumsum(counts, out=offsets[1:])
    source = f"{name} ({len(user_vocab)} users, {len(item_vocab)} items, {len(order)} interactions)"
    return SequenceData(
        items=iid[order], times=times[order], offsets=offsets, user_vocab=user_vocab,
        item_vocab=item_vocab, source=source,
    )  # fmt: skip


def _seconds(text: str) -> int | None:
    """A timestamp's whole seconds (a float rounded down); None if it is not a finite number."""
    try:
        return int(text)
    except ValueError:
        pass
    try:
        x = float(text)
    except ValueError:
        return None
    return math.floor(x) if math.isfinite(x) else None


def parse_times(values: Sequence[str], where: Sequence[str] | Any, field: str) -> np.ndarray:
    """Timestamps as int64 seconds ``[N]`` (floats rounded down; exact up to 2**53);
    ``ValueError`` naming ``where[i]`` ("file:line") and the first value that is not a
    finite number. ``where`` is indexed only then (a list, or any object with
    ``__getitem__``)."""
    try:
        x = np.asarray(values, dtype=str).astype(np.float64)
        ok = bool(np.isfinite(x).all())
    except ValueError:
        ok = False
    if ok:
        return np.floor(x).astype(np.int64)
    for i, v in enumerate(values):
        if _seconds(v) is None:
            raise ValueError(
                f"{where[i]}: time field {field!r} must be a number (seconds), got {v!r}"
            )
    return np.fromiter((_seconds(v) for v in values), dtype=np.int64, count=len(values))


def read_recbole_sequences(
    root: Path,
    *,
    user_field: str = "user_id",
    item_field: str = "item_id",
    time_field: str = "timestamp",
) -> SequenceData:
    """The ``.inter`` file of the RecBole data set in ``root`` as sequences (its
    ``.user`` and ``.item`` files are not read). ``ValueError`` naming the file and the
    field when one is missing (with the fields it has) or a time is not a number."""
    path = atomic_files(Path(root))["inter"]
    table, _ = read_atomic(path)
    for option, name in (
        ("user_field", user_field), ("item_field", item_field), ("time_field", time_field)
    ):  # fmt: skip
        if name not in table.columns:
            raise ValueError(f"{path}: no field {name!r} ({option}); its fields are {table.names}")
    times = parse_times(table.columns[time_field], _Where(str(path), table.lines), time_field)
    return sequences_from_columns(
        table.columns[user_field], table.columns[item_field], times, path.stem
    )


class _Where:
    """``where[i]`` -> "path:line" of row ``i``, made only when an error needs one."""

    def __init__(self, path: str | list[str], lines: Sequence[int], files: Any = None) -> None:
        self.path, self.lines, self.files = path, lines, files

    def __getitem__(self, i: int) -> str:
        path = self.path if isinstance(self.path, str) else self.path[self.files[i]]
        return f"{path}:{self.lines[i]}"


def read_tabular_sequences(
    paths: list[Path],
    *,
    user_column: str,
    item_column: str,
    time_column: str,
    delimiter: str | None = None,
) -> SequenceData:
    """CSV/TSV (plain or ``.gz``, a header line naming the columns, no quoting) and
    Parquet files as one set of sequences. A file's format comes from its name as for the
    tabular reader (``.parquet``/``.pq``: Parquet, ``.tsv``/``.txt``: tabs, else commas);
    ``delimiter`` overrides the separator of the text files. ``ValueError`` naming the
    file and the column when one is missing (with the columns it has), and file:line
    when a row has the wrong number of fields or a time is not a number. A Parquet
    timestamp column is read as seconds since the epoch."""
    if not paths:
        raise ValueError("tabular sequences: paths is empty; give at least one data file")
    names = [str(p) for p in paths]
    formats = [file_format(p, Schema()) for p in names]
    wanted = (("user_column", user_column), ("item_column", item_column),
              ("time_column", time_column))  # fmt: skip
    users: list[str] = []
    items: list[str] = []
    times: list[str] = []
    lines, files = array("q"), array("q")
    stream: RecordStream[None] = RecordStream(
        names, ["parquet" if f == "parquet" else "header" for f in formats], batch_size=1,
        rank=0, world_size=1, drop_last=False, what="tabular sequences",
    )  # fmt: skip
    header: Any = None
    at: list[int] = []
    sep: str | None = None
    width = 0
    for rec in stream.records():
        if rec.header is not header:
            header = rec.header
            fmt = formats[rec.file_index]
            sep = None if fmt == "parquet" else delimiter or ("\t" if fmt == "tsv" else ",")
            columns = list(header) if sep is None else header.split(sep)
            for option, name in wanted:
                if name not in columns:
                    raise ValueError(
                        f"{rec.path}: no column {name!r} ({option}); its columns are {columns}"
                    )
            at = [columns.index(name) for _, name in wanted]
            width = len(columns)
        values = rec.raw if sep is None else decode_line(rec.raw, rec.where).split(sep)
        if len(values) != width:
            raise ValueError(
                f"{rec.where}: expected {width} fields (as the header), got {len(values)}"
            )
        u, i, t = (values[k] for k in at)
        users.append(_token(u))
        items.append(_token(i))
        times.append(str(math.floor(t.timestamp())) if hasattr(t, "timestamp") else _token(t))
        lines.append(rec.line)
        files.append(rec.file_index)
    name = names[0] if len(names) == 1 else f"{names[0]} and {len(names) - 1} more"
    seconds = parse_times(times, _Where(names, lines, files), time_column)
    return sequences_from_columns(users, items, seconds, name)


def _token(v: Any) -> str:
    """A field as text (a Parquet value: its ``str``; a null: empty)."""
    return v if isinstance(v, str) else "" if v is None else str(v)


def movielens_sequences() -> SequenceData:
    """MovieLens-100k's ratings (``ml-100k.inter`` of the ``recbole`` package) as
    sequences: 943 users, 1,682 items, 100,000 interactions. ``FileNotFoundError``
    saying what to install when the package is missing."""
    return read_recbole_sequences(movielens_dir())


# ---- leave-one-out


@dataclass(frozen=True, slots=True)
class LeaveOneOut:
    """The standard leave-one-out split: per user with n >= 3 interactions, the last is
    the test target, the second-to-last the validation target, the first n-2 the
    training sequence. Users with n < 3 only train (no validation or test sample)::

        user with n = 5:  i0 i1 i2 | i3  | i4
                          training   val   test      train_end[u] = offsets[u] + 3
    """

    data: SequenceData
    train_end: np.ndarray  # int64 [U]: training interactions of u are offsets[u] .. train_end[u]

    @classmethod
    def of(cls, data: SequenceData) -> LeaveOneOut:
        held_out = np.where(data.lengths() >= 3, 2, 0).astype(np.int64)  # [U]
        return cls(data=data, train_end=data.offsets[1:] - held_out)

    def train_lengths(self) -> np.ndarray:
        """Each user's number of training interactions, int64 ``[U]``."""
        return self.train_end - self.data.offsets[:-1]

    def eval_users(self, split: Split) -> np.ndarray:
        """The users with a sample in ``split`` ("val" or "test"), in user order, int64."""
        _check_split(split)
        return np.flatnonzero(self.data.lengths() >= 3).astype(np.int64)

    def target_positions(self, split: Split) -> np.ndarray:
        """Where each of :meth:`eval_users` ``(split)``'s targets is in ``data.items``."""
        users = self.eval_users(split)
        return self.data.offsets[users + 1] - (2 if split == "val" else 1)

    def item_train_counts(self) -> np.ndarray:
        """Each item's count in the training parts (its popularity), int64 ``[V]``."""
        d = self.data
        owner = np.repeat(np.arange(d.num_users, dtype=np.int64), d.lengths())  # [N]
        in_train = np.arange(d.num_interactions, dtype=np.int64) < self.train_end[owner]
        return np.bincount(d.items[in_train], minlength=d.num_items).astype(np.int64)


def _check_split(split: str) -> None:
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")


# ---- batches


@dataclass(slots=True)
class SeqBatch:
    """A batch of user histories as jagged sequences (values + offsets, no padding)::

        offsets  [0,       3,  4]         B = 2 samples
        items    [a, b, c | x]            [N] inputs, oldest first
        targets  training: [b, c, d | y]  [T] the next item after each scored input
                 eval:     [d, y]         [B] the held-out item

    ``times`` ``[N]`` are the inputs' timestamps, ``target_times`` the targets' (``[T]``
    in training, ``[B]`` in evaluation); ``users`` ``[B]`` each sample's user index.
    ``scored`` (training only): the input positions ``[T]`` (ascending, into ``items``)
    whose next item is predicted, ``targets`` ``[T]`` theirs; ``None`` when every
    position is (``T = N``). Positions left out are context: a window's first inputs,
    read by the model but predicted in the window before it.
    ``seen_items`` ``[M]`` with ``seen_offsets`` ``[B + 1]`` (evaluation only; empty
    ``[0]`` tensors in training): every item of the user before the target (all of
    them, not capped at ``max_seq_len``), to exclude from the ranking: the training
    part for "val", the training part and the validation item for "test".
    ``global_targets``: the targets in this step's GLOBAL batch (all ranks), so each
    rank can divide its summed loss by it to get the global mean. ``epoch`` and
    ``step``: where a training batch is in its run (step within the epoch; the same on
    every rank, e.g. to seed a step's negatives); an evaluation batch has epoch 0 and its
    index as step. A batch may be empty (``B = 0``, ``N = 0``, ``offsets == [0]``). All
    tensors are int64.
    """

    items: torch.Tensor
    times: torch.Tensor
    offsets: torch.Tensor
    targets: torch.Tensor
    target_times: torch.Tensor
    users: torch.Tensor
    seen_items: torch.Tensor
    seen_offsets: torch.Tensor
    global_targets: int
    epoch: int = 0
    step: int = 0
    scored: torch.Tensor | None = None

    @property
    def batch_size(self) -> int:
        return len(self.offsets) - 1

    @property
    def num_targets(self) -> int:
        """This rank's targets (the global count is :attr:`global_targets`)."""
        return len(self.targets)


def _ranges(starts: np.ndarray, ends: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The positions ``starts[b] .. ends[b]`` of every ``b`` concatenated ``[sum]``, and
    their offsets ``[B + 1]``."""
    lengths = ends - starts
    offsets = np.zeros(len(starts) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    idx = np.arange(offsets[-1], dtype=np.int64) + np.repeat(starts - offsets[:-1], lengths)
    return idx, offsets


def deal(count: int, rank: int, size: int) -> tuple[int, int]:
    """Rank ``rank``'s contiguous share ``[lo, hi)`` of ``count`` samples dealt as evenly
    as possible to ``size`` ranks (the first ``count % size`` ranks get one more)."""
    q, r = divmod(count, size)
    lo = rank * q + min(rank, r)
    return lo, lo + q + (1 if rank < r else 0)


def _tensor(a: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(a, dtype=np.int64))


_EMPTY = np.zeros(0, dtype=np.int64)


class SequenceBatches:
    """This rank's batches of a :class:`LeaveOneOut` split.

    Training (``unit="users"``): each step's GLOBAL batch is ``batch_size`` users (of
    those with a training sample, i.e. at least 2 training interactions), in an order
    shuffled per epoch from ``(seed, epoch)`` only (numpy ``PCG64``), never from the rank
    count. The global batch is dealt to ranks by user: rank ``r`` takes users
    ``[r*b, (r+1)*b)``, ``b = batch_size // size`` (``batch_size`` must split evenly).
    The last global batch of an epoch may be partial: it is kept and dealt as evenly as
    possible (some ranks get one user fewer, a rank may get none: an empty
    :class:`SeqBatch`). So the ranks' batches of step ``k``, concatenated in rank order,
    are the one-process batch of step ``k``. ``unit="windows"``: the same, with the
    training windows (below) of every user in place of the users: a global batch is
    ``batch_size`` windows drawn from all users' windows, shuffled across users per
    epoch (as RecBole batches its training prefixes), so a user's windows are spread
    over an epoch's steps and one step sees as many users as windows; each window is
    dealt to one rank whole.

    A user's training samples (``windows="all"``): its training sequence ``s``, inputs
    ``s[:-1]`` and targets ``s[1:]``, cut into windows of ``max_seq_len`` inputs counted
    back from the most recent (the oldest window may be shorter), so every training
    target is predicted once per epoch, from the window's earlier items. With
    ``context = C > 0`` the windows overlap by ``C`` inputs: the targets are cut into
    chunks of ``max_seq_len - C`` counted back from the most recent, and each chunk's
    window also reads the ``C`` inputs before it (fewer at the user's start) without
    predicting their next items, so every target is still predicted once, from at least
    ``C`` earlier items where the history has them (an evaluation sample reads up to
    ``max_seq_len``). ``windows="last"``: the most recent window only (``s`` cut to its
    last ``max_seq_len + 1`` items), every position scored. With ``unit="users"`` a
    user's windows stay together, oldest first, in the user's batch (so a batch has
    ``batch_size`` users and at least as many samples); ``users`` names each sample's
    user. An evaluation
    sample: the most recent ``max_seq_len`` items before the target as inputs (the
    training part for "val"; the training part and the validation item for "test").
    """

    def __init__(
        self,
        split: LeaveOneOut,
        *,
        max_seq_len: int,
        batch_size: int,
        rank: int,
        size: int,
        seed: int,
        windows: Literal["all", "last"] = "all",
        context: int = 0,
        unit: Literal["users", "windows"] = "users",
    ) -> None:
        if windows not in ("all", "last"):
            raise ValueError(f"SequenceBatches: windows must be 'all' or 'last', got {windows!r}")
        if unit not in ("users", "windows"):
            raise ValueError(f"SequenceBatches: unit must be 'users' or 'windows', got {unit!r}")
        if max_seq_len < 1:
            raise ValueError(f"SequenceBatches: max_seq_len must be >= 1, got {max_seq_len}")
        if not 0 <= context < max_seq_len:
            raise ValueError(
                f"SequenceBatches: context must be in [0, max_seq_len = {max_seq_len}), "
                f"got {context}"
            )
        if context and windows != "all":
            raise ValueError(
                f"SequenceBatches: context {context} needs windows='all' (the most recent "
                "window alone scores every position)"
            )
        if size < 1 or not 0 <= rank < size:
            raise ValueError(f"SequenceBatches: need 0 <= rank < size, got rank {rank} of {size}")
        if batch_size < 1 or batch_size % size:
            raise ValueError(
                f"SequenceBatches: batch_size {batch_size} (users per global batch) must be a "
                f"positive multiple of the {size} ranks"
            )
        if seed < 0:
            raise ValueError(f"SequenceBatches: seed must be >= 0, got {seed}")
        self.split = split
        self.max_seq_len, self.batch_size = max_seq_len, batch_size
        self.rank, self.size, self.seed = rank, size, seed
        self.windows, self.context = windows, context
        self.train_users = np.flatnonzero(split.train_lengths() >= 2).astype(np.int64)
        # unit "windows": every training window's (start, scored_from, end, user), [W] each
        self._all_windows = self._train_window(self.train_users) if unit == "windows" else None

    @property
    def _units(self) -> int:
        """What an epoch shuffles and deals: training users, or their windows."""
        if self._all_windows is None:
            return len(self.train_users)
        return len(self._all_windows[0])

    @property
    def steps_per_epoch(self) -> int:
        return -(-self._units // self.batch_size)

    def epoch_order(self, epoch: int) -> np.ndarray:
        """The training users of ``epoch`` in their shuffled order (``unit="windows"``:
        the indices of the windows of :meth:`_train_window` over all training users), the
        same on every rank."""
        if epoch < 0:
            raise ValueError(f"SequenceBatches: epoch must be >= 0, got {epoch}")
        rng = np.random.Generator(np.random.PCG64([self.seed, epoch]))
        order = rng.permutation(self._units)
        return order if self._all_windows is not None else self.train_users[order]

    def train_batches(
        self, epoch: int, skip: int = 0, start: torch.Tensor | None = None
    ) -> Iterator[tuple[SeqBatch, None]]:
        """``(batch, None)`` for steps ``skip ..`` of ``epoch`` (the step count locates a
        batch, so ``start`` is unused); skipped steps are not built."""
        del start
        order = self.epoch_order(epoch)
        for step in range(skip, self.steps_per_epoch):
            glob = order[step * self.batch_size : (step + 1) * self.batch_size]
            lo, hi = deal(len(glob), self.rank, self.size)
            if self._all_windows is None:
                batch = self.train_batch(glob[lo:hi], self._train_targets(glob))
            else:
                w_start, scored_from, end, owner = (w.take(glob) for w in self._all_windows)
                batch = self._window_batch(
                    w_start[lo:hi], scored_from[lo:hi], end[lo:hi], owner[lo:hi],
                    int((end - scored_from).sum()),
                )  # fmt: skip
            batch.epoch, batch.step = epoch, step
            yield batch, None

    def _train_window(
        self, users: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """``(start, scored_from, end, user)`` of each training sample of ``users`` (a
        user's windows in a row, oldest first): it reads inputs ``[start, end)`` and
        predicts the next items of ``[scored_from, end)`` (global positions)."""
        end = self.split.train_end[users] - 1  # the last training item is only a target
        first = self.split.data.offsets[users]
        m = self.max_seq_len
        if self.windows == "last":
            start = np.maximum(first, end - m)
            return start, start, end, users
        chunk = m - self.context  # targets per window
        count = -(-(end - first) // chunk)  # [U] windows per user (each has >= 1 target)
        back = np.arange(int(count.sum()), dtype=np.int64) - np.repeat(
            np.cumsum(count) - count, count
        )  # [W] 0 .. count-1 within each user
        back = np.repeat(count, count) - 1 - back  # oldest window first
        w_end = np.repeat(end, count) - back * chunk
        w_first = np.repeat(first, count)
        start = np.maximum(w_first, w_end - m)
        return start, np.maximum(w_first, w_end - chunk), w_end, np.repeat(users, count)

    def _train_targets(self, users: np.ndarray) -> int:
        _, scored_from, end, _ = self._train_window(users)
        return int((end - scored_from).sum())

    def train_batch(self, users: np.ndarray, global_targets: int) -> SeqBatch:
        """The training samples of ``users`` (each with >= 2 training interactions)."""
        return self._window_batch(*self._train_window(users), global_targets)

    def _window_batch(
        self,
        start: np.ndarray,
        scored_from: np.ndarray,
        end: np.ndarray,
        owner: np.ndarray,
        global_targets: int,
    ) -> SeqBatch:
        """The samples of the windows ``(start, scored_from, end, owner)`` (``[W]`` each,
        as :meth:`_train_window` gives them), in that order."""
        d = self.split.data
        idx, offsets = _ranges(start, end)
        scored = None
        target_at = idx  # [T] global positions whose next item is predicted
        if self.context:
            scored, _ = _ranges(offsets[:-1] + (scored_from - start), offsets[1:])
            target_at = idx[scored]
        return SeqBatch(
            items=_tensor(d.items[idx]), times=_tensor(d.times[idx]), offsets=_tensor(offsets),
            targets=_tensor(d.items[target_at + 1]), target_times=_tensor(d.times[target_at + 1]),
            users=_tensor(owner), seen_items=_tensor(_EMPTY), seen_offsets=_tensor(_EMPTY),
            global_targets=global_targets, scored=None if scored is None else _tensor(scored),
        )  # fmt: skip

    def eval_batches(self, split: Split, batch_size: int) -> list[SeqBatch]:
        """This rank's samples of ``split``: its users in user order, in global batches of
        ``batch_size`` users, each dealt to ranks as evenly as possible, contiguously in
        rank order (as training's). Every rank gets the same number of batches, some
        possibly empty, since evaluation is collective."""
        _check_split(split)
        if batch_size < 1:
            raise ValueError(f"SequenceBatches: eval batch_size must be >= 1, got {batch_size}")
        users = self.split.eval_users(split)
        targets = self.split.target_positions(split)
        out: list[SeqBatch] = []
        for at in range(0, len(users), batch_size):
            glob = slice(at, min(at + batch_size, len(users)))
            lo, hi = deal(glob.stop - glob.start, self.rank, self.size)
            mine = slice(glob.start + lo, glob.start + hi)
            batch = self._eval_batch(users[mine], targets[mine], glob.stop - glob.start)
            batch.step = len(out)
            out.append(batch)
        return out

    def _eval_batch(self, users: np.ndarray, target: np.ndarray, global_targets: int) -> SeqBatch:
        d = self.split.data
        first = d.offsets[users]
        idx, offsets = _ranges(np.maximum(first, target - self.max_seq_len), target)
        seen, seen_offsets = _ranges(first, target)
        return SeqBatch(
            items=_tensor(d.items[idx]), times=_tensor(d.times[idx]), offsets=_tensor(offsets),
            targets=_tensor(d.items[target]), target_times=_tensor(d.times[target]),
            users=_tensor(users), seen_items=_tensor(d.items[seen]),
            seen_offsets=_tensor(seen_offsets), global_targets=global_targets,
        )  # fmt: skip
