"""``docs/options.md`` is the reference of every job's and the planner's options, generated
from the option dataclasses (:func:`hybridrec.cli.options.options_markdown`), so it cannot drift
from ``--help``: this test fails when it is not current.
``python tests/project/test_options_doc.py`` writes it anew."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from hybridrec.cli.options import options_markdown
from hybridrec.dlrm.config import DLRMJobConfig
from hybridrec.lm.config import LMConfig
from hybridrec.plan.options import PlanOptions
from hybridrec.seq.config import SeqConfig

DOC = Path(__file__).resolve().parents[2] / "docs" / "options.md"
INTRO = """# Every option

Generated from the option dataclasses by `python tests/project/test_options_doc.py` (a test checks
that this file is current). Each option is also a key of a `--config` TOML or JSON file,
spelt without the leading `--` (`batch-size = 512`); the values column says what a file
value must be. How the options fit together: [usage.md](usage.md).
"""


def generated() -> str:
    parts = [
        INTRO,
        options_markdown(DLRMJobConfig, "`hybridrec train-dlrm` (`examples/train_dlrm.py`)"),
        options_markdown(LMConfig, "`hybridrec train-lm` (`examples/train_lm.py`)"),
        options_markdown(SeqConfig, "`hybridrec train-seq` (`examples/train_seq.py`)"),
        options_markdown(PlanOptions, "`python -m hybridrec.plan` (the capacity planner)"),
    ]
    return "\n".join(parts).rstrip("\n") + "\n"


@pytest.mark.timeout(30)
def test_the_options_reference_is_current() -> None:
    assert DOC.is_file(), f"{DOC} is missing: run python tests/project/test_options_doc.py"
    assert DOC.read_text(encoding="utf-8") == generated(), (
        f"{DOC} is not what the option dataclasses say: "
        "run python tests/project/test_options_doc.py"
    )


@pytest.mark.timeout(30)
def test_every_flag_of_the_parsers_is_in_the_reference() -> None:
    """The reference lists exactly the flags ``--help`` shows (an independent view: the
    argparse parser the jobs build)."""
    from hybridrec.cli.options import build_parser

    text = DOC.read_text(encoding="utf-8")
    for cls in (DLRMJobConfig, LMConfig, SeqConfig, PlanOptions):
        parser = build_parser(cls, "")
        for action in parser._actions:  # noqa: SLF001 - argparse keeps its options here
            for opt in action.option_strings:
                if opt.startswith("--") and opt not in ("--help", "--config"):
                    if action.help and action.help.startswith("old name of"):
                        continue
                    assert f"`{opt}`" in text, f"{cls.__name__}: {opt} is not in {DOC.name}"


if __name__ == "__main__":
    sys.path.insert(0, str(DOC.parent.parent))
    DOC.write_text(generated(), encoding="utf-8")
    print(f"wrote {DOC}")
