"""Tokenizers for jspec models: a Hugging Face directory, a GGUF file, or an Orbax checkpoint dir.

    tok = load_tokenizer("models/.../model.gguf")
    ids = apply_chat(tok, "What is the capital of France?")
"""

from __future__ import annotations

import hashlib
import os
import shutil
from pathlib import Path

from .checkpoint.errors import CheckpointNotFoundError
from .checkpoint.gguf_io import fast_gguf_parsing
from .user_cache import user_cache_dir

# Where `jspec convert` stores the source's tokenizer inside an Orbax checkpoint directory.
ORBAX_TOKENIZER_DIR = "tokenizer"


def load_tokenizer(source: str | os.PathLike):
    """A transformers tokenizer for an HF model dir, a .gguf file or an Orbax dir from `convert`."""
    from transformers import AutoTokenizer

    path = Path(source)
    if path.is_file() and path.suffix == ".gguf":
        return _gguf_tokenizer(path)
    if path.is_dir() and (path / ORBAX_TOKENIZER_DIR).is_dir():
        return AutoTokenizer.from_pretrained(str(path / ORBAX_TOKENIZER_DIR))
    if path.is_dir():
        return AutoTokenizer.from_pretrained(str(path))
    raise CheckpointNotFoundError(f"{path}: no tokenizer source (expected an HF model dir, a .gguf file or an Orbax dir)")


def gguf_tokenizer_cache(path: Path) -> Path:
    """Where a GGUF file's converted tokenizer is kept: keyed by the file (path, size, mtime) and
    the transformers version that converted it, so a changed file or library converts afresh."""
    import transformers

    st = path.stat()
    key = f"{path.resolve()}|{st.st_size}|{st.st_mtime_ns}|{transformers.__version__}"
    return user_cache_dir() / "tokenizers" / f"{path.stem}-{hashlib.sha256(key.encode()).hexdigest()[:16]}"


def _gguf_tokenizer(path: Path):
    """A GGUF file's tokenizer. transformers converts it from the file's metadata on every load
    (4.6 s for Qwen2.5's 151,936 tokens on a CPU, every process); the converted tokenizer is saved
    once under the user cache and read back from there (0.9 s)."""
    from transformers import AutoTokenizer

    cached = gguf_tokenizer_cache(path)
    if (cached / "tokenizer_config.json").is_file():
        try:
            return AutoTokenizer.from_pretrained(str(cached))
        except (OSError, ValueError):  # cut short or unreadable: converted again and rewritten below
            shutil.rmtree(cached, ignore_errors=True)
    with fast_gguf_parsing():
        tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    staging = cached.with_name(f"{cached.name}.tmp{os.getpid()}")
    try:  # written whole, then renamed: a reader never sees half a directory
        tokenizer.save_pretrained(str(staging))
        os.replace(staging, cached)
    except (OSError, ValueError):  # a read-only cache, or another process renamed its copy first: nothing lost
        shutil.rmtree(staging, ignore_errors=True)
    return tokenizer


def has_chat_template(tokenizer) -> bool:
    return bool(getattr(tokenizer, "chat_template", None))


def apply_chat(tokenizer, user_text: str, system: str | None = None) -> list[int]:
    """Token ids of a one-turn chat, ending with the assistant prompt (add_generation_prompt)."""
    if not has_chat_template(tokenizer):
        raise ValueError("this tokenizer has no chat template (a base model?); use prompt_ids(..., chat=False)")
    messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": user_text}]
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    return [int(t) for t in ids]


def prompt_ids(tokenizer, text: str, chat: bool | None = None) -> list[int]:
    """Chat-formatted ids when `chat`, else the plain encoding (with the tokenizer's BOS policy).

    chat=None means: use the chat template when the tokenizer has one.
    """
    if chat is None:
        chat = has_chat_template(tokenizer)
    if chat:
        return apply_chat(tokenizer, text)
    return [int(t) for t in tokenizer(text)["input_ids"]]
