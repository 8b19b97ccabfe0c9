"""Any data set in RecBole's atomic-file format, as in-memory click data.

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
(``hybridrec/datasets/movielens.toml`` builds MovieLens's that way). The samples are
split train/validation/test at random (seeded).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from hybridrec.datasets.criteo import hash_categorical
from hybridrec.datasets.ctr import CTRData, SparseFeature, split_indices, standardize_
from hybridrec.datasets.schema import DenseColumn, LabelColumn, Schema, SparseColumn
from hybridrec.datasets.tabular import string_id

TYPES = ("token", "token_seq", "float", "float_seq")
SEQ_SEPARATOR = " "


@dataclass(slots=True)
class AtomicTable:
    """One atomic file: field names, their types, and each field's values as text."""

    path: Path
    names: list[str]
    types: list[str]
    columns: dict[str, list[str]]

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
    columns = {n: [r[j] for r in rows] for j, n in enumerate(names)}
    return AtomicTable(path, names, types, columns), skipped


def _is_numbers(value: str) -> bool:
    try:
        [float(x) for x in value.split(SEQ_SEPARATOR) if x]
    except ValueError:
        return False
    return True


def token_vocab(tokens: list[str]) -> dict[str, int]:
    """Contiguous ids from 1 in sorted token order (numbers numerically); 0 is unknown."""
    order = sorted(set(tokens), key=lambda t: (not t.isdigit(), int(t) if t.isdigit() else 0, t))
    return {t: i + 1 for i, t in enumerate(order)}


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


def joined_fields(root: Path, *, skip_bad_lines: bool = False) -> tuple[list[_Field], int]:
    """Every field of the interactions, with the user and item fields joined on."""
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
    return out, skipped


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
    schema = schema or Schema()
    fields, _ = joined_fields(Path(root), skip_bad_lines=skip_bad_lines)
    names = [f.name for f in fields]
    schema.check_columns(names, f"RecBole data {root}")
    label = schema.label or _default_label(fields)
    by_name = {f.name: f for f in fields}
    n = len(fields[0].values)
    if n == 0:
        raise ValueError(f"RecBole data {root}: the .inter file has no interactions")
    where = f"RecBole data {root}: field {label.column!r}"
    try:
        uniq, inv = _unique(by_name[label.column].values)
        labels = torch.tensor([label.clicked(v) for v in uniq])[torch.from_numpy(inv)]  # [N]
    except ValueError as e:
        raise ValueError(f"{where}: {e}") from None
    train_idx, val_idx, test_idx = split_indices(n, fractions, seed)
    for split, idx in (("train", train_idx), ("validation", val_idx), ("test", test_idx)):
        if len(idx) == 0:
            raise ValueError(
                f"RecBole data {root}: the {split} split is empty ({n} interactions, "
                f"fractions {fractions})"
            )
    named = schema.named_columns()
    skip = {label.column, *schema.drop}
    auto = [f for f in fields if f.name not in skip and f.name not in named]
    dense_plan = list(schema.dense) + [
        DenseColumn(column=f.name, standardize=True) for f in auto if f.kind.startswith("float")
    ]
    sparse_plan = list(schema.sparse) + [
        SparseColumn(column=f.name, vocab=True) for f in auto if f.kind.startswith("token")
    ]
    train_np = train_idx.numpy()
    dense_cols: list[np.ndarray] = []  # [N] float64 each
    dense_names: list[str] = []
    scaled: list[int] = []  # the dense features to standardize
    for opt in dense_plan:
        for name, col in _dense(by_name[opt.column], opt, train_np, str(root)):
            if opt.standardize:
                scaled.append(len(dense_cols))
            dense_cols.append(col)
            dense_names.append(name)
    dense = (
        torch.from_numpy(np.stack(dense_cols, axis=1).astype(np.float32))
        if dense_cols
        else torch.zeros((n, 0), dtype=torch.float32)
    )  # [N, D]
    if scaled and scaled == list(range(len(dense_names))):
        standardize_(dense, train_idx)
    elif scaled:
        part = dense[:, scaled].contiguous()
        standardize_(part, train_idx)
        dense[:, scaled] = part
    sparse = [
        _sparse(by_name[opt.column], opt, [c.column for c in sparse_plan].index(opt.column))
        for opt in sparse_plan
    ]
    if not sparse:
        raise ValueError(f"RecBole data {root}: no sparse (token) fields left; fields: {names}")
    item_key = next((f.name for f in fields if f.name == "item_id"), None)
    item = next((o.feature for o in sparse_plan if o.column == item_key), sparse[0].name)
    return CTRData(
        dense=dense,
        dense_names=dense_names,
        sparse=sparse,
        labels=labels.float(),
        train_idx=train_idx,
        val_idx=val_idx,
        test_idx=test_idx,
        item_feature=item,
    )


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


