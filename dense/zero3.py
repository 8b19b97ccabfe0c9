"""ZeRO stage 3: parameters, gradients and optimizer state all sharded over ranks.

The model is cut into UNITS: every direct child module that holds parameters (the
children of a ``ModuleList`` / ``ModuleDict`` one by one, so each ``Block`` of a
GPT is a unit), plus the parameters registered on the model itself as one more
unit. A unit's parameters are flattened per dtype into ``N`` elements, padded to
``L = ceil(N / size) * size`` and cut into ``size`` shards of ``S = L / size``
exactly as :mod:`dense.zero` does; rank ``r`` keeps only elements
``[r*S, (r+1)*S)``::

    unit blocks.1 (flat):  | ln1.w ln1.b qkv.w qkv.b proj.w ... mlp.proj.b | pad |
    shards (size 2):       | rank 0                   | rank 1                     |

Between uses a unit's full parameters hold no memory. Its flat buffer ``[L]`` is
allocated when the unit is about to compute and its storage is released
(``untyped_storage().resize_(0)``) afterwards; the model's parameters are views of
that buffer while it is live and empty tensors otherwise (so a stray use fails on
a shape instead of reading freed memory). The tensors autograd saved for backward
(a Linear's ``weight.t()``, ...) are views of the same storage, so they are freed
with it and see the data again when the storage is refilled.

One training step, per unit (one collective per unit and dtype each time):

* forward pre-hook: allgather the shards (or wait for the prefetch issued
  earlier), then start the async allgather of the unit expected next (the order
  of the previous forward; registration order at first);
* forward hook: free the full parameters; hook every output tensor that needs a
  gradient, so the unit is gathered again when backward reaches it;
* output-gradient hook (before the unit's backward): gather again and prefetch
  the unit that ran before it in forward;
* when every parameter of the unit has its gradient (``post_accumulate_grad``
  hooks; a unit called twice accumulates once, after both calls' backward):
  reduce-scatter-average the flat gradient ``[L]`` into this rank's shard
  gradient ``[S]`` (async), drop the full gradients and free the parameters; at
  the end of backward (an autograd engine callback) the units not complete yet
  (some parameter unused) are finished the same way, and the reduce-scatters are
  waited;
* ``step()``: the inner torch optimizer steps the shards only (no allgather: the
  next forward gathers what it needs).

Shards, flat buffers and optimizer state live on the parameters' device (a GPU
included; over mpi or gloo the group stages device tensors through pinned host memory).

This equals one process on the global batch for elementwise optimizers (SGD,
Adam, AdamW, ...), like :class:`dense.ZeroOptimizer`. Every rank must run the
same units in the same order (the gathers are collectives), the parameters of a
unit must be used only inside that unit's forward, and a parameter may belong to
one unit only. All parameters must be trainable floating-point tensors; buffers
stay replicated and untouched.

Checkpoints: :meth:`Zero3.state_dict` gathers the optimizer state to the global
form :meth:`dense.ZeroOptimizer.state_dict` writes (parameter ``i`` = the i-th of
``model.parameters()``), so stage 1, 2 and 3 states load into one another at any
rank count; :meth:`Zero3.full_state_dict` gathers the model's full tensors under
the keys of ``model.state_dict()``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from dense.data_parallel import agree_on_layout, broadcast_tensors
from dense.zero import (
    check_state,
    global_state_tensors,
    load_param_groups,
    shard_of_state,
    state_meta,
)

if TYPE_CHECKING:  # only the types: the group is passed in by the caller
    from comm.group import ProcessGroup
    from comm.handle import Handle

ROOT_UNIT = "(root)"  # the name of the unit of the parameters registered on the model itself


@dataclass(slots=True, eq=False)
class _Flat:
    """One unit's parameters of one dtype: their places in the flat ``[L]``; this rank's shard."""

    dtype: torch.dtype
    params: list[int]  # indices into Zero3.params (model.parameters() order)
    offsets: list[int]
    numel: int  # N, without padding
    shard_numel: int  # S; the padded length L is S * size
    shard: nn.Parameter  # [S], this rank's elements, stepped by the inner optimizer
    full: torch.Tensor  # [L]; its storage is released (0 bytes) while the unit is not in use


@dataclass(slots=True, eq=False)
class _Unit:
    """A module whose parameters are gathered together; ``module`` is where the hooks sit."""

    name: str
    module: nn.Module
    flats: list[_Flat]
    n_params: int
    gathered: bool = False
    gathering: list[Handle] = field(default_factory=list)  # in-flight allgathers, one per flat
    accumulated: int = 0  # parameters whose gradient is complete in the running backward
    done: bool = False  # gradients reduce-scattered in the running backward


class Zero3:
    """Train ``model`` with its parameters, gradients and optimizer state sharded over ``group``.

    Every rank builds the same model (parameters are broadcast from rank 0 unless
    ``broadcast=False``), then calls the model (or this object) on its own slice of
    the batch::

        z = Zero3(model, group, torch.optim.AdamW, lr=1e-3)
        loss = gpt_loss(z(tok_emb_local), targets_local)  # same as model(...)
        loss.backward()                                   # gradients reduce-scattered
        z.step()                                          # shards stepped
        z.zero_grad()

    The model's parameters keep their identity and shapes but hold no data outside
    a unit's forward and backward: read the model through :meth:`full_state_dict`
    and load it through :meth:`load_full_state_dict`, not ``model.state_dict()``.
    Bad arguments raise ``ValueError`` / ``TypeError`` on every rank.
    """

    def __init__(
        self,
        model: nn.Module,
        group: ProcessGroup,
        optimizer_cls: type[torch.optim.Optimizer],
        *,
        broadcast: bool = True,
        **optimizer_kwargs: Any,
    ) -> None:
        self.group = group
        error: Exception | None = None
        plist: list[torch.Tensor] = []
        members: list[tuple[str, nn.Module, list[int]]] = []
        try:
            if not isinstance(model, nn.Module):
                raise TypeError(f"Zero3: model must be an nn.Module, got {type(model).__name__}")
            if not (
                isinstance(optimizer_cls, type) and issubclass(optimizer_cls, torch.optim.Optimizer)
            ):
                raise TypeError(
                    f"Zero3: optimizer_cls must be a torch.optim.Optimizer subclass, "
                    f"got {optimizer_cls!r}"
                )
            plist = list(model.parameters())
            members = _units_of(model, plist)
        except (TypeError, ValueError) as e:
            error = e
        agree_on_layout(group, "Zero3", plist, [len(members)], error)
        if error is not None:
            raise error
        self.model = model
        self.params = plist
        self._shapes = [p.shape for p in plist]  # the parameters' own shapes, kept while freed
        self.optimizer_cls = optimizer_cls
        if broadcast:
            broadcast_tensors([p.data for p in plist], group)
        self.units = [self._build_unit(name, module, idx) for name, module, idx in members]
        # The inner optimizer sees one [S] shard per unit and dtype: ~1/size of the state.
        self.optimizer = optimizer_cls(
            [f.shard for u in self.units for f in u.flats], **optimizer_kwargs
        )
        self._order: list[_Unit] = [u for u in self.units if u.name != ROOT_UNIT]
        self._calls: list[_Unit] = []  # units in the order the running forward called them
        self._reducing: list[tuple[_Flat, Handle]] = []
        self._callback_queued = False
        self._live_bytes = 0  # gathered parameters + full gradients being reduced right now
        self._peak_live_bytes = 0
        self._hooks = self._install_hooks()

    # ------------------------------------------------------------------ set-up

    def _build_unit(self, name: str, module: nn.Module, idx: list[int]) -> _Unit:
        by_dtype: dict[torch.dtype, list[int]] = {}
        for i in idx:
            by_dtype.setdefault(self.params[i].dtype, []).append(i)
        flats = []
        size, rank = self.group.size, self.group.rank
        for dtype, members in by_dtype.items():
            offsets, n = [], 0
            for i in members:
                offsets.append(n)
                n += self.params[i].numel()
            s = math.ceil(n / size)
            device = self.params[members[0]].device
            full = torch.zeros(s * size, dtype=dtype, device=device)  # [L]
            with torch.no_grad():
                for i, off in zip(members, offsets, strict=True):
                    full[off : off + self.params[i].numel()].copy_(self.params[i].reshape(-1))
            shard = nn.Parameter(full[rank * s : (rank + 1) * s].clone())  # [S]
            flats.append(_Flat(dtype, members, offsets, n, s, shard, full))
        unit = _Unit(name, module, flats, len(idx))
        self._release(unit)  # the model's own full copies go with it
        return unit

    def _install_hooks(self) -> list[Any]:
        hooks: list[Any] = [
            self.model.register_forward_pre_hook(self._model_pre_forward),
            self.model.register_forward_hook(self._model_post_forward),
        ]
        for unit in self.units:
            if unit.name != ROOT_UNIT:
                hooks.append(unit.module.register_forward_pre_hook(self._pre_forward_hook(unit)))
                hooks.append(unit.module.register_forward_hook(self._post_forward_hook(unit)))
            for flat in unit.flats:
                for i in flat.params:
                    hooks.append(
                        self.params[i].register_post_accumulate_grad_hook(self._acc_hook(unit))
                    )
        return hooks

    # ------------------------------------------------------------------ gather / free

    def _start_gather(self, unit: _Unit) -> None:
        if unit.gathered or unit.gathering:
            return
        unit.gathering = [self.group.allgather_async(f.shard.detach()) for f in unit.flats]

    @torch.no_grad()
    def _gather(self, unit: _Unit) -> None:
        """Make the unit's full parameters live (waits for a prefetch if one is in flight)."""
        if unit.gathered:
            return
        self._start_gather(unit)
        for flat, handle in zip(unit.flats, unit.gathering, strict=True):
            out = handle.wait().reshape(-1)  # [size, S] -> [L]
            nbytes = flat.full.numel() * flat.full.element_size()
            flat.full.untyped_storage().resize_(nbytes)
            # Through .data: the copy must not bump the version counter autograd checks.
            flat.full.data.copy_(out)
            for i, off in zip(flat.params, flat.offsets, strict=True):
                p = self.params[i]
                p.data = flat.full[off : off + _numel(self._shape(i))].view(self._shape(i))
            self._add_live(nbytes)
        unit.gathering = []
        unit.gathered = True

    def _release(self, unit: _Unit) -> None:
        """Drop the unit's full parameters (waits for an unused prefetch first)."""
        for handle in unit.gathering:
            handle.wait()
        unit.gathering = []
        for flat in unit.flats:
            for i in flat.params:
                self.params[i].data = torch.empty(0, dtype=flat.dtype, device=flat.full.device)
            if flat.full.untyped_storage().nbytes() > 0:
                flat.full.untyped_storage().resize_(0)
                if unit.gathered:
                    self._add_live(-flat.full.numel() * flat.full.element_size())
        unit.gathered = False

    def _shape(self, i: int) -> torch.Size:
        return self._shapes[i]

    def _add_live(self, nbytes: int) -> None:
        self._live_bytes += nbytes
        self._peak_live_bytes = max(self._peak_live_bytes, self._live_bytes)

    # ------------------------------------------------------------------ forward hooks

    def _model_pre_forward(self, module: nn.Module, args: Any) -> None:
        if not _in_backward():  # (a recomputation inside backward is not a new forward)
            self._calls = []
        for unit in self.units:
            if unit.name == ROOT_UNIT:
                self._gather(unit)

    def _model_post_forward(self, module: nn.Module, args: Any, output: Any) -> None:
        if self._calls:
            self._order = list(self._calls)  # the prefetch order of the next forward
        if _in_backward():
            return  # recomputation inside backward: keep what backward gathered
        for unit in self.units:
            if unit.name == ROOT_UNIT:
                self._hook_outputs(unit, output, self._calls, -1)
            if unit.gathered or unit.gathering:
                self._release(unit)  # the root unit, and prefetches nobody used

    def _pre_forward_hook(self, unit: _Unit) -> Callable[[nn.Module, Any], None]:
        def hook(module: nn.Module, args: Any) -> None:
            if _in_backward():  # recomputation inside backward: only make the unit live
                self._gather(unit)
                return
            c = len(self._calls)
            self._calls.append(unit)
            self._gather(unit)
            if c + 1 < len(self._order) and self._order[c] is unit:
                self._start_gather(self._order[c + 1])

        return hook

    def _post_forward_hook(self, unit: _Unit) -> Callable[[nn.Module, Any, Any], None]:
        def hook(module: nn.Module, args: Any, output: Any) -> None:
            if _in_backward():
                return  # recomputation inside backward: the unit's backward follows
            self._hook_outputs(unit, output, self._calls, len(self._calls) - 1)
            self._release(unit)

        return hook

    def _hook_outputs(self, unit: _Unit, output: Any, calls: list[_Unit], call: int) -> None:
        """Gather ``unit`` again when backward reaches any of its outputs."""
        if not torch.is_grad_enabled():
            return
        for t in _tensors_in(output):
            if t.requires_grad:
                t.register_hook(self._pre_backward_hook(unit, calls, call))

    # ------------------------------------------------------------------ backward hooks

    def _pre_backward_hook(
        self, unit: _Unit, calls: list[_Unit], call: int
    ) -> Callable[[torch.Tensor], None]:
        def hook(grad: torch.Tensor) -> None:
            self._queue_callback()
            if not unit.done:
                self._gather(unit)
            # The unit that ran before this call in forward runs next in backward.
            if call > 0 and not calls[call - 1].done:
                self._start_gather(calls[call - 1])

        return hook

    def _acc_hook(self, unit: _Unit) -> Callable[[torch.Tensor], None]:
        def hook(param: torch.Tensor) -> None:
            self._queue_callback()
            unit.accumulated += 1
            if unit.accumulated == unit.n_params:
                self._reduce(unit)

        return hook

    def _queue_callback(self) -> None:
        if not self._callback_queued:
            self._callback_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward)

    @torch.no_grad()
    def _reduce(self, unit: _Unit) -> None:
        """Start the reduce-scatter of the unit's gradients; free its full parameters."""
        for flat in unit.flats:
            grads = [self.params[i].grad for i in flat.params]
            if all(g is None for g in grads):
                continue  # no gradient on any rank (same graph everywhere): nothing to send
            buf = torch.zeros(  # [L]; padding and missing gradients stay zero
                flat.full.numel(), dtype=flat.dtype, device=flat.shard.device
            )
            for i, off, g in zip(flat.params, flat.offsets, grads, strict=True):
                if g is not None:
                    if g.is_sparse:
                        raise TypeError(f"Zero3: parameter {i} has a sparse gradient")
                    buf[off : off + g.numel()].copy_(g.reshape(-1))
                    self.params[i].grad = None
            # The peak so far counts autograd's full gradients and buf, briefly both alive.
            grad_bytes = 2 * buf.numel() * buf.element_size()
            self._add_live(grad_bytes)
            self._add_live(-grad_bytes)
            self._reducing.append((flat, self.group.reduce_scatter_async(buf, op="avg")))
        unit.done = True
        self._release(unit)

    @torch.no_grad()
    def _end_of_backward(self) -> None:
        for unit in self.units:  # the same order on every rank
            if not unit.done and (unit.accumulated or unit.gathered or unit.gathering):
                self._reduce(unit)
        self._wait_reductions()
        for unit in self.units:
            unit.accumulated, unit.done = 0, False
        self._callback_queued = False

    def _wait_reductions(self) -> None:
        for flat, handle in self._reducing:
            part = handle.wait()  # [S]: the average over ranks of my shard's gradient
            if flat.shard.grad is None:
                flat.shard.grad = part
            else:
                flat.shard.grad.add_(part)  # gradient accumulation over several backwards
        self._reducing = []

    # ------------------------------------------------------------------ stepping

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.model(*args, **kwargs)

    forward = __call__

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        """The inner optimizer's groups (change ``lr`` here; its ``params`` are the shards)."""
        return self.optimizer.param_groups

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        """Step the inner optimizer on this rank's shards (local: the gradients are reduced)."""
        self._wait_reductions()
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self.optimizer.step()
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.params:  # normally None already (dropped once reduce-scattered)
            p.grad = None
        for unit in self.units:
            for flat in unit.flats:
                if set_to_none:
                    flat.shard.grad = None
                elif flat.shard.grad is not None:
                    flat.shard.grad.zero_()

    # ------------------------------------------------------------------ memory

    def _flats(self) -> Iterator[_Flat]:
        for unit in self.units:
            yield from unit.flats

    def memory_bytes(self) -> int:
        """Bytes this rank holds between steps: parameter shards, gradient shards (counted
        whether allocated right now or not: they live from backward to ``step``) and the
        optimizer state. About 1/size of :meth:`unsharded_bytes`."""
        total = 0
        for flat in self._flats():
            total += 2 * flat.shard_numel * flat.shard.element_size()
            for v in self.optimizer.state.get(flat.shard, {}).values():
                if isinstance(v, torch.Tensor):
                    total += v.numel() * v.element_size()
        return total

    def peak_memory_bytes(self) -> int:
        """:meth:`memory_bytes` plus the most gathered parameters and full gradients seen
        at once so far (a unit computing, the next one prefetched, one unit's gradients)."""
        return self.memory_bytes() + self._peak_live_bytes

    def unsharded_bytes(self) -> int:
        """What one process with the unsharded optimizer holds: parameters, gradients and
        the same optimizer state per parameter (scalars such as ``step`` once per tensor)."""
        total = 0
        for flat in self._flats():
            el = flat.shard.element_size()
            total += 2 * flat.numel * el
            for v in self.optimizer.state.get(flat.shard, {}).values():
                if isinstance(v, torch.Tensor):
                    if v.dim() == 0:
                        total += len(flat.params) * v.element_size()
                    else:
                        total += flat.numel * v.element_size()
        return total

    # ------------------------------------------------------------------ checkpoints

    def _meta(self) -> dict[str, Any]:
        shapes = [(tuple(self._shape(i)), p.dtype) for i, p in enumerate(self.params)]
        return state_meta(self.optimizer_cls, self.optimizer.param_groups, shapes)

    def _full_of(self, flat: _Flat, shard: torch.Tensor) -> Iterator[tuple[int, torch.Tensor]]:
        """Allgather a ``[S]`` tensor of ``flat`` (collective); yield each parameter's part."""
        full = self.group.allgather(shard.detach().contiguous()).reshape(-1)  # [L]
        for i, off in zip(flat.params, flat.offsets, strict=True):
            shape = self._shape(i)
            yield i, full[off : off + _numel(shape)].view(shape).clone()

    @torch.no_grad()
    def state_dict(self) -> dict[str, Any]:
        """The GLOBAL optimizer state, the form of :meth:`dense.ZeroOptimizer.state_dict`
        (collective: every rank must call it; every rank receives the whole state)."""
        tensors = global_state_tensors(self.optimizer, self._flats(), self._full_of, "Zero3")
        return {"meta": self._meta(), "tensors": tensors}

    @torch.no_grad()
    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Load a global optimizer state (stage 1, 2 or 3, saved at any rank count; local)."""
        tensors = check_state(state, self._meta(), "Zero3.load_state_dict")
        shapes = [tuple(shape) for shape in self._shapes]
        for flat in self._flats():
            self.optimizer.state[flat.shard] = shard_of_state(
                tensors, flat, shapes, self.group.rank, self.group.size, "Zero3.load_state_dict"
            )
        load_param_groups(self.optimizer, state["meta"])

    @torch.no_grad()
    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The model's full tensors under the keys of ``model.state_dict()`` (collective;
        every rank receives all of them): parameters gathered, buffers as they are."""
        gathered: dict[int, torch.Tensor] = {}
        for flat in self._flats():
            gathered.update(self._full_of(flat, flat.shard))
        index = {id(p): i for i, p in enumerate(self.params)}
        out: dict[str, torch.Tensor] = {}
        for name, t in self.model.state_dict(keep_vars=True).items():
            i = index.get(id(t))
            out[name] = gathered[i] if i is not None else t.detach().clone()
        return out

    @torch.no_grad()
    def load_full_state_dict(self, tensors: dict[str, torch.Tensor]) -> None:
        """Load full model tensors (e.g. :meth:`full_state_dict`'s, or a plain model's
        ``state_dict()``); every rank passes all of them and keeps its shard (local)."""
        index = {id(p): i for i, p in enumerate(self.params)}
        own = self.model.state_dict(keep_vars=True)
        missing = sorted(set(own) - set(tensors))
        extra = sorted(set(tensors) - set(own))
        if missing or extra:
            raise ValueError(
                f"Zero3.load_full_state_dict: missing keys {missing[:5]}, unexpected keys "
                f"{extra[:5]} (expected the keys of model.state_dict())"
            )
        by_index: dict[int, torch.Tensor] = {}
        for name, t in own.items():
            i = index.get(id(t))
            want = tuple(self._shape(i)) if i is not None else tuple(t.shape)
            if tuple(tensors[name].shape) != want:
                raise ValueError(
                    f"Zero3.load_full_state_dict: {name} has shape "
                    f"{tuple(tensors[name].shape)}, expected {want}"
                )
            if i is None:
                t.copy_(tensors[name])
            else:
                by_index[i] = tensors[name]
        rank = self.group.rank
        for flat in self._flats():
            lo = rank * flat.shard_numel
            for i, off in zip(flat.params, flat.offsets, strict=True):
                src = by_index[i].reshape(-1)
                a, b = max(lo, off), min(lo + flat.shard_numel, off + src.numel())
                if a < b:
                    flat.shard[a - lo : b - lo].copy_(src[a - off : b - off])

    def close(self) -> None:
        """Remove the hooks (the model stays sharded: gather it with :meth:`full_state_dict`)."""
        for h in self._hooks:
            h.remove()
        self._hooks = []


