"""The DLRM job's step time on this machine, measured the way the validation reads a run.

    config, seconds = step_seconds(["--data", "synthetic", "--batch-size", "512"],
                                   steps=30, log_every=5, warm_steps=10)

The capacity planner's calibration (:mod:`hybridrec.plan.calibrate_job`) times the job
through this function alone.
"""

from __future__ import annotations

import json
import tempfile
from collections.abc import Sequence
from pathlib import Path

import comm
from hybridrec.dlrm.config import DLRMJobConfig
from hybridrec.dlrm.job import DLRMJob, parse_args
from ps import InProcessStore

__all__ = ["step_seconds"]


def step_seconds(
    options: Sequence[str], *, steps: int, log_every: int, warm_steps: int
) -> tuple[DLRMJobConfig, list[float]]:
    """``(config, seconds)``: the job's steady-state step seconds, one per logged block.

    Runs the DLRM job (:class:`hybridrec.dlrm.job.DLRMJob`) of the command-line
    ``options`` in this process, on one rank (a local group) and a fresh in-process
    store, for ``steps`` steps with a metrics line every ``log_every``, then reads the
    job's metrics file as the validation reads a real run's: each step line past
    ``warm_steps`` (at a multiple of ``log_every``) gives ``batch_size / samples_per_s``.
    The trainer's own loop is timed; the test split is not evaluated. ``config`` is the
    parsed job config (the options plus the ones this function adds: step count, the
    temporary metrics file, no progress bar, no printing), for planning the same job.
    """
    with tempfile.TemporaryDirectory() as tmp:
        metrics = Path(tmp) / "m.jsonl"
        cfg = parse_args([
            *options, "--max-steps", str(steps), "--log-every", str(log_every), "--no-progress",
            "--no-verbose", "--metrics-out", str(metrics),
        ])  # fmt: skip
        group = comm.init("local")
        try:
            job = DLRMJob(cfg, group, InProcessStore())
            job.trainer.fit()
            # the timed steps are done: the pipeline's thread ends with its last push (the
            # store is thrown away, so no cache flush and no test evaluation)
            job.model.embeddings.set_sparse_pipeline(False)
            job.trainer.close()
        finally:
            group.close()
        seconds = []
        for line in metrics.read_text(encoding="utf-8").splitlines():
            row = json.loads(line)
            if (
                row.get("kind") == "step"
                and row.get("step", 0) > warm_steps
                and row["step"] % log_every == 0
            ):
                seconds.append(cfg.batch_size / row["samples_per_s"])
    return cfg, seconds
