"""Speculative decoding: greedy identity to AR for every drafter x policy, lossless sampling,
policy/drafter compatibility errors. Tiny random models, one compile per combination."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from scipy import stats

from jspec import model as M
from jspec.config import ModelConfig
from jspec.decode import PromptError
from jspec.generate import generate
from jspec.heads import eagle as H
from jspec.sampling import Sampling, probs
from jspec.speculative.drafters.base import DrafterError
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


@pytest.fixture(scope="module")
def target():
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


COMBOS = [
    (d, p)
    for d in ("ngram", "early-exit", "model", "eagle", "eagle3")
    for p in POLICY_NAMES
    if not (d == "ngram" and p in ("confidence", "svip", "adaedl", "tapout"))
]


@pytest.mark.parametrize("drafter_name,policy_name", COMBOS)
def test_greedy_identical_to_ar(target, drafter_name, policy_name):
    drafter, dparams = _drafters(target)[drafter_name]
    policy = make_policy(policy_name, k_max=K)
    pp = _policy_params(policy_name)

    @settings(max_examples=2, deadline=None, suppress_health_check=list(HealthCheck))
    @given(st.integers(0, 10_000))
    def check(seed):
        prompts = _prompts(seed)
        ar = generate(target, CFG, prompts, max_new_tokens=MAX_NEW)
        sp = generate(target, CFG, prompts, max_new_tokens=MAX_NEW, drafter=drafter, drafter_params=dparams,
                      policy=policy, policy_params=pp, k_max=K)
        for b in range(len(prompts)):
            assert sp.row(b) == ar.row(b), (drafter_name, policy_name, b)
        assert (sp.target_calls <= ar.target_calls).all()
        assert (sp.accepted <= sp.drafted).all()
        # per-call traces add up to the totals
        assert (sp.step_tokens.sum(1) == sp.lengths).all() and (sp.draft_lengths.sum(1) == sp.drafted).all()

    check()


def test_row_alone_equals_row_in_batch(target):
    drafter, dparams = _drafters(target)["early-exit"]
    prompts = _prompts(7, batch=3)
    batch = generate(target, CFG, prompts, max_new_tokens=MAX_NEW, drafter=drafter, k_max=K)
    alone = generate(target, CFG, prompts[1:2], max_new_tokens=MAX_NEW, drafter=drafter, k_max=K)
    assert alone.row(0) == batch.row(1)


def _exact_two_token_distribution(tparams, prompt, sampling):
    """Joint target distribution of the first two sampled tokens, computed exactly."""
    V = CFG.vocab_size
    cache = M.init_cache(CFG, 1, 64)
    out = M.forward(tparams, CFG, jnp.asarray([prompt]), cache)
    p1 = probs(M.lm_head(tparams, CFG, out.hidden[:, -1]), sampling)[0]
    seqs = jnp.asarray([prompt + [t] for t in range(V)])
    out2 = M.forward(tparams, CFG, seqs, M.init_cache(CFG, V, 64))
    p2 = probs(M.lm_head(tparams, CFG, out2.hidden[:, -1]), sampling)  # [V, V]
    return np.asarray(p1[:, None] * p2)


def assert_two_token_law(target, prompt, sampling, n=2000, **gen_kwargs):
    """Chi-square test at 99.9% confidence: emitted token pairs follow the target's exact law."""
    exact = _exact_two_token_distribution(target, prompt, sampling)
    res = generate(target, CFG, [prompt] * n, max_new_tokens=2, sampling=sampling, seed=11, **gen_kwargs)
    t1, t2 = res.tokens[:, 0], res.tokens[:, 1]
    keep = res.lengths == 2  # rows that stopped at EOS after one token have no second token
    counts = np.zeros_like(exact)
    np.add.at(counts, (t1[keep], t2[keep]), 1)
    expected = exact.copy()
    expected[3, :] = 0  # EOS first: no second token
    expected = expected / expected.sum() * keep.sum()
    big = expected > 5
    obs = np.append(counts[big], counts[~big].sum())
    exp = np.append(expected[big], expected[~big].sum())
    chi2 = ((obs - exp) ** 2 / np.maximum(exp, 1e-9)).sum()
    assert chi2 < stats.chi2.ppf(0.999, df=len(obs) - 1), chi2
    return res


# The draft model and EAGLE heads (chains and trees) are checked at every position, bonus tokens
# alone, with a mutation check of the verifiers, in test_lossless_sampling.py.
@pytest.mark.parametrize("drafter_name", ["early-exit", "ngram"])
def test_sampling_is_lossless(target, drafter_name):
    drafter, dparams = _drafters(target)[drafter_name]
    # Every ordinary token occurs once in the prompt, so prompt lookup proposes a draft
    # whatever the first sampled token is.
    prompt = list(range(4, CFG.vocab_size)) + [5, 9]
    res = assert_two_token_law(target, prompt, Sampling(temperature=0.8, top_p=0.9),
                               drafter=drafter, drafter_params=dparams, k_max=3)
    assert 0 < res.drafted.sum()
    if drafter_name != "ngram":  # this prompt's n-gram drafts are almost never accepted
        assert 0 < res.accepted.sum() < res.drafted.sum()  # both accept and reject paths ran


@pytest.mark.parametrize("with_q", [False, True])
def test_verify_sampling_first_token_law(with_q):
    """The first emitted token is distributed as p, for point-mass (q=1) and sampled drafts."""
    from jspec.speculative.verify.chain import verify_sampling

    n, V = 40000, 5
    logits = jnp.log(jnp.asarray([0.1, 0.4, 0.2, 0.25, 0.05]))
    q = jnp.asarray([0.5, 0.1, 0.1, 0.2, 0.1])
    kd, kv = jax.random.split(jax.random.PRNGKey(0))
    draft = jax.random.categorical(kd, jnp.log(q), shape=(n, 1)) if with_q else jnp.full((n, 1), 1)
    tl = jnp.broadcast_to(logits, (n, 2, V))
    dp = jnp.broadcast_to(q, (n, 1, V)) if with_q else None
    acc, nxt = verify_sampling(kv, tl, draft, jnp.ones((n, 1), bool), Sampling(temperature=1.0), dp)
    first = np.where(np.asarray(acc) > 0, np.asarray(draft[:, 0]), np.asarray(nxt))
    freq = np.bincount(first, minlength=V) / n
    np.testing.assert_allclose(freq, np.exp(np.asarray(logits)), atol=0.01)
    assert 0 < int(acc.sum()) < n


def test_policy_needing_logits_rejects_ngram(target):
    with pytest.raises(DrafterError, match="draft distributions"):
        generate(target, CFG, [[5, 6]], max_new_tokens=4, drafter=NgramDrafter(), policy=make_policy("svip", k_max=K), k_max=K)


def test_vocab_mismatch_is_an_error(target):
    other = CFG.replace(vocab_size=64, num_layers=1)
    with pytest.raises(DrafterError, match="vocabulary"):
        generate(target, CFG, [[5, 6]], max_new_tokens=4, drafter=ModelDrafter(other),
                 drafter_params=M.init_params(other, jax.random.PRNGKey(0)), k_max=K)


def test_unknown_policy_and_k_max_beyond_cache(target):
    with pytest.raises(ValueError, match="unknown"):
        make_policy("nope")
    with pytest.raises(PromptError, match="cache"):
        generate(target, CFG, [[5, 6]], max_new_tokens=4, drafter=NgramDrafter(), k_max=200, cache_len=64)
