"""The export folder: its files, its manifest and their checks.

An export is a folder of ``.npy`` arrays and JSON files and one ``manifest.json`` that
names every file with its size and sha256. Arrays are written with
``np.save(allow_pickle=False)`` and read with ``np.load(allow_pickle=False)``, so nothing
a predictor opens can run code; only files the manifest names, by plain relative names
inside the folder, are opened.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

FORMAT = "hybridrec-serving/1"
MANIFEST = "manifest.json"
# Relative names a manifest may hold: folders and files of letters, digits, . _ -, none
# starting with a dot (so no '..' and no hidden files)
_NAME = re.compile(r"^[A-Za-z0-9_\-][A-Za-z0-9_.\-]*(/[A-Za-z0-9_\-][A-Za-z0-9_.\-]*)*$")


class ChecksumError(ValueError):
    """A file of an export is not the one its manifest describes (size or sha256)."""


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def checked_name(name: str) -> str:
    """``name`` if it is a plain relative name inside the folder (no ``..``, no absolute
    path); ValueError otherwise."""
    if not isinstance(name, str) or not _NAME.match(name):
        raise ValueError(f"export manifest: bad file name {name!r}")
    return name


@dataclass
class ExportWriter:
    """Writes an export's files into ``folder`` and records each one's size and sha256."""

    folder: Path
    files: dict[str, dict[str, Any]] = field(default_factory=dict)

    def _record(self, name: str) -> str:
        path = self.folder / name
        self.files[name] = {"bytes": path.stat().st_size, "sha256": sha256(path)}
        return name

    def array(self, name: str, value: np.ndarray) -> str:
        """``value`` as ``name`` (a ``.npy``, C order, no pickle)."""
        path = self.folder / checked_name(name)
        path.parent.mkdir(parents=True, exist_ok=True)
        np.save(path, np.ascontiguousarray(value), allow_pickle=False)
        return self._record(name)

    def json(self, name: str, value: Any) -> str:
        path = self.folder / checked_name(name)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(value, indent=1) + "\n", encoding="utf-8")
        return self._record(name)

    def extra(self, name: str) -> Path:
        """Where a file written by other code goes; :meth:`seal` records it after."""
        path = self.folder / checked_name(name)
        path.parent.mkdir(parents=True, exist_ok=True)
        return path

    def seal(self, name: str) -> str:
        return self._record(checked_name(name))

    def manifest(self, doc: dict[str, Any]) -> None:
        """``manifest.json``: ``doc`` with the format and every recorded file."""
        body = {"format": FORMAT, **doc, "files": dict(sorted(self.files.items()))}
        (self.folder / MANIFEST).write_text(json.dumps(body, indent=1) + "\n", encoding="utf-8")


@dataclass
class ExportReader:
    """An export's manifest and its files, each checked against the manifest once."""

    folder: Path
    manifest: dict[str, Any]
    verify: bool = True

    @classmethod
    def open(cls, folder: str | Path, verify: bool = True) -> ExportReader:
        root = Path(folder)
        path = root / MANIFEST
        if not path.is_file():
            raise FileNotFoundError(
                f"{root}: not a model export (no {MANIFEST}); write one with hybridrec export"
            )
        manifest = json.loads(path.read_text(encoding="utf-8"))
        if manifest.get("format") != FORMAT:
            raise ValueError(
                f"{path}: format {manifest.get('format')!r}, this hybridrec reads {FORMAT!r}"
            )
        reader = cls(root, manifest, verify)
        for name in manifest.get("files", {}):
            reader.check(name)
        return reader

    def check(self, name: str) -> Path:
        """The path of manifest file ``name``, its size (and with ``verify``, its sha256)
        compared to the manifest's; ChecksumError naming the file otherwise."""
        files = self.manifest.get("files", {})
        if name not in files:
            raise ValueError(f"{self.folder}: {name!r} is not a file of this export's manifest")
        path = self.folder / checked_name(name)
        want = files[name]
        if not path.is_file():
            raise FileNotFoundError(f"{self.folder}: {name} (named in {MANIFEST}) is missing")
        size = path.stat().st_size
        if size != want["bytes"]:
            raise ChecksumError(
                f"{path}: {size} bytes, the manifest says {want['bytes']}: the file was "
                "changed or truncated after export"
            )
        if self.verify:
            got = sha256(path)
            if got != want["sha256"]:
                raise ChecksumError(
                    f"{path}: sha256 {got[:16]}..., the manifest says {want['sha256'][:16]}...: "
                    "the file was changed after export"
                )
        return path

    def array(self, name: str, mmap: bool = False) -> np.ndarray:
        """A manifest ``.npy`` (memory-mapped read-only with ``mmap``; never unpickled)."""
        path = self.folder / checked_name(name)
        if name not in self.manifest.get("files", {}):
            raise ValueError(f"{self.folder}: {name!r} is not a file of this export's manifest")
        return np.load(path, mmap_mode="r" if mmap else None, allow_pickle=False)

    def json(self, name: str) -> Any:
        if name not in self.manifest.get("files", {}):
            raise ValueError(f"{self.folder}: {name!r} is not a file of this export's manifest")
        return json.loads((self.folder / checked_name(name)).read_text(encoding="utf-8"))
