"""``--keep-freed-mb``: the C library's allocator keeps a step's freed buffers for the next
step (:mod:`hybridrec.launch.allocator`). Measured in fresh processes (the setting is
process-wide): a loop that allocates and frees tensors of growing sizes, as a training
step's pulled rows and pooled outputs are, takes its pages from the kernel again every
time under glibc's defaults and reuses them once the allocator keeps freed memory."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from hybridrec.dlrm.config import DLRMJobConfig
from hybridrec.launch import roles
from hybridrec.launch.allocator import keep_freed_memory

pytestmark = pytest.mark.timeout(120)

ROOT = Path(__file__).resolve().parents[2]

# 40 steps, each filling a fresh float32 tensor of 8 MiB plus a little more than the last
# (a batch's [U, D] rows change size with U), then freeing it; the minor page faults of
# the last 30 steps, after a warm-up.
LOOP = """
import json, resource, sys
import torch
from hybridrec.launch.allocator import keep_freed_memory
took = keep_freed_memory(int(sys.argv[1]))
def step(i):
    torch.empty((8 << 20) // 4 + i * 4096, dtype=torch.float32).fill_(1.0)
for i in range(10):
    step(i)
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for i in range(10, 40):
    step(i)
faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
print(json.dumps({"took": took, "faults_per_step": faults / 30}))
"""


def _faults(limit_mb: int) -> dict[str, float]:
    out = subprocess.run(
        [sys.executable, "-c", LOOP, str(limit_mb)], cwd=ROOT, capture_output=True,
        text=True, timeout=100, check=True,
    )  # fmt: skip
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_kept_memory_takes_no_pages_from_the_kernel_again() -> None:
    default, kept = _faults(0), _faults(512)
    if not kept["took"]:
        pytest.skip("the C library here is not glibc (no mallopt): nothing to keep")
    # Under the defaults each 8 MiB block is a fresh mmap: ~2 k pages faulted a step.
    assert default["faults_per_step"] > 1000, default
    assert kept["faults_per_step"] < 20, kept


def test_zero_changes_nothing_and_bad_limits_are_named() -> None:
    assert keep_freed_memory(0) is False
    for bad in (-1, 1.5, True):
        with pytest.raises(ValueError, match=rf"limit_mb must be an int >= 0, got {bad!r}"):
            keep_freed_memory(bad)  # type: ignore[arg-type]


def test_the_jobs_option_reaches_the_launch(monkeypatch: pytest.MonkeyPatch) -> None:
    asked: list[int] = []
    monkeypatch.setattr(roles, "keep_freed_memory", asked.append)
    assert DLRMJobConfig().keep_freed_mb == 512
    with roles.Launch.for_run(DLRMJobConfig(backend="local", keep_freed_mb=64, batch_size=4)):
        pass
    with roles.Launch.for_run(DLRMJobConfig(backend="local", keep_freed_mb=0, batch_size=4)):
        pass
    assert asked == [64, 0]
    with pytest.raises(ValueError, match="keep_freed_mb must be >= 0, got -1"):
        DLRMJobConfig(keep_freed_mb=-1)
