"""``InProcessStore(init_device=...)``: initial rows hashed by torch on a device, then
copied into the host tables, are the rows of the default numpy path bit for bit.

The reference is a store built without ``init_device`` (numpy on the host); rows are
compared as int32 bit patterns, so -0.0 against 0.0 would fail too. The chunked copy is
exercised with a chunk smaller than a table (several chunks, a short last one), and on
CUDA with the pinned double buffer."""

from __future__ import annotations

import pytest
import torch

import ps
from ps.local import table as local_table

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


def _specs() -> list[ps.TableSpec]:
    return [
        ps.TableSpec(name="default_init", num_rows=1000, dim=16, optimizer=ps.SGD(lr=0.1)),
        ps.TableSpec(
            name="seeded",
            num_rows=333,
            dim=5,
            optimizer=ps.RowWiseAdagrad(lr=0.1, initial_accumulator=0.25),
            init=ps.UniformInit(low=-0.3, high=0.7, seed=2**63 - 5),
        ),
        ps.TableSpec(
            name="constant",
            num_rows=257,
            dim=3,
            optimizer=ps.Adam(lr=0.01),
            init=ps.UniformInit(low=0.125, high=0.125),
        ),
        ps.TableSpec(
            name="negative_zero",
            num_rows=64,
            dim=2,
            optimizer=ps.SGD(lr=0.1),
            init=ps.UniformInit(low=-0.0, high=-0.0),
        ),
        ps.TableSpec(name="dynamic", num_rows=None, dim=4, optimizer=ps.SGD(lr=0.5)),
    ]


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int32)


def _assert_same_tables(got: ps.InProcessStore, want: ps.InProcessStore) -> None:
    for spec in _specs():
        n = spec.num_rows or 50
        ids = torch.arange(n)
        a, b = got.pull(spec.name, ids), want.pull(spec.name, ids)
        assert torch.equal(_bits(a.rows), _bits(b.rows)), spec.name
        assert torch.equal(a.clocks, b.clocks), spec.name
        assert torch.equal(_bits(got.state(spec.name, ids)), _bits(want.state(spec.name, ids)))


@pytest.mark.parametrize("device", DEVICES)
def test_tables_hashed_on_a_device_equal_the_host_tables(
    device: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Chunks of 7 x 16 = 112 elements: the 1000-row table takes 143 chunks, the last short.
    monkeypatch.setattr(local_table, "_DEVICE_INIT_ELEMENTS", {"cuda": 112})
    monkeypatch.setattr(local_table, "_HOST_INIT_ELEMENTS", 112)
    want, got = ps.InProcessStore(), ps.InProcessStore(init_device=device)
    assert got.init_device is not None and got.init_device.type == device
    for spec in _specs():
        want.create_table(spec)
        got.create_table(spec)
    _assert_same_tables(got, want)
    # The negative-zero constant keeps its sign bit (not calloc's +0.0).
    assert bool((_bits(got.pull("negative_zero", torch.arange(64)).rows) < 0).all())

    # Dynamic tables are unaffected: rows are created by pushes, from the same init.
    ids, grads = torch.tensor([7, -3, 2**40]), torch.ones(3, 4)
    for store in (want, got):
        store.push("dynamic", ids, grads)
        store.push("default_init", ids[:1], torch.ones(1, 16))
    _assert_same_tables(got, want)


@pytest.mark.parametrize("device", DEVICES)
def test_rows_a_checkpoint_lacks_are_hashed_on_the_device(
    device: str, tmp_path: object, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A load fills the rows its parts lack from the init: on the device, same bits."""
    from pathlib import Path

    from ps.checkpoint import TablePart, write_checkpoint

    monkeypatch.setattr(local_table, "_DEVICE_INIT_ELEMENTS", {"cuda": 48})
    monkeypatch.setattr(local_table, "_HOST_INIT_ELEMENTS", 48)
    spec = _specs()[0]
    have = torch.tensor([0, 5, 999])
    part = TablePart(
        ids=have,
        weights=torch.full((3, 16), 2.0),
        state=torch.zeros(3, 0),
        clocks=torch.tensor([1, 2, 3]),
    )
    path = Path(str(tmp_path)) / "ckpt"
    write_checkpoint(path, [(spec, [part])], writer="test")
    want, got = ps.InProcessStore(), ps.InProcessStore(init_device=device)
    want.load(path)
    got.load(path)
    ids = torch.arange(1000)
    assert torch.equal(_bits(got.pull(spec.name, ids).rows), _bits(want.pull(spec.name, ids).rows))
    assert torch.equal(got.pull(spec.name, have).rows, torch.full((3, 16), 2.0))


def test_bad_init_device_is_an_error_naming_it() -> None:
    with pytest.raises(ValueError, match="init_device='gpu'"):
        ps.InProcessStore(init_device="gpu")
    with pytest.raises(TypeError, match="init_device must be"):
        ps.InProcessStore(init_device=0)  # type: ignore[arg-type]
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="init_device='cuda'.*no CUDA"):
            ps.InProcessStore(init_device="cuda")
