"""Train a next-item recommender (SASRec or HSTU) on user histories, on 1 or N ranks.

    python examples/train_seq.py                          # SASRec on MovieLens-100k
    python examples/train_seq.py --model hstu
    mpirun -n 2 python examples/train_seq.py              # the same job on two ranks
    torchrun --standalone --nproc_per_node 2 examples/train_seq.py
    python examples/train_seq.py --placement hybrid --cache-fraction 0.1 --read-bound 4 \
        --write-bound 4                                   # the item table in the PS, cached

The same job as the installed ``hybridrec train-seq``; ``--help`` lists every option.
``run_job`` does what every job does: the config, the launch (the world, the worker and
PS-server roles, the ``--ps`` store); on a worker, :class:`SeqJob` builds the histories
(leave-one-out), the tied item table (local, sharded or hybrid), the encoder under
DataParallel or ZeRO and the Trainer; then the epochs, validated by full ranking, the
best one kept and tested (the last line: ``test HR@10 ... NDCG@10 ...``).
"""

from __future__ import annotations

from hybridrec.cli.run_job import run_job
from hybridrec.seq.job import SeqJob

if __name__ == "__main__":
    run_job(SeqJob)
