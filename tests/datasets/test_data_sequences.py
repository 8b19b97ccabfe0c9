"""User histories as sequences: reading, leave-one-out, jagged batches dealt to ranks.

The expected sequences, splits and samples are worked out here by a plain-Python
reference (lists, loops, ``sorted``) from the same rows the files hold.
"""

from __future__ import annotations

import math
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from hybridrec.datasets.sequences import (
    LeaveOneOut,
    SeqBatch,
    SequenceBatches,
    SequenceData,
    Split,
    movielens_sequences,
    read_recbole_sequences,
    read_tabular_sequences,
    sequences_from_columns,
)

# (user, item, time) in file order. Users: "10" has 5 interactions (a tie at 300 and a
# float time), "2" has 3, "u-a" 2, "9" 1, "u-b" 4 (all at one time: file order decides).
ROWS = [
    ("10", "30", "300"),
    ("2", "x", "50"),
    ("10", "7", "100.7"),
    ("u-a", "100", "5"),
    ("10", "b", "300"),
    ("9", "7", "1"),
    ("2", "7", "40"),
    ("u-b", "30", "8"),
    ("10", "100", "200"),
    ("u-b", "7", "8"),
    ("u-a", "x", "4.2"),
    ("2", "30", "60"),
    ("u-b", "b", "8"),
    ("10", "x", "300.9"),
    ("u-b", "100", "8"),
]
SPLITS: tuple[Split, ...] = ("val", "test")
USERS = ["2", "9", "10", "u-a", "u-b"]  # numbers numerically, then text
ITEMS = ["7", "30", "100", "b", "x"]


def _reference(rows: list[tuple[str, str, str]]) -> dict[str, list[tuple[str, int]]]:
    """Each user's (item, whole seconds) sorted by time, ties in file order."""
    by_user: dict[str, list[tuple[int, int, str]]] = {}
    for k, (u, i, t) in enumerate(rows):
        by_user.setdefault(u, []).append((math.floor(float(t)), k, i))
    return {u: [(i, t) for t, _, i in sorted(v)] for u, v in by_user.items()}


def _recbole(tmp: Path, rows: list[tuple[str, str, str]], time_type: str = "float") -> Path:
    d = tmp / "shop"
    d.mkdir()
    head = f"user_id:token\titem_id:token\trating:float\ttimestamp:{time_type}"
    text = "\n".join([head, *(f"{u}\t{i}\t3\t{t}" for u, i, t in rows)]) + "\n"
    (d / "shop.inter").write_text(text)
    return d


def _histories(data: SequenceData) -> dict[str, list[tuple[str, int]]]:
    """The data as the reference's shape: raw tokens, per user."""
    out = {}
    for u, name in enumerate(data.user_vocab):
        lo, hi = data.offsets[u], data.offsets[u + 1]
        out[name] = [
            (data.item_vocab[i], int(t))
            for i, t in zip(data.items[lo:hi], data.times[lo:hi], strict=True)
        ]
    return out


def _check(data: SequenceData) -> None:
    assert data.user_vocab == USERS
    assert data.item_vocab == ITEMS
    assert _histories(data) == _reference(ROWS)
    assert (data.num_users, data.num_items, data.num_interactions) == (5, 5, 15)
    for a in (data.items, data.times, data.offsets):
        assert a.dtype == np.int64


def test_recbole_sorted_by_time_ties_in_file_order(tmp_path: Path) -> None:
    data = read_recbole_sequences(_recbole(tmp_path, ROWS))
    _check(data)
    assert _histories(data)["u-b"] == [("30", 8), ("7", 8), ("b", 8), ("100", 8)]
    assert _histories(data)["10"] == [("7", 100), ("100", 200), ("30", 300), ("b", 300),
                                      ("x", 300)]  # fmt: skip
    assert data.source == "shop (5 users, 5 items, 15 interactions)"


