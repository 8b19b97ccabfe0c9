"""Hashed n-gram input tables (embedding.ngram) against independent references.

* The ids: :func:`ref_ngram_ids` replays the module docstring's definition on Python
  ints with explicit 64-bit masks (splitmix64 pinned to its published outputs), for
  every position (the padded first ``n - 1`` too), ``n`` = 1, 2, 3, 5, both hash modes
  and seeds up to ``2**63 - 1``; then the properties the tables rely on (an id depends
  on exactly its window, equal windows share ids, rows are hit evenly), the errors,
  and the same ids on 2 and 4 real ranks (tests/embedding/ranks/ngram_ids.py, gloo).
* The tables: :class:`NGramConfig` naming, shapes and rules; a token table plus
  n-gram tables in one :class:`EmbeddingCollection` trained against plain
  ``nn.Embedding`` modules with hand-written SGD; local, fixed hybrid and dynamic
  hybrid tables training alike; dynamic tables creating rows only for the n-grams
  pushed and evicting them (LRU ``capacity``, ``max_age_steps``) exactly as a Python
  model of the store's rules (:class:`ps.TableSpec`) says.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.util
from types import ModuleType

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import ps
from embedding import EmbeddingCollection, KeyedJaggedIds, NGramConfig, TableConfig, ngram_ids
from embedding.config import Placement
from multiproc import rank_script, run_ranks
from tolerance import assert_close, assert_same, replay_tol, sum_tol

pytestmark = pytest.mark.timeout(120)

# ---------------------------------------------------------------- the reference hash

MASK = (1 << 64) - 1


def ref_mix(z: int) -> int:
    """splitmix64 on a uint64 held in a Python int: add the golden gamma, then the
    finaliser (Steele, Lea and Flood 2014; Vigna's splitmix64.c)."""
    z = (z + 0x9E3779B97F4A7C15) & MASK
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK
    return z ^ (z >> 31)


def ref_ngram_ids(tokens: list[list[int]], n: int, rows: int | None, seed: int) -> list[list[int]]:
    """The module docstring's ids, one position at a time: codes ``token + 1`` (0 before
    the window), ``h = mix(seed ^ mix(n))``, ``h = mix(h ^ code)`` oldest first,
    ``h >> 1``, then ``% rows`` for a fixed table."""
    key = ref_mix(seed ^ ref_mix(n))
    out = []
    for row in tokens:
        ids = []
        for t in range(len(row)):
            h = key
            for j in range(t - n + 1, t + 1):
                code = (row[j] + 1) & MASK if j >= 0 else 0
                h = ref_mix(h ^ code)
            v = h >> 1
            ids.append(v if rows is None else v % rows)
        out.append(ids)
    return out


def test_reference_mix_is_splitmix64() -> None:
    """The reference's mix is the published splitmix64: its output stream from state 0
    and from seed 1234567 (each output mixes the state advanced by the golden gamma)."""
    assert ref_mix(0) == 0xE220A8397B1DCDAF
    gamma = 0x9E3779B97F4A7C15
    stream = [ref_mix((1234567 + k * gamma) & MASK) for k in range(3)]
    assert stream == [6457827717110365317, 3203168211198807973, 9817491932198370423]


def _tokens(b: int, t: int, vocab: int, seed: int) -> torch.Tensor:
    return torch.randint(0, vocab, (b, t), generator=torch.Generator().manual_seed(seed))


# ---------------------------------------------------------------- ids vs the reference

NS = [1, 2, 3, 5]
ROW_CHOICES = [None, 1, 2, 97, 50257, 2**31 - 1, 2**62 + 1, 2**63 - 1]
BIG_SEEDS = [0, 1, 2**32 + 5, 2**53, 2**63 - 1]


def _check_against_reference(tok: torch.Tensor, n: int, rows: int | None, seed: int) -> None:
    got = ngram_ids(tok, n, rows=rows, seed=seed)
    assert got.dtype == torch.int64 and tuple(got.shape) == tuple(tok.shape)
    assert got.tolist() == ref_ngram_ids(tok.tolist(), n, rows, seed), (n, rows, seed)
    if got.numel():
        assert int(got.min()) >= 0
        if rows is not None:
            assert int(got.max()) < rows


@st.composite
def id_cases(draw: st.DrawFn) -> tuple[torch.Tensor, int, int | None, int]:
    vocab = draw(st.sampled_from([50257, 256, 3]))  # GPT-2's, bytes, a tiny one (repeats)
    b, t = draw(st.integers(1, 3)), draw(st.integers(1, 9))
    row = st.lists(st.integers(0, vocab - 1), min_size=t, max_size=t)
    tokens = draw(st.lists(row, min_size=b, max_size=b))
    n = draw(st.sampled_from(NS))
    rows = draw(st.sampled_from(ROW_CHOICES))
    seed = draw(st.one_of(st.sampled_from(BIG_SEEDS), st.integers(0, 2**63 - 1)))
    return torch.tensor(tokens, dtype=torch.int64), n, rows, seed


@settings(max_examples=30, deadline=None)
@given(id_cases())
def test_ids_equal_the_reference(case: tuple[torch.Tensor, int, int | None, int]) -> None:
    _check_against_reference(*case)


@pytest.mark.parametrize("vocab", [50257, 256])
@pytest.mark.parametrize("rows", [None, 50257])
def test_ids_equal_the_reference_every_n_and_seed(vocab: int, rows: int | None) -> None:
    """Every position of 3 windows of 12 (so the padded starts of each), every n."""
    tok = _tokens(3, 12, vocab, seed=vocab)
    for n in NS:
        for seed in BIG_SEEDS:
            _check_against_reference(tok, n, rows, seed)


@pytest.mark.parametrize(
    "tokens",
    [
        [[5, 9]],  # shorter than n = 3, 5: every position is padded
        [[0, 0, 0, 0, 0, 0]],  # token 0 (code 1) is not the padding (code 0)
        [[0, 2**40, 2**62, 2**63 - 2, 7]],  # token ids are not range-checked: any int64
        [[]],  # T = 0
    ],
)
def test_ids_equal_the_reference_edge_windows(tokens: list[list[int]]) -> None:
    tok = torch.tensor(tokens, dtype=torch.int64).reshape(len(tokens), -1)
    for n in NS:
        for rows in (None, 1000):
            _check_against_reference(tok, n, rows, seed=2**63 - 1)
    assert tuple(ngram_ids(torch.zeros(0, 4, dtype=torch.int64), 2, rows=9).shape) == (0, 4)


def test_padding_is_not_token_zero() -> None:
    """Position 0's bigram (pad, a) differs from the bigram (0, a) later in a window."""
    ids = ngram_ids(torch.tensor([[4, 0, 4]]), 2, rows=None)
    assert int(ids[0, 0]) != int(ids[0, 2])
    same = ngram_ids(torch.tensor([[4, 1, 4], [7, 1, 4]]), 2, rows=None)
    assert int(same[0, 2]) == int(same[1, 2])  # (1, 4) twice


# ---------------------------------------------------------------- properties


def test_other_n_or_seed_gives_other_ids() -> None:
    tok = _tokens(4, 64, 50257, seed=1)
    base = ngram_ids(tok, 2, rows=None, seed=3)
    for other in (
        ngram_ids(tok, 3, rows=None, seed=3),
        ngram_ids(tok, 1, rows=None, seed=3),
        ngram_ids(tok, 2, rows=None, seed=4),
        ngram_ids(tok, 2, rows=None, seed=3 + 2**62),
    ):
        assert bool((other != base).all())  # 63-bit ids: no collision expected in 256
    fixed = [ngram_ids(tok, n, rows=2**20, seed=s) for n, s in ((2, 3), (3, 3), (2, 4))]
    for a, b in ((0, 1), (0, 2), (1, 2)):
        assert float((fixed[a] == fixed[b]).float().mean()) < 0.02  # ~1/2**20 expected


@pytest.mark.parametrize("n", [1, 2, 3, 5])
def test_id_depends_on_exactly_its_window(n: int) -> None:
    """Changing token j changes the ids of positions j .. j + n - 1 and no other."""
    t = 11
    tok = _tokens(1, t, 256, seed=n)
    base = ngram_ids(tok, n, rows=None, seed=9)
    for j in range(t):
        changed = tok.clone()
        changed[0, j] = (changed[0, j] + 1) % 256
        differ = (ngram_ids(changed, n, rows=None, seed=9) != base)[0].tolist()
        assert differ == [j <= p < j + n for p in range(t)], (n, j)


@pytest.mark.parametrize("n", [2, 3])
def test_equal_windows_share_ids(n: int) -> None:
    """Over a tiny vocabulary (many repeats), two positions share an id exactly when
    their n codes (padding included) are equal, in any row of the batch."""
    tok = _tokens(4, 30, 3, seed=n)
    ids = ngram_ids(tok, n, rows=None, seed=1)
    seen: dict[tuple[int, ...], int] = {}
    rows = tok.tolist()
    for b, row in enumerate(rows):
        for t in range(len(row)):
            window = tuple(row[j] + 1 if j >= 0 else 0 for j in range(t - n + 1, t + 1))
            seen.setdefault(window, int(ids[b, t]))
            assert int(ids[b, t]) == seen[window], (b, t, window)
    assert len(set(seen.values())) == len(seen)  # different windows, different ids
    assert len(seen) < ids.numel() // 2  # the check saw many repeats


def _chi_square(ids: torch.Tensor, buckets: int) -> float:
    counts = torch.bincount(ids.flatten(), minlength=buckets).double()
    expected = ids.numel() / buckets
    return float(((counts - expected) ** 2 / expected).sum())


def test_ids_spread_evenly_over_rows() -> None:
    """Every one of 300 * 300 distinct bigrams hashed into a prime and a power-of-two
    number of rows (whose remainder keeps only low bits), and the top bits of the 63-bit
    ids: chi-square far below 2 x its degrees of freedom (its mean); a biased hash
    (say, one that ignores a token) is off by orders of magnitude."""
    a = torch.arange(300).repeat_interleave(300)
    b = torch.arange(300).repeat(300)
    pairs = torch.stack([a, b], dim=1)  # [90000, 2]: position 1 holds each bigram once
    for rows in (97, 64):
        ids = ngram_ids(pairs, 2, rows=rows, seed=5)[:, 1]
        assert _chi_square(ids, rows) < 2 * (rows - 1), rows
    top = ngram_ids(pairs, 2, rows=None, seed=5)[:, 1] >> 57  # 6 top bits of 63
    assert _chi_square(top, 64) < 2 * 63


def test_bad_input_is_named() -> None:
    tok = torch.zeros(2, 3, dtype=torch.int64)
    expected = r"tokens must be an int64 tensor \[B, T\], got torch.float32 \(2, 3\)"
    with pytest.raises(TypeError, match=expected):
        ngram_ids(tok.float(), 2, rows=None)
    with pytest.raises(TypeError, match=r"got torch.int64 \(6,\)"):
        ngram_ids(tok.flatten(), 2, rows=None)
    with pytest.raises(TypeError, match=r"tokens must be an int64 tensor \[B, T\], got list"):
        ngram_ids([[1, 2]], 2, rows=None)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"n must be an int >= 1, got 0"):
        ngram_ids(tok, 0, rows=None)
    expected = r"rows must be an int in \[1, 2\*\*63\) or None \(dynamic\), got 0"
    with pytest.raises(ValueError, match=expected):
        ngram_ids(tok, 2, rows=0)
    with pytest.raises(ValueError, match=r"rows must be .* got 9223372036854775808"):
        ngram_ids(tok, 2, rows=2**63)  # would wrap to negative int64 ids
    with pytest.raises(ValueError, match=r"seed must be an int in \[0, 2\*\*63\), got -1"):
        ngram_ids(tok, 2, rows=None, seed=-1)
    with pytest.raises(ValueError, match=r"seed must be .* got 9223372036854775808"):
        ngram_ids(tok, 2, rows=None, seed=2**63)
    with pytest.raises(ValueError, match=r"seed must be .* got True"):
        ngram_ids(tok, 2, rows=None, seed=True)


