"""C passes over rows stored as fp16 or bf16: stochastic rounding, row-wise Adagrad, pooling.

A narrow table's update is computed in float32 and written back with the stochastic
rounding of :mod:`ps.rounding`, whose random bits come from the row's table seed, table
id and clock after the update. These passes do it in place, one pass per row:

* :func:`round_rows` -- :func:`ps.rounding.round_to` for flat rows of several tables at
  once (the torch-path optimizers write their results back through it);
* :func:`rowwise_adagrad_` / :func:`rowwise_adagrad_parts_` -- the row-wise Adagrad
  passes of :mod:`ps.kernels.rowwise_adagrad` over narrow rows: each row widened, the
  float32 kernel's own step (the same bits as on a float32 row), the row rounded back;
* :func:`pool` -- a sum pooling of narrow rows accumulated in float32
  (``F.embedding_bag`` on a narrow weight returns the narrow type).

``narrow_rows.c`` is compiled together with ``rowwise_adagrad.c`` (whose step and
gradient sums it calls) into one library, on first use, like the other kernels
(:func:`comm.native.load_c_library`). Every entry point returns False or None where the
library is not available or a tensor does not fit; callers then take their torch path
(:func:`round_rows` falls back to :func:`ps.rounding.round_to` itself).

Flat rows may hold several tables (an embedding fused group): :class:`RoundingKeys`
says which table owns a row, with which seed, and the row's id in its table.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from typing import Any

import torch

from comm.native import kernel_source, load_c_library
from ps.kernels import rowwise_adagrad
from ps.kernels.rowwise_adagrad import _parts_info, _ptr
from ps.rounding import round_to

# The C source: narrow_rows.c next to this file (package data); it is compiled after
# rowwise_adagrad.c, whose step, gradient sums and parts layout it uses (one string, built
# once: the loader's cache is keyed by it, and every call asks).
_SOURCE = kernel_source(__package__, "narrow_rows")
_LIBRARY_SOURCE = rowwise_adagrad._SOURCE + "\n" + _SOURCE

#: The kernel's code of each narrow row type.
DTYPE_CODES = {torch.float16: 1, torch.bfloat16: 2}


def load() -> ctypes.CDLL | None:
    """The compiled library (built on first use), or None where it is not available."""
    return load_c_library("hr_narrow_rows", _LIBRARY_SOURCE, _declare)  # kept after the first call


def _declare(lib: ctypes.CDLL) -> None:
    i64, ptr, f32, c_int = ctypes.c_int64, ctypes.c_void_p, ctypes.c_float, ctypes.c_int
    keys: list[Any] = [c_int, i64, ptr, ptr, ptr]  # dtype, tables, starts, seeds, row ids
    lib.hr_narrow_round.restype = c_int
    lib.hr_narrow_round.argtypes = [i64, i64, ptr, ptr, ptr, *keys, ptr]
    lib.hr_narrow_adagrad.restype = c_int
    lib.hr_narrow_adagrad.argtypes = [i64] * 3 + [ptr] * 8 + [f32, f32, *keys, c_int]
    parts: list[Any] = [i64] * 3 + [ptr] * 3 + [i64, ptr, i64] + [ptr] * 6
    lib.hr_narrow_adagrad_parts.restype = c_int
    lib.hr_narrow_adagrad_parts.argtypes = [*parts, f32, f32, *keys, c_int]
    lib.hr_narrow_pool.restype = c_int
    lib.hr_narrow_pool.argtypes = [i64, i64, c_int] + [ptr] * 5 + [c_int]


def available() -> bool:
    """Whether the narrow passes run the C kernels here."""
    return load() is not None


@dataclass(frozen=True, slots=True)
class RoundingKeys:
    """The stochastic rounding of flat rows that may hold several tables::

        dtype    torch.float16 or torch.bfloat16: the rows' type
        starts   int64 [T + 1]   table k owns flat rows [starts[k], starts[k + 1])
        seeds    int64 [T]       table k's rounding seed (its init seed)
        row_ids  int64 [R] or None  each flat row's id in its table, where it is not
                                    row - starts[k] (a server's shard)

    The tensors live where the rows do (the C passes read host tensors).
    """

    dtype: torch.dtype
    starts: torch.Tensor
    seeds: torch.Tensor
    row_ids: torch.Tensor | None = None

    def __post_init__(self) -> None:
        if self.dtype not in DTYPE_CODES:
            raise ValueError(
                f"RoundingKeys: dtype must be torch.float16 or torch.bfloat16, got {self.dtype}"
            )
        t = self.seeds.numel()
        if t < 1 or self.starts.numel() != t + 1:
            raise ValueError(
                f"RoundingKeys: starts must have one entry more than seeds ({t} tables), "
                f"got {self.starts.numel()}"
            )
        for name, v in (("starts", self.starts), ("seeds", self.seeds), ("row_ids", self.row_ids)):
            if v is not None and (v.dtype != torch.int64 or v.dim() != 1):
                raise TypeError(f"RoundingKeys: {name} must be 1-D int64, got {v.dtype}")

    @staticmethod
    def of_tables(
        dtype: torch.dtype, sizes: list[int], seeds: list[int], device: torch.device | str = "cpu"
    ) -> RoundingKeys:
        """Keys of tables of ``sizes`` rows laid end to end, seeded by ``seeds``."""
        starts = [0]
        for n in sizes:
            starts.append(starts[-1] + n)
        return RoundingKeys(
            dtype,
            torch.tensor(starts, dtype=torch.int64, device=device),
            torch.tensor(seeds, dtype=torch.int64, device=device),
        )

    def to(self, device: torch.device | str) -> RoundingKeys:
        """The same keys with their tensors on ``device``."""
        ids = None if self.row_ids is None else self.row_ids.to(device)
        return RoundingKeys(self.dtype, self.starts.to(device), self.seeds.to(device), ids)

    def tables_of(self, rows: torch.Tensor) -> torch.Tensor:
        """The table index ``[N]`` of flat ``rows`` ``[N]``."""
        return torch.searchsorted(self.starts, rows, right=True) - 1

    def ids_of(self, rows: torch.Tensor, tables: torch.Tensor) -> torch.Tensor:
        """The id in its table ``[N]`` of flat ``rows`` ``[N]`` (of ``tables`` ``[N]``)."""
        if self.row_ids is not None:
            return self.row_ids.index_select(0, rows)
        return rows - self.starts.index_select(0, tables)

    def _args(self) -> list[Any]:
        return [
            DTYPE_CODES[self.dtype], self.seeds.numel(), _ptr(self.starts), _ptr(self.seeds),
            _ptr(self.row_ids),
        ]  # fmt: skip

    def _fit(self) -> bool:
        tensors = (self.starts, self.seeds, self.row_ids)
        return all(t is None or (t.is_cpu and t.is_contiguous()) for t in tensors)


def round_rows(
    values: torch.Tensor, keys: RoundingKeys, rows: torch.Tensor, versions: torch.Tensor
) -> torch.Tensor:
    """float32 ``values`` ``[N, D]`` of flat ``rows`` ``[N]`` at ``versions`` ``[N]`` (their
    clocks after the update) stochastically rounded to ``keys.dtype``: a new ``[N, D]``
    tensor, bit for bit :func:`ps.rounding.round_to` with each row's table seed and id."""
    n, d = values.shape
    lib = load()
    host = values.is_cpu and rows.is_cpu and versions.is_cpu and keys._fit()
    if lib is not None and host:
        x = values.to(torch.float32).contiguous()
        r = rows.to(torch.int64).contiguous()
        v = versions.to(torch.int64).contiguous()
        out = torch.empty(n, d, dtype=keys.dtype)
        if lib.hr_narrow_round(n, d, _ptr(x), _ptr(r), _ptr(v), *keys._args(), _ptr(out)) == 0:
            return out
    out = torch.empty(n, d, dtype=keys.dtype, device=values.device)
    if n == 0:
        return out
    tables = keys.tables_of(rows)  # [N]
    ids = keys.ids_of(rows, tables)  # [N]
    seeds = keys.seeds.tolist()
    for k in torch.unique(tables).tolist():  # one round_to per table present
        sel = torch.nonzero(tables == k).squeeze(1)
        out[sel] = round_to(
            values[sel], keys.dtype, seed=int(seeds[k]), ids=ids[sel], versions=versions[sel]
        )
    return out


def _narrow_fit(weight: torch.Tensor, keys: RoundingKeys) -> bool:
    return (
        weight.dtype == keys.dtype
        and weight.dim() == 2
        and weight.is_cpu
        and weight.is_contiguous()
        and keys._fit()
    )


def rowwise_adagrad_(
    weight: torch.Tensor,
    state: torch.Tensor,
    clocks: torch.Tensor,
    sorted_ids: torch.Tensor,
    grad: torch.Tensor,
    *,
    lr: float,
    eps: float,
    keys: RoundingKeys,
    perm: torch.Tensor | None = None,
    bag_of: torch.Tensor | None = None,
    weights: torch.Tensor | None = None,
) -> bool:
    """:func:`ps.kernels.rowwise_adagrad.rowwise_adagrad_` on a narrow ``weight``
    ``[R, D]`` (``keys.dtype``): each touched row widened, the float32 kernel's step, its
    clock + 1, the row rounded back with the key of that clock. False (nothing changed)
    where the kernel is not available or a tensor does not fit."""
    lib = load()
    if lib is None or not _narrow_fit(weight, keys) or state.shape[1] < 1:
        return False
    d = weight.shape[1]
    if not rowwise_adagrad._fits((state, grad, weights), (clocks, sorted_ids, perm, bag_of)):
        return False
    if grad.dim() != 2 or grad.shape[1] != d:
        return False
    rc = lib.hr_narrow_adagrad(
        sorted_ids.numel(), d, state.stride(0), _ptr(sorted_ids), _ptr(perm), _ptr(bag_of),
        _ptr(weights), _ptr(grad), _ptr(weight), _ptr(state), _ptr(clocks),
        float(lr), float(eps), *keys._args(), torch.get_num_threads(),
    )  # fmt: skip
    return bool(rc == 0)


def rowwise_adagrad_parts_(
    weight: torch.Tensor,
    state: torch.Tensor,
    clocks: torch.Tensor,
    sorted_ids: torch.Tensor,
    perm: torch.Tensor,
    offsets: torch.Tensor | None,
    parts: list[torch.Tensor],
    *,
    lr: float,
    eps: float,
    keys: RoundingKeys,
    weights: torch.Tensor | None = None,
) -> bool:
    """:func:`ps.kernels.rowwise_adagrad.rowwise_adagrad_parts_` on a narrow ``weight``
    (see :func:`rowwise_adagrad_`)."""
    lib = load()
    if lib is None or not _narrow_fit(weight, keys) or state.shape[1] < 1:
        return False
    if not rowwise_adagrad._fits((state, weights), (clocks, sorted_ids, perm, offsets)):
        return False
    d = weight.shape[1]
    got = _parts_info(parts, d, offsets)
    if got is None:
        return False
    info, nbags = got
    rc = lib.hr_narrow_adagrad_parts(
        sorted_ids.numel(), d, state.stride(0),
        _ptr(sorted_ids), _ptr(perm), _ptr(offsets), nbags, _ptr(weights),
        len(parts), info[0].data_ptr(), info[1].data_ptr(), info[2].data_ptr(),
        _ptr(weight), _ptr(state), _ptr(clocks), float(lr), float(eps),
        *keys._args(), torch.get_num_threads(),
    )  # fmt: skip
    return bool(rc == 0)


def pool(
    weight: torch.Tensor,
    ids: torch.Tensor,
    offsets: torch.Tensor,
    weights: torch.Tensor | None = None,
) -> torch.Tensor | None:
    """Pooled bags ``[B, D]`` float32 of the narrow ``weight`` ``[R, D]``: bag ``b`` sums
    ``weights[i] * weight[ids[i]]`` (``weights`` None: 1) over ``offsets[b] <= i <
    offsets[b + 1]`` (``offsets`` int64 ``[B + 1]``), rows widened, accumulated in float32
    in the order of the ids. The ids must be in range (the caller checked them). None
    where the kernel is not available or a tensor does not fit."""
    lib = load()
    if lib is None or weight.dtype not in DTYPE_CODES or weight.dim() != 2:
        return None
    if not weight.is_cpu or not weight.is_contiguous():
        return None
    if not rowwise_adagrad._fits((weights,), (ids, offsets)) or offsets.numel() < 1:
        return None
    nbags, d = offsets.numel() - 1, weight.shape[1]
    out = torch.empty(nbags, d, dtype=torch.float32)
    rc = lib.hr_narrow_pool(
        nbags, d, DTYPE_CODES[weight.dtype], _ptr(ids), _ptr(offsets), _ptr(weights),
        _ptr(weight), _ptr(out), torch.get_num_threads(),
    )  # fmt: skip
    return out if rc == 0 else None
