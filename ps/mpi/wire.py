"""The binary message layout of the MPI parameter-server protocol (no pickle).

A request is two messages from a worker to a server (an int64 header + payload, then
32-bit data words), a reply two messages back; the header words, the payload of each
op, the flags, error kinds and the exactly-once numbering are described once, in
``docs/ps_protocol.md``. This module builds and checks those messages; it imports no
MPI, so it can be tested anywhere.

Rows and gradients of a narrow table (``TableSpec.dtype`` fp16 / bf16) travel in the
table's type, two 16-bit values per data word (:func:`pack_values`), so a pull or push
moves half the bytes; optimizer state and the statistics of counted pushes stay
float32. A pull's or push's width word says which (:func:`width_word`).
"""

from __future__ import annotations

import enum

import numpy as np
import torch

from ps.errors import TableExistsError, TableSpecMismatch
from ps.table import ROW_DTYPES, TORCH_ROW_DTYPES

PROTOCOL = 8
MAGIC = 0x48525053  # "HRPS"
MAGIC_VERSION = (MAGIC << 16) | PROTOCOL
HEADER_LEN = 8
#: Most ids one request may carry (a server refuses larger headers before allocating).
MAX_IDS = 1 << 27
#: Most tables one batched request may carry.
MAX_PARTS = 1 << 16
#: Table-of-contents words per table of a batched request: PULL_MANY (table index, n,
#: dim, bound; bound -1 is a plain pull), PUSH_MANY (table index, n, dim), and of a
#: PULL_MANY reply (m rows, flags); WRITE (table index, n, dim, state width).
PULL_PART_WORDS, PUSH_PART_WORDS, REPLY_PART_WORDS = 4, 3, 2
WRITE_PART_WORDS = 4
MAX_ERROR_BYTES = 4000  # longer error messages are cut; bounds the reply buffers
ERROR_WORDS = (MAX_ERROR_BYTES + 7) // 8
#: Largest text / JSON reply (table list, stats, save parts); a worker's reply buffer.
MAX_TEXT_BYTES = 1 << 20
TEXT_WORDS = (MAX_TEXT_BYTES + 7) // 8

TAG_REQUEST = 1
TAG_REQUEST_DATA = 2
_TAG_REPLY_BASE = 16

# Header words.
W_MAGIC, W_OP, W_ID, W_TABLE, W_N, W_DIM, W_FLAGS, W_ARG = range(HEADER_LEN)

FLAG_CLOCKS = 1  # PULL request: caller clocks follow the ids; arg is the bound
FLAG_POSITIONS = 2  # PULL reply: positions follow the clocks
FLAG_SEQ = 4  # PUSH request: arg is the sequence number, the session follows the ids
FLAG_DUPLICATE = 8  # PUSH reply: a repeat of an applied push, acknowledged, not applied
FLAG_EXIST_OK = 16  # CREATE request: an existing table with an equal spec is opened
FLAG_COUNTED = 32  # PUSH_MANY request: update counts and statistics follow (counted_words)
FLAG_WIDE_COUNTS = 64  # with FLAG_COUNTED: counts as int64 words (else one byte each)
FLAG_STATE = 128  # PULL_MANY request: each row comes back with its optimizer state after it

#: Row types on the wire: the code in a width word's high 32 bits (:func:`width_word`).
ROW_CODES = {dtype: code for code, dtype in enumerate(ROW_DTYPES)}  # fp32 0, fp16 1, bf16 2
_WIDTH_MASK = 0xFFFFFFFF


class Op(enum.IntEnum):
    ERROR = -1
    CREATE = 1
    LOOKUP = 2
    LIST = 3
    PULL = 4
    PUSH = 5
    CLOCKS = 6
    STATE = 7
    STATS = 8
    SAVE = 9
    LOAD = 10
    GOODBYE = 11
    DROP = 12
    PULL_MANY = 13
    PUSH_MANY = 14
    WRITE = 15


class ErrorKind(enum.IntEnum):
    """Which exception the worker raises for an error reply."""

    VALUE = 1
    TYPE = 2
    RUNTIME = 3
    TABLE_EXISTS = 4
    TABLE_MISMATCH = 5

    @classmethod
    def of(cls, e: BaseException) -> ErrorKind:
        if isinstance(e, TableExistsError):
            return cls.TABLE_EXISTS
        if isinstance(e, TableSpecMismatch):
            return cls.TABLE_MISMATCH
        if isinstance(e, TypeError):
            return cls.TYPE
        if isinstance(e, ValueError):
            return cls.VALUE
        return cls.RUNTIME

    def exception(self, message: str) -> Exception:
        if self is ErrorKind.TABLE_EXISTS:
            return TableExistsError(message)
        if self is ErrorKind.TABLE_MISMATCH:
            return TableSpecMismatch(message)
        if self is ErrorKind.TYPE:
            return TypeError(message)
        if self is ErrorKind.VALUE:
            return ValueError(message)
        return RuntimeError(message)


