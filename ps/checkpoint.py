"""The checkpoint format every store writes and reads: a directory, a JSON manifest, ``.npy`` parts.

Layout of a checkpoint at ``path``::

    path/
      manifest.json                      written last; the checkpoint exists once it does
      t0000/                             one folder per table, numbered in manifest order
        <part>.ids.npy                   int64   [R]      row ids (any order, no repeats)
        <part>.weights.npy               float32 [R, D]   rows
        <part>.state.npy                 float32 [R, S]   optimizer state (S = state_dim)
        <part>.clocks.npy                int64   [R]      per-row update counts
        ...more parts...
      t0001/ ...

``manifest.json``::

    {"format": "hybridrec-ps/1",
     "writer": "InProcessStore",                         # informational
     "tables": [{"spec": {...TableSpec.to_json()...},
                 "rows": 1000,                           # sum of the parts' rows
                 "parts": [{"name": "s0000-00000", "rows": 1000,
                            "files": {"ids": "t0000/s0000-00000.ids.npy", "weights": ...,
                                      "state": ..., "clocks": ...}}]}]}

Parts carry their row ids, so a checkpoint is independent of how the writer was
sharded: a reader routes each row by id (:func:`ps.routing.shard_of`) to its own
shards. Arrays are written with ``np.save(..., allow_pickle=False)`` and read
with ``numpy.lib.format.read_array(..., allow_pickle=False)`` after checking the
``.npy`` magic, so a pickle or an object array in a checkpoint is refused, never
unpickled; files not named by the manifest are never opened, and manifest paths
must stay inside the checkpoint directory.

Atomicity (:mod:`ps.atomic_save`): everything is written into a sibling
``<path>.tmp-<random>``; every file and folder is fsynced, the manifest is written
last, then the folder is renamed into place (the previous checkpoint is first renamed
to ``<path>.prev`` and deleted after the swap; if a crash lands between those two
renames, :func:`read_checkpoint` finds the previous checkpoint at ``<path>.prev``). A
crash at any point leaves a loadable checkpoint, the previous or the new one. Two
saves to one path at the same time are not supported.

Writing, for one process::

    write_checkpoint(path, [(spec, [TablePart(ids=..., weights=..., state=..., clocks=...)])])

or in steps, for several writers sharing a filesystem (e.g. each MPI server
writes its own parts into the folder the coordinator created)::

    tmp = begin_checkpoint(path)                                 # coordinator
    entry = write_part(tmp, table_index=0, name="s0001-00000", part=part)   # any process
    finish_checkpoint(tmp, path, [(spec, [entry, ...])])         # coordinator, after all

Reading::

    ckpt = read_checkpoint(path)
    for spec in ckpt.specs:
        for part in ckpt.parts(spec.name): ...        # validated TableParts, one at a time
"""

from __future__ import annotations

import json
import os
import re
import warnings
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

import ps.atomic_save as atomic_save
from ps.table import TableSpec

FORMAT = "hybridrec-ps/1"
MANIFEST = "manifest.json"
ARRAYS: tuple[str, ...] = ("ids", "weights", "state", "clocks")
_DTYPES = {"ids": np.int64, "weights": np.float32, "state": np.float32, "clocks": np.int64}
_PART_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
_REL_PATH = re.compile(r"^t[0-9]{4,}/[A-Za-z0-9_-]{1,64}\.(ids|weights|state|clocks)\.npy$")

PathLike = str | os.PathLike[str]


