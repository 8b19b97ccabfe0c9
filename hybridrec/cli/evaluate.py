"""``hybridrec evaluate --checkpoint DIR [--split test|val|all] [--slice-by COL] [options]``.

A saved run's model on any data: the job (DLRM or the GPT) is rebuilt from the options
the checkpoint recorded, with every option given here on top (``--data-test-path
new.csv``, ``--batch-size``, ``--device``, ...), its model loaded at any worker count,
and its metrics printed the way the training run printed them. ``DIR`` is a run's
``--checkpoint-dir`` (its newest checkpoint) or one ``step-N`` folder in it.

* The model evaluated is the one the training run tested: the best validation epoch's
  (``best/``, when the run kept one and ``DIR`` is its newest checkpoint), else the
  checkpoint's own.
* The rows are read into an in-process store (``--ps local``) unless ``--ps`` is given:
  evaluation never writes into the store a run trained in (a shared Redis keeps its
  rows), and needs no PS server ranks.
* Nothing is trained, no checkpoint is written; ``--out FILE`` writes the metrics as one
  JSON object (rank 0).
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
from collections.abc import Sequence
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any

from comm import Topology
from hybridrec.checkpoint.run_checkpoint import latest_checkpoint
from hybridrec.cli.errors import reported_errors
from hybridrec.cli.options import ConfigError, parse_config, program
from hybridrec.launch.roles import Launch

# The job each checkpoint's config names (``config["job"]``) -> its class, imported when used.
JOBS = {
    "dlrm": "hybridrec.dlrm.job:DLRMJob",
    "lm": "hybridrec.lm.job:LMJob",
    "seq": "hybridrec.seq.job:SeqJob",
}
SPLITS = ("test", "val", "all")


@dataclass(frozen=True)
class Evaluation:
    """What to evaluate: the checkpoint's step folder, the splits, the slice column."""

    checkpoint: Path  # a step-N folder (meta.json, model/)
    model: Path  # the saved model to evaluate (the step's model/ or the run's best/)
    meta: dict[str, Any]
    splits: tuple[str, ...]  # () means the job's default
    slice_by: str | None


def step_folder(path: str | Path) -> Path:
    """The checkpoint folder ``path`` names: a step folder itself, or the newest one of
    a run's checkpoint folder; FileNotFoundError saying which, otherwise."""
    folder = Path(path)
    if (folder / "meta.json").is_file():
        return folder
    newest = latest_checkpoint(folder)  # ValueError if 'latest' names an incomplete one
    if newest is not None:
        return newest
    raise FileNotFoundError(
        f"--checkpoint {folder}: neither a checkpoint (no meta.json) nor a checkpoint folder "
        "(no 'latest'); give a run's --checkpoint-dir or one of its step-N folders"
    )


def job_name(config: dict[str, Any]) -> str:
    """Which job saved ``config``: its ``job`` key (the DLRM job's options have an
    ``interaction``, the GPT's a ``block_size``, in checkpoints without one)."""
    if "job" in config:
        return str(config["job"])
    return "dlrm" if "interaction" in config else "lm"


def job_class(name: str) -> Any:
    module, cls = JOBS[name].split(":")
    return getattr(importlib.import_module(module), cls)


def saved_options(config: dict[str, Any], config_class: type) -> dict[str, Any]:
    """The run's options as the base of the evaluation's: the job's own fields, without
    what belongs to the training run (its checkpoints, metrics file, resume) and with the
    in-process store (a password-free ``--ps`` is given again when wanted)."""
    known = {f.name for f in fields(config_class)}
    base = {k: v for k, v in config.items() if k in known}
    base.update(
        checkpoint_dir=None, resume=False, metrics_out=None, ps="local", existing_tables="fail"
    )
    return base


def saved_run_parser(what: str) -> argparse.ArgumentParser:
    """The options of an after-training command (``evaluate``, ``predict``, ``export``):
    ``--checkpoint`` here, the command's own added by the caller; every other option is
    the saved job's. ``what``: the first half of the description."""
    own = argparse.ArgumentParser(
        prog=program(),
        add_help=False,
        description=f"{what}; every other option is the job's (--checkpoint DIR --help lists "
        "them).",
    )
    own.add_argument("--checkpoint", help="a run's --checkpoint-dir, or one step-N folder in it")
    return own


