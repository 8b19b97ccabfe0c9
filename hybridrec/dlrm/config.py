"""The options of the DLRM job (``examples/train_dlrm.py --help`` prints them all).

Every field is one command-line option (``batch_size`` -> ``--batch-size``) and one
key of a ``--config run.toml`` file; see :mod:`hybridrec.cli.options`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

from hybridrec.cli.job_options import RunOptions
from hybridrec.cli.options import option
from hybridrec.launch.roles import parse_ps

PLACEMENTS = ("auto", "local", "hybrid", "sharded")


def check_mlp(name: str, widths: list[int], last: int, what: str) -> None:
    """ValueError unless ``widths`` are ints >= 1 ending in ``last``."""
    flag = "--" + name.replace("_", "-")
    if not widths or any(not isinstance(w, int) or isinstance(w, bool) or w < 1 for w in widths):
        raise ValueError(f"{name} must be a non-empty list of ints >= 1, got {widths!r}")
    if widths[-1] != last:
        example = " ".join(str(w) for w in [*widths, last])
        raise ValueError(
            f"{name} {widths} must end in {what}: it lists the output width of every layer, "
            f"the last included (as dense.DLRMConfig does); e.g. {flag} {example}"
        )


@dataclass(kw_only=True, slots=True)
class DLRMJobConfig(RunOptions):
    # ---- data
    data: Literal["movielens", "synthetic", "criteo", "tabular", "recbole"] = option(
        "movielens",
        help="movielens: MovieLens-100k from the recbole package; synthetic: Criteo-shaped "
        "Zipf clicks; criteo: Criteo TSV files (--criteo-path); tabular: your CSV/TSV/Parquet "
        "files (--data-path, --schema); recbole: a RecBole atomic data set (--data-path DIR)",
    )
    criteo_path: list[str] = option(
        [], help="Criteo TSV files (plain or .gz) to train on, streamed, dealt to ranks by line"
    )
    criteo_val_path: list[str] = option(
        [], help="Criteo TSV files for validation (AUC, log loss); none: no validation"
    )
    criteo_rows: int = option(
        100_000,
        help="rows per Criteo table: categorical values are hashed into this many rows; "
        "0: raw 63-bit ids in dynamic tables on the parameter server (hybrid placement)",
    )
    skip_bad_lines: bool = option(
        False,
        help="count and skip malformed Criteo, tabular or RecBole lines instead of stopping "
        "with an error",
    )
    # ---- bring your own data (--data tabular | recbole)
    data_path: list[str] = option(
        [],
        help="tabular: training files (CSV/TSV with a header line, plain or .gz, or Parquet), "
        "streamed, dealt to ranks by row; recbole: the folder of NAME.inter (.user, .item)",
    )
    data_val_path: list[str] = option(
        [], help="tabular: validation files (AUC, log loss); none: no validation"
    )
    data_test_path: list[str] = option([], help="tabular: test files; none: no test AUC")
    schema: str = option(
        "",
        help="schema file (TOML or JSON): the label column and click rule, dense and sparse "
        "columns and their options (needed by tabular; recbole: overrides the field types)",
    )
    synthetic_rows: int = option(10_000, help="rows per table of the synthetic data")
    synthetic_samples: int = option(200_000, help="samples of the synthetic data")
    synthetic_zipf: float = option(
        1.05, help="synthetic data: the Zipf exponent of each table's ids (larger: hotter rows)"
    )
    # ---- schedule
    epochs: int | None = option(
        None,
        help="passes over the training data; default 8 for MovieLens (ended by --patience), else 1",
    )
    max_steps: int = option(0, help="stop after this many steps in total; 0 = no limit")
    batch_size: int = option(256, help="global batch size, split evenly over the worker ranks")
    eval_batch_size: int = option(4096, help="samples per forward pass when evaluating")
    eval_every: int = option(0, help="steps between validation passes; 0 = after each epoch")
    # ---- best epoch and early stopping (on the validation AUC of each epoch)
    keep_best: bool = option(
        True,
        help="report test metrics of the epoch with the best validation AUC, whose model is "
        "kept (best/ under --checkpoint-dir, else a temporary folder); --no-keep-best: the last",
    )
    patience: int | None = option(
        None,
        help="stop after this many epochs without a better validation AUC; 0 = off; "
        "default 2 for MovieLens (with --keep-best), else 0",
    )
    # ---- model and optimizers
    dim: int | None = option(
        None,
        help="embedding dimension (and the bottom MLP's output width); default 32 for "
        "MovieLens, else 16",
    )
    bottom_mlp: list[int] | None = option(
        None,
        help="output width of every bottom-MLP layer, the last one equal to --dim (as in "
        "dense.DLRMConfig.bottom_mlp), e.g. --bottom-mlp 64 16; default: 64 then --dim",
    )
    top_mlp: list[int] | None = option(
        None,
        help="output width of every top-MLP layer, the last one 1 (the logit; as in "
        "dense.DLRMConfig.top_mlp); default 128 64 1 for MovieLens, else 64 32 1",
    )
    # ---- the interaction (dense.DLRMConfig.interaction)
    interaction: Literal["dot", "dcn"] | None = option(
        None,
        help="dot: DLRM's pairwise dot products; dcn: DCN-v2's low-rank cross network "
        "(--dcn-layers, --dcn-rank), as in MLPerf's DLRM-DCNv2; default dcn for MovieLens, "
        "else dot",
    )
    dcn_layers: int = option(3, help="cross layers of --interaction dcn")
    dcn_rank: int = option(64, help="rank of each cross layer's weight (U V^T) with dcn")
    # ---- optimizers
    lr: float = option(1e-3, help="dense learning rate")
    weight_decay: float = option(
        0.0, help="L2 penalty of the dense optimizer on every dense weight (torch's weight_decay)"
    )
    dense_optimizer: Literal["adam", "adagrad"] = option("adam", help="dense optimizer")
    emb_lr: float = option(0.05, help="learning rate of the row-wise Adagrad on embedding rows")
    seed: int = option(0, help="seed of the model init, the data split and the shuffles")
    # ---- where the embedding rows live
    ps: str = option(
        "local",
        help="parameter server for hybrid tables: local (in-process, one replica per rank), "
        "mpi or mpi:S (the last S ranks of mpirun serve), redis://[user:pw@]host:port/db "
        "(?cluster=1 for Redis Cluster)",
    )
    placement: Literal["auto", "local", "hybrid", "sharded"] = option(
        "auto",
        help="where every table's rows live: local (replicated, fused), hybrid (in the --ps "
        "store, behind the cache if one is set), sharded (split over the ranks, alltoallv); "
        "auto: hybrid with a cache, a non-local --ps or dynamic tables, else local",
    )
    placement_of: list[str] = option(
        [], help="per-table overrides TABLE=PLACEMENT, e.g. --placement-of user=sharded item=hybrid"
    )
    # ---- metrics (dense parallelism, checkpoints, runtime: hybridrec.cli.job_options)
    log_every: int = option(50, help="steps between training-loss lines in the metrics file")
    metrics_window: int = option(
        100,
        help="steps whose training predictions each metrics line scores (train_auc, "
        "train_ne, train_calibration over every rank's samples); 0: none",
    )
    verbose: bool = option(True, help="print epoch and final results (rank 0)")

    def __post_init__(self) -> None:
        self.check_run_options()
        if self.data not in ("movielens", "synthetic", "criteo", "tabular", "recbole"):
            raise ValueError(
                "data must be 'movielens', 'synthetic', 'criteo', 'tabular' or 'recbole', "
                f"got {self.data!r}"
            )
        self.resolve_defaults()
        self.check_own_data()
        if self.data == "criteo" and not self.criteo_path:
            raise ValueError("data 'criteo' needs --criteo-path FILE [FILE ...]")
        if self.dense_optimizer not in ("adam", "adagrad"):
            raise ValueError(
                f"dense_optimizer must be 'adam' or 'adagrad', got {self.dense_optimizer!r}"
            )
        if self.interaction not in ("dot", "dcn"):
            raise ValueError(f"interaction must be 'dot' or 'dcn', got {self.interaction!r}")
        for name in (
            "epochs", "batch_size", "dim", "synthetic_rows", "eval_batch_size",
            "dcn_layers", "dcn_rank",
        ):  # fmt: skip
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in (
            "max_steps", "threads", "criteo_rows", "patience",
            "eval_every", "checkpoint_every", "seed", "metrics_window",
        ):  # fmt: skip
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        for name in ("log_every", "checkpoint_keep"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("lr", "emb_lr", "bucket_mb"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        assert self.dim is not None and self.top_mlp is not None  # resolve_defaults
        if self.bottom_mlp is None:
            self.bottom_mlp = [64, self.dim]
        check_mlp("bottom_mlp", self.bottom_mlp, self.dim, f"--dim {self.dim}")
        check_mlp("top_mlp", self.top_mlp, 1, "1 (the logit)")
        if not self.weight_decay >= 0:
            raise ValueError(f"weight_decay must be >= 0, got {self.weight_decay}")
        if self.patience and not self.keep_best:
            raise ValueError(
                f"patience {self.patience} needs keep_best (early stopping keeps the best epoch)"
            )
        if self.synthetic_samples < 10:
            raise ValueError(f"synthetic_samples must be >= 10, got {self.synthetic_samples}")
        if not (math.isfinite(self.synthetic_zipf) and self.synthetic_zipf > 0):
            raise ValueError(f"synthetic_zipf must be a number > 0, got {self.synthetic_zipf}")
        if self.placement not in PLACEMENTS:
            raise ValueError(f"placement must be one of {PLACEMENTS}, got {self.placement!r}")
        self.placement_overrides()  # checks the TABLE=PLACEMENT syntax
        parse_ps(self.ps)  # checks the --ps syntax

    def check_own_data(self) -> None:
        if self.data == "tabular" and not (self.data_path and self.schema):
            raise ValueError("data 'tabular' needs data_path FILE [FILE ...] and schema FILE")
        if self.data == "recbole" and len(self.data_path) != 1:
            raise ValueError(
                f"data 'recbole' needs data_path DIR (one folder), got {self.data_path}"
            )
        given = [n for n in ("data_val_path", "data_test_path") if getattr(self, n)]
        if self.data != "tabular" and given:
            raise ValueError(f"{given[0]} is read with data 'tabular' only")

    def resolve_defaults(self) -> None:
        """The options left None get their data set's defaults. MovieLens-100k's were
        chosen by its validation AUC (mean over seeds; the README gives the figures):
        DCN-v2, 32-wide embeddings, a wider top MLP, up to 8 epochs ended by patience 2.
        A RecBole data set (MovieLens is one) gets the same; streamed data the others."""
        movielens = self.data in ("movielens", "recbole")
        if self.epochs is None:
            self.epochs = 8 if movielens else 1
        if self.dim is None:
            self.dim = 32 if movielens else 16
        if self.top_mlp is None:
            self.top_mlp = [128, 64, 1] if movielens else [64, 32, 1]
        if self.interaction is None:
            self.interaction = "dcn" if movielens else "dot"
        if self.patience is None:
            self.patience = 2 if movielens and self.keep_best else 0

    def placement_overrides(self) -> dict[str, str]:
        """``placement_of`` as ``{table: placement}``."""
        out = {}
        for item in self.placement_of:
            table, sep, where = item.partition("=")
            if not sep or not table or where not in PLACEMENTS[1:]:
                raise ValueError(f"placement_of: expected TABLE=local|hybrid|sharded, got {item!r}")
            out[table] = where
        return out
