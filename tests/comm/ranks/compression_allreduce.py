"""Rank script: compressed_allreduce equals the average of every rank's replayed encoding.

For each codec, every rank averages two gradient buffers ("w", "b") over three steps,
both allreduces in flight at once. Each rank then rebuilds every rank's codec from
the RNG policy (``get_codec(name, seed=SEED, rank=r)``), replays rank r's encodings of
rank r's gradients in the same order, decodes them (the same fp32 operations as the
collective's, so the same bits) and averages in float64: the collective's fp32 sum of
``size`` decoded vectors and its division round at most ``size + 1`` times, so it must
match within :func:`tests.support.tolerance.sum_tol` of that many terms of the vectors'
magnitude. Also: stats count this rank's bytes, and with validation on a NaN on one rank
raises ValueError on every rank and leaves the group usable.

Backend from ``HYBRIDREC_TEST_BACKEND``. Prints ``rank R/N: ok compression``.
"""

from __future__ import annotations

import os

import torch

import comm
from comm import ProcessGroup
from comm.compression import CODECS, compressed_allreduce, compressed_allreduce_async, get_codec
from tests.support.tolerance import assert_close, sum_tol

SEED = 17
STEPS = 3
SIZES = {"w": 1003, "b": 10}


def gradient(rank: int, step: int, key: str) -> torch.Tensor:
    gen = torch.Generator().manual_seed(1000 * rank + 10 * step + len(key) + SIZES[key])
    return torch.randn(SIZES[key], generator=gen) * (1.0 + rank)  # ranks differ in scale


def check_codec(group: ProcessGroup, name: str) -> None:
    kwargs = {"ratio": 0.05} if name == "topk" else {}
    codec = get_codec(name, seed=SEED, **kwargs)
    replays = [get_codec(name, seed=SEED, rank=r, **kwargs) for r in range(group.size)]
    for step in range(STEPS):
        flats = {key: gradient(group.rank, step, key) for key in SIZES}
        handles = {k: compressed_allreduce_async(group, f, codec, k) for k, f in flats.items()}
        for key, h in handles.items():  # waited after both were issued
            got = h.wait()
            assert got is flats[key]
            expect = torch.zeros(SIZES[key], dtype=torch.float64)
            magnitude = torch.zeros(SIZES[key], dtype=torch.float64)  # sum_r |decoded_r| / size
            for r, rc in enumerate(replays):
                enc = rc.encode(gradient(r, step, key), key=key)
                decoded = rc.decode(enc, SIZES[key]).double()
                expect += decoded
                magnitude += decoded.abs()
            expect /= group.size
            magnitude /= group.size
            tol = sum_tol(torch.float32, group.size + 1, float(magnitude.max()))
            assert_close(got, expect, atol=tol, what=f"{name} {key} step {step}",
                         why="fp32 sum of size decoded vectors, then a division")  # fmt: skip
    wire = STEPS * sum(codec.expected_wire_bytes(n) for n in SIZES.values())
    assert codec.stats["bytes_on_wire"] == wire, (name, codec.stats, wire)
    assert codec.stats["bytes_in"] == STEPS * 4 * sum(SIZES.values()), (name, codec.stats)


def check_bad_input_raises_everywhere(group: ProcessGroup) -> None:
    flat = torch.ones(8)
    if group.rank == group.size - 1:
        flat[3] = float("nan")
    try:
        compressed_allreduce(group, flat, get_codec("natural"), key="bucket7")
    except ValueError as e:
        assert "'bucket7'" in str(e), e
    else:
        raise AssertionError("a NaN on the last rank did not raise")
    # Nothing moved: the group still works.
    t = torch.full((3,), float(group.rank))
    group.allreduce(t, op="sum")
    assert t.tolist() == [float(sum(range(group.size)))] * 3


def main() -> None:
    backend = os.environ.get("HYBRIDREC_TEST_BACKEND", "auto")
    group = comm.init(backend, timeout_s=60.0)
    try:
        for name in CODECS:
            check_codec(group, name)
        check_bad_input_raises_everywhere(group)
        group.barrier()
    finally:
        group.close()
    print(f"rank {group.rank}/{group.size}: ok compression", flush=True)


if __name__ == "__main__":
    main()
