"""Atomic saves of a folder: a crash at any point leaves the previous save or the new one
at ``path``, never half of one.

A save writes everything into a private sibling folder ``<path>.tmp-<token>``
(:func:`begin`); :func:`swap_in` then renames it into place. A previous save at ``path``
is first renamed to ``<path>.prev`` and deleted once the new one is in; if a crash lands
between those two renames, ``<path>.prev`` holds the previous save, whole (a reader may
fall back to it, as :func:`ps.checkpoint.read_checkpoint` does), and the next save
completes the swap. A crash before the swap leaves only the ``.tmp-`` folder, which no
reader opens. Two saves to one path at the same time are not supported.

What may be replaced is the caller's to say: every function takes ``replaceable(path)``,
called when something exists at ``path``, which raises unless it is a save of the
caller's kind (a folder of the user's is never replaced).

:func:`saving` wraps the whole sequence, also for saves that several ranks write into
one folder (each rank its part, on one machine or a shared filesystem): every rank gets
the same temporary folder (rank 0 makes it, under rank 0's random token), rank 0 swaps
it in, and a failure on any rank leaves ``path`` as it was on every rank.

This lives in ps, not comm: ps is the lowest layer that saves anything (the stores'
checkpoints, :mod:`ps.checkpoint`), while comm moves tensors and writes no files. The
collective form needs only comm's process group and rank-0 helpers, which ps may use;
the model and run checkpoints above (``hybridrec.checkpoint``) save through the same
functions.
"""

from __future__ import annotations

import os
import secrets
import shutil
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from comm import LocalGroup, ProcessGroup, run_on_rank0, shared_token

#: ``replaceable(path)``: raises unless the existing ``path`` may be replaced by a save.
Replaceable = Callable[[Path], None]

TMP = ".tmp-"
PREV = ".prev"


def temp_folder(final: Path, token: int) -> Path:
    """The private sibling ``<final>.tmp-<token as 12 hex digits>`` a save writes into."""
    return final.with_name(f"{final.name}{TMP}{token:012x}")


def previous(final: Path) -> Path:
    """Where the previous save of ``final`` is while a swap replaces it."""
    return final.with_name(final.name + PREV)


def is_leftover(path: Path) -> bool:
    """Whether ``path`` is a temporary or previous folder of some save, not a save."""
    return TMP in path.name or path.name.endswith(PREV)


def fsync_dir(path: Path) -> None:
    """Make ``path``'s entries (files created or renamed in it) durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _check(final: Path, replaceable: Replaceable) -> None:
    if final.exists() or final.is_symlink():
        replaceable(final)


def begin(
    final: Path, replaceable: Replaceable, *, token: int | None = None, parents: bool = False
) -> Path:
    """Create and return the empty temporary folder of a save of ``final``
    (:func:`temp_folder` of ``token``, random if None). ``parents``: create missing
    parent folders. Raises (``replaceable``) if ``final`` must not be replaced."""
    _check(final, replaceable)
    if parents:
        final.parent.mkdir(parents=True, exist_ok=True)
    tmp = temp_folder(final, secrets.randbits(48) if token is None else token)
    tmp.mkdir()
    return tmp


def swap_in(tmp: Path, final: Path, replaceable: Replaceable) -> None:
    """Make the written folder ``tmp`` the save at ``final``; at every instant ``final`` or
    its :func:`previous` is a whole save. An empty folder at ``final`` is replaced too."""
    _check(final, replaceable)
    prev = previous(final)
    if final.is_dir() and not final.is_symlink() and not any(final.iterdir()):
        final.rmdir()
    if final.exists():
        if prev.exists():  # left by a crash after an earlier swap: final is whole, prev stale
            shutil.rmtree(prev)
        os.rename(final, prev)
    os.rename(tmp, final)
    fsync_dir(final.parent)
    if prev.exists():
        shutil.rmtree(prev, ignore_errors=True)


def abort(tmp: Path) -> None:
    """Remove an unfinished temporary folder (best effort); the save it was for keeps
    the previous one."""
    shutil.rmtree(tmp, ignore_errors=True)


@contextmanager
def saving(
    final: Path,
    replaceable: Replaceable,
    *,
    group: ProcessGroup | None = None,
    parents: bool = False,
) -> Iterator[Path]:
    """Collective over ``group`` (default: this process alone): a save of the folder
    ``final``. Yields its temporary folder, the same on every rank (made by rank 0), for
    every rank to write its part into; when the block ends, rank 0 swaps it in and every
    rank returns once it is in place. If the block or the swap raises (on every rank: a
    rank that fails alone must make the others raise too, e.g. with
    :func:`comm.agree`), rank 0 removes the temporary folder and ``final`` keeps the
    previous save."""
    group = LocalGroup() if group is None else group
    token = shared_token(group)
    tmp = temp_folder(final, token)
    run_on_rank0(
        group,
        lambda: begin(final, replaceable, token=token, parents=parents),
        f"creating {tmp}",
    )
    try:
        yield tmp
        run_on_rank0(group, lambda: swap_in(tmp, final, replaceable), f"renaming {tmp} to {final}")
    except BaseException:
        if group.rank == 0:
            abort(tmp)
        raise


def write_file(path: Path, text: str) -> None:
    """Replace the small file ``path`` with ``text`` atomically: written beside it first,
    then renamed over it (a reader sees the old text or the new, never part of one)."""
    tmp = path.with_name(f"{path.name}{TMP}{secrets.token_hex(4)}")
    try:
        with open(tmp, "x", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
