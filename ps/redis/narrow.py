"""Narrow rows (fp16, bf16) in Redis: their bytes, and how the push scripts round them.

A table with ``TableSpec.dtype`` "fp16" or "bf16" keeps each row in its bucket's rows
hash as ``weights uint16[D] LE | clock int64 LE`` (``2D + 8`` bytes; fp32 tables
``4D + 8``); the optimizer state stays float32. The client widens what it reads to
float32 (exact) and sends a row it creates (initial rows, loaded rows) rounded to the
nearest narrow value, as the in-process store stores them. Gradients travel as float32:
the update is defined on float32 gradients (summed by the client), and narrowing them
would add a rounding the in-process store does not make; the bytes a push moves are
then those of an fp32 table's push.

The push script widens a narrow row (bf16: by inserting two zero bytes before each
value, one ``string.gsub`` a row; fp16: per value from its bits), runs the optimizer's
update in doubles exactly as for fp32 rows, rounds each new value to float32 (as the
fp32 path stores it) and from there to the narrow type with **stochastic rounding**.

Random bits (Lua 5.1 has doubles and the ``bit`` library's 32-bit operations, so the
64-bit hash of :mod:`ps.rounding` is not used). A row's key is hashed once per update
with ``fmix``, murmur3's 32-bit finaliser (its products mod 2^32 taken in 16-bit
halves, exact in doubles); its columns then draw from a linear congruential generator
(Numerical Recipes' constants) started at that key, whose step ``x * 1664525 +
1013904223`` is exact in doubles: three arithmetic operations a column, where a hash
per pair of columns takes six ``bit`` calls and two split products (measured in Redis
6.2's Lua, 16 random bits a column: 30 ns against 125 ns). All values unsigned 32-bit::

    S     = fmix(fmix(seed_hi) ^ seed_lo)        # seed = the table's init seed mod 2^64
    x_0   = fmix(fmix(fmix(fmix(S ^ id_lo) ^ id_hi) ^ ver_lo) ^ ver_hi)   # per row
    x_j+1 = (x_j * 1664525 + 1013904223) mod 2^32                         # column j
    r_j   = x_j+1 >> 16 (bf16), x_j+1 >> 19 (fp16: 13 bits)               # its bits

``id`` is the row's table id (int64 as two 32-bit halves, low first), ``ver`` its clock
after the update (as :mod:`ps.rounding`), so the bits are a pure function of (seed,
id, version, column): a repeated run rounds alike, on a server or a cluster. The top
bits of the generator are the good ones (bit ``k`` of an LCG mod 2^32 has period
2^(k+1)). They are not :mod:`ps.rounding`'s bits, so a Redis table is not bit-equal to
an in-process one; each update rounds by less than one step of the narrow type either
way.

Rounding a float32 value ``u`` (its bits) with ``r = r_j`` (sign and magnitude apart,
so adding to the magnitude rounds it up):

* bf16: ``floor((u + r) / 2^16)``: the value goes up with probability (its low 16
  bits) / 2^16. NaN becomes the quiet NaN of its sign; infinities stay.
* fp16, ``|u| >= 2^-14`` (normal): ``floor((mag + r) / 2^13) - 112 * 2^10`` (the
  exponent rebased, 13 bits dropped), saturated at 65504 (0x7BFF); infinities stay,
  NaN becomes 0x7E00.
* fp16, ``|u| < 2^-14`` (subnormal, step 2^-24): with ``s = |u| * 2^24`` (exact),
  ``floor(s)`` plus one if ``frac(s) * 2^13 + r >= 2^13``.

Both are: the lower narrow neighbour of ``|u|``, plus one step if the part above it,
in units of 2^-k steps, plus the k random bits carries past 2^k.

"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ps.table import TableSpec

_M32 = 0xFFFFFFFF
#: The columns' generator: ``x * LCG_A + LCG_C`` mod 2^32 (exact in doubles: A < 2^21).
LCG_A, LCG_C = 1664525, 1013904223


def fmix32(h: int) -> int:
    """murmur3's 32-bit finaliser (the Lua scripts' ``fmix``)."""
    h ^= h >> 16
    h = (h * 0x85EBCA6B) & _M32
    h ^= h >> 13
    h = (h * 0xC2B2AE35) & _M32
    return h ^ (h >> 16)


def seed32(seed: int) -> int:
    """The 32-bit key ``S`` of a table's init seed (see the module docstring)."""
    s = seed & 0xFFFFFFFFFFFFFFFF
    return fmix32(fmix32(s >> 32) ^ (s & _M32))


@dataclass(frozen=True, slots=True)
class NarrowRows:
    """How a narrow table's rows are stored: ``dtype`` "fp16" or "bf16", and ``seed`` the
    table's init seed (the key of its stochastic rounding)."""

    dtype: str
    seed: int

    @staticmethod
    def of(spec: TableSpec) -> NarrowRows | None:
        """The narrow rows of ``spec``, None for fp32 rows."""
        if not spec.narrow:
            return None
        assert spec.init is not None  # resolved by TableSpec
        return NarrowRows(spec.dtype, spec.init.seed)


