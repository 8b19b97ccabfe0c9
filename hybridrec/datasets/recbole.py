"""Any data set in RecBole's atomic-file format read, joined and split into in-memory click data.

A data set is a folder holding ``NAME.inter`` (one interaction a line) and
optionally ``NAME.user`` and ``NAME.item`` (one user or item a line). Files are
tab-separated with a typed header, e.g. ``user_id:token	rating:float``; either
line ending is read. The types map to features:

* ``token``: one sparse feature (a vocabulary of every value in the files, ids
  from 1 in sorted order, numbers numerically; 0 is unknown);
* ``token_seq``: a multi-valued sparse feature (values separated by spaces);
* ``float``: one dense feature (missing: the training mean), standardized with
  training-split statistics;
* ``float_seq``: one dense feature per position (missing: 0), standardized.

The ``.user`` (``.item``) file's first field is its key; it is joined onto the
interactions that have the same field, so every interaction gets its user's and
its item's features. Ids are arbitrary strings. The label is the schema's
(:mod:`hybridrec.datasets.schema`), else a ``label`` field (0/1), else
``rating >= 4``. A schema can also drop fields and give a field other options
(``[[sparse]]``: hashing, a separator; ``[[dense]]``: ``log``, ``standardize``;
a ``token`` field named under ``[[dense]]`` is read as a number, a value that is
not one counting as missing). The schema's columns come first, in its order,
then the fields it does not name, by type; ``name``, ``of`` (``length`` of a
token list, ``train_count`` of a value's training interactions), ``fill``
(``median`` of the field's own file), ``prefix`` and ``buckets`` derive features
(``docs/movielens_schema.toml`` builds MovieLens's that way). The samples are
split train/validation/test at random (seeded).

This file reads the files, joins them and turns the types and the schema into one
encoder per feature; the encoders (:mod:`hybridrec.datasets.encode`) learn their
vocabularies, counts, fill values and statistics from the columns and encode them,
each distinct value once. A hashed field's values are hashed as text.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from hybridrec.datasets.ctr import (
    Batch,
    CTRData,
    KeyRow,
    SparseFeature,
    gather_batch,
    split_indices,
)
from hybridrec.datasets.encode import (
    BucketEncoder,
    Column,
    DenseEncoder,
    Encoders,
    HashEncoder,
    LabelEncoder,
    SparseEncoder,
    VocabEncoder,
    dense_matrix,
    fill_value,
    fit_standardization,
    sparse_feature,
    train_counts,
)
from hybridrec.datasets.schema import DenseColumn, LabelColumn, Schema, SparseColumn

TYPES = ("token", "token_seq", "float", "float_seq")
SEQ_SEPARATOR = " "


@dataclass(slots=True)
class AtomicTable:
    """One atomic file: field names, their types, and each field's values as text."""

    path: Path
    names: list[str]
    types: list[str]
    columns: dict[str, list[str]]
    lines: list[int]  # the file line of each row (the header is line 1)

    def __len__(self) -> int:
        return len(self.columns[self.names[0]]) if self.names else 0


