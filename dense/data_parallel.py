"""Synchronous data parallelism for dense modules.

Every rank holds a full replica of the module. Rank 0's parameters (and buffers)
are broadcast so all replicas start equal; after each backward the gradients are
averaged over ranks, so the same optimizer step keeps the replicas equal.

Two ways to do the averaging:

* :class:`DataParallel` wraps the module and overlaps the averaging with backward:
  parameters are packed into buckets (``dense.buckets``, reverse registration
  order, at most ``bucket_mb`` each, one dtype per bucket) and, as soon as every
  gradient of a bucket has been accumulated, that bucket's flat buffer starts an
  async allreduce (optionally through a ``comm.compression`` codec) while autograd
  goes on computing earlier layers' gradients. A final autograd callback waits for
  all buckets and writes the averages back into ``.grad``.
* :func:`allreduce_gradients` does the same after backward, in one collective per
  dtype (no overlap; handy for loops that do not own their module).

The module may live on a GPU: the bucket buffers are made on the parameters' device.
Over nccl they travel as they are and nothing waits on the host (a handle's wait only
orders the stream). Over mpi or gloo the group stages each bucket through pinned host
memory (``comm/staging.py``): issuing a bucket waits on the host for its device-to-host
copy, and ``finish`` queues the copy back. Codecs encode and decode on the device.

Timeline of one step with three buckets (``A`` = allreduce in flight)::

    backward:  [top layers ][middle layers][bottom layers]| finish
    bucket 0:              A A A A A A A A                |  wait, copy to .grad
    bucket 1:                             A A A A A A A A |  wait, copy to .grad
    bucket 2:                                            A|A wait, copy to .grad
"""

from __future__ import annotations

import time
import zlib
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from dense.buckets import Bucket, assign_buckets

if TYPE_CHECKING:  # only the types: the group and codec are passed in by the caller
    from comm.group import ProcessGroup
    from comm.handle import Handle

_MB = 1 << 20


def _by_dtype(tensors: Iterable[torch.Tensor]) -> dict[torch.dtype, list[torch.Tensor]]:
    groups: dict[torch.dtype, list[torch.Tensor]] = {}
    for t in tensors:
        groups.setdefault(t.dtype, []).append(t)
    return groups


@torch.no_grad()
def broadcast_tensors(tensors: Sequence[torch.Tensor], group: ProcessGroup, root: int = 0) -> None:
    """Overwrite every tensor (in place) with rank ``root``'s values; one collective per dtype."""
    if group.size == 1:
        return
    for same in _by_dtype(tensors).values():
        flat = torch.cat([t.reshape(-1) for t in same])  # [sum numel]
        group.broadcast(flat, root=root)
        offset = 0
        for t in same:
            n = t.numel()
            t.copy_(flat[offset : offset + n].view_as(t))
            offset += n


@torch.no_grad()
def broadcast_parameters(module: nn.Module, group: ProcessGroup, root: int = 0) -> None:
    """Overwrite every parameter and buffer with rank ``root``'s values (collective).

    All ranks must hold modules of the same structure; a shape mismatch raises
    ``ValueError`` on every rank (the group's validation). No-op at size 1.
    """
    tensors = [p.data for p in module.parameters()] + list(module.buffers())
    broadcast_tensors(tensors, group, root)


