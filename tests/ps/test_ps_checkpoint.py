"""Checkpoints: round trips, atomic replacement (crashes mid-save), resharding, no pickle."""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import ps
from multiproc import rank_env
from ps import checkpoint as ckpt

pytestmark = pytest.mark.timeout(60)

DIM = 4
ROOT = Path(__file__).resolve().parents[2]


def _filled_store() -> ps.InProcessStore:
    """A fixed Adam table and a dynamic FTRL table with LRU, with some history."""
    store = ps.InProcessStore()
    store.create_table(ps.TableSpec(name="fixed", num_rows=30, dim=DIM, optimizer=ps.Adam(lr=0.1)))
    store.create_table(
        ps.TableSpec(
            name="dyn/üñí code",  # any table name: folders are numbered, not named
            num_rows=None,
            dim=DIM,
            optimizer=ps.FTRL(alpha=0.2, l1=0.01),
            capacity=100,
            nan_policy="skip",
        )
    )
    gen = torch.Generator().manual_seed(0)
    for _ in range(4):
        ids = torch.randint(0, 30, (20,), generator=gen)
        store.push("fixed", ids, torch.randn(20, DIM, generator=gen))
        dids = torch.randint(-(10**15), 10**15, (40,), generator=gen)
        store.push("dyn/üñí code", dids, torch.randn(40, DIM, generator=gen))
    return store


def _dump(store: ps.Store) -> dict[str, tuple[torch.Tensor, ...]]:
    """Every table's (ids, rows, state, clocks), ids sorted (dynamic: the live rows)."""
    out = {}
    for name in store.tables():
        spec = store.spec(name)
        if spec.num_rows is not None:
            ids = torch.arange(spec.num_rows)
        else:  # the ids that exist: clocks > 0 among everything ever pushed is not knowable
            ids = _dyn_ids(store, name)
        got = store.pull(name, ids)
        out[name] = (ids, got.rows, store.state(name, ids), got.clocks)
    return out


def _dyn_ids(store: ps.Store, name: str) -> torch.Tensor:
    # The in-process store lists its live ids through a checkpoint part.
    table = store._tables[name]  # type: ignore[attr-defined]
    parts = list(table.parts())
    return torch.cat([p.ids for p in parts])


def _assert_same(a: ps.Store, b: ps.Store) -> None:
    da, db = _dump(a), _dump(b)
    assert list(da) == list(db)
    for name in da:
        assert a.spec(name) == b.spec(name)
        for x, y in zip(da[name], db[name], strict=True):
            assert torch.equal(x, y), name


def test_round_trip_fixed_and_dynamic(tmp_path: Path) -> None:
    store = _filled_store()
    path = tmp_path / "ck"
    store.save(path)
    manifest = json.loads((path / "manifest.json").read_text())
    assert manifest["format"] == "hybridrec-ps/1"
    assert [t["spec"]["name"] for t in manifest["tables"]] == ["fixed", "dyn/üñí code"]
    assert sorted(os.listdir(tmp_path)) == ["ck"]  # no temporary folders left
    loaded = ps.InProcessStore()
    loaded.load(path)
    _assert_same(store, loaded)
    # The loaded store keeps training identically.
    g = torch.randn(3, DIM)
    for s in (store, loaded):
        s.push("fixed", torch.tensor([1, 2, 1]), g)
    _assert_same(store, loaded)
    # Saving again over the same path replaces it atomically.
    store.save(path)
    again = ps.InProcessStore()
    again.load(path)
    _assert_same(store, again)
    assert sorted(os.listdir(tmp_path)) == ["ck"]


def test_load_replaces_named_tables_and_keeps_others(tmp_path: Path) -> None:
    store = _filled_store()
    store.save(tmp_path / "ck")
    other = ps.InProcessStore()
    other.create_table(ps.TableSpec(name="fixed", num_rows=3, dim=2, optimizer=ps.SGD(lr=1.0)))
    other.create_table(ps.TableSpec(name="mine", num_rows=3, dim=2, optimizer=ps.SGD(lr=1.0)))
    mine = other.pull("mine", torch.arange(3)).rows
    other.load(tmp_path / "ck")
    assert other.tables() == ["fixed", "mine", "dyn/üñí code"]
    assert other.spec("fixed") == store.spec("fixed")  # replaced, spec included
    assert torch.equal(other.pull("mine", torch.arange(3)).rows, mine)


