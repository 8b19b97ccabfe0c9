"""Build a small C source into a shared library on first use, cached per user and CPU.

Plain C (no torch headers: a build takes well under a second), compiled with the
system C compiler (``$CC``, else ``cc``/``gcc``) into ``$HYBRIDREC_KERNEL_DIR``
(default ``~/.cache/hybridrec/kernels``) under a name hashed from the source, the
compiler, the flags and the CPU (``-march=native`` code must not move to another
CPU), and loaded with ``ctypes``. Flags are tried from the fastest set down
(``-march=native -fopenmp``, then without ``-march``, then without OpenMP).

:func:`load_c_library` returns None where there is no compiler, every build fails,
or ``HYBRIDREC_CPU_KERNEL=0`` is set; callers then take their torch path.

Kernel convention: a package's C kernels live in its ``kernels`` subpackage, one
pair of files per kernel, ``<package>/kernels/<name>.c`` (the source, shipped as
package data) and ``<package>/kernels/<name>.py`` (the loader: reads the source with
:func:`kernel_source`, declares the ctypes signatures, holds the Python entry
points). The users:

* ``ps/kernels/rowwise_adagrad`` - fused row-wise Adagrad, id sort and segment sums
  (the ps table engine's pushes; ``embedding``'s CPU fused backward calls it too);
* ``ps/kernels/message_pass`` - an MPI server's whole batched messages (compiled with
  ``rowwise_adagrad.c`` in one library);
* ``ps/kernels/narrow_rows`` - fp16 / bf16 rows: stochastic rounding, row-wise Adagrad
  on narrow rows, pooling in float32 (compiled with ``rowwise_adagrad.c`` too);
* ``cache/kernels/records`` - the cache's slot records (serve rows, install, apply pushes);
* ``cache/kernels/sketch`` - the TinyLFU frequency sketch (count, estimate);
* ``cache/kernels/sorted_ids`` - the difference of two sorted id arrays (a prefetch's
  ids less the serving pull's);
* ``dense/kernels/interaction`` - the DLRM pairwise interaction.

It lives in ``comm`` because ``ps``, ``cache`` and ``dense`` all build kernels with it
and the layering lets ``dense`` share code with the others only through ``comm``.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import importlib.resources
import os
import platform
import shutil
import subprocess
import tempfile
from collections.abc import Callable
from pathlib import Path

FLAG_SETS = (
    ("-O3", "-march=native", "-fopenmp"),
    ("-O3", "-fopenmp"),
    ("-O3",),
)


def _cache_dir() -> Path:
    env = os.environ.get("HYBRIDREC_KERNEL_DIR")
    return Path(env) if env else Path.home() / ".cache" / "hybridrec" / "kernels"


@functools.cache
def _cpu_tag() -> str:
    tag = platform.machine()
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith(("flags", "Features", "model name")):
                    tag += line
                    if len(tag) > 4096:
                        break
    except OSError:
        pass
    return tag


def _compile(cc: str, flags: tuple[str, ...], source: str, out: Path) -> bool:
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        src = Path(tmp) / "kernel.c"
        src.write_text(source, encoding="utf-8")
        so = Path(tmp) / out.name
        cmd = [cc, *flags, "-shared", "-fPIC", str(src), "-o", str(so), "-lm"]
        try:
            done = subprocess.run(cmd, capture_output=True, timeout=120, check=False)
        except (OSError, subprocess.SubprocessError):
            return False
        if done.returncode != 0 or not so.exists():
            return False
        os.replace(so, out)  # atomic: several processes may build the same file
    return True


def kernel_source(package: str, name: str) -> str:
    """The C source ``<name>.c`` of ``package`` (a ``kernels`` subpackage; see the module
    docstring). Read through :mod:`importlib.resources`, so it is found in a checkout, an
    editable install and an installed wheel alike."""
    return importlib.resources.files(package).joinpath(f"{name}.c").read_text(encoding="utf-8")


def load_c_library(
    name: str, source: str, declare: Callable[[ctypes.CDLL], None] | None = None
) -> ctypes.CDLL | None:
    """``source`` built and loaded (see the module docstring), or None.

    ``declare(lib)`` sets the functions' ``argtypes``/``restype``; it runs once per
    library. Cheap after the first call: the result is kept per (name, source,
    settings), since callers ask on every step (a lookup of the compiler, a hash and a
    ``dlopen`` cost ~0.5 ms, 12 ms per step of a 26-table push)."""
    enabled = os.environ.get("HYBRIDREC_CPU_KERNEL", "1")
    lib = _load(name, source, enabled, os.environ.get("CC"))
    if lib is not None and declare is not None:
        _declare_once(lib, declare)
    return lib


@functools.cache
def _declare_once(lib: ctypes.CDLL, declare: Callable[[ctypes.CDLL], None]) -> None:
    declare(lib)


@functools.cache
def _load(name: str, source: str, enabled: str, cc_env: str | None) -> ctypes.CDLL | None:
    if enabled == "0":
        return None
    cc = cc_env or shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        return None
    for flags in FLAG_SETS:
        key = hashlib.sha256("\0".join([source, cc, *flags, _cpu_tag()]).encode()).hexdigest()
        path = _cache_dir() / f"{name}_{key[:20]}.so"
        try:
            if not path.exists() and not _compile(cc, flags, source, path):
                continue
            return ctypes.CDLL(str(path))
        except OSError:
            continue
    return None
