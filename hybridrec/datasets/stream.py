"""Streaming rows out of files, dealt to ranks, resumable at a saved position.

The Criteo and tabular readers share this loop: files are read one record at a
time (never whole), record ``i`` of a file goes to rank ``i mod n`` so every rank
sees a disjoint ``1/n`` of each file without coordination, and a
:class:`ReaderPosition` says how far a reader got, so that a restarted reader
continues after the last batch it yielded. A record that does not parse raises
``ValueError`` naming the file and line, or is counted and skipped.
"""

from __future__ import annotations

import gzip
import io
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import Generic, TypeVar

R = TypeVar("R")  # a raw record as a file gives it
T = TypeVar("T")  # a parsed record


@dataclass(slots=True)
class ReaderPosition:
    """How far a reader got: enough to resume exactly where it stopped."""

    file_index: int = 0
    line: int = 0  # records of that file consumed (all ranks' records, not just ours)
    skipped: int = 0  # malformed records skipped so far (by this rank)
    samples: int = 0  # samples yielded so far (by this rank)


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


# A file's records: ``(line number shown in errors, raw record)``.
OpenRecords = Callable[[str], AbstractContextManager[Iterator[tuple[int, R]]]]


class RecordStream(Generic[R, T]):
    """This rank's parsed records of ``paths``, from ``position`` on, in batches.

    ``open_records(path)`` gives a file's records with the line number an error
    should name; ``parse(record, where)`` turns one into a ``T`` or raises
    ``ValueError``; ``batches()`` yields lists of ``batch_size`` parsed records
    (and a final shorter list unless ``drop_last``), advancing :attr:`position`.
    """

    def __init__(
        self,
        paths: list[str],
        open_records: OpenRecords[R],
        parse: Callable[[R, str], T],
        *,
        batch_size: int,
        rank: int,
        world_size: int,
        skip_bad_lines: bool,
        drop_last: bool,
        what: str,
        start: ReaderPosition | None = None,
    ) -> None:
        self.paths, self.open_records, self.parse = paths, open_records, parse
        self.batch_size, self.rank, self.world_size = batch_size, rank, world_size
        self.skip_bad_lines, self.drop_last, self.what = skip_bad_lines, drop_last, what
        self.position = ReaderPosition() if start is None else start
        for p in paths:
            if not Path(p).is_file():
                raise FileNotFoundError(f"{what}: {p} does not exist or is not a file")

    def batches(self) -> Iterator[list[T]]:
        pos = self.position
        pending: list[T] = []
        while pos.file_index < len(self.paths):
            path = self.paths[pos.file_index]
            with self.open_records(path) as records:
                in_file = 0
                for index, (lineno, record) in enumerate(records):
                    in_file += 1
                    if index < pos.line:
                        continue  # resuming: already consumed
                    pos.line = index + 1
                    if index % self.world_size != self.rank:
                        continue
                    try:
                        parsed = self.parse(record, f"{path}:{lineno}")
                    except ValueError:
                        if not self.skip_bad_lines:
                            raise
                        pos.skipped += 1
                        continue
                    pending.append(parsed)
                    if len(pending) == self.batch_size:
                        pos.samples += len(pending)
                        yield pending
                        pending = []
                if in_file == 0:
                    raise ValueError(f"{self.what}: {path} is empty (expected data rows)")
            pos.file_index += 1
            pos.line = 0
        if pending and not self.drop_last:
            pos.samples += len(pending)
            yield pending
