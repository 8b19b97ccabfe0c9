"""The Lua scripts of the Redis store (Redis >= 6.2 scripting: Lua 5.1 with ``struct``).

Data layout (see :mod:`ps.redis.layout`): per bucket of a table, a hash ``...:w``
maps the 8-byte little-endian id to ``row float32[D] | clock int64`` (``4D+8``
bytes), a hash ``...:s`` maps it to the optimizer state ``float32[S]`` (absent
when ``S == 0``), and on tables with eviction a sorted set ``...:t`` scores it
with the table step of its last touch.

Incarnation marker: the field :data:`MARKER` (4 bytes, so it never clashes with
an 8-byte id) of every ``...:w`` hash holds the table's random incarnation token,
written when the table is created or loaded. Every script reads it with the rows
it reads anyway (one more field of the same HMGET) and refuses to work on a
bucket whose marker is missing or different: the bucket was lost (Redis
restarted without persistence, was flushed) or the table was re-created.

Exactly-once pushes (the protocol: ``docs/ps_protocol.md``): a hash ``...:q`` per
bucket maps a worker id to ``"<session> <low> <seq> <seq> ..."``: the numbers of the
push calls applied for that session are every number ``<= low`` and the listed ones
(at most :data:`SEQ_WINDOW`). An applied call that skipped rows missing from Redis
also keeps their positions in the field ``<worker>:<number>``, so a repeat answers
them too; the client's follow-up call names the first one and removes that field.
Fields ``@applied`` / ``@dup`` count applied calls and repeats.

Scripts here:

* :data:`PULL_BOUNDED`: the HET conditional pull of one bucket. It reads the
  rows inside Redis and returns only those whose clock is past the caller's
  clock + bound (and, on eviction tables, stamps the touch), so the bytes moved
  are those of the stale rows only, in one round trip.
* :data:`TOUCH_PULL`: a plain pull of one bucket that also stamps the touch
  (eviction tables only; other tables pull with a plain HMGET).
* :func:`push_script`: generated per (optimizer, dim). It applies the optimizer
  to every row of one bucket call atomically (a script runs alone inside
  Redis), so concurrent workers never lose an update. Rows that do not exist
  yet need their initial values, which only the client can compute (the hash
  initializer is 64-bit integer arithmetic that Lua's doubles cannot do): the
  script updates the rows that exist and answers the positions of the missing
  ones; the client resends just those, with their initial rows.
* :data:`SNAPSHOT`: a chunk of a bucket (HSCAN of the rows hash plus the state
  of the same ids) read atomically, for checkpoints.
* :data:`EVICT_AGE`, :data:`LRU_CANDIDATES`, :data:`EVICT_IDS`: eviction by age, and
  by capacity (the oldest entries per bucket; then delete the chosen ones).

Arithmetic runs on doubles and each stored value is rounded to float32 once per
update (``struct.pack('f')``); the torch reference rounds every intermediate to
float32, so results agree to ~1e-7 relative. Gradients that are exact binary
fractions give bit-identical SGD results.

Narrow tables (fp16/bf16 rows, ``2D + 8`` bytes a value): the push script widens a row,
runs the same update, rounds each value to float32 and then stochastically to the
narrow type with random bits hashed inside the script (:mod:`ps.redis.narrow`).

The generated push code is unrolled in chunks of columns with the values held in
Lua locals (no per-value table traffic): unpacking and packing the float32 values
is most of the cost of an update, so it is done with as few calls as possible.
"""

from __future__ import annotations

import hashlib
import math
import struct
from dataclasses import dataclass

from ps.optimizers import FTRL, SGD, Adagrad, Adam, Optimizer, RowWiseAdagrad
from ps.redis.narrow import (
    NarrowRows,
    lua_prelude,
    lua_read_chunk,
    lua_row_functions,
    lua_row_start,
    lua_write_chunk,
)

#: Most rows one script call handles (Lua's ``unpack`` is limited to ~8000 values).
MAX_ROWS_PER_CALL = 1024
#: The field of each bucket's rows hash that holds the table's incarnation token.
MARKER = b"@inc"
#: A field of each bucket's rows and state hashes whose value is longer than any compact
#: encoding takes (Redis keeps a hash of at most ``hash-max-listpack-entries`` (512)
#: fields of at most ``hash-max-listpack-value`` (64) bytes as one flat list, searched
#: field by field, and never converts a hash back once it was converted): without it
#: a bucket's state hash of up to 512 four-byte values (row-wise Adagrad) and a rows
#: hash of ``dim`` <= 14 are lists, and every HMGET or HSET of 64 ids scans them
#: (measured on Redis 6.2: 22 us against 4 us for a hash table of 500 entries).
WIDE = b"@enc"
WIDE_VALUE = bytes(1024)
#: Most applied sequence numbers remembered above ``low`` per (worker, bucket).
SEQ_WINDOW = 64

# Push script statuses (the first element of its answer).
PUSH_APPLIED, PUSH_REPEAT, PUSH_GONE = 0, 1, 3

# ---------------------------------------------------------------- pulls