def open_saved(
    own: argparse.ArgumentParser, argv: Sequence[str] | None, command: str, jobs: Sequence[str]
) -> tuple[argparse.Namespace, SavedRun, list[str]]:
    """``(the command's options, the saved run, the job's options)`` of ``argv``; a run of
    a job other than ``jobs`` is refused naming both."""
    args, rest = own.parse_known_args(list(sys.argv[1:] if argv is None else argv))
    run = saved_run(args.checkpoint, own, rest)
    if run.job not in jobs:
        raise ConfigError(
            f"--checkpoint {run.folder}: {command} serves {' and '.join(jobs)} runs; this is "
            f"a {run.job} run"
        )
    return args, run, rest


def _own_parser() -> argparse.ArgumentParser:
    own = saved_run_parser("Evaluate a saved run on any data")
    own.add_argument(
        "--split", choices=SPLITS, default=None, help="what to evaluate (default: the job's)"
    )
    own.add_argument("--slice-by", default=None, help="metrics per value of this feature too")
    own.add_argument("--out", default=None, help="write the metrics here as JSON (rank 0)")
    return own


@dataclass(frozen=True)
class SavedRun:
    """A checkpoint as the after-training commands open it."""

    folder: Path  # the step-N folder
    meta: dict[str, Any]
    job: str  # "dlrm" or "lm"
    model: Path  # the model the run tested: its best/ (kept, newest checkpoint) or model/


def saved_run(checkpoint: str | None, own: argparse.ArgumentParser, rest: list[str]) -> SavedRun:
    """The checkpoint ``--checkpoint`` names (``--help`` without one prints ``own``'s)."""
    if checkpoint is None:
        if "-h" in rest or "--help" in rest:
            own.print_help()
            raise SystemExit(0)
        raise ConfigError("--checkpoint is required (a run's --checkpoint-dir or a step folder)")
    folder = step_folder(checkpoint)
    meta = json.loads((folder / "meta.json").read_text(encoding="utf-8"))
    name = job_name(meta.get("config") or {})
    if name not in JOBS:
        raise ConfigError(f"--checkpoint {folder}: saved by an unknown job {name!r}")
    newest = latest_checkpoint(folder.parent) == folder
    best = folder.parent / "best"
    kept_best = bool(meta.get("best")) and newest and (best / "model.json").is_file()
    return SavedRun(folder, meta, name, best if kept_best else folder / "model")


def job_config(
    run: SavedRun, rest: list[str], description: str, overrides: dict[str, Any] | None = None
) -> tuple[Any, Any]:
    """``(job class, job config)``: the saved run's options, then ``overrides`` (what the
    command needs, e.g. every table in this process), then the command line's."""
    cls = job_class(run.job)
    base = saved_options(run.meta.get("config") or {}, cls.config_class) | (overrides or {})
    return cls, parse_config(cls.config_class, rest, f"{description} (a {run.job} run)", base)


def scoring_config(cfg: Any, topology: Topology) -> Any:
    """``cfg`` with a training batch the workers split evenly, rounded up where the saved
    one does not (a run trained on 1 rank with batch 50, scored by 4): the job is built
    for its held-out data, which is read in ``eval_batch_size`` batches, and the
    training batch only has to pass the job's own checks."""
    per = cfg.ranks_per_replica
    workers = topology.num_workers
    replicas = workers // per if per > 1 and workers % per == 0 else workers
    if cfg.batch_size % replicas == 0:
        return cfg
    return replace(cfg, batch_size=-(-cfg.batch_size // replicas) * replicas)


def parse_evaluation(argv: Sequence[str] | None) -> tuple[Evaluation, Any, Any, str | None]:
    """``(evaluation, job class, job config, --out)`` from the command line."""
    own = _own_parser()
    args, run, rest = open_saved(own, argv, "evaluate", tuple(JOBS))
    cls, cfg = job_config(run, rest, str(own.description))
    splits = () if args.split is None else ("test", "val") if args.split == "all" else (args.split,)
    return Evaluation(run.folder, run.model, run.meta, splits, args.slice_by), cls, cfg, args.out


def main(argv: Sequence[str] | None = None) -> None:
    """Launch the saved job's roles, build it on the workers, evaluate, write ``--out``."""
    with reported_errors():
        evaluation, cls, cfg, out = parse_evaluation(argv)
        with Launch.for_run(cfg, training=False) as launch:
            if not launch.is_worker:
                return
            cfg = scoring_config(cfg, launch.topology)
            job = cls(
                cfg, launch.group, launch.store, roles=launch.topology,
                saved_config=evaluation.meta.get("config"),
            )  # fmt: skip
            result = job.evaluate_saved(evaluation)
            if out is not None and launch.group.rank == 0:
                Path(out).write_text(json.dumps(result, indent=1) + "\n", encoding="utf-8")