# ---------------------------------------------------------------- every rank


def _rank_script() -> ModuleType:
    spec = importlib.util.spec_from_file_location("ngram_ids_rank", rank_script("ngram_ids.py"))
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _reference_digest(script: ModuleType) -> str:
    """sha256 of the rank script's ids in its order, computed by the reference."""
    ids: list[int] = []
    for vocab in script.VOCABS:
        tok = script.tokens(vocab).tolist()
        cases = [(n, r, s) for n in script.NS for r in script.ROWS for s in script.SEEDS]
        cfg = NGramConfig(max_n=4, rows=None, dim=6, splits=3, seed=2**52 + 1)
        cases += [(n, None, (cfg.seed << 10) | split) for _, n, split in cfg.features()]
        for n, rows, seed in cases:
            ids += [i for row in ref_ngram_ids(tok, n, rows, seed) for i in row]
    return hashlib.sha256(torch.tensor(ids, dtype=torch.int64).numpy().tobytes()).hexdigest()


@pytest.mark.parametrize("nprocs", [2, 4])
def test_same_ids_on_every_rank(nprocs: int) -> None:
    """The ranks allgather their ids and find them equal; each prints their digest, which
    is the reference's (so every rank computed the reference ids)."""
    expected = _reference_digest(_rank_script())
    outputs = run_ranks("ngram_ids.py", nprocs, "gloo", timeout=90)
    for rank, out in enumerate(outputs):
        assert f"rank {rank}/{nprocs}: ok ngram ids {expected}" in out, out