def test_resharded_parts_load_into_one_table(tmp_path: Path) -> None:
    # Parts as a 3-shard store would write them: rows routed by id, any order.
    store = _filled_store()
    spec = store.spec("fixed")
    full = _dump(store)["fixed"]
    whole = ckpt.TablePart(ids=full[0], weights=full[1], state=full[2], clocks=full[3])
    shards = ps.shard_of(whole.ids, 3)
    parts = [whole.select(torch.nonzero(shards == s).squeeze(1).flip(0)) for s in range(3)]
    ckpt.write_checkpoint(tmp_path / "ck", [(spec, parts)], writer="test")
    loaded = ps.InProcessStore()
    loaded.load(tmp_path / "ck")
    got = loaded.pull("fixed", whole.ids)
    assert torch.equal(got.rows, whole.weights) and torch.equal(got.clocks, whole.clocks)
    assert torch.equal(loaded.state("fixed", whole.ids), whole.state)
    # The same through the stepwise API that several writer processes would use.
    tmp = ckpt.begin_checkpoint(tmp_path / "ck2")
    entries = [ckpt.write_part(tmp, 0, f"s{s:04d}-00000", p) for s, p in enumerate(parts)]
    ckpt.finish_checkpoint(tmp, tmp_path / "ck2", [(spec, entries)])
    assert torch.equal(
        ckpt.read_checkpoint(tmp_path / "ck2").read_table("fixed").ids.sort().values, whole.ids
    )


def _part(ids: list[int], spec: ps.TableSpec) -> ckpt.TablePart:
    n = len(ids)
    return ckpt.TablePart(
        ids=torch.tensor(ids, dtype=torch.int64),
        weights=torch.zeros(n, spec.dim),
        state=torch.zeros(n, spec.state_dim),
        clocks=torch.ones(n, dtype=torch.int64),
    )