PULL_BOUNDED = """
-- KEYS[1] rows hash, KEYS[2] touch zset (or "")
-- ARGV[1] ids (int64 LE x n), ARGV[2] caller clocks (int64 LE x n), ARGV[3] bound,
-- ARGV[4] byte offset of the clock in a value (4 * dim), ARGV[5] touch step ("" = none),
-- ARGV[6] the table's incarnation token.
-- Returns {values of the stale present rows concatenated, their 1-based positions
-- (int32 LE each), the positions of the missing ids (int32 LE each), 1}, or
-- {'', '', '', 0} if the bucket's marker is not the token.
local sunpack, spack, ssub = struct.unpack, struct.pack, string.sub
local ids, cl = ARGV[1], ARGV[2]
local bound, off = tonumber(ARGV[3]), tonumber(ARGV[4]) + 1
local n = #ids / 8
local f = {}
for i = 1, n do f[i] = ssub(ids, 8 * i - 7, 8 * i) end
f[n + 1] = '@inc'
local v = redis.call('HMGET', KEYS[1], unpack(f))
if v[n + 1] ~= ARGV[6] then return {'', '', '', 0} end
local out, pos, miss = {}, {}, {}
for i = 1, n do
  local x = v[i]
  if x then
    if sunpack('<i8', x, off) > sunpack('<i8', cl, 8 * i - 7) + bound then
      out[#out + 1] = x
      pos[#pos + 1] = spack('<i4', i)
    end
  else
    miss[#miss + 1] = spack('<i4', i)
  end
end
if ARGV[5] ~= '' then
  local step, z = ARGV[5], {}
  for i = 1, n do z[2 * i - 1] = step; z[2 * i] = f[i] end
  redis.call('ZADD', KEYS[2], 'XX', unpack(z))
end
return {table.concat(out), table.concat(pos), table.concat(miss), 1}
"""

TOUCH_PULL = """
-- KEYS[1] rows hash, KEYS[2] touch zset; ARGV[1] ids (int64 LE x n), ARGV[2] touch step.
-- The values (false where missing) followed by the bucket's incarnation marker, after
-- stamping the touch of the present rows.
local ssub = string.sub
local ids, step = ARGV[1], ARGV[2]
local n = #ids / 8
local f, z = {}, {}
for i = 1, n do
  local id = ssub(ids, 8 * i - 7, 8 * i)
  f[i] = id
  z[2 * i - 1] = step
  z[2 * i] = id
end
f[n + 1] = '@inc'
local v = redis.call('HMGET', KEYS[1], unpack(f))
redis.call('ZADD', KEYS[2], 'XX', unpack(z))
return v
"""

# ---------------------------------------------------------------- checkpoints, eviction

SNAPSHOT = """
-- KEYS[1] rows hash, KEYS[2] state hash; ARGV[1] HSCAN cursor, ARGV[2] COUNT hint,
-- ARGV[3] "1" if the table has optimizer state, ARGV[4] the initial state bytes,
-- ARGV[5] the table's incarnation token.
-- Returns {next cursor, ids concatenated, values concatenated, states concatenated, 1},
-- or {'0', '', '', '', 0} if the bucket's marker is not the token.
if redis.call('HGET', KEYS[1], '@inc') ~= ARGV[5] then return {'0', '', '', '', 0} end
local r = redis.call('HSCAN', KEYS[1], ARGV[1], 'COUNT', ARGV[2])
local kv = r[2]
local ids, vals = {}, {}
for i = 1, #kv, 2 do
  if #kv[i] == 8 then  -- an id (the marker field has 4 bytes)
    ids[#ids + 1] = kv[i]
    vals[#vals + 1] = kv[i + 1]
  end
end
local st = ''
if ARGV[3] == '1' and #ids > 0 then
  local s = redis.call('HMGET', KEYS[2], unpack(ids))
  for i = 1, #ids do
    if not s[i] then s[i] = ARGV[4] end
  end
  st = table.concat(s)
end
return {r[1], table.concat(ids), table.concat(vals), st, 1}
"""

RESET_BUCKET = """
-- KEYS[1] rows, KEYS[2] state, KEYS[3] touch zset; ARGV[1] the incarnation token,
-- ARGV[2] the wide field's value, ARGV[3] "1" if the table has optimizer state.
-- Empties the bucket and marks it with the token, atomically (a table being loaded);
-- the wide field keeps its hashes hash tables.
redis.call('DEL', KEYS[1], KEYS[2], KEYS[3])
redis.call('HSET', KEYS[1], '@inc', ARGV[1], '@enc', ARGV[2])
if ARGV[3] == '1' then redis.call('HSET', KEYS[2], '@enc', ARGV[2]) end
return 1
"""

EVICT_AGE = """
-- KEYS[1] rows, KEYS[2] state, KEYS[3] touch zset; ARGV[1] the last step to evict
-- (rows touched at or before it go). Returns the number of rows evicted.
local old = redis.call('ZRANGEBYSCORE', KEYS[3], '-inf', ARGV[1])
local n = #old
for i = 1, n, 1000 do
  local j = math.min(n, i + 999)
  redis.call('HDEL', KEYS[1], unpack(old, i, j))
  redis.call('HDEL', KEYS[2], unpack(old, i, j))
  redis.call('ZREM', KEYS[3], unpack(old, i, j))
end
return n
"""