def read_atomic(path: Path, *, skip_bad_lines: bool = False) -> tuple[AtomicTable, int]:
    """``path`` -> (the table, lines skipped); ``ValueError`` naming file and line."""
    with path.open("rb") as f:
        data = f.read()
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        lineno = data[: e.start].count(b"\n") + 1
        raise ValueError(f"{path}:{lineno}: not UTF-8 text") from None
    lines = text.replace("\r\n", "\n").split("\n")
    if not lines or not lines[0].strip():
        raise ValueError(f"{path}:1: expected a header such as 'user_id:token\\titem_id:token'")
    names: list[str] = []
    types: list[str] = []
    for h in lines[0].split("\t"):
        name, sep, kind = h.rpartition(":")
        if not sep or kind not in TYPES or not name:
            raise ValueError(
                f"{path}:1: header field {h!r} must be NAME:TYPE with TYPE one of {TYPES}"
            )
        names.append(name)
        types.append(kind)
    rows: list[list[str]] = []
    linenos: list[int] = []
    skipped = 0
    for i, line in enumerate(lines[1:]):
        if not line.strip():
            continue
        fields = line.split("\t")
        if len(fields) != len(names):
            if not skip_bad_lines:
                raise ValueError(
                    f"{path}:{i + 2}: expected {len(names)} tab-separated fields {names}, "
                    f"got {len(fields)}"
                )
            skipped += 1
            continue
        rows.append(fields)
        linenos.append(i + 2)
    # Numbers are checked once per distinct value; a bad one is then found by line.
    bad_rows: set[int] = set()
    for j, (name, kind) in enumerate(zip(names, types, strict=True)):
        if not kind.startswith("float"):
            continue
        bad = {v for v in {r[j] for r in rows} if not _is_numbers(v)}
        for k, r in enumerate(rows):
            if r[j] in bad:
                if not skip_bad_lines:
                    raise ValueError(
                        f"{path}:{linenos[k]}: field {name!r} ({kind}) must be numbers, "
                        f"got {r[j]!r}"
                    )
                bad_rows.add(k)
    if bad_rows:
        skipped += len(bad_rows)
        rows = [r for k, r in enumerate(rows) if k not in bad_rows]
        linenos = [line for k, line in enumerate(linenos) if k not in bad_rows]
    columns = {n: [r[j] for r in rows] for j, n in enumerate(names)}
    return AtomicTable(path, names, types, columns, linenos), skipped


def _is_numbers(value: str) -> bool:
    try:
        [float(x) for x in value.split(SEQ_SEPARATOR) if x]
    except ValueError:
        return False
    return True


def atomic_files(root: Path) -> dict[str, Path]:
    """The ``inter`` (required), ``user`` and ``item`` files of the data set in ``root``."""
    if not root.is_dir():
        raise FileNotFoundError(f"RecBole data: {root} is not a folder")
    inters = sorted(root.glob("*.inter"))
    if len(inters) != 1:
        raise FileNotFoundError(
            f"RecBole data: {root} must hold exactly one .inter file, found "
            f"{[p.name for p in inters]}"
        )
    out = {"inter": inters[0]}
    for kind in ("user", "item"):
        p = inters[0].with_suffix("." + kind)
        if p.is_file():
            out[kind] = p
    return out


@dataclass(slots=True)
class _Field:
    """One field of the joined data: its values for every interaction."""

    name: str
    kind: str
    values: list[str]  # [N]
    own: list[str] | None = None  # the values in the field's own file (.user/.item), one per row
    column: Column = field(init=False)  # the values with their distinct ones

    def __post_init__(self) -> None:
        self.column = Column(self.values)


def joined_fields(
    root: Path, *, skip_bad_lines: bool = False
) -> tuple[list[_Field], int, AtomicTable]:
    """Every field of the interactions, with the user and item fields joined on; the
    lines skipped; the interactions' own table (its path and each row's line)."""
    files = atomic_files(root)
    inter, skipped = read_atomic(files["inter"], skip_bad_lines=skip_bad_lines)
    out = [_Field(n, t, inter.columns[n]) for n, t in zip(inter.names, inter.types, strict=True)]
    for kind in ("user", "item"):
        if kind not in files:
            continue
        table, s = read_atomic(files[kind], skip_bad_lines=skip_bad_lines)
        skipped += s
        key = table.names[0]
        if key not in inter.columns:
            raise ValueError(
                f"{table.path}: its key field {key!r} (the first) is not a field of "
                f"{inter.path}, which has {inter.names}"
            )
        row_of = {v: i for i, v in enumerate(table.columns[key])}
        rows = [row_of.get(v, -1) for v in inter.columns[key]]  # -1: no such user/item
        for name, t in zip(table.names[1:], table.types[1:], strict=True):
            col = table.columns[name]
            out.append(_Field(name, t, [col[r] if r >= 0 else "" for r in rows], col))
    return out, skipped, inter


def _default_label(fields: list[_Field]) -> LabelColumn:
    names = [f.name for f in fields]
    if "label" in names:
        return LabelColumn(column="label")
    if "rating" in names:
        return LabelColumn(column="rating", rule=">= 4")
    raise ValueError(
        f"RecBole data: no 'label' or 'rating' field to derive clicks from; fields: {names}. "
        "Name one in the schema: [label] column = ... rule = ..."
    )


