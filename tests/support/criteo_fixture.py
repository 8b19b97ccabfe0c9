"""Criteo-format files for the readers' tests, written by hand: 40 tab-separated fields a
line (label, 13 integer and 26 categorical features), plain or gzip."""

from __future__ import annotations

import gzip
from pathlib import Path


def write_criteo_fixture(path: str | Path, rows: list[list[str]]) -> None:
    """Write ``rows`` (40 strings each) as a Criteo TSV file (gzip if ``path`` ends in .gz)."""
    text = "".join("\t".join(r) + "\n" for r in rows).encode()
    p = Path(path)
    if p.suffix == ".gz":
        with gzip.open(p, "wb") as f:
            f.write(text)
    else:
        p.write_bytes(text)
