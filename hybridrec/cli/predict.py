"""``hybridrec predict --checkpoint DIR --input FILE [FILE ...] --out scores.csv [--key COL ...]``.

A saved DLRM run's score for every row of tabular or Criteo files it never saw (or of a
folder of RecBole atomic files, for a RecBole or MovieLens run), written beside the row's
key columns (``.csv``, ``.jsonl`` or ``.parquet``), under python, mpirun or
torchrun: every rank scores its share of each file and rank 0 writes all rows in file
and line order, each once (:mod:`hybridrec.dlrm.predict`). The files are encoded with the
vocabularies and statistics the run saved. The model is the one ``hybridrec evaluate``
evaluates (the best validation epoch's when the run kept one), its rows in an
in-process store unless ``--ps`` is given.

The files to score are ``--input``, not ``--data``: ``--data`` is the job's own option
(which reader, ``tabular``), taken from the checkpoint with every other one.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from hybridrec.cli.errors import reported_errors
from hybridrec.cli.evaluate import job_config, open_saved, saved_run_parser, scoring_config
from hybridrec.cli.options import ConfigError
from hybridrec.dlrm.predict import gather_scores, output_format, score, scored_rows, write_scores
from hybridrec.launch.roles import Launch


def _own_parser() -> argparse.ArgumentParser:
    own = saved_run_parser("Score every row of tabular, Criteo or RecBole data with a saved DLRM")
    own.add_argument(
        "--input",
        nargs="+",
        default=None,
        help="the CSV/TSV/Parquet or Criteo files to score, or one RecBole folder",
    )
    own.add_argument("--out", default=None, help="scores.csv, scores.jsonl or scores.parquet")
    own.add_argument(
        "--key",
        nargs="+",
        default=[],
        help="columns written beside each score (default: file, line)",
    )
    return own


def main(argv: Sequence[str] | None = None) -> None:
    with reported_errors():
        own = _own_parser()
        args, run, rest = open_saved(own, argv, "predict", ("dlrm",))
        if not args.input or args.out is None:
            raise ConfigError(
                "predict needs --input FILE [FILE ...] and --out scores.csv|jsonl|parquet"
            )
        output_format(args.out)
        cls, cfg = job_config(run, rest, str(own.description))
        if cfg.data == "synthetic":
            raise ConfigError(
                f"--checkpoint {run.folder}: a --data synthetic run has no files to score; "
                "score its held-out split with hybridrec evaluate"
            )
        with Launch.for_run(cfg, training=False) as launch:
            if not launch.is_worker:
                return
            cfg = scoring_config(cfg, launch.topology)
            group = launch.group
            job = cls(cfg, group, launch.store, roles=launch.topology,
                      saved_config=run.meta.get("config"))  # fmt: skip
            if job.lockstep:
                raise ConfigError(
                    "predict: this run's sharded tables need every rank in each forward; "
                    "predict with --placement local or hybrid (the checkpoint loads into either)"
                )
            job.load_saved(run.model)
            files, batches = scored_rows(job.source, args.input, args.key, group)
            keys, probs = score(job.model, batches, job.feed, cfg.precision)
            rows = gather_scores(keys, probs, group, len(args.key))
            if rows is not None:
                write_scores(args.out, rows, args.key, files)
                job.say(f"scored {len(rows)} rows of {len(files)} file(s) into {args.out}")
