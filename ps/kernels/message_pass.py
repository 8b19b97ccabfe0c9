"""C passes over whole batched messages of the MPI parameter server.

A ``PULL_MANY`` or ``PUSH_MANY`` of 26 tables served part by part in Python pays
~65 us of fixed cost per part (the checks' tensors, views, counters, the table's
branches) against a few microseconds of rows: the server was busy ~1.8 ms per
message beyond its rows' kernels. These passes check and serve every part of one
message in C, reading the request's words and writing the reply's in place:

* :func:`pull_check` then :func:`pull_apply`: table indices, sizes, id ranges and
  routing of every part, then each part's clocks, the bound's selection (a
  conditional part) and its rows gathered straight into the reply;
* :func:`push_check` then :func:`push_apply`: the same checks plus strictly
  increasing ids and finite gradients (and, for a counted push, counts >= 1 and
  statistics finite and >= 0), then row-wise Adagrad on every part in place with the
  table engine's own step (``adagrad()`` of ``rowwise_adagrad.c``, or its counted
  form ``hr_rowwise_adagrad_counted``, built into this library), so the bits are the
  ones ``LocalTable.push`` gives.

Tables of fp16 / bf16 rows (``spec.narrow``): a pull copies the stored 16-bit rows
(``packed``: into the reply's data words in the table's type, the layout of
:func:`ps.mpi.wire.pack_values`; else widened to float32); a plain push widens each row,
takes the same float32 row step and writes the row back stochastically rounded with
``narrow_rows.c``'s functions (built into this library too), keyed by (the table's init
seed, the row's table id, its clock after the update, column): the bits of
``LocalTable.push``. A counted push of a narrow table goes the Python path.

A check says only whether the pass can serve the message exactly as the Python path
would; where it cannot (another optimizer, a dynamic table, unsorted or repeated ids,
a bad id, a NaN) nothing has changed and the server takes its Python path, which
serves the message or replies with its error. Table descriptors and counters are
laid out in ``message_pass.c``'s header; :class:`ps.mpi.batched_pass.BatchedPass`
builds them. Every entry point returns None where the library is not available.
"""

from __future__ import annotations

import ctypes

import numpy as np

from comm.native import kernel_source, load_c_library
from ps.kernels import narrow_rows
from ps.table import ROW_DTYPES

# The C source: message_pass.c next to this file (package data); it is compiled after
# rowwise_adagrad.c and narrow_rows.c, whose row step, widening and rounding it calls (one
# string, built once: the loader's cache is keyed by it).
_SOURCE = kernel_source(__package__, "message_pass")
_LIBRARY_SOURCE = narrow_rows._LIBRARY_SOURCE + "\n" + _SOURCE

#: int64 words per table descriptor and counters per table (see message_pass.c).
TABLE_WORDS = 12
COUNTER_WORDS = 8
#: The descriptor's code of each row type (``ps.table.ROW_DTYPES`` order, as on the wire).
ROW_CODES = {dtype: code for code, dtype in enumerate(ROW_DTYPES)}


def width_word(dim: int, dtype: str) -> int:
    """A table of contents' width word: ``dim`` with the row type's code above its low
    32 bits (``ps.mpi.wire.width_word``); the passes refuse a part whose type is not its
    table's."""
    return dim | (ROW_CODES[dtype] << 32)


def _library() -> ctypes.CDLL | None:
    return load_c_library("hr_message_pass", _LIBRARY_SOURCE, _declare)  # kept after the first call


def _declare(lib: ctypes.CDLL) -> None:
    i64, ptr, c_int = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int
    lib.hr_pull_check.restype = ctypes.c_int
    lib.hr_pull_check.argtypes = [i64, ptr, i64, ptr, ptr, i64, c_int, c_int, ptr]
    lib.hr_pull_apply.restype = ctypes.c_int
    lib.hr_pull_apply.argtypes = [i64, ptr, ptr, ptr, c_int, c_int, ptr, ptr, ptr, ptr, c_int]
    lib.hr_push_check.restype = ctypes.c_int
    lib.hr_push_check.argtypes = [
        i64, ptr, i64, ptr, i64, ptr, ptr, i64, ptr, ptr, i64, c_int, c_int
    ]  # fmt: skip
    lib.hr_push_apply.restype = ctypes.c_int
    lib.hr_push_apply.argtypes = [i64, ptr, ptr, ptr, ptr, ptr, ptr, ptr, ptr, c_int, c_int]
    lib.hr_write_check.restype = ctypes.c_int
    lib.hr_write_check.argtypes = [i64, ptr, ptr, ptr, ptr, ptr, ptr, i64]
    lib.hr_write_apply.restype = None
    lib.hr_write_apply.argtypes = [i64, ptr, ptr, ptr, ptr, ptr, ptr]


def available() -> bool:
    return _library() is not None


def pull_check(
    toc: np.ndarray,
    words: np.ndarray,
    tables: np.ndarray,
    with_state: bool = False,
    packed: bool = False,
) -> tuple[int, int] | None:
    """``(reply words after the header, row floats)`` of a ``PULL_MANY`` the pass can
    serve: ``toc`` int64 ``[k, 4]``, ``words`` int64 ``[W]`` (each part's ids, then its
    caller clocks when conditional), ``tables`` int64 ``[T, TABLE_WORDS]``;
    ``with_state``: each row's optimizer state follows its values; ``packed``: narrow
    rows go back in their type (the reply's data words), else widened. None: take the
    Python path."""
    lib = _library()
    if lib is None:
        return None
    sizes = np.empty(2, dtype=np.int64)
    rc = lib.hr_pull_check(
        toc.shape[0], toc.ctypes.data, words.size, words.ctypes.data, tables.ctypes.data,
        tables.shape[0], int(with_state), int(packed), sizes.ctypes.data,
    )  # fmt: skip
    return None if rc != 0 else (int(sizes[0]), int(sizes[1]))


