"""One call saves a whole model, one call loads it, at any number of workers.

``save_model(path, model, optimizer, group=group)`` walks ``model`` (any
``nn.Module``) and writes, collectively, one folder::

    path/
      model.json              format, the saving world size, the collections (their tables,
                              placements, store and cache) and DataParallel wrappers found
      dense/                  model.state_dict() without the embedding tables, names as if
                              no DataParallel wrapped anything (index.json + .npy)
      optimizer/              a torch optimizer's state_dict (same format), or
      zero/                   a dense.ZeroOptimizer's global state (dense.save_zero_state)
      embeddings/c000/        one folder per EmbeddingCollection (names in model.json):
        tables/               its local and sharded tables, whole (ps checkpoint format)
      stores/s000/            each shared store holding hybrid tables, saved once by rank 0
                              (store.save: every table it holds), after every worker
                              flushed its cache
      ranks/00000/            per saving rank:
        stores/s001/          each per-rank store (a replica of the hybrid tables that only
                              this rank reads and writes), saved by its rank
        codec/                each DataParallel's codec state (error-feedback residuals,
                              random generator states)
        cache/                each cache's contents (cached ids, copies, counters)

``load_model(path, model, optimizer, group=group)`` restores it into freshly built
modules of the same structure, at any number of workers ``M`` (saved by ``N``):

* dense weights, plain optimizer state: replicated, the same at any ``M``;
* ZeRO stage 1/2 state: saved in its global form, resharded to ``M`` ranks;
* local tables (replicated) load whole on every rank; sharded tables were saved
  whole and each rank copies the rows the ``M``-rank plan gives it; local and
  sharded placements load into each other. Hybrid tables go back into the store
  (rank 0 loads a shared store once; rank ``m`` loads saved rank ``m mod N``'s per-rank
  store); the ps format routes rows by id, so any server count reads it;
* codec state: exact per rank when ``M == N``; otherwise every rank takes the mean of
  the saved residuals, which keeps the pending correction of the averaged gradient
  (``sum_r r_r / N``) unchanged, and random codecs restart their streams (see
  :meth:`dense.DataParallel.load_codec_state`);
* cache contents: rank ``m`` takes those of saved rank ``m mod N`` (exact when
  ``M == N``). A cached copy is a store row read at a known clock plus local
  updates, valid for any worker under the read bound, so this is a warm start at
  any ``M``; a cache over a store differs from the store by design (copies may lag
  by the read bound and carry local steps), which is why the copies themselves are
  saved and a flush alone would not reproduce what the cache serves next.

At the saving count every rank gets back exactly its own state, so a resumed run repeats
the saving run's arithmetic bit for bit. Per-rank store replicas are saved per rank for
that reason: they receive the same gradients, but each rank's cache groups them into
pushes by its own hits and evictions, so the replicas differ by rounding, and a resumed
rank that took rank 0's replica would continue from other bits.

Everything but the per-rank folders is written by rank 0; every rank writes its own
``ranks/`` folder, so all ranks must see ``path`` (one machine or a shared
filesystem). ``save_model`` writes into ``<path>.tmp-<random>`` and renames it into
place (:mod:`ps.atomic_save`: a previous save is first renamed to ``<path>.prev`` and
deleted after): a crash leaves a whole previous or new save, never half of one. A
folder at ``path`` that is not a save is never replaced. No pickle anywhere.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from cache import CachedStore
from comm import LocalGroup, ProcessGroup
from comm.agreement import agree, run_on_rank0
from dense import DataParallel, Zero3, ZeroOptimizer, load_zero_state, save_zero_state
from embedding import EmbeddingCollection
from embedding.hybrid import backing_store
from hybridrec.checkpoint.row_dtypes import store_checkpoint_as
from hybridrec.checkpoint.state_folder import read_state, write_state
from ps import Store
from ps.atomic_save import saving
from ps.checkpoint import write_checkpoint
from ps.table import RowDtype

FORMAT = "hybridrec-model/2"
DenseOptimizer = torch.optim.Optimizer | ZeroOptimizer | Zero3


# ---------------------------------------------------------------- what a model holds


def canonical_name(model: nn.Module, dotted: str) -> str:
    """``dotted`` (a module, parameter or buffer name in ``model``) without the
    ``module`` step of every :class:`dense.DataParallel` on its path, so a model saved
    with its dense part wrapped loads into one without the wrapper and back."""
    out: list[str] = []
    mod: nn.Module | None = model
    for part in dotted.split(".") if dotted else []:
        if isinstance(mod, DataParallel) and part == "module":
            mod = mod.module
            continue
        out.append(part)
        mod = None if mod is None else mod._modules.get(part)
    return ".".join(out)


@dataclass(slots=True)
class ModelParts:
    """The parts of a model that need more than its ``state_dict``."""

    collections: dict[str, EmbeddingCollection] = field(default_factory=dict)
    data_parallel: dict[str, DataParallel] = field(default_factory=dict)

    @classmethod
    def of(cls, model: nn.Module) -> ModelParts:
        parts = cls()
        for name, mod in model.named_modules():
            if isinstance(mod, EmbeddingCollection):
                parts.collections[canonical_name(model, name)] = mod
            elif isinstance(mod, DataParallel):
                parts.data_parallel[canonical_name(model, name)] = mod
        return parts

    def hybrid_stores(self) -> list[Store]:
        """The distinct backing stores of the hybrid tables, in collection order."""
        seen: dict[int, Store] = {}
        for c in self.collections.values():
            if c.hybrid is not None:
                seen.setdefault(id(backing_store(c.store)), backing_store(c.store))
        return list(seen.values())

    def shared_stores(self) -> set[int]:
        """``id()`` of the hybrid stores that every rank shares (the others are per rank)."""
        return {
            id(backing_store(c.store))
            for c in self.collections.values()
            if c.hybrid is not None and c.hybrid.store_is_shared
        }

    def settle(self) -> None:
        """Every collection's sparse pipeline drained and its pull ahead dropped (a
        load replaces the rows it read)."""
        for c in self.collections.values():
            if c.hybrid is not None:
                c.hybrid.settle()

    def caches(self) -> list[CachedStore]:
        """The distinct caches in front of hybrid tables, in collection order."""
        seen: dict[int, CachedStore] = {}
        for c in self.collections.values():
            if c.hybrid is not None and isinstance(c.store, CachedStore):
                seen.setdefault(id(c.store), c.store)
        return list(seen.values())


def _describe(parts: ModelParts, optimizer: DenseOptimizer | None, group: ProcessGroup) -> dict:
    stores = [id(s) for s in parts.hybrid_stores()]
    caches = [id(c) for c in parts.caches()]
    collections = []
    for i, (name, c) in enumerate(parts.collections.items()):
        hybrid = c.hybrid is not None
        collections.append({
            "name": name,
            "folder": f"c{i:03d}",
            "tables": {t.name: t.placement for t in c.tables},
            "store": stores.index(id(backing_store(c.store))) if hybrid else None,
            "store_is_shared": bool(c.hybrid.store_is_shared) if c.hybrid is not None else None,
            "cache": caches.index(id(c.store)) if hybrid and id(c.store) in caches else None,
        })  # fmt: skip
    kind = (
        None
        if optimizer is None
        else "zero"
        if isinstance(optimizer, ZeroOptimizer | Zero3)
        else "torch"
    )
    return {
        "format": FORMAT,
        "world_size": group.size,
        "optimizer": kind,
        "collections": collections,
        "data_parallel": {
            n: (None if dp.codec is None else dp.codec.name)
            for n, dp in parts.data_parallel.items()
        },
    }


def zero3_prefix(model: nn.Module, optimizer: DenseOptimizer | None) -> str | None:
    """Where the module a :class:`dense.Zero3` shards sits in ``model`` (``"dense"``, or
    ``""`` for the model itself); None without ZeRO-3. Its parameters are freed between
    uses, so its weights are read and written through the optimizer."""
    if not isinstance(optimizer, Zero3):
        return None
    for name, module in model.named_modules():
        if module is optimizer.model:
            return name
    raise ValueError("the ZeRO-3 optimizer shards a module that is not part of this model")


def _with_prefix(prefix: str, key: str) -> str:
    return f"{prefix}.{key}" if prefix else key


@contextmanager
def tables_left_out(parts: ModelParts) -> Iterator[None]:
    """Within it, the collections' tables are not in ``model.state_dict()`` nor expected by
    ``load_state_dict()``: a model save writes them with the collections' own checkpoint
    code (``embeddings/``, ``stores/``), and a state dict would read every hybrid table
    through its store for nothing."""
    with ExitStack() as stack:
        for c in parts.collections.values():
            stack.enter_context(c.tables_left_out())
        yield


def _dense_state(
    model: nn.Module, parts: ModelParts, full: dict[str, torch.Tensor] | None = None
) -> dict[str, torch.Tensor]:
    """``model.state_dict()`` under canonical names, without any collection's entries;
    ``full`` replaces the entries it has (the gathered weights of a ZeRO-3 module)."""
    skip = tuple(f"{n}." for n in parts.collections if n)
    out = {}
    with tables_left_out(parts):
        state = model.state_dict()
    for key, value in (state | (full or {})).items():
        name = canonical_name(model, key)
        if "" in parts.collections or name.startswith(skip):
            continue
        out[name] = value
    return out


# ---------------------------------------------------------------- save


def write_model(
    folder: Path, model: nn.Module, optimizer: DenseOptimizer | None, group: ProcessGroup
) -> None:
    """Collective: write ``model`` (and ``optimizer``) into the existing ``folder``, which
    every rank sees (see the module docstring for the layout). Raises on every rank if
    any rank failed."""
    parts = ModelParts.of(model)
    parts.settle()  # no store call of a sparse pipeline in flight while the stores are read
    caches = parts.caches()
    cache_states = [c.cache_state() for c in caches]  # flushes: pending rows reach the store
    # collective: the global optimizer state, and the gathered weights of a ZeRO-3 module
    zero = optimizer.state_dict() if isinstance(optimizer, ZeroOptimizer | Zero3) else None
    prefix = zero3_prefix(model, optimizer)
    full = None
    if prefix is not None and isinstance(optimizer, Zero3):
        full = {_with_prefix(prefix, k): v for k, v in optimizer.full_state_dict().items()}
    tables = {n: c.checkpoint_parts() for n, c in parts.collections.items()}  # collective
    codecs = {n: dp.codec_state() for n, dp in parts.data_parallel.items() if dp.codec is not None}
    group.barrier()  # every rank's updates are in the shared stores before rank 0 saves them
    error: BaseException | None = None
    try:
        mine = folder / "ranks" / f"{group.rank:05d}"
        shared = parts.shared_stores()
        for j, store in enumerate(parts.hybrid_stores()):
            if id(store) not in shared:
                (mine / "stores").mkdir(parents=True, exist_ok=True)
                store.save(mine / "stores" / f"s{j:03d}")
        write_state(mine / "codec", codecs)
        write_state(mine / "cache", {f"k{i:03d}": s for i, s in enumerate(cache_states)})
        if group.rank == 0:
            _write_shared(folder, model, parts, optimizer, zero, tables, group, full)
    except Exception as e:  # every rank learns it below
        error = e
    agree(group, error, f"saving the model to {folder}")


def _write_shared(
    folder: Path,
    model: nn.Module,
    parts: ModelParts,
    optimizer: DenseOptimizer | None,
    zero: dict[str, Any] | None,
    tables: dict[str, list[Any]],
    group: ProcessGroup,
    full: dict[str, torch.Tensor] | None = None,
) -> None:
    """Rank 0's part of :func:`write_model`."""
    doc = _describe(parts, optimizer, group)
    write_state(folder / "dense", _dense_state(model, parts, full))
    if zero is not None:
        save_zero_state(zero, folder / "zero")
    elif optimizer is not None:
        write_state(folder / "optimizer", optimizer.state_dict())
    for entry in doc["collections"]:
        found = tables[entry["name"]]
        if found:
            where = folder / "embeddings" / entry["folder"] / "tables"
            where.parent.mkdir(parents=True, exist_ok=True)
            write_checkpoint(where, [(s, [p]) for s, p in found], writer="hybridrec.save_model")
    shared = parts.shared_stores()
    for j, store in enumerate(parts.hybrid_stores()):
        if id(store) in shared:  # per-rank stores: every rank saves its own (write_model)
            (folder / "stores").mkdir(exist_ok=True)
            store.save(folder / "stores" / f"s{j:03d}")
    (folder / "model.json").write_text(json.dumps(doc, indent=1), encoding="utf-8")