# ---------------------------------------------------------------- NGramConfig


def test_config_features_and_tables() -> None:
    one = NGramConfig(max_n=3, rows=1000, dim=8)
    assert one.features() == [("ngram2", 2, 0), ("ngram3", 3, 0)]
    split = NGramConfig(
        max_n=3,
        rows=None,
        dim=12,
        splits=3,
        prefix="ng",
        capacity=50,
        max_age_steps=4,
        optimizer=ps.SGD(lr=0.5),
        seed=11,
    )
    names = ["ng2_0", "ng2_1", "ng2_2", "ng3_0", "ng3_1", "ng3_2"]
    assert [f for f, _, _ in split.features()] == names
    assert [(n, s) for _, n, s in split.features()] == [(n, s) for n in (2, 3) for s in range(3)]
    for cfg, dim, rows in ((one, 8, 1000), (split, 4, None)):
        tables = cfg.tables()
        assert [t.name for t in tables] == [f for f, _, _ in cfg.features()]
        for t in tables:
            assert t.feature_names == [t.name] and t.pooling == "none"
            assert t.dim == dim and t.num_rows == rows
            assert t.placement == cfg.placement == "hybrid" and t.optimizer == cfg.optimizer
            assert t.capacity == cfg.capacity and t.max_age_steps == cfg.max_age_steps
            spec = t.to_spec()
            assert spec.capacity == cfg.capacity and spec.max_age_steps == cfg.max_age_steps
            assert bool((spec.initial_rows(torch.tensor([0, 5, 2**62])) == 0).all())
    local = NGramConfig(max_n=2, rows=10, dim=4, placement="local", optimizer=ps.Adam(lr=0.1))
    assert [(t.placement, t.optimizer) for t in local.tables()] == [("local", ps.Adam(lr=0.1))]