# ---------------------------------------------------------------- client side


def stored_bytes(rows: torch.Tensor, dtype: str) -> np.ndarray:
    """float32 ``rows`` ``[N, D]`` as stored: uint8 ``[N, 2D]`` of the narrow values
    rounded to nearest ("fp16"/"bf16"), or ``[N, 4D]`` float32 ("fp32")."""
    n = int(rows.shape[0])
    if dtype == "fp32":
        return rows.numpy().astype("<f4").view(np.uint8).reshape(n, -1)
    if dtype == "fp16":
        return rows.to(torch.float16).numpy().astype("<f2").view(np.uint8).reshape(n, -1)
    bits = rows.to(torch.bfloat16).view(torch.int16).numpy()  # numpy has no bfloat16
    return bits.astype("<i2").view(np.uint8).reshape(n, -1)


def widen(raw: np.ndarray, dtype: str) -> np.ndarray:
    """Stored weights uint8 ``[N, B]`` (``B`` = 2D or 4D) as float32 ``[N, D]`` (exact)."""
    if dtype == "fp32":
        return raw.view("<f4").astype(np.float32, copy=False)
    if dtype == "fp16":
        return raw.view("<f2").astype(np.float32)
    bits = raw.view("<u2").astype(np.uint32) << 16  # bf16 is float32's top half
    return bits.view(np.float32)


# ---------------------------------------------------------------- Lua


def lua_prelude(narrow: NarrowRows) -> list[str]:
    """Locals every narrow push script defines before its rows: ``floor``, ``fmix`` and
    ``rowkey(id bytes, version)`` (``x_0``)."""
    return [
        "local floor = math.floor",
        "local fmix, rowkey",
        "do",
        "  local bxor, rshift = bit.bxor, bit.rshift",
        "  fmix = function(h)  -- products mod 2^32 in 16-bit halves: exact in doubles",
        "    h = bxor(h, rshift(h, 16)) % 4294967296",
        "    h = (h * 51819 + h * 34283 % 65536 * 65536) % 4294967296  -- * 0x85EBCA6B",
        "    h = bxor(h, rshift(h, 13)) % 4294967296",
        "    h = (h * 44597 + h * 49842 % 65536 * 65536) % 4294967296  -- * 0xC2B2AE35",
        "    return bxor(h, rshift(h, 16)) % 4294967296",
        "  end",
        "  rowkey = function(id, ver)",
        "    local lo, hi = struct.unpack('<I4I4', id)",
        "    local vl = ver % 4294967296",
        f"    local k = fmix(bxor({seed32(narrow.seed)}, lo) % 4294967296)",
        "    k = fmix(bxor(k, hi) % 4294967296)",
        "    k = fmix(bxor(k, vl) % 4294967296)",
        "    return fmix(bxor(k, (ver - vl) / 4294967296) % 4294967296)",
        "  end",
        "end",
    ]


def lua_row_start(narrow: NarrowRows, dim: int) -> list[str]:
    """Per row, before its columns: its clock ``clk`` and the generator of its random
    bits ``X`` (started at the row key of version ``clk + 1``); a bf16 row widened in
    place to float32 bytes (the fp32 layout, which the column code then reads)."""
    wb = 2 * dim
    lines = [f"local clk = sunpack('<i8', row, {wb + 1})", "local X = rowkey(f[i], clk + 1)"]
    if narrow.dtype == "bf16":
        lines.append(f"row = string.gsub(ssub(row, 1, {wb}), '..', '\\0\\0%0')")
    return lines


# Constant arithmetic below: floor(a / 2^k) is written (a - a % 2^k) / 2^k, Lua VM
# operations where math.floor is a function call (the column code runs per value).


def _fp16_to_bits(v: str) -> list[str]:
    """Lua: fp16 bits in ``v`` -> the float32 bits of its value in ``v`` (temporaries
    t2..t4): normal values rebase the exponent (+112) and move the mantissa up 13 bits,
    infinities and NaN keep an all-ones exponent, subnormals become normal float32."""
    return [
        f"t2 = {v} % 32768",
        f"t3 = ({v} - t2) * 65536",  # the sign bit
        "if t2 >= 1024 then",
        f"  if t2 < 31744 then {v} = t2 * 8192 + 939524096 + t3",
        f"  else {v} = t2 * 8192 + 1879048192 + t3 end",
        f"elseif t2 == 0 then {v} = t3",
        f"else t2, t4 = math.frexp(t2); {v} = (t4 + 101 + 2 * t2) * 8388608 + t3 end",
    ]


