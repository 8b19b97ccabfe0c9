"""How the GPT job's workers split the model: a ``dp x pp x tp`` mesh and its groups.

``--tp`` and ``--pp`` fix two sizes of :class:`comm.DeviceMesh`; the data-parallel size is
what is left: ``dp = workers / (pp * tp)``. The ranks sharing a ``dp`` coordinate see the
same windows (rank ``r`` of the ``dp`` group takes slice ``r`` of each global batch);
the ``tp`` ranks of a replica split every block and the output head
(:func:`dense.apply_tensor_parallel`), the ``pp`` ranks hold consecutive stages
(:mod:`dense.pipeline`). The sparse input tables belong to the replica: every rank of it
keeps a copy (a replicated in-process store, or a sharded placement over ``dp``) and
applies the same row updates, since the gradient reaching the token vectors is the full
one on each of them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from comm import DeviceMesh, ProcessGroup
from dense.gpt import gpt_loss
from dense.vocab_parallel import tp_gpt_loss
from hybridrec.lm.config import LMConfig


@dataclass(slots=True)
class ModelParallel:
    """This rank's place in the mesh and the groups it talks in."""

    mesh: DeviceMesh
    dp: ProcessGroup  # replicas of this rank's part: gradients averaged, batch sliced
    tp: ProcessGroup  # this replica's tensor-parallel peers (size 1: none)
    pp: ProcessGroup  # this replica's pipeline stages, in order (size 1: none)

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
    return ModelParallel(mesh=mesh, dp=mesh.group("dp"), tp=mesh.group("tp"), pp=mesh.group("pp"))
