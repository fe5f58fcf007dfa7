"""A GGUF file's tokenizer is converted once and read back from the user cache: the cached copy
encodes, decodes and applies the chat template exactly as the conversion does."""

from __future__ import annotations

import contextlib

import pytest
from gguf_reference import preset_gguf

import jspec.tokenizer as T

TEXTS = (
    "What is the capital of France?",
    "def fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)\n\n\n\tx = {'a': [1, 2]}",
    "  leading spaces, trailing   \n",
    "Unicode: héllo wörld, 你好, ½ → ∞, emoji 🙂",
    "<|im_start|>user\nhi<|im_end|> <bos> <start_of_turn> </s>",
    "",
)


def assert_same(a, b):
    for text in TEXTS:
        assert a(text)["input_ids"] == b(text)["input_ids"], text
        ids = a(text)["input_ids"]
        assert a.decode(ids) == b.decode(ids), text
    assert (a.bos_token_id, a.eos_token_id, a.pad_token_id, len(a)) == (b.bos_token_id, b.eos_token_id, b.pad_token_id, len(b))
    assert T.has_chat_template(a) == T.has_chat_template(b)
    if T.has_chat_template(a):
        assert T.apply_chat(a, TEXTS[1]) == T.apply_chat(b, TEXTS[1])


@contextlib.contextmanager
def no_conversion():
    def fail():
        raise AssertionError("the GGUF was converted again instead of read from the cache")
    saved, T.fast_gguf_parsing = T.fast_gguf_parsing, fail
    try:
        yield
    finally:
        T.fast_gguf_parsing = saved


@pytest.mark.parametrize("preset", ["smollm2-135m-instruct", "gemma3-270m"])
def test_gguf_tokenizer_is_converted_once_and_read_back_equal(preset, tmp_path, monkeypatch):
    path = preset_gguf(preset)
    monkeypatch.setenv("JSPEC_CACHE", str(tmp_path))
    converted = T.load_tokenizer(path)
    cached_dir = T.gguf_tokenizer_cache(path)
    assert cached_dir.is_dir() and list((tmp_path / "tokenizers").iterdir()) == [cached_dir]
    with no_conversion():
        cached = T.load_tokenizer(path)
    assert_same(converted, cached)

    (cached_dir / "tokenizer.json").write_text("{ cut short")  # a broken cache is converted again
    rebuilt = T.load_tokenizer(path)
    assert_same(converted, rebuilt)
    with no_conversion():
        assert_same(converted, T.load_tokenizer(path))


def test_a_changed_gguf_file_gets_a_new_cache_entry(tmp_path, monkeypatch):
    path = preset_gguf("smollm2-135m-instruct")
    monkeypatch.setenv("JSPEC_CACHE", str(tmp_path / "cache"))
    copy = tmp_path / path.name
    copy.write_bytes(path.read_bytes())
    before = T.gguf_tokenizer_cache(copy)
    with open(copy, "ab") as fh:  # same path, another size: another key
        fh.write(b"\0")
    assert T.gguf_tokenizer_cache(copy) != before