def _replaceable_model(folder: Path) -> None:
    """FileExistsError unless ``folder`` is a saved model (a save replaces only those)."""
    if not (folder / "model.json").is_file():
        raise FileExistsError(f"{folder} exists and is not a saved model; not replacing it")


def save_model(
    path: str | os.PathLike[str],
    model: nn.Module,
    optimizer: DenseOptimizer | None = None,
    *,
    group: ProcessGroup | None = None,
) -> Path:
    """Collective over ``group`` (default: one process): save everything of ``model``
    and ``optimizer`` to the folder ``path`` (atomic; replaces a previous save). See
    the module docstring for what is saved and how it loads at another rank count."""
    group = LocalGroup() if group is None else group
    final = Path(path)
    with saving(final, _replaceable_model, group=group, parents=True) as tmp:
        write_model(tmp, model, optimizer, group)
    return final


# ---------------------------------------------------------------- load


def read_model_doc(folder: Path) -> dict[str, Any]:
    file = folder / "model.json"
    if not file.is_file():
        raise FileNotFoundError(f"{folder} holds no saved model (no model.json)")
    doc = json.loads(file.read_text(encoding="utf-8"))
    if doc.get("format") != FORMAT:
        raise ValueError(f"{file}: format {doc.get('format')!r}, expected {FORMAT!r}")
    return doc


