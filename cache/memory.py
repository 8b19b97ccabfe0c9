"""What a cache will take, before it exists: bytes on its device and in host memory.

A job sizing a cache against a GPU's memory, or saying at start where its memory goes,
asks :func:`cache_bytes` with the tables it will cache. Per cached row of a ``D``-wide
table (layouts in :mod:`cache.table_cache`):

* records in host memory (``device=None``): one ``W``-float record (row: ``D`` float32,
  or ``ceil(D / 2)`` words of a table of fp16 or bf16 rows; pending sum: ``D`` float32;
  64 bytes of metadata, with counted pushes of an element-wise optimizer ``D`` floats of
  statistics, with the optimizer's local step its ``S`` state floats, rounded up to
  64-byte lines) on the host;
* rows on a device: the row (``D`` float32, or ``D`` 2-byte values of a table of fp16
  or bf16 rows) and the pending sum, ``D`` float32 (plus the ``Q`` statistic floats of
  counted pushes and the ``S`` state floats of the optimizer's local step), on the
  device, and a 64-byte metadata record on the host;
* either way on the host: the slot's row id, eviction key, free-stack entry and a
  one-byte copy of its push count (25 bytes), the id -> slot map (4 bytes per *table*
  row for a fixed table of at most :data:`cache.config.DENSE_INDEX_MAX_ROWS` rows, else
  about 64 bytes per cached id), and TinyLFU's sketch (``4 x width x depth`` bytes).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from cache.config import DENSE_INDEX_MAX_ROWS, CacheConfig
from ps import TableSpec

META_BYTES = 64  # CLOCK, OWN, COUNT, FREQ, PF, CHECKED, PUSHED, spare: 8 int64
SLOT_BYTES = 25  # row id, eviction key, free-stack entry: 3 int64; own8: 1 byte
HASH_BYTES_PER_ID = 64  # the hash index's share per cached id (46-92 measured)


@dataclass(frozen=True, slots=True)
class CacheBytes:
    """Bytes a cache takes: ``device`` on the device its rows are on (0 when they are in
    host records), ``host`` in host memory."""

    device: int
    host: int


def stat_floats(config: CacheConfig, spec: TableSpec) -> int:
    """Floats of the counted pushes' statistic per cached row of ``spec`` (``Q``; 0 where
    pushes are not counted: ``counted_pushes`` off or no write bound)."""
    if not (config.counted_pushes and config.write_bound > 0):
        return 0
    return spec.optimizer.stat_dim(spec.dim)


def state_floats(config: CacheConfig, spec: TableSpec) -> int:
    """Floats of optimizer state per cached row of ``spec`` (``S``: the state its local
    step uses, :meth:`cache.CacheConfig.local_optimizer`; 0 for an SGD step)."""
    opt = config.local_optimizer(spec)
    return 0 if opt is None else opt.state_dim(spec.dim)


def state_in_spare_word(stat: int, state: int) -> bool:
    """Whether a record's ``state`` floats of optimizer state fit in the metadata's spare
    word beside its ``stat`` statistic floats: one float each at most."""
    return state == 1 and stat <= 1


def record_floats(dim: int, stat: int = 0, state: int = 0, *, row_words: int | None = None) -> int:
    """Floats of one host record holding row (``row_words`` floats; None: ``dim``, a
    float32 row), pending sum, metadata, a statistic of ``stat`` floats and ``state``
    floats of optimizer state, in whole 64-byte lines. The metadata's spare word holds
    a statistic of one float and, beside at most that, a state of one float."""
    extra = (stat if stat > 1 else 0) + (0 if state_in_spare_word(stat, state) else state)
    row = dim if row_words is None else row_words
    return -(-(row + dim + META_BYTES // 4 + extra) // 16) * 16


def host_row_words(spec: TableSpec) -> int:
    """Floats of a host record's row of ``spec``: ``D``, or ``ceil(D / 2)`` for a table
    of fp16 or bf16 rows (2 bytes per element)."""
    return -(-spec.dim // 2) if spec.narrow else spec.dim


def device_row_bytes(config: CacheConfig, spec: TableSpec) -> int:
    """Bytes of one cached row of ``spec`` on a device (:class:`cache.device_rows.DeviceRows`):
    the row (2 or 4 bytes per element), its ``D`` pending floats, ``Q`` statistic floats
    and ``S`` optimizer state floats."""
    floats = spec.dim + stat_floats(config, spec) + state_floats(config, spec)
    return spec.dim * (2 if spec.narrow else 4) + floats * 4


def cache_bytes(config: CacheConfig, specs: Sequence[TableSpec], *, on_device: bool) -> CacheBytes:
    """What caches of ``specs`` under ``config`` take when full; ``on_device``: rows and
    pending sums on a device (:class:`cache.CachedStore` given a ``device``)."""
    device = host = 0
    for spec in specs:
        rows = config.capacity(spec)
        q, s = stat_floats(config, spec), state_floats(config, spec)
        if on_device:
            device += rows * device_row_bytes(config, spec)
            host += rows * META_BYTES
        else:
            host += rows * record_floats(spec.dim, q, s, row_words=host_row_words(spec)) * 4
        host += rows * SLOT_BYTES
        if spec.num_rows is not None and spec.num_rows <= DENSE_INDEX_MAX_ROWS:
            host += spec.num_rows * 4
        else:
            host += rows * HASH_BYTES_PER_ID
        if config.policy == "tinylfu":
            width, depth, _ = config.sketch(rows)
            host += 4 * width * depth
    return CacheBytes(device=device, host=host)


def rows_fitting(
    specs: Sequence[TableSpec], device_bytes: int, config: CacheConfig | None = None
) -> int:
    """The most rows per table whose caches of ``specs`` (rows on a device, under
    ``config``'s bounds) take at most ``device_bytes`` there:
    ``device_bytes // sum(device_row_bytes)`` (:func:`device_row_bytes`)."""
    cfg = CacheConfig(capacity_rows=1) if config is None else config
    per_row = sum(device_row_bytes(cfg, spec) for spec in specs)
    if per_row == 0:
        raise ValueError("rows_fitting: no tables to cache")
    return max(0, int(device_bytes) // per_row)
