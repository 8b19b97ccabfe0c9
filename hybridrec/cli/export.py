"""``hybridrec export --checkpoint DIR --out MODEL_DIR [--tables fp32|fp16|int8] [options]``.

A saved DLRM run as a self-contained folder for :class:`hybridrec.serving.Predictor`:
every table whole in one row format, the dynamic tables' ids, the dense part's config
and weights, the run's options and encoders, and a manifest of checksums
(:mod:`hybridrec.serving.export`). The model exported is the one ``hybridrec evaluate``
scores: the best validation epoch's (``best/``) when the run kept one and ``DIR`` is its
newest checkpoint, else the checkpoint's own.

The job is rebuilt in this process from the options the checkpoint recorded (every other
option given here on top), on the CPU, without a cache: tables saved local or sharded
become local (the two load into each other), tables saved hybrid (dynamic ones among
them) go into an in-process store, whatever store and server count they trained on (the
ps format routes rows by id).
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from comm import LocalGroup
from hybridrec.cli.errors import reported_errors
from hybridrec.cli.evaluate import job_config, open_saved, saved_run_parser
from hybridrec.cli.options import ConfigError
from hybridrec.serving.export import export_dlrm
from hybridrec.serving.quantize import TABLE_DTYPES
from ps import InProcessStore

# Every table in this one process, read whole; nothing trains, so no cache or pipeline.
IN_PROCESS = dict(
    cache_rows=0, cache_fraction=0.0, cache_memory=0.0, sparse_pipeline="off", device="cpu",
    precision="fp32",
)  # fmt: skip


def in_process_placements(model_dir: Path) -> dict[str, Any]:
    """Placement options that hold every saved table in this process: tables saved hybrid
    stay hybrid (their rows load only into a store: here an in-process one), local and
    sharded ones become local (the two load into each other)."""
    doc = json.loads((model_dir / "model.json").read_text(encoding="utf-8"))
    saved = {t: p for c in doc.get("collections", []) for t, p in c["tables"].items()}
    hybrid = [f"{t}=hybrid" for t, p in saved.items() if p == "hybrid"]
    return {"placement": "local", "placement_of": hybrid}


def _own_parser() -> argparse.ArgumentParser:
    own = saved_run_parser("Export a saved DLRM run for serving (hybridrec.serving.Predictor)")
    own.add_argument("--out", help="the new folder to write the export into")
    own.add_argument(
        "--tables", choices=TABLE_DTYPES, default="fp32",
        help="row format of every table: fp32 (4 D bytes a row), fp16 (2 D), int8 (row-wise "
        "quantized, D + 8: uint8 codes, float32 scale and bias)",
    )  # fmt: skip
    return own


def main(argv: Sequence[str] | None = None) -> None:
    """Build the saved job in this process, load its model, write the export."""
    with reported_errors():
        own = _own_parser()
        args, run, rest = open_saved(own, argv, "export", ("dlrm",))
        folder, meta, model_dir = run.folder, run.meta, run.model
        config = meta.get("config") or {}
        overrides = IN_PROCESS | in_process_placements(model_dir)
        cls, cfg = job_config(run, rest, str(own.description), overrides)
        if args.out is None:
            raise ConfigError("--out is required (the new folder to write the export into)")
        job = cls(cfg, LocalGroup(), InProcessStore(), saved_config=config)
        try:
            job.load_saved(model_dir)  # settled: the store's rows are the ones exported
            # the encoders that made the run's batches (a tabular run's the saved ones)
            encoders = None if job.source.encoders is None else job.source.encoders.to_state()
            export_dlrm(
                job.model, args.out, tables=args.tables,
                job_config={k: v for k, v in config.items() if k != "data_encoders"},
                encoders=encoders,
                source={"checkpoint": str(folder), "model": str(model_dir),
                        "step": meta.get("step")},
            )  # fmt: skip
        finally:
            job.trainer.close()
        if cfg.verbose:
            step = meta.get("step")
            print(f"exported {model_dir} (step {step}) to {args.out}, {args.tables} tables")