def _match(doc: dict[str, Any], parts: ModelParts, folder: Path) -> dict[str, dict[str, Any]]:
    """Saved collection entries by name; raises naming what differs."""
    saved = {e["name"]: e for e in doc["collections"]}
    if set(saved) != set(parts.collections):
        raise ValueError(
            f"{folder}: saved embedding collections {sorted(saved)}, this model has "
            f"{sorted(parts.collections)}"
        )
    for name, c in parts.collections.items():
        was = saved[name]["tables"]
        now = {t.name: t.placement for t in c.tables}
        if set(was) != set(now):
            raise ValueError(
                f"{folder}: collection {name!r} was saved with tables {sorted(was)}, this "
                f"model's has {sorted(now)}"
            )
        moved = [t for t in now if (was[t] == "hybrid") != (now[t] == "hybrid")]
        if moved:
            raise ValueError(
                f"{folder}: collection {name!r}: tables {moved} were saved as "
                f"{[was[t] for t in moved]} and are {[now[t] for t in moved]} now; local and "
                "sharded load into each other, hybrid tables only into hybrid ones"
            )
    return saved


def load_model(
    path: str | os.PathLike[str],
    model: nn.Module,
    optimizer: DenseOptimizer | None = None,
    *,
    group: ProcessGroup | None = None,
) -> dict[str, Any]:
    """Collective over ``group``: restore what :func:`save_model` wrote into ``model``
    (and ``optimizer``), built the same way, at any number of ranks. Returns the
    saved ``model.json`` (``world_size``: the saving rank count)."""
    group = LocalGroup() if group is None else group
    folder = Path(path)
    error: BaseException | None = None
    doc: dict[str, Any] = {}
    try:
        doc = read_model_doc(folder)
        parts = ModelParts.of(model)
        saved = _match(doc, parts, folder)
        if optimizer is not None and doc["optimizer"] is None:
            raise ValueError(f"{folder} was saved without an optimizer state")
        if doc["optimizer"] == "zero" and not isinstance(optimizer, ZeroOptimizer | Zero3 | None):
            raise ValueError(
                f"{folder} holds a ZeroOptimizer state; got a {type(optimizer).__name__}"
            )
        if doc["optimizer"] == "torch" and isinstance(optimizer, ZeroOptimizer | Zero3):
            raise ValueError(f"{folder} holds a torch optimizer state, not a ZeroOptimizer's")
    except Exception as e:
        error = e
    agree(group, error, f"checking {folder}")
    try:
        parts.settle()  # a sparse pipeline's pushes applied, its rows pulled ahead dropped
        for cache in parts.caches():
            cache.flush()  # no update of the old state may reach the store after the load
        _load_local(folder, model, parts, saved, optimizer)
    except Exception as e:
        error = e
    agree(group, error, f"loading the model from {folder}")  # also: every cache flushed
    _load_stores(folder, doc, parts, saved, group)
    try:
        _load_rank_state(folder, doc, parts, saved, group)
    except Exception as e:
        error = e
    agree(group, error, f"loading the per-rank state from {folder}")
    return doc


