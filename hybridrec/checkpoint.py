"""Resumable training checkpoints for the example jobs: no pickle, atomic, any placement.

A checkpoint is one folder per saved step under ``--checkpoint-dir``::

    <dir>/latest                    the name of the newest complete checkpoint ("step-00000120")
    <dir>/step-00000120/
      meta.json                     written last: format, step, the job's own state (JSON)
      dense/  index.json + *.npy    the dense module's state_dict
      optimizer/ ...                the torch optimizer's state_dict (same format), or
      zero/   meta.json + *.npy     dense.save_zero_state (ZeRO: the gathered global state)
      ranks/  index.json + *.npy    per rank: torch RNG state and the job's int64 vector
                                    (e.g. a Criteo reader position)
      tables/local/                 local tables (EmbeddingCollection.save, ps format)
      tables/store/                 hybrid tables (store.save, after every cache is flushed)
      tables/sharded/               sharded tables, gathered whole (ps format)

Nested state (dicts with int keys, lists, tuples, tensors, JSON scalars) is
written as a JSON skeleton plus one ``.npy`` per tensor (``allow_pickle=False``
both ways). Rank 0 writes everything into ``step-N.tmp-<random>`` and renames it
into place, then rewrites ``latest`` with ``os.replace``: a crash leaves either
the old or the new checkpoint, never half of one. Every rank must see the folder
(one machine or a shared filesystem).

Not saved: the gradient codec's error-feedback residuals (``--compression``), so
a resumed compressed run is close to, not bit-equal with, an uninterrupted one.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from comm import ProcessGroup
from dense import ZeroOptimizer, load_zero_state, save_zero_state
from embedding import EmbeddingCollection
from embedding.hybrid import store_is_replicated
from ps.checkpoint import TablePart, write_checkpoint

FORMAT = "hybridrec-run/1"
LATEST = "latest"
DenseOptimizer = torch.optim.Optimizer | ZeroOptimizer


# ---------------------------------------------------------------- nested state <-> .npy + JSON


def flatten(obj: Any, tensors: dict[str, torch.Tensor]) -> Any:
    """``obj`` -> a JSON skeleton; its tensors go to ``tensors`` under numbered names."""
    if isinstance(obj, torch.Tensor):
        name = f"{len(tensors):06d}"
        tensors[name] = obj.detach().cpu()
        return {"__tensor__": name}
    if isinstance(obj, Mapping):  # keys may be ints (optimizer state): keep their type
        return {"__dict__": [[k, flatten(v, tensors)] for k, v in obj.items()]}
    if isinstance(obj, tuple):
        return {"__tuple__": [flatten(v, tensors) for v in obj]}
    if isinstance(obj, list):
        return [flatten(v, tensors) for v in obj]
    if obj is None or isinstance(obj, bool | int | float | str):
        return obj
    raise TypeError(f"checkpoint: cannot store a {type(obj).__name__} ({obj!r}) without pickle")


def unflatten(skeleton: Any, tensors: Mapping[str, torch.Tensor]) -> Any:
    """The inverse of :func:`flatten`."""
    if isinstance(skeleton, dict):
        if "__tensor__" in skeleton:
            return tensors[skeleton["__tensor__"]]
        if "__dict__" in skeleton:
            return {k: unflatten(v, tensors) for k, v in skeleton["__dict__"]}
        if "__tuple__" in skeleton:
            return tuple(unflatten(v, tensors) for v in skeleton["__tuple__"])
        raise ValueError(f"checkpoint: unknown skeleton entry {sorted(skeleton)}")
    if isinstance(skeleton, list):
        return [unflatten(v, tensors) for v in skeleton]
    return skeleton


def write_state(folder: Path, obj: Any) -> None:
    """Write nested state as ``folder/index.json`` + one ``.npy`` per tensor."""
    folder.mkdir(parents=True)
    tensors: dict[str, torch.Tensor] = {}
    skeleton = flatten(obj, tensors)
    dtypes = {}
    for name, t in tensors.items():
        if t.dtype == torch.bfloat16:  # numpy has no bfloat16: keep the bits
            arr, dtypes[name] = t.view(torch.int16).numpy(), "bfloat16"
        else:
            arr, dtypes[name] = t.contiguous().numpy(), str(t.dtype).removeprefix("torch.")
        np.save(folder / f"{name}.npy", arr, allow_pickle=False)
    doc = {"skeleton": skeleton, "dtypes": dtypes}
    (folder / "index.json").write_text(json.dumps(doc), encoding="utf-8")


def read_state(folder: Path) -> Any:
    """Read what :func:`write_state` wrote (never unpickles: object arrays are refused)."""
    doc = json.loads((folder / "index.json").read_text(encoding="utf-8"))
    tensors = {}
    for name, dtype in doc["dtypes"].items():
        if not name.isdigit():
            raise ValueError(f"checkpoint {folder}: bad tensor name {name!r}")
        t = torch.from_numpy(np.load(folder / f"{name}.npy", allow_pickle=False).copy())
        tensors[name] = t.view(torch.bfloat16) if dtype == "bfloat16" else t
    return unflatten(doc["skeleton"], tensors)


# ---------------------------------------------------------------- the run checkpoint


def latest_checkpoint(root: str | os.PathLike[str]) -> Path | None:
    """The newest complete checkpoint under ``root``, or None."""
    pointer = Path(root) / LATEST
    if not pointer.is_file():
        return None
    path = Path(root) / pointer.read_text(encoding="utf-8").strip()
    if not (path / "meta.json").is_file():
        raise ValueError(f"checkpoint {pointer} names {path.name!r}, which is not complete")
    return path


def _agree(group: ProcessGroup, error: BaseException | None, what: str) -> None:
    """Collective: raise on every rank if ``what`` failed on any (rank 0 writes alone)."""
    flag = torch.tensor([0 if error is None else 1], dtype=torch.int64)
    group.allreduce(flag, op="max")
    if error is not None:
        raise error
    if int(flag) != 0:
        raise RuntimeError(f"{what} failed on rank 0 (see its error)")


def _flush(embeddings: EmbeddingCollection) -> None:
    flush = getattr(embeddings.store, "flush", None)  # a cache: push pending row updates
    if embeddings.hybrid is not None and callable(flush):
        flush()


def _sharded_parts(embeddings: EmbeddingCollection) -> list[tuple[Any, TablePart]]:
    """Collective: every sharded table gathered whole (``[num_rows, D]`` on every rank)."""
    sharded: Any = embeddings.sharded
    return [] if sharded is None else list(sharded.checkpoint_parts())


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
    is written); ``rank_state`` an int64 ``[k]`` vector of this rank (same k everywhere)."""
    _flush(embeddings)  # every worker pushes its pending updates before rank 0 saves the store
    zero = optimizer.state_dict() if isinstance(optimizer, ZeroOptimizer) else None  # collective
    sharded = _sharded_parts(embeddings)  # collective
    mine = torch.empty(0, dtype=torch.int64) if rank_state is None else rank_state
    states = group.allgather(mine.to(torch.int64).contiguous())  # [size, k]
    rngs = group.allgather(torch.get_rng_state().contiguous())  # [size, n] uint8
    group.barrier()  # every flush has reached a shared store
    final = Path(root) / f"step-{step:08d}"
    error: BaseException | None = None
    if group.rank == 0:
        try:
            _write(final, step, dense, optimizer, zero, embeddings, sharded, meta, states, rngs)
            _prune(Path(root), keep)
        except Exception as e:  # reported on every rank by _agree
            error = e
    _agree(group, error, f"saving checkpoint {final}")
    return final


