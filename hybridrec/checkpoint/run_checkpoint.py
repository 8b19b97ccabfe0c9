"""Resumable training checkpoints: no pickle, atomic, any placement, any worker count.

``save_model`` / ``load_model`` (from :mod:`hybridrec.checkpoint.model_state`, re-exported here)
save and load one whole model; ``save_checkpoint`` / ``load_checkpoint`` add what a
run needs to resume (step, the job's meta, per-rank RNG and data position, rotation).

A checkpoint is one folder per saved step under ``--checkpoint-dir``::

    <dir>/latest                    the name of the newest complete checkpoint ("step-00000120")
    <dir>/step-00000120/
      meta.json                     written last: format, step, world_size, the job's own state
      model/                        the whole model (hybridrec.checkpoint.model_state.save_model):
        model.json                  what was found: collections, placements, stores, caches
        dense/                      the dense modules' state_dict (DataParallel's ``module.``
                                    dropped), index.json + *.npy
        optimizer/ or zero/         the torch optimizer's state_dict, or the ZeRO global state
        embeddings/c000/tables/     local and sharded tables, whole (ps format)
        stores/s000/                hybrid tables in a shared store: its save, after every
                                    cache flushed
        ranks/<rank>/stores/s001/   per rank: its own replica of hybrid tables in a per-rank store
        ranks/<rank>/codec/         per rank: gradient-codec residuals and generator states
        ranks/<rank>/cache/         per rank: the cache contents (ids, copies, counters)
      ranks/  index.json + *.npy    per rank: torch RNG state, the CUDA RNG state of every
                                    GPU it sees (when CUDA is initialised) and the job's
                                    int64 vector (e.g. a Criteo reader position)

Nested state is a JSON skeleton plus one ``.npy`` per tensor
(:mod:`hybridrec.checkpoint.state_folder`, ``allow_pickle=False`` both ways). Rank 0
makes ``step-N.tmp-<random>`` (every rank learns its name), every rank writes its own
``ranks`` folders in it, rank 0 the rest, then renames it into place and rewrites
``latest`` with a rename over it (:mod:`ps.atomic_save`): a crash leaves either the old
or the new checkpoint, never half of one. Every rank must see the folder (one machine
or a shared filesystem).

Worker count: the model loads at any count (see :mod:`hybridrec.checkpoint.model_state` for the
rule of each part). The torch RNGs and the job's per-rank vector belong to a rank of
the saving run: at the same count each rank gets its own back; at another count
(``resize=True``) no rank restores an RNG (each keeps the stream it was seeded with)
and the per-rank vector is None, so the job restarts its data position from the
global step in ``meta``. Without ``resize`` another count is an error, since a job
that keeps a per-rank data position would silently start its data over.

CUDA RNG: a rank whose process initialised CUDA saves ``torch.cuda.get_rng_state_all()``
(one state per visible GPU: dropout on a GPU draws from them), so a resume on the GPU
repeats the saving run's draws. A rank that sees another number of GPUs than the saving
rank did restores none of them and warns (its CPU RNG is still restored): which saved
state would belong to which device is not known.
"""

from __future__ import annotations

import json
import os
import shutil
import warnings
from pathlib import Path
from typing import Any

import torch
from torch import nn

from comm import ProcessGroup
from comm.agreement import run_on_rank0
from embedding import EmbeddingCollection
from hybridrec.checkpoint.model_state import (
    DenseOptimizer,
    load_model,
    read_model_doc,
    save_model,
    write_model,
)
from hybridrec.checkpoint.state_folder import flatten, read_state, unflatten, write_state
from ps import atomic_save

FORMAT = "hybridrec-run/2"
LATEST = "latest"

__all__ = [
    "DenseOptimizer",
    "flatten",
    "latest_checkpoint",
    "load_checkpoint",
    "load_model",
    "read_state",
    "save_checkpoint",
    "save_model",
    "unflatten",
    "write_state",
]


def latest_checkpoint(root: str | os.PathLike[str]) -> Path | None:
    """The newest complete checkpoint under ``root``, or None."""
    pointer = Path(root) / LATEST
    if not pointer.is_file():
        return None
    path = Path(root) / pointer.read_text(encoding="utf-8").strip()
    if not (path / "meta.json").is_file():
        raise ValueError(f"checkpoint {pointer} names {path.name!r}, which is not complete")
    return path


