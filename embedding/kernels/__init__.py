"""embedding.kernels: Triton GPU kernels for the fused (table-batched) local placement.

Kernels over ONE flat weight ``[R, D]`` holding every table of a fused group
(table ``t`` owns rows ``[base[t], base[t] + rows[t])``; ids arrive already
offset by their table's base, as in FBGEMM's TBE):

- :func:`embedding.kernels.triton_pool.pooled_lookup` -- gather + sum/mean pool,
  optional per-id weights, empty bags give zeros;
- :func:`embedding.kernels.triton_optimizers.fused_backward_` -- the backward of
  that pool fused with any ps optimizer (SGD with or without momentum, row-wise
  Adagrad, Adagrad, Adam, FTRL), in place, deterministic;
  :func:`~embedding.kernels.triton_optimizers.apply_rows_` the same update from
  gradients already coalesced per row (data parallel).

``triton`` is optional: this package imports it only inside the kernel
modules, so ``import embedding.kernels`` works without it. Callers ask
:func:`use_triton` per tensor and fall back to the torch path otherwise. See
``docs/kernels.md``.
"""

from __future__ import annotations

import functools
import os

import torch

__all__ = [
    "FUSED_OPTIMIZERS",
    "autotune_enabled",
    "interpreter_enabled",
    "triton_available",
    "use_triton",
]

#: ``Optimizer.kind`` of every ps optimizer the Triton backward fuses.
FUSED_OPTIMIZERS = frozenset({"sgd", "rowwise_adagrad", "adagrad", "adam", "ftrl"})


@functools.cache
def triton_available() -> bool:
    """True when ``triton`` and ``triton.language`` import (checked once per process)."""
    try:
        import triton  # noqa: F401
        import triton.language  # noqa: F401
    except Exception:  # ImportError, or a broken install failing at import time
        return False
    return True


def interpreter_enabled() -> bool:
    """True when ``TRITON_INTERPRET=1``: Triton runs kernels in its numpy interpreter.

    Triton reads this variable when a kernel is *defined* (at import of the kernel
    module), so it must be set before the first import of ``triton_pool`` /
    ``triton_optimizers`` in the process.
    """
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def use_triton(t: torch.Tensor) -> bool:
    """Whether the Triton kernels should handle tensors like ``t``: when triton imports
    and ``t`` is on CUDA. A CPU ``t`` takes the torch path even with ``TRITON_INTERPRET=1``
    (the interpreter is far slower than torch on the CPU), so it is never picked by
    accident; tests run the kernels in the interpreter by calling them directly."""
    return t.is_cuda and triton_available()


def autotune_enabled(t: torch.Tensor) -> bool:
    """Whether the forward launcher autotunes its tile shape for tensors like ``t``.

    Only on a GPU (the interpreter has no timer to tune with: it uses a fixed
    config) and unless ``HYBRIDREC_TRITON_AUTOTUNE=0`` asks for the fixed config
    there too (e.g. to time one known config).
    """
    if not t.is_cuda or interpreter_enabled():
        return False
    return os.environ.get("HYBRIDREC_TRITON_AUTOTUNE", "1") != "0"
