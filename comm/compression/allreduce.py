"""Average a gradient over ranks with every rank's contribution compressed.

``compressed_allreduce_async(group, flat, codec, key)``::

    encode(flat)                       this rank's Encoded: payload [+ scale] [+ indices]
    allgather_async(each component)    one collective per component, all in flight at once
    ... (caller overlaps other work) ...
    handle.wait():  flat[:] = sum_r decode(encoded_r) / size     (in place, float32)

Every codec here produces components whose shapes depend only on ``numel`` (top-k
sends exactly ``k(numel)`` entries), so a plain allgather does the job; allgatherv
would cost one more exchange of row counts. A sum of compressed values is not
compressed (ternary codes of two ranks sum to five levels, top-k index sets differ),
hence gather + decode + average rather than an allreduce in the compressed domain.
``"none"`` is the exception: a plain average allreduce (nothing to decode).

On a size-1 group the codec still runs (``flat`` becomes ``decode(encode(flat))``),
so the effect of compression can be tested and measured on one process.

Input checks: ``flat`` must be a contiguous float32 1-D tensor with finite values,
else ``ValueError`` naming ``key``. With ``group.validate`` on, the ranks first agree
(one small allgather) so a bad input on any rank raises on every rank instead of
leaving its peers waiting until their timeout.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch

from comm.compression.base import Codec, Encoded, check_vector, rebuild
from comm.compression.casts import NoCompression
from comm.group import ProcessGroup
from comm.handle import Handle


def _check_flat(flat: object, key: str) -> None:
    check_vector(flat, key, "compressed_allreduce")
    assert isinstance(flat, torch.Tensor)
    if flat.dtype != torch.float32 or not flat.is_contiguous():
        raise ValueError(
            f"compressed_allreduce: gradient {key!r} must be a contiguous float32 tensor "
            f"(it is averaged in place), got dtype {flat.dtype}, contiguous="
            f"{flat.is_contiguous()}"
        )


def _agree_inputs(group: ProcessGroup, key: str, error: ValueError | None) -> None:
    """Raise on every rank if any rank's input was bad (only with ``group.validate``)."""
    if group.validate and group.size > 1:
        flags = group.allgather(torch.tensor([0 if error is None else 1], dtype=torch.int64))
        bad = [r for r in range(group.size) if int(flags[r, 0])]
        if error is not None:
            raise error
        if bad:
            raise ValueError(
                f"compressed_allreduce: gradient {key!r} was bad on rank(s) {bad} (see their "
                f"error); rank {group.rank}'s input was fine"
            )
    elif error is not None:
        raise error


def compose(
    handles: list[Handle], finish: Callable[[list[Any]], Any], *, what: str, timeout_s: float
) -> Handle:
    """One handle over several in flight; ``finish(results)`` makes its result.

    ``wait(timeout)`` waits for each part within one shared deadline (each part
    raises :class:`comm.CommTimeoutError` naming itself if it runs out).
    """

    def test() -> bool:
        return all(h.is_completed() for h in handles)

    def block(limit: float) -> None:
        deadline = time.monotonic() + limit
        for h in handles:
            h.wait(max(deadline - time.monotonic(), 1e-3))

    def ordered() -> None:
        for h in handles:
            h.wait()

    return Handle(
        test,
        lambda: finish([h.wait() for h in handles]),
        what=what,
        timeout_s=timeout_s,
        block=block,
        # Parts that wait on the device stream (nccl): so does the whole.
        ordered=ordered if handles and all(h.stream_ordered for h in handles) else None,
    )


def compressed_allreduce_async(
    group: ProcessGroup, flat: torch.Tensor, codec: Codec, key: str
) -> Handle:
    """Start averaging ``flat`` (float32 ``[n]``) over ranks through ``codec``.

    ``wait()`` leaves ``sum_r decode(encode_r(flat_r)) / size`` in ``flat`` and
    returns it. ``key`` names the buffer (error-feedback state, error messages).
    """
    error: ValueError | None = None
    try:
        _check_flat(flat, key)
    except ValueError as e:
        error = e
    _agree_inputs(group, key, error)
    codec.bind_rank(group.rank)
    n = flat.numel()
    what = f"compressed_allreduce[{codec.name}] of {key!r} on rank {group.rank}"

    if isinstance(codec, NoCompression):
        codec.count(n, 4 * n)
        if group.size == 1:
            return Handle.completed(flat, what)
        return group.allreduce_async(flat, op="avg")

    enc = codec.encode_checked(flat, key)  # flat was checked above
    if group.size == 1 or n == 0:
        if n:
            flat.copy_(codec.decode(enc, n))
        return Handle.completed(flat, what)

    names = list(enc.parts())
    handles = [group.allgather_async(t.contiguous()) for t in enc.parts().values()]
    size = group.size

    def finish(gathered: list[torch.Tensor]) -> torch.Tensor:
        # gathered[j]: [size, *component_j.shape]; decode rank by rank, in rank order.
        total = torch.zeros(n, dtype=torch.float32, device=flat.device)
        for r in range(size):
            enc_r: Encoded = rebuild(enc, {nm: g[r] for nm, g in zip(names, gathered, strict=True)})
            total += codec.decode(enc_r, n)
        return flat.copy_(total.div_(size))

    return compose(handles, finish, what=what, timeout_s=group.timeout_s)


def compressed_allreduce(
    group: ProcessGroup, flat: torch.Tensor, codec: Codec, key: str
) -> torch.Tensor:
    """:func:`compressed_allreduce_async` and wait: ``flat`` holds the average."""
    result: torch.Tensor = compressed_allreduce_async(group, flat, codec, key).wait()
    return result