def test_bad_checkpoints_are_refused_and_change_nothing(tmp_path: Path) -> None:
    store = _filled_store()
    before = _dump(store)
    spec = store.spec("fixed")
    dup = tmp_path / "dup"
    ckpt.write_checkpoint(dup, [(spec, [_part([1, 2], spec), _part([3, 2], spec)])])
    with pytest.raises(ValueError, match=r"table 'fixed' .*row id 2 appears more than once"):
        store.load(dup)
    rng = tmp_path / "range"
    with pytest.raises(ValueError, match=r"table 'fixed' \(part 0\): checkpoint row id 30 is out"):
        ckpt.write_checkpoint(rng, [(spec, [_part([30], spec)])])
    assert not rng.exists() and sorted(os.listdir(tmp_path)) == ["dup"]
    wide = ps.TableSpec(name="fixed", num_rows=30, dim=DIM + 1, optimizer=spec.optimizer)
    with pytest.raises(ValueError, match=r"expected widths dim=5 and state_dim=11"):
        ckpt.write_checkpoint(tmp_path / "w", [(wide, [_part([1], spec)])])
    bad_format = tmp_path / "fmt"
    store.save(bad_format)
    m = json.loads((bad_format / "manifest.json").read_text())
    m["format"] = "hybridrec-ps/0"
    (bad_format / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(ValueError, match=r"format is 'hybridrec-ps/0', expected 'hybridrec-ps/1'"):
        store.load(bad_format)
    with pytest.raises(FileNotFoundError, match=r"no manifest.json"):
        store.load(tmp_path / "nothing")
    for name, got in _dump(store).items():
        for x, y in zip(before[name], got, strict=True):
            assert torch.equal(x, y)


class _Boom:
    """Unpickling this would create a marker file: proof that nothing was unpickled."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[object, tuple[str, str]]:
        return (open, (str(self.marker), "w"))


def test_pickles_in_a_checkpoint_are_never_loaded(tmp_path: Path) -> None:
    store = _filled_store()
    path = tmp_path / "ck"
    store.save(path)
    marker = tmp_path / "UNPICKLED"
    manifest = json.loads((path / "manifest.json").read_text())
    weights_file = path / manifest["tables"][0]["parts"][0]["files"]["weights"]
    # 1. A stray pickle next to the parts: never opened.
    (path / "t0000" / "extra.pkl").write_bytes(pickle.dumps(_Boom(marker)))
    loaded = ps.InProcessStore()
    loaded.load(path)
    _assert_same(store, loaded)
    # 2. A pickle in place of a part file.
    good = weights_file.read_bytes()
    weights_file.write_bytes(pickle.dumps(_Boom(marker)))
    with pytest.raises(ValueError, match=r"is not a plain .npy array"):
        ps.InProcessStore().load(path)
    # 3. A .npy holding an object array (pickled inside).
    with open(weights_file, "wb") as f:
        np.save(f, np.array([_Boom(marker)], dtype=object), allow_pickle=True)
    with pytest.raises(ValueError, match=r"is not a plain .npy array"):
        ps.InProcessStore().load(path)
    assert not marker.exists()
    # 4. A manifest that points outside the checkpoint.
    weights_file.write_bytes(good)
    outside = tmp_path / "evil.weights.npy"
    outside.write_bytes(good)
    manifest["tables"][0]["parts"][0]["files"]["weights"] = "../evil.weights.npy"
    (path / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(ValueError, match=r"is not a plain 't0000/<name>.weights.npy' path"):
        ps.InProcessStore().load(path)


def test_exception_mid_save_keeps_previous_checkpoint(tmp_path: Path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    store = _filled_store()
    path = tmp_path / "ck"
    store.save(path)
    saved = ps.InProcessStore()
    saved.load(path)
    store.push("fixed", torch.tensor([0]), torch.ones(1, DIM))  # now differs from the checkpoint
    real = ckpt._save_array
    written: list[Path] = []

    def failing(file: Path, array: np.ndarray) -> None:
        if len(written) == 5:  # after a whole part and one more file
            raise OSError("disk full (simulated)")
        written.append(file)
        real(file, array)

    monkeypatch.setattr(ckpt, "_save_array", failing)
    with pytest.raises(OSError, match="disk full"):
        store.save(path)
    assert sorted(os.listdir(tmp_path)) == ["ck"]  # the temporary folder is gone
    reloaded = ps.InProcessStore()
    reloaded.load(path)
    _assert_same(saved, reloaded)
    # A generator of parts that fails half way: the same.
    monkeypatch.setattr(ckpt, "_save_array", real)
    spec = store.spec("fixed")

    def parts():  # type: ignore[no-untyped-def]
        yield _part([1], spec)
        raise RuntimeError("writer died")

    with pytest.raises(RuntimeError, match="writer died"):
        ckpt.write_checkpoint(path, [(spec, parts())])
    reloaded.load(path)
    _assert_same(saved, reloaded)


_CRASH = """
import os, sys, torch, ps
from ps import checkpoint as ckpt
store = ps.InProcessStore()
store.create_table(ps.TableSpec(name="t", num_rows=10, dim=3, optimizer=ps.SGD(lr=1.0)))
store.push("t", torch.arange(10), torch.ones(10, 3))
store.save(sys.argv[1])
store.push("t", torch.arange(10), torch.ones(10, 3))
real, n = ckpt._save_array, [0]
def dying(file, array):
    n[0] += 1
    if n[0] == 3:
        os._exit(17)  # a real crash: no cleanup, no finally blocks
    real(file, array)
ckpt._save_array = dying
store.save(sys.argv[1])
"""


def test_process_killed_mid_save_keeps_previous_checkpoint(tmp_path: Path) -> None:
    path = tmp_path / "ck"
    env = rank_env()
    proc = subprocess.run([sys.executable, "-c", _CRASH, str(path)], env=env, timeout=50)
    assert proc.returncode == 17
    leftovers = [p for p in os.listdir(tmp_path) if p != "ck"]
    assert len(leftovers) == 1 and leftovers[0].startswith("ck.tmp-")  # the dead save's folder
    store = ps.InProcessStore()
    store.load(path)
    assert store.clocks("t", torch.arange(10)).tolist() == [1] * 10  # the first save


def test_crash_between_renames_reads_previous(tmp_path: Path) -> None:
    store = _filled_store()
    path = tmp_path / "ck"
    store.save(path)
    os.rename(path, tmp_path / "ck.prev")  # what a crash between the two renames leaves
    loaded = ps.InProcessStore()
    with pytest.warns(UserWarning, match="reading the previous one"):
        loaded.load(path)
    _assert_same(store, loaded)
    store.save(path)  # the next save completes the swap and drops the old copy
    assert sorted(os.listdir(tmp_path)) == ["ck"]


def test_refuses_to_replace_what_is_not_a_checkpoint(tmp_path: Path) -> None:
    store = _filled_store()
    precious = tmp_path / "home"
    precious.mkdir()
    (precious / "thesis.tex").write_text("years of work")
    with pytest.raises(ValueError, match=r"non-empty folder without a hybridrec-ps/1 manifest"):
        store.save(precious)
    assert (precious / "thesis.tex").read_text() == "years of work"
    (tmp_path / "file").write_text("x")
    with pytest.raises(ValueError, match=r"exists and is not a folder"):
        store.save(tmp_path / "file")
    empty = tmp_path / "empty"
    empty.mkdir()
    store.save(empty)  # an empty folder is fine
    assert (empty / "manifest.json").is_file()
