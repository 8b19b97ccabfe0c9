"""Tokenizers for the language-model example: raw bytes, and GPT-2's byte-pair encoding.

``ByteTokenizer``: one token per UTF-8 byte, vocabulary 256.

``GPT2Tokenizer``: GPT-2's BPE from a ``gpt2.tiktoken`` file (shipped in the
``openai-whisper`` sdist as ``whisper/assets/gpt2.tiktoken``), written here in a
few lines instead of depending on ``tiktoken``. The file has one line per token,
``base64(token bytes) rank``; the rank is the token id and also the merge
priority (a lower rank was learned earlier, so it merges first). Id 50256 is
``<|endoftext|>``, which is not in the file. Encoding:

1. Split the text into chunks with GPT-2's pre-tokenizer pattern (contractions,
   runs of letters, of digits, of other symbols, each with one optional leading
   space, and runs of whitespace), so merges never cross chunk boundaries.
2. In each chunk's UTF-8 bytes, repeatedly merge the adjacent pair whose
   concatenation has the lowest rank, until no adjacent pair is a token. Every
   single byte is a token, so any text encodes and ``decode(encode(s)) == s``.

The pattern differs from GPT-2's in one place: GPT-2 uses the third-party ``regex``
module's ``\\p{L}`` (letters) and ``\\p{N}`` (numbers); Python's ``re`` has
neither, so letters are ``[^\\W\\d_]`` and numbers are ``\\d``. That is the same
for ASCII and for every letter and decimal digit; non-decimal numeric characters
(Unicode No/Nl, e.g. "½", "²", "Ⅻ") count as letters here instead of numbers,
and ``\\s`` follows ``str.isspace`` (which also includes the ASCII separators
0x1C-0x1F) instead of Unicode White_Space. Text without such characters encodes to
exactly GPT-2's ids. Special tokens in the text are encoded as plain text.
"""

from __future__ import annotations

import base64
import re
from pathlib import Path

# GPT-2's pattern, with \p{L} -> [^\W\d_] and \p{N} -> \d (see the module docstring).
_LETTERS = r"[^\W\d_]"
_NUMBERS = r"\d"
GPT2_SPLIT = re.compile(
    r"'s|'t|'re|'ve|'m|'ll|'d"
    rf"| ?{_LETTERS}+"
    rf"| ?{_NUMBERS}+"
    rf"| ?(?:[^\s\w]|_)+"  # neither space, letter nor number ("_" is \w but not a letter)
    r"|\s+(?!\S)"  # trailing whitespace run, leaving its last space to the next word
    r"|\s+"
)
END_OF_TEXT = "<|endoftext|>"


class ByteTokenizer:
    """One token per UTF-8 byte (vocabulary 256). Decoding invalid UTF-8 inserts U+FFFD."""

    name = "byte"
    vocab_size = 256

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int]) -> str:
        return bytes(ids).decode("utf-8", errors="replace")


class GPT2Tokenizer:
    """GPT-2 byte-pair encoding from a ``gpt2.tiktoken`` rank file (50257 tokens)."""

    name = "gpt2"

    def __init__(self, ranks: dict[bytes, int]) -> None:
        if len(ranks) < 256 or any(bytes([b]) not in ranks for b in range(256)):
            raise ValueError(
                f"GPT2Tokenizer: the rank table must contain all 256 single bytes, got "
                f"{len(ranks)} tokens"
            )
        self._ranks = ranks
        self._eot = max(ranks.values()) + 1  # 50256 for GPT-2
        self._bytes: dict[int, bytes] = {r: tok for tok, r in ranks.items()}
        self._bytes[self._eot] = END_OF_TEXT.encode()
        self.vocab_size = self._eot + 1
        self._cache: dict[str, list[int]] = {}  # chunk -> ids; text repeats chunks a lot

    @classmethod
    def from_file(cls, path: str | Path) -> GPT2Tokenizer:
        return cls.from_bytes(Path(path).read_bytes(), source=str(path))

    @classmethod
    def from_bytes(cls, data: bytes, source: str = "<bytes>") -> GPT2Tokenizer:
        """Parse ``base64 rank`` lines (the tiktoken file format)."""
        ranks: dict[bytes, int] = {}
        for n, line in enumerate(data.splitlines(), start=1):
            if not line.strip():
                continue
            parts = line.split()
            if len(parts) != 2:
                raise ValueError(
                    f"{source}: line {n} should be 'base64-token rank', got {line[:60]!r}"
                )
            ranks[base64.b64decode(parts[0])] = int(parts[1])
        return cls(ranks)

    @property
    def eot(self) -> int:
        """The id of ``<|endoftext|>``."""
        return self._eot

    def encode(self, text: str) -> list[int]:
        out: list[int] = []
        cache = self._cache
        for chunk in GPT2_SPLIT.findall(text):
            ids = cache.get(chunk)
            if ids is None:
                ids = self._merge(chunk.encode("utf-8"))
                if len(cache) < 1_000_000:
                    cache[chunk] = ids
            out.extend(ids)
        return out

    def decode(self, ids: list[int]) -> str:
        try:
            data = b"".join(self._bytes[i] for i in ids)
        except KeyError as e:
            raise ValueError(
                f"GPT2Tokenizer: token id {e.args[0]} is out of range [0, {self.vocab_size})"
            ) from None
        return data.decode("utf-8", errors="replace")

    def _merge(self, piece: bytes) -> list[int]:
        """Byte-pair merge of one chunk: lowest-rank adjacent pair first."""
        ranks = self._ranks
        whole = ranks.get(piece)
        if whole is not None:
            return [whole]
        parts = [piece[i : i + 1] for i in range(len(piece))]
        while len(parts) > 1:
            best, best_rank = -1, len(ranks) + 1
            for i in range(len(parts) - 1):
                r = ranks.get(parts[i] + parts[i + 1])
                if r is not None and r < best_rank:
                    best, best_rank = i, r
            if best < 0:
                break
            parts[best : best + 2] = [parts[best] + parts[best + 1]]
        return [ranks[p] for p in parts]