def _load_local(
    folder: Path,
    model: nn.Module,
    parts: ModelParts,
    saved: dict[str, dict[str, Any]],
    optimizer: DenseOptimizer | None,
) -> None:
    state = read_state(folder / "dense")
    with tables_left_out(parts):
        _load_dense(folder, model, state, optimizer)
    if optimizer is not None:
        if isinstance(optimizer, ZeroOptimizer | Zero3):
            optimizer.load_state_dict(load_zero_state(folder / "zero"))
        else:
            optimizer.load_state_dict(read_state(folder / "optimizer"))
    for name, c in parts.collections.items():
        if c.local is not None or c.sharded is not None:
            # hybrid tables: their stores are loaded on their own (_load_stores)
            c.load(folder / "embeddings" / saved[name]["folder"] / "tables", hybrid=False)


def _load_dense(
    folder: Path,
    model: nn.Module,
    state: dict[str, torch.Tensor],
    optimizer: DenseOptimizer | None,
) -> None:
    """The dense entries into ``model`` (strict: every entry, the tables left out)."""
    actual = {canonical_name(model, k): k for k in model.state_dict()}
    unknown = sorted(set(state) - set(actual))
    if unknown:
        raise ValueError(f"{folder}: saved dense entries {unknown[:5]} are not in this model")
    prefix = zero3_prefix(model, optimizer)
    if prefix is None:
        model.load_state_dict({actual[k]: v for k, v in state.items()}, strict=True)
    else:  # the ZeRO-3 module's weights go in through its optimizer (each rank keeps a shard)
        assert isinstance(optimizer, Zero3)
        head = _with_prefix(prefix, "") if prefix else ""
        mine = {actual[k]: v for k, v in state.items() if actual[k].startswith(head)}
        optimizer.load_full_state_dict({k[len(head) :]: v for k, v in mine.items()})
        rest = {actual[k]: v for k, v in state.items() if not actual[k].startswith(head)}
        model.load_state_dict(rest, strict=False)