def pull_apply(
    toc: np.ndarray,
    words: np.ndarray,
    tables: np.ndarray,
    counters: np.ndarray,
    reply: np.ndarray,
    rows: np.ndarray,
    threads: int,
    with_state: bool = False,
    packed: bool = False,
) -> tuple[int, int]:
    """Serve a checked ``PULL_MANY`` into ``reply`` (int64, the words after the header)
    and ``rows`` (float32; ``with_state``: each row's optimizer state after its values),
    parts of different tables on up to ``threads`` threads; returns the reply words and
    row floats written (``packed`` as :func:`pull_check` took it)."""
    lib = _library()
    assert lib is not None  # pull_check said yes
    used = np.empty(2, dtype=np.int64)
    rc = lib.hr_pull_apply(
        toc.shape[0], toc.ctypes.data, words.ctypes.data, tables.ctypes.data, int(with_state),
        int(packed), counters.ctypes.data, reply.ctypes.data, rows.ctypes.data,
        used.ctypes.data, threads,
    )  # fmt: skip
    if rc != 0:
        raise MemoryError("pull_many: the server could not allocate a buffer of the pull pass")
    return int(used[0]), int(used[1])


#: A counted push's update counts int64 ``[N]`` and statistics float32 ``[N]`` (row-wise
#: Adagrad's one sum of ``mean(g ** 2)`` per row), or None for a plain push.
Counted = tuple[np.ndarray, np.ndarray] | None


def _address(a: np.ndarray | None) -> int | None:
    return None if a is None else a.ctypes.data


def push_check(
    toc: np.ndarray,
    ids: np.ndarray,
    grads: np.ndarray,
    tables: np.ndarray,
    counted: Counted,
    packed: bool = False,
    threads: int = 1,
) -> bool:
    """Whether the pass can apply a ``PUSH_MANY``: ``toc`` int64 ``[k, 3]``, ``ids`` int64
    ``[N]``, ``grads`` float32 ``[sum n * dim]`` (``packed``: a narrow part's in data
    words of its table's type), ``counted`` (see :data:`Counted`); the parts' values
    checked on up to ``threads`` OpenMP threads (the same verdict on any number)."""
    lib = _library()
    if lib is None:
        return False
    counts, stats = (None, None) if counted is None else counted
    rc = lib.hr_push_check(
        toc.shape[0], toc.ctypes.data, ids.size, ids.ctypes.data, grads.size, grads.ctypes.data,
        _address(counts), 0 if stats is None else stats.size, _address(stats),
        tables.ctypes.data, tables.shape[0], int(packed), max(1, int(threads)),
    )  # fmt: skip
    return rc == 0


def push_apply(
    toc: np.ndarray,
    ids: np.ndarray,
    grads: np.ndarray,
    tables: np.ndarray,
    hyper: np.ndarray,
    counters: np.ndarray,
    threads: int,
    counted: Counted,
    packed: bool = False,
) -> None:
    """Apply a checked ``PUSH_MANY`` in place (``hyper`` float32 ``[T, 2]``: lr, eps),
    parts of different tables on up to ``threads`` threads; a counted one with each row's
    update count and statistic (``counted``, and ``packed``, as :func:`push_check`
    accepted them)."""
    lib = _library()
    assert lib is not None  # push_check said yes
    counts, stats = (None, None) if counted is None else counted
    rc = lib.hr_push_apply(
        toc.shape[0], toc.ctypes.data, ids.ctypes.data, grads.ctypes.data, _address(counts),
        _address(stats), tables.ctypes.data, hyper.ctypes.data, counters.ctypes.data,
        int(packed), threads,
    )  # fmt: skip
    if rc != 0:
        raise MemoryError("push_many: the server could not allocate a buffer of the push pass")


def write(
    toc: np.ndarray,
    ids: np.ndarray,
    clocks: np.ndarray,
    rows: np.ndarray,
    state: np.ndarray,
    tables: np.ndarray,
) -> bool:
    """Check, then apply a write (``hr_write_check``, ``hr_write_apply``): parts ``toc``
    int64 ``[k, 4]`` (table row, n, width word, state width) of float32 fixed tables
    ``tables`` int64 ``[T, TABLE_WORDS]``; ``ids`` and ``clocks`` int64 ``[N]``, ``rows``
    float32 ``[sum n * dim]`` and ``state`` ``[sum n * swidth]``, each the parts' values
    back to back. False: nothing changed (no kernel, or a check refused it: the Python
    path says why)."""
    lib = _library()
    if lib is None:
        return False
    arrays = (toc, ids, clocks, rows, state, tables)
    assert all(a.flags.c_contiguous for a in arrays)
    n, k = int(toc[:, 1].sum()), toc.shape[0]
    assert ids.size == n and clocks.size == n, "the caller sizes the arrays from toc"
    ptrs = [a.ctypes.data for a in (toc, ids, clocks, rows, state, tables)]
    if lib.hr_write_check(k, *ptrs, tables.shape[0]):
        return False
    lib.hr_write_apply(k, *ptrs)
    return True
