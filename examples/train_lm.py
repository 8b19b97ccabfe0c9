"""Train a GPT language model with a sparse token embedding, on 1 or N ranks.

    python examples/train_lm.py                         # Shakespeare (or stdlib source), bytes
    mpirun -n 2 python examples/train_lm.py             # the same job on two ranks
    torchrun --standalone --nproc_per_node 2 examples/train_lm.py --zero-stage 1
    python examples/train_lm.py --tokenizer gpt2 --d-model 128 --max-steps 1000
    python examples/train_lm.py --checkpoint-dir ckpt --checkpoint-every 100 --resume

The same job as the installed ``hybridrec train-lm``; ``--help`` lists every option.
Each step below is a library call (``hybridrec.lm.job``, ``hybridrec.launch``,
``hybridrec.trainer``); this script only shows their order.
"""

from __future__ import annotations

from hybridrec.errors import reported_errors
from hybridrec.launch import Launch
from hybridrec.lm.job import LMJob, parse_args


@reported_errors()  # a user error is one line on stderr (--debug: the traceback)
def main(argv: list[str] | None = None) -> None:
    # Config: defaults < --config run.toml < command line, checked on every rank.
    cfg = parse_args(argv)
    # Launch: the world, the worker / PS-server roles and the --ps store; the roles are
    # checked before anything starts, and leaving the block closes store and world.
    with Launch.for_run(cfg) as launch:
        if not launch.is_worker:
            return  # a PS server rank served the rows until every worker closed its store
        # Build: corpus and tokenizer, the token table (hybrid, sharded or local), the GPT
        # under DataParallel or ZeRO, and the Trainer with its evaluation and checkpoints.
        job = LMJob(cfg, launch.group, launch.store, roles=launch.topology)
        # Train: --max-steps steps, evaluating every --eval-every; --resume continues a run.
        run = job.trainer.fit()
        # Close: the final validation loss, tokens/s of this run, metrics file + plot.
        job.close(run)


if __name__ == "__main__":
    main()