def _write(
    final: Path,
    step: int,
    dense: nn.Module,
    optimizer: DenseOptimizer,
    zero: dict[str, Any] | None,
    embeddings: EmbeddingCollection,
    sharded: list[tuple[Any, TablePart]],
    meta: dict[str, Any],
    states: torch.Tensor,
    rngs: torch.Tensor,
) -> None:
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = final.with_name(f"{final.name}.tmp-{secrets.token_hex(6)}")
    tmp.mkdir()
    try:
        write_state(tmp / "dense", dense.state_dict())
        if zero is not None:
            save_zero_state(zero, tmp / "zero")
        else:
            assert isinstance(optimizer, torch.optim.Optimizer)
            write_state(tmp / "optimizer", optimizer.state_dict())
        write_state(tmp / "ranks", {"state": states, "rng": rngs})
        (tmp / "tables").mkdir()
        if embeddings.local is not None:  # rank 0 only: the module's own (not collective) save
            embeddings.local.save(tmp / "tables" / "local")
        if embeddings.hybrid is not None:
            embeddings.store.save(tmp / "tables" / "store")
        if sharded:
            write_checkpoint(tmp / "tables" / "sharded", [(s, [p]) for s, p in sharded])
        doc = {"format": FORMAT, "step": step, "world_size": int(states.shape[0]), **meta}
        (tmp / "meta.json").write_text(json.dumps(doc, indent=1), encoding="utf-8")
        if final.exists():  # saved at this step before (e.g. the final save): replace it
            shutil.rmtree(final)
        os.rename(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    pointer = final.parent / f"{LATEST}.tmp-{secrets.token_hex(4)}"
    pointer.write_text(final.name + "\n", encoding="utf-8")
    os.replace(pointer, final.parent / LATEST)


def _prune(root: Path, keep: int) -> None:
    steps = sorted(p for p in root.glob("step-*") if p.is_dir() and ".tmp-" not in p.name)
    for old in steps[: max(0, len(steps) - keep)]:
        shutil.rmtree(old, ignore_errors=True)


def load_checkpoint(
    path: str | os.PathLike[str],
    *,
    group: ProcessGroup,
    dense: nn.Module,
    optimizer: DenseOptimizer,
    embeddings: EmbeddingCollection,
) -> tuple[dict[str, Any], torch.Tensor | None]:
    """Collective: restore everything :func:`save_checkpoint` wrote into freshly built
    modules; returns ``(meta, this rank's rank_state or None)``. The world size must
    be the one saved (the data position and the RNG are per rank)."""
    folder = Path(path)
    meta = json.loads((folder / "meta.json").read_text(encoding="utf-8"))
    if meta.get("format") != FORMAT:
        raise ValueError(f"checkpoint {folder}: format {meta.get('format')!r}, expected {FORMAT!r}")
    if meta["world_size"] != group.size:
        raise ValueError(
            f"checkpoint {folder} was written by {meta['world_size']} worker ranks; this job "
            f"has {group.size} (resume with the same number of workers)"
        )
    dense.load_state_dict(read_state(folder / "dense"))
    if isinstance(optimizer, ZeroOptimizer):
        optimizer.load_state_dict(load_zero_state(folder / "zero"))
    else:
        optimizer.load_state_dict(read_state(folder / "optimizer"))
    ranks = read_state(folder / "ranks")
    torch.set_rng_state(ranks["rng"][group.rank].clone())
    if embeddings.local is not None:
        embeddings.local.load(folder / "tables" / "local")
    if embeddings.hybrid is not None:
        store = embeddings.store
        if store_is_replicated(store) or group.rank == 0:  # a shared store: loaded once
            store.load(folder / "tables" / "store")
        group.barrier()
    if embeddings.sharded is not None:
        embeddings.sharded.load(folder / "tables" / "sharded")  # type: ignore[operator]
    state = ranks["state"][group.rank]
    return meta, (state if state.numel() else None)
