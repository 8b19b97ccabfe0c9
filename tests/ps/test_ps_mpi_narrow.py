"""fp16 and bf16 tables over the MPI store: narrow rows and gradients on the wire.

The wire layout is checked here without MPI (width words, 16-bit values two per data
word, exact round trips); the store under real ``mpirun`` jobs by the rank script
``tests/ps/ranks/ps_mpi_narrow.py``, which compares every table bit for bit with an
in-process store fed the same gradients rounded to the table's type (what the wire
carries), at 1 and 2 servers and with 2 workers at once.
"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest
import torch

from multiproc import run_ranks
from ps.mpi import wire

SCRIPT = "ps_mpi_narrow.py"


def _oks(outs: list[str], role: str) -> list[int]:
    return sorted(int(r) for r in re.findall(rf"rank (\d+): ok {role}", "\n".join(outs)))


@pytest.mark.timeout(10)
def test_width_words_name_the_row_type() -> None:
    """fp32's width word is the width itself (the C passes compare it with the table's
    dim); a narrow type sets the high bits; an unknown code is refused naming it."""
    assert wire.width_word(64, "fp32") == 64
    words = np.array([wire.width_word(d, t) for d, t in [(7, "fp16"), (64, "bf16"), (3, "fp32")]])
    dims, types = wire.split_widths(words)
    assert dims.tolist() == [7, 64, 3] and types == ["fp16", "bf16", "fp32"]
    with pytest.raises(ValueError, match="row type 5; expected one of 0 \\(fp32\\)"):
        wire.split_widths(np.array([8 | (5 << 32)]))
    dims, types = wire.split_widths(np.array([-8]))  # a bad width, for the caller's check
    assert dims.tolist() == [-8] and types == ["fp32"]


@pytest.mark.timeout(10)
@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
@pytest.mark.parametrize("count", [0, 1, 7, 64])
def test_narrow_values_travel_two_per_word_and_widen_exactly(dtype: str, count: int) -> None:
    """A narrow part takes half the words (an odd count padded by a half word); unpacked
    it is the widened values bit for bit, and float32 values travel as they are."""
    torch_dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}[dtype]
    values = (torch.randn(count, generator=torch.Generator().manual_seed(count)) * 100).to(
        torch_dtype
    )
    words = wire.pack_values(values)
    assert words.dtype == np.float32 and words.size == wire.value_words(count, dtype)
    assert words.size == (count + 1) // 2
    # a part is followed by the next: unpacking reads only its own words
    tail = np.full(3, 7.0, dtype=np.float32)
    back = wire.unpack_values(np.concatenate([words, tail]), count, dtype)
    assert back.dtype == torch.float32
    assert torch.equal(back.view(torch.int32), values.to(torch.float32).view(torch.int32))
    wide = torch.randn(count)
    assert wire.value_words(count, "fp32") == count
    assert torch.equal(wire.unpack_values(wire.pack_values(wide), count, "fp32"), wide)


@pytest.mark.timeout(120)
def test_one_server_narrow_tables_match_inprocess(tmp_path: Path) -> None:
    """1 worker + 1 server: every optimizer, fixed and dynamic, single and batched
    requests, range errors, server-side refusals, a checkpoint round trip, and a worker of
    another protocol version refused with the clear message."""
    args = ["--servers", "1", "--dir", str(tmp_path), "--protocol"]
    outs = run_ranks(SCRIPT, 2, "mpi", args, timeout=100)
    assert _oks(outs, "worker") == [0] and _oks(outs, "server") == [1], outs


@pytest.mark.timeout(120)
def test_two_servers_narrow_tables_match_inprocess(tmp_path: Path) -> None:
    """1 worker + 2 servers: every push and pull split over two shards."""
    outs = run_ranks(SCRIPT, 3, "mpi", ["--servers", "2", "--dir", str(tmp_path)], timeout=100)
    assert _oks(outs, "worker") == [0] and _oks(outs, "server") == [1, 2], outs


@pytest.mark.timeout(150)
def test_two_workers_two_servers_narrow_tables_match_inprocess(tmp_path: Path) -> None:
    """2 workers + 2 servers: each worker its share of the tables, at the same time."""
    outs = run_ranks(SCRIPT, 4, "mpi", ["--servers", "2", "--dir", str(tmp_path)], timeout=130)
    assert _oks(outs, "worker") == [0, 1] and _oks(outs, "server") == [2, 3], outs
