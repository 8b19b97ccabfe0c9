"""The user code example of docs/usage.md runs as written and learns."""

from __future__ import annotations

from pathlib import Path

import pytest

from doc_blocks import code_after

DOC = Path(__file__).resolve().parents[2] / "docs" / "usage.md"
MARKER = "<!-- usage-example: tested by tests/project/test_docs_examples.py -->"


def example_code() -> str:
    return code_after(DOC, MARKER)


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
    readme = DOC.parent.parent / "README.md"
    assert code_after(readme, "<!-- readme-example:") == example_code()