def _unique(values: list[str]) -> tuple[list[str], np.ndarray]:
    """The distinct values and, per row, the index ``[N]`` of its value among them
    (features are worked out once per distinct value, then gathered)."""
    uniq, inverse = np.unique(np.asarray(values, dtype=str), return_inverse=True)
    return [str(u) for u in uniq.tolist()], inverse.reshape(-1).astype(np.int64)


def _dense(
    f: _Field, opt: DenseColumn, train: np.ndarray, root: str
) -> list[tuple[str, np.ndarray]]:
    """The dense feature(s) ``[N]`` float64 of field ``f`` (standardized later)."""
    where = f"RecBole data {root}: field {f.name!r}"
    uniq, inv = _unique(f.values)
    if opt.of == "length":
        counted = [[float(len([t for t in v.split(SEQ_SEPARATOR) if t]))] for v in uniq]
        block = np.asarray(counted, dtype=np.float64)[inv]  # [N, 1]
    elif opt.of == "train_count":
        counts = np.bincount(inv[train], minlength=len(uniq))  # [U]
        block = counts[inv].astype(np.float64).reshape(-1, 1)  # [N, 1]
    else:
        seqs = _numbers(uniq, where, lenient=f.kind == "token")
        width = max(1, max(len(q) for q in seqs))
        per_value = np.full((len(uniq), width), np.nan)  # [U, W]
        for i, q in enumerate(seqs):
            per_value[i, : len(q)] = q
        block = per_value[inv]  # [N, W]
        fill = opt.fill or ("zero" if f.kind == "float_seq" else "mean")
        for j in range(width):
            col = block[:, j]
            if fill == "zero":
                value = 0.0
            elif fill == "median":
                own = _numbers(
                    f.own if f.own is not None else f.values, where, lenient=f.kind == "token"
                )
                have = [q[j] for q in own if len(q) > j]
                value = float(np.median(have)) if have else 0.0
            else:
                seen = col[train][~np.isnan(col[train])]
                value = float(seen.mean()) if len(seen) else 0.0
            col[np.isnan(col)] = value
    out = []
    for j in range(block.shape[1]):
        col = block[:, j]
        if opt.log:
            col = np.log1p(np.maximum(col, 0.0))
        out.append((opt.feature if block.shape[1] == 1 else f"{opt.feature}_{j}", col))
    return out


def _sparse(f: _Field, opt: SparseColumn, k: int) -> SparseFeature:
    """The sparse feature of field ``f``; ``k`` its place among the sparse columns (hashing)."""
    sep = (
        opt.separator
        if opt.separator is not None
        else (SEQ_SEPARATOR if f.kind == "token_seq" else None)
    )
    uniq, inv = _unique(f.values)
    bags = [
        ([t for t in v.split(sep) if t] if sep is not None else ([v] if v else [])) for v in uniq
    ]  # per distinct value
    if opt.prefix is not None:
        bags = [[t[: opt.prefix] for t in b] for b in bags]
    if opt.buckets is not None:
        edges = np.array(sorted(opt.buckets), dtype=np.float64)
        try:
            flat_num = np.array([float(t) for b in bags for t in b], dtype=np.float64)
        except ValueError:
            raise ValueError(f"field {f.name!r}: buckets need numbers") from None
        ids_flat = (np.searchsorted(edges, flat_num, side="right") + 1).tolist()
        rows = len(edges) + 2
    elif not opt.vocab:
        rows = opt.hash_rows
        flat = torch.tensor([string_id(t) for b in bags for t in b], dtype=torch.int64)
        ids_flat = hash_categorical(flat, k, rows).tolist()
    else:
        vocab = token_vocab([t for b in bags for t in b])
        rows = len(vocab) + 1
        ids_flat = [vocab[t] for b in bags for t in b]
    width = max(1, max(len(b) for b in bags))
    ids = np.zeros((len(uniq), width), dtype=np.int64)  # [U, L], 0-padded
    lengths = np.array([len(b) for b in bags], dtype=np.int64)  # [U]
    pos = 0
    for i, b in enumerate(bags):
        ids[i, : len(b)] = ids_flat[pos : pos + len(b)]
        pos += len(b)
    if sep is None:
        lengths[:] = 1  # a missing token is id 0 (unknown)
    return SparseFeature(
        name=opt.feature,
        ids=torch.from_numpy(ids[inv]),  # [N, L]
        lengths=torch.from_numpy(lengths[inv]),  # [N]
        num_rows=rows,
    )
