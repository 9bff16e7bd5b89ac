"""The charlm corpus builder: deterministic, cached by content hash, no network, a split across the library."""
from __future__ import annotations

import socket

import numpy as np
import pytest

from lit_speed.data.charlm import (
    VOCAB,
    VOCAB_SIZE,
    TokenWindows,
    build_corpus,
    decode,
    encode,
    list_source_files,
    unigram_cross_entropy,
)


@pytest.fixture
def no_network(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("the corpus builder tried to open a network connection")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)


def test_same_hash_twice_without_network(tmp_path, no_network):
    a = build_corpus(tmp_path / "a", max_bytes=300_000)
    b = build_corpus(tmp_path / "b", max_bytes=300_000)
    assert a.content_hash == b.content_hash
    assert np.array_equal(a.train_tokens(), b.train_tokens())
    assert np.array_equal(a.val_tokens(), b.val_tokens())
    again = build_corpus(tmp_path / "a", max_bytes=300_000)  # cache hit: same files
    assert again.train_path == a.train_path and again.meta == a.meta


def test_size_cap_and_split_every_tenth_file(tmp_path):
    corpus = build_corpus(tmp_path, max_bytes=200_000, val_every=10)
    m = corpus.meta
    assert m["train_tokens"] + m["val_tokens"] == 200_000
    assert m["val_files"] == m["files"] // 10
    assert len(corpus.train_tokens()) == m["train_tokens"]


def test_different_arguments_change_the_hash(tmp_path):
    assert build_corpus(tmp_path, max_bytes=100_000).content_hash != build_corpus(tmp_path, max_bytes=120_000).content_hash


def test_generated_tables_are_skipped():
    rels = [p.as_posix() for p in list_source_files()]
    assert rels, "no stdlib sources found"
    assert not any("/encodings/" in r or "/test/" in r or "site-packages" in r for r in rels)
    assert rels == sorted(rels)


def test_encode_decode_round_trip_and_unknown_chars():
    text = "def f(x):\n\treturn x  # ok\n"
    assert decode(encode(text)) == text
    assert decode(encode("naïve")) == "na?ve"
    assert VOCAB_SIZE == len(VOCAB) == 97


def test_token_windows_shift_targets_by_one():
    tokens = np.arange(50, dtype=np.uint8)
    ds = TokenWindows(tokens, block_size=8)
    x, y = ds[2]
    assert x.tolist() == list(range(16, 24)) and y.tolist() == list(range(17, 25))
    assert len(ds) == (50 - 9) // 8 + 1


def test_unigram_baseline_is_the_entropy_for_matching_distributions():
    rng = np.random.default_rng(0)
    p = np.zeros(VOCAB_SIZE)
    p[:4] = [0.5, 0.25, 0.125, 0.125]
    train = rng.choice(VOCAB_SIZE, size=200_000, p=p).astype(np.uint8)
    val = rng.choice(VOCAB_SIZE, size=200_000, p=p).astype(np.uint8)
    entropy = -(p[:4] * np.log(p[:4])).sum()
    assert unigram_cross_entropy(train, val) == pytest.approx(entropy, rel=1e-2)


def test_bad_arguments_name_the_setting(tmp_path):
    with pytest.raises(ValueError, match="max_bytes must be >= 10000, got 10"):
        build_corpus(tmp_path, max_bytes=10)
    with pytest.raises(ValueError, match="val_every must be >= 2"):
        build_corpus(tmp_path, val_every=1)
