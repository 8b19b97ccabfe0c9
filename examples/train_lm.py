"""Train a GPT language model with a sparse token embedding, on 1 or N ranks.

    python examples/train_lm.py                         # Shakespeare (or stdlib source), bytes
    mpirun -n 2 python examples/train_lm.py             # the same job on two ranks
    torchrun --standalone --nproc_per_node 2 examples/train_lm.py --zero-stage 1
    python examples/train_lm.py --tokenizer gpt2 --d-model 128 --max-steps 1000
    python examples/train_lm.py --checkpoint-dir ckpt --checkpoint-every 100 --resume

The same job as the installed ``hybridrec train-lm``; ``--help`` lists every option.
``run_job`` does what every job does, in this order: the config (defaults < ``--config
run.toml`` < command line, checked on every rank); the launch (the world, the worker and
PS-server roles, the ``--ps`` store); on a worker, :class:`LMJob` builds the corpus and
tokenizer, the token table (hybrid, sharded or local), the GPT under DataParallel or ZeRO
and the Trainer; then ``--max-steps`` steps, evaluating every ``--eval-every``, resumed
with ``--resume``, and the close (test loss, the summary line, metrics and plot).
"""

from __future__ import annotations

from hybridrec.cli.run_job import run_job
from hybridrec.lm.job import LMJob

if __name__ == "__main__":
    run_job(LMJob)