def reply_tags(request_id: int, tag_ub: int) -> tuple[int, int]:
    """The (meta, data) tags of the reply to ``request_id``.

    ``tag_ub`` is the communicator's ``MPI.TAG_UB`` (at least 32767 by the MPI
    standard; MPICH: 2**29 - 1); request ids wrap after ``(tag_ub - 16) // 2``,
    far more than one worker ever has in flight to one server.
    """
    t = _TAG_REPLY_BASE + 2 * (request_id % ((tag_ub - _TAG_REPLY_BASE) // 2))
    return t, t + 1


def header(
    op: int,
    request_id: int,
    *,
    table: int = -1,
    n: int = 0,
    dim: int = 0,
    flags: int = 0,
    arg: int = 0,
) -> list[int]:
    return [MAGIC_VERSION, int(op), request_id, table, n, dim, flags, arg]


def message(head: list[int], *payload: np.ndarray) -> np.ndarray:
    """One int64 meta message: ``head`` then each payload array (int64, flattened)."""
    size = HEADER_LEN + sum(int(p.size) for p in payload)
    out = np.empty(size, dtype=np.int64)
    out[:HEADER_LEN] = head
    at = HEADER_LEN
    for p in payload:
        out[at : at + p.size] = p.reshape(-1)
        at += p.size
    return out


def check_parts(k: int, what: str) -> int:
    """``k``, the number of tables a batched request says it carries, once checked."""
    if not 0 < k <= MAX_PARTS:
        raise ValueError(f"{what}: the request says {k} tables; expected 1 to {MAX_PARTS}")
    return k


def pack_bytes(data: bytes) -> np.ndarray:
    """``data`` as int64 words (zero padded); the byte count travels in the header."""
    padded = data + b"\0" * (-len(data) % 8)
    return np.frombuffer(padded, dtype=np.int64).copy()


def unpack_bytes(words: np.ndarray, nbytes: int) -> bytes:
    """The first ``nbytes`` bytes of int64 ``words``; ValueError if there are fewer."""
    raw = np.ascontiguousarray(words, dtype=np.int64).tobytes()
    if not 0 <= nbytes <= len(raw):
        raise ValueError(f"message says {nbytes} bytes of text but carries {len(raw)}")
    return raw[:nbytes]


def error_message(head_op: int, request_id: int, e: BaseException) -> np.ndarray:
    """The meta message of an error reply carrying ``e``'s text (cut to MAX_ERROR_BYTES)."""
    text = str(e).encode("utf-8")[:MAX_ERROR_BYTES]
    h = header(Op.ERROR, request_id, flags=int(ErrorKind.of(e)), arg=len(text), dim=head_op)
    return message(h, pack_bytes(text))


def check_header(meta: np.ndarray, what: str) -> np.ndarray:
    """``meta``'s header (a view); ValueError if it is too short or from another protocol."""
    if meta.size < HEADER_LEN:
        raise ValueError(f"{what}: message of {meta.size} int64 words is shorter than a header")
    word = int(meta[W_MAGIC])
    if word >> 16 == MAGIC and word != MAGIC_VERSION:
        raise ValueError(
            f"{what}: the peer speaks hybridrec-ps protocol {word & 0xFFFF}, this side "
            f"protocol {PROTOCOL}; run the same hybridrec version on every rank"
        )
    if word != MAGIC_VERSION:
        raise ValueError(
            f"{what}: bad magic/version word {int(meta[W_MAGIC]):#x}, "
            f"expected {MAGIC_VERSION:#x} (hybridrec-ps protocol {PROTOCOL})"
        )
    return meta[:HEADER_LEN]


def raise_if_error(meta: np.ndarray, what: str) -> None:
    """Raise the exception an error reply carries (prefixed with ``what``)."""
    if int(meta[W_OP]) != Op.ERROR:
        return
    text = unpack_bytes(meta[HEADER_LEN:], int(meta[W_ARG])).decode("utf-8", "replace")
    try:
        kind = ErrorKind(int(meta[W_FLAGS]))
    except ValueError:
        kind = ErrorKind.RUNTIME
    raise kind.exception(f"{what}: {text}" if what else text)


def pull_reply_parts(reply: np.ndarray, k: int, server: int) -> tuple[np.ndarray, np.ndarray]:
    """A ``PULL_MANY`` reply of ``k`` parts from server rank ``server``: its body (the
    words after the header) and table of contents ``[k, REPLY_PART_WORDS]`` (each part's
    rows returned, its flags); RuntimeError if it holds another number of parts."""
    if int(reply[W_N]) != k:
        raise RuntimeError(
            f"pull_many reply from server rank {server} has {int(reply[W_N])} parts for a "
            f"request of {k}; the protocol is out of step"
        )
    body = reply[HEADER_LEN:]
    return body, body[: k * REPLY_PART_WORDS].reshape(k, REPLY_PART_WORDS)


def pull_part_error(server: int, got: int, positions: bool, table: str, asked: int) -> RuntimeError:
    """The error of a ``PULL_MANY`` reply part that returned ``got`` rows (``positions``:
    flagged with positions) for ``table`` where ``asked`` were asked."""
    return RuntimeError(
        f"pull_many reply from server rank {server} has {got} rows (positions: {positions}) "
        f"for table {table!r} where {asked} were asked; the table may have been reloaded "
        "with another spec by another worker"
    )


def count_words(n: int, wide: bool) -> int:
    """Payload words of a counted ``PUSH_MANY``'s ``n`` update counts: one byte each,
    padded to whole words (``wide``: one word each, for counts above 255)."""
    return n if wide else -(-n // 8)


def pack_counts(counts: np.ndarray) -> tuple[np.ndarray, bool]:
    """``counts`` int64 ``[n]`` (>= 1) as payload words, and whether they are wide."""
    if counts.size == 0 or int(counts.max()) <= 255:
        b = np.zeros(count_words(counts.size, False) * 8, dtype=np.uint8)
        b[: counts.size] = counts
        return b.view(np.int64), False
    return counts.astype(np.int64), True


def unpack_counts(words: np.ndarray, n: int, wide: bool) -> np.ndarray:
    """The ``n`` counts (int64) from :func:`pack_counts`'s words."""
    if wide:
        return words[:n].astype(np.int64)
    return words.view(np.uint8)[:n].astype(np.int64)


def width_word(dim: int, dtype: str) -> int:
    """The width word of a pull or push (a table of contents' ``dim_i``, a single
    request's header word ``W_DIM``): the row width in the low 32 bits, the row type
    the values travel in (:data:`ROW_CODES`) above them; for float32 rows, the width."""
    return dim | (ROW_CODES[dtype] << 32)


def split_widths(words: np.ndarray) -> tuple[np.ndarray, list[str]]:
    """Width words int64 ``[k]`` as ``(dims [k], row types [k])``; ValueError naming the
    word where its type code is unknown. A negative word is left as it is, a width of
    fp32 rows, for the caller's check of the width to refuse."""
    negative = words < 0
    dims = np.where(negative, words, words & _WIDTH_MASK)
    codes = np.where(negative, 0, words >> 32)
    types = []
    for word, code in zip(words.tolist(), codes.tolist(), strict=True):
        if not 0 <= code < len(ROW_DTYPES):
            raise ValueError(
                f"width word {word:#x} names row type {code}; expected one of "
                + ", ".join(f"{c} ({t})" for t, c in ROW_CODES.items())
            )
        types.append(ROW_DTYPES[code])
    return dims, types


def value_words(count: int, dtype: str) -> int:
    """Data words that carry ``count`` values of rows of ``dtype``: one per float32
    value, one per two 16-bit values (an odd count's last word padded)."""
    return count if dtype == "fp32" else (count + 1) // 2


def pack_values(values: torch.Tensor) -> np.ndarray:
    """``values`` (a host tensor of float32, float16 or bfloat16, any shape) as data words
    (a float32 array, a view where it can be): float32 values as they are, 16-bit ones
    two per word in memory order, an odd count ending in a zero half word."""
    flat = values.contiguous().reshape(-1)
    if flat.dtype == torch.float32:
        return flat.numpy()
    bits = flat.view(torch.int16).numpy()  # numpy has no bfloat16: move the bits
    if bits.size % 2:
        bits = np.concatenate([bits, np.zeros(1, dtype=np.int16)])
    return bits.view(np.float32)


def unpack_values(words: np.ndarray, count: int, dtype: str) -> torch.Tensor:
    """The first ``count`` values of rows of ``dtype`` in data ``words`` (a contiguous
    float32 array, as :func:`pack_values` wrote them), as float32 ``[count]``: a view of
    float32 values, a widened copy (exact) of 16-bit ones."""
    if dtype == "fp32":
        return torch.from_numpy(words[:count])
    bits = torch.from_numpy(words.view(np.int16)[:count])
    return bits.view(TORCH_ROW_DTYPES[dtype]).to(torch.float32)
