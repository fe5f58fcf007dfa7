"""Gemma-3-270M's shipped EAGLE-3 head (its own file: the GGUF load and Gemma's compiles take a
minute, and pytest-xdist's --dist loadfile then runs it beside the SmolLM2 heads' file)."""

import pytest
from shipped_heads import check_lossless_and_accepts

from jspec.presets import resolve_model
from jspec.speculative.factory import shipped_head_path

pytestmark = pytest.mark.slow


def test_shipped_gemma_head_is_lossless_and_accepts():
    """Gemma-3-270M's EAGLE-3 head (trained with fc_in_scale, exported folded into fc) loads
    through its preset and keeps float32 greedy output identical to AR's."""
    preset = "gemma3-270m"
    if shipped_head_path(preset, "eagle3") is None:
        pytest.skip("no eagle3 head shipped for gemma3-270m")
    target = resolve_model(preset)
    prompts = [target[2]("The three primary colors are")["input_ids"]]
    drafter, dparams = check_lossless_and_accepts("eagle3", preset, target, prompts, max_new_tokens=32)
    assert drafter.head.capture_layers == (2, 9, 15) and "fc_in_scale" not in dparams
