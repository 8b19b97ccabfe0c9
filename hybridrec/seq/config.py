"""The options of the sequential-recommender job (``examples/train_seq.py --help``).

Every field is one command-line option (``max_seq_len`` -> ``--max-seq-len``) and one
key of a ``--config run.toml`` file; see :mod:`hybridrec.cli.options`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar, Literal

from hybridrec.cli.job_options import RunOptions
from hybridrec.cli.options import option
from hybridrec.launch.roles import parse_ps

# A catalogue this small is scored whole at every step (--loss auto): the full softmax
# costs less than a sampled one's bookkeeping there, and it is exact.
FULL_SOFTMAX_ITEMS = 50_000
# Model defaults where the two papers differ (dropout), by --model.
DROPOUT = {"sasrec": 0.5, "hstu": 0.2}


@dataclass(kw_only=True, slots=True)
class SeqConfig(RunOptions):
    max_zero_stage: ClassVar[int] = 2
    # ---- data
    data: Literal["movielens", "recbole", "tabular", "synthetic"] = option(
        "movielens",
        help="movielens: MovieLens-100k from the recbole package; recbole: a RecBole atomic "
        "data set (--data-path DIR); tabular: CSV/TSV/Parquet files with a user, item and "
        "time column (--data-path FILE ...); synthetic: Zipf item sequences (--synthetic-*)",
    )
    data_path: list[str] = option(
        [], help="recbole: the folder of NAME.inter; tabular: the interaction files"
    )
    user_field: str = option("user_id", help="the user column (recbole field or tabular column)")
    item_field: str = option("item_id", help="the item column")
    time_field: str = option("timestamp", help="the time column (histories are sorted by it)")
    synthetic_items: int = option(100_000, help="synthetic data: items in the catalogue")
    synthetic_users: int = option(5_000, help="synthetic data: users")
    synthetic_length: int = option(40, help="synthetic data: interactions per user (mean)")
    synthetic_zipf: float = option(1.05, help="synthetic data: Zipf exponent of item popularity")
    max_seq_len: int = option(
        50, help="longest history the model reads (the most recent interactions are kept)"
    )
    train_windows: Literal["all", "last"] = option(
        "all",
        help="all: a history longer than --max-seq-len trains in windows of that many items, "
        "every training item predicted once per epoch; last: only its most recent window",
    )
    train_context: int | None = option(
        None,
        help="--train-windows all: consecutive windows overlap by this many inputs, read "
        "but not predicted again, so each predicted item has that much history before it; "
        "default 9/10 of --max-seq-len (45 of 50)",
    )
    # ---- model
    model: Literal["sasrec", "hstu"] = option(
        "sasrec",
        help="sasrec: causal self-attention with learned positions (Kang & McAuley 2018); "
        "hstu: pointwise SiLU attention with an update gate and a relative position and "
        "time bias (Zhai et al. 2024)",
    )
    dim: int = option(64, help="item embedding and model width")
    n_layer: int = option(2, help="encoder blocks")
    n_head: int = option(2, help="attention heads per block")
    positions: Literal["first", "last"] = option(
        "first",
        help="which end of a history the learned positions count from: first (0 = the "
        "oldest item, as RecBole) or last (the newest item at --max-seq-len - 1, as the "
        "SASRec paper's code)",
    )
    dropout: float | None = option(
        None, help="dropout in the encoder; default 0.5 for sasrec (as RecBole), 0.2 for hstu"
    )
    # ---- loss
    loss: Literal["auto", "full", "sampled"] = option(
        "auto",
        help="full: softmax over every item; sampled: over the batch's items and --negatives "
        f"sampled ones, logQ-corrected; auto: full up to {FULL_SOFTMAX_ITEMS} items",
    )
    negatives: int = option(256, help="sampled negatives per step (--loss sampled)")
    negative_sampler: Literal["uniform", "popularity"] = option(
        "uniform", help="how negatives are drawn: uniformly, or by training popularity"
    )
    # ---- schedule
    epochs: int = option(200, help="passes over the training users (ended by --patience)")
    max_steps: int = option(0, help="stop after this many steps in total; 0 = no limit")
    batch_size: int = option(
        64, help="windows (or users, --batch-unit) per global step, split evenly over the ranks"
    )
    batch_unit: Literal["users", "windows"] = option(
        "windows",
        help="what --batch-size counts: users, each with all its training windows; or "
        "windows, drawn from every user's and shuffled across users each epoch",
    )
    eval_batch_size: int = option(256, help="users per evaluation batch")
    eval_every: int = option(0, help="steps between validation passes; 0 = after each epoch")
    keep_best: bool = option(
        True,
        help="test the epoch with the best validation NDCG@10 (its model kept); "
        "--no-keep-best: the last",
    )
    patience: int = option(
        20, help="stop after this many epochs without a better validation NDCG@10; 0 = off"
    )
    exclude_seen: bool = option(
        False, help="leave each user's earlier items out of the ranking (default: every item)"
    )
    # ---- optimizers
    lr: float = option(1e-3, help="Adam learning rate of the encoder")
    weight_decay: float = option(0.0, help="the encoder's L2 penalty (torch's weight_decay)")
    emb_optimizer: Literal["adam", "adagrad", "sgd"] = option(
        "adam", help="the item table's optimizer, applied to touched rows (adagrad: row-wise)"
    )
    emb_lr: float = option(1e-3, help="the item table's learning rate")
    seed: int = option(0, help="seed of the init, the user order, dropout and the negatives")
    # ---- where the item rows live
    ps: str = option(
        "local",
        help="parameter server for a hybrid item table: local (in-process, one replica per "
        "rank), mpi or mpi:S (the last S ranks serve), redis://[user:pw@]host:port/db",
    )
    placement: Literal["auto", "local", "hybrid", "sharded"] = option(
        "auto",
        help="the item table: local (replicated), hybrid (in the --ps store, behind the cache "
        "if one is set), sharded (split over the ranks, alltoallv); auto: hybrid with a cache "
        "or a non-local --ps, else local",
    )
    # ---- output
    log_every: int = option(50, help="steps between training-loss lines in the metrics file")
    verbose: bool = option(True, help="print epoch and final results (rank 0)")

    def __post_init__(self) -> None:
        self.check_run_options()
        if self.data == "recbole" and len(self.data_path) != 1:
            raise ValueError(
                f"data 'recbole' needs data_path DIR (one folder), got {self.data_path}"
            )
        if self.data == "tabular" and not self.data_path:
            raise ValueError("data 'tabular' needs data_path FILE [FILE ...]")
        if self.data in ("movielens", "synthetic") and self.data_path:
            raise ValueError(
                f"data_path is read with data 'recbole' or 'tabular', not {self.data!r}"
            )
        for name in (
            "synthetic_items", "synthetic_users", "synthetic_length", "max_seq_len", "dim",
            "n_layer", "n_head", "epochs", "batch_size", "eval_batch_size", "log_every",
        ):  # fmt: skip
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("negatives", "max_steps", "eval_every", "patience", "seed"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.train_context is not None and not 0 <= self.train_context < self.max_seq_len:
            raise ValueError(
                f"train_context must be in [0, max_seq_len = {self.max_seq_len}), "
                f"got {self.train_context}"
            )
        if self.train_context and self.train_windows != "all":
            raise ValueError(
                f"train_context {self.train_context} needs train_windows 'all', "
                f"got {self.train_windows!r}"
            )
        if self.dim % self.n_head:
            raise ValueError(f"dim {self.dim} must be a multiple of n_head {self.n_head}")
        if self.dropout is not None and not 0 <= self.dropout < 1:
            raise ValueError(f"dropout must be in [0, 1), got {self.dropout}")
        for name in ("lr", "emb_lr"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if not self.weight_decay >= 0:
            raise ValueError(f"weight_decay must be >= 0, got {self.weight_decay}")
        if not (math.isfinite(self.synthetic_zipf) and self.synthetic_zipf > 0):
            raise ValueError(f"synthetic_zipf must be a number > 0, got {self.synthetic_zipf}")
        if self.patience and not self.keep_best:
            raise ValueError(
                f"patience {self.patience} needs keep_best (early stopping keeps the best epoch)"
            )
        parse_ps(self.ps)  # checks the --ps syntax

    @property
    def window_context(self) -> int:
        """The inputs each training window reads before its first predicted one:
        ``--train-context``, by default 9/10 of ``--max-seq-len`` (0 for ``--train-windows
        last``, whose one window predicts every position)."""
        if self.train_context is not None:
            return self.train_context
        return 0 if self.train_windows == "last" else self.max_seq_len * 9 // 10

    @property
    def model_dropout(self) -> float:
        return DROPOUT[self.model] if self.dropout is None else self.dropout

    @property
    def table_placement(self) -> str:
        """The item table's placement, ``auto`` resolved."""
        if self.placement != "auto":
            return self.placement
        return "hybrid" if (self.wants_cache or self.ps != "local") else "local"

    def uses_full_softmax(self, num_items: int) -> bool:
        return self.loss == "full" or (self.loss == "auto" and num_items <= FULL_SOFTMAX_ITEMS)
