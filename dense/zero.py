"""ZeRO: shard the optimizer state (stage 1) and the gradients (stage 2) over ranks.

The parameters are flattened per dtype into one vector of ``N`` elements, padded
to ``L = ceil(N / size) * size`` and cut into ``size`` contiguous shards of
``S = L / size``; rank ``r`` owns elements ``[r*S, (r+1)*S)``::

    params (registration order):  | w0 ......... | b0 | w1 ....... | b1 | pad |
    shards (size 3):              | rank 0      | rank 1          | rank 2    |

A step, per dtype:

* stage 1: allreduce-average the full flat gradient ``[L]``; each rank keeps only
  its slice ``[S]`` as the gradient of its shard;
* stage 2: reduce-scatter-average the flat gradient straight into the owner's
  shard ``[S]`` (no rank ever holds the full averaged gradient; the parameters'
  ``.grad`` are released after the reduce-scatter);
* then each rank steps the inner torch optimizer on its shard only (so its state,
  e.g. Adam's two moments, is ``S`` elements instead of ``N``) and the updated
  shards are allgathered back into every rank's full parameters.

Flat buffers, shards and optimizer state live on the parameters' device (a GPU
included; over mpi or gloo the group stages device tensors through pinned host memory).

This equals the unsharded optimizer for optimizers that act elementwise (SGD,
Adam, AdamW, Adagrad, RMSprop, ...); optimizers that look at whole tensors
(LAMB, LARS, Adafactor) would see shards and must not be used. A gradient that
is ``None`` counts as zeros (an unsharded optimizer would skip that parameter).

Checkpoint format (rank-count independent): :meth:`ZeroOptimizer.state_dict`
gathers the shards and returns ``{"meta": <JSON-able dict>, "tensors": {name:
tensor}}`` where ``tensors["<i>/<key>"]`` is state ``key`` (e.g. ``exp_avg``) of
parameter ``i`` in its own shape (0-d for scalars such as ``step``) and ``meta``
records the optimizer class, its hyperparameters and every parameter's shape and
dtype. It loads on any rank count; :func:`save_to_dir` / :func:`load_from_dir`
store it as ``meta.json`` plus one ``.npy`` per tensor (no pickle anywhere).
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

import numpy as np
import torch
from torch import nn

from dense.data_parallel import agree_on_layout, broadcast_tensors

if TYPE_CHECKING:  # only the types: the group is passed in by the caller
    from comm.group import ProcessGroup
    from comm.handle import Handle

FORMAT = "hybridrec.zero.v1"


@dataclass(slots=True)
class _Flat:
    """The parameters of one dtype: where each sits in the flat vector, and this rank's shard."""

    dtype: torch.dtype
    params: list[int]  # indices into ZeroOptimizer.params
    offsets: list[int]
    numel: int  # N, without padding
    shard_numel: int  # S; the padded length is S * size
    shard: nn.Parameter  # [S], this rank's elements, stepped by the inner optimizer


def _to_json(value: Any, where: str) -> Any:
    if isinstance(value, (bool, int, float, str)) or value is None:
        return value
    if isinstance(value, (tuple, list)):
        return [_to_json(v, where) for v in value]
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        return value.item()
    raise TypeError(
        f"ZeroOptimizer.state_dict: hyperparameter {where} = {value!r} is not JSON-able"
    )


