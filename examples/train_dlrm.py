"""Train DLRM on MovieLens-100k, synthetic or Criteo data, on 1 or N ranks.

    python examples/train_dlrm.py                                # MovieLens, one process
    mpirun -n 2 python examples/train_dlrm.py                    # the same job on two ranks
    torchrun --standalone --nproc_per_node 2 examples/train_dlrm.py
    mpirun -n 3 python examples/train_dlrm.py --ps mpi           # 2 workers + 1 PS rank
    python examples/train_dlrm.py --data criteo --criteo-path day_0.gz --criteo-rows 0
    python examples/train_dlrm.py --config run.toml --checkpoint-dir ckpt --resume

The same job as the installed ``hybridrec train-dlrm``; ``--help`` lists every option.
Each step below is a library call (``hybridrec.dlrm.job``, ``hybridrec.launch``,
``hybridrec.trainer``); this script only shows their order.
"""

from __future__ import annotations

from hybridrec.dlrm.job import DLRMJob, parse_args
from hybridrec.errors import reported_errors
from hybridrec.launch import Launch


@reported_errors()  # a user error is one line on stderr (--debug: the traceback)
def main(argv: list[str] | None = None) -> None:
    # Config: defaults < --config run.toml < command line, checked on every rank.
    cfg = parse_args(argv)
    # Launch: the world, the worker / PS-server roles and the --ps store; the roles are
    # checked before anything starts, and leaving the block closes store and world.
    with Launch.for_run(cfg) as launch:
        if not launch.is_worker:
            return  # a PS server rank served the rows until every worker closed its store
        # Build: data source, embedding tables (placed per table), dense part, optimizer,
        # cache, and the Trainer with its evaluation, checkpoint and metrics hooks.
        job = DLRMJob(cfg, launch.group, launch.store, roles=launch.topology)
        # Train: epochs / --max-steps, resumed from --checkpoint-dir with --resume.
        run = job.trainer.fit()
        # Close: test AUC next to the popularity baseline, the summary line, metrics + plot.
        job.close(run)


if __name__ == "__main__":
    main()