def test_tabular_csv_tsv_and_parquet_read_the_same(tmp_path: Path) -> None:
    csv = tmp_path / "log.csv"
    csv.write_text("when,who,what\r\n" + "".join(f"{t},{u},{i}\r\n" for u, i, t in ROWS))
    cols = {"user_column": "who", "item_column": "what", "time_column": "when"}
    _check(read_tabular_sequences([csv], **cols))
    # Two files are one data set; a delimiter overrides the one the name implies.
    a, b = tmp_path / "a.txt", tmp_path / "b.txt"
    for path, part in ((a, ROWS[:6]), (b, ROWS[6:])):
        path.write_text("who|what|when\n" + "".join(f"{u}|{i}|{t}\n" for u, i, t in part))
    two = read_tabular_sequences([a, b], delimiter="|", **cols)
    _check(two)
    assert two.source.endswith("a.txt and 1 more (5 users, 5 items, 15 interactions)")
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    table = pa.table(
        {
            "who": [u for u, _, _ in ROWS],
            "what": [i for _, i, _ in ROWS],
            "when": [float(t) for _, _, t in ROWS],
        }
    )
    pq.write_table(table, tmp_path / "log.parquet")
    _check(read_tabular_sequences([tmp_path / "log.parquet"], **cols))


def test_leave_one_out_against_reference(tmp_path: Path) -> None:
    data = read_recbole_sequences(_recbole(tmp_path, ROWS))
    split = LeaveOneOut.of(data)
    ref = _reference(ROWS)
    train, val, test = {}, {}, {}
    for u, hist in ref.items():
        items = [i for i, _ in hist]
        if len(items) >= 3:
            train[u], val[u], test[u] = items[:-2], items[-2], items[-1]
        else:
            train[u] = items
    assert {len(h) for h in ref.values()} == {1, 2, 3, 4, 5}
    for k, name in enumerate(data.user_vocab):
        got = data.items[data.offsets[k] : split.train_end[k]]
        assert [data.item_vocab[i] for i in got] == train[name]
    for which, want in zip(SPLITS, (val, test), strict=True):
        users = split.eval_users(which)
        assert users.dtype == np.int64
        assert [data.user_vocab[k] for k in users] == [u for u in USERS if u in want]
        at = split.target_positions(which)
        assert [data.item_vocab[data.items[p]] for p in at] == [
            want[data.user_vocab[u]] for u in users
        ]
    counts = Counter(i for items in train.values() for i in items)
    assert split.item_train_counts().tolist() == [counts[i] for i in ITEMS]
    with pytest.raises(ValueError, match="split must be one of"):
        split.eval_users("train")  # type: ignore[arg-type]


def _samples(batch: SeqBatch) -> list[tuple[Any, ...]]:
    """A batch as plain lists, one tuple per sample: (user, inputs, input times, targets,
    target times, seen items)."""
    off = batch.offsets.tolist()
    eval_ = batch.seen_offsets.numel() > 0
    out = []
    for b, user in enumerate(batch.users.tolist()):
        lo, hi = off[b], off[b + 1]
        targets: Any
        target_times: Any
        if eval_:
            s = batch.seen_offsets.tolist()
            targets = batch.targets[b].item()
            target_times = batch.target_times[b].item()
            seen = batch.seen_items[s[b] : s[b + 1]].tolist()
        else:
            targets = batch.targets[lo:hi].tolist()
            target_times = batch.target_times[lo:hi].tolist()
            seen = []
        out.append((user, batch.items[lo:hi].tolist(), batch.times[lo:hi].tolist(), targets,
                    target_times, seen))  # fmt: skip
    return out


def _ref_samples(data: SequenceData, max_len: int, split: str) -> dict[int, tuple[Any, ...]]:
    """Every user's sample of ``split`` ("train", "val", "test"), from plain lists."""
    out: dict[int, tuple[Any, ...]] = {}
    for u in range(data.num_users):
        lo, hi = int(data.offsets[u]), int(data.offsets[u + 1])
        items, times = data.items[lo:hi].tolist(), data.times[lo:hi].tolist()
        n = len(items)
        if split == "train":
            end = n - 2 if n >= 3 else n
            s, st = items[:end][-(max_len + 1) :], times[:end][-(max_len + 1) :]
            if len(s) >= 2:
                out[u] = (u, s[:-1], st[:-1], s[1:], st[1:], [])
        elif n >= 3:
            t = n - 2 if split == "val" else n - 1
            inputs = items[:t][-max_len:]
            out[u] = (u, inputs, times[:t][-max_len:], items[t], times[t], items[:t])
    return out


