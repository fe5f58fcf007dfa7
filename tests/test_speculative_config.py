"""SpeculativeConfig: generate()'s speculative settings in one object; a combination that cannot run
fails when it is built, with one line, instead of at run time or by being ignored."""

import jax
import pytest

from jspec import model as M
from jspec.config import ModelConfig
from jspec.generate import SpeculativeConfig, generate
from jspec.speculative.engines.specbranch import SpecBranchConfig
from jspec.speculative.engines.tree import TreeConfig
from jspec.speculative.verify.consultant import ConsultantRule

CFG = ModelConfig(
    arch="llama", vocab_size=48, hidden_size=32, intermediate_size=64, num_layers=2,
    num_heads=4, num_kv_heads=2, head_dim=8, eos_token_ids=(3,), max_position_embeddings=512,
)


@pytest.mark.parametrize("fields, message", [
    (dict(drafter=None), "needs a drafter"),
    (dict(drafter="eagle3", tree=True, verify="consultant"), "Consultant Decoding verifies chains, not trees"),
    (dict(drafter="eagle3", tree=True, verify="token"), "token-by-token verification verifies chains, not trees"),
    (dict(drafter="eagle3", tree=TreeConfig(), verify=ConsultantRule(eps=50.0)), "verifies chains, not trees"),
    (dict(drafter="ngram", tree=True), "trees need an EAGLE head drafter"),
    (dict(drafter="eagle3", tree="big"), "expected None, True, .auto. or a TreeConfig"),
    (dict(drafter="ngram", gamma=4), "gamma sets PEARL's window: add engine='pearl'"),
    (dict(drafter="early-exit:1", engine="ppsd", gamma=2), "PPSD drafts one token a tick"),
    (dict(drafter="model:x", engine=SpecBranchConfig(), gamma=2), r"SpecBranch takes SpecBranchConfig\(gamma=\.\.\.\)"),
    (dict(drafter="model:x", engine="pearl", policy="svip"), "engine='pearl' has its own schedule: policy"),
    (dict(drafter="model:x", engine="pearl", tree=True), "tree do not apply"),
    (dict(drafter="model:x", engine="pearl", policy_params={}), "takes no policy_params"),
    (dict(drafter="model:x", engine="medusa"), "unknown engine 'medusa'"),
    (dict(drafter="ngram", k_max=0), "k_max must be an integer >= 1"),
    (dict(drafter="ngram", verify="strict"), "verify='strict'"),
])
def test_invalid_combinations_fail_when_built(fields, message):
    with pytest.raises(ValueError, match=message) as err:
        SpeculativeConfig(**fields)
    assert "\n" not in str(err.value)


PROMPTS = [[5, 6, 7, 5, 6, 7, 5], [9, 10, 11]]
SPEC = SpeculativeConfig(drafter="ngram", policy="heuristic", k_max=3)


def test_generate_takes_the_config():
    params = M.init_params(CFG, jax.random.PRNGKey(0), scale=0.35)
    ar = generate(params, CFG, PROMPTS, max_new_tokens=6)
    sp = generate(params, CFG, PROMPTS, max_new_tokens=6, speculative=SPEC)
    assert [sp.row(b) for b in range(2)] == [ar.row(b) for b in range(2)]  # greedy: the target's own text


def test_deprecated_keywords_still_work_and_warn():
    """The one test of generate()'s old keywords (the suite errors on jspec's DeprecationWarning
    everywhere else): they warn and build the same config, so its checks apply to them too."""
    params = M.init_params(CFG, jax.random.PRNGKey(0), scale=0.35)
    sp = generate(params, CFG, PROMPTS, max_new_tokens=6, speculative=SPEC)
    with pytest.warns(DeprecationWarning, match="pass speculative=SpeculativeConfig"):
        old = generate(params, CFG, PROMPTS, max_new_tokens=6, drafter="ngram", policy="heuristic", k_max=3)
    assert [old.row(b) for b in range(2)] == [sp.row(b) for b in range(2)]
    with pytest.raises(ValueError, match="not also as k_max"):
        generate(params, CFG, PROMPTS, speculative=SPEC, k_max=4)
    with pytest.raises(ValueError, match="k_max applies only to speculative decoding"), pytest.warns(DeprecationWarning):
        generate(params, CFG, PROMPTS, k_max=4)
    # generate(tree=..., verify="consultant") used to run the lossless tree rule silently; it now
    # fails like the config does, before anything compiles
    with pytest.raises(ValueError, match="verifies chains, not trees"), pytest.warns(DeprecationWarning):
        generate(params, CFG, [[5, 6, 7]], max_new_tokens=4, drafter="eagle3", tree=True,
                 verify=ConsultantRule(eps=50.0))
