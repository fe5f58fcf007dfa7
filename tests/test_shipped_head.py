"""The EAGLE heads shipped for SmolLM2 (EAGLE-3 and EAGLE-1) load through the preset and keep
greedy output identical; a bare `early-exit` loads the shipped exit head."""

import pytest
from shipped_heads import check_lossless_and_accepts

from jspec.presets import resolve_model
from jspec.speculative.factory import build_drafter, shipped_head_path
from jspec.tokenizer import apply_chat

pytestmark = pytest.mark.slow
PRESET = "smollm2-135m-instruct"


@pytest.fixture(scope="module")
def target():
    return resolve_model(PRESET)


@pytest.mark.parametrize("kind", ["eagle3", "eagle"])
def test_shipped_eagle_head_is_lossless_and_accepts(target, kind):
    if shipped_head_path(PRESET, kind) is None:
        pytest.skip(f"no {kind} head shipped")
    prompts = [apply_chat(target[2], "Give me three tips for better sleep.")]
    drafter, _ = check_lossless_and_accepts(kind, PRESET, target, prompts, max_new_tokens=24)
    assert drafter.head.kind == ("eagle3" if kind == "eagle3" else "eagle1")


def test_bare_early_exit_loads_the_shipped_exit_head(target):
    """`early-exit` without an argument is what the preset ships, as for every drafter; `early-exit:E`
    stays the untrained exit at layer E."""
    path = shipped_head_path(PRESET, "early-exit")
    if path is None:
        pytest.skip("no exit head shipped")
    cfg, params, _ = target
    drafter, dparams = build_drafter("early-exit", cfg, params, model_name=PRESET)
    assert drafter.head is not None and dparams is not None and drafter.exit_layer == 15
    untrained, none = build_drafter("early-exit:7", cfg, params, model_name=PRESET)
    assert untrained.head is None and none is None and untrained.exit_layer == 7
