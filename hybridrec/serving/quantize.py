"""Compact row formats of an exported table, and reading rows back as float32.

* ``fp32``: the rows as trained, ``[n, D]`` float32 (4 D bytes a row).
* ``fp16``: ``[n, D]`` float16 (2 D bytes a row); a row reads back within fp16's
  relative rounding, 2^-11 of each value.
* ``int8``: row-wise quantized as TorchRec's inference tables are: per row ``bias = min``,
  ``scale = (max - min) / 255``, ``codes = round((x - bias) / scale)`` as uint8 ``[n, D]``
  and ``scale_bias [n, 2]`` float32 (D + 8 bytes a row). A row reads back as
  ``codes * scale + bias``, within ``scale / 2`` of each value; a constant row has
  scale 0 and reads back exactly.
"""

from __future__ import annotations

from typing import Literal

import numpy as np

TableDtype = Literal["fp32", "fp16", "int8"]
TABLE_DTYPES: tuple[TableDtype, ...] = ("fp32", "fp16", "int8")
LEVELS = 255  # uint8 codes 0 ... 255


def row_bytes(dtype: TableDtype, dim: int) -> int:
    """Bytes one row takes in ``dtype``'s files (the row file plus its scale and bias)."""
    return {"fp32": 4 * dim, "fp16": 2 * dim, "int8": dim + 8}[dtype]


def quantize_rows(rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """float32 ``[n, D]`` -> ``(codes uint8 [n, D], scale_bias float32 [n, 2])``."""
    rows = np.asarray(rows, dtype=np.float32)
    lo = rows.min(axis=1, initial=np.inf) if rows.shape[1] else np.zeros(len(rows), np.float32)
    hi = rows.max(axis=1, initial=-np.inf) if rows.shape[1] else lo
    scale = ((hi - lo) / np.float32(LEVELS)).astype(np.float32)  # [n]
    safe = np.where(scale > 0, scale, np.float32(1.0))  # a constant row: codes 0, scale 0
    codes = np.rint((rows - lo[:, None]) / safe[:, None])  # [n, D] in [0, 255]
    codes = np.clip(codes, 0, LEVELS).astype(np.uint8)
    return codes, np.stack([scale, lo], axis=1).astype(np.float32)


def encode_rows(rows: np.ndarray, dtype: TableDtype) -> dict[str, np.ndarray]:
    """The arrays a table of ``dtype`` stores: ``rows`` (and ``scale_bias`` for int8)."""
    rows = np.ascontiguousarray(rows, dtype=np.float32)  # [n, D]
    if dtype == "fp32":
        return {"rows": rows}
    if dtype == "fp16":
        return {"rows": rows.astype(np.float16)}
    if dtype == "int8":
        codes, scale_bias = quantize_rows(rows)
        return {"rows": codes, "scale_bias": scale_bias}
    raise ValueError(f"table dtype must be one of {TABLE_DTYPES}, got {dtype!r}")