@torch.no_grad()
def allreduce_gradients(module: nn.Module, group: ProcessGroup) -> None:
    """Average ``.grad`` of every trainable parameter over ranks (collective).

    A parameter without a gradient on this rank contributes zeros, and gets the
    averaged gradient afterwards, so every rank steps the same parameters (a rank
    cannot know whether its peers saw that parameter). No-op at size 1.
    """
    if group.size == 1:
        return
    params = [p for p in module.parameters() if p.requires_grad]
    for param in params:
        if param.grad is not None and param.grad.is_sparse:
            raise TypeError(
                f"allreduce_gradients: parameter of shape {tuple(param.shape)} has a sparse "
                "gradient; only dense gradients are supported"
            )
    for same in _by_dtype(params).values():
        # [sum numel]: one buffer, one collective.
        flat = torch.cat(
            [(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in same]
        )
        group.allreduce(flat, op="avg")
        offset = 0
        for p in same:
            n = p.numel()
            g = flat[offset : offset + n].view_as(p)
            if p.grad is None:
                p.grad = g.clone()
            else:
                p.grad.copy_(g)
            offset += n


def agree_on_layout(
    group: ProcessGroup,
    what: str,
    tensors: Sequence[torch.Tensor],
    settings: list[int],
    error: BaseException | None,
) -> None:
    """One small allgather: check that every rank wraps the same tensors and settings.

    Row per rank: ``[local error?, #tensors, total numel, crc(shapes, dtypes),
    *settings]``. A local error on any rank (``error``, which the caller raises
    afterwards), or any difference between ranks, raises ``ValueError`` on every
    rank before any data moves, instead of one rank failing while its peers hang.
    No-op at size 1.
    """
    if group.size == 1:
        return
    layout = repr([(tuple(t.shape), str(t.dtype)) for t in tensors]).encode()
    row = [
        int(error is not None),
        len(tensors),
        sum(t.numel() for t in tensors),
        zlib.crc32(layout),
        *settings,
    ]
    table = group.allgather(torch.tensor(row, dtype=torch.int64)).tolist()  # [size, len(row)]
    if error is not None:
        return  # the caller raises this rank's own error
    bad = [r for r, t in enumerate(table) if t[0]]
    if bad:
        raise ValueError(
            f"{what}: rank(s) {bad} rejected their arguments (see their errors); "
            f"rank {group.rank} stops too"
        )
    if any(t != table[0] for t in table):
        rows = "; ".join(
            f"rank {r}: {t[1]} tensors, {t[2]} elements, layout crc {t[3]}, settings {t[4:]}"
            for r, t in enumerate(table)
        )
        raise ValueError(
            f"{what}: ranks disagree on the parameters (shapes/dtypes) or settings; every "
            f"rank must pass the same: {rows}"
        )


def _resolve_codec(compression: object) -> Any:
    """``None`` -> plain allreduce; a name -> ``comm.compression.get_codec(name)``; a Codec."""
    if compression is None:
        return None
    from comm import compression as compression_mod  # optional part of comm

    if isinstance(compression, str):
        return compression_mod.get_codec(compression)
    if isinstance(compression, compression_mod.Codec):
        return compression
    raise TypeError(
        f"DataParallel: compression must be None, a codec name or a comm.compression.Codec, "
        f"got {type(compression).__name__}"
    )


class DataParallel(nn.Module):
    """Wrap ``module`` so gradients are averaged over ``group`` while backward runs.

    Usage (every rank runs the same lines)::

        model = DataParallel(MyNet(), group, bucket_mb=25.0)
        loss = loss_fn(model(x_local), y_local)   # x_local: this rank's share of the batch
        loss.backward()                            # bucket allreduces overlap with this
        model.finish()                             # no-op when backward already synced
        optimizer.step()

    * Parameters are broadcast from rank 0 at wrap time (``broadcast=True``),
      buffers too (once; not on every forward).
    * ``bucket_mb`` caps each bucket (MiB), ``first_bucket_mb`` the first one (small,
      so communication starts early in backward; as torch DDP). Every rank must wrap
      the same module structure with the same sizes and compression, else
      ``ValueError`` on every rank at wrap time.
    * ``compression``: ``None`` (exact allreduce), a codec name from
      ``comm.compression`` (``"fp16"``, ``"bf16"``, ``"terngrad"``, ``"natural"``,
      ``"topk"``, ``"none"``) or a ``Codec``; error-feedback state is kept per bucket.
    * ``ignore``: parameters (or their names in ``module.named_parameters()``) left
      alone: neither broadcast nor averaged. Parameters with ``requires_grad=False``
      are never averaged.
    * A parameter that got no gradient on a rank this step (unused branch)
      contributes zeros and receives the average, so no rank waits forever; every
      rank then holds the same ``.grad`` for it.
    * The sync finishes in an autograd callback at the end of backward. A rank
      whose backward touched no parameter at all must call :meth:`finish` itself
      (its peers wait for it); calling it always, before the optimizer step, is safe.
    * :meth:`no_sync` skips the averaging (gradient accumulation); the next synced
      backward averages the accumulated gradients.
    """

    def __init__(
        self,
        module: nn.Module,
        group: ProcessGroup,
        *,
        bucket_mb: float = 25.0,
        first_bucket_mb: float = 1.0,
        compression: object = None,
        broadcast: bool = True,
        ignore: Iterable[nn.Parameter | str] = (),
    ) -> None:
        super().__init__()
        if not isinstance(module, nn.Module):
            raise TypeError(
                f"DataParallel: module must be an nn.Module, got {type(module).__name__}"
            )
        self.module = module
        self.group = group
        named = list(module.named_parameters())
        error: Exception | None = None
        ignored: set[int] = set()
        codec: Any = None
        params: list[nn.Parameter] = []
        bucket_bytes = first_bytes = 0
        try:
            bucket_bytes = self._check_bucket_mb("bucket_mb", bucket_mb)
            first_bytes = min(
                bucket_bytes, self._check_bucket_mb("first_bucket_mb", first_bucket_mb)
            )
            ignored = self._ignored_ids(named, list(ignore))
            params = [p for _, p in named if p.requires_grad and id(p) not in ignored]
            codec = _resolve_codec(compression)
            for p in params:
                if not (p.is_floating_point() or p.is_complex()):
                    raise TypeError(
                        f"DataParallel: parameter of dtype {p.dtype} cannot be averaged"
                    )
                if codec is not None and p.dtype != torch.float32:
                    raise TypeError(
                        f"DataParallel: compression {compression!r} needs float32 parameters, "
                        f"got one of dtype {p.dtype}; pass it in ignore= or drop compression"
                    )
        except (ValueError, TypeError, ImportError) as e:
            error = e
        codec_name = compression if isinstance(compression, str) else type(compression).__name__
        agree_on_layout(
            group,
            "DataParallel",
            params,
            [bucket_bytes, first_bytes, zlib.crc32(codec_name.encode())],
            error,
        )
        if error is not None:
            raise error
        self._codec = codec
        self._params = params
        names = {id(p): n for n, p in named}
        self._names = [names[id(p)] for p in params]  # for the codec state (checkpoints)
        self._buckets: list[Bucket] = assign_buckets(params, bucket_bytes, first_bytes)
        # param index -> (bucket index, element offset in the bucket, numel)
        self._where: list[tuple[int, int, int]] = [(0, 0, 0)] * len(params)
        for b in self._buckets:
            for i, off, n in zip(b.params, b.offsets, b.numels, strict=True):
                self._where[i] = (b.index, off, n)
        self._flat: list[torch.Tensor] = [
            torch.zeros(b.numel, dtype=b.dtype, device=params[b.params[0]].device)
            for b in self._buckets
        ]  # one [numel] gradient buffer per bucket, reused every step
        if broadcast:
            kept = [p.data for _, p in named if id(p) not in ignored]
            broadcast_tensors(kept + list(module.buffers()), group)
        # Per-round state (one round = one synced backward).
        self._param_ready = [False] * len(params)
        self._bucket_count = [0] * len(self._buckets)
        self._handles: list[Handle | None] = [None] * len(self._buckets)
        self._next_launch = 0
        self._in_round = False
        self._synced = True
        self._sync_enabled = True
        #: ``(bucket index, time.perf_counter())`` of every collective issued in the
        #: last round, in issue order: shows how far the sync overlapped backward.
        self.last_launches: list[tuple[int, float]] = []
        self._hooks = [
            p.register_post_accumulate_grad_hook(self._make_hook(i)) for i, p in enumerate(params)
        ]

    # ------------------------------------------------------------------ set-up

    @staticmethod
    def _check_bucket_mb(name: str, mb: float) -> int:
        if isinstance(mb, bool) or not isinstance(mb, (int, float)):
            raise TypeError(f"DataParallel: {name} must be a number, got {mb!r}")
        if not mb > 0:
            raise ValueError(f"DataParallel: {name} must be > 0 MiB, got {mb!r}")
        return max(1, int(mb * _MB))

    @staticmethod
    def _ignored_ids(
        named: list[tuple[str, nn.Parameter]], ignore: Iterable[nn.Parameter | str]
    ) -> set[int]:
        by_name = dict(named)
        known = {id(p) for _, p in named}
        out: set[int] = set()
        for item in ignore:
            if isinstance(item, str):
                if item not in by_name:
                    raise ValueError(
                        f"DataParallel: ignore names parameter {item!r}, which the module does "
                        f"not have; it has {sorted(by_name)}"
                    )
                out.add(id(by_name[item]))
            elif isinstance(item, torch.Tensor):
                if id(item) not in known:
                    raise ValueError(
                        f"DataParallel: ignore lists a tensor of shape {tuple(item.shape)} that "
                        "is not a parameter of the module"
                    )
                out.add(id(item))
            else:
                raise TypeError(
                    f"DataParallel: ignore items must be parameters or names, got "
                    f"{type(item).__name__}"
                )
        return out

    # ------------------------------------------------------------------ module

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if torch.is_grad_enabled() and self._sync_enabled:
            self._synced = False  # a new step: finish() must sync even if no hook fires
        return self.module(*args, **kwargs)

    @property
    def buckets(self) -> list[Bucket]:
        """The bucket assignment (indices refer to :attr:`synced_parameters`)."""
        return list(self._buckets)

    @property
    def synced_parameters(self) -> list[nn.Parameter]:
        """The parameters whose gradients are averaged, in registration order."""
        return list(self._params)

    @property
    def codec(self) -> Any:
        """The ``comm.compression`` codec in use, or None."""
        return self._codec

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward passes inside accumulate local gradients without communicating."""
        old = self._sync_enabled
        self._sync_enabled = False
        try:
            yield
        finally:
            self._sync_enabled = old

    def remove_hooks(self) -> None:
        """Detach from the module's parameters (the module keeps working unsynced)."""
        for h in self._hooks:
            h.remove()
        self._hooks = []

    # ------------------------------------------------------------------ codec state

    def _bucket_key(self, b: int) -> str:
        return f"dense.DataParallel.bucket{b}"

    def codec_state(self) -> dict[str, Any]:
        """This rank's gradient-codec state, for a checkpoint (local, no communication):
        ``{"residuals": {parameter name: tensor shaped like it}, "generators":
        {device: uint8 generator state}}``. Residuals are a codec's error feedback (what
        it has not sent yet, e.g. top-k); generators drive random codecs (TernGrad,
        natural). Empty without a codec. Call it between steps, not inside a backward."""
        if self._in_round:
            raise RuntimeError("DataParallel.codec_state: a gradient sync is in flight")
        out: dict[str, Any] = {"residuals": {}, "generators": {}}
        codec = self._codec
        if codec is None:
            return out
        residuals = getattr(codec, "residuals", None)
        if isinstance(residuals, dict):
            for bucket in self._buckets:
                flat = residuals.get(self._bucket_key(bucket.index))
                if flat is None:
                    continue
                for i, off, n in zip(bucket.params, bucket.offsets, bucket.numels, strict=True):
                    p = self._params[i]
                    out["residuals"][self._names[i]] = flat[off : off + n].view_as(p).clone()
        codec.bind_rank(self.group.rank)  # the stream compressed_allreduce uses
        for device in sorted({str(f.device) for f in self._flat}):
            out["generators"][device] = codec.generator(torch.device(device)).get_state()
        return out

    def load_codec_state(self, saved: Sequence[dict[str, Any]]) -> None:
        """Restore the codec state from every saved rank's :meth:`codec_state` (``saved[r]``
        for rank ``r`` of the run that saved; local, no communication).

        * Same rank count: each rank takes its own state back, exactly.
        * Another count ``M`` (saved by ``N`` ranks): every rank takes the MEAN of the
          saved residuals. The averaged gradient the ranks apply carries the pending
          correction ``sum_r residual_r / N``; with the mean on each of the M ranks it
          is ``M * mean / M``, the same, so no delayed gradient is lost or doubled.
          Generators restart from the codec's seed and the new rank (a rank's random
          stream has no counterpart at another rank count).

        A parameter absent from the state (or a codec without residuals) starts at zero.
        """
        codec = self._codec
        if codec is None or not saved:
            return
        same = len(saved) == self.group.size
        residuals = getattr(codec, "residuals", None)
        if isinstance(residuals, dict):
            for bucket in self._buckets:
                key = self._bucket_key(bucket.index)
                flat = torch.zeros(bucket.numel, dtype=torch.float32, device=self._flat[0].device)
                found = False
                for i, off, n in zip(bucket.params, bucket.offsets, bucket.numels, strict=True):
                    name = self._names[i]
                    # Same count: this rank's own; else the mean over the saved ranks (a
                    # rank without a residual counts as zero).
                    sources = [saved[self.group.rank]] if same else list(saved)
                    mine = [s["residuals"][name] for s in sources if name in s["residuals"]]
                    if not mine:
                        continue
                    value = torch.stack([t.reshape(-1).float() for t in mine]).sum(0) / len(sources)
                    if value.numel() != n:
                        raise ValueError(
                            f"DataParallel.load_codec_state: residual of {name!r} has "
                            f"{value.numel()} values, the parameter has {n}"
                        )
                    flat[off : off + n] = value.to(flat.device)
                    found = True
                if found:
                    residuals[key] = flat
                else:
                    residuals.pop(key, None)
        if same:
            codec.bind_rank(self.group.rank)
            for device, state in saved[self.group.rank]["generators"].items():
                codec.generator(torch.device(device)).set_state(state)

    # ------------------------------------------------------------------ the round

    def _make_hook(self, index: int) -> Callable[[torch.Tensor], None]:
        def hook(param: torch.Tensor) -> None:
            self._grad_ready(index, param)

        return hook

    def _start_round(self, *, from_autograd: bool) -> None:
        self._param_ready = [False] * len(self._params)
        self._bucket_count = [0] * len(self._buckets)
        self._handles = [None] * len(self._buckets)
        self._next_launch = 0
        self._in_round = True
        self.last_launches = []
        if from_autograd:
            # Runs once the whole backward is done (all grads accumulated).
            torch.autograd.Variable._execution_engine.queue_callback(self.finish)

    @torch.no_grad()
    def _grad_ready(self, index: int, param: torch.Tensor) -> None:
        if not self._sync_enabled:
            return
        if not self._in_round:
            self._start_round(from_autograd=True)
        b, off, n = self._where[index]
        if self._param_ready[index]:
            if self._handles[b] is not None:
                raise RuntimeError(
                    f"DataParallel: parameter {index} of shape {tuple(param.shape)} got a second "
                    f"gradient after its bucket {b} was already sent in this backward pass "
                    "(reentrant backward or a parameter used by two backward calls?)"
                )
        else:
            self._param_ready[index] = True
            self._bucket_count[b] += 1
        grad = param.grad
        assert grad is not None, "post-accumulate-grad hook without a gradient"
        self._flat[b][off : off + n].copy_(grad.reshape(-1))
        if self._bucket_count[b] == len(self._buckets[b].params):
            self._launch_ready()
        else:
            self._poke()

    def _launch_ready(self) -> None:
        """Issue every complete bucket in bucket order (all ranks issue the same sequence)."""
        while self._next_launch < len(self._buckets) and self._bucket_count[
            self._next_launch
        ] == len(self._buckets[self._next_launch].params):
            self._launch(self._next_launch)
            self._next_launch += 1

    def _launch(self, b: int) -> None:
        flat = self._flat[b]
        self.last_launches.append((b, time.perf_counter()))
        if self._codec is None:
            self._handles[b] = self.group.allreduce_async(flat, op="avg")
        else:
            from comm.compression import compressed_allreduce_async

            self._handles[b] = compressed_allreduce_async(
                self.group, flat, self._codec, f"dense.DataParallel.bucket{b}"
            )

    def _poke(self) -> None:
        """Let the oldest collective in flight progress (MPI moves data only inside calls)."""
        for h in self._handles:
            if h is not None:
                h.is_completed()
                return

    @torch.no_grad()
    def finish(self) -> None:
        """Wait for every bucket and write the averaged gradients into ``.grad``.

        Called automatically at the end of a synced backward; calling it again is a
        no-op. On a rank whose backward touched no parameter it runs the whole
        round with zero gradients (its peers are waiting for it).
        """
        if not self._in_round:
            if self._synced or not self._sync_enabled:
                return
            self._start_round(from_autograd=False)
        # Parameters without a gradient this round contribute zeros (unused branches).
        for i, ready in enumerate(self._param_ready):
            if not ready:
                b, off, n = self._where[i]
                self._flat[b][off : off + n].zero_()
                self._param_ready[i] = True
                self._bucket_count[b] += 1
        self._launch_ready()
        try:
            for bucket in self._buckets:
                handle = self._handles[bucket.index]
                assert handle is not None
                handle.wait()
                flat = self._flat[bucket.index]
                for i, off, n in zip(bucket.params, bucket.offsets, bucket.numels, strict=True):
                    p = self._params[i]
                    avg = flat[off : off + n].view_as(p)
                    if p.grad is None:
                        p.grad = avg.clone()
                    else:
                        p.grad.copy_(avg)
        finally:
            self._in_round = False
            self._synced = True
            self._handles = [None] * len(self._buckets)
