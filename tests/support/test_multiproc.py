"""The multi-rank harness reruns a torch run once only for the known teardown abort."""

from __future__ import annotations

import pytest

from multiproc import _exit_abort_only

pytestmark = pytest.mark.timeout(30)

ABORT = (
    "gloo x2 s.py: exit codes [-6, 0]\n---- rank/process 0 (exit -6) ----\nrank 0/2: ok\n"
    "terminate called without an active exception\n\n---- rank/process 1 (exit 0) ----\n"
    "rank 1/2: ok\n"
)


def test_teardown_abort_after_the_work_is_recognised() -> None:
    assert _exit_abort_only(ABORT)


@pytest.mark.parametrize(
    "report",
    [
        ABORT.replace("rank 0/2: ok\n", "Traceback (most recent call last):\n"),  # it failed
        ABORT.replace("(exit 0)", "(exit 1)"),  # another rank failed
        ABORT.replace("(exit -6)", "(exit -11)"),  # another signal
        ABORT.replace("terminate called", "rank 0 said: terminate called") + "more\n",
        "gloo x2 s.py: timed out after 3 s\n",
    ],
)
def test_every_other_failure_is_not(report: str) -> None:
    assert not _exit_abort_only(report)