def _encode(dtype: str, v: str) -> list[str]:
    """Lua: float32 bits in ``v`` -> the narrow bits in ``v``, rounded stochastically with
    the top bits of the generator ``X`` (see the module docstring; temporaries t2..t4).

    ``floor((a + r) / 2^k)`` with ``r = floor(X / 2^s)`` equals ``floor((a + X / 2^s) / 2^k)``
    for integer ``a``; ``a + X / 2^s`` is exact in doubles (at most 32 + 19 bits)."""
    if dtype == "bf16":
        return [
            f"t2 = {v} % 2147483648",
            f"if t2 > 2139095040 then {v} = ({v} - t2) / 65536 + 32704",  # NaN
            f"else t2 = {v} + X / 65536; {v} = (t2 - t2 % 65536) / 65536 end",
        ]
    return [
        f"t2 = {v} % 2147483648",
        f"t3 = ({v} - t2) / 65536",  # the sign bit
        "if t2 >= 947912704 then",
        "  if t2 < 2139095040 then",
        "    t2 = t2 + X / 524288",
        "    t2 = (t2 - t2 % 8192) / 8192 - 114688",
        "    if t2 > 31743 then t2 = 31743 end",
        "  elseif t2 > 2139095040 then t2 = 32256",
        "  else t2 = 31744 end",
        "else",
        "  t4 = math.ldexp(t2 % 8388608 + 8388608, floor(t2 / 8388608) - 126)",
        "  t2 = floor(t4)",
        "  if (t4 - t2) * 8192 + floor(X / 524288) >= 8192 then t2 = t2 + 1 end",
        "end",
        f"{v} = t2 + t3",
    ]


_STEP = f"X = (X * {LCG_A} + {LCG_C}) % 4294967296"  # the generator, one step a column


def lua_read_chunk(narrow: NarrowRows, names: list[str], offset: str) -> list[str]:
    """Lua: the locals ``names`` (k columns at float32 byte ``offset``, a Lua
    expression) set to the row's widened values."""
    k = len(names)
    joined = ", ".join(names)
    if narrow.dtype == "bf16":  # the row was widened by lua_row_start
        return [f"local {joined} = sunpack('<{'f' * k}', row, {offset} + 1)"]
    lines = [f"local {joined} = sunpack('<{'H' * k}', row, {_div(offset, 2)} + 1)"]
    for v in names:
        lines += _fp16_to_bits(v)
    lines.append(f"{joined} = sunpack('<{'f' * k}', spack('<{'I4' * k}', {joined}))")
    return lines


def lua_write_chunk(narrow: NarrowRows, names: list[str]) -> list[str]:
    """Lua: the values in ``names`` (the row's next k columns: chunks run in column
    order) rounded to float32, then stochastically to the narrow type, left as bits in
    ``names``."""
    k = len(names)
    joined = ", ".join(names)
    lines = [f"{joined} = sunpack('<{'I4' * k}', spack('<{'f' * k}', {joined}))"]
    for v in names:
        lines.append(_STEP)
        lines += _encode(narrow.dtype, v)
    return lines


def lua_row_functions(narrow: NarrowRows, dim: int) -> list[str]:
    """Lua functions of the counted push's sub-steps: ``dec_row(row)`` -> a table of the
    row's widened values ``[1..D]``; ``enc_row(W, X)`` -> the narrow bytes of ``W[1..D]``
    (rounded as :func:`lua_write_chunk` rounds)."""
    wb = 2 * dim
    ff, ii = f"'<{'f' * dim}'", f"'<{'I4' * dim}'"
    if narrow.dtype == "bf16":
        wide = f"(string.gsub(ssub(row, 1, {wb}), '..', '\\0\\0%0'))"  # one value, not two
        dec = ["local function dec_row(row)", f"return {{sunpack({ff}, {wide})}}", "end"]
    else:
        dec = ["local function dec_row(row)", f"local W = {{sunpack('<{'H' * dim}', row, 1)}}",
               "local t2, t3, t4", f"for j = 1, {dim} do", *_fp16_to_bits("W[j]"), "end",
               f"return {{sunpack({ff}, spack({ii}, unpack(W, 1, {dim})))}}", "end"]  # fmt: skip
    enc = [
        "local function enc_row(W, X)",
        f"local U = {{sunpack({ii}, spack({ff}, unpack(W, 1, {dim})))}}",
        "local t2, t3, t4",
        f"for j = 1, {dim} do",
        _STEP,
        *_encode(narrow.dtype, "U[j]"),
        "end",
        f"return spack('<{'H' * dim}', unpack(U, 1, {dim}))",
        "end",
    ]
    return dec + enc


def _div(offset: str, n: int) -> str:
    """The Lua expression ``offset / n`` (folded where ``offset`` is a number)."""
    if offset.isdigit():
        return str(int(offset) // n)
    return f"({offset}) / {n}"
