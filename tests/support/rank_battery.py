"""One launch per (backend, ranks) for the embedding and dense multi-rank checks.

Starting ranks costs more than most checks (every rank imports torch; 4 ranks share 2
cores here), so the rank scripts of test_embedding_sharded, test_embedding_data_parallel,
test_dense_data_parallel, test_dense_zero, test_dense_zero3, test_dense_tensor_parallel,
test_dense_pipeline and test_comm_device (its CPU checks) run together through
``tests/support/ranks/battery.py``: one launch per (backend, ranks) for the whole session,
started by whichever test needs it first (``RankBattery.output``). Each test then looks
for its own "ok" lines in that output. A failing check fails its own test and no other:
its ranks may be stuck in a collective that can never complete, so the launch ends
there, its failure report is kept, and the checks after it run in a new launch (one
more rank start per failed check). A launch that fails before its first check ran
(the ranks did not start) is not repeated: every check left fails with its report.

:func:`plan` lists the checks of every launch: the same (backend, ranks) cases and the same
arguments as when each script had its own launches.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

from multiproc import run_ranks

EMBEDDING_CASES = [(b, n) for b in ("mpi", "gloo") for n in (1, 2, 4)]
DENSE_CASES = [("mpi", 1), ("mpi", 2), ("gloo", 2), ("mpi", 4), ("gloo", 4)]
CODECS = ["none", "fp16", "bf16", "terngrad", "natural", "topk"]
# dense_zero's files saved at 2 ranks (gloo) are loaded at 1 (mpirun) and 4 (gloo).
ZERO_SAVE = ("gloo", 2)
ZERO_LOADS = [("mpi", 1), ("gloo", 4)]
PIPELINE_CASES = [c for c in DENSE_CASES if c[1] > 1]  # the world is the pipeline
# Device checks on CPU tensors through the staging of device tensors (test_comm_device).
DEVICE_CASES = [("mpi", 2), ("gloo", 2)]
# Seconds a launch may take: ranks start, then each check (several steps, 4 ranks on 2 cores).
START_S, PER_CHECK_S = 60.0, 60.0
# pytest timeout of a test that reads a launch: the dense_zero loads wait for the save's launch.
MOST_CHECKS = 11  # the longest: 3 embedding, dp, codecs, zero, zero3, tp, pp, 2 device
BATTERY_TIMEOUT_S = int(2 * (START_S + MOST_CHECKS * PER_CHECK_S)) + 60


def plan(backend: str, nprocs: int, workdir: Path) -> list[list[str]]:
    """The checks of the (backend, nprocs) launch, each ``[script, arg, ...]``; creates
    the folders under ``workdir`` that they write to."""
    case = (backend, nprocs)
    missing_dir, zero_dir = workdir / f"missing-{backend}-{nprocs}", workdir / "zero"
    missing_dir.mkdir(parents=True, exist_ok=True)
    zero_dir.mkdir(parents=True, exist_ok=True)
    checks: list[list[str]] = []
    if case in EMBEDDING_CASES:
        checks.append(["embedding_sharded", "all"])
        checks.append(["embedding_dp"])
        checks.append(["embedding_dp_missing", str(missing_dir)])
    if case in DENSE_CASES:
        checks.append(["dense_dp", "main"])
        checks.append(["dense_zero", "train"])
        zero3_dir = workdir / f"zero3-{backend}-{nprocs}"
        zero3_dir.mkdir(parents=True, exist_ok=True)
        checks.append(["dense_zero3", "all", str(zero3_dir)])
    if case == ("mpi", 2):
        checks.append(["dense_dp", "codec", *CODECS])
    if case == ZERO_SAVE:
        checks.append(["dense_zero", "save", str(zero_dir)])
    if case in ZERO_LOADS:
        checks.append(["dense_zero", "load", str(zero_dir)])
    if case in DENSE_CASES:
        checks.append(["dense_tp", "all"])
    if case in PIPELINE_CASES:
        checks.append(["dense_pp"])
    if case in DEVICE_CASES:
        checks.append(["comm_device", "cpu"])
        checks.append(["dense_device", "cpu"])
    return checks


class RankBattery:
    """Runs each (backend, ranks) launch of :func:`plan` at most once; files under ``workdir``."""

    def __init__(
        self, workdir: Path, checks: Callable[[str, int, Path], list[list[str]]] = plan
    ) -> None:
        self.workdir = workdir
        self._plan = checks  # the checks of each launch (tests of the battery pass others)
        self._outputs: dict[tuple[str, int], str] = {}

    def output(self, backend: str, nprocs: int) -> str:
        """Every rank's output of the (backend, nprocs) launches (run now if not run yet),
        each failed launch followed by its failure report."""
        key = (backend, nprocs)
        if key in ZERO_LOADS:
            self.output(*ZERO_SAVE)  # the files the loads read
        if key not in self._outputs:
            checks = self._plan(backend, nprocs, self.workdir)
            if not checks:
                raise ValueError(f"no multi-rank checks planned for {backend} x{nprocs}")
            texts: list[str] = []
            while checks:
                timeout = START_S + PER_CHECK_S * len(checks)
                args = [json.dumps(c) for c in checks]
                try:
                    texts.append("\n".join(run_ranks("battery.py", nprocs, backend, args, timeout)))
                    break
                except AssertionError as err:
                    report = str(err)
                failed = _first_unfinished(report, checks, nprocs)
                what = " ".join(checks[failed])
                texts.append(f"{report}\n==== the launch failed in check {what!r} (report above)")
                if f"battery start {what}" not in report:
                    break  # the ranks never reached it: a relaunch would fail the same way
                checks = checks[failed + 1 :]
            self._outputs[key] = "\n".join(texts)
        return self._outputs[key]

    def expect(self, backend: str, nprocs: int, lines: list[str]) -> None:
        """Fail with the launch's whole output unless every one of ``lines`` is in it."""
        text = self.output(backend, nprocs)
        missing = [line for line in lines if line not in text]
        assert not missing, f"missing from {backend} x{nprocs}: {missing}\n{text}"


def _first_unfinished(report: str, checks: list[list[str]], nprocs: int) -> int:
    """The index of the first of ``checks`` that not every rank finished in ``report``."""
    for i, check in enumerate(checks):
        what = " ".join(check)
        done = [f"rank {r}/{nprocs}: battery done {what} (" for r in range(nprocs)]
        if not all(line in report for line in done):
            return i
    return len(checks) - 1  # every check finished, then the launch failed: blame the last
