"""Group requests over the MPI store under real ``mpirun`` (one worker, 1, 2 and 4
servers): in bulk, against the same requests cut by table on twin tables, bit for bit
(``tests/ps/ranks/ps_mpi_groups.py`` says why they must agree exactly)."""

from __future__ import annotations

import re

import pytest

from multiproc import run_ranks


@pytest.mark.timeout(150)
@pytest.mark.parametrize("servers", [1, 2, 4])
def test_group_requests_in_bulk_equal_them_cut_by_table(servers: int) -> None:
    outs = run_ranks("ps_mpi_groups.py", 1 + servers, "mpi", ["--servers", str(servers)],
                     timeout=120)  # fmt: skip
    text = "\n".join(outs)
    assert re.findall(r"rank 0: ok worker \d+ checks", text), outs
    assert len(re.findall(r"rank \d+: ok server", text)) == servers, outs