class RunModel(nn.Module):
    """What a run checkpoint saves as its model: the dense module (plain, or wrapped in
    ``DataParallel``: its codec state is saved too) and the embedding collection."""

    def __init__(self, dense: nn.Module, embeddings: EmbeddingCollection) -> None:
        super().__init__()
        self.dense = dense
        self.embeddings = embeddings


def save_checkpoint(
    root: str | os.PathLike[str],
    step: int,
    *,
    group: ProcessGroup,
    dense: nn.Module,
    optimizer: DenseOptimizer,
    embeddings: EmbeddingCollection,
    meta: dict[str, Any],
    rank_state: torch.Tensor | None = None,
    keep: int = 2,
) -> Path:
    """Collective over ``group`` (the workers): write ``root/step-<step>`` and point
    ``latest`` at it; keep the newest ``keep`` checkpoints. ``meta`` is JSON (rank 0's
    is written); ``rank_state`` an int64 ``[k]`` vector of this rank (same k everywhere).
    ``dense`` may be the ``DataParallel`` wrapper (then its codec state is saved)."""
    mine = torch.empty(0, dtype=torch.int64) if rank_state is None else rank_state
    states = group.allgather(mine.to(torch.int64).contiguous())  # [size, k]
    rngs = {"rng": group.allgather(torch.get_rng_state().contiguous())}  # [size, n] uint8
    rngs |= _gather_cuda_rngs(group)
    final = Path(root) / f"step-{step:08d}"
    what = f"saving checkpoint {final}"
    # A checkpoint saved at this step before (e.g. by the final save) is replaced.
    with atomic_save.saving(final, _replaceable_step, group=group, parents=True) as tmp:
        write_model(tmp / "model", RunModel(dense, embeddings), optimizer, group)
        run_on_rank0(group, lambda: _write_rank0(tmp, step, meta, states, rngs), what)
    run_on_rank0(group, lambda: _point_latest(final, keep), what)
    return final


def _replaceable_step(folder: Path) -> None:
    """FileExistsError unless ``folder`` is a complete checkpoint (the only kind replaced)."""
    if not (folder / "meta.json").is_file():
        raise FileExistsError(f"{folder} exists and is not a checkpoint; not replacing it")


def cuda_rng_states() -> torch.Tensor | None:
    """This process's CUDA RNG states ``[G, m]`` uint8 (one row per visible GPU), or
    None where CUDA is not initialised (nothing drew from them, and reading them would
    initialise CUDA on a CPU-only run)."""
    if not torch.cuda.is_initialized():
        return None
    states = torch.cuda.get_rng_state_all()  # G x [m] uint8 on the host
    return torch.stack([s.contiguous() for s in states]) if states else None


def _gather_cuda_rngs(group: ProcessGroup) -> dict[str, torch.Tensor]:
    """Collective: every rank's CUDA RNG states, for the ``ranks`` folder::

        cuda_rng        [sum G_r, m] uint8   rank r's G_r states, in rank order
        cuda_rng_count  [size] int64         G_r (0 where a rank did not initialise CUDA)

    Empty (no field saved) where no rank initialised CUDA."""
    mine = cuda_rng_states()
    shape = [0, 0] if mine is None else list(mine.shape)
    shapes = group.allgather(torch.tensor(shape, dtype=torch.int64))  # [size, 2]: G_r, m
    widths = {int(m) for g, m in shapes.tolist() if g > 0}
    if not widths:
        return {}
    if len(widths) > 1:
        raise ValueError(f"ranks hold CUDA RNG states of different sizes {sorted(widths)}")
    width = widths.pop()
    rows = torch.zeros(0, width, dtype=torch.uint8) if mine is None else mine
    return {"cuda_rng": group.allgatherv(rows), "cuda_rng_count": shapes[:, 0].contiguous()}


