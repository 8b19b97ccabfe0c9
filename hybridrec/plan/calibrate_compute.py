"""The calibration's one-process compute parts: batch assembly, the dense model and an
embedding collection, each timed at a few sizes and fitted (:mod:`hybridrec.plan.timing`)."""

from __future__ import annotations

import functools
from typing import Any

import numpy as np
import torch

import comm
import ps
from dense import DLRMConfig, DLRMDense
from embedding import EmbeddingCollection, KeyedJaggedIds, RowWiseAdagrad, TableConfig
from hybridrec.datasets import gather_batch, make_synthetic
from hybridrec.plan.calibrate_store import shard_seconds
from hybridrec.plan.costs import DenseCosts, EmbeddingCosts, Linear, StoreCosts
from hybridrec.plan.dense_work import dense_work
from hybridrec.plan.timing import DIM, fit, fit_linear, ids_of, timed


def calibrate_data(quick: bool) -> Linear:
    """:func:`hybridrec.datasets.gather_batch` of a synthetic set, per batch and per sample."""
    data = make_synthetic(num_samples=4096, num_rows=1000, seed=0)
    gen = torch.Generator().manual_seed(0)
    points = []
    for b in (64, 1024):
        idx = torch.randint(0, data.num_samples, (b,), generator=gen)
        s = timed(functools.partial(gather_batch, data, idx), 5 if quick else 20)
        points.append((1.0, float(b), s))
    return fit_linear(points)


def calibrate_dense(quick: bool) -> DenseCosts:
    """:class:`dense.DLRMDense` forward + backward + Adam step, two model widths at two
    batch sizes: per step, per parameter and per FLOP."""
    rows, times = [], []
    for width in (64, 512):
        cfg = DLRMConfig(num_dense=13, num_sparse=26, embedding_dim=DIM,
                         bottom_mlp=[width, DIM], top_mlp=[width, width // 2, 1])  # fmt: skip
        flops, params = dense_work(cfg)
        torch.manual_seed(0)
        model = DLRMDense(cfg)
        opt = torch.optim.Adam(model.parameters(), lr=1e-3)
        for b in (64, 512):
            x = torch.randn(b, 13)
            embs = [torch.randn(b, DIM) for _ in range(26)]
            y = torch.rand(b)

            def step(model: Any = model, opt: Any = opt, x: Any = x, embs: Any = embs,
                     y: Any = y) -> None:  # fmt: skip
                loss = torch.nn.functional.binary_cross_entropy_with_logits(model(x, embs), y)
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()

            rows.append([1.0, float(params), flops * b])
            times.append(timed(step, 5 if quick else 15))
    alpha, per_param, per_flop = fit(rows, times)
    return DenseCosts(alpha_s=alpha, s_per_param=per_param, s_per_flop=per_flop)


def calibrate_embedding(
    quick: bool,
    server: dict[str, StoreCosts],
    placements: tuple[str, ...] = ("local", "hybrid", "sharded"),
) -> dict[str, EmbeddingCosts]:
    """An :class:`embedding.EmbeddingCollection` of 8 tables on one rank, forward +
    backward per placement: per step, per id looked up and per distinct id (hybrid: the
    store's share, ``server["dense"]``, taken out)."""
    tables, rows = 8, 50_000
    group = comm.init("local")
    out = {}
    try:
        for placement in placements:
            design, times = [], []
            for b in (128, 1024):
                for law in ("uniform", "zipf"):
                    store = ps.InProcessStore()
                    cfgs = [
                        TableConfig(
                            name=f"t{i}", num_rows=rows, dim=DIM, feature_names=[f"t{i}"],
                            placement=placement,  # type: ignore[arg-type]
                            optimizer=RowWiseAdagrad(lr=0.01),
                        )
                        for i in range(tables)
                    ]  # fmt: skip
                    emb = EmbeddingCollection(cfgs, group=group, store=store)
                    rng = np.random.default_rng(b)
                    per = [ids_of(rng, law, rows, b) for _ in range(tables)]
                    unique = float(sum(np.unique(p).size for p in per))
                    kjt = KeyedJaggedIds(
                        [f"t{i}" for i in range(tables)],
                        torch.from_numpy(np.concatenate(per)),
                        torch.ones(tables * b, dtype=torch.int64),
                    )

                    def step(emb: Any = emb, kjt: Any = kjt) -> None:
                        pooled = emb(kjt)
                        sum(v.sum() for v in pooled.values()).backward()  # type: ignore[union-attr]

                    s = timed(step, 3 if quick else 9)
                    if placement == "hybrid":  # the store's share is the server's cost
                        s -= shard_seconds(server["dense"], "rowwise_adagrad", tables,
                                           unique, unique)  # fmt: skip
                    design.append([1.0, float(tables * b), unique])
                    times.append(max(s, 0.0))
            alpha, per_lookup, per_unique = fit(design, times)
            out[placement] = EmbeddingCosts(
                alpha_s=alpha, per_lookup_s=per_lookup, per_unique_s=per_unique
            )
    finally:
        group.close()
    return out
