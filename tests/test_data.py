"""Tokenizer, corpus split and the resumable, rank-sharded loader."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from moepec.errors import ConfigError, DataError
from moepec.train.data import (
    SEPARATOR,
    ByteTokenizer,
    TokenLoader,
    check_vocab,
    eval_batches,
    load_corpus,
)


def test_byte_tokenizer_round_trip() -> None:
    tok = ByteTokenizer()
    text = "def f(x):\n    return x  # héllo ✓"
    ids = tok.encode(text)
    assert ids.dtype == np.uint8 and len(ids) == len(text.encode())
    assert tok.decode(ids) == text
    assert tok.decode(torch.from_numpy(ids.astype(np.int64))) == text


def test_default_corpus_is_the_stdlib_split_by_file() -> None:
    corpus = load_corpus()
    assert "standard library" in corpus.source
    assert corpus.train.dtype == np.uint8 and corpus.val.dtype == np.uint8
    assert corpus.n_files > 100
    val_share = len(corpus.val) / (len(corpus.train) + len(corpus.val))
    assert 0.01 < val_share < 0.15
    # files end with the separator, so both splits hold whole files
    assert corpus.train[-1] == SEPARATOR and corpus.val[-1] == SEPARATOR
    assert b"def " in corpus.train[:100_000].tobytes()


def test_glob_split_is_by_file_and_deterministic(text_files: Path) -> None:
    pattern = str(text_files / "**" / "*.txt")
    corpus = load_corpus(pattern)
    assert corpus.n_files == 200
    val_files = {chunk[:8] for chunk in corpus.val.tobytes().split(bytes([SEPARATOR])) if chunk}
    train_files = {chunk[:8] for chunk in corpus.train.tobytes().split(bytes([SEPARATOR]))
                   if chunk}
    assert len(val_files) + len(train_files) == 200
    assert not val_files & train_files
    assert 2 <= len(val_files) <= 25  # ~5% of 200
    load_corpus.cache_clear()
    again = load_corpus(pattern)
    assert np.array_equal(again.train, corpus.train) and np.array_equal(again.val, corpus.val)


def test_single_file_splits_by_bytes(tmp_path: Path) -> None:
    path = tmp_path / "one.txt"
    path.write_bytes(bytes(range(1, 201)) * 10)
    corpus = load_corpus(str(path))
    whole = np.concatenate([corpus.train, corpus.val])
    assert len(corpus.val) == int(len(whole) * 0.05)
    assert whole[:2000].tobytes() == path.read_bytes()


def test_bad_data_raises_one_line_data_errors(tmp_path: Path) -> None:
    with pytest.raises(DataError, match="matches no files"):
        load_corpus(str(tmp_path / "nothing*.txt"))
    (tmp_path / "empty.txt").write_text("")
    with pytest.raises(DataError, match="only empty files"):
        load_corpus(str(tmp_path / "*.txt"))
    with pytest.raises(DataError, match="fewer than one sequence"):
        TokenLoader(np.zeros(32, dtype=np.uint8), seq_len=32, batch_size=1, seed=0)
    with pytest.raises(DataError, match="smaller --batch-size"):
        TokenLoader(np.zeros(100, dtype=np.uint8), seq_len=32, batch_size=4, seed=0)
    with pytest.raises(ConfigError, match="vocab mismatch"):
        check_vocab(100)
    check_vocab(50257)


def _tokens(n: int = 331) -> np.ndarray:
    return (np.arange(n) % 251).astype(np.uint8)


def test_loader_batches_are_shifted_windows_without_overlap() -> None:
    tokens = np.arange(331)  # token value == position (the loader takes any int array)
    loader = TokenLoader(tokens, seq_len=10, batch_size=4, seed=0)
    assert loader.n_windows == 33 and loader.batches_per_epoch == 8
    starts = []
    for _ in range(loader.batches_per_epoch):
        x, y = loader.next_batch()
        assert x.shape == (4, 10) and x.dtype == torch.int64
        assert torch.equal(x[:, 1:], y[:, :-1])
        starts += [int(row[0]) for row in x]
    assert len(set(starts)) == 32 and all(s % 10 == 0 for s in starts)
    assert loader.state_dict() == {"epoch": 1, "position": 0, "seed": 0}


def test_ranks_get_disjoint_shards_of_the_global_batch() -> None:
    tokens = _tokens(2001)
    whole = TokenLoader(tokens, seq_len=10, batch_size=6, seed=5)
    ranks = [TokenLoader(tokens, seq_len=10, batch_size=6, seed=5, rank=r, world_size=3)
             for r in range(3)]
    for _ in range(5):
        gx, _ = whole.next_batch()
        parts = [r.next_batch()[0] for r in ranks]
        assert all(p.shape == (2, 10) for p in parts)
        for r, part in enumerate(parts):
            assert torch.equal(part, gx[r::3])
    assert all(r.state_dict() == whole.state_dict() for r in ranks)


def _take(loader: TokenLoader, n: int) -> list[torch.Tensor]:
    return [torch.cat(loader.next_batch()) for _ in range(n)]


@pytest.mark.parametrize("n, m", [(3, 4), (7, 5), (8, 9), (0, 3)])
def test_loader_state_round_trip(n: int, m: int) -> None:
    # 8 batches per epoch: (3, 4) stays mid-epoch, (7, 5) crosses the boundary,
    # (8, 9) resumes exactly at an epoch start.
    tokens = _tokens()
    a = TokenLoader(tokens, seq_len=10, batch_size=4, seed=11)
    _take(a, n)
    state = json.loads(json.dumps(a.state_dict()))  # JSON-able
    expected = _take(a, m)
    b = TokenLoader(tokens, seq_len=10, batch_size=4, seed=0)
    b.load_state_dict(state)
    got = _take(b, m)
    assert all(torch.equal(e, g) for e, g in zip(expected, got, strict=True))


@settings(max_examples=25, deadline=None)
@given(n=st.integers(0, 40), m=st.integers(1, 10), seed=st.integers(0, 2**31),
       world=st.sampled_from([1, 2]))
def test_loader_resume_property(n: int, m: int, seed: int, world: int) -> None:
    tokens = _tokens(257)
    a = TokenLoader(tokens, seq_len=8, batch_size=6, seed=seed, rank=world - 1, world_size=world)
    _take(a, n)
    b = TokenLoader(tokens, seq_len=8, batch_size=6, seed=0, rank=world - 1, world_size=world)
    b.load_state_dict(a.state_dict())
    assert all(torch.equal(e, g) for e, g in zip(_take(a, m), _take(b, m), strict=True))


def test_epochs_use_different_orders() -> None:
    loader = TokenLoader(_tokens(), seq_len=10, batch_size=4, seed=0)
    first = _take(loader, 8)
    second = _take(loader, 8)
    assert not all(torch.equal(a, b) for a, b in zip(first, second))


def test_load_state_rejects_a_foreign_state() -> None:
    loader = TokenLoader(_tokens(), seq_len=10, batch_size=4, seed=0)
    with pytest.raises(DataError, match="same data"):
        loader.load_state_dict({"epoch": 0, "position": 99, "seed": 0})


def test_eval_batches_are_fixed_and_sharded() -> None:
    tokens = _tokens(2001)
    one = eval_batches(tokens, 10, 4, n_batches=3)
    assert len(one) == 3 and one[0][0].shape == (4, 10)
    again = eval_batches(tokens, 10, 4, n_batches=3)
    assert all(torch.equal(a[0], b[0]) for a, b in zip(one, again))
    halves = [eval_batches(tokens, 10, 4, 3, rank=r, world_size=2) for r in range(2)]
    assert torch.equal(halves[1][0][0], one[0][0][1::2])
    assert eval_batches(tokens[:5], 10, 4, 3) == []
