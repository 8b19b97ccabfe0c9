"""Argument checks shared by every backend.

Local checks (contiguity, ranks in range, splits that add up) cost nothing.
Cross-rank checks exchange a fixed-size int64 signature of each rank's tensor
(dtype code, ndim, shape) with one small allgather, compare every rank against
rank 0, and raise the same ``ValueError`` on every rank, naming the ranks, the
argument and the numbers.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from comm.group import ProcessGroup

# A stable code per dtype, so signatures compare across processes.
_DTYPES: tuple[torch.dtype, ...] = (
    torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64,
    torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool,
    torch.complex64, torch.complex128,
)  # fmt: skip
_MAX_DIMS = 8  # signature: [dtype, ndim, numel, dim0 .. dim7]


def check_contiguous(group: ProcessGroup, op: str, arg: str, tensor: object) -> None:
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(
            f"{op}: rank {group.rank} passed {arg} of type {type(tensor).__name__}; "
            "expected a torch.Tensor"
        )
    if not tensor.is_contiguous():
        raise ValueError(
            f"{op}: rank {group.rank} passed a non-contiguous {arg} (shape "
            f"{tuple(tensor.shape)}, strides {tensor.stride()}); call .contiguous() first"
        )


def check_rank(group: ProcessGroup, op: str, arg: str, value: int) -> None:
    if not isinstance(value, int) or not 0 <= value < group.size:
        raise ValueError(
            f"{op}: rank {group.rank} passed {arg}={value!r}; expected a rank in [0, {group.size})"
        )


def check_splits(
    group: ProcessGroup, op: str, arg: str, splits: Sequence[int], total: int | None
) -> list[int]:
    out = [int(s) for s in splits]
    if len(out) != group.size:
        raise ValueError(
            f"{op}: rank {group.rank} passed {len(out)} {arg} {out}; expected one per "
            f"rank ({group.size})"
        )
    if any(s < 0 for s in out):
        raise ValueError(f"{op}: rank {group.rank} passed negative {arg} {out}")
    if total is not None and sum(out) != total:
        raise ValueError(
            f"{op}: rank {group.rank} passed {arg} {out} that add up to {sum(out)}, "
            f"but the tensor has {total} rows"
        )
    return out


def dtype_code(dtype: torch.dtype) -> int:
    try:
        return _DTYPES.index(dtype)
    except ValueError:
        raise TypeError(f"dtype {dtype} is not supported by comm") from None


def _signature(tensor: torch.Tensor, skip_first_dim: bool) -> torch.Tensor:
    shape = list(tensor.shape)
    if skip_first_dim and shape:
        shape[0] = -1
    numel = -1 if skip_first_dim else tensor.numel()
    dims = (shape + [0] * _MAX_DIMS)[:_MAX_DIMS]
    return torch.tensor([dtype_code(tensor.dtype), tensor.dim(), numel, *dims], dtype=torch.int64)


def _describe(sig: list[int]) -> str:
    ndim = sig[1]
    dims = sig[3 : 3 + min(ndim, _MAX_DIMS)]
    shape = tuple("*" if d == -1 else d for d in dims)
    return f"dtype {str(_DTYPES[sig[0]]).removeprefix('torch.')} shape {shape}"


def check_same_across_ranks(
    group: ProcessGroup, op: str, arg: str, tensor: torch.Tensor, *, skip_first_dim: bool = False
) -> None:
    """Raise on every rank if ranks disagree on ``tensor``'s dtype or shape.

    With ``skip_first_dim`` the row count may differ (alltoallv, allgatherv).
    """
    sig = _signature(tensor, skip_first_dim)
    if tensor.is_cuda:
        sig = sig.to(tensor.device)
    table = group._allgather_async(sig).wait().cpu().tolist()
    ref = table[0]
    for r, row in enumerate(table):
        if row != ref:
            raise ValueError(
                f"{op}: ranks disagree on {arg}: rank {r} passed {_describe(row)}, "
                f"rank 0 passed {_describe(ref)}"
            )


def exchange_splits(group: ProcessGroup, send: list[int]) -> list[int]:
    """Alltoall of the counts: element ``p`` of the result is what peer ``p`` sends here."""
    counts = torch.tensor(send, dtype=torch.int64)
    ones = [1] * group.size
    got: torch.Tensor = group._alltoallv_async(counts, ones, ones).wait()
    return [int(x) for x in got.tolist()]