def _tensors_in(output: Any) -> Iterator[torch.Tensor]:
    """The tensors of a forward's output (a tensor, or tuples / lists / dicts of them)."""
    if isinstance(output, torch.Tensor):
        yield output
    elif isinstance(output, tuple | list):
        for item in output:
            yield from _tensors_in(item)
    elif isinstance(output, dict):
        for item in output.values():
            yield from _tensors_in(item)


def _numel(shape: torch.Size) -> int:
    return math.prod(shape)


def _in_backward() -> bool:
    return bool(torch._C._current_graph_task_id() != -1)


def _unit_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """Direct children that hold parameters; a ModuleList / ModuleDict stands for its children."""
    out: list[tuple[str, nn.Module]] = []

    def visit(prefix: str, module: nn.Module) -> None:
        for name, child in module.named_children():
            full = f"{prefix}{name}"
            if isinstance(child, nn.ModuleList | nn.ModuleDict):
                visit(f"{full}.", child)
            elif any(True for _ in child.parameters()):
                out.append((full, child))

    visit("", model)
    return out


def _units_of(
    model: nn.Module, plist: list[torch.Tensor]
) -> list[tuple[str, nn.Module, list[int]]]:
    """``(name, module, parameter indices)`` per unit; raises on what Zero3 cannot shard."""
    if not plist:
        raise ValueError("Zero3: the model has no parameters (nothing to shard)")
    index = {id(p): i for i, p in enumerate(plist)}
    names = {id(p): n for n, p in model.named_parameters()}
    for p in plist:
        if not p.is_floating_point():
            raise TypeError(f"Zero3: parameter {names[id(p)]} has dtype {p.dtype}, not floating")
        if not p.requires_grad:
            raise ValueError(
                f"Zero3: parameter {names[id(p)]} is frozen (requires_grad=False); every "
                "parameter must be trainable (keep frozen tensors as buffers)"
            )
    owner: dict[int, str] = {}
    units: list[tuple[str, nn.Module, list[int]]] = []
    for name, module in _unit_modules(model):
        idx = []
        for p in module.parameters():
            if id(p) in owner:
                raise ValueError(
                    f"Zero3: parameter {names[id(p)]} is shared by units {owner[id(p)]!r} and "
                    f"{name!r}; a parameter must belong to one unit only"
                )
            owner[id(p)] = name
            idx.append(index[id(p)])
        units.append((name, module, sorted(idx)))
    rest = []
    for name, p in model.named_parameters(recurse=False):
        if id(p) in owner:
            raise ValueError(
                f"Zero3: parameter {name} of the model itself is also in unit {owner[id(p)]!r}; "
                "a parameter must belong to one unit only"
            )
        rest.append(index[id(p)])
    if rest:
        units.append((ROOT_UNIT, model, rest))
    return units
