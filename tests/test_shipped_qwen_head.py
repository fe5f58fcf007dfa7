"""Qwen2.5-Coder-1.5B's shipped EAGLE-3 head, where the model is installed (`make models-qwen`;
CI does not install it, so there it skips). Its own file: the 1.5B load takes half a minute."""

import pytest
from shipped_heads import check_lossless_and_accepts

from jspec.checkpoint import CheckpointNotFoundError
from jspec.presets import resolve_model
from jspec.speculative.factory import shipped_head_path
from jspec.tokenizer import apply_chat

pytestmark = [pytest.mark.slow, pytest.mark.alone]  # a 1.5B model in fp32 (6 GB): after the parallel suite, by itself
PRESET = "qwen2.5-coder-1.5b-instruct"


def test_shipped_qwen_head_is_lossless_and_accepts():
    """The head ships as three Hugging Face shards with a 16,384-token draft vocabulary and reads
    the target's embedding (not shipped twice); float32 greedy output equals AR's."""
    assert shipped_head_path(PRESET, "eagle3") is not None
    try:
        target = resolve_model(PRESET)
    except CheckpointNotFoundError as e:
        pytest.skip(str(e))
    prompts = [apply_chat(target[2], "Write a Python function that checks whether a string is a palindrome.")]
    drafter, _ = check_lossless_and_accepts("eagle3", PRESET, target, prompts, max_new_tokens=32)
    assert drafter.head.capture_layers == (2, 14, 25) and drafter.head.draft_vocab_size == 16384
