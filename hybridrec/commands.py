"""The ``hybridrec`` console command: ``hybridrec train-dlrm ...``, ``hybridrec train-lm ...``.

Each subcommand takes exactly the options of its job (``hybridrec train-dlrm --help``).
"""

from __future__ import annotations

import sys
from collections.abc import Callable

from hybridrec.dlrm import job as dlrm_job
from hybridrec.lm import job as lm_job

COMMANDS: dict[str, tuple[Callable[[list[str] | None], None], str]] = {
    "train-dlrm": (dlrm_job.main, "train DLRM on MovieLens-100k, synthetic or Criteo data"),
    "train-lm": (lm_job.main, "train a GPT language model with a sparse token table"),
}


def usage() -> str:
    lines = ["usage: hybridrec COMMAND [options]", "", "commands:"]
    lines += [f"  {name:12s} {text}" for name, (_, text) in COMMANDS.items()]
    lines += ["", "hybridrec COMMAND --help lists the options of a command."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    args = sys.argv[1:] if argv is None else list(argv)
    if not args or args[0] in ("-h", "--help"):
        print(usage())
        return
    name, rest = args[0], args[1:]
    if name not in COMMANDS:
        print(f"hybridrec: unknown command {name!r}\n\n{usage()}", file=sys.stderr)
        raise SystemExit(2)
    COMMANDS[name][0](rest)
