"""The check every shipped EAGLE head passes through its preset: greedy output identical to AR's
(float32 on the CPU) while it accepts drafts and saves target calls."""

from __future__ import annotations

from jspec.generate import SpeculativeConfig, generate
from jspec.speculative.factory import build_drafter


def check_lossless_and_accepts(kind, preset, target, prompts, max_new_tokens, k_max=4):
    """Drafts `prompts` with the head `preset` ships for `kind`; returns the drafter for more checks."""
    cfg, params, _ = target
    drafter, dparams = build_drafter(kind, cfg, params, model_name=preset)
    ar = generate(params, cfg, prompts, max_new_tokens=max_new_tokens)
    sp = generate(params, cfg, prompts, max_new_tokens=max_new_tokens,
                  speculative=SpeculativeConfig(drafter=drafter, drafter_params=dparams, k_max=k_max))
    assert sp.row(0) == ar.row(0)
    assert sp.accepted[0] > 0 and sp.target_calls[0] < ar.target_calls[0]
    return drafter, dparams
