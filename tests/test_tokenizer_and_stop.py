"""Incremental detokenization and stop strings, on the default model's tokenizer."""

from __future__ import annotations

import random

import pytest

from pdserve.engine.llm_engine import find_stop_string
from pdserve.tokenizer import IncrementalDetokenizer, load_tokenizer


@pytest.fixture(scope="module")
def tokenizer(default_model_dir):
    return load_tokenizer(default_model_dir)


def test_incremental_text_equals_full_decode(tokenizer):
    rng = random.Random(0)
    texts = ["Hello, world! Ünïcödé — 日本語のテキスト 🙂🚀 spaces   and\ttabs\n", "  leading", "a" * 50]
    for text in texts:
        ids = tokenizer.encode(text, add_special_tokens=False)
        prompt = tokenizer.encode("Prompt:", add_special_tokens=False)
        detok = IncrementalDetokenizer(tokenizer, prompt)
        pos = 0
        while pos < len(ids):
            step = rng.randint(1, 3)
            detok.add(ids[pos : pos + step])
            pos += step
        assert detok.text == tokenizer.decode(ids, skip_special_tokens=True)


def test_random_ids_never_emit_replacement_mid_stream(tokenizer):
    rng = random.Random(1)
    ids = [rng.randrange(tokenizer.vocab_size) for _ in range(300)]
    detok = IncrementalDetokenizer(tokenizer, [1, 2, 3])
    for t in ids:
        detok.add([t])
    full = tokenizer.decode(ids, skip_special_tokens=True)
    # Only a trailing incomplete character may be held back.
    assert full.startswith(detok.text)
    assert len(full) - len(detok.text) <= 2


def test_special_tokens_are_skipped(tokenizer):
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    detok = IncrementalDetokenizer(tokenizer, [])
    detok.add(tokenizer.encode("Hi there", add_special_tokens=False) + [eos])
    assert detok.text == "Hi there"


class _Wrapped:
    """The tokenizer behind its Python ``decode`` only (no Rust backend to call directly)."""

    def __init__(self, tokenizer) -> None:
        self.decode = tokenizer.decode


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_backend_decode_streams_the_same_text_as_the_tokenizer(tokenizer, skip_special_tokens):
    """The fast path (the Rust backend's decode) gives every delta the wrapper's decode gives:
    random ids, special tokens and split multi-byte characters included."""
    rng = random.Random(2)
    specials = tokenizer.all_special_ids
    ids = [
        rng.choice(specials) if rng.random() < 0.05 else rng.randrange(tokenizer.vocab_size)
        for _ in range(400)
    ]
    ids += tokenizer.encode("🙂🚀 日本語 Ünï", add_special_tokens=False)
    fast = IncrementalDetokenizer(tokenizer, [5, 6, 7], skip_special_tokens)
    slow = IncrementalDetokenizer(_Wrapped(tokenizer), [5, 6, 7], skip_special_tokens)
    assert fast._backend_decode is not None and slow._backend_decode is None
    pos = 0
    while pos < len(ids):
        step = rng.randint(1, 3)
        assert fast.add(ids[pos : pos + step]) == slow.add(ids[pos : pos + step])
        pos += step
    assert fast.text == slow.text


def test_find_stop_string():
    # Only stops completed by the new part (from index 5 on) count; the earliest wins.
    assert find_stop_string("abc. STOP here", 5, ("STOP",), False) == ("STOP", 5)
    assert find_stop_string("abc. STOP here", 5, ("STOP",), True) == ("STOP", 9)
    assert find_stop_string("xx ab", 3, ("ab", "b"), False) == ("ab", 3)
    # A stop string straddling old and new text is found.
    assert find_stop_string("hello wor", 6, ("o w",), False) == ("o w", 4)
    assert find_stop_string("hello wor", 7, ("o w",), False) is None  # ended before the new part
    assert find_stop_string("nothing", 0, ("zzz",), False) is None
