"""A process killed (SIGKILL) at random moments while it saves a big table, again and again.

A child process opens an :class:`ps.InProcessStore` with a 100 000 x 16 table
(RowWiseAdagrad, ~8 MB per checkpoint), loads the checkpoint at ``path`` if there
is one, and then loops: one push of a known gradient to every row, ``save(path)``,
print ``saved V`` (``V``: the pushes applied, which is every row's clock). The
test kills it at a random moment (a fixed seed) several times, and after each kill:

* the checkpoint at ``path`` loads (possibly from ``path.prev``, with a warning,
  if the kill fell between the two renames of the swap) and is **whole**: every
  row, its optimizer state and clock equal a reference store that applied the same
  ``V`` pushes, with ``V`` the last version the child reported saved, or the one
  after it (saved and swapped in, killed before it printed);
* the next child resumes from it, so the kills land on saves of growing versions.

``tests/ps/test_ps_checkpoint.py`` already kills a save at one fixed file; this one
kills at arbitrary instants (inside ``np.save``, fsync, rename, rmtree) with a
table big enough that most kills land inside a save.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
import warnings
from pathlib import Path

import pytest
import torch

import ps
from multiproc import rank_env
from tolerance import assert_same

ROOT = Path(__file__).resolve().parents[2]
NUM_ROWS = 100_000
DIM = 16
KILLS = 5

_CHILD = f"""
import sys, warnings, torch, ps
path = sys.argv[1]
spec = ps.TableSpec(name="big", num_rows={NUM_ROWS}, dim={DIM},
                    optimizer=ps.RowWiseAdagrad(lr=0.01))
store = ps.InProcessStore()
try:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        store.load(path)
    version = int(store.clocks("big", torch.tensor([0]))[0])
except FileNotFoundError:
    store.create_table(spec)
    version = 0
ids = torch.arange({NUM_ROWS})
print("ready", version, flush=True)
while True:
    store.push("big", ids, grad(version))
    version += 1
    store.save(path)
    print("saved", version, flush=True)
"""

_GRAD = """
def grad(version):
    g = torch.Generator().manual_seed(version)
    return torch.randn({rows}, {dim}, generator=g)
"""


def _grad(version: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(version)
    return torch.randn(NUM_ROWS, DIM, generator=g)


def _reference(version: int) -> ps.InProcessStore:
    ref = ps.InProcessStore()
    ref.create_table(
        ps.TableSpec(name="big", num_rows=NUM_ROWS, dim=DIM, optimizer=ps.RowWiseAdagrad(lr=0.01))
    )
    ids = torch.arange(NUM_ROWS)
    for v in range(version):
        ref.push("big", ids, _grad(v))
    return ref


def _load(path: Path) -> ps.InProcessStore:
    store = ps.InProcessStore()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "reading the previous one": allowed after a kill
        store.load(path)
    return store


@pytest.mark.timeout(240)
def test_random_kills_during_saves_always_leave_a_whole_checkpoint(tmp_path: Path) -> None:
    path = tmp_path / "ck"
    source = _GRAD.format(rows=NUM_ROWS, dim=DIM) + _CHILD
    env = rank_env()
    rng = random.Random(8)
    ids = torch.arange(NUM_ROWS)
    saved = 0  # the last version a child reported saved
    for kill in range(KILLS):
        child = subprocess.Popen(
            [sys.executable, "-c", source, str(path)],
            env=env,
            stdout=subprocess.PIPE,
            text=True,
        )
        assert child.stdout is not None
        try:
            first = child.stdout.readline().split()
            assert first[:1] == ["ready"], first
            assert int(first[1]) in (saved, saved + 1), (first, saved)
            # Let it complete at least one save, then kill it at a random instant of a later
            # one (most of the loop is the save: ~8 MB written and fsynced).
            reported = [int(first[1])]
            line = child.stdout.readline().split()
            assert line[:1] == ["saved"], line
            reported.append(int(line[1]))
            time.sleep(rng.uniform(0.0, 0.6))
            child.send_signal(signal.SIGKILL)
            rest = child.stdout.read()
        finally:
            if child.poll() is None:
                child.kill()
            child.wait(timeout=10)
        reported += [int(w.split()[1]) for w in rest.splitlines() if w.startswith("saved")]
        saved = reported[-1]
        got = _load(path)
        version = int(got.clocks("big", ids[:1])[0])
        assert version in (saved, saved + 1), f"kill {kill}: loaded {version}, saved {saved}"
        want = _reference(version)
        assert torch.equal(got.clocks("big", ids), want.clocks("big", ids)), f"kill {kill}"
        why = "the same store kernel applied the same pushes to the same rows in order"
        rows, state = got.pull("big", ids).rows, got.state("big", ids)
        assert_same(rows, want.pull("big", ids).rows, what=f"kill {kill}: rows", why=why)
        assert_same(state, want.state("big", ids), what=f"kill {kill}: state", why=why)
        saved = version
    # The swap leaves no second copy behind; only dead saves' temporary folders remain.
    names = sorted(os.listdir(tmp_path))
    assert "ck" in names or "ck.prev" in names, names
    assert all(n in ("ck", "ck.prev") or n.startswith("ck.tmp-") for n in names), names