def load_recbole(
    root: str | Path,
    schema: Schema | None = None,
    *,
    seed: int = 0,
    fractions: tuple[float, float, float] = (0.8, 0.1, 0.1),
    skip_bad_lines: bool = False,
) -> CTRData:
    """The data set in ``root`` as click data (see the module docstring)."""
    return read_recbole(
        root, schema, seed=seed, fractions=fractions, skip_bad_lines=skip_bad_lines
    )[0]


def read_recbole(
    root: str | Path,
    schema: Schema | None = None,
    *,
    seed: int = 0,
    fractions: tuple[float, float, float] = (0.8, 0.1, 0.1),
    skip_bad_lines: bool = False,
    encoders: Encoders | None = None,
) -> tuple[CTRData, Encoders]:
    """The data set in ``root`` as click data, and the encoders that built it: fitted to
    its training split, or ``encoders`` (a saved run's) as they are, so that new files
    encode as that run's did."""
    fields, _, _ = joined_fields(Path(root), skip_bad_lines=skip_bad_lines)
    n = len(fields[0].values)
    if n == 0:
        raise ValueError(f"RecBole data {root}: the .inter file has no interactions")
    train_idx, val_idx, test_idx = split_indices(n, fractions, seed)
    for split, idx in (("train", train_idx), ("validation", val_idx), ("test", test_idx)):
        if len(idx) == 0:
            raise ValueError(
                f"RecBole data {root}: the {split} split is empty ({n} interactions, "
                f"fractions {fractions})"
            )
    encoded = encode_fields(fields, schema or Schema(), train_idx, str(root), encoders)
    data = CTRData(
        dense=encoded.dense,
        dense_names=[e.name for e in encoded.encoders.dense],
        sparse=encoded.sparse,
        labels=encoded.labels,
        train_idx=train_idx,
        val_idx=val_idx,
        test_idx=test_idx,
        item_feature=encoded.item_feature,
    )
    return data, encoded.encoders


@dataclass(slots=True)
class EncodedFields:
    """Every interaction's features: dense ``[N, D]`` float32, sparse features ``[N, L]``,
    labels ``[N]`` float32, the encoders that made them and the popularity feature."""

    dense: torch.Tensor
    sparse: list[SparseFeature]
    labels: torch.Tensor
    encoders: Encoders
    item_feature: str


def encode_fields(
    fields: list[_Field],
    schema: Schema,
    train_idx: torch.Tensor,
    root: str,
    saved: Encoders | None = None,
) -> EncodedFields:
    """The joined ``fields`` encoded: with encoders fitted to the rows ``train_idx``, or
    with ``saved`` as they are (``train_idx`` unused; an unseen value is the unknown
    row, a missing label field labels every row 0: files to score need none)."""
    names = [f.name for f in fields]
    schema.check_columns(names, f"RecBole data {root}")
    by_name = {f.name: f for f in fields}
    n = len(fields[0].values)
    if saved is not None:
        label = saved.label
    else:
        label_col = schema.label or _default_label(fields)
        label = LabelEncoder(column=label_col.column, rule=label_col.rule)
    labels = np.zeros(n, dtype=np.float32)  # [N]
    if label is not None and (saved is None or label.column in by_name):
        where = f"RecBole data {root}: field {label.column!r}"
        try:
            uniq, inv = by_name[label.column].column.distinct
            labels = np.asarray([label.clicked(v) for v in uniq], dtype=np.float32)[inv]
        except ValueError as e:
            raise ValueError(f"{where}: {e}") from None
    named = schema.named_columns()
    skip = {*schema.drop, *([label.column] if label is not None else [])}
    auto = [f for f in fields if f.name not in skip and f.name not in named]
    dense_plan = list(schema.dense) + [
        DenseColumn(column=f.name, standardize=True) for f in auto if f.kind.startswith("float")
    ]
    sparse_plan = list(schema.sparse) + [
        SparseColumn(column=f.name, vocab=True) for f in auto if f.kind.startswith("token")
    ]
    if saved is not None:
        _check_saved(saved, dense_plan, sparse_plan, root)
    train_np = train_idx.numpy()
    dense_enc: list[DenseEncoder] = []
    numbers: list[np.ndarray] = []  # [N] float64 each, NaN: missing
    for dcol in dense_plan:
        was = None if saved is None else _saved_dense(saved, dcol.feature)
        for denc, x in _dense(by_name[dcol.column], dcol, train_np, root, was):
            dense_enc.append(denc)
            numbers.append(x)
    if saved is None:
        dense_enc = fit_standardization(dense_enc, numbers, train_idx)
    sparse_enc: list[SparseEncoder] = []
    sparse = []
    columns = [c.column for c in sparse_plan]
    for k, opt in enumerate(sparse_plan):
        f = by_name[opt.column]
        if saved is None:
            enc = _sparse_encoder(f, opt, columns.index(opt.column))
        else:
            enc = saved.sparse[k]
        try:
            sparse.append(sparse_feature(enc, f.column))
        except ValueError as e:
            if not isinstance(enc, BucketEncoder):
                raise
            raise ValueError(f"field {f.name!r}: {e}") from None
        sparse_enc.append(enc)
    if not sparse:
        raise ValueError(f"RecBole data {root}: no sparse (token) fields left; fields: {names}")
    item_key = next((f.name for f in fields if f.name == "item_id"), None)
    item = next((o.feature for o in sparse_plan if o.column == item_key), sparse[0].name)
    return EncodedFields(
        dense=dense_matrix(dense_enc, numbers, n),
        sparse=sparse,
        labels=torch.from_numpy(labels),
        encoders=Encoders(label=label, dense=dense_enc, sparse=sparse_enc),
        item_feature=item,
    )