def test_config_ids_are_each_tables_own_hash() -> None:
    cfg = NGramConfig(max_n=3, rows=None, dim=4, splits=2, seed=2**53 - 1)
    tok = _tokens(2, 7, 50257, seed=3)
    ids = cfg.ids(tok)
    assert list(ids) == ["ngram2_0", "ngram2_1", "ngram3_0", "ngram3_1"]
    for feature, n, split in cfg.features():
        assert ids[feature].tolist() == ref_ngram_ids(
            tok.tolist(), n, None, cfg.seed * 1024 + split
        )
    assert bool((ids["ngram2_0"] != ids["ngram2_1"]).all())  # sub-tables hash apart
    fixed = NGramConfig(max_n=2, rows=97, dim=4, seed=3).ids(tok)["ngram2"]
    assert fixed.tolist() == ref_ngram_ids(tok.tolist(), 2, 97, 3 * 1024)


def test_config_errors_are_named() -> None:
    with pytest.raises(ValueError, match=r"max_n must be an int >= 2, got 1"):
        NGramConfig(max_n=1, rows=10, dim=4)
    with pytest.raises(ValueError, match=r"dim 10 must be a positive multiple of splits 3"):
        NGramConfig(max_n=2, rows=10, dim=10, splits=3)
    with pytest.raises(ValueError, match=r"splits must be an int in \[1, 1024\], got 0"):
        NGramConfig(max_n=2, rows=10, dim=4, splits=0)
    with pytest.raises(ValueError, match=r"splits must be .* got True"):
        NGramConfig(max_n=2, rows=10, dim=4, splits=True)
    with pytest.raises(ValueError, match=r"seed must be an int in \[0, 2\*\*53\), got -1"):
        NGramConfig(max_n=2, rows=10, dim=4, seed=-1)
    fixed = r"table 'ngram2': capacity=100 needs a dynamic table \(num_rows=None\), got num_rows=10"
    with pytest.raises(ValueError, match=fixed):
        NGramConfig(max_n=2, rows=10, dim=4, capacity=100)
    with pytest.raises(ValueError, match=r"table 'ngram2_0': max_age_steps=3 needs a dynamic"):
        NGramConfig(max_n=2, rows=10, dim=4, splits=2, max_age_steps=3)
    local = r"table 'ngram2': num_rows=None .* needs placement='hybrid'"
    with pytest.raises(ValueError, match=local):
        NGramConfig(max_n=2, rows=None, dim=4, placement="local")
    with pytest.raises(ValueError, match=r"table 'x2': num_rows must be an int > 0, got 0"):
        NGramConfig(max_n=2, rows=0, dim=4, prefix="x")


def test_combine_sums_each_ns_concatenated_sub_tables() -> None:
    cfg = NGramConfig(max_n=3, rows=10, dim=4, splits=2)
    rows = {
        "ngram3_1": torch.tensor([[[30.0, 40.0]]]),  # any order of the dict
        "ngram2_0": torch.tensor([[[1.0, 2.0]]]),
        "ngram3_0": torch.tensor([[[10.0, 20.0]]]),
        "ngram2_1": torch.tensor([[[3.0, 4.0]]]),
    }
    # Sums of small integers: exact in float32, in any order.
    assert cfg.combine(rows).tolist() == [[[11.0, 22.0, 33.0, 44.0]]]
    one = NGramConfig(max_n=4, rows=10, dim=2)
    parts = {f"ngram{n}": torch.full((2, 3, 2), float(10**n)) for n in (2, 3, 4)}
    assert_same(
        one.combine(parts), torch.full((2, 3, 2), 11100.0), what="combined rows",
        why="sums of integers below 2**24 are exact in float32, in any order",
    )  # fmt: skip


# ---------------------------------------------------------------- through a collection

VOCAB, DIM = 50, 8
TOKEN_INIT = ps.UniformInit(low=-0.5, high=0.5, seed=3)


def token_table(placement: Placement, dim: int = DIM) -> TableConfig:
    return TableConfig(
        name="tokens",
        num_rows=VOCAB,
        dim=dim,
        feature_names=["tokens"],
        pooling="none",
        placement=placement,
        optimizer=ps.SGD(lr=0.1),
        init=TOKEN_INIT,
    )