EVICT_IDS = """
-- KEYS[1] rows, KEYS[2] state, KEYS[3] touch zset; ARGV[1] ids (int64 LE x n),
-- ARGV[2] their last-touch steps (int64 LE x n) as the caller saw them. A row goes
-- only if it was not touched since (concurrent requests keep what they touched).
local sunpack, ssub = struct.unpack, string.sub
local ids, steps = ARGV[1], ARGV[2]
local n = #ids / 8
local gone = 0
for i = 1, n do
  local id = ssub(ids, 8 * i - 7, 8 * i)
  local sc = redis.call('ZSCORE', KEYS[3], id)
  if sc and tonumber(sc) == sunpack('<i8', steps, 8 * i - 7) then
    redis.call('HDEL', KEYS[1], id)
    redis.call('HDEL', KEYS[2], id)
    redis.call('ZREM', KEYS[3], id)
    gone = gone + 1
  end
end
return gone
"""

LRU_CANDIDATES = """
-- KEYS[1] touch zset; ARGV[1] k. The k least recently touched entries and every entry
-- tied with the k-th: {ids (int64 LE each), their steps (int64 LE each)}.
local k = tonumber(ARGV[1])
local last = redis.call('ZRANGE', KEYS[1], k - 1, k - 1, 'WITHSCORES')
local r
if #last == 0 then
  r = redis.call('ZRANGE', KEYS[1], 0, -1, 'WITHSCORES')
else
  r = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', last[2], 'WITHSCORES')
end
local ids, sc = {}, {}
for i = 1, #r, 2 do
  ids[#ids + 1] = r[i]
  sc[#sc + 1] = struct.pack('<i8', tonumber(r[i + 1]))
end
return {table.concat(ids), table.concat(sc)}
"""

# ---------------------------------------------------------------- pushes


def _num(x: float) -> str:
    """A Lua numeral for the double ``x`` (repr round-trips exactly through strtod)."""
    if not math.isfinite(x):
        raise ValueError(f"cannot write {x!r} into a Lua script")
    return repr(float(x))


def _lua_bytes(data: bytes) -> str:
    """A Lua string literal holding ``data`` exactly."""
    return '"' + "".join(f"\\{b:03d}" for b in data) + '"'


@dataclass(frozen=True, slots=True)
class _Kernel:
    """The per-row update of one optimizer, as Lua source fragments.

    ``vectors``: names of the state vectors of width D (in state layout order),
    followed in the state by ``scalars`` (one float32 each). ``gsq``: the row
    code needs ``gsq`` = sum of g*g over the row (a pre-pass). ``row``: Lua run
    once per row before the columns (may change scalars, define ``a``..``c``).
    ``col``: Lua per column, with ``#`` standing for the column's suffix: the
    weight ``w#``, gradient ``g#``, state values ``<vector>#``; temporaries
    ``t1``..``t3`` are free to use.
    """

    vectors: tuple[str, ...]
    scalars: tuple[str, ...]
    gsq: bool
    row: str
    col: str


def _kernel(opt: Optimizer, dim: int) -> _Kernel:
    if isinstance(opt, SGD):
        lr = _num(opt.lr)
        if opt.momentum > 0:
            mom = _num(opt.momentum)
            col = f"b# = {mom} * b# + g#\nw# = w# - {lr} * b#"
            return _Kernel(("b",), (), False, "", col)
        return _Kernel((), (), False, "", f"w# = w# - {lr} * g#")
    if isinstance(opt, RowWiseAdagrad):
        row = f"acc = acc + gsq / {dim}\na = {_num(opt.lr)} / (msqrt(acc) + {_num(opt.eps)})"
        return _Kernel((), ("acc",), True, row, "w# = w# - a * g#")
    if isinstance(opt, Adagrad):
        col = f"s# = s# + g# * g#\nw# = w# - {_num(opt.lr)} * g# / (msqrt(s#) + {_num(opt.eps)})"
        return _Kernel(("s",), (), False, "", col)
    if isinstance(opt, Adam):
        b1, b2 = float(opt.betas[0]), float(opt.betas[1])
        row = f"t = t + 1\na = {_num(opt.lr)} * msqrt(1 - {_num(b2)} ^ t) / (1 - {_num(b1)} ^ t)"
        col = ""
        if opt.weight_decay > 0:
            col += f"g# = g# + {_num(opt.weight_decay)} * w#\n"
        col += (
            f"m# = {_num(b1)} * m# + {_num(1.0 - b1)} * g#\n"
            f"v# = {_num(b2)} * v# + {_num(1.0 - b2)} * g# * g#\n"
            f"w# = w# - a * m# / (msqrt(v#) + {_num(opt.eps)})"
        )
        return _Kernel(("m", "v"), ("t",), False, row, col)
    if isinstance(opt, FTRL):
        al, be, l1, l2 = _num(opt.alpha), _num(opt.beta), _num(opt.l1), _num(opt.l2)
        col = (
            "t1 = n# + g# * g#\n"
            f"t2 = msqrt(t1)\n"
            f"z# = z# + g# - (t2 - msqrt(n#)) / {al} * w#\n"
            "n# = t1\n"
            f"if z# <= {l1} and z# >= -{l1} then w# = 0\n"
            f"elseif z# > 0 then w# = -(z# - {l1}) / (({be} + t2) / {al} + {l2})\n"
            f"else w# = -(z# + {l1}) / (({be} + t2) / {al} + {l2}) end"
        )
        return _Kernel(("z", "n"), (), False, "", col)
    raise NotImplementedError(
        f"the Redis store has no Lua update for optimizer {type(opt).__name__} "
        f"({opt.to_json()}); supported: SGD, RowWiseAdagrad, Adagrad, Adam, FTRL"
    )


