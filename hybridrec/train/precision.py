"""The dense math's precision: fp32, or bf16 under autocast.

Under ``bf16`` the matmuls and convolutions of the forward run in bfloat16 (torch's
autocast lists), reductions and losses stay in fp32, and every parameter, gradient,
optimizer state and embedding row stays fp32, so no loss scaling is needed (bf16 has
fp32's exponent range).
"""

from __future__ import annotations

import contextlib

import torch

PRECISIONS = ("fp32", "bf16")


def autocast(device: torch.device, precision: str) -> contextlib.AbstractContextManager[None]:
    """The context the forward and loss run in for ``precision`` on ``device``."""
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {PRECISIONS}, got {precision!r}")
    if precision == "fp32":
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=torch.bfloat16)
