"""The ``hybridrec`` console command: ``hybridrec train-dlrm ...``, ``hybridrec train-lm ...``.

Each subcommand takes exactly the options of its job, the same as the example
scripts (``hybridrec train-dlrm --help``). ``hybridrec --version`` prints the
installed version. A user error (a bad option, a missing file, an unreachable
store) prints one line and exits with status 2; ``--debug`` anywhere on the command
line, or ``HYBRIDREC_DEBUG=1``, shows the traceback instead (:mod:`hybridrec.cli.errors`).
"""

from __future__ import annotations

import difflib
import importlib
import sys
from collections.abc import Sequence
from importlib import metadata

from hybridrec.cli.errors import reported_errors, show_tracebacks
from hybridrec.cli.options import DEBUG_FLAG, ConfigError, program_name

PROG = "hybridrec"

# name -> (module whose main(argv) runs it, one line of help). Modules are imported
# only when their command runs, so --help and --version do not load torch.
COMMANDS: dict[str, tuple[str, str]] = {
    "train-dlrm": (
        "hybridrec.dlrm.job",
        "train DLRM on MovieLens-100k, synthetic, Criteo, your CSV/TSV/Parquet files "
        "(tabular) or a RecBole data set",
    ),
    "train-lm": (
        "hybridrec.lm.job",
        "train a GPT language model with a sparse token table (Shakespeare, or your text files)",
    ),
    "train-seq": (
        "hybridrec.seq.job",
        "train a next-item recommender (SASRec or HSTU) on user histories: MovieLens-100k, a "
        "RecBole data set, your files or synthetic",
    ),
    "evaluate": (
        "hybridrec.cli.evaluate",
        "evaluate a saved run (DLRM or GPT) on its own or new data: test AUC, log loss, NE, "
        "calibration, per slice",
    ),
    "predict": (
        "hybridrec.cli.predict",
        "score every row of tabular files with a saved DLRM run (csv, jsonl or parquet out)",
    ),
    "export": (
        "hybridrec.cli.export",
        "export a saved DLRM run for serving: compact tables (fp32, fp16, int8), the dense "
        "part, encoders, checksums",
    ),
}


def version() -> str:
    try:
        return metadata.version("hybridrec")
    except metadata.PackageNotFoundError:  # run from a checkout that was never installed
        return "unknown (not installed)"


def usage() -> str:
    lines = [f"usage: {PROG} [--version] [{DEBUG_FLAG}] COMMAND [options]", "", "commands:"]
    lines += [f"  {name:12s} {text}" for name, (_, text) in COMMANDS.items()]
    lines += [
        "",
        f"{PROG} COMMAND --help lists the options of a command; {DEBUG_FLAG} (or "
        "HYBRIDREC_DEBUG=1) shows the traceback of an error instead of one line.",
    ]
    return "\n".join(lines)


def unknown_command(name: str) -> ConfigError:
    close = difflib.get_close_matches(name, list(COMMANDS), n=1)
    hint = f"did you mean {close[0]!r}? " if close else ""
    return ConfigError(
        f"unknown command {name!r}; {hint}the commands are {', '.join(COMMANDS)} ({PROG} --help)"
    )


def main(argv: Sequence[str] | None = None) -> None:
    args = list(sys.argv[1:] if argv is None else argv)
    with reported_errors():
        while args and args[0] == DEBUG_FLAG:  # hybridrec --debug train-dlrm ...
            show_tracebacks()
            args = args[1:]
        if not args:
            print(usage(), file=sys.stderr)
            raise SystemExit(2)
        if args[0] in ("-h", "--help"):
            print(usage())
            return
        if args[0] == "--version":
            print(f"{PROG} {version()}")
            return
        name, rest = args[0], args[1:]
        if name not in COMMANDS:
            raise unknown_command(name)
        job = importlib.import_module(COMMANDS[name][0])
        with program_name(f"{PROG} {name}"):
            job.main(rest)