@dataclass(slots=True, frozen=True)
class TablePart:
    """Some rows of one table: ``ids`` int64 ``[R]``, ``weights`` float32 ``[R, D]``,
    ``state`` float32 ``[R, S]``, ``clocks`` int64 ``[R]`` (CPU tensors)."""

    ids: torch.Tensor
    weights: torch.Tensor
    state: torch.Tensor
    clocks: torch.Tensor

    def __post_init__(self) -> None:
        want = {
            "ids": (torch.int64, 1),
            "weights": (torch.float32, 2),
            "state": (torch.float32, 2),
            "clocks": (torch.int64, 1),
        }
        for name, (dtype, ndim) in want.items():
            t = getattr(self, name)
            if not isinstance(t, torch.Tensor) or t.dtype != dtype or t.dim() != ndim:
                got = f"{t.dtype} {tuple(t.shape)}" if isinstance(t, torch.Tensor) else type(t)
                raise ValueError(f"TablePart.{name} must be a {ndim}-D {dtype} tensor, got {got}")
        r = self.ids.shape[0]
        for name in ("weights", "state", "clocks"):
            if getattr(self, name).shape[0] != r:
                raise ValueError(
                    f"TablePart: {name} has {getattr(self, name).shape[0]} rows, ids has {r}"
                )

    @property
    def num_rows(self) -> int:
        return int(self.ids.shape[0])

    def check_spec(self, spec: TableSpec, where: str = "") -> None:
        """ValueError unless the widths fit ``spec`` and the ids are valid (range, no repeats)."""
        at = f" ({where})" if where else ""
        if self.weights.shape[1] != spec.dim or self.state.shape[1] != spec.state_dim:
            raise ValueError(
                f"table {spec.name!r}{at}: part has weights {tuple(self.weights.shape)} and "
                f"state {tuple(self.state.shape)}, expected widths dim={spec.dim} and "
                f"state_dim={spec.state_dim}"
            )
        check_row_ids(spec, self.ids, where)

    def select(self, index: torch.Tensor) -> TablePart:
        """The rows at ``index`` (int64 positions or bool mask ``[R]``), e.g. one shard's."""
        return TablePart(
            ids=self.ids[index],
            weights=self.weights[index],
            state=self.state[index],
            clocks=self.clocks[index],
        )

    @staticmethod
    def concat(parts: Sequence[TablePart], dim: int, state_dim: int) -> TablePart:
        """All rows of ``parts`` in one part (an empty part of the given widths if none)."""
        if not parts:
            return TablePart(
                ids=torch.empty(0, dtype=torch.int64),
                weights=torch.empty(0, dim, dtype=torch.float32),
                state=torch.empty(0, state_dim, dtype=torch.float32),
                clocks=torch.empty(0, dtype=torch.int64),
            )
        if len(parts) == 1:
            return parts[0]
        return TablePart(
            ids=torch.cat([p.ids for p in parts]),
            weights=torch.cat([p.weights for p in parts]),
            state=torch.cat([p.state for p in parts]),
            clocks=torch.cat([p.clocks for p in parts]),
        )


def check_row_ids(spec: TableSpec, ids: torch.Tensor, where: str = "") -> None:
    """ValueError if ``ids`` repeat or (fixed table) fall outside ``[0, num_rows)``."""
    at = f" ({where})" if where else ""
    if ids.numel() == 0:
        return
    if spec.num_rows is not None:
        bad = (ids < 0) | (ids >= spec.num_rows)
        if bool(bad.any()):
            pos = int(torch.nonzero(bad)[0, 0])
            raise ValueError(
                f"table {spec.name!r}{at}: checkpoint row id {int(ids[pos])} is out of range "
                f"[0, {spec.num_rows})"
            )
    uniq = torch.unique(ids)
    if uniq.numel() != ids.numel():
        srt = torch.sort(ids).values
        dup = int(srt[1:][srt[1:] == srt[:-1]][0])
        raise ValueError(f"table {spec.name!r}{at}: checkpoint row id {dup} appears more than once")


# ---------------------------------------------------------------- writing


def _save_array(file: Path, array: np.ndarray) -> None:
    """Write one ``.npy`` (no pickle) and fsync it."""
    with open(file, "xb") as f:
        np.save(f, np.ascontiguousarray(array), allow_pickle=False)
        f.flush()
        os.fsync(f.fileno())


def begin_checkpoint(path: PathLike) -> Path:
    """Create and return the private folder ``<path>.tmp-<random>`` to write a checkpoint into.

    ``path``'s parent must exist. ``path`` itself must be absent, an empty
    folder, or a checkpoint (it is replaced only by :func:`finish_checkpoint`).
    """
    final = Path(path)
    _check_parent(final)
    return atomic_save.begin(final, _check_replaceable)


