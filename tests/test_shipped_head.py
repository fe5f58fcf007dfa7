"""The EAGLE-3 head shipped for SmolLM2 loads through the preset and keeps greedy output identical."""

import pytest

from jspec.generate import generate
from jspec.presets import resolve_model
from jspec.speculative.factory import build_drafter, shipped_head_path
from jspec.tokenizer import apply_chat

pytestmark = pytest.mark.slow
PRESET = "smollm2-135m-instruct"


def test_shipped_eagle3_head_is_lossless_and_accepts():
    if shipped_head_path(PRESET, "eagle3") is None:
        pytest.skip("no EAGLE-3 head shipped")
    cfg, params, tok = resolve_model(PRESET)
    drafter, dparams = build_drafter("eagle3", cfg, params, model_name=PRESET)
    prompts = [apply_chat(tok, "Give me three tips for better sleep.")]
    ar = generate(params, cfg, prompts, max_new_tokens=24)
    sp = generate(params, cfg, prompts, max_new_tokens=24, drafter=drafter, drafter_params=dparams, k_max=4)
    assert sp.row(0) == ar.row(0)
    assert sp.accepted[0] > 0 and sp.target_calls[0] < ar.target_calls[0]
