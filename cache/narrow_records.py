"""A narrow table's rows in the cache's host records, on numpy (the C kernels of
:mod:`cache.kernels.records` do the same in their passes).

A record of an fp16 or bf16 table holds its row as ``D`` 2-byte values in
``ceil(D / 2)`` float32 words (:func:`cache.kernels.records.row_words`), seen here as
uint16 bits ``[K, D]``. Reads widen exactly; rows from the store are written as they are
(they are values of the type already); a row the cache computed (refreshed, or stepped
locally) is rounded stochastically by :func:`ps.rounding.round_to` with the table's
init seed, the row ids and version ``-1 - seq`` (``seq`` the cache's request number of
the write: unique per write of a row, and never a PS clock, which is >= 0).
"""

from __future__ import annotations

import numpy as np
import torch

from ps.rounding import round_to

_TORCH = {1: torch.float16, 2: torch.bfloat16}


def widen(bits: np.ndarray, kind: int) -> np.ndarray:
    """uint16 ``bits`` ``[K, D]`` of narrow ``kind`` (1 fp16, 2 bf16) as float32 ``[K, D]``
    (exact)."""
    if kind == 1:
        return bits.view(np.float16).astype(np.float32)
    return (bits.astype(np.uint32) << 16).view(np.float32)


def _bits(rows: torch.Tensor) -> np.ndarray:
    return rows.contiguous().view(torch.int16).numpy().view(np.uint16)


def exact(rows: np.ndarray, kind: int) -> np.ndarray:
    """float32 ``rows`` ``[K, D]`` holding values of narrow ``kind`` as its uint16 bits
    ``[K, D]`` (exact for such values)."""
    return _bits(torch.from_numpy(np.ascontiguousarray(rows, dtype=np.float32)).to(_TORCH[kind]))


def rounded(rows: np.ndarray, kind: int, *, seed: int, ids: np.ndarray, seq: int) -> np.ndarray:
    """float32 ``rows`` ``[K, D]`` of table ids ``ids`` ``[K]`` written by the cache's
    request ``seq``, stochastically rounded to ``kind``: uint16 bits ``[K, D]``."""
    ids_t = torch.from_numpy(np.ascontiguousarray(ids, dtype=np.int64))
    versions = torch.full_like(ids_t, -1 - seq)
    values = torch.from_numpy(np.ascontiguousarray(rows, dtype=np.float32))
    return _bits(round_to(values, _TORCH[kind], seed=seed, ids=ids_t, versions=versions))
