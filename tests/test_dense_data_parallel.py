"""dense.data_parallel on one process: both calls leave everything as it was.

The multi-rank behaviour (broadcast from rank 0, averaged gradients, parameters
without a gradient on some ranks) is checked on real processes by
tests/ranks/dlrm_train.py (tests/test_dlrm_mpi.py).
"""

from __future__ import annotations

import torch
from torch import nn

import comm
from dense import allreduce_gradients, broadcast_parameters


def test_size_one_is_a_no_op() -> None:
    torch.manual_seed(0)
    module = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Linear(4, 1))
    module(torch.randn(5, 3)).sum().backward()
    params = [p.detach().clone() for p in module.parameters()]
    grads = [p.grad.clone() for p in module.parameters() if p.grad is not None]
    group = comm.LocalGroup()
    broadcast_parameters(module, group)
    allreduce_gradients(module, group)
    for p, want in zip(module.parameters(), params, strict=True):
        assert torch.equal(p.detach(), want)
    got = [p.grad for p in module.parameters() if p.grad is not None]
    assert all(torch.equal(g, w) for g, w in zip(got, grads, strict=True))
