"""Natural compression (Horvath et al., 2019): stochastic rounding to a power of two.

A value ``x`` with ``2^e <= |x| < 2^(e+1)`` becomes ``sign(x) * 2^(e+1)`` with
probability ``(|x| - 2^e) / 2^e`` and ``sign(x) * 2^e`` otherwise, so
``E[C(x)] = x`` (unbiased) and ``Var[C(x)] <= x^2 / 8``. Zero stays zero.

Wire format (1 byte per value + 4 bytes per vector). The paper keeps float32's sign
and 8 exponent bits (9 bits). We fit one byte by sending exponents relative to the
vector's largest one, ``E`` (the smallest power of two >= max|x|), which travels
as the ``scale`` (a float32 holding the integer ``E``)::

    bit 7     sign
    bits 0-6  c = 0: zero;  c = 1..127: magnitude 2^(E - 127 + c)

so 126 binades below ``2^E`` are representable (float32 itself spans ~277). A value
below the smallest level ``2^(E-126)`` is rounded stochastically to 0 or to
``2^(E-126)`` with probability ``|x| / 2^(E-126)``: still unbiased, and such values
are at least 2^125 times smaller than the largest. Levels beyond float32's range
decode to Inf (needs ``|x| >= 2^127``) or underflow to 0 (below ~2^-149).
"""

from __future__ import annotations

import torch

from comm.compression.base import Codec, Encoded

_LEVELS = 127  # codes 1..127 are magnitudes; code 0 is zero
_SIGN = 128


class NaturalCompression(Codec):
    """Unbiased rounding to powers of two, one byte per value; see the module docstring."""

    name = "natural"
    unbiased = True

    def _encode(self, t: torch.Tensor, key: str) -> Encoded:
        # The reference exponent stays a 0-d tensor on t's device: no host sync per call.
        a = t.abs().double()  # [n]; float64 so the probabilities below are exact
        mant, exp = torch.frexp(a)  # a = mant * 2^exp, mant in [0.5, 1) (0 for a == 0)
        nonzero = a > 0
        # 2^top > max|x| (exp of a zero is 0 and never the largest unless all are zero).
        lowest = torch.iinfo(exp.dtype).min
        top = torch.where(nonzero, exp, lowest).amax() if a.numel() else exp.new_zeros(())
        top = torch.where(top == lowest, 0, top)  # 0-d; 0 when every value is zero
        low_exp = exp - 1  # 2^low_exp <= a < 2^(low_exp + 1)
        floor_exp = top - (_LEVELS - 1)  # the smallest level, code 1
        u = torch.rand(
            a.numel(), generator=self.generator(a.device), dtype=torch.float64, device=a.device
        )
        # In range: up one binade with probability 2*mant - 1 = (a - 2^low) / 2^low.
        code = low_exp + (u < 2.0 * mant - 1.0).to(exp.dtype) - floor_exp + 1
        # Below the smallest level: 0 or 2^floor_exp, with probability a / 2^floor_exp.
        tiny = low_exp < floor_exp
        tiny_up = u < a * torch.exp2(-floor_exp.double())  # exact: a power-of-two scaling
        code = torch.where(tiny, tiny_up.to(code.dtype), code)
        code = torch.where(nonzero, code, 0).to(torch.uint8)  # [n] in 0..127
        payload = code | (t < 0).to(torch.uint8) * _SIGN
        scale = top.reshape(1).to(torch.float32)  # [1], the integer E
        return Encoded(payload=payload, scale=scale)

    def _decode(self, e: Encoded, numel: int) -> torch.Tensor:
        assert e.scale is not None
        top = e.scale.to(torch.int64)  # [1], the integer E
        code = (e.payload & (_SIGN - 1)).long()  # [n]
        mag = torch.exp2((code + (top - _LEVELS)).double())  # exact powers of two
        mag = torch.where(code > 0, mag, 0.0)
        sign = 1.0 - 2.0 * (e.payload >> 7).double()
        return (mag * sign).float()

    def _wire_bytes(self, numel: int) -> int:
        return numel + 4