def _names(prefix: str, k: int) -> str:
    return ", ".join(f"{prefix}{j}" for j in range(k))


def _chunk(
    kern: _Kernel,
    k: int,
    offset: str,
    d4: int,
    piece: str | None,
    clock: bool,
    narrow: NarrowRows | None = None,
) -> list[str]:
    """Lua statements updating ``k`` columns at byte ``offset`` (a Lua expression) of the
    float32 layout (gradients, state; a narrow row's columns are at half of it).

    The packed results go to the locals ``<piece>`` / ``<piece>_<vector>`` (or are
    appended to the tables ``wp`` / ``p_<vector>`` when ``piece`` is None). With
    ``clock``, the row's clock (after the ``k`` weights) is read and written
    incremented in the same struct calls (fp32 rows; a narrow row's clock is read once
    per row by :func:`ps.redis.narrow.lua_row_start`). The gradient is unpacked first
    (the single-chunk row code splices its row code after the first two lines).
    """
    fmt = f"'<{'f' * k}'"
    wnames = [f"w{j}" for j in range(k)]
    lines = [f"local {_names('g', k)} = sunpack({fmt}, gb, gofs + {offset} + 1)"]
    if narrow is None:
        wfmt = f"'<{'f' * k}i8'" if clock else fmt
        wvars = _names("w", k) + (", clk" if clock else "")
        lines.append(f"local {wvars} = sunpack({wfmt}, row, {offset} + 1)")
    else:
        assert not clock, "a narrow row's clock is read once per row"
        lines += lua_read_chunk(narrow, wnames, offset)
    for vi, vec in enumerate(kern.vectors):
        lines.append(f"local {_names(vec, k)} = sunpack({fmt}, st, {vi * d4} + {offset} + 1)")
    for j in range(k):
        lines.extend(kern.col.replace("#", str(j)).split("\n"))
    if narrow is None:
        wfmt = f"'<{'f' * k}i8'" if clock else fmt
        wout = _names("w", k) + (", clk + 1" if clock else "")
    else:
        lines += lua_write_chunk(narrow, wnames)
        wfmt, wout = f"'<{'H' * k}'", _names("w", k)
    if piece is None:
        lines.append(f"wp[#wp + 1] = spack({wfmt}, {wout})")
        for vec in kern.vectors:
            lines.append(f"p_{vec}[#p_{vec} + 1] = spack({fmt}, {_names(vec, k)})")
    else:
        lines.append(f"{piece} = spack({wfmt}, {wout})")
        for vec in kern.vectors:
            lines.append(f"{piece}_{vec} = spack({fmt}, {_names(vec, k)})")
    return lines


def _gsq_chunk(k: int, offset: str) -> list[str]:
    fmt = f"'<{'f' * k}'"
    terms = " + ".join(f"g{j} * g{j}" for j in range(k))
    return [
        f"local {_names('g', k)} = sunpack({fmt}, gb, gofs + {offset} + 1)",
        f"gsq = gsq + {terms}",
    ]


def _chunks(kern: _Kernel, dim: int) -> tuple[int, int, int]:
    """``(k, full, tail)``: columns per chunk, full chunks, columns in the last partial one."""
    per = 64 if not kern.vectors else 32  # keeps Lua's 200 locals / 250 registers limits
    k = min(per, dim)
    full, tail = divmod(dim, k)
    return k, full, tail


_UNROLL_CHUNKS = 8  # up to this many chunks the column code is unrolled (no loop, no tables)


