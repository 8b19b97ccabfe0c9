"""Train DLRM on MovieLens-100k, synthetic or Criteo data, on 1 or N ranks.

    python examples/train_dlrm.py                                # MovieLens, one process
    mpirun -n 2 python examples/train_dlrm.py                    # the same job on two ranks
    torchrun --standalone --nproc_per_node 2 examples/train_dlrm.py
    mpirun -n 3 python examples/train_dlrm.py --ps mpi           # 2 workers + 1 PS rank
    python examples/train_dlrm.py --data criteo --criteo-path day_0.gz --criteo-rows 0
    python examples/train_dlrm.py --config run.toml --checkpoint-dir ckpt --resume

The same job as the installed ``hybridrec train-dlrm``; ``--help`` lists every option.
``run_job`` does what every job does, in this order: the config (defaults < ``--config
run.toml`` < command line, checked on every rank); the launch (the world, the worker and
PS-server roles, the ``--ps`` store); on a worker, :class:`DLRMJob` builds the data
source, the embedding tables (placed per table), the dense part, the optimizer, the cache
and the Trainer; then training (epochs or ``--max-steps``, resumed with ``--resume``) and
the close (test AUC beside the popularity baseline, the summary line, metrics and plot).
"""

from __future__ import annotations

from hybridrec.cli.run_job import run_job
from hybridrec.dlrm.job import DLRMJob

if __name__ == "__main__":
    run_job(DLRMJob)
