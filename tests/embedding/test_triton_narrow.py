"""The Triton kernels on fp16 and bf16 rows, in Triton's CPU interpreter.

The cases live in ``tests/support/triton_narrow_cases.py`` and run in ONE subprocess with
``TRITON_INTERPRET=1`` (Triton reads it when a kernel is defined, so it cannot be switched
on inside this pytest process); each case is one test here. The narrow pool and update
are compared bit for bit with the same kernels on the rows widened to float32 (then
``ps.rounding.round_to`` for an update). The kernel variants with rounding are compiled
for sm_90 by ``test_triton_kernels.py::test_kernels_compile_for_sm90`` (they are in
``triton_cases.COMPILE_VARIANTS``). Without triton the cases are skipped, unless
``HYBRIDREC_REQUIRE_TRITON=1``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import triton_narrow_cases
from embedding.kernels import triton_available
from multiproc import rank_env

SCRIPT = Path(__file__).resolve().parents[1] / "support" / "triton_narrow_cases.py"
ROOT = SCRIPT.parents[2]


def _require_triton() -> None:
    if triton_available():
        return
    if os.environ.get("HYBRIDREC_REQUIRE_TRITON") == "1":
        pytest.fail("HYBRIDREC_REQUIRE_TRITON=1 but triton does not import (pip install triton)")
    pytest.skip("triton is not installed (pip install triton; the test extra has it)")


def _run_cases(device: str) -> dict[str, dict]:
    env = rank_env(pythonpath=(SCRIPT.parent,))
    env.pop("TRITON_INTERPRET", None)  # the script sets it for --device cpu
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--device", device],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=240,
    )
    results = {}
    for line in proc.stdout.splitlines():
        if line.startswith("{"):
            r = json.loads(line)
            results[r["case"]] = r
    if not results:
        pytest.fail(
            f"triton_narrow_cases.py gave no results (rc {proc.returncode}):\n{proc.stderr}"
        )
    return results


@pytest.fixture(scope="module")
def case_results() -> dict[str, dict]:
    _require_triton()
    return _run_cases(os.environ.get("HYBRIDREC_TRITON_DEVICE", "cpu"))


@pytest.mark.numerics
@pytest.mark.timeout(280)
@pytest.mark.parametrize("case", sorted(triton_narrow_cases.CASES))
def test_triton_narrow_case(case_results: dict[str, dict], case: str) -> None:
    assert case in case_results, f"case {case} did not run; got {sorted(case_results)}"
    r = case_results[case]
    assert r["ok"], r["error"]


@pytest.mark.gpu
@pytest.mark.timeout(280)
def test_triton_narrow_cases_on_cuda() -> None:
    _require_triton()
    results = _run_cases("cuda")
    failed = {name: r["error"] for name, r in results.items() if not r["ok"]}
    assert not failed, "\n".join(f"{n}:\n{e}" for n, e in failed.items())
