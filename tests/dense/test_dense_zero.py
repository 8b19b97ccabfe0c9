"""dense.ZeroOptimizer on real processes (launched with the other embedding and dense rank
checks by tests/support/rank_battery.py): equals unsharded torch Adam/AdamW, state ~1/N,
checkpoints that load on a different rank count (tests/dense/ranks/dense_zero.py), plus
single-process checks of the argument errors and the no-pickle file format."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

import comm
from dense import ZeroOptimizer, load_zero_state, save_zero_state
from rank_battery import BATTERY_TIMEOUT_S, DENSE_CASES, ZERO_LOADS, ZERO_SAVE, RankBattery
from tolerance import assert_same


@pytest.mark.timeout(BATTERY_TIMEOUT_S)
@pytest.mark.parametrize(("backend", "nprocs"), DENSE_CASES)
def test_zero_matches_unsharded_adam_and_adamw(
    backend: str, nprocs: int, rank_battery: RankBattery
) -> None:
    lines = [f"rank {rank}/{nprocs} {backend} train: ok" for rank in range(nprocs)]
    rank_battery.expect(backend, nprocs, lines)


@pytest.mark.timeout(BATTERY_TIMEOUT_S)
def test_zero_state_saved_at_2_ranks_loads_at_1_and_4(rank_battery: RankBattery) -> None:
    # Saved under gloo, loaded under mpirun (1 rank) and gloo (4 ranks): the files are
    # independent of the rank count and the backend.
    backend, n = ZERO_SAVE
    rank_battery.expect(backend, n, [f"rank {r}/{n} {backend} save: ok" for r in range(n)])
    assert (rank_battery.workdir / "zero" / "optimizer" / "meta.json").exists()
    for backend, n in ZERO_LOADS:
        rank_battery.expect(backend, n, [f"rank {r}/{n} {backend} load: ok" for r in range(n)])


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 1))


def test_bad_arguments() -> None:
    group = comm.LocalGroup()
    net = _net()
    with pytest.raises(ValueError, match="stage must be 1 or 2, got 3"):
        ZeroOptimizer(torch.optim.Adam, net.parameters(), group, stage=3)
    with pytest.raises(TypeError, match="torch.optim.Optimizer subclass"):
        ZeroOptimizer(dict, net.parameters(), group)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="empty parameter list"):
        ZeroOptimizer(torch.optim.Adam, [], group)
    with pytest.raises(TypeError, match="parameter groups as dicts"):
        ZeroOptimizer(torch.optim.Adam, [{"params": list(net.parameters())}], group)  # type: ignore[list-item]
    p = next(net.parameters())
    with pytest.raises(ValueError, match="appears twice"):
        ZeroOptimizer(torch.optim.Adam, [p, p], group)


def test_state_files_are_plain_npy_and_json(tmp_path: Path) -> None:
    net = _net()
    net.half_param = nn.Parameter(torch.randn(5, dtype=torch.bfloat16))  # type: ignore[assignment]
    opt = ZeroOptimizer(torch.optim.Adam, net.parameters(), comm.LocalGroup(), lr=0.1)
    for _ in range(2):
        (net(torch.randn(2, 3)).sum() + net.half_param.float().sum()).backward()
        opt.step()
        opt.zero_grad()
    state = opt.state_dict()
    save_zero_state(state, tmp_path)
    doc = json.loads((tmp_path / "meta.json").read_text())
    for entry in doc["tensors"]:
        np.load(tmp_path / entry["file"], allow_pickle=False)  # raises on pickled content
    back = load_zero_state(tmp_path)
    assert back["meta"] == json.loads(json.dumps(state["meta"]))
    assert set(back["tensors"]) == set(state["tensors"])
    for name, t in state["tensors"].items():
        assert back["tensors"][name].dtype == t.dtype
        assert_same(back["tensors"][name], t, what=name, why="a .npy file stores the bits")
    opt.load_state_dict(back)
    with pytest.raises(ValueError, match="state is for 'Adam'"):
        ZeroOptimizer(torch.optim.AdamW, net.parameters(), comm.LocalGroup()).load_state_dict(back)
    with pytest.raises(ValueError, match="parameters"):
        ZeroOptimizer(torch.optim.Adam, _net().parameters(), comm.LocalGroup()).load_state_dict(
            back
        )
