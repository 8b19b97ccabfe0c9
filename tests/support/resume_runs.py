"""What the resume tests share: a small DLRM run's options, and the check that a run
stopped and resumed equals the run left alone, step by step and bit for bit."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from tolerance import assert_close, sum_tol

DLRM = dict(
    data="synthetic", synthetic_samples=2_000, synthetic_rows=200, batch_size=100, epochs=2,
    dim=8, bottom_mlp=[16, 8], top_mlp=[16, 1], verbose=False, progress=False, log_every=1,
)  # fmt: skip


# A resume with these model options changed is refused, naming them.
SMALLER = dict(dim=4, bottom_mlp=[16, 4])


def losses(path: Path, kind: str = "step", key: str = "loss") -> dict[int, float]:
    """``{step: loss}`` of the step lines; with ``kind="epoch"``, ``{epoch: train loss}``
    (the last line of each epoch: a resumed run writes its epoch's line again)."""
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    at = "step" if kind == "step" else "epoch"
    return {r[at]: r[key] for r in rows if r["kind"] == kind}


def interrupted_equals_uninterrupted(
    run: Any, cfg: type, base: dict[str, Any], tmp: Path, stop: dict[str, Any],
    changed: dict[str, Any],
) -> None:  # fmt: skip
    """Also: the epoch losses span the resume, rates count the resumed run's steps, a
    finished run stays finished, and a resume with ``changed`` shapes names them."""
    full, part, ck = tmp / "full.jsonl", tmp / "part.jsonl", tmp / "b"
    run(cfg(**base, metrics_out=str(full), checkpoint_dir=str(tmp / "a"), checkpoint_every=10))
    first = run(cfg(**{**base, **stop}, metrics_out=str(part), checkpoint_dir=str(ck)))
    resumed = run(cfg(**base, metrics_out=str(part), checkpoint_dir=str(ck), resume=True))
    want, got = losses(full), losses(part)
    assert sorted(got) == sorted(want) and len(want) > 20
    for step in want:  # bit for bit (the metrics file's floats read back to the same bits)
        assert got[step] == want[step], (step, got[step], want[step])
    # The epoch losses too: the checkpoint keeps the float64 loss sums exactly.
    assert losses(part, "epoch", "train_loss") == losses(full, "epoch", "train_loss")

    assert resumed["steps_run"] == resumed["steps"] - first["steps"] > 0
    rate, per_step = (("samples_per_s", base["batch_size"]) if "samples_per_s" in resumed else
                      ("tokens_per_s", base["batch_size"] * base["block_size"]))  # fmt: skip
    want_rate = resumed["steps_run"] * per_step / resumed["train_seconds"]
    # The job's rate is the same quotient, with the block size multiplied in before or after
    # the division: two float64 roundings each way.
    tol = sum_tol(torch.float64, 2, want_rate)
    assert_close(resumed[rate], want_rate, atol=tol, what=rate, why="two roundings each way")

    listing = sorted((p.name, p.stat().st_mtime_ns) for p in ck.iterdir())
    again = run(cfg(**base, checkpoint_dir=str(ck), resume=True))
    assert again["already_finished"] and again["steps_run"] == 0
    assert again["steps"] == resumed["steps"]
    assert sorted((p.name, p.stat().st_mtime_ns) for p in ck.iterdir()) == listing

    named = "; ".join(f"{k}: .* in the checkpoint, .* now" for k in changed)
    with pytest.raises(ValueError, match=f"the model options differ: {named}"):
        run(cfg(**{**base, **changed}, checkpoint_dir=str(ck), resume=True))
