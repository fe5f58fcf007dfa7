"""Speculative sampling is lossless: the joint law of the first two emitted tokens equals the
target's exact law (chi-square) for the early-exit and n-gram drafters, and the chain verifier's
first token follows p for point-mass and sampled drafts. Tiny random target from spec_tiny.py."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats
from spec_tiny import CFG, _drafters, make_target

from jspec import model as M
from jspec.generate import SpeculativeConfig, generate
from jspec.sampling import Sampling, probs
from jspec.speculative.verify import block as block_verify
from jspec.speculative.verify import chain as chain_verify


@pytest.fixture(scope="module")
def target():
    return make_target()


def _exact_two_token_distribution(tparams, prompt, sampling):
    """Joint target distribution of the first two sampled tokens, computed exactly."""
    V = CFG.vocab_size

    @jax.jit  # one program: op-by-op dispatch compiles every op on its own
    def joint(tparams, first, seqs):
        out = M.forward(tparams, CFG, first, M.init_cache(CFG, 1, 64))
        p1 = probs(M.lm_head(tparams, CFG, out.hidden[:, -1]), sampling)[0]
        out2 = M.forward(tparams, CFG, seqs, M.init_cache(CFG, V, 64))
        p2 = probs(M.lm_head(tparams, CFG, out2.hidden[:, -1]), sampling)  # [V, V]
        return p1[:, None] * p2

    return np.asarray(joint(tparams, jnp.asarray([prompt]), jnp.asarray([prompt + [t] for t in range(V)])))


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
    # 64 cache slots hold the 46-token prompt, 2 new tokens and a k_max + 1 block; the default
    # plan (a 128-slot cache) doubles every attention over the 2000 rows for the same tokens.
    res = assert_two_token_law(target, prompt, Sampling(temperature=0.8, top_p=0.9), cache_len=64,
                               speculative=SpeculativeConfig(drafter=drafter, drafter_params=dparams, k_max=3))
    assert 0 < res.drafted.sum()
    if drafter_name != "ngram":  # this prompt's n-gram drafts are almost never accepted
        assert 0 < res.accepted.sum() < res.drafted.sum()  # both accept and reject paths ran


@pytest.mark.parametrize("rule", ["token", "block"])
@pytest.mark.parametrize("with_q", [False, True])
def test_verify_sampling_first_token_law(with_q, rule):
    """The first emitted token is distributed as p, for point-mass (q=1) and sampled drafts."""
    verify_sampling = {"token": chain_verify.verify_sampling, "block": block_verify.verify_block}[rule]
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


def test_block_verification_accepts_more_than_token_by_token():
    """Block verification keeps more drafts than the token rule on the same drafts and target laws
    (never fewer in expectation; the paper proves it), here K = 4 drafts from a q unlike p; with
    q = 1 drafts (n-grams) the two rules accept alike."""
    rows, K, V = 40_000, 4, 8
    rs = np.random.RandomState(3)
    P, Q = rs.dirichlet(np.ones(V), K + 1), rs.dirichlet(np.ones(V), K)
    kd, kv = jax.random.split(jax.random.PRNGKey(5))
    logits = jnp.broadcast_to(jnp.log(jnp.asarray(P, jnp.float32)), (rows, K + 1, V))
    valid = jnp.ones((rows, K), bool)
    sampled = jax.random.categorical(kd, jnp.log(jnp.asarray(Q, jnp.float32)), shape=(rows, K))
    q = jnp.broadcast_to(jnp.asarray(Q, jnp.float32), (rows, K, V))
    fixed = jnp.broadcast_to(jnp.asarray(np.argmax(P[:K], 1), jnp.int32), (rows, K))
    mean_n = {}
    for rule, fn in (("token", chain_verify.verify_sampling), ("block", block_verify.verify_block)):
        for drafts, probs in (("sampled", q), ("fixed", None)):
            n, _ = fn(kv, logits, sampled if drafts == "sampled" else fixed, valid, Sampling(temperature=1.0), probs)
            mean_n[rule, drafts] = float(np.mean(np.asarray(n)))
    assert mean_n["block", "sampled"] > 1.05 * mean_n["token", "sampled"], mean_n
    assert abs(mean_n["block", "fixed"] - mean_n["token", "fixed"]) < 0.02, mean_n