def _load_stores(
    folder: Path,
    doc: dict[str, Any],
    parts: ModelParts,
    saved: dict[str, dict[str, Any]],
    group: ProcessGroup,
) -> None:
    """Each backing store once: rank 0 for a shared one; every rank for a per-rank one,
    rank ``m`` from saved rank ``m mod N``'s. Rows saved in another type than the
    collections' hybrid tables have are loaded in the tables' types
    (:func:`hybridrec.checkpoint.row_dtypes.store_checkpoint_as`)."""
    source = folder / "ranks" / f"{group.rank % int(doc['world_size']):05d}"
    done: set[int] = set()
    shared: list[tuple[Store, Path]] = []
    per_rank: list[tuple[Store, Path]] = []
    dtypes: dict[int, dict[str, RowDtype]] = {}  # id(store) -> {table: row type} of its tables
    for name, c in parts.collections.items():
        store = backing_store(c.store)
        if c.hybrid is None:
            continue
        dtypes.setdefault(id(store), {}).update(
            {t: cfg.dtype for t, cfg in c.hybrid.configs.items()}
        )
        if id(store) in done:
            continue
        done.add(id(store))
        part = f"s{saved[name]['store']:03d}"
        if c.hybrid.store_is_shared:
            shared.append((store, folder / "stores" / part))
        else:
            per_rank.append((store, source / "stores" / part))

    def load(stores: list[tuple[Store, Path]]) -> None:
        for store, path in stores:
            with store_checkpoint_as(path, dtypes[id(store)], folder.parent) as rows:
                store.load(rows)

    error: BaseException | None = None
    try:
        load(per_rank)
    except Exception as e:
        error = e
    agree(group, error, f"loading the per-rank stores from {folder}")
    run_on_rank0(group, lambda: load(shared), f"loading the shared stores from {folder}")


def _load_rank_state(
    folder: Path,
    doc: dict[str, Any],
    parts: ModelParts,
    saved: dict[str, dict[str, Any]],
    group: ProcessGroup,
) -> None:
    """Caches (rank ``m`` takes saved rank ``m mod N``'s) and codec states (local)."""
    n = int(doc["world_size"])
    source = folder / "ranks" / f"{group.rank % n:05d}"
    caches = read_state(source / "cache") if parts.caches() else {}
    done: set[int] = set()
    for name, c in parts.collections.items():
        if not isinstance(c.store, CachedStore) or id(c.store) in done:
            continue
        done.add(id(c.store))
        k = saved[name]["cache"]
        c.store.load_cache_state({} if k is None else caches[f"k{k:03d}"])
    with_codec = {k: dp for k, dp in parts.data_parallel.items() if dp.codec is not None}
    if not with_codec:
        return
    ranks = [group.rank] if n == group.size else list(range(n))
    states = {r: read_state(folder / "ranks" / f"{r:05d}" / "codec") for r in ranks}
    empty: dict[str, Any] = {"residuals": {}, "generators": {}}
    for name, dp in with_codec.items():
        # Every saved rank's state; at the same count only this rank's is read (and used).
        per_rank = [states[r].get(name, empty) if r in states else empty for r in range(n)]
        dp.load_codec_state(per_rank)
