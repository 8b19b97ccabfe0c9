"""What every job's ``main`` does around its own model: the checks before anything
starts, the stop requests, the launch, the training and the close.

A job module's entry point is one call::

    @reported_errors()
    def main(argv=None):
        run_job(parse_args(argv), DLRMJob)

``job(cfg, group, store, roles=topology)`` builds the job on a worker rank; it has a
``trainer`` and a ``close(result)``. A PS server rank serves inside the launch and builds
nothing.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

from hybridrec.interrupts import exit_if_asked, watching
from hybridrec.launch import Launch
from hybridrec.trainer import check_checkpoint_dir


class _Job(Protocol):
    trainer: Any

    def close(self, run: Any) -> Any: ...


def run_job(cfg: Any, job: Callable[..., _Job]) -> None:
    """Check ``cfg``'s checkpoint folder (every rank sees it, so all stop alike), then
    launch (roles, store), build ``job`` on a worker, train, close; Ctrl-C or SIGTERM
    finish the step, save and exit 130 (:mod:`hybridrec.interrupts`)."""
    check_checkpoint_dir(cfg.checkpoint_dir, resume=cfg.resume, overwrite=cfg.overwrite_checkpoints)
    with watching():
        with Launch.for_run(cfg) as launch:
            if launch.is_worker:  # a PS server rank has served inside Launch and skips this
                built = job(cfg, launch.group, launch.store, roles=launch.topology)
                built.close(built.trainer.fit())
        exit_if_asked()  # a PS server rank, or a stop request at the last step
