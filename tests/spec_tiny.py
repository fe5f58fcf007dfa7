"""The tiny random target, drafters, policies and prompts shared by the speculative-decoding tests
(test_spec*.py, and through test_spec's re-export test_tree, test_rules, test_auto, ...), and the
greedy-identity check that test_spec.py and test_spec_heads.py run for each drafter x policy."""

import jax
import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from jspec import model as M
from jspec.config import ModelConfig
from jspec.generate import SpeculativeConfig, generate
from jspec.heads import eagle as H
from jspec.speculative.drafters.eagle import EagleDrafter
from jspec.speculative.drafters.early_exit import EarlyExitDrafter
from jspec.speculative.drafters.model import ModelDrafter
from jspec.speculative.drafters.ngram import NgramDrafter
from jspec.speculative.policies import POLICY_NAMES, make_policy

CFG = ModelConfig(
    arch="llama", vocab_size=48, hidden_size=32, intermediate_size=64, num_layers=4,
    num_heads=4, num_kv_heads=2, head_dim=8, eos_token_ids=(3,), max_position_embeddings=512,
)
K = 4
MAX_NEW = 20


def make_target():
    # A large init scale gives peaked, repetitive distributions, so drafts are often accepted
    # and the accept/reject paths are both exercised.
    return M.init_params(CFG, jax.random.PRNGKey(0), scale=0.35)


def _drafters(tparams):
    dcfg = CFG.replace(num_layers=1)
    dparams = M.init_params(dcfg, jax.random.PRNGKey(1), scale=0.35)
    dparams["embed"] = tparams["embed"]
    e1 = H.default_head_config("eagle1", CFG)
    e3 = H.HeadConfig(kind="eagle3", target=CFG, capture_layers=(0, 2, 3), draft_vocab_size=24)
    e3p = H.with_draft_vocab(e3, H.init_head(e3, jax.random.PRNGKey(3), scale=0.3), np.arange(CFG.vocab_size)[::-1] + 1.0)
    return {
        "ngram": (NgramDrafter(), None),
        "early-exit": (EarlyExitDrafter(exit_layer=2), None),
        "model": (ModelDrafter(dcfg), dparams),
        "eagle": (EagleDrafter(e1), H.init_head(e1, jax.random.PRNGKey(2), scale=0.3)),
        "eagle3": (EagleDrafter(e3), e3p),
    }


def _policy_params(name):
    if name != "ldlp":
        return None
    from jspec.speculative.policies.ldlp import init_ldlp

    return init_ldlp(CFG.hidden_size, jax.random.PRNGKey(5), hidden=16)


def _prompts(seed, batch=3):
    rs = np.random.RandomState(seed)
    # repeated fragments so prompt lookup has something to find
    base = list(rs.randint(4, CFG.vocab_size, 6))
    return [(base * 3)[: rs.randint(3, 18)] + list(rs.randint(4, CFG.vocab_size, 2)) for _ in range(batch)]


# Policies see drafters only through the draft logits (and EAGLE heads' features for LDLP), so every
# policy runs with one drafter of each interface (the early-exit chain drafter, the EAGLE-3 head)
# and with the n-gram drafter (no distributions); the draft model and EAGLE-1 run the policies
# that exercise their own paths (static, the heuristic, a logit rule, LDLP).
FULL_SWEEP = ("ngram", "early-exit", "eagle3")
SOME_POLICIES = ("static", "heuristic", "confidence", "ldlp")


def combos(drafters):
    """The (drafter, policy) pairs checked for greedy identity among `drafters` (see above;
    n-grams have no draft distributions)."""
    return [
        (d, p)
        for d in drafters
        for p in POLICY_NAMES
        if not (d == "ngram" and p in ("confidence", "svip", "adaedl", "tapout"))
        and (d in FULL_SWEEP or p in SOME_POLICIES)
    ]


def check_greedy_identical_to_ar(target, drafter_name, policy_name):
    """Greedy speculative output == AR output row by row, on two random prompt batches."""
    drafter, dparams = _drafters(target)[drafter_name]
    policy = make_policy(policy_name, k_max=K)
    pp = _policy_params(policy_name)

    @settings(max_examples=2, deadline=None, suppress_health_check=list(HealthCheck))
    @given(st.integers(0, 10_000))
    def check(seed):
        prompts = _prompts(seed)
        ar = generate(target, CFG, prompts, max_new_tokens=MAX_NEW)
        sp = generate(target, CFG, prompts, max_new_tokens=MAX_NEW,
                      speculative=SpeculativeConfig(drafter=drafter, drafter_params=dparams, policy=policy, policy_params=pp, k_max=K))
        for b in range(len(prompts)):
            assert sp.row(b) == ar.row(b), (drafter_name, policy_name, b)
        assert (sp.target_calls <= ar.target_calls).all()
        assert (sp.accepted <= sp.drafted).all()
        # per-call traces add up to the totals
        assert (sp.step_tokens.sum(1) == sp.lengths).all() and (sp.draft_lengths.sum(1) == sp.drafted).all()

    check()
