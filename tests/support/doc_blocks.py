"""The Python code block that follows a marker in a Markdown file (docs examples that
tests run, and the README copies that must equal them)."""

from __future__ import annotations

import re
from pathlib import Path


def code_after(path: Path, marker: str) -> str:
    """The first ```python block after ``marker`` in ``path``; AssertionError naming the
    file if the marker or the block is gone."""
    text = path.read_text(encoding="utf-8")
    assert marker in text, f"{path} lost its example marker {marker!r}"
    match = re.search(r"```python\n(.*?)```", text[text.index(marker) :], re.S)
    assert match is not None, f"{path}: no python code block after {marker!r}"
    return match.group(1)