@pytest.mark.parametrize("max_len", [1, 2, 3, 10])
def test_samples_capped_to_the_most_recent(tmp_path: Path, max_len: int) -> None:
    data = read_recbole_sequences(_recbole(tmp_path, ROWS))
    batches = SequenceBatches(
        LeaveOneOut.of(data), max_seq_len=max_len, batch_size=64, rank=0, size=1, seed=0,
        windows="last",
    )  # fmt: skip
    (batch, position), *rest = list(batches.train_batches(0))
    assert not rest and position is None
    got = _samples(batch)
    assert {s[0]: s for s in got} == _ref_samples(data, max_len, "train")
    assert batch.global_targets == batch.num_targets == sum(len(s[1]) for s in got)
    assert all(len(s[1]) <= max_len for s in got)
    assert batch.seen_items.numel() == batch.seen_offsets.numel() == 0
    for which in SPLITS:
        (ev,) = batches.eval_batches(which, 64)
        assert _samples(ev) == list(_ref_samples(data, max_len, which).values())
        assert ev.global_targets == ev.num_targets == ev.batch_size == 3
    # User "10" (index 2): i0..i4 = 7 100 30 b x; training part 7 100 30.
    want = {1: ([100], [30]), 2: ([7, 100], [100, 30]), 3: ([7, 100], [100, 30])}
    if max_len in want:
        x, y = want[max_len]
        u = data.user_vocab.index("10")
        sample = {s[0]: s for s in got}[u]
        assert [data.item_vocab[i] for i in sample[1]] == [str(i) for i in x]
        assert [data.item_vocab[i] for i in sample[3]] == [str(i) for i in y]


def _synthetic(users: int = 24, seed: int = 5) -> SequenceData:
    """``users`` users with 1, 2, .., 9, 1, 2, .. interactions, random items and times
    (24 users: 18 with a training sample, those with 2 or >= 4 interactions)."""
    rng = np.random.default_rng(seed)
    lengths = [u % 9 + 1 for u in range(users)]
    us = [f"u{u}" for u, n in enumerate(lengths) for _ in range(n)]
    items = [str(i) for i in rng.integers(0, 12, size=len(us))]
    times = rng.integers(0, 1000, size=len(us))
    return sequences_from_columns(us, items, times, "synthetic")


