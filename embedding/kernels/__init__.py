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

fp16/bf16 weights (narrow tables) are widened as they are loaded and pooled in float32;
an update is stored stochastically rounded with the bits of :func:`ps.rounding.round_to`
(given the group's :class:`ps.kernels.narrow_rows.RoundingKeys` and clocks).

``triton`` is optional: this package imports it only inside the kernel
modules, so ``import embedding.kernels`` works without it. Callers ask
:func:`use_triton` per tensor and fall back to the torch path otherwise; the
first CUDA tensor asked about also builds and runs a trivial kernel once
(:func:`triton_builds`), since Triton compiles a C launcher with the machine's C
compiler and ``Python.h``, and without them every kernel would fail at its first
launch. See ``docs/kernels.md``.
"""

from __future__ import annotations

import functools
import os
import shutil
import sysconfig
import warnings
from pathlib import Path

import torch

__all__ = [
    "FUSED_OPTIMIZERS",
    "autotune_enabled",
    "interpreter_enabled",
    "python_include_dir",
    "triton_available",
    "triton_builds",
    "triton_prerequisites",
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
    """Whether the Triton kernels should handle tensors like ``t``: when triton imports,
    ``t`` is on CUDA and a trivial kernel builds and runs (:func:`triton_builds`, once
    per process). A CPU ``t`` takes the torch path even with ``TRITON_INTERPRET=1``
    (the interpreter is far slower than torch on the CPU), so it is never picked by
    accident; tests run the kernels in the interpreter by calling them directly."""
    return _wants_triton(t) and triton_builds(t.device)


def _wants_triton(t: torch.Tensor) -> bool:
    return t.is_cuda and triton_available()


#: The probe's answer (None: not run yet in this process).
_BUILDS: bool | None = None


def triton_builds(device: torch.device) -> bool:
    """True when a trivial Triton kernel compiles, launches and computes on ``device``
    (tried once per process; the answer holds for every device after it). When it
    fails, one ``RuntimeWarning`` names what this machine lacks
    (:func:`triton_prerequisites`) and the error, and the caller keeps the torch path.

    Building a kernel rather than only looking for a compiler: Triton caches the
    launcher it built, so a machine with a warm cache needs no compiler, and a
    compiler may be there and still fail (a missing ``Python.h``, a broken driver).
    """
    global _BUILDS
    if _BUILDS is None:
        _BUILDS = _probe(device)
    return _BUILDS


def _probe(device: torch.device) -> bool:
    try:
        _build_probe_kernel(device)
    except Exception as e:  # a compiler error, a missing header, a driver error
        missing = triton_prerequisites()
        lacks = "; ".join(missing) if missing else "no missing prerequisite found"
        warnings.warn(
            f"the Triton kernels cannot be built on {device} ({lacks}): "
            f"{type(e).__name__}: {str(e)[:300]}. The fused embedding tables use the torch "
            "path instead (F.embedding_bag and the ps optimizers), with the same results "
            "and more time per step",
            RuntimeWarning,
            stacklevel=4,
        )
        return False
    return True


def _build_probe_kernel(device: torch.device) -> None:
    """Compile and run the trivial kernel of :mod:`embedding.kernels._probe` on ``device``."""
    from embedding.kernels._probe import run_probe

    run_probe(device)


def python_include_dir() -> Path:
    """Where Triton looks for ``Python.h`` when it builds a launcher (the same scheme rule)."""
    scheme = sysconfig.get_default_scheme()
    if scheme == "posix_local":  # Debian's scheme; its headers live under posix_prefix
        scheme = "posix_prefix"
    return Path(sysconfig.get_paths(scheme=scheme)["include"])


def triton_prerequisites() -> list[str]:
    """What Triton needs to build a kernel's launcher and this machine lacks, each as a
    phrase naming it and the fix; empty when everything is there.

    Triton compiles its launcher with ``$CC``, else ``gcc``, else ``clang`` from
    ``PATH``, against this Python's ``Python.h``.
    """
    missing = []
    cc = os.environ.get("CC")
    if cc is not None:
        if shutil.which(cc) is None:
            missing.append(f"the C compiler CC={cc!r} is not found (set CC to one, or unset it)")
    elif shutil.which("gcc") is None and shutil.which("clang") is None:
        missing.append("no C compiler: CC is unset and neither gcc nor clang is on PATH")
    include = python_include_dir()
    if not (include / "Python.h").is_file():
        missing.append(
            f"no Python.h in {include} (install this Python's development headers, "
            "e.g. python3-dev)"
        )
    return missing


def autotune_enabled(t: torch.Tensor) -> bool:
    """Whether the forward launcher autotunes its tile shape for tensors like ``t``.

    Only on a GPU (the interpreter has no timer to tune with: it uses a fixed
    config) and unless ``HYBRIDREC_TRITON_AUTOTUNE=0`` asks for the fixed config
    there too (e.g. to time one known config).
    """
    if not t.is_cuda or interpreter_enabled():
        return False
    return os.environ.get("HYBRIDREC_TRITON_AUTOTUNE", "1") != "0"
