"""The C library's allocator told to keep freed memory for reuse (glibc ``mallopt``).

A training step allocates the same large buffers every step and frees them: the pooled
embedding outputs (``[B, D]`` per feature, ~14 MB a step in the DLRM benchmark), the
rows a pull brings (``[U, D]``, a size that changes with every batch), the row
gradients, the push's sums. glibc's malloc serves blocks above its mmap threshold
(128 KB, raised only to the size of the last such block freed) with a fresh ``mmap``
and gives them back on ``free``, and it trims free memory at the top of its heap above
128 KB: so the next step writes to pages the kernel must fault in and zero again. In
the DLRM benchmark at two threads that was 1.5-6 k minor page faults a step for the
hybrid tables (local tables 0.3-2 k), and the cached hybrid step ran at 0.84 of local
tables' speed against 0.88 without them.

:func:`keep_freed_memory` raises both thresholds, so blocks below ``limit_mb`` come from
the heap and up to ``limit_mb`` of freed memory stays mapped for the next step: the
faults fall to ~0 a step. The price is a resident size that stays near its peak,
as with the jemalloc or tcmalloc that PyTorch's CPU tuning guides preload for the same
reason. The jobs set it when they start (``--keep-freed-mb``, :class:`Launch`); a
process that builds its model from the packages directly may call it itself. Where
the C library is not glibc (no ``mallopt``) nothing changes.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
from collections.abc import Callable

# mallopt's parameters (glibc's malloc.h)
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_INT_MAX = 2**31 - 1  # mallopt takes a C int


@functools.cache
def _mallopt() -> Callable[[int, int], int] | None:
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name) if name else ctypes.CDLL(None)
        fn = libc.mallopt
    except (OSError, AttributeError):  # no C library found, or one without mallopt
        return None
    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.c_int, ctypes.c_int]
    return fn


def keep_freed_memory(limit_mb: int) -> bool:
    """Serve blocks below ``limit_mb`` MiB from the heap and keep up to ``limit_mb`` MiB of
    freed heap memory mapped (process-wide, for the rest of the process); True where the
    C library took both settings. ``limit_mb`` 0 changes nothing (False)."""
    if not isinstance(limit_mb, int) or isinstance(limit_mb, bool) or limit_mb < 0:
        raise ValueError(f"keep_freed_memory: limit_mb must be an int >= 0, got {limit_mb!r}")
    fn = _mallopt()
    if limit_mb == 0 or fn is None:
        return False
    limit = min(limit_mb << 20, _INT_MAX)
    # The mmap threshold first: a trim threshold alone turns off glibc's raising of the
    # mmap threshold, leaving every block above 128 KB a fresh mmap (worse than before).
    # glibc before 2.26 refuses thresholds above 32 MiB: then 32 MiB.
    if fn(_M_MMAP_THRESHOLD, limit) != 1 and fn(_M_MMAP_THRESHOLD, min(limit, 32 << 20)) != 1:
        return False
    return fn(_M_TRIM_THRESHOLD, limit) == 1
