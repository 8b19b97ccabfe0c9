"""Argument checks shared by every backend: plain functions of the arguments, this
rank's number and the group size, so they run before anything is sent.

Local checks (contiguity, ranks in range, splits that add up) cost nothing.
Cross-rank checks compare a fixed-size int64 signature of each rank's tensor
(dtype code, ndim, shape): :func:`signature_row` builds this rank's row, the group
(``ProcessGroup._agree``) exchanges the rows in one small allgather, and
:func:`signature_rows` / :func:`check_signatures` compare every rank against rank 0
and raise the same ``ValueError`` on every rank, naming the ranks, the argument and
the numbers.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

# A stable code per dtype, so signatures compare across processes.
_DTYPES: tuple[torch.dtype, ...] = (
    torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64,
    torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool,
    torch.complex64, torch.complex128,
)  # fmt: skip
_MAX_DIMS = 8  # signature: [dtype, ndim, numel, dim0 .. dim7]
_ZEROS = [0] * _MAX_DIMS
_CODES = {dt: i for i, dt in enumerate(_DTYPES)}


def check_avg_dtype(rank: int, op: str, tensor: torch.Tensor) -> None:
    """An average over ranks needs a floating-point or complex tensor (the one check of
    every collective that averages)."""
    if not (tensor.is_floating_point() or tensor.is_complex()):
        raise TypeError(
            f"{op}: op 'avg' needs a floating-point tensor, rank {rank} passed {tensor.dtype}"
        )


def check_contiguous(rank: int, op: str, arg: str, tensor: object) -> None:
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(
            f"{op}: rank {rank} passed {arg} of type {type(tensor).__name__}; "
            "expected a torch.Tensor"
        )
    if not tensor.is_contiguous():
        raise ValueError(
            f"{op}: rank {rank} passed a non-contiguous {arg} (shape "
            f"{tuple(tensor.shape)}, strides {tensor.stride()}); call .contiguous() first"
        )


def check_rank(rank: int, size: int, op: str, arg: str, value: int) -> None:
    if not isinstance(value, int) or not 0 <= value < size:
        raise ValueError(
            f"{op}: rank {rank} passed {arg}={value!r}; expected a rank in [0, {size})"
        )


def check_splits(
    rank: int, size: int, op: str, arg: str, splits: Sequence[int], total: int | None
) -> list[int]:
    out = [int(s) for s in splits]
    if len(out) != size:
        raise ValueError(
            f"{op}: rank {rank} passed {len(out)} {arg} {out}; expected one per rank ({size})"
        )
    if any(s < 0 for s in out):
        raise ValueError(f"{op}: rank {rank} passed negative {arg} {out}")
    if total is not None and sum(out) != total:
        raise ValueError(
            f"{op}: rank {rank} passed {arg} {out} that add up to {sum(out)}, "
            f"but the tensor has {total} rows"
        )
    return out


def _signature(tensor: torch.Tensor | None, skip_first_dim: bool) -> list[int]:
    if tensor is None:  # this rank failed its own checks; its row only carries the flag
        return [0] * (2 + _MAX_DIMS + 1)
    shape = list(tensor.shape)
    if skip_first_dim and shape:
        shape[0] = -1
    numel = -1 if skip_first_dim else tensor.numel()
    dims = (shape + _ZEROS)[:_MAX_DIMS]
    return [_CODES[tensor.dtype], len(shape), numel, *dims]


def _describe(sig: list[int]) -> str:
    ndim = sig[1]
    dims = sig[3 : 3 + min(ndim, _MAX_DIMS)]
    shape = tuple("*" if d == -1 else d for d in dims)
    return f"dtype {str(_DTYPES[sig[0]]).removeprefix('torch.')} shape {shape}"


_SIG = 3 + _MAX_DIMS  # signature columns after the error flag


def signature_row(
    tensor: torch.Tensor | None, failed: bool, skip_first_dim: bool, extra: list[int]
) -> list[int]:
    """This rank's row of the argument allgather: ``[failed, signature, *extra]``."""
    return [int(failed), *_signature(tensor, skip_first_dim), *extra]


def signature_rows(rank: int, table: list[list[int]], failed: bool) -> list[list[int]]:
    """Every rank's ``[signature, *extra]`` from the gathered rows of
    :func:`signature_row` (``table``: one per rank).

    Raises on every rank if any rank ``failed`` its local checks (that rank raises
    its own, more precise, error instead).
    """
    bad = [r for r, t in enumerate(table) if t[0]]
    if bad and not failed:
        raise ValueError(
            f"rank(s) {bad} passed bad arguments to this collective (their own error says "
            f"which); rank {rank}'s arguments were fine and nothing was sent"
        )
    return [t[1:] for t in table]


def check_signatures(op: str, arg: str, table: list[list[int]]) -> None:
    """Raise the same ValueError on every rank if ranks disagree on dtype or shape."""
    ref = table[0][:_SIG]
    for r, row in enumerate(table):
        if row[:_SIG] != ref:
            raise ValueError(
                f"{op}: ranks disagree on {arg}: rank {r} passed {_describe(row[:_SIG])}, "
                f"rank 0 passed {_describe(ref)}"
            )


def check_recv_splits(rank: int, op: str, sends: list[list[int]], expects: list[list[int]]) -> None:
    """Every rank's given ``recv_splits`` (row of ``expects``; -1s = not given) must equal
    what the peers send it. Every rank raises: a rank that got its own splits wrong
    names its own mistake, the others name the first rank that did."""
    me = rank
    order = [me] + [q for q in range(len(expects)) if q != me]  # own mistake named first
    for q in order:
        want = expects[q]
        if want[0] < 0:
            continue
        got = [sends[p][q] for p in range(len(sends))]
        if want != got:
            bad = next(p for p in range(len(got)) if want[p] != got[p])
            raise ValueError(
                f"{op}: rank {q} expects recv_splits[{bad}]={want[bad]} rows from rank {bad}, "
                f"but rank {bad} sends {got[bad]} (recv_splits={want}, peers send {got})"
            )
