"""The user code example of docs/usage.md runs as written and learns."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

DOC = Path(__file__).resolve().parent.parent / "docs" / "usage.md"
MARKER = "<!-- usage-example: tested by tests/test_docs_examples.py -->"


def example_code() -> str:
    text = DOC.read_text(encoding="utf-8")
    assert MARKER in text, f"{DOC} lost its example marker"
    match = re.search(r"```python\n(.*?)```", text[text.index(MARKER) :], re.S)
    assert match is not None, "no python code block after the marker"
    return match.group(1)


def test_example_is_short() -> None:
    lines = [ln for ln in example_code().splitlines() if ln.strip()]
    assert len(lines) <= 32, len(lines)  # about 25 lines of code plus imports


@pytest.mark.timeout(120)
def test_example_runs_and_learns() -> None:
    namespace: dict[str, object] = {"__name__": "docs_example"}
    exec(compile(example_code(), str(DOC), "exec"), namespace)  # noqa: S102 - our own doc
    losses = namespace["losses"]
    assert isinstance(losses, list) and len(losses) == 60
    first, last = sum(losses[:10]) / 10, sum(losses[-10:]) / 10
    assert last < first - 0.1, (first, last)  # the item table learns the item property


def test_readme_shows_the_same_example() -> None:
    readme = (DOC.parent.parent / "README.md").read_text(encoding="utf-8")
    marker = "<!-- readme-example:"
    assert marker in readme, "README.md lost its example marker"
    match = re.search(r"```python\n(.*?)```", readme[readme.index(marker) :], re.S)
    assert match is not None and match.group(1) == example_code()
