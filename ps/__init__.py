"""ps: the parameter server. Tables of rows, server-side optimizers, per-row clocks.

Quick use::

    import torch
    import ps

    store = ps.InProcessStore()
    store.create_table(ps.TableSpec(name="items", num_rows=1000, dim=16,
                                    optimizer=ps.RowWiseAdagrad(lr=0.05)))
    ids = torch.tensor([3, 7, 3])
    got = store.pull("items", ids)          # got.rows [3, 16], got.clocks [3]
    store.push("items", ids, torch.ones(3, 16))  # id 3's two gradients are summed
"""

from ps.inprocess import InProcessStore
from ps.optimizers import SGD, Optimizer, RowWiseAdagrad
from ps.store import PullResult, Store
from ps.table import TableSpec, UniformInit, default_init

__all__ = [
    "SGD",
    "InProcessStore",
    "Optimizer",
    "PullResult",
    "RowWiseAdagrad",
    "Store",
    "TableSpec",
    "UniformInit",
    "default_init",
]
