"""How the GPT job's workers split the model: a ``dp x pp x tp`` mesh and its groups.

``--tp`` and ``--pp`` fix two sizes of :class:`comm.DeviceMesh`; the data-parallel size is
what is left: ``dp = workers / (pp * tp)``. The ranks sharing a ``dp`` coordinate see the
same windows (rank ``r`` of the ``dp`` group takes slice ``r`` of each global batch);
the ``tp`` ranks of a replica split every block and the output head
(:func:`dense.apply_tensor_parallel`), the ``pp`` ranks hold consecutive stages
(:mod:`dense.pipeline`). The sparse input tables are looked up where the first stage runs
(stage 0; with the bidirectional schedule also the last rank, which runs the first stage
of the up pipe): every such rank keeps a copy (a replicated in-process store, or a
sharded placement) and applies the same row updates. With tensor parallelism the
gradient reaching the token vectors is the full one on every tp rank; in the
bidirectional pipeline each of the two first stages gets the gradient of its half of
the micro-batches, which is scaled by 2 so that the tables' data-parallel mean over
both (and over ``dp``) is the replica's gradient.

ZeRO-3 (``--zero-stage 3``) shards the GPT's parameters over ``dp`` (:class:`dense.Zero3`);
under a pipeline the stages keep their parameters and ZeRO stages 1 and 2 shard the
optimizer state (and gradients) of each stage over ``dp``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from comm import DeviceMesh, ProcessGroup
from dense import GPT, Pipeline, ZeroOptimizer, allreduce_gradients, stages_for_rank
from dense.gpt import gpt_loss
from dense.vocab_parallel import tp_gpt_loss
from hybridrec.checkpoint.run_checkpoint import DenseOptimizer
from hybridrec.lm.config import LMConfig
from hybridrec.lm.model import LanguageModel, adamw_options, make_dense_optimizer


@dataclass(slots=True)
class ModelParallel:
    """This rank's place in the mesh and the groups it talks in."""

    mesh: DeviceMesh
    dp: ProcessGroup  # replicas of this rank's part: gradients averaged, batch sliced
    tp: ProcessGroup  # this replica's tensor-parallel peers (size 1: none)
    pp: ProcessGroup  # this replica's pipeline stages, in order (size 1: none)
    schedule: str = "1f1b"
    tables: ProcessGroup | None = None  # the ranks holding copies of the sparse tables

    @property
    def first_stages(self) -> tuple[int, ...]:
        """The pp ranks that run a first stage (and look up the sparse rows)."""
        p = self.mesh.size("pp")
        return (0, p - 1) if self.schedule == "bidirectional" and p > 1 else (0,)

    @property
    def looks_up(self) -> bool:
        return self.stage in self.first_stages

    @property
    def has_targets(self) -> bool:
        """Ranks that run a last stage: the last one; bidirectional, also rank 0."""
        p = self.mesh.size("pp")
        return self.stage == p - 1 or (self.schedule == "bidirectional" and self.stage == 0)

    @property
    def stage(self) -> int:
        return self.mesh.coord("pp")

    @property
    def first_stage(self) -> bool:
        return self.stage == 0

    @property
    def last_stage(self) -> bool:
        return self.stage == self.mesh.size("pp") - 1

    def loss(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Mean next-token cross entropy of this replica's windows; with ``tp`` > 1 from
        the logits shard ``[B, T, V / tp]`` without gathering the full logits."""
        if self.tp.size == 1:
            return gpt_loss(logits, targets)
        return tp_gpt_loss(logits, targets, self.tp)


def model_parallel(cfg: LMConfig, workers: ProcessGroup, vocab_size: int) -> ModelParallel:
    """Collective over ``workers``: the mesh of ``--tp`` and ``--pp``, after the checks that
    need the world size and the vocabulary (the same ValueError on every rank)."""
    split = cfg.tp * cfg.pp
    if workers.size % split:
        raise ValueError(
            f"--tp {cfg.tp} x --pp {cfg.pp} = {split} ranks per model replica does not divide "
            f"the {workers.size} worker ranks"
        )
    if vocab_size % cfg.tp:
        raise ValueError(
            f"the vocabulary of {vocab_size} tokens is not divisible by --tp {cfg.tp} (the "
            "output head is split by vocabulary rows)"
        )
    dp = workers.size // split
    if cfg.batch_size % dp or (cfg.batch_size // dp) % cfg.num_microbatches:
        raise ValueError(
            f"--batch-size {cfg.batch_size} over {dp} data-parallel replicas gives "
            f"{cfg.batch_size / dp:g} windows each, which must be a whole multiple of the "
            f"{cfg.num_microbatches} micro-batches"
        )
    mesh = DeviceMesh(workers, {"dp": dp, "pp": cfg.pp, "tp": cfg.tp})
    par = ModelParallel(
        mesh=mesh, dp=mesh.group("dp"), tp=mesh.group("tp"), pp=mesh.group("pp"),
        schedule=cfg.schedule,
    )  # fmt: skip
    if cfg.pp == 1:
        par.tables = par.dp
    else:  # collective: the first-stage ranks of every replica with this tp coordinate
        color = mesh.coord("tp") if par.looks_up else cfg.tp
        par.tables = workers.split(color, workers.rank)
    return par


class _ScaleGrad(torch.autograd.Function):
    """Identity forward; the gradient times ``k`` backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, k: float) -> torch.Tensor:
        ctx.k = k
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad * ctx.k, None