def sequence_batch(features: dict[str, torch.Tensor]) -> KeyedJaggedIds:
    """One id per position: every feature's ``[B, T]`` ids as ``B`` samples of ``T``."""
    first = next(iter(features.values()))
    b, t = first.shape
    ids = torch.cat([v.reshape(-1) for v in features.values()])
    lengths = torch.full((len(features) * b,), t, dtype=torch.int64)
    return KeyedJaggedIds(list(features), ids, lengths)


def collection_input(ec: EmbeddingCollection, cfg: NGramConfig, tok: torch.Tensor) -> torch.Tensor:
    """Token rows plus the n-gram rows: ``[B, T, DIM]``."""
    out = ec(sequence_batch({"tokens": tok, **cfg.ids(tok)}))
    return out["tokens"] + cfg.combine({f: out[f] for f, _, _ in cfg.features()})


def toy_loss(x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """A loss whose gradient depends on the rows (``x + target``)."""
    return 0.5 * (x**2).sum() + (x * target).sum()


class ReferenceModel:
    """Plain ``nn.Embedding`` per table with hand-written SGD; the n-gram ids come from
    :func:`ref_ngram_ids` and each distinct id (over all batches) gets its own zero row.
    ``dtype`` float64 replays the same computation in float64."""

    def __init__(
        self,
        cfg: NGramConfig,
        batches: list[torch.Tensor],
        lr_tok: float,
        lr_ngram: float,
        dtype: torch.dtype = torch.float32,
    ) -> None:
        self.cfg, self.lr_tok, self.lr_ngram = cfg, lr_tok, lr_ngram
        self.tok = nn.Embedding(VOCAB, DIM, dtype=dtype)
        with torch.no_grad():
            self.tok.weight.copy_(TOKEN_INIT.rows(torch.arange(VOCAB), DIM))
        self.ids: list[dict[str, list[list[int]]]] = []  # per batch: feature -> [B][T] ids
        for tok in batches:
            self.ids.append(
                {
                    f: ref_ngram_ids(tok.tolist(), n, cfg.rows, (cfg.seed << 10) | s)
                    for f, n, s in cfg.features()
                }
            )
        self.known = {
            f: sorted({i for ids in self.ids for row in ids[f] for i in row})
            for f, _, _ in cfg.features()
        }  # feature -> its distinct ids, sorted
        self.emb = {
            f: nn.Embedding(len(k), DIM // cfg.splits, dtype=dtype) for f, k in self.known.items()
        }
        for e in self.emb.values():
            nn.init.zeros_(e.weight)

    def forward(self, step: int, tok: torch.Tensor, absolute: bool = False) -> torch.Tensor:
        """The input ``[B, T, DIM]`` of batch ``step``; ``absolute``: from the rows' absolute
        values (the magnitude of each sum, for its rounding bound)."""

        def rows(mod: nn.Embedding) -> torch.Tensor:
            return mod.weight.abs() if absolute else mod.weight

        per_n: dict[int, list[torch.Tensor]] = {}
        for f, n, _ in self.cfg.features():
            where = {i: k for k, i in enumerate(self.known[f])}
            index = torch.tensor([[where[i] for i in row] for row in self.ids[step][f]])
            per_n.setdefault(n, []).append(F.embedding(index, rows(self.emb[f])))  # [B, T, D/s]
        x = F.embedding(tok, rows(self.tok))
        for parts in per_n.values():
            x = x + torch.cat(parts, dim=-1)
        return x

    def sgd(self) -> None:
        tables = [(self.tok.weight, self.lr_tok)]
        tables += [(e.weight, self.lr_ngram) for e in self.emb.values()]
        with torch.no_grad():
            for w, lr in tables:
                if w.grad is not None:
                    w -= lr * w.grad
                    w.grad = None


# Roundings of one row element in an SGD step besides its gradient's sum: ``x + target`` per
# occurrence (the toy loss's gradient), ``lr * g`` and ``w - lr * g``.
SGD_ROUNDINGS = 3
REPLAY_WHY = (
    "4x the fp32 reference's own rounding error, measured by its float64 replay; never "
    "below the roundings of the last step (one sum, or a row's gradient sum and its update)"
)


class ReplayedReference:
    """:class:`ReferenceModel` in float32 (``ref``, what the collections are compared with)
    and its float64 replay (``ref64``), stepped together; each tolerance is
    :func:`replay_tol` of ``|ref - ref64|``, never below the worst case of the last
    operation alone: the input sums a token row and one n-gram row per ``n``; a row's
    gradient sums up to ``occ`` terms (the most occurrences of one row in a batch)."""

    def __init__(
        self, cfg: NGramConfig, batches: list[torch.Tensor], lr_tok: float, lr_ngram: float
    ) -> None:
        self.cfg, self.batches = cfg, batches
        self.ref = ReferenceModel(cfg, batches, lr_tok, lr_ngram)
        self.ref64 = ReferenceModel(cfg, batches, lr_tok, lr_ngram, dtype=torch.float64)
        self.occ = {"tokens": 0, **{f: 0 for f, _, _ in cfg.features()}}

    def forward(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        tok = self.batches[step]
        return self.ref.forward(step, tok), self.ref64.forward(step, tok)

    def output_tol(self, step: int, want: torch.Tensor, want64: torch.Tensor) -> float:
        terms = 1 + len({n for _, n, _ in self.cfg.features()})
        magnitude = self.ref64.forward(step, self.batches[step], absolute=True)
        floor = sum_tol(torch.float32, terms, float(magnitude.detach().max()))
        return max(replay_tol(want.detach(), want64.detach()), floor)

    def backward_and_step(self, step: int, want: torch.Tensor, want64: torch.Tensor,
                          target: torch.Tensor) -> None:  # fmt: skip
        toy_loss(want, target).backward()
        toy_loss(want64, target.double()).backward()
        self.ref.sgd()
        self.ref64.sgd()
        counts = {"tokens": self.batches[step].flatten()}
        counts |= {f: torch.tensor(ids).flatten() for f, ids in self.ref.ids[step].items()}
        for f, ids in counts.items():
            self.occ[f] = max(self.occ[f], int(torch.unique(ids, return_counts=True)[1].max()))

    def weight(self, f: str, ref: ReferenceModel | None = None) -> torch.Tensor:
        ref = self.ref if ref is None else ref
        return (ref.tok if f == "tokens" else ref.emb[f]).weight.detach()

    def rows_tol(self, f: str) -> float:
        """Feature ``f``'s rows (``"tokens"``: the token table's)."""
        w, w64 = self.weight(f), self.weight(f, self.ref64)
        return replay_tol(w, w64, floor_terms=self.occ[f] + SGD_ROUNDINGS)


@pytest.mark.parametrize("rows", [1000, None], ids=["fixed", "dynamic"])
def test_collection_trains_like_plain_embeddings(rows: int | None) -> None:
    """Token + n-gram tables (hybrid, in-process store, SGD) vs the reference: outputs
    and rows after every step; rows outside the batches seen stay as they started.
    With 1000 rows the n-grams of a batch collide, sharing (and summing into) rows."""
    cfg = NGramConfig(max_n=3, rows=rows, dim=DIM, splits=2, optimizer=ps.SGD(lr=0.5), seed=6)
    ec = EmbeddingCollection([token_table("hybrid"), *cfg.tables()], store=ps.InProcessStore())
    gen = torch.Generator().manual_seed(0)
    batches = [torch.randint(0, VOCAB, (3, 6), generator=gen) for _ in range(3)]
    targets = [torch.randn(3, 6, DIM, generator=gen) for _ in batches]
    rep = ReplayedReference(cfg, batches, lr_tok=0.1, lr_ngram=0.5)
    ref = rep.ref
    if rows is not None:  # some distinct n-grams of the batches share one of the 1000 rows
        apart = ReferenceModel(dataclasses.replace(cfg, rows=None), batches, 0.1, 0.5).known
        assert any(len(ref.known[f]) < len(apart[f]) for f in apart)
    seen_tokens: set[int] = set()
    for step, (tok, target) in enumerate(zip(batches, targets, strict=True)):
        x = collection_input(ec, cfg, tok)
        want, want64 = rep.forward(step)
        assert_close(
            x.detach(), want.detach(), atol=rep.output_tol(step, want, want64),
            what=f"step {step} input", why=REPLAY_WHY,
        )  # fmt: skip
        toy_loss(x, target).backward()
        rep.backward_and_step(step, want, want64, target)
        seen_tokens |= set(tok.flatten().tolist())
        assert_close(
            ec.rows("tokens", torch.arange(VOCAB)), rep.weight("tokens"),
            atol=rep.rows_tol("tokens"), what=f"step {step} token rows", why=REPLAY_WHY,
        )  # fmt: skip
        unseen = torch.tensor(sorted(set(range(VOCAB)) - seen_tokens))
        assert_same(
            ec.rows("tokens", unseen), TOKEN_INIT.rows(unseen, DIM), what="untouched token rows",
            why="rows no batch touched keep the initializer's values",
        )  # fmt: skip
        for f, _, _ in cfg.features():
            known = torch.tensor(ref.known[f])
            # Rows of n-grams of later batches are still zero in both.
            assert_close(
                ec.rows(f, known), rep.weight(f), atol=rep.rows_tol(f),
                what=f"step {step} rows of {f}", why=REPLAY_WHY,
            )  # fmt: skip
            seen = {i for ids in ref.ids[: step + 1] for row in ids[f] for i in row}
            if rows is not None:  # every other row of the fixed table is still zero
                moved = torch.nonzero(ec.rows(f, torch.arange(rows)).abs().sum(1)).flatten()
                assert set(moved.tolist()) == seen, f
            else:
                assert ec.store.stats()[f]["rows"] == len(seen), f


def test_placements_train_alike() -> None:
    """Local, fixed hybrid and dynamic hybrid n-gram tables (and the token table local or
    hybrid) give the same outputs and rows over a few steps: every n-gram seen has a row
    of its own in each (checked: no two share a row of the fixed tables)."""
    rows = 2**16
    made: dict[str, tuple[Placement, int | None]] = {
        "local": ("local", rows),
        "hybrid": ("hybrid", rows),
        "dynamic": ("hybrid", None),
    }
    cfgs, ecs = {}, {}
    for name, (placement, r) in made.items():
        cfgs[name] = NGramConfig(
            max_n=3,
            rows=r,
            dim=DIM,
            splits=2,
            placement=placement,
            optimizer=ps.SGD(lr=0.5),
            seed=2,
        )
        ecs[name] = EmbeddingCollection(
            [token_table(placement), *cfgs[name].tables()], store=ps.InProcessStore()
        )
    gen = torch.Generator().manual_seed(1)
    batches = [torch.randint(0, VOCAB, (2, 8), generator=gen) for _ in range(3)]
    # The tolerances: the same training by the plain-module reference, in float32 and float64
    # (every n-gram its own row, as the check below the loop makes sure of).
    rep = ReplayedReference(cfgs["local"], batches, lr_tok=0.1, lr_ngram=0.5)
    for step, tok in enumerate(batches):
        target = torch.randn(2, 8, DIM, generator=gen)
        xs = {name: collection_input(ecs[name], cfgs[name], tok) for name in made}
        want, want64 = rep.forward(step)
        for name in ("hybrid", "dynamic"):
            assert_close(
                xs[name].detach(), xs["local"].detach(), atol=rep.output_tol(step, want, want64),
                what=f"step {step} input, {name} vs local", why=REPLAY_WHY,
            )  # fmt: skip
        for x in xs.values():
            toy_loss(x, target).backward()
        rep.backward_and_step(step, want, want64, target)
    all_tok = torch.cat(batches)
    for f, _, _ in cfgs["local"].features():
        fixed = cfgs["local"].ids(all_tok)[f].flatten()
        dynamic = cfgs["dynamic"].ids(all_tok)[f].flatten()
        pairs = set(zip(fixed.tolist(), dynamic.tolist(), strict=True))
        assert len({a for a, _ in pairs}) == len(pairs), f"{f}: n-grams share a fixed row"
        want = ecs["local"].rows(f, fixed)
        assert bool(want.abs().sum(1).gt(0).all())  # every n-gram trained
        for name, got in (
            ("hybrid", ecs["hybrid"].rows(f, fixed)),
            ("dynamic", ecs["dynamic"].rows(f, dynamic)),
        ):
            assert_close(
                got, want, atol=rep.rows_tol(f), what=f"rows of {f}, {name} vs local",
                why=REPLAY_WHY,
            )  # fmt: skip
    want_tok = ecs["local"].rows("tokens", torch.arange(VOCAB))
    for name in ("hybrid", "dynamic"):
        got_tok = ecs[name].rows("tokens", torch.arange(VOCAB))
        assert_close(
            got_tok, want_tok, atol=rep.rows_tol("tokens"), what=f"token rows, {name} vs local",
            why=REPLAY_WHY,
        )  # fmt: skip


# ---------------------------------------------------------------- dynamic tables


class DynamicTableModel:
    """The rows of one dynamic table by :class:`ps.TableSpec`'s rules: a push counts a
    step, creates its missing rows and touches its rows; a pull touches the rows that
    exist (creates none); after a push, rows untouched for ``max_age`` pushes go, then the
    least recently touched (ties: smaller id) while more than ``capacity`` remain."""

    def __init__(self, capacity: int | None = None, max_age: int | None = None) -> None:
        self.capacity, self.max_age = capacity, max_age
        self.step = 0
        self.last: dict[int, int] = {}  # id -> step of its last touch
        self.clock: dict[int, int] = {}  # id -> pushes since its row was created
        self.evicted = 0
        self.max_clock = 0  # the most pushes any row has lived through

    def pull(self, ids: set[int]) -> None:
        for i in ids & self.last.keys():
            self.last[i] = self.step

    def push(self, ids: set[int]) -> None:
        self.step += 1
        for i in ids:
            self.last[i] = self.step
            self.clock[i] = self.clock.get(i, 0) + 1
            self.max_clock = max(self.max_clock, self.clock[i])
        if self.max_age is not None:
            for i in [i for i, s in self.last.items() if self.step - s >= self.max_age]:
                self._drop(i)
        while self.capacity is not None and len(self.last) > self.capacity:
            self._drop(min(self.last, key=lambda i: (self.last[i], i)))

    def _drop(self, i: int) -> None:
        del self.last[i], self.clock[i]
        self.evicted += 1


def _dynamic_run(
    cfg: NGramConfig, steps: int, b: int, t: int, vocab: int, pull_every: int | None
) -> tuple[EmbeddingCollection, dict[str, DynamicTableModel], dict[str, set[int]], set[str]]:
    """Train ``steps`` batches of ``b x t`` tokens from ``vocab`` (the token table in the
    same dim group as the n-gram tables); every ``pull_every`` steps also run a batch
    under no_grad. After each, the store's rows and clocks must be the models'.

    Returns the collection, the models, every id each table was given, and the tables
    whose rows at some point differed from a model that ignores pulls (where the
    no_grad pulls, as touches, changed what was evicted)."""
    ec = EmbeddingCollection([token_table("hybrid", cfg.dim), *cfg.tables()])
    names = [f for f, _, _ in cfg.features()]
    models = {f: DynamicTableModel(cfg.capacity, cfg.max_age_steps) for f in names}
    blind = {f: DynamicTableModel(cfg.capacity, cfg.max_age_steps) for f in names}
    pulls_mattered: set[str] = set()
    given: dict[str, set[int]] = {f: set() for f in models}
    gen = torch.Generator().manual_seed(vocab)

    def check(when: str) -> None:
        stats = ec.store.stats()
        for f, model in models.items():
            ids = sorted(given[f])
            clocks = ec.clocks(f, torch.tensor(ids)).tolist()  # reads; touches nothing
            have = {i: c for i, c in zip(ids, clocks, strict=True) if c > 0}
            assert have == model.clock, f"{when}, {f}"
            assert stats[f]["rows"] == len(model.clock), f"{when}, {f}"
            assert stats[f]["rows_evicted"] == model.evicted, f"{when}, {f}"

    for step in range(steps):
        tok = torch.randint(0, vocab, (b, t), generator=gen)
        x = collection_input(ec, cfg, tok)
        toy_loss(x, torch.ones_like(x)).backward()
        for f, ids in cfg.ids(tok).items():
            models[f].push(set(ids.flatten().tolist()))
            blind[f].push(set(ids.flatten().tolist()))
            given[f] |= set(ids.flatten().tolist())
            if models[f].clock.keys() != blind[f].clock.keys():
                pulls_mattered.add(f)
        check(f"after push {step + 1}")
        if pull_every is not None and step % pull_every == 0:
            tok = torch.randint(0, vocab, (b, t), generator=gen)
            with torch.no_grad():
                collection_input(ec, cfg, tok)
            for f, ids in cfg.ids(tok).items():
                models[f].pull(set(ids.flatten().tolist()))
                given[f] |= set(ids.flatten().tolist())
            check(f"after the pull past push {step + 1}")
    return ec, models, given, pulls_mattered


def test_dynamic_tables_hold_only_the_ngrams_pushed() -> None:
    """No eviction: a row per distinct n-gram pushed, its clock the number of batches
    it was in; forwards under no_grad or in eval mode create no rows."""
    cfg = NGramConfig(max_n=3, rows=None, dim=4, optimizer=ps.SGD(lr=0.1), seed=4)
    ec, models, given, _ = _dynamic_run(cfg, steps=4, b=2, t=6, vocab=VOCAB, pull_every=1)
    for f, model in models.items():
        pulled_only = given[f] - model.clock.keys()
        assert pulled_only, f"{f}: the no_grad batches brought no new n-gram"
        assert ec.store.stats()[f]["rows_created"] == len(model.clock)
    before = ec.store.stats()
    ec.eval()
    collection_input(ec, cfg, _tokens(2, 6, VOCAB, seed=99))  # grad enabled, eval mode
    after = ec.store.stats()
    for f in models:
        for counter in ("rows", "rows_created", "push_requests"):
            assert after[f][counter] == before[f][counter], (f, counter)
        assert after[f]["pull_requests"] == before[f]["pull_requests"] + 1


def test_dynamic_tables_keep_the_most_recently_touched_rows() -> None:
    """``capacity``: never more rows than it; the rows kept (and their clocks: an evicted
    row starts again) are the LRU model's, no_grad pulls counting as touches."""
    cfg = NGramConfig(max_n=3, rows=None, dim=4, optimizer=ps.SGD(lr=0.1), seed=5, capacity=8)
    _, models, _, pulls_mattered = _dynamic_run(cfg, steps=10, b=2, t=4, vocab=3, pull_every=2)
    for f, model in models.items():  # the run evicted, and kept rows over pushes
        assert model.evicted > 0 and len(model.clock) == 8 and model.max_clock > 2, f
    assert pulls_mattered == set(models)


def test_dynamic_tables_drop_rows_untouched_for_max_age_pushes() -> None:
    """``max_age_steps``: rows not touched in the last A pushes are gone (the model's)."""
    cfg = NGramConfig(max_n=3, rows=None, dim=4, optimizer=ps.SGD(lr=0.1), seed=6, max_age_steps=2)
    _, models, _, pulls_mattered = _dynamic_run(cfg, steps=10, b=2, t=4, vocab=4, pull_every=3)
    for f, model in models.items():  # the run evicted, and kept rows touched often
        assert model.evicted > 0 and model.max_clock > 2, f
    assert pulls_mattered == set(models)
