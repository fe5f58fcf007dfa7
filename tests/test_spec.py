"""Speculative decoding: greedy identity to AR for the n-gram, early-exit and draft-model drafters
x every policy, a row alone == the row in a batch, policy/drafter compatibility errors. Tiny random
models, one compile per combination. The EAGLE heads' greedy identity is in test_spec_heads.py,
lossless sampling in test_spec_sampling.py; the shared tiny models live in spec_tiny.py."""

import jax
import pytest
from spec_tiny import CFG, K, MAX_NEW, _drafters, _policy_params, _prompts, check_greedy_identical_to_ar, combos
from spec_tiny import make_target

from jspec import model as M
from jspec.decode import PromptError
from jspec.generate import SpeculativeConfig, generate
from jspec.speculative.drafters.base import DrafterError
from jspec.speculative.drafters.model import ModelDrafter
from jspec.speculative.drafters.ngram import NgramDrafter
from jspec.speculative.policies import make_policy

# Re-exported for the test files that import the tiny setup from here.
__all__ = ["CFG", "K", "MAX_NEW", "_drafters", "_policy_params", "_prompts"]


@pytest.fixture(scope="module")
def target():
    return make_target()


@pytest.mark.parametrize("drafter_name,policy_name", combos(("ngram", "early-exit", "model")))
def test_greedy_identical_to_ar(target, drafter_name, policy_name):
    check_greedy_identical_to_ar(target, drafter_name, policy_name)


def test_row_alone_equals_row_in_batch(target):
    drafter, dparams = _drafters(target)["early-exit"]
    prompts = _prompts(7, batch=3)
    batch = generate(target, CFG, prompts, max_new_tokens=MAX_NEW,
                     speculative=SpeculativeConfig(drafter=drafter, k_max=K))
    alone = generate(target, CFG, prompts[1:2], max_new_tokens=MAX_NEW,
                     speculative=SpeculativeConfig(drafter=drafter, k_max=K))
    assert alone.row(0) == batch.row(1)


def test_policy_needing_logits_rejects_ngram(target):
    with pytest.raises(DrafterError, match="draft distributions"):
        generate(target, CFG, [[5, 6]], max_new_tokens=4,
                 speculative=SpeculativeConfig(drafter=NgramDrafter(), policy=make_policy("svip", k_max=K), k_max=K))


def test_vocab_mismatch_is_an_error(target):
    other = CFG.replace(vocab_size=64, num_layers=1)
    with pytest.raises(DrafterError, match="vocabulary"):
        generate(target, CFG, [[5, 6]], max_new_tokens=4,
                 speculative=SpeculativeConfig(drafter=ModelDrafter(other), drafter_params=M.init_params(other, jax.random.PRNGKey(0)), k_max=K))


def test_unknown_policy_and_k_max_beyond_cache(target):
    with pytest.raises(ValueError, match="unknown"):
        make_policy("nope")
    with pytest.raises(PromptError, match="cache"):
        generate(target, CFG, [[5, 6]], max_new_tokens=4,
                 speculative=SpeculativeConfig(drafter=NgramDrafter(), k_max=200), cache_len=64)


@pytest.mark.parametrize("policy_name", ["static", "heuristic"])
def test_known_length_draft_loop_equals_the_early_exit_loop(target, policy_name):
    """Limit-only policies draft max(limit) steps in a loop of known length (one branch per step
    count); the early-exit while_loop that stop rules need must give the same rounds and tokens,
    sampled drafts (the kept draft distributions) included."""
    import dataclasses

    import numpy as np

    from jspec.sampling import Sampling

    policy = make_policy(policy_name, k_max=K)
    assert not policy.stops_in_round
    early_exit = type("EarlyExit", (type(policy),), {"stops_in_round": True})(
        **{f.name: getattr(policy, f.name) for f in dataclasses.fields(policy)})
    drafter, dparams = _drafters(target)["eagle3"]
    prompts = _prompts(11, batch=3)
    runs = [generate(target, CFG, prompts, max_new_tokens=MAX_NEW,
                     speculative=SpeculativeConfig(drafter=drafter, drafter_params=dparams, policy=p, k_max=K), sampling=Sampling(temperature=0.8), seed=3) for p in (policy, early_exit)]
    for field in ("tokens", "lengths", "drafted", "accepted", "draft_lengths"):
        np.testing.assert_array_equal(getattr(runs[0], field), getattr(runs[1], field), err_msg=field)


def test_static_chains_draft_without_a_branch(target):
    """A static K is known when tracing: its rounds draft in a plain loop, with no conditional (on a
    GPU a branch reads its predicate back to the host); a limit decided on the device (`auto`)
    keeps one branch on the round's step count."""
    import jax.numpy as jnp

    from jspec.decode import pack_prompts
    from jspec.sampling import Sampling
    from jspec.speculative.engines.chain import speculative_generate_jit

    drafter, dparams = _drafters(target)["eagle3"]
    tokens, lens, cache_len = pack_prompts(CFG, _prompts(2), 8, K + 1)

    def hlo(policy):
        return speculative_generate_jit.lower(target, dparams, None, jnp.asarray(tokens), jnp.asarray(lens), jax.random.PRNGKey(0),
                                              tcfg=CFG, drafter=drafter, policy=policy, k_max=K, max_new=8, cache_len=cache_len,
                                              sampling=Sampling(), verify="lossless", unroll=None).as_text()

    assert make_policy("static", k_max=K).fixed_steps(K) == K and make_policy("static", k=2, k_max=K).fixed_steps(K) == 2
    assert "stablehlo.case" not in hlo(make_policy("static", k_max=K))
    assert "stablehlo.case" in hlo(make_policy("auto", k_max=K))


def test_device_loops_only_where_a_rule_stops_mid_round(monkeypatch):
    from jspec.speculative.engines import chain

    static, confidence = make_policy("static", k_max=K), make_policy("confidence", k_max=K)
    assert not static.stops_in_round and confidence.stops_in_round
    monkeypatch.setattr(chain.jax, "default_backend", lambda: "gpu")
    assert chain.generation_program(confidence) is chain._speculative_generate_device_loops_jit
    assert chain.generation_program(static) is chain.speculative_generate_jit
    monkeypatch.setenv("JSPEC_DEVICE_LOOPS", "off")
    assert chain.generation_program(confidence) is chain.speculative_generate_jit
    monkeypatch.setenv("JSPEC_DEVICE_LOOPS", "all")
    assert chain.generation_program(static) is chain._speculative_generate_device_loops_jit
    monkeypatch.setenv("JSPEC_DEVICE_LOOPS", "yes")
    with pytest.raises(ValueError, match="JSPEC_DEVICE_LOOPS='yes': expected one of auto, off, all"):
        chain.generation_program(static)
    monkeypatch.setattr(chain.jax, "default_backend", lambda: "cpu")
    monkeypatch.setenv("JSPEC_DEVICE_LOOPS", "all")
    assert chain.generation_program(static) is chain.speculative_generate_jit  # (CPU: XLA's default)