class ZeroOptimizer:
    """An elementwise torch optimizer whose state (and, at stage 2, gradients) is sharded.

    Use it instead of ``optimizer_cls(params, **optimizer_kwargs)`` on a plain
    (unwrapped) module whose replicas see different data: ``step()`` averages the
    gradients over ``group`` itself, so do not also wrap the module in
    ``DataParallel``. Every rank must pass the same parameters (shapes, dtypes,
    order) and stage, else ``ValueError`` on every rank. Parameters are broadcast
    from rank 0 at construction (``broadcast=True``).

    ::

        opt = ZeroOptimizer(torch.optim.AdamW, model.parameters(), group, stage=2, lr=1e-3)
        loss_fn(model(x_local), y_local).backward()
        opt.step()
        opt.zero_grad()
    """

    def __init__(
        self,
        optimizer_cls: type[torch.optim.Optimizer],
        params: Iterable[torch.Tensor],
        group: ProcessGroup,
        *,
        stage: int = 1,
        broadcast: bool = True,
        **optimizer_kwargs: Any,
    ) -> None:
        self.group = group
        self.stage = stage
        error: Exception | None = None
        plist: list[torch.Tensor] = []
        try:
            if not (
                isinstance(optimizer_cls, type) and issubclass(optimizer_cls, torch.optim.Optimizer)
            ):
                raise TypeError(
                    f"ZeroOptimizer: optimizer_cls must be a torch.optim.Optimizer subclass, "
                    f"got {optimizer_cls!r}"
                )
            if stage not in (1, 2):
                raise ValueError(f"ZeroOptimizer: stage must be 1 or 2, got {stage!r}")
            plist = list(params)
            self._check_params(plist)
        except (TypeError, ValueError) as e:
            error = e
        agree_on_layout(group, "ZeroOptimizer", plist, [stage if stage in (1, 2) else -1], error)
        if error is not None:
            raise error
        self.params = plist
        self.optimizer_cls = optimizer_cls
        if broadcast:
            broadcast_tensors([p.data for p in plist], group)
        self._flats = self._build_flats(plist)
        # The inner optimizer sees one [S] shard per dtype: its state is ~1/size of unsharded.
        self.optimizer = optimizer_cls([f.shard for f in self._flats], **optimizer_kwargs)

    # ------------------------------------------------------------------ set-up

    @staticmethod
    def _check_params(plist: list[torch.Tensor]) -> None:
        if not plist:
            raise ValueError("ZeroOptimizer: got an empty parameter list")
        seen: set[int] = set()
        for i, p in enumerate(plist):
            if not isinstance(p, torch.Tensor):
                raise TypeError(
                    f"ZeroOptimizer: params must be tensors (parameter groups as dicts are not "
                    f"supported), item {i} is {type(p).__name__}"
                )
            if not p.is_floating_point():
                raise TypeError(f"ZeroOptimizer: parameter {i} has dtype {p.dtype}, not floating")
            if id(p) in seen:
                raise ValueError(f"ZeroOptimizer: parameter {i} appears twice in params")
            seen.add(id(p))

    def _build_flats(self, plist: list[torch.Tensor]) -> list[_Flat]:
        by_dtype: dict[torch.dtype, list[int]] = {}
        for i, p in enumerate(plist):
            by_dtype.setdefault(p.dtype, []).append(i)
        flats = []
        for dtype, members in by_dtype.items():
            offsets, n = [], 0
            for i in members:
                offsets.append(n)
                n += plist[i].numel()
            s = math.ceil(n / self.group.size)
            device = plist[members[0]].device
            shard = nn.Parameter(torch.zeros(s, dtype=dtype, device=device))
            flat = _Flat(dtype, members, offsets, n, s, shard)
            self._copy_params_to_shard(flat)
            flats.append(flat)
        return flats

    def _overlaps(self, flat: _Flat) -> Iterable[tuple[int, int, int, int]]:
        """``(param index, start in param, start in shard, length)`` of my shard's pieces."""
        lo = self.group.rank * flat.shard_numel
        hi = lo + flat.shard_numel
        for i, off in zip(flat.params, flat.offsets, strict=True):
            a, b = max(lo, off), min(hi, off + self.params[i].numel())
            if a < b:
                yield i, a - off, a - lo, b - a

    @torch.no_grad()
    def _copy_params_to_shard(self, flat: _Flat) -> None:
        # Cheap (S elements) and done every step, so a model reloaded between steps is seen.
        for i, p_start, s_start, n in self._overlaps(flat):
            flat.shard[s_start : s_start + n].copy_(
                self.params[i].detach().reshape(-1)[p_start : p_start + n]
            )

    # ------------------------------------------------------------------ stepping

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        """The inner optimizer's groups (change ``lr`` here; its ``params`` are the shards)."""
        return self.optimizer.param_groups

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.params:
            if set_to_none:
                p.grad = None
            elif p.grad is not None:
                p.grad.zero_()

    def _flat_grad(self, flat: _Flat) -> torch.Tensor:
        buf = torch.zeros(  # [S * size]; padding and missing grads stay zero
            flat.shard_numel * self.group.size, dtype=flat.dtype, device=flat.shard.device
        )
        for i, off in zip(flat.params, flat.offsets, strict=True):
            g = self.params[i].grad
            if g is not None:
                if g.is_sparse:
                    raise TypeError(f"ZeroOptimizer: parameter {i} has a sparse gradient")
                buf[off : off + g.numel()].copy_(g.reshape(-1))
        return buf

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        """Average gradients, step this rank's shard, allgather the parameters (collective)."""
        rank = self.group.rank
        pending: list[tuple[_Flat, Handle, torch.Tensor]] = []
        for flat in self._flats:
            buf = self._flat_grad(flat)  # [L]
            if self.stage == 1:
                pending.append((flat, self.group.allreduce_async(buf, op="avg"), buf))
            else:
                pending.append((flat, self.group.reduce_scatter_async(buf, op="avg"), buf))
        for flat, handle, buf in pending:
            out = handle.wait()
            s = flat.shard_numel
            # stage 1: my slice of the averaged [L]; stage 2: the [S] reduce-scatter result.
            flat.shard.grad = buf[rank * s : (rank + 1) * s].clone() if self.stage == 1 else out
            self._copy_params_to_shard(flat)
        if self.stage == 2:
            for p in self.params:  # the full gradients are no longer needed
                p.grad = None
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self.optimizer.step()
        gathers = [(flat, self.group.allgather_async(flat.shard.detach())) for flat in self._flats]
        for flat, handle in gathers:
            full = handle.wait().reshape(-1)  # [size, S] -> [L]
            for i, off in zip(flat.params, flat.offsets, strict=True):
                p = self.params[i]
                p.copy_(full[off : off + p.numel()].view_as(p))
            del full
        for flat in self._flats:
            flat.shard.grad = None
        return loss

    # ------------------------------------------------------------------ memory

    def state_bytes(self) -> int:
        """Bytes of optimizer state held by this rank (about 1/size of unsharded)."""
        total = 0
        for st in self.optimizer.state.values():
            for v in st.values():
                if isinstance(v, torch.Tensor):
                    total += v.numel() * v.element_size()
        return total

    def shard_numel(self) -> int:
        """Elements of the parameters this rank owns (all dtypes)."""
        return sum(f.shard_numel for f in self._flats)

    # ------------------------------------------------------------------ checkpoints

    def _meta(self) -> dict[str, Any]:
        shapes = [(tuple(p.shape), p.dtype) for p in self.params]
        return state_meta(self.optimizer_cls, self.optimizer.param_groups, shapes)

    @torch.no_grad()
    def state_dict(self) -> dict[str, Any]:
        """The GLOBAL optimizer state (collective: every rank must call it).

        Returns ``{"meta": dict, "tensors": {"<i>/<key>": tensor}}``; see the module
        docstring. Every rank receives the full state; typically rank 0 saves it.
        """
        shapes = [p.shape for p in self.params]

        def full_of(flat: _Flat, shard: torch.Tensor) -> Iterator[tuple[int, torch.Tensor]]:
            full = self.group.allgather(shard.detach().contiguous()).reshape(-1)  # [L]
            for i, off in zip(flat.params, flat.offsets, strict=True):
                yield i, full[off : off + shapes[i].numel()].view(shapes[i]).clone()

        tensors = global_state_tensors(self.optimizer, self._flats, full_of, "ZeroOptimizer")
        return {"meta": self._meta(), "tensors": tensors}

    @torch.no_grad()
    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Load a state from :meth:`state_dict`, saved at any rank count (local: no comm)."""
        tensors = check_state(state, self._meta(), "ZeroOptimizer.load_state_dict")
        shapes = [tuple(p.shape) for p in self.params]
        for flat in self._flats:
            self.optimizer.state[flat.shard] = shard_of_state(
                tensors, flat, shapes, self.group.rank, self.group.size,
                "ZeroOptimizer.load_state_dict",
            )  # fmt: skip
        load_param_groups(self.optimizer, state["meta"])


class FlatLayout(Protocol):
    """Where parameters sit in a flat vector of ``shard_numel * size`` elements."""

    params: list[int]  # parameter indices (into the checkpoint's parameter list)
    offsets: list[int]
    shard_numel: int
    shard: nn.Parameter


Flat = TypeVar("Flat", bound=FlatLayout)


def global_state_tensors(
    optimizer: torch.optim.Optimizer,
    flats: Iterable[Flat],
    full_of: Callable[[Flat, torch.Tensor], Iterator[tuple[int, torch.Tensor]]],
    who: str,
) -> dict[str, torch.Tensor]:
    """Collective: ``{"<i>/<key>": tensor}``, the optimizer state of every parameter in
    its own shape, from the ``[S]`` shard states (``full_of`` allgathers one and cuts it
    per parameter; scalars such as ``step`` are copied to every parameter of the flat)."""
    tensors: dict[str, torch.Tensor] = {}
    for flat in flats:
        state = optimizer.state.get(flat.shard, {})
        for key in sorted(state):
            value = state[key]
            if not isinstance(value, torch.Tensor):
                raise TypeError(
                    f"{who}.state_dict: state {key!r} is a {type(value).__name__}, "
                    "only tensor state is supported"
                )
            if value.dim() == 0:
                for i in flat.params:
                    tensors[f"{i}/{key}"] = value.detach().clone()
                continue
            if tuple(value.shape) != (flat.shard_numel,):
                raise ValueError(
                    f"{who}.state_dict: state {key!r} has shape {tuple(value.shape)}, "
                    f"expected the shard's ({flat.shard_numel},) or a scalar"
                )
            for i, t in full_of(flat, value):
                tensors[f"{i}/{key}"] = t
    return tensors


def state_meta(
    optimizer_cls: type[torch.optim.Optimizer],
    param_groups: list[dict[str, Any]],
    shapes: list[tuple[tuple[int, ...], torch.dtype]],
) -> dict[str, Any]:
    """The ``meta`` of a checkpoint: format, optimizer, hyperparameters, parameter shapes."""
    groups = [{k: _to_json(v, k) for k, v in g.items() if k != "params"} for g in param_groups]
    return {
        "format": FORMAT,
        "optimizer": optimizer_cls.__name__,
        "param_groups": groups,
        "params": [{"shape": list(shape), "dtype": str(dtype)} for shape, dtype in shapes],
    }


def check_state(state: dict[str, Any], want: dict[str, Any], who: str) -> dict[str, torch.Tensor]:
    """Check a global state against this optimizer's :func:`state_meta`; its tensors."""
    meta, tensors = state.get("meta"), state.get("tensors")
    if not isinstance(meta, dict) or not isinstance(tensors, dict):
        raise ValueError(f"{who}: expected {{'meta': ..., 'tensors': ...}}")
    if meta.get("format") != FORMAT:
        raise ValueError(f"{who}: format {meta.get('format')!r}, expected {FORMAT!r}")
    if meta.get("optimizer") != want["optimizer"]:
        raise ValueError(
            f"{who}: state is for {meta.get('optimizer')!r}, this optimizer is "
            f"{want['optimizer']!r}"
        )
    got = meta.get("params")
    if got != want["params"]:
        diff = [
            i for i, (a, b) in enumerate(zip(got or [], want["params"], strict=False)) if a != b
        ]
        raise ValueError(
            f"{who}: the state is for {len(got or [])} parameters, this optimizer has "
            f"{len(want['params'])}; first differing parameters: {diff[:5]}"
        )
    return tensors


