"""Hashed n-gram input tables for language models (over-encoding).

The input vector of position ``t`` is the token's row plus, for every ``n`` in
``2 .. N``, the row of the n-gram of tokens ``t-n+1 .. t`` in a table of its own
(Over-Tokenized Transformers, Huang et al. 2025; SCONE, Yu et al. 2025). The
n-grams of a vocabulary of V tokens number ``V**n``, so each is *hashed* into a
fixed table of ``rows`` rows, or kept as a 63-bit id for a dynamic table whose rows
exist only for the n-grams seen. Their use is Zipf-skewed and sparse: exactly what
hybrid tables (rows in a parameter server, behind the hot-row cache) are for.

**The ids.** :func:`ngram_ids` maps token ids ``[B, T]`` to one int64 id per
position ``[B, T]``; one definition, which the tests replay in plain Python:

* the n-gram of position ``t`` is the codes ``c[t-n+1], ..., c[t]`` with
  ``c[j] = token[j] + 1``, and ``c[j] = 0`` (padding, outside every vocabulary) for
  ``j < 0``: the first ``n - 1`` positions of a window see where it starts;
* ``h = mix(seed ^ mix(n))``, then ``h = mix(h ^ c)`` for each code in order, with
  ``mix`` the splitmix64 finaliser on 64-bit words (wrapping);
* ``id = h >> 1`` (63 bits, >= 0) for a dynamic table, ``(h >> 1) % rows`` for a
  fixed one.

It is pure integer arithmetic on the tokens, so every rank computes the same ids,
on any device, with a few vectorised passes per ``n`` (no loop over positions).

**The tables.** :class:`NGramConfig` names ``(N - 1) * splits`` tables: per ``n``,
``splits`` sub-tables of width ``dim / splits``, each hashed with its own seed, whose
rows are concatenated (a position's n-gram vector is a combination of ``splits``
rows, so ``rows ** splits`` n-grams are told apart for the memory of ``rows`` full
rows). Rows start at zero: a fresh model computes exactly what it would without
them, and a row moves only once its n-gram is trained on.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from embedding.config import Placement, TableConfig
from ps import Adam, Optimizer, UniformInit
from ps.routing import splitmix64 as mix  # the stores' row hash, on int64 words

MAX_SPLITS = 1024  # a sub-table's hash seed is (seed << 10) | split
MAX_SEED = 2**53  # keeps (seed << 10) | split inside 63 bits


def ngram_ids(tokens: torch.Tensor, n: int, *, rows: int | None, seed: int = 0) -> torch.Tensor:
    """Ids of the n-grams ending at each position: int64 ``[B, T]`` from tokens ``[B, T]``.

    ``rows`` > 0 hashes into ``[0, rows)`` (a fixed table); None keeps 63-bit ids (a
    dynamic table). ``seed`` selects the hash (see the module docstring). Token ids
    are not range-checked here: the token table of the same batch checks them.
    """
    if not isinstance(tokens, torch.Tensor) or tokens.dtype != torch.int64 or tokens.dim() != 2:
        what = (
            f"{tokens.dtype} {tuple(tokens.shape)}"
            if isinstance(tokens, torch.Tensor)
            else type(tokens).__name__
        )
        raise TypeError(f"ngram_ids: tokens must be an int64 tensor [B, T], got {what}")
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        raise ValueError(f"ngram_ids: n must be an int >= 1, got {n!r}")
    if rows is not None and (
        not isinstance(rows, int) or isinstance(rows, bool) or not 0 < rows < 2**63
    ):  # ids are int64: a remainder by 2**63 or more would wrap to negative ids
        raise ValueError(
            f"ngram_ids: rows must be an int in [1, 2**63) or None (dynamic), got {rows!r}"
        )
    if not isinstance(seed, int) or isinstance(seed, bool) or not 0 <= seed < 2**63:
        raise ValueError(f"ngram_ids: seed must be an int in [0, 2**63), got {seed!r}")
    b, t = tokens.shape
    pad = torch.zeros(b, n - 1, dtype=torch.int64, device=tokens.device)
    codes = torch.cat([pad, tokens + 1], dim=1)  # [B, n-1+T]: 0 = before the window
    # The hash's start for (seed, n), computed on the host; it reaches the device as the
    # fill value of a kernel, not as a tensor copied there each step.
    key = int(
        mix(torch.tensor([seed], dtype=torch.int64) ^ mix(torch.tensor([n], dtype=torch.int64)))
    )
    h = torch.full((b, t), key, dtype=torch.int64, device=tokens.device)  # [B, T]
    for k in range(n):  # the n codes of each position's n-gram, oldest first
        h = mix(h ^ codes[:, k : k + t])
    ids = (h >> 1) & ((1 << 63) - 1)  # [B, T]: the top 63 bits, logical shift, in [0, 2**63)
    return ids if rows is None else torch.remainder(ids, rows)


@dataclass(kw_only=True, frozen=True, slots=True)
class NGramConfig:
    """Hashed n-gram input tables for ``n = 2 .. max_n``, added to the token vectors.

    * ``rows``: rows per table (hashed ids), or None for dynamic tables keyed by the
      63-bit ids, optionally bounded by ``capacity`` (LRU) and ``max_age_steps``.
    * ``dim``: the token vector's width; ``splits`` sub-tables per ``n`` of
      ``dim / splits`` each (see the module docstring).
    * ``placement``, ``optimizer``: as for any :class:`TableConfig`.
    * ``seed``: the hash seed (every rank must use the same).
    """

    max_n: int
    rows: int | None
    dim: int
    splits: int = 1
    placement: Placement = "hybrid"
    optimizer: Optimizer = field(default_factory=lambda: Adam(lr=0.01))
    seed: int = 0
    capacity: int | None = None
    max_age_steps: int | None = None
    prefix: str = "ngram"

    def __post_init__(self) -> None:
        if not isinstance(self.max_n, int) or isinstance(self.max_n, bool) or self.max_n < 2:
            raise ValueError(f"NGramConfig: max_n must be an int >= 2, got {self.max_n!r}")
        if (
            not isinstance(self.splits, int)
            or isinstance(self.splits, bool)
            or not 1 <= self.splits <= MAX_SPLITS
        ):
            raise ValueError(
                f"NGramConfig: splits must be an int in [1, {MAX_SPLITS}], got {self.splits!r}"
            )
        if (
            not isinstance(self.dim, int)
            or isinstance(self.dim, bool)
            or self.dim <= 0
            or self.dim % self.splits
        ):
            raise ValueError(
                f"NGramConfig: dim {self.dim!r} must be a positive multiple of splits "
                f"{self.splits} (each sub-table is dim / splits wide)"
            )
        if (
            not isinstance(self.seed, int)
            or isinstance(self.seed, bool)
            or not 0 <= self.seed < MAX_SEED
        ):
            raise ValueError(f"NGramConfig: seed must be an int in [0, 2**53), got {self.seed!r}")
        self.tables()  # the table rules (rows, placement, capacity) with the tables' names

    def features(self) -> list[tuple[str, int, int]]:
        """``(feature, n, split)`` of every table, n-major: ``("ngram3_1", 3, 1)``."""
        one = self.splits == 1
        return [
            (f"{self.prefix}{n}" if one else f"{self.prefix}{n}_{s}", n, s)
            for n in range(2, self.max_n + 1)
            for s in range(self.splits)
        ]

    def tables(self) -> list[TableConfig]:
        """One table per feature (named like it), pooling "none": ``[B, T, dim / splits]``."""
        return [
            TableConfig(
                name=feature,
                num_rows=self.rows,
                dim=self.dim // self.splits,
                feature_names=[feature],
                pooling="none",
                placement=self.placement,
                optimizer=self.optimizer,
                init=UniformInit(low=0.0, high=0.0),
                capacity=self.capacity,
                max_age_steps=self.max_age_steps,
            )
            for feature, _, _ in self.features()
        ]

    def ids(self, tokens: torch.Tensor) -> dict[str, torch.Tensor]:
        """``{feature: [B, T] int64}`` for the token ids ``[B, T]``."""
        return {
            feature: ngram_ids(tokens, n, rows=self.rows, seed=(self.seed << 10) | split)
            for feature, n, split in self.features()
        }

    def combine(self, rows: dict[str, torch.Tensor]) -> torch.Tensor:
        """The sum over ``n`` of each ``n``'s sub-table rows concatenated: ``[B, T, dim]``
        from ``{feature: [B, T, dim / splits]}``."""
        per_n: dict[int, list[torch.Tensor]] = {}
        for feature, n, _ in self.features():
            per_n.setdefault(n, []).append(rows[feature])
        parts = [torch.cat(p, dim=-1) if len(p) > 1 else p[0] for p in per_n.values()]
        out = parts[0]
        for p in parts[1:]:
            out = out + p
        return out