@dataclass(slots=True)
class DenseParts:
    """The dense model as this rank trains it: the module a checkpoint holds, the
    optimizer and, under a pipeline, the :class:`dense.Pipeline` running this rank's stages."""

    trained: nn.Module
    optimizer: DenseOptimizer
    pipeline: Pipeline | None = None


def build_dense(cfg: LMConfig, gpt: GPT, par: ModelParallel) -> DenseParts:
    """Collective: the optimizer of this rank's part of ``gpt`` (already split by tp)."""
    if cfg.pp == 1:
        trained, optimizer = make_dense_optimizer(cfg, gpt, par.dp)
        return DenseParts(trained, optimizer)
    stages = stages_for_rank(gpt, par.pp, cfg.schedule)
    pipeline = Pipeline(stages, par.pp, cfg.num_microbatches, cfg.schedule, loss_fn=par.loss)
    params = list(pipeline.parameters())
    kw = adamw_options(cfg)
    opt: DenseOptimizer
    if cfg.zero_stage in (1, 2):
        opt = ZeroOptimizer(torch.optim.AdamW, params, par.dp, stage=cfg.zero_stage, **kw)
    else:
        opt = torch.optim.AdamW(params, **kw)
    return DenseParts(nn.ModuleList(stages), opt, pipeline)


def pipeline_step(
    model: LanguageModel, parts: DenseParts, par: ModelParallel, zero_stage: int
) -> Callable[[Any, Any], float]:
    """A trainer step under a pipeline: the first stages embed the windows, the pipeline
    runs every micro-batch forward and backward (the tables' rows update inside it),
    then the dense gradients are averaged over ``dp`` and the optimizer steps."""
    pipeline, optimizer = parts.pipeline, parts.optimizer
    assert pipeline is not None
    scale = float(len(par.first_stages))

    def step(batch: Any, next_batch: Any) -> float:
        del next_batch
        x, y = batch
        optimizer.zero_grad(set_to_none=True)
        inputs = _ScaleGrad.apply(model.embed(x), scale) if par.looks_up else None
        loss = pipeline.step(inputs, y if par.has_targets else None)
        if zero_stage == 0:  # ZeroOptimizer averages over dp itself
            allreduce_gradients(parts.trained, par.dp)
        optimizer.step()
        return float(loss)

    return step


@torch.no_grad()
def pipeline_loss(
    model: LanguageModel, parts: DenseParts, par: ModelParallel, x: Any, y: Any
) -> float:
    """The mean validation loss of windows ``x`` (forward only, down the pipe)."""
    assert parts.pipeline is not None
    inputs = model.embed(x) if par.looks_up else None
    return float(parts.pipeline.evaluate(inputs, y if par.has_targets else None))