def write_part(tmp_dir: PathLike, table_index: int, name: str, part: TablePart) -> dict[str, Any]:
    """Write ``part`` as the four ``.npy`` files of table ``table_index``; return its entry.

    ``name`` (letters, digits, ``_``, ``-``) must be unique within the table,
    e.g. ``f"s{shard:04d}-{k:05d}"``. Any process that sees ``tmp_dir`` may call
    this; the entry goes to :func:`finish_checkpoint`.
    """
    if not isinstance(name, str) or not _PART_NAME.match(name):
        raise ValueError(f"write_part: part name must match {_PART_NAME.pattern}, got {name!r}")
    if not isinstance(table_index, int) or table_index < 0:
        raise ValueError(f"write_part: table_index must be an int >= 0, got {table_index!r}")
    folder = Path(tmp_dir) / f"t{table_index:04d}"
    folder.mkdir(exist_ok=True)
    files: dict[str, str] = {}
    for key in ARRAYS:
        rel = f"t{table_index:04d}/{name}.{key}.npy"
        _save_array(Path(tmp_dir) / rel, getattr(part, key).detach().cpu().contiguous().numpy())
        files[key] = rel
    atomic_save.fsync_dir(folder)
    return {"name": name, "rows": part.num_rows, "files": files}


def finish_checkpoint(
    tmp_dir: PathLike,
    path: PathLike,
    tables: Sequence[tuple[TableSpec, Sequence[dict[str, Any]]]],
    *,
    writer: str = "",
) -> None:
    """Write the manifest into ``tmp_dir`` and atomically make it the checkpoint at ``path``.

    ``tables`` lists each table's spec with the entries :func:`write_part`
    returned for it; table ``i`` must be the one written with ``table_index=i``.
    """
    _write_manifest(Path(tmp_dir), tables, writer)
    atomic_save.swap_in(Path(tmp_dir), Path(path), _check_replaceable)