def _check_saved(
    saved: Encoders, dense: list[DenseColumn], sparse: list[SparseColumn], root: str
) -> None:
    """``ValueError`` unless the saved run encoded the features this schema and these
    fields give, in the same order (each sparse one is a table of the saved model)."""
    now = [c.feature for c in sparse]
    was = [e.name for e in saved.sparse]
    if now != was:
        raise ValueError(
            f"RecBole data {root}: sparse features {now}, but the saved run encoded {was} "
            "(score files with the fields and the schema the run trained with)"
        )
    missing = [c.feature for c in dense if not _saved_dense(saved, c.feature)]
    if missing:
        raise ValueError(
            f"RecBole data {root}: dense feature(s) {missing} were not features of the saved "
            f"run, which has {[e.name for e in saved.dense]}"
        )


def _saved_dense(saved: Encoders, feature: str) -> list[DenseEncoder]:
    """The saved encoders of dense ``feature``: one, or ``feature_0 ..`` of a sequence."""
    one = [e for e in saved.dense if e.name == feature]
    return one or [e for e in saved.dense if re.fullmatch(re.escape(feature) + r"_\d+", e.name)]


def _number_or_none(t: str) -> list[float]:
    try:
        return [float(t)]
    except ValueError:
        return []


def _numbers(values: list[str], where: str, lenient: bool = False) -> list[list[float]]:
    """Numbers of each value; ``lenient`` (a token field read as a number): a value
    that is not a number is missing."""
    if lenient:
        return [_number_or_none(v) for v in values]
    try:
        return [[float(x) for x in v.split(SEQ_SEPARATOR) if x] for v in values]
    except ValueError:
        raise ValueError(f"{where}: must be numbers") from None


def _dense(
    f: _Field,
    opt: DenseColumn,
    train: np.ndarray,
    root: str,
    saved: list[DenseEncoder] | None = None,
) -> list[tuple[DenseEncoder, np.ndarray]]:
    """The dense feature(s) of field ``f``: each one's encoder (its fill and counts
    fitted, not yet its standardization; or ``saved``, a run's, as they are: a sequence
    then has the saved width) and numbers ``[N]`` float64 (NaN: missing)."""
    where = f"RecBole data {root}: field {f.name!r}"
    enc = DenseEncoder(name=opt.feature, log=opt.log, standardize=opt.standardize)
    uniq, inv = f.column.distinct
    if opt.of == "train_count":
        if saved is not None:
            return [(saved[0], saved[0].count(uniq)[inv])]
        enc.counts = train_counts(f.column, train)
        return [(enc, enc.count(uniq)[inv])]
    if opt.of == "length":
        counted = [float(len([t for t in v.split(SEQ_SEPARATOR) if t])) for v in uniq]
        return [(saved[0] if saved else enc, np.asarray(counted, dtype=np.float64)[inv])]
    seqs = _numbers(uniq, where, lenient=f.kind == "token")
    if saved is not None:
        width = len(saved)
        per_value = np.full((len(uniq), width), np.nan)  # [U, W], a longer value cut
        for i, q in enumerate(seqs):
            per_value[i, : min(len(q), width)] = q[:width]
        return [(e, per_value[inv][:, j]) for j, e in enumerate(saved)]
    width = max(1, max(len(q) for q in seqs))
    per_value = np.full((len(uniq), width), np.nan)  # [U, W]
    for i, q in enumerate(seqs):
        per_value[i, : len(q)] = q
    block = per_value[inv]  # [N, W]
    fill = opt.fill or ("zero" if f.kind == "float_seq" else "mean")
    own: list[list[float]] = []
    if fill == "median":
        own = _numbers(f.own if f.own is not None else f.values, where, lenient=f.kind == "token")
    out = []
    for j in range(width):
        col = block[:, j]
        value = fill_value(fill, col, train, [q[j] for q in own if len(q) > j])
        name = opt.feature if width == 1 else f"{opt.feature}_{j}"
        out.append((dataclasses.replace(enc, name=name, fill=value), col))
    return out