def shard_of_state(
    tensors: dict[str, torch.Tensor],
    flat: FlatLayout,
    shapes: list[tuple[int, ...]],
    rank: int,
    size: int,
    who: str,
) -> dict[str, torch.Tensor]:
    """This rank's ``[S]`` slice of each state (scalars as they are) of ``flat``'s parameters.

    A parameter without state in ``tensors`` (it never had a gradient where the state
    was saved, e.g. an unused layer under stage 3) starts from zeros, as a fresh
    optimizer state would.
    """
    members = set(flat.params)
    keys = sorted({n.split("/", 1)[1] for n in tensors if int(n.split("/", 1)[0]) in members})
    device = flat.shard.device
    out: dict[str, torch.Tensor] = {}
    for key in keys:
        parts = [tensors.get(f"{i}/{key}") for i in flat.params]
        present = [t for t in parts if t is not None]
        if present[0].dim() == 0:
            out[key] = present[0].detach().clone().to(device)
            continue
        full = torch.zeros(flat.shard_numel * size, dtype=present[0].dtype)  # [L]
        for i, off, t in zip(flat.params, flat.offsets, parts, strict=True):
            if t is None:
                continue
            if tuple(t.shape) != shapes[i]:
                raise ValueError(
                    f"{who}: tensor {i}/{key} has shape {tuple(t.shape)}, parameter {i} has "
                    f"{shapes[i]}"
                )
            full[off : off + t.numel()].copy_(t.reshape(-1))
        s = flat.shard_numel
        out[key] = full[rank * s : (rank + 1) * s].clone().to(device)
    return out