def _write_manifest(
    tmp: Path, tables: Sequence[tuple[TableSpec, Sequence[dict[str, Any]]]], writer: str
) -> None:
    """The manifest of the parts in ``tmp`` (see :func:`finish_checkpoint`), fsynced."""
    entries = []
    names: set[str] = set()
    for i, (spec, parts) in enumerate(tables):
        if spec.name in names:
            raise ValueError(f"finish_checkpoint: table {spec.name!r} listed twice")
        names.add(spec.name)
        for p in parts:
            for rel in p["files"].values():
                if not rel.startswith(f"t{i:04d}/"):
                    raise ValueError(
                        f"finish_checkpoint: table {spec.name!r} is number {i} but part "
                        f"file {rel!r} belongs to another table folder"
                    )
        entries.append(
            {
                "spec": spec.to_json(),
                "rows": sum(int(p["rows"]) for p in parts),
                "parts": list(parts),
            }
        )
    manifest = {"format": FORMAT, "writer": writer, "tables": entries}
    with open(tmp / MANIFEST, "x", encoding="utf-8") as f:
        json.dump(manifest, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    atomic_save.fsync_dir(tmp)


def abort_checkpoint(tmp_dir: PathLike) -> None:
    """Remove an unfinished ``tmp_dir`` (best effort); the checkpoint at ``path`` is untouched."""
    atomic_save.abort(Path(tmp_dir))


def write_checkpoint(
    path: PathLike,
    tables: Iterable[tuple[TableSpec, Iterable[TablePart]]],
    *,
    writer: str = "",
) -> None:
    """Write a whole checkpoint from one process; atomic (see the module docstring).

    ``tables`` yields ``(spec, parts)``; parts are written as they come, so a
    store can stream a big table in slices. Each part is checked against its
    spec. On any error the temporary folder is removed and ``path`` keeps the
    previous checkpoint.
    """
    final = Path(path)
    _check_parent(final)
    with atomic_save.saving(final, _check_replaceable) as tmp:
        listed: list[tuple[TableSpec, list[dict[str, Any]]]] = []
        for i, (spec, parts) in enumerate(tables):
            entries = []
            for k, part in enumerate(parts):
                part.check_spec(spec, f"part {k}")
                entries.append(write_part(tmp, i, f"p{k:05d}", part))
            listed.append((spec, entries))
        _write_manifest(tmp, listed, writer)


def _check_parent(final: Path) -> None:
    if not final.parent.is_dir():
        raise FileNotFoundError(f"checkpoint {str(final)!r}: parent folder does not exist")


def _is_checkpoint(folder: Path) -> bool:
    try:
        with open(folder / MANIFEST, encoding="utf-8") as f:
            return bool(json.load(f).get("format") == FORMAT)
    except (OSError, ValueError, AttributeError):
        return False


def _check_replaceable(final: Path) -> None:
    if final.is_symlink() or (final.exists() and not final.is_dir()):
        raise ValueError(f"checkpoint {str(final)!r} exists and is not a folder; not replacing it")
    if final.is_dir() and any(final.iterdir()) and not _is_checkpoint(final):
        raise ValueError(
            f"checkpoint {str(final)!r} is a non-empty folder without a {FORMAT} "
            f"{MANIFEST}; refusing to replace it"
        )


# ---------------------------------------------------------------- reading


def _read_array(file: Path, key: str, where: str) -> np.ndarray:
    """One ``.npy`` of the expected dtype, never unpickling (object arrays are refused)."""
    try:
        with open(file, "rb") as f:
            version = np.lib.format.read_magic(f)  # ValueError if not .npy (e.g. a pickle)
            f.seek(0)
            array = np.lib.format.read_array(f, allow_pickle=False)
    except ValueError as err:
        raise ValueError(f"checkpoint {where}: {file} is not a plain .npy array: {err}") from None
    del version
    want = _DTYPES[key]
    if array.dtype != want:
        raise ValueError(f"checkpoint {where}: {file} holds {array.dtype}, expected {want}")
    return array


class Checkpoint:
    """A checkpoint read by :func:`read_checkpoint`: the specs up front, parts on demand."""

    def __init__(self, path: Path, manifest: dict[str, Any]) -> None:
        self.path = path
        self.manifest = manifest
        self.specs: list[TableSpec] = [TableSpec.from_json(t["spec"]) for t in manifest["tables"]]
        self._by_name = {s.name: i for i, s in enumerate(self.specs)}
        if len(self._by_name) != len(self.specs):
            raise ValueError(f"checkpoint {str(path)!r}: a table name appears twice")

    def __repr__(self) -> str:
        return f"Checkpoint({str(self.path)!r}, tables={self.tables()})"

    def tables(self) -> list[str]:
        return [s.name for s in self.specs]

    def spec(self, table: str) -> TableSpec:
        return self.specs[self._index(table)]

    def expect(self, spec: TableSpec) -> None:
        """Raise ValueError unless the checkpoint holds ``spec``'s table with the same
        rows, dim and optimizer (what a caller loading it in place needs)."""
        if spec.name not in self._by_name:
            raise ValueError(
                f"load {str(self.path)!r}: no table {spec.name!r} in the checkpoint; it has "
                f"{sorted(self.tables())}"
            )
        have = self.spec(spec.name)
        if (have.num_rows, have.dim, have.optimizer) != (spec.num_rows, spec.dim, spec.optimizer):
            raise ValueError(
                f"load {str(self.path)!r}: table {spec.name!r} was saved with num_rows="
                f"{have.num_rows}, dim={have.dim}, optimizer={have.optimizer}; this "
                f"collection has num_rows={spec.num_rows}, dim={spec.dim}, "
                f"optimizer={spec.optimizer}"
            )

    def num_rows(self, table: str) -> int:
        """Rows stored for ``table`` (all parts)."""
        return int(self.manifest["tables"][self._index(table)]["rows"])

    def _index(self, table: str) -> int:
        try:
            return self._by_name[table]
        except KeyError:
            raise ValueError(
                f"checkpoint {str(self.path)!r} has no table {table!r}; it has {self.tables()}"
            ) from None

    def parts(self, table: str) -> Iterator[TablePart]:
        """The parts of ``table``, read and checked (dtypes, shapes, widths, ids) one by one."""
        i = self._index(table)
        spec = self.specs[i]
        for k, entry in enumerate(self.manifest["tables"][i]["parts"]):
            where = f"{str(self.path)!r} table {table!r} part {k}"
            arrays = {
                key: _read_array(self.path / entry["files"][key], key, where) for key in ARRAYS
            }
            try:
                part = TablePart(**{key: torch.from_numpy(a) for key, a in arrays.items()})
            except ValueError as err:
                raise ValueError(f"checkpoint {where}: {err}") from None
            if part.num_rows != int(entry["rows"]):
                raise ValueError(
                    f"checkpoint {where}: manifest says {entry['rows']} rows, files hold "
                    f"{part.num_rows}"
                )
            part.check_spec(spec, f"checkpoint {where}")
            yield part

    def read_table(self, table: str) -> TablePart:
        """All rows of ``table`` in one part; also checks that no id repeats across parts."""
        spec = self.spec(table)
        part = TablePart.concat(list(self.parts(table)), spec.dim, spec.state_dim)
        check_row_ids(spec, part.ids, f"checkpoint {str(self.path)!r}")
        return part


def _check_manifest(path: Path, manifest: object) -> dict[str, Any]:
    where = f"checkpoint {str(path)!r}"
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        got = manifest.get("format") if isinstance(manifest, dict) else type(manifest).__name__
        raise ValueError(f"{where}: {MANIFEST} format is {got!r}, expected {FORMAT!r}")
    tables = manifest.get("tables")
    if not isinstance(tables, list):
        raise ValueError(f"{where}: {MANIFEST} 'tables' must be a list")
    for i, t in enumerate(tables):
        if not isinstance(t, dict) or not isinstance(t.get("parts"), list):
            raise ValueError(f"{where}: table entry {i} must have a 'parts' list")
        if not isinstance(t.get("rows"), int) or t["rows"] < 0:
            raise ValueError(f"{where}: table entry {i} has a bad row count {t.get('rows')!r}")
        for k, p in enumerate(t["parts"]):
            files = p.get("files") if isinstance(p, dict) else None
            if not isinstance(files, dict) or sorted(files) != sorted(ARRAYS):
                raise ValueError(f"{where}: table {i} part {k} must list files {list(ARRAYS)}")
            if not isinstance(p.get("rows"), int) or p["rows"] < 0:
                raise ValueError(f"{where}: table {i} part {k} has a bad row count")
            for key, rel in files.items():
                ok = isinstance(rel, str) and _REL_PATH.match(rel) is not None
                if not ok or not rel.endswith(f".{key}.npy") or not rel.startswith(f"t{i:04d}/"):
                    raise ValueError(
                        f"{where}: table {i} part {k} file {rel!r} is not a plain "
                        f"'t{i:04d}/<name>.{key}.npy' path inside the checkpoint"
                    )
        if sum(int(p["rows"]) for p in t["parts"]) != t["rows"]:
            raise ValueError(f"{where}: table entry {i} rows do not add up over its parts")
    return manifest


def read_checkpoint(path: PathLike) -> Checkpoint:
    """Open the checkpoint at ``path``: read and check its manifest (parts are read later).

    If ``path`` is missing but ``<path>.prev`` holds a checkpoint (a crash
    between the two renames of a save), that one is read, with a warning.
    """
    folder = Path(path)
    prev = atomic_save.previous(folder)
    if not (folder / MANIFEST).is_file() and (prev / MANIFEST).is_file():
        warnings.warn(
            f"checkpoint {str(folder)!r} is missing; reading the previous one at "
            f"{str(prev)!r} (a save was interrupted)",
            stacklevel=2,
        )
        folder = prev
    try:
        with open(folder / MANIFEST, encoding="utf-8") as f:
            manifest = json.load(f)
    except FileNotFoundError:
        raise FileNotFoundError(
            f"checkpoint {str(path)!r}: no {MANIFEST} (not a checkpoint, or a save never finished)"
        ) from None
    except ValueError as err:
        raise ValueError(f"checkpoint {str(path)!r}: {MANIFEST} is not valid JSON: {err}") from None
    return Checkpoint(folder, _check_manifest(folder, manifest))
