"""What the columns of a user's data mean: the schema that the tabular and RecBole readers
follow, read from a TOML or JSON file and checked.

A schema is a TOML or JSON file (``--schema FILE``)::

    format = "csv"            # csv, tsv or parquet; default: from the file name
    drop = ["timestamp"]      # columns (fields) not used

    [label]
    column = "rating"
    rule = ">= 4"             # click if the value is >= 4; default "0/1": the column holds 0 or 1

    [[dense]]
    column = "price"
    log = true                # log1p(max(x, 0)) first
    standardize = true        # then zero mean, unit variance (training-split statistics)

    [[sparse]]
    column = "user_id"
    vocab = true              # a vocabulary of the training split; row 0: unseen values

    [[sparse]]
    column = "tags"
    separator = "|"           # several values per row (mean-pooled); none: one value
    hash_rows = 100000        # hashed into this many rows (the default when vocab is false)

A missing dense value is 0 (before ``log``/``standardize``); a missing sparse
value is an empty bag. ``encoding = "hex"`` on a hashed column reads its values
as hex integers, which the Criteo reader also does (so a Criteo file read
through a schema gives the Criteo reader's ids and values: the encoders of
:mod:`hybridrec.datasets.encode` do what these options say, for every reader).
"""

from __future__ import annotations

import json
import tomllib
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hybridrec.cli.options import type_mismatch
from hybridrec.datasets.encode import LabelEncoder


@dataclass(kw_only=True, slots=True)
class LabelColumn:
    """The label column and how a click (1) is derived from its value."""

    column: str
    rule: str = "0/1"  # "0/1": the value is 0 or 1; else "OP NUMBER", e.g. ">= 4"

    def __post_init__(self) -> None:
        LabelEncoder(column=self.column, rule=self.rule)  # checks the rule


@dataclass(kw_only=True, slots=True)
class DenseColumn:
    column: str
    log: bool = False  # log1p(max(x, 0))
    standardize: bool = False  # zero mean, unit variance with training-split statistics
    # In-memory (RecBole) data only:
    name: str | None = None  # the feature's name; default: the column's
    of: str = "value"  # value; length (of a token_seq); train_count (training rows with this value)
    fill: str | None = None  # a missing value: zero, mean or median (of the field's own file)

    def __post_init__(self) -> None:
        if self.of not in ("value", "length", "train_count"):
            raise ValueError(
                f"dense column {self.column!r}: of must be value, length or train_count, "
                f"got {self.of!r}"
            )
        if self.fill not in (None, "zero", "mean", "median"):
            raise ValueError(
                f"dense column {self.column!r}: fill must be zero, mean or median, "
                f"got {self.fill!r}"
            )

    @property
    def feature(self) -> str:
        return self.name or self.column


@dataclass(kw_only=True, slots=True)
class SparseColumn:
    column: str
    separator: str | None = None  # several values per row split by this; None: one value
    vocab: bool = False  # a vocabulary of the training split (row 0: out of vocabulary)
    hash_rows: int = 100_000  # rows when hashed (vocab false)
    encoding: str = "string"  # hashed values: "string" (any text) or "hex" (hex integers)
    # In-memory (RecBole) data only:
    name: str | None = None  # the feature's name; default: the column's
    prefix: int | None = None  # keep the first N characters of a value
    buckets: list[float] | None = None  # a number -> 1 + how many edges are <= it

    def __post_init__(self) -> None:
        if self.separator == "":
            self.separator = None
        if self.hash_rows < 1:
            raise ValueError(
                f"sparse column {self.column!r}: hash_rows must be >= 1, got {self.hash_rows}"
            )
        if self.encoding not in ("string", "hex"):
            raise ValueError(
                f"sparse column {self.column!r}: encoding must be 'string' or 'hex', "
                f"got {self.encoding!r}"
            )

    @property
    def feature(self) -> str:
        return self.name or self.column