def load_param_groups(optimizer: torch.optim.Optimizer, meta: dict[str, Any]) -> None:
    """Set the hyperparameters saved in ``meta`` (``lr``, ``betas``, ...) on ``optimizer``."""
    for group_now, saved in zip(optimizer.param_groups, meta["param_groups"], strict=False):
        for k, v in saved.items():
            group_now[k] = tuple(v) if isinstance(group_now.get(k), tuple) else v


def _npy_dtype(t: torch.Tensor) -> tuple[np.ndarray, str]:
    if t.dtype == torch.bfloat16:  # numpy has no bfloat16: keep its bits
        return t.detach().cpu().view(torch.int16).numpy(), "bfloat16"
    return t.detach().cpu().numpy(), str(t.dtype).removeprefix("torch.")


def save_to_dir(state: dict[str, Any], path: str | Path) -> None:
    """Write a :meth:`ZeroOptimizer.state_dict` as ``meta.json`` + ``<n>.npy`` files."""
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    index = []
    for n, (name, t) in enumerate(sorted(state["tensors"].items())):
        arr, dtype = _npy_dtype(t)
        file = f"{n:06d}.npy"
        np.save(out / file, arr, allow_pickle=False)
        index.append({"name": name, "file": file, "dtype": dtype, "shape": list(t.shape)})
    doc = {"meta": state["meta"], "tensors": index}
    (out / "meta.json").write_text(json.dumps(doc, indent=1))


def load_from_dir(path: str | Path) -> dict[str, Any]:
    """Read what :func:`save_to_dir` wrote; the result goes to ``load_state_dict``."""
    src = Path(path)
    doc = json.loads((src / "meta.json").read_text())
    tensors: dict[str, torch.Tensor] = {}
    for entry in doc["tensors"]:
        arr = np.load(src / entry["file"], allow_pickle=False)
        t = torch.from_numpy(np.ascontiguousarray(arr))
        if entry["dtype"] == "bfloat16":
            t = t.view(torch.bfloat16)
        tensors[entry["name"]] = t.reshape(entry["shape"])
    return {"meta": doc["meta"], "tensors": tensors}
