"""Identity and low-precision casts: ``none`` (float32), ``fp16``, ``bf16``.

The casts are deterministic and biased only by rounding to nearest (relative error
at most 2^-11 for fp16, 2^-8 for bf16). fp16 saturates: values beyond its largest
finite number (65504) are clamped to +-65504 rather than becoming Inf, so one large
gradient cannot poison the average. bf16 has float32's range and never overflows.
"""

from __future__ import annotations

import torch

from comm.compression.base import Codec, Encoded

_FP16_MAX = float(torch.finfo(torch.float16).max)


class NoCompression(Codec):
    """float32 as is: 4 bytes per value. The allreduce uses a plain average for it."""

    name = "none"
    unbiased = True

    def _encode(self, t: torch.Tensor, key: str) -> Encoded:
        return Encoded(payload=t.clone())

    def _decode(self, e: Encoded, numel: int) -> torch.Tensor:
        return e.payload.float().clone()

    def _wire_bytes(self, numel: int) -> int:
        return 4 * numel


class Fp16Cast(Codec):
    """IEEE half precision: 2 bytes per value, saturating at +-65504."""

    name = "fp16"
    unbiased = False

    def _encode(self, t: torch.Tensor, key: str) -> Encoded:
        return Encoded(payload=t.clamp(-_FP16_MAX, _FP16_MAX).to(torch.float16))

    def _decode(self, e: Encoded, numel: int) -> torch.Tensor:
        return e.payload.float()

    def _wire_bytes(self, numel: int) -> int:
        return 2 * numel


class Bf16Cast(Codec):
    """bfloat16: float32's exponent with 8 bits of mantissa; 2 bytes per value."""

    name = "bf16"
    unbiased = False

    def _encode(self, t: torch.Tensor, key: str) -> Encoded:
        return Encoded(payload=t.to(torch.bfloat16))

    def _decode(self, e: Encoded, numel: int) -> torch.Tensor:
        return e.payload.float()

    def _wire_bytes(self, numel: int) -> int:
        return 2 * numel