@dataclass(kw_only=True, slots=True)
class Schema:
    """Label, dense and sparse columns of a data set (see the module docstring)."""

    label: LabelColumn | None = None  # None: the reader's default (RecBole: none given)
    dense: list[DenseColumn] = field(default_factory=list)
    sparse: list[SparseColumn] = field(default_factory=list)
    drop: list[str] = field(default_factory=list)
    format: str | None = None  # csv, tsv, parquet; None: from the file name

    def __post_init__(self) -> None:
        if self.format not in (None, "csv", "tsv", "parquet"):
            raise ValueError(f"schema format must be csv, tsv or parquet, got {self.format!r}")
        for kind, names in (
            ("dense", [c.feature for c in self.dense]),
            ("sparse", [c.feature for c in self.sparse]),
        ):
            twice = sorted({n for n in names if names.count(n) > 1})
            if twice:
                raise ValueError(f"schema: {kind} features named more than once: {twice}")

    def in_memory_options(self) -> list[str]:
        """The options a streamed reader cannot apply (they need the whole data set)."""
        out = [
            f"dense {c.column!r}: {k}"
            for c in self.dense
            for k, v in (("name", c.name), ("of", c.of != "value"), ("fill", c.fill))
            if v
        ]
        out += [
            f"sparse {c.column!r}: {k}"
            for c in self.sparse
            for k, v in (("name", c.name), ("prefix", c.prefix), ("buckets", c.buckets))
            if v
        ]
        return out  # fmt: skip

    def used_columns(self) -> list[str]:
        cols = [] if self.label is None else [self.label.column]
        return cols + [c.column for c in self.dense] + [c.column for c in self.sparse]

    def named_columns(self) -> set[str]:
        return set(self.used_columns())

    def check_columns(self, have: list[str], where: str) -> None:
        """``ValueError`` naming every schema column missing from ``have``."""
        missing = [c for c in [*self.used_columns(), *self.drop] if c not in have]
        if not missing:
            return
        for sep, fmt in (("\t", "tsv"), (",", "csv"), (";", None), ("|", None)):
            split = [c.strip() for c in have[0].split(sep)] if len(have) == 1 else []
            if len(split) > 1 and not [c for c in missing if c not in split]:
                how = f'format = "{fmt}" in the schema' if fmt else "a file of commas or tabs"
                raise ValueError(
                    f"{where}: the header is one column, {have[0]!r}, which splits on "
                    f"{sep!r} into the schema's columns {split}: the file is separated "
                    f"by {sep!r}, not as its name says; give {how}"
                )
        raise ValueError(
            f"{where}: unknown column(s) {missing} in the schema; the columns are {have}"
        )


def _table(raw: Any, cls: type, where: str) -> Any:
    if not isinstance(raw, dict):
        raise ValueError(f"{where}: expected a table, got {raw!r}")
    known = list(cls.__dataclass_fields__)  # type: ignore[attr-defined]
    unknown = [k for k in raw if k not in known]
    if unknown:
        raise ValueError(f"{where}: unknown key(s) {unknown}; known keys: {known}")
    if "column" not in raw or not isinstance(raw["column"], str):
        raise ValueError(f'{where}: needs column = "NAME"')
    where = f"{where} (column {raw['column']!r})"
    hints = typing.get_type_hints(cls)
    for key, value in raw.items():
        expected = type_mismatch(value, hints[key])  # the config files' own type check
        if expected is not None:
            raise ValueError(f"{where}: {key} = {json.dumps(value)} must be {expected}")
    try:
        return cls(**raw)
    except (TypeError, ValueError) as e:
        raise ValueError(f"{where}: {e}") from None


def schema_from_dict(raw: dict[str, Any], where: str = "schema") -> Schema:
    """A schema from a parsed TOML/JSON table; ``ValueError`` naming a bad key."""
    known = ["label", "dense", "sparse", "drop", "format"]
    unknown = [k for k in raw if k not in known]
    if unknown:
        raise ValueError(f"{where}: unknown key(s) {unknown}; known keys: {known}")
    for key in ("dense", "sparse", "drop"):
        if not isinstance(raw.get(key, []), list):
            raise ValueError(f"{where}: {key!r} must be a list, got {raw[key]!r}")
    label = raw.get("label")
    return Schema(
        label=None if label is None else _table(label, LabelColumn, f"{where}: [label]"),
        dense=[
            _table(d, DenseColumn, f"{where}: dense #{i + 1}")
            for i, d in enumerate(raw.get("dense", []))
        ],
        sparse=[
            _table(s, SparseColumn, f"{where}: sparse #{i + 1}")
            for i, s in enumerate(raw.get("sparse", []))
        ],
        drop=[str(d) for d in raw.get("drop", [])],
        format=raw.get("format"),
    )


def load_schema(path: str | Path) -> Schema:
    """A schema from a ``.toml`` or ``.json`` file."""
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"schema file {p} does not exist")
    try:
        if p.suffix == ".toml":
            raw = tomllib.loads(p.read_text(encoding="utf-8"))
        elif p.suffix == ".json":
            raw = json.loads(p.read_text(encoding="utf-8"))
        else:
            raise ValueError(f"schema file {p}: expected a .toml or .json file")
    except (tomllib.TOMLDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"schema file {p}: not valid {p.suffix[1:].upper()}: {e}") from None
    if not isinstance(raw, dict):
        raise ValueError(f"schema file {p}: expected a table")
    return schema_from_dict(raw, f"schema file {p}")
