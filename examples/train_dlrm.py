"""Train DLRM on MovieLens-100k, synthetic or Criteo data, on 1 or N ranks.

    python examples/train_dlrm.py                                # MovieLens, one process
    mpirun -n 2 python examples/train_dlrm.py                    # the same job on two ranks
    torchrun --standalone --nproc_per_node 2 examples/train_dlrm.py
    mpirun -n 3 python examples/train_dlrm.py --ps mpi           # 2 workers + 1 PS rank
    python examples/train_dlrm.py --config run.toml --checkpoint-dir ckpt --resume

The same job as the installed ``hybridrec train-dlrm``; ``--help`` lists every option.
"""

from hybridrec.dlrm.job import main

if __name__ == "__main__":
    main()
