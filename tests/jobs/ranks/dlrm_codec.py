"""Rank script: DLRM on MovieLens-100k with each gradient codec, held-out AUC vs uncompressed.

Usage: ``mpirun -n 2 python tests/jobs/ranks/dlrm_codec.py [CODEC ...]`` (default: all codecs
and the ``frozen-dense`` control).

For each codec the example's ``train()`` runs one epoch with ``compression=<codec>``:
the dense part trains under ``dense.DataParallel`` whose (single, 6417-value) bucket is
averaged through that codec; embedding rows are synchronized by the collection itself,
uncompressed. The control ``frozen-dense`` is uncompressed with a dense learning rate
of 1e-20, i.e. dense layers that never move.

Rank 0 prints one line ``RESULT {json}``: per codec the test AUC, log loss, steps and
bytes on the wire per step for the dense gradient (this rank's encoding).
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys

import torch

import comm
from comm.compression import CODECS
from hybridrec.dlrm.config import DLRMJobConfig
from hybridrec.dlrm.job import train

# The dot-interaction DLRM (dim 16, top MLP 64-32-1: 6417 dense parameters), not
# MovieLens's default model: the byte counts and the measured AUCs are for this one.
CFG = DLRMJobConfig(data="movielens", epochs=1, verbose=False, progress=False, log_every=10_000,
                  interaction="dot", dim=16, top_mlp=[64, 32, 1])  # fmt: skip
# Not a codec: dense layers that never train. Shows how much of the AUC the dense
# gradients carry, i.e. that "within 0.01 of uncompressed" has teeth.
CONTROL = "frozen-dense"


def run(group: comm.ProcessGroup, name: str) -> dict[str, float]:
    if name == CONTROL:
        cfg = dataclasses.replace(CFG, lr=1e-20)
    else:
        cfg = dataclasses.replace(CFG, compression=name)
    metrics = train(cfg, group)
    out = {
        "test_auc": metrics["test_auc"],
        "test_logloss": metrics["test_logloss"],
        "steps": metrics["steps"],
        "train_seconds": metrics["train_seconds"],
    }
    stats = metrics.get("codec_stats")
    if stats is not None:
        calls = max(stats["calls"], 1)
        out["dense_params"] = stats["bytes_in"] / calls / 4
        out["bytes_in_per_step"] = stats["bytes_in"] / calls
        out["bytes_on_wire_per_step"] = stats["bytes_on_wire"] / calls
    return out


def main() -> None:
    names = sys.argv[1:] or [*CODECS, CONTROL]
    if names[0] != "none":
        names = ["none", *[n for n in names if n != "none"]]
    group = comm.init(os.environ.get("HYBRIDREC_TEST_BACKEND", "auto"), validate=False)
    torch.set_num_threads(1)
    try:
        results = {name: run(group, name) for name in names}
    finally:
        group.close()
    if group.rank == 0:
        print("RESULT " + json.dumps({"world_size": group.size, "codecs": results}), flush=True)


if __name__ == "__main__":
    main()