def _update_columns(
    kern: _Kernel, dim: int, lines: list[str], narrow: NarrowRows | None = None
) -> tuple[str, list[str]]:
    """Append the column updates to ``lines``; return the Lua expressions of the new row
    value (weights and clock) and of each state vector's new bytes."""
    d4 = 4 * dim
    k, full, tail = _chunks(kern, dim)
    spans = [(k, str(4 * k * c)) for c in range(full)] + (
        [(tail, str(4 * full * k))] if tail else []
    )
    # fp32 rows pack the clock with their last chunk; narrow rows append it.
    clock_tail = "" if narrow is None else " .. spack('<i8', clk + 1)"
    if len(spans) == 1 and kern.gsq:
        # One chunk: the gradient is unpacked once; sum its squares, then run the row code.
        names = ["wp0"]
        lines.append("local wp0")
        body = _chunk(kern, dim, "0", d4, "wp0", narrow is None, narrow)
        terms = " + ".join(f"g{j} * g{j}" for j in range(dim))
        lines += ["do", *body[:2], f"gsq = {terms}", *kern.row.split("\n"), *body[2:], "end"]
        return "wp0" + clock_tail, []
    if kern.gsq:
        lines += _gsq_columns(kern, dim)
    if kern.row:
        lines += kern.row.split("\n")
    if len(spans) <= _UNROLL_CHUNKS:
        names = [f"wp{c}" for c in range(len(spans))]
        lines.append("local " + ", ".join(names))
        for vec in kern.vectors:
            lines.append("local " + ", ".join(f"{n}_{vec}" for n in names))
        for c, (kk, off) in enumerate(spans):
            last = c == len(spans) - 1 and narrow is None
            lines += ["do", *_chunk(kern, kk, off, d4, names[c], last, narrow), "end"]
        row = " .. ".join(names) + clock_tail
        vecs = [" .. ".join(f"{n}_{vec}" for n in names) for vec in kern.vectors]
        return row, vecs
    if narrow is None:
        lines.append(f"local clk = sunpack('<i8', row, {d4} + 1)")
    lines.append("local wp = {}")
    for vec in kern.vectors:
        lines.append(f"local p_{vec} = {{}}")
    lines += [f"for c = 0, {full - 1} do", f"local o = c * {4 * k}"]
    lines += _chunk(kern, k, "o", d4, None, False, narrow) + ["end"]
    if tail:
        lines += ["do", *_chunk(kern, tail, str(4 * full * k), d4, None, False, narrow), "end"]
    row = "tconcat(wp) .. spack('<i8', clk + 1)"
    return row, [f"tconcat(p_{vec})" for vec in kern.vectors]


def _gsq_columns(kern: _Kernel, dim: int) -> list[str]:
    k, full, tail = _chunks(kern, dim)
    lines = ["gsq = 0"]
    if full == 1:
        lines += ["do", *_gsq_chunk(k, "0"), "end"]
    elif full > 1:
        lines += [f"for c = 0, {full - 1} do", *_gsq_chunk(k, f"c * {4 * k}"), "end"]
    if tail:
        lines += ["do", *_gsq_chunk(tail, str(4 * full * k)), "end"]
    return lines


def push_script(
    opt: Optimizer, dim: int, kern: _Kernel | None = None, narrow: NarrowRows | None = None
) -> str:
    """The push script of a table with optimizer ``opt`` and row width ``dim`` (``kern``:
    its update, by default the optimizer's plain one; ``narrow``: the table's fp16/bf16
    rows, None for fp32 rows).

    ``KEYS[1]`` rows hash, ``KEYS[2]`` state hash, ``KEYS[3]`` touch zset,
    ``KEYS[4]`` sequence hash. ``ARGV[1]`` unique ids (int64 LE x n), ``ARGV[2]``
    their summed gradients (float32 LE, n x dim), ``ARGV[3]`` initial rows (as stored:
    float32 LE, or the narrow type's bits, dim each) for the 1-based positions in
    ``ARGV[4]`` (int32 LE each), ``ARGV[5]`` the touch step ("" on tables without
    eviction), ``ARGV[6]`` the incarnation token, ``ARGV[7]`` the worker id ("": no
    exactly-once check), ``ARGV[8]`` its session, ``ARGV[9]`` the call's sequence
    number, ``ARGV[10]`` the caller's watermark, ``ARGV[11]`` the number of the call
    this one completes ("" if none) (see the module docstring).

    The answer is ``{status, rows created, skipped}``; ``skipped`` holds the 1-based
    positions (int32 LE each) of rows that do not exist and have no initial row
    here: the client sends those again, with their initial rows, as a new call.
    :data:`PUSH_APPLIED`: every other row was updated and its clock went up by 1;
    :data:`PUSH_REPEAT`: this number was applied before, nothing changes (``skipped``
    as the first time); :data:`PUSH_GONE`: the bucket's marker is not the token,
    nothing changes.
    """
    kern = kern or _kernel(opt, dim)
    d4 = 4 * dim
    wb = d4 if narrow is None else 2 * dim  # bytes of a stored row's weights
    state_dim = opt.state_dim(dim)
    assert state_dim == len(kern.vectors) * dim + len(kern.scalars)
    state0 = struct.pack(f"<{state_dim}f", *opt.initial_state(dim).tolist())
    has_state = state_dim > 0
    lines = [
        "local sunpack, spack, ssub, msqrt = struct.unpack, struct.pack, string.sub, math.sqrt",
        "local tconcat = table.concat",
        "local ids, gb, ib, ip, step = ARGV[1], ARGV[2], ARGV[3], ARGV[4], ARGV[5]",
        "local n = #ids / 8",
        "local f = {}",
        "for i = 1, n do f[i] = ssub(ids, 8 * i - 7, 8 * i) end",
        "f[n + 1] = '@inc'",
        "local rows = redis.call('HMGET', KEYS[1], unpack(f))",
        f"if rows[n + 1] ~= ARGV[6] then return {{{PUSH_GONE}, 0, ''}} end",
        *_DEDUP_CHECK.strip().split("\n"),
    ]
    if has_state:
        lines.append("local sts = redis.call('HMGET', KEYS[2], unpack(f, 1, n))")
    lines += [
        "local init = {}",
        "for k = 1, #ip / 4 do init[sunpack('<i4', ip, 4 * k - 3)] = k end",
        "local miss, created = {}, 0",
        "for i = 1, n do",
        "  if not rows[i] then",
        "    local k = init[i]",
        "    if k then",
        f"      rows[i] = ssub(ib, (k - 1) * {wb} + 1, k * {wb}) .. CLOCK0",
    ]
    if has_state:
        lines.append("      sts[i] = false")
    lines += [
        "      created = created + 1",
        "    else miss[#miss + 1] = spack('<i4', i) end",
        "  end",
        "end",
        "miss = tconcat(miss)",
        "local wout, sout, z, nw = {}, {}, {}, 0",
        "local t1, t2, t3, a, gsq" + ("" if narrow is None else ", t4"),
    ]
    if has_state:
        lines.append(f"local STATE0 = {_lua_bytes(state0)}")
    if narrow is not None:
        lines += lua_prelude(narrow)
    lines += [
        "for i = 1, n do",
        "local row = rows[i]",
        "if row then",
        "nw = nw + 1",
        f"local gofs = (i - 1) * {d4}",
    ]
    if has_state:
        lines.append("local st = sts[i] or STATE0")
    if narrow is not None:
        lines += lua_row_start(narrow, dim)
    base = len(kern.vectors) * d4
    for si, sc in enumerate(kern.scalars):
        lines.append(f"local {sc} = sunpack('<f', st, {base + 4 * si} + 1)")
    row_expr, vec_exprs = _update_columns(kern, dim, lines, narrow)
    lines += ["wout[2 * nw - 1] = f[i]", f"wout[2 * nw] = {row_expr}"]
    if has_state:
        parts = list(vec_exprs)
        if kern.scalars:
            parts.append(f"spack('<{'f' * len(kern.scalars)}', {', '.join(kern.scalars)})")
        lines += ["sout[2 * nw - 1] = f[i]", f"sout[2 * nw] = {' .. '.join(parts)}"]
    lines += ["z[2 * nw - 1] = step", "z[2 * nw] = f[i]", "end", "end"]
    lines.append("if nw > 0 then")
    lines.append("  redis.call('HSET', KEYS[1], unpack(wout))")
    if has_state:
        lines.append("  redis.call('HSET', KEYS[2], unpack(sout))")
    lines += [
        "  if step ~= '' then redis.call('ZADD', KEYS[3], unpack(z)) end",
        "end",
        *_DEDUP_RECORD.strip().split("\n"),
        f"return {{{PUSH_APPLIED}, created, miss}}",
    ]
    src = "\n".join(lines).replace("CLOCK0", _lua_bytes(bytes(8)))
    rows = "" if narrow is None else f" dtype={narrow.dtype}"
    header = f"-- hybridrec push: {opt.to_json()} dim={dim}{rows}\n"
    return header + src


