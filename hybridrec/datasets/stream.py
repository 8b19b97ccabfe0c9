"""The records of streamed files, dealt to ranks, in batches, resumable at a saved position.

The Criteo and tabular readers read their files through this: a file is read one record
at a time (never whole), record ``i`` of a file goes to rank ``i mod n`` so every rank
sees a disjoint ``1/n`` of each file without coordination, and a :class:`ReaderPosition`
says how far a reader got, so that a restarted reader continues after the last batch it
yielded. Three layouts of records:

* ``"lines"``: each line of a text file (plain or ``.gz``) is a record, numbered from 1;
* ``"header"``: the same after a first line naming the columns (data from line 2);
* ``"parquet"``: each row of a Parquet file (needs pyarrow), numbered from 1.

The reader parses each record it is given (:meth:`RecordStream.records`) and hands the
parsed ones back (:meth:`RecordStream.add`, :meth:`RecordStream.rest`) to be batched; a
record that does not parse is the reader's to raise for (naming the file and line) or
to count as skipped in :attr:`RecordStream.position`.
"""

from __future__ import annotations

import gzip
import io
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Generic, NamedTuple, TypeVar

T = TypeVar("T")  # a parsed record

PARQUET_HINT = "pip install 'hybridrec[parquet]' (or pip install pyarrow)"
LAYOUTS = ("lines", "header", "parquet")


@dataclass(slots=True)
class ReaderPosition:
    """How far a reader got: enough to resume exactly where it stopped."""

    file_index: int = 0
    line: int = 0  # records of that file consumed (all ranks' records, not just ours)
    skipped: int = 0  # malformed records skipped so far (by this rank)
    samples: int = 0  # samples yielded so far (by this rank)


class Record(NamedTuple):
    """One record of this rank: where it is, its file's header, and the record itself."""

    path: str
    where: str  # "path:line", for error messages
    header: Any  # "header": the first line's text; "parquet": the column names; else None
    raw: Any  # "lines"/"header": the line's bytes (decode_line); "parquet": the row's values
    line: int = 0  # its line (row) number in the file, as ``where`` says it
    file_index: int = 0  # which of the stream's files


def open_lines(path: str, what: str) -> io.BufferedIOBase:
    """The file as bytes, gunzipped if it ends in .gz (lines are decoded one by one,
    so a bad byte names its line)."""
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"{what}: {path} does not exist or is not a file")
    if path.endswith(".gz"):
        return gzip.open(p, "rb")  # type: ignore[return-value]
    return open(p, "rb")  # noqa: SIM115 - closed by the caller


def decode_line(raw: bytes, where: str) -> str:
    """UTF-8 text of one line without its line ending (``\\n`` or ``\\r\\n``)."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(
            f"{where}: not UTF-8 text (byte {raw[e.start]:#04x} at column {e.start + 1})"
        ) from None
    return text.rstrip("\r\n")


def _import_parquet() -> Any:
    try:
        import pyarrow.parquet as pq  # type: ignore[import-not-found,import-untyped,unused-ignore]
    except ImportError:
        raise ImportError(
            f"reading Parquet files needs pyarrow, which is not installed; {PARQUET_HINT}"
        ) from None
    return pq


@contextmanager
def _open(path: str, layout: str, what: str) -> Iterator[tuple[Any, Iterator[tuple[int, Any]]]]:
    """``(header, records)`` of one file: records are ``(line number, raw record)``."""
    if layout == "parquet":
        pq = _import_parquet()
        if not Path(path).is_file():
            raise FileNotFoundError(f"{what}: {path} does not exist or is not a file")
        pf = pq.ParquetFile(path)

        def rows() -> Iterator[tuple[int, Any]]:
            n = 0
            for part in pf.iter_batches(batch_size=4096):
                columns = [part.column(i).to_pylist() for i in range(part.num_columns)]
                for values in zip(*columns, strict=True):
                    n += 1
                    yield n, list(values)

        yield list(pf.schema_arrow.names), rows()
        return
    with open_lines(path, what) as f:
        if layout == "lines":
            yield None, ((i + 1, raw) for i, raw in enumerate(f))
            return
        first = f.readline()
        if not first:
            raise ValueError(f"{what}: {path} is empty (expected a header line)")
        yield decode_line(first, f"{path}:1"), ((i + 2, raw) for i, raw in enumerate(f))


class RecordStream(Generic[T]):
    """This rank's records of ``paths`` from ``start`` on, and their batches.

    :meth:`records` yields this rank's :class:`Record` s, advancing :attr:`position`;
    :meth:`add` takes a parsed one and gives a full batch of ``batch_size`` once there is
    one, :meth:`rest` the final shorter batch (None with ``drop_last``).
    """

    def __init__(
        self,
        paths: list[str],
        layout: str | list[str],  # one for every file, or each file's
        *,
        batch_size: int,
        rank: int,
        world_size: int,
        drop_last: bool,
        what: str,
        start: ReaderPosition | None = None,
    ) -> None:
        self.layouts = [layout] * len(paths) if isinstance(layout, str) else list(layout)
        for lay in self.layouts:
            if lay not in LAYOUTS:
                raise ValueError(f"record layout must be one of {LAYOUTS}, got {lay!r}")
        self.paths, self.what = paths, what
        self.batch_size, self.rank, self.world_size = batch_size, rank, world_size
        self.drop_last = drop_last
        self.position = ReaderPosition() if start is None else start
        self._pending: list[T] = []
        for p in paths:
            if not Path(p).is_file():
                raise FileNotFoundError(f"{what}: {p} does not exist or is not a file")

    def records(self) -> Iterator[Record]:
        pos = self.position
        while pos.file_index < len(self.paths):
            path = self.paths[pos.file_index]
            with _open(path, self.layouts[pos.file_index], self.what) as (header, records):
                in_file = 0
                for index, (lineno, raw) in enumerate(records):
                    in_file += 1
                    if index < pos.line:
                        continue  # resuming: already consumed
                    pos.line = index + 1
                    if index % self.world_size != self.rank:
                        continue
                    yield Record(path, f"{path}:{lineno}", header, raw, lineno, pos.file_index)
                if in_file == 0:
                    raise ValueError(f"{self.what}: {path} is empty (expected data rows)")
            pos.file_index += 1
            pos.line = 0

    def add(self, parsed: T) -> list[T] | None:
        """Keep ``parsed``; the batch it completes, if it completes one."""
        self._pending.append(parsed)
        if len(self._pending) < self.batch_size:
            return None
        batch, self._pending = self._pending, []
        self.position.samples += len(batch)
        return batch

    def rest(self) -> list[T] | None:
        """After the last record: the final shorter batch, unless none or ``drop_last``."""
        batch, self._pending = self._pending, []
        if not batch or self.drop_last:
            return None
        self.position.samples += len(batch)
        return batch