def _write_rank0(
    tmp: Path, step: int, meta: dict[str, Any], states: torch.Tensor, rngs: dict[str, torch.Tensor]
) -> None:
    """Rank 0: the per-rank vectors (``states`` int64 ``[size, k]``, ``rngs``: ``rng``
    uint8 ``[size, n]`` and the CUDA states of :func:`_gather_cuda_rngs`), then
    ``meta.json``, which marks the checkpoint complete."""
    write_state(tmp / "ranks", {"state": states, **rngs})
    doc = {"format": FORMAT, "step": step, "world_size": int(states.shape[0]), **meta}
    (tmp / "meta.json").write_text(json.dumps(doc, indent=1), encoding="utf-8")


def _point_latest(final: Path, keep: int) -> None:
    """Rank 0, once ``final`` is in place: ``latest`` names it, older checkpoints beyond
    the newest ``keep`` go."""
    atomic_save.write_file(final.parent / LATEST, final.name + "\n")
    _prune(final.parent, keep)


def _prune(root: Path, keep: int) -> None:
    steps = sorted(p for p in root.glob("step-*") if p.is_dir() and not atomic_save.is_leftover(p))
    for old in steps[: max(0, len(steps) - keep)]:
        shutil.rmtree(old, ignore_errors=True)


def load_checkpoint(
    path: str | os.PathLike[str],
    *,
    group: ProcessGroup,
    dense: nn.Module,
    optimizer: DenseOptimizer,
    embeddings: EmbeddingCollection,
    resize: bool = False,
) -> tuple[dict[str, Any], torch.Tensor | None]:
    """Collective: restore everything :func:`save_checkpoint` wrote into freshly built
    modules; returns ``(meta, this rank's rank_state or None)``.

    At the saving worker count each rank gets its RNG and ``rank_state`` back. At
    another count ``resize=True`` is needed: the model reshards (every placement, see
    :mod:`hybridrec.checkpoint.model_state`), no RNG is restored and ``rank_state`` is None."""
    folder = Path(path)
    meta = json.loads((folder / "meta.json").read_text(encoding="utf-8"))
    if meta.get("format") != FORMAT:
        raise ValueError(f"checkpoint {folder}: format {meta.get('format')!r}, expected {FORMAT!r}")
    saved = int(meta["world_size"])
    if saved != group.size and not resize:
        raise ValueError(
            f"checkpoint {folder} was written by {saved} worker ranks; this job has "
            f"{group.size} (resume with the same number of workers, or load with "
            "resize=True: the model reshards, but per-rank RNG and data positions restart)"
        )
    read_model_doc(folder / "model")  # a clear error for a folder that is not complete
    load_model(folder / "model", RunModel(dense, embeddings), optimizer, group=group)
    if saved != group.size:
        return meta, None
    ranks = read_state(folder / "ranks")
    torch.set_rng_state(ranks["rng"][group.rank].clone())
    if "cuda_rng" in ranks:
        _restore_cuda_rngs(folder, ranks["cuda_rng"], ranks["cuda_rng_count"], group.rank)
    state = ranks["state"][group.rank]
    return meta, (state if state.numel() else None)


def _restore_cuda_rngs(folder: Path, rows: torch.Tensor, counts: torch.Tensor, rank: int) -> None:
    """Rank ``rank``'s saved CUDA RNG states (``rows`` ``[sum G_r, m]``, ``counts``
    ``[size]``) back into every visible GPU, when it sees as many as it saved; else a
    warning naming both counts, and the GPUs keep their seeded streams."""
    saved = int(counts[rank])
    if saved == 0:  # the saving rank never initialised CUDA: nothing drew from it
        return
    start = int(counts[:rank].sum())
    here = torch.cuda.device_count()
    if here != saved:
        warnings.warn(
            f"checkpoint {folder}: rank {rank} saved the CUDA RNG states of {saved} GPU(s), "
            f"this process sees {here}; they are not restored, so random draws on the GPU "
            "(dropout) will differ from the saving run's (resume with as many visible GPUs, "
            "e.g. the same CUDA_VISIBLE_DEVICES, for an exact resume)",
            RuntimeWarning,
            stacklevel=3,
        )
        return
    torch.cuda.set_rng_state_all(list(rows[start : start + saved].clone()))
