"""Options every example job shares: cache, dense parallelism, checkpoints, metrics, runtime.

:class:`RunOptions` is the base of each job's config dataclass
(``hybridrec/dlrm/config.py``, ``hybridrec/lm/config.py``); each field is one
command-line option and one key of a ``--config`` file (:mod:`hybridrec.cli.options`).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar, Literal, cast

from comm import DEVICE_CHOICES
from comm.compression import CODECS
from hybridrec.cli.options import option
from ps.table import ROW_DTYPES, RowDtype, check_row_dtype

HELP_GROUPS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("data", ("data", "data_path", "data_val_path", "data_test_path", "schema",
              "skip_bad_lines", "criteo_path", "criteo_val_path", "criteo_rows",
              "synthetic_rows", "synthetic_samples", "synthetic_zipf", "text_dir", "max_bytes",
              "tokenizer", "bpe_file", "block_size", "user_field", "item_field", "time_field",
              "synthetic_items", "synthetic_users", "synthetic_length", "max_seq_len",
              "train_windows", "train_context")),
    ("training", ("epochs", "max_steps", "batch_size", "batch_unit", "lr", "weight_decay",
                  "dense_optimizer", "seed", "eval_every", "eval_batch_size", "eval_batches",
                  "keep_best", "patience", "precision", "loss", "negatives", "negative_sampler",
                  "exclude_seen")),
    ("model", ("model", "dim", "bottom_mlp", "top_mlp", "interaction", "dcn_layers", "dcn_rank",
               "n_layer", "n_head", "d_model", "dropout")),
    ("tables and store", ("ps", "placement", "placement_of", "emb_dtype", "emb_dtype_of",
                          "existing_tables", "emb_lr", "emb_optimizer", "ngram", "ngram_rows",
                          "ngram_splits", "ngram_placement", "ngram_capacity",
                          "ngram_max_age")),
    ("cache", ("cache_rows", "cache_fraction", "read_bound", "write_bound", "counted_pushes",
               "local_step", "cache_policy", "other_writers", "cache_groups", "cache_memory",
               "cache_on", "cache_prefetch", "cache_write_back", "sparse_pipeline")),
    ("dense parallelism", ("compression", "zero_stage", "bucket_mb", "tp", "pp",
                           "microbatches", "schedule")),
    ("checkpoints", ("checkpoint_dir", "checkpoint_every", "checkpoint_keep", "resume",
                     "overwrite_checkpoints")),
    ("output", ("metrics_out", "log_every", "metrics_window", "progress", "verbose")),
    ("launch", ("device", "backend", "threads", "keep_freed_mb", "validate_comm")),
)  # fmt: skip


@dataclass(kw_only=True, slots=True)
class CacheOptions:
    """The hot-row cache's size, bounds and policy: one definition for the jobs
    (:class:`RunOptions`) and the planner (``hybridrec.plan.options.PlanOptions``)."""

    cache_rows: int = option(0, help="hot-row cache in front of the store: rows per table")
    cache_fraction: float = option(0.0, help="cache size as a fraction of each table's rows")
    read_bound: int = option(0, help="cache read staleness bound s_r (PS updates a copy may miss)")
    write_bound: int = option(0, help="cache write bound s_w (updates a row may hold unpushed)")
    cache_policy: Literal["lru", "lfu", "tinylfu"] = option(
        "lru", help="cache eviction policy (tinylfu: frequency-aware admission, LFU eviction)"
    )
    other_writers: bool = option(
        False,
        help="other processes write the hybrid tables too (another job on the same --ps "
        "store): the cache of a one-worker job then asks the store about every row it serves, "
        "as with several workers, instead of counting its own pushes to know which are fresh",
    )


@dataclass(kw_only=True, slots=True)
class RunOptions(CacheOptions):
    max_zero_stage: ClassVar[int] = 2  # a job that shards parameters (ZeRO-3) raises it
    #: How ``--help`` groups the options of every job (one name means one thing in all of
    #: them), the common groups first; an option listed nowhere goes to "other options".
    help_groups: ClassVar[tuple[tuple[str, tuple[str, ...]], ...]] = HELP_GROUPS
    # ---- the hot-row cache in front of the --ps store (hybrid tables): also CacheOptions
    counted_pushes: bool = option(
        True,
        help="the cache pushes a row with the count of the updates it sums (and their squares), "
        "so the store's optimizer applies each of them (Adam, Adagrad: as without a write "
        "bound); --no-counted-pushes: one update per push (in-process and MPI stores)",
    )
    local_step: Literal["optimizer", "sgd"] = option(
        "optimizer",
        help="how a cached copy moves with each local update until it is refreshed: "
        "optimizer (the table's optimizer, with the row's state as pulled: one worker "
        "without a write bound serves exactly the store's rows) or sgd (HET's plain SGD "
        "step of the table's lr)",
    )
    cache_groups: bool = option(
        True, help="tables of one dim share one cache: one cache pass per step for all of them"
    )
    cache_memory: float = option(
        0.0,
        help="size the cache so that its rows and pending sums take at most this fraction "
        "(0 < F <= 1) of the worker GPU's memory, instead of --cache-rows/--cache-fraction: "
        "with fixed tables every table caches the same fraction of its rows (never more than "
        "all of them), with dynamic tables every table gets the same rows (at most the "
        "smallest fixed table's); a GPU worker with the cache on the device only",
    )
    cache_on: Literal["auto", "host", "device"] = option(
        "auto",
        help="where the cache keeps its rows: device (the worker's GPU: hits never leave it), "
        "host (records in host memory, as on a CPU worker) or auto (device on a GPU worker, "
        "host on a CPU worker)",
    )
    cache_prefetch: Literal["auto", "on", "off"] = option(
        "auto",
        help="the cache fetches the next batch's rows ahead, riding on this batch's pull: "
        "on, off, or auto (off: riding on the pull hides no latency and plans each batch "
        "twice; the DLRM job over MPI trained 1.06-1.16x faster without it)",
    )
    cache_write_back: Literal["auto", "gradients", "values"] = option(
        "auto",
        help="what the cache sends the store for a row's due updates: values (the cached "
        "copy, its state and clock, which the store keeps as they are: exact and cheaper, "
        "for a one-worker job's row-wise Adagrad tables), gradients (their sum, stepped by "
        "the store) or auto (values where a one-worker job's tables allow it)",
    )
    sparse_pipeline: Literal["auto", "on", "off"] = option(
        "auto",
        help="pull the next batch's hybrid rows and push this batch's on a background thread "
        "while the dense step runs: on, off, or auto (on where a core is free for it: a GPU "
        "worker, or more cores than this host's ranks use for torch threads; off for per-rank "
        "replicas, whose pushes are collectives)",
    )
    # ---- dense data parallelism
    compression: str | None = option(
        None, help=f"gradient codec for the DataParallel allreduce: one of {', '.join(CODECS)}"
    )
    zero_stage: int = option(
        0,
        help="0: DataParallel (bucketed allreduce overlapped with backward); 1: "
        "dense.ZeroOptimizer, optimizer state sharded over the ranks; 2: gradients sharded too; "
        "3 (GPT job): parameters sharded too, gathered per block (dense.Zero3)",
    )
    bucket_mb: float = option(25.0, help="DataParallel bucket size (MiB)")
    # ---- checkpoints and metrics
    checkpoint_dir: str | None = option(None, help="write checkpoints here (none: no checkpoints)")
    checkpoint_every: int = option(0, help="steps between checkpoints (0: only at the end)")
    checkpoint_keep: int = option(2, help="how many of the newest checkpoints to keep")
    resume: bool = option(False, help="continue from the newest checkpoint in --checkpoint-dir")
    overwrite_checkpoints: bool = option(
        False,
        help="a fresh run whose --checkpoint-dir holds another run's checkpoints deletes them "
        "first (without it, the run stops and names them)",
    )
    existing_tables: Literal["fail", "reuse", "replace"] = option(
        "fail",
        help="when the --ps store already holds this job's tables (a shared store such as "
        "Redis outlives a run): fail (stop and say so), reuse (train on from their rows; a "
        "different shape is an error naming the table) or replace (drop and recreate them); "
        "--resume implies reuse",
    )
    # ---- the element type of the embedding rows (every table, every placement)
    emb_dtype: Literal["fp32", "fp16", "bf16"] = option(
        "fp32",
        help="element type the embedding rows are stored in: fp32, fp16 or bf16 (half the "
        "weights' bytes; lookups and updates compute in float32, updates are written back "
        "with stochastic rounding, optimizer state stays float32); a resume or an "
        "evaluation with another type converts the saved rows",
    )
    emb_dtype_of: list[str] = option(
        [], help="per-table overrides TABLE=DTYPE, e.g. --emb-dtype-of user=bf16 item=fp32"
    )
    metrics_out: str | None = option(
        None, help="JSON lines file of metrics (rank 0); a PNG plot is written next to it"
    )
    progress: bool = option(True, help="progress bar (rank 0, only on a terminal)")
    # ---- runtime
    device: str = option(
        "auto",
        help="where a worker trains: auto (this rank's GPU when CUDA is there, else the CPU), "
        "cpu, cuda (GPU local_rank mod the host's GPUs) or cuda:N; PS ranks stay on the host",
    )
    precision: Literal["fp32", "bf16"] = option(
        "fp32",
        help="dense math precision: fp32, or bf16 autocast (the embedding rows keep "
        "--emb-dtype, their updates are computed in fp32)",
    )
    backend: str = option("auto", help="auto (mpirun -> mpi, torchrun -> gloo), local, mpi, gloo")
    validate_comm: bool = option(False, help="cross-rank checks on every collective (slower)")
    threads: int = option(1, help="torch threads per rank; 0 = torch's default")
    keep_freed_mb: int = option(
        512,
        help="the C library's malloc keeps up to this many MiB of freed memory for the next "
        "step instead of returning it to the OS (no page faults on a step's buffers); 0: "
        "its defaults",
    )

    def dtype_overrides(self) -> dict[str, RowDtype]:
        """``emb_dtype_of`` as ``{table: dtype}``; ValueError naming the item, its table
        and the choices for a malformed item or a dtype that is not one of them."""
        out: dict[str, RowDtype] = {}
        for item in self.emb_dtype_of:
            table, sep, dtype = item.partition("=")
            if not sep or not table:
                raise ValueError(
                    f"emb_dtype_of: expected TABLE={'|'.join(ROW_DTYPES)}, got {item!r}"
                )
            try:
                check_row_dtype(table, dtype)
            except ValueError as e:  # "table 'user': dtype must be one of ..., got 'fp8'"
                raise ValueError(f"emb_dtype_of: {e}") from None
            out[table] = cast(RowDtype, dtype)
        return out

    def table_dtypes(self, tables: Sequence[str]) -> dict[str, RowDtype]:
        """The row dtype of each of ``tables`` (a job's table names): ``emb_dtype``, or
        the table's ``emb_dtype_of`` override; ValueError naming an override whose table
        the job does not have, with the tables it has."""
        out: dict[str, RowDtype] = dict.fromkeys(tables, self.emb_dtype)
        for table, dtype in self.dtype_overrides().items():
            if table not in out:
                raise ValueError(
                    f"emb_dtype_of {table}={dtype}: no table {table!r}; the tables are "
                    f"{', '.join(tables)}"
                )
            out[table] = dtype
        return out

    @property
    def tables_policy(self) -> str:
        """What to do with tables already in the store: ``--resume`` turns fail into reuse."""
        return "reuse" if self.resume and self.existing_tables == "fail" else self.existing_tables

    @property
    def ranks_per_replica(self) -> int:
        """Worker ranks holding one copy of the model between them (they see the same
        samples); 1 unless a job splits its model (the GPT job's tp x pp)."""
        return 1

    @property
    def wants_cache(self) -> bool:
        """A hot-row cache is asked for (by rows, fraction or GPU memory)."""
        return bool(self.cache_rows or self.cache_fraction or self.cache_memory)

    def check_cache_memory(self) -> None:
        """``cache_memory`` is a share of the GPU, exclusive of the other cache sizes, and
        sizes a cache whose rows are on the device (the worker's device is checked later,
        by :func:`hybridrec.launch.job_cache.cache_config`)."""
        if self.cache_on not in ("auto", "host", "device"):
            raise ValueError(f"cache_on must be 'auto', 'host' or 'device', got {self.cache_on!r}")
        if not self.cache_memory:
            return
        if not 0 < self.cache_memory <= 1:
            raise ValueError(
                f"cache_memory must be in (0, 1] (a fraction of the GPU's memory), "
                f"got {self.cache_memory}"
            )
        given = [f"{n} {getattr(self, n)}" for n in ("cache_rows", "cache_fraction")
                 if getattr(self, n)]  # fmt: skip
        if given:
            raise ValueError(
                f"give cache_memory or {' / '.join(n.split()[0] for n in given)}, not both "
                f"(got cache_memory {self.cache_memory} and {' and '.join(given)})"
            )
        if self.cache_on == "host":
            raise ValueError(
                f"cache_memory {self.cache_memory} sizes a cache whose rows are on the GPU, but "
                "cache_on is 'host' (size a host cache with cache_rows or cache_fraction)"
            )

    def check_run_options(self) -> None:
        """ValueError naming the option and its value if a shared option is out of range."""
        if self.cache_rows and self.cache_fraction:
            raise ValueError(
                f"give cache_rows or cache_fraction, not both (got {self.cache_rows} and "
                f"{self.cache_fraction})"
            )
        if not 0 <= self.cache_fraction <= 1:
            raise ValueError(f"cache_fraction must be in [0, 1], got {self.cache_fraction}")
        self.check_cache_memory()
        for name in (
            "threads", "keep_freed_mb", "checkpoint_every", "cache_rows", "read_bound",
            "write_bound",
        ):  # fmt: skip
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.checkpoint_keep < 1:
            raise ValueError(f"checkpoint_keep must be >= 1, got {self.checkpoint_keep}")
        if not self.bucket_mb > 0:
            raise ValueError(f"bucket_mb must be > 0, got {self.bucket_mb}")
        stages = tuple(range(self.max_zero_stage + 1))
        if self.zero_stage not in stages:
            listed = ", ".join(map(str, stages[:-1])) + f" or {stages[-1]}"
            raise ValueError(f"zero_stage must be {listed}, got {self.zero_stage}")
        if self.compression is not None and self.compression not in CODECS:
            raise ValueError(
                f"compression must be one of {', '.join(CODECS)}, got {self.compression!r}"
            )
        if self.compression is not None and self.zero_stage:
            raise ValueError(
                f"compression {self.compression!r} applies to the DataParallel allreduce; "
                f"ZeRO stage {self.zero_stage} reduces gradients itself (use zero_stage 0)"
            )
        device = self.device.strip().lower()
        if device not in DEVICE_CHOICES and not re.fullmatch(r"cuda:\d+", device):
            raise ValueError(f"device must be auto, cpu, cuda or cuda:N, got {self.device!r}")
        if self.precision not in ("fp32", "bf16"):
            raise ValueError(f"precision must be fp32 or bf16, got {self.precision!r}")
        if self.emb_dtype not in ROW_DTYPES:
            raise ValueError(
                f"emb_dtype must be one of {', '.join(ROW_DTYPES)}, got {self.emb_dtype!r}"
            )
        self.dtype_overrides()  # checks the TABLE=DTYPE syntax and the dtypes
        if self.existing_tables not in ("fail", "reuse", "replace"):
            raise ValueError(
                "existing_tables must be 'fail', 'reuse' or 'replace', got "
                f"{self.existing_tables!r}"
            )
        if self.resume and not self.checkpoint_dir:
            raise ValueError("resume needs checkpoint_dir (where to find the checkpoints)")
