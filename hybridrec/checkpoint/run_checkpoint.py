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
      ranks/  index.json + *.npy    per rank: torch RNG state and the job's int64 vector
                                    (e.g. a Criteo reader position)

Nested state is a JSON skeleton plus one ``.npy`` per tensor
(:mod:`hybridrec.checkpoint.state_folder`, ``allow_pickle=False`` both ways). Rank 0
makes ``step-N.tmp-<random>`` (every rank learns its name), every rank writes its own
``ranks`` folders in it, rank 0 the rest, then renames it into place and rewrites
``latest`` with a rename over it (:mod:`ps.atomic_save`): a crash leaves either the old
or the new checkpoint, never half of one. Every rank must see the folder (one machine
or a shared filesystem).

Worker count: the model loads at any count (see :mod:`hybridrec.checkpoint.model_state` for the
rule of each part). The torch RNG and the job's per-rank vector belong to a rank of
the saving run: at the same count each rank gets its own back; at another count
(``resize=True``) no rank restores an RNG (each keeps the stream it was seeded with)
and the per-rank vector is None, so the job restarts its data position from the
global step in ``meta``. Without ``resize`` another count is an error, since a job
that keeps a per-rank data position would silently start its data over.
"""

from __future__ import annotations

import json
import os
import shutil
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
    rngs = group.allgather(torch.get_rng_state().contiguous())  # [size, n] uint8
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


def _write_rank0(
    tmp: Path, step: int, meta: dict[str, Any], states: torch.Tensor, rngs: torch.Tensor
) -> None:
    """Rank 0: the per-rank vectors (``states`` int64 ``[size, k]``, ``rngs`` uint8
    ``[size, n]``), then ``meta.json``, which marks the checkpoint complete."""
    write_state(tmp / "ranks", {"state": states, "rng": rngs})
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
    state = ranks["state"][group.rank]
    return meta, (state if state.numel() else None)