@pytest.mark.parametrize("batch_size", [4, 8])
def test_ranks_concatenated_equal_one_process(batch_size: int) -> None:
    split = LeaveOneOut.of(_synthetic())

    def make(rank: int, size: int) -> SequenceBatches:
        return SequenceBatches(
            split, max_seq_len=3, batch_size=batch_size, rank=rank, size=size, seed=11
        )

    one = make(0, 1)
    n_train = len(one.train_users)
    assert n_train % batch_size, "the fixture must end each epoch with a partial batch"
    assert one.steps_per_epoch == math.ceil(n_train / batch_size)
    empty_rank_seen = False
    for epoch in (0, 1):
        single = [b for b, _ in one.train_batches(epoch)]
        users = [u for b in single for u in dict.fromkeys(b.users.tolist())]
        assert sorted(users) == one.train_users.tolist()  # each user once, its windows together
        for size in (1, 2, 4):
            per_rank = [[b for b, _ in make(r, size).train_batches(epoch)] for r in range(size)]
            assert {len(b) for b in per_rank} == {one.steps_per_epoch}
            for step, whole in enumerate(single):
                parts = [per_rank[r][step] for r in range(size)]
                assert [s for p in parts for s in _samples(p)] == _samples(whole)
                assert sum(p.num_targets for p in parts) == whole.global_targets
                assert {p.global_targets for p in parts} == {whole.num_targets}
                assert {(p.epoch, p.step) for p in parts} == {(epoch, step)}
                if step < len(single) - 1:
                    assert {len(set(p.users.tolist())) for p in parts} == {batch_size // size}
                empty_rank_seen |= any(p.batch_size == 0 for p in parts)
    if batch_size == 8:
        assert empty_rank_seen, "size 4 must deal a rank no user in the last batch"
    for which in SPLITS:
        for eval_size in (3, 8):
            evals = one.eval_batches(which, eval_size)
            assert len(evals) == math.ceil(len(split.eval_users(which)) / eval_size)
            assert [w.global_targets for w in evals] == [w.batch_size for w in evals]
            for size in (2, 4):
                per_rank_eval = [make(r, size).eval_batches(which, eval_size) for r in range(size)]
                assert {len(b) for b in per_rank_eval} == {len(evals)}
                for k, w in enumerate(evals):
                    eparts = [per_rank_eval[r][k] for r in range(size)]
                    assert [s for p in eparts for s in _samples(p)] == _samples(w)
                    assert {p.global_targets for p in eparts} == {w.batch_size}
                    assert {p.step for p in eparts} == {k}


def test_empty_batch_is_valid() -> None:
    split = LeaveOneOut.of(_synthetic())
    b = SequenceBatches(split, max_seq_len=3, batch_size=4, rank=3, size=4, seed=0)
    batch = b.train_batch(np.zeros(0, dtype=np.int64), 0)
    assert batch.offsets.tolist() == [0] and batch.batch_size == 0 and batch.num_targets == 0
    for t in (batch.items, batch.times, batch.targets, batch.target_times, batch.users):
        assert t.shape == (0,)


def test_skip_gives_the_same_batches() -> None:
    split = LeaveOneOut.of(_synthetic())
    b = SequenceBatches(split, max_seq_len=4, batch_size=4, rank=1, size=2, seed=3)
    full = [_samples(x) for x, _ in b.train_batches(2)]
    for skip in (0, 1, 3, len(full)):
        assert [_samples(x) for x, _ in b.train_batches(2, skip=skip)] == full[skip:]


def test_shuffle_depends_on_seed_and_epoch_only() -> None:
    split = LeaveOneOut.of(_synthetic(users=60))

    def order(seed: int, epoch: int, size: int = 1) -> list[int]:
        b = SequenceBatches(split, max_seq_len=2, batch_size=4, rank=0, size=size, seed=seed)
        return b.epoch_order(epoch).tolist()

    assert order(1, 0) == order(1, 0) == order(1, 0, size=4)
    assert order(1, 0) != order(1, 1)
    assert order(1, 0) != order(2, 0)
    assert sorted(order(1, 0)) == sorted(order(2, 5))


def test_movielens_100k() -> None:
    try:
        data = movielens_sequences()
    except FileNotFoundError as e:  # the data must be there: `make test` installs recbole
        pytest.fail(f"MovieLens-100k is missing: {e}")
    assert (data.num_users, data.num_items, data.num_interactions) == (943, 1682, 100000)
    assert data.source == "ml-100k (943 users, 1682 items, 100000 interactions)"
    assert data.user_vocab[:3] == ["1", "2", "3"] and data.item_vocab[-1] == "1682"
    owner = np.repeat(np.arange(data.num_users), data.lengths())
    same_user = owner[1:] == owner[:-1]
    assert (np.diff(data.times)[same_user] >= 0).all()
    split = LeaveOneOut.of(data)
    assert len(split.eval_users("test")) == 943  # every ml-100k user has >= 20 ratings
    assert split.item_train_counts().sum() == 100000 - 2 * 943


def test_errors_name_file_field_and_value(tmp_path: Path) -> None:
    root = _recbole(tmp_path, ROWS)
    with pytest.raises(ValueError, match=r"shop\.inter: no field 'ts' \(time_field\); its fields "
                       r"are \['user_id', 'item_id', 'rating', 'timestamp'\]"):  # fmt: skip
        read_recbole_sequences(root, time_field="ts")
    bad = [*ROWS[:3], ("2", "x", "soon"), *ROWS[3:]]
    (tmp_path / "bad").mkdir()
    with pytest.raises(ValueError, match=r"shop\.inter:5: time field 'timestamp' must "
                       r"be a number \(seconds\), got 'soon'"):  # fmt: skip
        read_recbole_sequences(_recbole(tmp_path / "bad", bad, time_type="token"))
    csv = tmp_path / "log.csv"
    csv.write_text("who,what,when\n" + "".join(f"{u},{i},{t}\n" for u, i, t in bad))
    with pytest.raises(ValueError, match=r"log\.csv:5: time field 'when' must be a number "
                       r"\(seconds\), got 'soon'"):  # fmt: skip
        read_tabular_sequences([csv], user_column="who", item_column="what", time_column="when")
    with pytest.raises(ValueError, match=r"log\.csv: no column 'item' \(item_column\); its "
                       r"columns are \['who', 'what', 'when'\]"):  # fmt: skip
        read_tabular_sequences([csv], user_column="who", item_column="item", time_column="when")
    split = LeaveOneOut.of(_synthetic())
    with pytest.raises(ValueError, match="batch_size 6 .* multiple of the 4 ranks"):
        SequenceBatches(split, max_seq_len=3, batch_size=6, rank=0, size=4, seed=0)


def _ref_windows(data: SequenceData, max_len: int) -> dict[int, list[tuple[list[int], list[int]]]]:
    """Every training target once: ``{user: [(inputs, targets), ...]}``, windows of
    ``max_len`` inputs counted back from the most recent, oldest first (plain lists)."""
    out: dict[int, list[tuple[list[int], list[int]]]] = {}
    for u in range(data.num_users):
        items = data.items[data.offsets[u] : data.offsets[u + 1]].tolist()
        n = len(items)
        s = items[: n - 2] if n >= 3 else items
        if len(s) < 2:
            continue
        inputs, targets = s[:-1], s[1:]
        windows = []
        end = len(inputs)
        while end > 0:
            start = max(0, end - max_len)
            windows.append((inputs[start:end], targets[start:end]))
            end = start
        out[u] = windows[::-1]
    return out


@pytest.mark.parametrize("max_len", [1, 2, 3, 10])
def test_all_windows_predict_every_training_target_once(max_len: int) -> None:
    """``windows="all"`` (the default): a user's training sequence in windows of
    ``max_len`` inputs from the most recent back, every target once, the user's
    windows together and oldest first; ``global_targets`` counts them all."""
    data = _synthetic(users=30, seed=2)
    split = LeaveOneOut.of(data)
    batches = SequenceBatches(split, max_seq_len=max_len, batch_size=30, rank=0, size=1, seed=0)
    ((batch, _),) = list(batches.train_batches(0))
    got: dict[int, list[tuple[list[int], list[int]]]] = {}
    off = batch.offsets.tolist()
    for b, u in enumerate(batch.users.tolist()):
        got.setdefault(u, []).append(
            (batch.items[off[b] : off[b + 1]].tolist(), batch.targets[off[b] : off[b + 1]].tolist())
        )
    assert got == _ref_windows(data, max_len)
    train_targets = sum(max(int(n) - 1, 0) for n in split.train_lengths() if n >= 2)
    assert batch.global_targets == batch.num_targets == train_targets
    with pytest.raises(ValueError, match="windows must be 'all' or 'last', got 'some'"):
        SequenceBatches(split, max_seq_len=2, batch_size=4, rank=0, size=1, seed=0,
                        windows="some")  # type: ignore[arg-type]  # fmt: skip


def _context_windows(split: LeaveOneOut, max_len: int, context: int) -> list[tuple[Any, ...]]:
    """Loop reference of ``context`` windows: ``(user, inputs, scored, targets)`` per
    window, users in id order, each user's windows oldest first."""
    d = split.data
    out = []
    for u in range(d.num_users):
        lo, end = int(d.offsets[u]), int(split.train_end[u])
        s = d.items[lo:end].tolist()
        if len(s) < 2:
            continue
        chunks, stop = [], len(s) - 1  # inputs s[:-1]; target of input j is s[j + 1]
        while stop > 0:
            chunks.append((max(0, stop - (max_len - context)), stop))
            stop = chunks[-1][0]
        for first, last in reversed(chunks):
            start = max(0, first - context)
            assert last - start <= max_len
            out.append((u, s[start:last], list(range(first - start, last - start)),
                        s[first + 1 : last + 1]))  # fmt: skip
    return out


def _windows_of(batch: SeqBatch) -> list[tuple[Any, ...]]:
    off = batch.offsets.tolist()
    scored = list(range(off[-1])) if batch.scored is None else batch.scored.tolist()
    targets = batch.targets.tolist()
    assert scored == sorted(scored) and len(scored) == len(targets) == batch.num_targets
    out = []
    for b, u in enumerate(batch.users.tolist()):
        mine = [k for k, p in enumerate(scored) if off[b] <= p < off[b + 1]]
        out.append((u, batch.items[off[b] : off[b + 1]].tolist(),
                    [scored[k] - off[b] for k in mine], [targets[k] for k in mine]))  # fmt: skip
    return out


@pytest.mark.parametrize(("max_len", "context"), [(2, 1), (3, 1), (5, 2), (10, 9), (4, 0)])
def test_context_windows_read_earlier_items_and_predict_each_target_once(
    max_len: int, context: int
) -> None:
    """``context = C``: windows of up to ``max_len`` inputs overlapping by ``C``; each
    predicts only its last ``max_len - C`` positions' next items (all of the oldest
    window's), so every training target is predicted once, after up to ``C`` earlier
    inputs; the ranks' batches concatenated equal one process's."""
    split = LeaveOneOut.of(_synthetic(users=30, seed=2))

    def make(rank: int, size: int, batch_size: int = 30) -> SequenceBatches:
        return SequenceBatches(split, max_seq_len=max_len, batch_size=batch_size, rank=rank,
                               size=size, seed=0, context=context)  # fmt: skip

    ((batch, _),) = list(make(0, 1).train_batches(0))
    assert (batch.scored is None) == (context == 0)
    got = sorted(_windows_of(batch), key=lambda w: w[0])  # stable: oldest first per user
    assert got == _context_windows(split, max_len, context)
    train_targets = sum(max(int(n) - 1, 0) for n in split.train_lengths() if n >= 2)
    assert batch.global_targets == batch.num_targets == train_targets
    for size in (2, 4):
        for step, (whole, _) in enumerate(make(0, 1, 8).train_batches(1)):
            parts = [list(make(r, size, 8).train_batches(1))[step][0] for r in range(size)]
            assert [w for p in parts for w in _windows_of(p)] == _windows_of(whole)
            assert sum(p.num_targets for p in parts) == whole.global_targets


@pytest.mark.parametrize(("max_len", "context"), [(3, 0), (5, 2), (10, 9)])
def test_window_batches_deal_every_window_once_shuffled_across_users(
    max_len: int, context: int
) -> None:
    """``unit="windows"``: an epoch's batches hold the windows of ``unit="users"`` (the
    loop reference), each once, ``batch_size`` of them a step, in an order drawn from
    ``(seed, epoch)`` across users (a user's windows spread over steps); the ranks'
    batches concatenated equal one process's at 2 and 4 ranks, and a skip builds the
    same later steps."""
    split = LeaveOneOut.of(_synthetic(users=30, seed=2))

    def make(rank: int, size: int, seed: int = 0) -> SequenceBatches:
        return SequenceBatches(split, max_seq_len=max_len, batch_size=8, rank=rank, size=size,
                               seed=seed, context=context, unit="windows")  # fmt: skip

    want = _context_windows(split, max_len, context)
    one = make(0, 1)
    assert one.steps_per_epoch == math.ceil(len(want) / 8) and len(want) % 8
    for epoch in (0, 1):
        single = [b for b, _ in one.train_batches(epoch)]
        windows = [_windows_of(b) for b in single]
        assert sorted(w for ws in windows for w in ws) == sorted(want)
        assert [len(ws) for ws in windows] == [8] * (len(single) - 1) + [len(want) % 8]
        for b, ws in zip(single, windows, strict=True):
            assert b.global_targets == b.num_targets == sum(len(w[3]) for w in ws)
        steps_of: dict[int, set[int]] = {}
        for step, ws in enumerate(windows):
            for w in ws:
                steps_of.setdefault(w[0], set()).add(step)
        assert any(len(steps) > 1 for steps in steps_of.values())
        for size in (2, 4):
            per_rank = [[b for b, _ in make(r, size).train_batches(epoch)] for r in range(size)]
            assert {len(b) for b in per_rank} == {one.steps_per_epoch}
            for step, whole in enumerate(single):
                parts = [per_rank[r][step] for r in range(size)]
                assert [w for p in parts for w in _windows_of(p)] == windows[step]
                assert {p.global_targets for p in parts} == {whole.num_targets}
                assert {(p.epoch, p.step) for p in parts} == {(epoch, step)}
        for skip in (1, len(single) - 1):
            later = [_windows_of(b) for b, _ in one.train_batches(epoch, skip=skip)]
            assert later == windows[skip:]
    assert [_windows_of(b) for b, _ in make(0, 1, seed=1).train_batches(0)] != [
        _windows_of(b) for b, _ in one.train_batches(0)
    ]


def test_context_errors() -> None:
    split = LeaveOneOut.of(_synthetic())
    with pytest.raises(ValueError, match=r"context must be in \[0, max_seq_len = 3\), got 3"):
        SequenceBatches(split, max_seq_len=3, batch_size=4, rank=0, size=1, seed=0, context=3)
    with pytest.raises(ValueError, match="context 1 needs windows='all'"):
        SequenceBatches(split, max_seq_len=3, batch_size=4, rank=0, size=1, seed=0,
                        windows="last", context=1)  # fmt: skip
    with pytest.raises(ValueError, match="unit must be 'users' or 'windows', got 'items'"):
        SequenceBatches(split, max_seq_len=3, batch_size=4, rank=0, size=1, seed=0,
                        unit="items")  # type: ignore[arg-type]  # fmt: skip
