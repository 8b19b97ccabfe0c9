"""A run checkpoint carries the CUDA RNG states of every GPU a rank sees (dropout on a GPU
draws from them), in the checkpoint's ``.npy`` format, and a resume restores them.

On the CPU the CUDA side is simulated (``torch.cuda.is_initialized``,
``get_rng_state_all``, ``device_count`` and ``set_rng_state_all`` monkeypatched); the
``gpu`` test draws dropout masks on a real GPU before and after a save and a load.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import comm
from embedding import EmbeddingCollection, TableConfig
from hybridrec.checkpoint import run_checkpoint
from hybridrec.checkpoint.run_checkpoint import load_checkpoint, read_state, save_checkpoint
from tolerance import assert_same

pytestmark = pytest.mark.timeout(60)

SAME = "the saved bytes of an RNG state, read back from .npy"


def _kw() -> dict[str, Any]:
    net = torch.nn.Linear(2, 2)
    ec = EmbeddingCollection([TableConfig(name="t", num_rows=5, dim=2, feature_names=["f"])])
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    return dict(group=comm.LocalGroup(), dense=net, optimizer=opt, embeddings=ec)


class FakeCuda:
    """The CUDA RNG calls of one process with ``gpus`` GPUs whose states are 16 bytes."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, gpus: int, *, initialised: bool) -> None:
        gen = torch.Generator().manual_seed(gpus)
        self.states = [torch.randint(0, 256, (16,), generator=gen, dtype=torch.uint8)
                       for _ in range(gpus)]  # fmt: skip
        self.restored: list[list[torch.Tensor]] = []
        monkeypatch.setattr(torch.cuda, "is_initialized", lambda: initialised)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)
        monkeypatch.setattr(
            torch.cuda, "get_rng_state_all", lambda: [s.clone() for s in self.states]
        )
        monkeypatch.setattr(torch.cuda, "set_rng_state_all", self.restored.append)


def test_cuda_rng_states_are_saved_and_restored(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    cuda = FakeCuda(monkeypatch, 2, initialised=True)
    kw = _kw()
    folder = save_checkpoint(tmp_path, 3, meta={}, **kw)
    cpu_rng = torch.get_rng_state()
    ranks = read_state(folder / "ranks")
    assert_same(ranks["cuda_rng"], torch.stack(cuda.states), what="saved CUDA RNG", why=SAME)
    assert ranks["cuda_rng"].dtype == torch.uint8 and ranks["cuda_rng"].shape == (2, 16)
    assert ranks["cuda_rng_count"].tolist() == [2]
    for file in (folder / "ranks").glob("*.npy"):
        np.load(file, allow_pickle=False)  # plain arrays, no pickle
    torch.rand(5)  # move the CPU stream on: the load must bring it back
    load_checkpoint(folder, **kw)
    assert len(cuda.restored) == 1 and len(cuda.restored[0]) == 2
    for got, saved in zip(cuda.restored[0], cuda.states, strict=True):
        assert_same(got, saved, what="restored CUDA RNG", why=SAME)
    assert_same(torch.get_rng_state(), cpu_rng, what="restored CPU RNG", why=SAME)


def test_another_gpu_count_warns_and_restores_no_cuda_state(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    FakeCuda(monkeypatch, 2, initialised=True)
    kw = _kw()
    folder = save_checkpoint(tmp_path, 1, meta={}, **kw)
    cpu_rng = torch.get_rng_state()
    cuda = FakeCuda(monkeypatch, 1, initialised=True)
    torch.rand(5)
    with pytest.warns(RuntimeWarning, match=r"CUDA RNG states of 2 GPU\(s\), this process sees 1"):
        load_checkpoint(folder, **kw)
    assert cuda.restored == []
    assert_same(torch.get_rng_state(), cpu_rng, what="restored CPU RNG", why=SAME)


def test_no_cuda_field_without_cuda(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    # Where CUDA was never initialised nothing drew from it: the checkpoint is as before,
    # and its load touches no CUDA state.
    cuda = FakeCuda(monkeypatch, 2, initialised=False)
    kw = _kw()
    folder = save_checkpoint(tmp_path, 1, meta={}, **kw)
    assert set(read_state(folder / "ranks")) == {"state", "rng"}
    load_checkpoint(folder, **kw)
    assert cuda.restored == []


def test_each_rank_takes_its_own_rows(monkeypatch: pytest.MonkeyPatch) -> None:
    # Rank r's states are rows [sum G_<r, sum G_<=r) of cuda_rng; a rank that saved none
    # restores none.
    cuda = FakeCuda(monkeypatch, 2, initialised=True)
    rows = torch.arange(3 * 16, dtype=torch.uint8).view(3, 16)  # rank 0: 1 GPU, rank 2: 2
    counts = torch.tensor([1, 0, 2])
    run_checkpoint._restore_cuda_rngs(Path("ckpt"), rows, counts, 2)
    assert_same(torch.stack(cuda.restored[0]), rows[1:], what="rank 2's rows", why=SAME)
    run_checkpoint._restore_cuda_rngs(Path("ckpt"), rows, counts, 1)
    assert len(cuda.restored) == 1


@pytest.mark.gpu
def test_dropout_on_the_gpu_repeats_after_a_resume(tmp_path: Path) -> None:
    x = torch.ones(4096, device="cuda")
    F.dropout(x, 0.5)  # CUDA initialised, its generator used
    kw = _kw()
    folder = save_checkpoint(tmp_path, 1, meta={}, **kw)
    after_save = F.dropout(x, 0.5)
    F.dropout(x, 0.5)  # the stream moves on
    load_checkpoint(folder, **kw)
    assert_same(F.dropout(x, 0.5), after_save, what="dropout mask after the load",
                why="the GPU's generator restored to its state at the save")  # fmt: skip
    counts = read_state(folder / "ranks")["cuda_rng_count"]
    assert counts.tolist() == [torch.cuda.device_count()]