# The exactly-once check of a push call (before anything changes). One local table Q
# keeps the generated scripts within Lua's limit of 200 locals.
_DEDUP_CHECK = f"""
local Q = {{wid = ARGV[7], sess = ARGV[8], low = 0, set = {{}}}}
if Q.wid ~= '' then
  Q.seq = tonumber(ARGV[9])
  local old = redis.call('HGET', KEYS[4], Q.wid)
  if old then
    local it = string.gmatch(old, '%S+')
    if it() == Q.sess then
      Q.low = tonumber(it())
      for x in it do Q.set[#Q.set + 1] = tonumber(x) end
    end
  end
  local again = Q.seq <= Q.low
  for k = 1, #Q.set do if Q.set[k] == Q.seq then again = true end end
  if again then
    redis.call('HINCRBY', KEYS[4], '@dup', 1)
    return {{{PUSH_REPEAT}, 0, redis.call('HGET', KEYS[4], Q.wid .. ':' .. ARGV[9]) or ''}}
  end
end
"""

# After an applied call: remember its number, fold what the watermark covers into low.
_DEDUP_RECORD = f"""
if Q.wid ~= '' then
  local wm = tonumber(ARGV[10])
  if wm > Q.low then Q.low = wm end
  local keep = {{}}
  for k = 1, #Q.set do if Q.set[k] > Q.low then keep[#keep + 1] = Q.set[k] end end
  keep[#keep + 1] = Q.seq
  table.sort(keep)
  if #keep > {SEQ_WINDOW} then
    Q.low = keep[#keep - {SEQ_WINDOW}]
    keep = {{unpack(keep, #keep - {SEQ_WINDOW - 1})}}
  end
  local parts = {{Q.sess, string.format('%d', Q.low)}}
  for k = 1, #keep do parts[#parts + 1] = string.format('%d', keep[k]) end
  redis.call('HSET', KEYS[4], Q.wid, table.concat(parts, ' '))
  if miss ~= '' then redis.call('HSET', KEYS[4], Q.wid .. ':' .. ARGV[9], miss) end
  if ARGV[11] ~= '' then redis.call('HDEL', KEYS[4], Q.wid .. ':' .. ARGV[11]) end
end
redis.call('HINCRBY', KEYS[4], '@applied', 1)
"""


def sha1(script: str) -> str:
    """The SHA1 Redis names a script by (EVALSHA)."""
    return hashlib.sha1(script.encode("utf-8")).hexdigest()


# ---------------------------------------------------------------- counted pushes


