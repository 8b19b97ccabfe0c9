"""Stochastic rounding of float32 rows to fp16 or bf16, reproducible from a seed.

A narrow table (``TableSpec.dtype`` "fp16" or "bf16") computes every update in float32
and stores the result rounded *stochastically*: a value between two neighbours of the
narrow type goes to the upper one with probability equal to its distance from the lower
one over the gap, so the expected stored value is the float32 result. Rounding to the
nearest would drop every update smaller than half a step of the row's magnitude (an
fp16 weight of 0.1 moves in steps of 6e-5; bf16 in steps of 5e-4), so small learning
rates would stop training; stochastic rounding keeps them on average (FBGEMM's fp16
weights round the same way).

The random bits are a pure function of ``(seed, row id, version, column)``, with the
row's version its clock after the update: the same run rounds the same way every time,
a resumed run exactly as the uninterrupted one, and every shard layout alike (ids are
the table's ids, not a shard's rows). One 64-bit hash gives the draws of four columns
(uint64, wrapping; ``>>`` logical)::

    key  = splitmix64(splitmix64(splitmix64(seed & (2**63 - 1)) ^ id)
                      + version * 0x9E3779B97F4A7C15)      # per row
    h    = key + (column // 4 + 1) * 0xD1B54A32D192ED03   # per group of four columns
    h   ^= h >> 33;  h *= 0xFF51AFD7ED558CCD               # murmur3's fmix64
    h   ^= h >> 33;  h *= 0xC4CEB9FE1A85EC53
    h   ^= h >> 33
    bits = (h >> (16 * (column % 4))) & 0xFFFF             # 16 random bits per element

The finaliser mixes every input bit into every output bit, so the four 16-bit lanes of
one hash are draws as good as four hashes' (``tests/ps/test_rounding.py`` checks their
uniformity and independence). Two 64-bit multiplies per four elements keep the hash
cheaper than what halving a row's bytes saves: a narrow row's update costs no more than a
float32 one.

Rounding works on the float32 bit pattern (sign and magnitude, so adding to the low
bits moves the magnitude): bf16 keeps the top 16 bits, so the 16 random bits are added
and the low 16 bits cleared; fp16 keeps 10 of float32's 23 mantissa bits, so the low 13
random bits (``bits & 0x1fff``) are added and 13 cleared, which is exact in fp16's
normal range; below it (``|x| < 2**-14``, fp16's subnormals, a fixed step of
``2**-24``) the value is first shifted by ``2**-14`` into the lowest normal binade,
whose step is the same, rounded there, and shifted back. Magnitudes past fp16's largest
finite value (65504) saturate there. Non-finite values are converted as they are.
"""

from __future__ import annotations

import torch

from ps.routing import splitmix64

_GOLDEN = -0x61C8864680B583EB  # 0x9E3779B97F4A7C15 as int64
_GROUP = -0x2E4AB5CD2E6D12FD  # 0xD1B54A32D192ED03 as int64
_FMIX1 = -0x00AE502812AA7333  # 0xFF51AFD7ED558CCD as int64
_FMIX2 = -0x3B314601E57A13AD  # 0xC4CEB9FE1A85EC53 as int64
_FP16_MAX = 65504.0
_FP16_MIN_NORMAL = 2.0**-14


def _shr(x: torch.Tensor, k: int) -> torch.Tensor:
    """Logical right shift of int64 bits."""
    return (x >> k) & ((1 << (64 - k)) - 1)


def _fmix64(h: torch.Tensor) -> torch.Tensor:
    """murmur3's 64-bit finaliser on int64 bits (the multiplies wrap)."""
    h = (h ^ _shr(h, 33)) * _FMIX1
    h = (h ^ _shr(h, 33)) * _FMIX2
    return h ^ _shr(h, 33)


def rounding_bits(seed: int, ids: torch.Tensor, versions: torch.Tensor, dim: int) -> torch.Tensor:
    """16 random bits per element (int64 ``[N, dim]`` in ``[0, 2**16)``) for rows ``ids``
    int64 ``[N]`` at ``versions`` int64 ``[N]``: column ``j`` takes lane ``j % 4`` of its
    group's hash (see the module docstring)."""
    # a Python int: the ids may live on a device
    seed_key = int(splitmix64(torch.tensor([seed & ((1 << 63) - 1)], dtype=torch.int64))[0])
    ids, versions = ids.to(torch.int64), versions.to(device=ids.device, dtype=torch.int64)
    key = splitmix64(splitmix64(ids ^ seed_key) + versions * _GOLDEN)  # [N]
    groups = -(-dim // 4)
    steps = torch.arange(1, groups + 1, dtype=torch.int64, device=ids.device) * _GROUP
    h = _fmix64(key[:, None] + steps[None, :])  # [N, G]
    # lane l is bits 16l..16l+15; an arithmetic shift of at most 48 leaves them in the
    # low 16 bits, which the mask keeps
    lanes = torch.arange(0, 64, 16, dtype=torch.int64, device=ids.device)  # [4]
    bits = (h[:, :, None] >> lanes) & 0xFFFF  # [N, G, 4]
    return bits.reshape(h.shape[0], 4 * groups)[:, :dim]


def round_to(
    values: torch.Tensor,
    dtype: torch.dtype,
    *,
    seed: int,
    ids: torch.Tensor,
    versions: torch.Tensor,
) -> torch.Tensor:
    """float32 ``values`` ``[N, D]`` of rows ``ids`` ``[N]`` stochastically rounded to
    ``dtype`` (float16 or bfloat16; float32 returns ``values``): a new ``[N, D]`` tensor."""
    if dtype == torch.float32:
        return values
    if dtype not in (torch.float16, torch.bfloat16):
        raise ValueError(f"round_to: no stochastic rounding to {dtype}; expected fp16 or bf16")
    n, d = values.shape
    if n == 0:
        return torch.empty(0, d, dtype=dtype, device=values.device)
    x = values.to(torch.float32).contiguous()
    bits = rounding_bits(seed, ids, versions, d).to(values.device)  # [N, D]
    if dtype == torch.bfloat16:
        raw = x.view(torch.int32).to(torch.int64)
        up = ((raw + (bits & 0xFFFF)) & ~0xFFFF).to(torch.int32)  # wraps like int32 bits
        out = up.view(torch.float32)
    else:  # float16
        mag = x.abs()
        small = mag < _FP16_MIN_NORMAL
        shifted = torch.where(small, mag + _FP16_MIN_NORMAL, mag)
        raw = shifted.view(torch.int32).to(torch.int64)
        up = ((raw + (bits & 0x1FFF)) & ~0x1FFF).to(torch.int32).view(torch.float32)
        up = torch.where(small, up - _FP16_MIN_NORMAL, up).clamp_(max=_FP16_MAX)
        out = torch.copysign(up, x)
    out = torch.where(torch.isfinite(x), out, x)
    return out.to(dtype)
