"""One entry point for every job: ``run_job(DLRMJob, argv)``.

What every job's ``main`` does around its own model, in this order:

1. **Config**: ``job.config_class`` parsed from ``argv`` (defaults < ``--config run.toml``
   < command line, every value checked on every rank; :mod:`hybridrec.cli.options`).
2. **Checks** before anything starts: the checkpoint folder (every rank sees it, so all
   stop alike).
3. **Launch**: the world, the worker and PS-server roles and the ``--ps`` store
   (:class:`hybridrec.launch.roles.Launch`); a PS server rank serves the rows inside the
   launch until every worker closed its store, and builds nothing.
4. **Build** on a worker: ``job(cfg, group, store, roles=topology)`` makes data, tables,
   dense part, optimizer, cache and the :class:`hybridrec.train.loop.Trainer`.
5. **Train and close**: ``job.close(job.trainer.fit())`` (the test metrics, the summary
   line, the metrics file and its plot); leaving the launch closes store and world.

Ctrl-C or SIGTERM finish the step, save and exit 130 (:mod:`hybridrec.train.interrupts`);
a user error (bad option, missing file, unreachable store) is one line on stderr and exit
status 2 (:mod:`hybridrec.cli.errors`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

from comm import ProcessGroup, Topology
from hybridrec.cli.errors import reported_errors
from hybridrec.cli.options import parse_config
from hybridrec.launch.roles import Launch, torch_threads
from hybridrec.train.interrupts import exit_if_asked, watching
from hybridrec.train.loop import check_checkpoint_dir
from ps import InProcessStore, Store


class BuiltJob(Protocol):
    """A job built on a worker: its trainer, and what ends the run."""

    trainer: Any

    def close(self, run: Any) -> Any: ...


class JobClass(Protocol):
    """What :func:`run_job` takes: a job class, with its options' dataclass and the
    one-line description ``--help`` starts with, built as
    ``job(cfg, group, store, roles=topology)`` on a worker rank."""

    @property
    def config_class(self) -> type: ...

    @property
    def description(self) -> str: ...

    def __call__(
        self, cfg: Any, group: ProcessGroup, store: Store, *, roles: Topology | None = ...
    ) -> BuiltJob: ...


def parse_job_args(job: JobClass, argv: Sequence[str] | None = None) -> Any:
    """``job``'s config from ``argv`` (None: ``sys.argv[1:]``)."""
    return parse_config(job.config_class, None if argv is None else list(argv), job.description)


def run_job(job: JobClass, argv: Sequence[str] | None = None) -> None:
    """Parse, check, launch, build ``job`` on a worker, train, close (module docstring)."""
    with reported_errors():
        cfg = parse_job_args(job, argv)
        check_checkpoint_dir(
            cfg.checkpoint_dir, resume=cfg.resume, overwrite=cfg.overwrite_checkpoints
        )
        with watching():
            with Launch.for_run(cfg) as launch:
                if launch.is_worker:
                    built = job(cfg, launch.group, launch.store, roles=launch.topology)
                    built.close(built.trainer.fit())
            exit_if_asked()  # a PS server rank, or a stop request at the last step


def train_in_group(
    job: JobClass,
    cfg: Any,
    group: ProcessGroup,
    store: Store | None = None,
    *,
    roles: Topology | None = None,
) -> Any:
    """Build ``job`` on the workers ``group`` already running (a test, a notebook, the
    planner), train, close; returns what ``close`` returns. ``store`` holds the hybrid
    tables (default: a fresh in-process store); ``roles``, the whole job's (for the
    header; default: ``group`` alone)."""
    with torch_threads(cfg.threads):
        built = job(cfg, group, InProcessStore() if store is None else store, roles=roles)
        return built.close(built.trainer.fit())