def _substep(opt: Optimizer, dim: int) -> list[str]:
    """Lua statements of one sub-step of a counted push on the tables ``W`` (weights),
    ``G`` (the mean gradient), ``Q`` (the mean statistic) and the state (``B``; ``acc``;
    ``S``; ``M``, ``V``, ``t``; ``Z``, ``N``), every stored value rounded to float32 after
    it (``r32``), as ``k`` separate pushes would round it (ps.optimizers)."""
    d = str(dim)
    if isinstance(opt, SGD):  # momentum (plain SGD is never counted: the sum is exact)
        mom, lr = _num(opt.momentum), _num(opt.lr)
        return [f"for j = 1, {d} do", f"B[j] = r32({mom} * B[j] + G[j])",
                f"W[j] = r32(W[j] - {lr} * B[j]) end"]  # fmt: skip
    if isinstance(opt, RowWiseAdagrad):
        lr, eps = _num(opt.lr), _num(opt.eps)
        return ["acc = r32(acc + Q[1])", f"local a = {lr} / (msqrt(acc) + {eps})",
                f"for j = 1, {d} do W[j] = r32(W[j] - a * G[j]) end"]  # fmt: skip
    if isinstance(opt, Adagrad):
        lr, eps = _num(opt.lr), _num(opt.eps)
        return [f"for j = 1, {d} do", "S[j] = r32(S[j] + Q[j])",
                f"W[j] = r32(W[j] - {lr} * G[j] / (msqrt(S[j]) + {eps})) end"]  # fmt: skip
    if isinstance(opt, Adam):
        b1, b2 = float(opt.betas[0]), float(opt.betas[1])
        lines = ["t = t + 1",
                 f"local a = {_num(opt.lr)} * msqrt(1 - {_num(b2)} ^ t) / (1 - {_num(b1)} ^ t)",
                 f"for j = 1, {d} do", "local g, q = G[j], Q[j]"]  # fmt: skip
        if opt.weight_decay > 0:  # E[(g + c)^2] = E[g^2] + 2 c E[g] + c^2, c = wd * w
            lines += [f"local c = {_num(opt.weight_decay)} * W[j]", "q = q + c * (2 * g + c)",
                      "g = g + c"]  # fmt: skip
        lines += [f"M[j] = r32({_num(b1)} * M[j] + {_num(1.0 - b1)} * g)",
                  f"V[j] = r32({_num(b2)} * V[j] + {_num(1.0 - b2)} * q)",
                  f"W[j] = r32(W[j] - a * M[j] / (msqrt(V[j]) + {_num(opt.eps)})) end"]  # fmt: skip
        return lines
    if isinstance(opt, FTRL):
        al, be, l1, l2 = _num(opt.alpha), _num(opt.beta), _num(opt.l1), _num(opt.l2)
        return [
            f"for j = 1, {d} do",
            "local t1 = N[j] + Q[j]",
            "local t2 = msqrt(t1)",
            f"Z[j] = r32(Z[j] + G[j] - (t2 - msqrt(N[j])) / {al} * W[j])",
            "N[j] = r32(t1)",
            "local z = Z[j]",
            f"if z <= {l1} and z >= -{l1} then W[j] = 0",
            f"elseif z > 0 then W[j] = r32(-(z - {l1}) / (({be} + msqrt(N[j])) / {al} + {l2}))",
            f"else W[j] = r32(-(z + {l1}) / (({be} + msqrt(N[j])) / {al} + {l2})) end end",
        ]
    raise NotImplementedError(f"no counted update for {type(opt).__name__}")


def _counted_rowwise_adagrad(opt: RowWiseAdagrad, dim: int) -> _Kernel:
    """Row-wise Adagrad's plain update with a counted row's ``kc`` sub-steps in its row code.

    The sub-steps all move the row along the same mean gradient ``G / kc``, each by its
    own scalar ``a_j = lr / (sqrt(acc_j) + eps)``: the accumulator takes its ``kc``
    float32 additions of the mean statistic exactly as ``kc`` pushes would, the scalars
    are summed in doubles, and the row moves once by ``(sum_j a_j / kc) * G``, rounded
    to float32 when it is stored, in the plain update's unrolled column code. That is
    ``kc + D`` operations where the sub-steps take ``kc * D`` float32 roundings (a
    string pack and unpack each in Lua) in Lua tables, and it differs from ``kc``
    separate pushes only by their roundings of the row in between: at most ``kc - 1``
    half-ulps of the row's values (docs/cache.md). A row of one update runs the plain
    row code, bit for bit."""
    lr, eps = _num(opt.lr), _num(opt.eps)
    row = "\n".join(
        [
            "local kc = sunpack('<i4', ARGV[12], 4 * i - 3)",
            "if kc > 1 then",
            "local qm, c = sunpack('<f', ARGV[13], 4 * i - 3) / kc, 0",
            "for _ = 1, kc do",
            "acc = (sunpack('<f', spack('<f', acc + qm)))",  # float32, as a push stores it
            f"c = c + {lr} / (msqrt(acc) + {eps})",
            "end",
            "a = c / kc",
            "else",
            f"acc = acc + gsq / {dim}",
            f"a = {lr} / (msqrt(acc) + {eps})",
            "end",
        ]
    )
    return _Kernel((), ("acc",), True, row, "w# = w# - a * g#")