def _sparse_encoder(f: _Field, opt: SparseColumn, k: int) -> SparseEncoder:
    """The encoder of field ``f``'s sparse feature, fitted; ``k`` its place among the
    sparse columns (the hash's salt)."""
    sep = (
        opt.separator
        if opt.separator is not None
        else (SEQ_SEPARATOR if f.kind == "token_seq" else None)
    )
    name, prefix = opt.feature, opt.prefix
    if opt.buckets is not None:
        return BucketEncoder(name=name, separator=sep, prefix=prefix, edges=list(opt.buckets))
    if not opt.vocab:
        return HashEncoder(name=name, separator=sep, prefix=prefix, salt=k, rows=opt.hash_rows)
    vocab = VocabEncoder(name=name, separator=sep, prefix=prefix)
    uniq, _ = f.column.distinct
    return vocab.fitted([t for v in uniq for t in vocab.bag(v)], numbers_first=True)


def keyed_batches(
    root: str | Path,
    schema: Schema | None,
    encoders: Encoders,
    keys: Sequence[str],
    *,
    batch_size: int,
    rank: int = 0,
    world_size: int = 1,
    skip_bad_lines: bool = False,
) -> tuple[Path, Iterator[tuple[Batch, list[KeyRow]]]]:
    """The interactions of the data set in ``root`` to score with a saved run's
    ``encoders``: its ``.inter`` file, and this rank's share (interaction ``i`` goes to
    rank ``i mod world_size``) in batches, each with its rows' ``(0, line, key field
    texts)``. ``keys`` are any fields of the joined data (``user_id``, an item field)."""
    fields, _, inter = joined_fields(Path(root), skip_bad_lines=skip_bad_lines)
    names = [f.name for f in fields]
    unknown = [k for k in keys if k not in names]
    if unknown:
        raise ValueError(f"--key {' '.join(unknown)}: not fields of {root}; its fields are {names}")
    share = np.arange(rank, len(inter), world_size)  # [n_rank] this rank's interactions
    mine = [_Field(f.name, f.kind, [f.values[i] for i in share], f.own) for f in fields]
    by_name = {f.name: f for f in mine}
    lines = [inter.lines[i] for i in share]

    def batches() -> Iterator[tuple[Batch, list[KeyRow]]]:
        if not len(share):
            return
        enc = encode_fields(mine, schema or Schema(), torch.empty(0, dtype=torch.int64),
                            str(root), encoders)  # fmt: skip
        data = CTRData(
            dense=enc.dense, dense_names=[e.name for e in enc.encoders.dense], sparse=enc.sparse,
            labels=enc.labels, train_idx=torch.empty(0, dtype=torch.int64),
            val_idx=torch.empty(0, dtype=torch.int64), test_idx=torch.arange(len(share)),
            item_feature=enc.item_feature,
        )  # fmt: skip
        for at in range(0, len(share), batch_size):
            idx = torch.arange(at, min(at + batch_size, len(share)))
            rows = [(0, lines[i], [by_name[k].values[i] for k in keys]) for i in idx.tolist()]
            yield gather_batch(data, idx), rows

    return inter.path, batches()
