"""Train a GPT language model with a sparse token embedding, on 1 or N ranks.

    python examples/train_lm.py                         # Shakespeare (or stdlib source), bytes
    mpirun -n 2 python examples/train_lm.py             # the same job on two ranks
    torchrun --standalone --nproc_per_node 2 examples/train_lm.py --zero-stage 1

The same job as the installed ``hybridrec train-lm``; ``--help`` lists every option.
"""

from hybridrec.lm.job import main

if __name__ == "__main__":
    main()