#: (state vectors in layout order, scalars after them) of each optimizer's counted update.
def _state_names(opt: Optimizer) -> tuple[tuple[str, ...], tuple[str, ...]]:
    if isinstance(opt, SGD):
        return ("B",), ()
    if isinstance(opt, RowWiseAdagrad):
        return (), ("acc",)
    if isinstance(opt, Adagrad):
        return ("S",), ()
    if isinstance(opt, Adam):
        return ("M", "V"), ("t",)
    if isinstance(opt, FTRL):
        return ("Z", "N"), ()
    raise NotImplementedError(type(opt).__name__)


def counted_push_script(opt: Optimizer, dim: int, narrow: NarrowRows | None = None) -> str:
    """The push script of a counted push: :func:`push_script`'s, with ``ARGV[12]`` every
    row's update count (int32 LE each) and ``ARGV[13]`` its statistic (float32 LE,
    ``Q = opt.stat_dim(dim)`` each). A row of one update takes the plain update, bit for
    bit; a row of ``k`` takes ``k`` sub-steps of its mean gradient with its mean
    statistic in place of the gradient's square (:meth:`ps.Optimizer.apply_counted`),
    written with plain Lua tables (a counted row is a hot row: few per call). A narrow row
    (``narrow``) takes its sub-steps on its widened values and is rounded to the narrow
    type once, after them (as one update)."""
    plain = push_script(opt, dim, narrow=narrow)
    if opt.sums_exactly():
        return plain  # the step of the sum is the k steps; the client sends it plain
    if isinstance(opt, RowWiseAdagrad):
        src = push_script(opt, dim, _counted_rowwise_adagrad(opt, dim), narrow)
        return src.replace("-- hybridrec push:", "-- hybridrec counted push:")
    q = opt.stat_dim(dim)
    vectors, scalars = _state_names(opt)
    d4 = 4 * dim
    fmt = f"'<{'f' * dim}'"
    wb = d4 if narrow is None else 2 * dim  # bytes of a stored row's weights
    read = f"{{sunpack({fmt}, row, 1)}}" if narrow is None else "dec_row(row)"
    sub = [] if narrow is None else lua_row_functions(narrow, dim)
    sub += [
        "local function r32(x) return (sunpack('<f', spack('<f', x))) end",
        "local function counted_row(row, st, gofs, kc, i)",
        f"  local W = {read}",
        f"  local clk = sunpack('<i8', row, {wb} + 1)",
        f"  local G = {{sunpack({fmt}, gb, gofs + 1)}}",
        f"  local Q = {{sunpack('<{'f' * max(q, 1)}', ARGV[13], (i - 1) * {4 * q} + 1)}}"
        if q
        else "  local Q = {}",
        f"  for j = 1, {dim} do G[j] = G[j] / kc end",
        f"  for j = 1, {q} do Q[j] = Q[j] / kc end",
    ]
    for vi, vec in enumerate(vectors):
        sub.append(f"  local {vec} = {{sunpack({fmt}, st, {vi * d4} + 1)}}")
    base = len(vectors) * d4
    for si, sc in enumerate(scalars):
        sub.append(f"  local {sc} = sunpack('<f', st, {base + 4 * si} + 1)")
    sub += ["  for _ = 1, kc do", *("    " + x for x in _substep(opt, dim)), "  end"]
    if narrow is None:
        sub.append(f"  W[{dim + 1}] = clk + 1")
        sub.append(f"  local nr = spack('<{'f' * dim}i8', unpack(W, 1, {dim + 1}))")
    else:
        sub.append("  local nr = enc_row(W, rowkey(f[i], clk + 1)) .. spack('<i8', clk + 1)")
    parts = [f"spack({fmt}, unpack({vec}, 1, {dim}))" for vec in vectors]
    if scalars:
        parts.append(f"spack('<{'f' * len(scalars)}', {', '.join(scalars)})")
    sub.append(f"  return nr, {' .. '.join(parts) if parts else 'nil'}")
    sub.append("end")
    # Splice: the helper before the row loop; in the loop, counted rows take it.
    head, sep, rest = plain.partition("for i = 1, n do\nlocal row = rows[i]\nif row then\n")
    assert sep, "push_script's row loop changed"
    body, sep2, tail = rest.partition("z[2 * nw - 1] = step")
    assert sep2, "push_script's row loop changed"
    has_state = opt.state_dim(dim) > 0
    counted = [
        "local kc = sunpack('<i4', ARGV[12], 4 * i - 3)",
        "if kc > 1 then",
        "nw = nw + 1",
        f"local nr, ns = counted_row(row, {'sts[i] or STATE0' if has_state else 'nil'}, "
        f"(i - 1) * {d4}, kc, i)",
        "wout[2 * nw - 1] = f[i]",
        "wout[2 * nw] = nr",
    ]
    if has_state:
        counted += ["sout[2 * nw - 1] = f[i]", "sout[2 * nw] = ns"]
    counted += ["else"]
    src = (
        head.replace("-- hybridrec push:", "-- hybridrec counted push:")
        + "\n".join(sub)
        + "\n"
        + sep
        + "\n".join(counted)
        + "\n"
        + body
        + "end\n"
        + sep2
        + tail
    )
    return src
