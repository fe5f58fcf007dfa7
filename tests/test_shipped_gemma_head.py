"""Gemma-3-270M's shipped EAGLE-3 head (its own file: the GGUF load and Gemma's compiles take a
minute, and pytest-xdist's --dist loadfile then runs it beside the SmolLM2 heads' file)."""

import pytest

from jspec.generate import SpeculativeConfig, generate
from jspec.presets import resolve_model
from jspec.speculative.factory import build_drafter, shipped_head_path

pytestmark = pytest.mark.slow


def test_shipped_gemma_head_is_lossless_and_accepts():
    """Gemma-3-270M's EAGLE-3 head (trained with fc_in_scale, exported folded into fc) loads
    through its preset and keeps float32 greedy output identical to AR's."""
    preset = "gemma3-270m"
    if shipped_head_path(preset, "eagle3") is None:
        pytest.skip("no eagle3 head shipped for gemma3-270m")
    cfg, params, tok = resolve_model(preset)
    drafter, dparams = build_drafter("eagle3", cfg, params, model_name=preset)
    assert drafter.head.capture_layers == (2, 9, 15) and "fc_in_scale" not in dparams
    prompts = [tok("The three primary colors are")["input_ids"]]
    ar = generate(params, cfg, prompts, max_new_tokens=32)
    sp = generate(params, cfg, prompts, max_new_tokens=32,
                  speculative=SpeculativeConfig(drafter=drafter, drafter_params=dparams, k_max=4))
    assert sp.row(0) == ar.row(0)
    assert sp.accepted[0] > 0 and sp.target_calls[0] < ar.target_calls[0]
