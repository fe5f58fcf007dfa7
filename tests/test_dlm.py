"""Masked-diffusion drafter: block caching, CPS, the drafter's drafts and their count, DiffuSpec
greedy identity, SSD == stepwise. Tiny random models (fp32), a handful of compiles."""

import dataclasses
import functools
import itertools
from collections import Counter

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jspec import model as M
from jspec.bench import round_cost as RC
from jspec.config import ModelConfig
from jspec.decode import generate_ar_jit, pack_prompts
from jspec.heads import dlm as D
from jspec.sampling import GREEDY
from jspec.speculative.drafters.diffusion import (
    DiffuSpecDrafter, cps_beam_search, cps_lattice, fit_trigram_proxy, proxy_logprob,
)
from jspec.speculative.drafters.base import DrafterError
from jspec.speculative.engines import ssd as SSD
from jspec.speculative.engines.chain import speculative_generate, start_spec
from jspec.speculative.policies import make_policy
from jspec.speculative.policies.adl import ADLPolicy
from jspec.train.testing import numpy_params

CFG = ModelConfig(
    arch="llama", vocab_size=48, hidden_size=32, intermediate_size=64, num_layers=4,
    num_heads=4, num_kv_heads=2, head_dim=8, eos_token_ids=(3,), max_position_embeddings=512,
)
DCFG = D.DLMConfig(target=CFG, num_layers=2, mask_token_id=5, block_size=8)


@pytest.fixture(scope="module")
def target():
    return numpy_params(M.init_params, CFG, scale=0.35)


@pytest.fixture(scope="module")
def dlm(target):
    own = D.init_dlm(DCFG, target)
    # perturb the copied layers so the DLM is not the target's truncation
    rng = np.random.default_rng(7)
    layers = {k: v + jnp.asarray(0.1 * rng.standard_normal(v.shape), v.dtype) if "norm" not in k else v
              for k, v in own["layers"].items()}
    return {"layers": layers, "final_norm": own["final_norm"]}


PROMPTS = [[7, 9, 11, 13, 9, 11], [20, 21, 22]]


def test_block_caching_matches_uncached(target, dlm):
    rng = np.random.default_rng(0)
    prefix = jnp.asarray(rng.integers(6, 48, (2, 9)), jnp.int32)
    block = jnp.asarray(rng.integers(6, 48, (2, 8)), jnp.int32).at[:, 3:].set(DCFG.mask_token_id)

    @jax.jit
    def run(dlm, target, prefix, block):
        ref = D.uncached_block_logits(dlm, target, DCFG, prefix, block)
        # cached: prompt prefill of 5 tokens, then a call that commits 4 pending tokens + the block
        cache = M.init_cache(DCFG.model, 2, 64)
        cache = D.prefill(dlm, target, DCFG, prefix[:, :5], jnp.full((2,), 5), cache, kernels="xla")
        pending = jnp.concatenate([prefix[:, 5:], jnp.zeros((2, 3), jnp.int32)], 1)  # 4 real + 3 junk
        got, cache = D.block_logits(dlm, target, DCFG, cache, pending, jnp.full((2,), 4), block, kernels="xla")
        # the same block again with nothing pending reads the committed prefix from the cache
        again, _ = D.block_logits(dlm, target, DCFG, cache, jnp.zeros((2, 0), jnp.int32), jnp.zeros((2,), jnp.int32),
                                  block, kernels="xla")
        return ref, got, again, cache.lengths

    ref, got, again, lengths = run(dlm, target, prefix, block)
    np.testing.assert_allclose(got, ref, atol=2e-5, rtol=1e-5)
    np.testing.assert_allclose(again, ref, atol=2e-5, rtol=1e-5)
    assert (lengths == 9).all()


def test_two_stream_training_forward_matches_inference(target, dlm):
    """The training layout computes the same block logits as the cached inference call."""
    rng = np.random.default_rng(1)
    L, b = 12, 4
    clean = jnp.asarray(rng.integers(6, 48, (1, L)), jnp.int32)
    pos = jnp.arange(L)
    anchor = (pos // b) * b
    noisy = jnp.where(pos % b == 0, clean, DCFG.mask_token_id)

    @jax.jit
    def run(dlm, target, clean, noisy):
        h = D.two_stream_hidden(dlm, target, DCFG, clean, noisy, anchor[None], (pos // b)[None])
        logits = M.lm_head(D.full_params(dlm, target), DCFG.model, h)
        return logits, D.uncached_block_logits(dlm, target, DCFG, clean[:, :4], noisy[:, 4:8])

    logits, ref = run(dlm, target, clean, noisy)
    np.testing.assert_allclose(logits[:, 4:8], ref, atol=2e-5, rtol=1e-5)


def test_cps_search_impl_and_objective_are_checked():
    with pytest.raises(DrafterError, match="cps_search 'cuda': choose auto, xla or pallas"):
        DiffuSpecDrafter(dcfg=DCFG, k_max=4, cps_search="cuda").check(CFG)
    # "auto" runs the one-kernel search where the model's GPU kernels run: never on the CPU
    assert DiffuSpecDrafter(dcfg=DCFG, k_max=4).search_impl() == "xla"
    assert DiffuSpecDrafter(dcfg=DCFG, k_max=4, kernels="pallas").search_impl() == "pallas"
    assert DiffuSpecDrafter(dcfg=DCFG, k_max=4, cps_search="xla", kernels="pallas").search_impl() == "xla"
    with pytest.raises(DrafterError, match="objective 'mean': choose logprob or expected"):
        DiffuSpecDrafter(dcfg=DCFG, k_max=4, objective="mean").check(CFG)
    paper = DiffuSpecDrafter.paper(DCFG, k_max=4)
    assert (paper.objective, paper.eos_stop, paper.lam) == ("logprob", True, 0.5)


def test_cps_finds_best_causal_path():
    """Hand-built lattice where greedy per-position choice and beam width 1 miss the optimum."""
    V, eos = 8, 3
    q = np.full((1, 3, V), 1e-6)
    q[0, 0, [4, 5]] = [0.55, 0.45]
    q[0, 1, [6, 7]] = [0.5, 0.5]
    q[0, 2, [4, 6, eos]] = [0.5, 0.3, 0.2]
    logq = jnp.log(jnp.asarray(q / q.sum(-1, keepdims=True), jnp.float32))
    # proxy: after (1, 2) it prefers 4, whose continuations it has never seen; 5 -> 7 -> 6 is rarer
    # but certain once started, so only a search beyond one step finds the best path
    seqs = [[1, 2, 4, 0, 0]] * 20 + [[1, 2, 5, 7, 6]] * 3
    proxy = jax.tree.map(jnp.asarray, fit_trigram_proxy(seqs, V))
    fn = lambda a, b, c: proxy_logprob(proxy, a, b, c)  # noqa: E731
    tok, lq, ok, _ = cps_lattice(logq, eos, tau=0.95, m_max=3)
    lam = 0.5
    prev2, prev1 = jnp.asarray([1]), jnp.asarray([2])

    # brute force over the lattice's causal paths (a path may end at EOS), proxy scores in one call
    table = np.asarray(jax.jit(fn)(*jnp.meshgrid(jnp.arange(V), jnp.arange(V), jnp.arange(V), indexing="ij")))
    best, best_path = -np.inf, None
    cands = [[(int(t), float(l)) for t, l, o in zip(tok[0, i], lq[0, i], ok[0, i]) if o] for i in range(3)]
    for n in range(1, 4):
        for path in itertools.product(*cands[:n]):
            toks = [t for t, _ in path]
            if eos in toks[:-1] or (n < 3 and toks[-1] != eos):
                continue
            ctx = [1, 2] + toks
            s = sum(lam * l + (1 - lam) * table[ctx[i], ctx[i + 1], t] for i, (t, l) in enumerate(path))
            if s > best:
                best, best_path = s, toks
    search = jax.jit(lambda w: cps_beam_search(tok, lq, ok, jnp.asarray([3]), prev2, prev1, fn, beam=w, lam=lam, eos_id=eos),
                     static_argnums=0)
    path, length, score = search(4)
    assert path[0, : int(length[0])].tolist() == best_path
    np.testing.assert_allclose(float(score[0]), best, rtol=1e-5)
    assert best_path[:2] == [5, 7]
    _, _, greedy_score = search(1)  # beam width 1 (greedy) misses the optimum here
    assert float(greedy_score[0]) < best - 1e-3


def test_proxy_lookup_matches_counted_ngrams():
    """The hashed device tables give the stupid-backoff 3-gram log-probs counted directly, for seen
    trigrams, bigram backoffs and unigram backoffs alike (and a table with no trigrams at all)."""
    rng = np.random.default_rng(0)
    V = 40
    seqs = [rng.integers(0, V, rng.integers(1, 50)).tolist() for _ in range(200)]
    tri, bi, uni = Counter(), Counter(), np.zeros(V)
    for s in seqs:
        uni += np.bincount(s, minlength=V)
        tri.update(tuple(s[i : i + 3]) for i in range(len(s) - 2))
        bi.update(tuple(s[i : i + 2]) for i in range(len(s) - 1))
    ctx2, ctx1 = Counter(), Counter()
    for (a, b, _), n in tri.items():
        ctx2[a, b] += n
    for (b, _), n in bi.items():
        ctx1[b] += n
    q = rng.integers(0, V, (3, 4000))
    q[:, :1000] = np.asarray(list(tri)[:1000]).T
    alpha = np.log(0.4)
    ref = [np.log(tri[a, b, c] / ctx2[a, b]) if (a, b, c) in tri else
           alpha + np.log(bi[b, c] / ctx1[b]) if (b, c) in bi else
           2 * alpha + np.log((uni[c] + 1) / (uni.sum() + V)) for a, b, c in q.T]
    lookup = jax.jit(proxy_logprob)
    proxy = jax.tree.map(jnp.asarray, fit_trigram_proxy(seqs, V))
    np.testing.assert_allclose(lookup(proxy, *map(jnp.asarray, q)), ref, rtol=1e-5, atol=1e-5)
    short = jax.tree.map(jnp.asarray, fit_trigram_proxy([[4, 5]], V))  # bigrams only
    np.testing.assert_allclose(lookup(short, *map(jnp.asarray, ([1], [4], [5]))), [alpha], rtol=1e-6)


def _diffuspec_params(dlm):
    seqs = [p + [9, 11, 13, 3] for p in PROMPTS]
    return {"dlm": dlm, "proxy": jax.tree.map(jnp.asarray, fit_trigram_proxy(seqs, CFG.vocab_size))}


@pytest.mark.parametrize("cps,policy,objective,eos_stop", [
    (True, "adl", "logprob", True), (True, "adl", "expected", False), (False, "static", "logprob", True)])
def test_diffuspec_greedy_matches_ar(target, dlm, cps, policy, objective, eos_stop):
    k = 6
    max_new = 24
    tokens, lens, cache_len = pack_prompts(CFG, PROMPTS, max_new, extra=k)
    ar, n_ar, _ = generate_ar_jit(target, CFG, jnp.asarray(tokens), jnp.asarray(lens), jax.random.PRNGKey(0),
                                  max_new=max_new, cache_len=cache_len, sampling=GREEDY)
    drafter = DiffuSpecDrafter(dcfg=DCFG, k_max=k, cps=cps, m_max=4, beam=2, kernels="xla", objective=objective,
                               eos_stop=eos_stop)
    pol = ADLPolicy(k_max=k, k_min=2, delta=2) if policy == "adl" else make_policy("static", k_max=k)
    res = speculative_generate(target, CFG, tokens, lens, jax.random.PRNGKey(0), drafter=drafter,
                               drafter_params=_diffuspec_params(dlm), policy=pol, policy_params=None, k_max=k,
                               max_new=max_new, cache_len=cache_len, sampling=GREEDY, verify="lossless", unroll=1)
    for b in range(len(PROMPTS)):
        assert res.row(b) == np.asarray(ar)[b, : int(n_ar[b])].tolist()
    assert (res.drafted > 0).all()


def _hand_marginals():
    """DLM marginals [T, V] for every round: position 0 puts 0.55 on token 4 and 0.45 on 5,
    position 1 0.7 on 6 and 0.3 on EOS (so the CPS lattice ends there), later positions 0.9 on 7."""
    q = np.full((DCFG.block_size, CFG.vocab_size), 1e-9)
    q[0, [4, 5]] = [0.55, 0.45]
    q[1, [6, CFG.eos_token_ids[0]]] = [0.7, 0.3]
    q[2:, [7, 8]] = [0.9, 0.1]
    return np.log(q / q.sum(-1, keepdims=True)).astype(np.float32)


@dataclasses.dataclass(frozen=True)
class HandMarginalsDrafter(DiffuSpecDrafter):
    """DiffuSpec whose DLM call returns `_hand_marginals()` (the cache still commits as usual)."""

    def denoise(self, dparams, tparams, dstate, last):
        _, fixed, fixed_tok, dstate = super().denoise(dparams, tparams, dstate, last)
        marginals = jnp.asarray(_hand_marginals()[: fixed.shape[1]])
        logits = jnp.broadcast_to(marginals, (last.shape[0],) + fixed.shape[1:] + (CFG.vocab_size,))
        return logits, fixed, fixed_tok, dstate


def _hand_drafter_params(dlm):
    # the proxy has seen 5 -> 6 often and 4 never: CPS takes 5 where the per-position argmax is 4
    return {"dlm": dlm, "proxy": jax.tree.map(jnp.asarray, fit_trigram_proxy([[5, 6] * 10] * 4, CFG.vocab_size))}


def test_diffuspec_drafts_the_cps_path_and_counts_only_its_tokens(target, dlm):
    """The drafter's drafted tokens are CPS's path, not the per-position argmax, and its valid count
    is the path's length: the lattice ends at position 1 (its tau-set holds EOS), the path takes 6
    there, not EOS, so it is [5, 6] and the block's slots 2..5 are padding, not drafts."""
    k = 6
    drafter = HandMarginalsDrafter(dcfg=DCFG, k_max=k, tau=0.8, m_max=4, beam=3, lam=0.5, kernels="xla",
                                   objective="logprob", eos_stop=True)
    tokens, lens, cache_len = pack_prompts(CFG, PROMPTS, 8, extra=k)
    params = _hand_drafter_params(dlm)

    @functools.partial(jax.jit, static_argnums=0)
    def draft(drafter, params, target, tokens, lens):
        first = jnp.full((tokens.shape[0],), 11, jnp.int32)
        dstate = drafter.init(params, target, CFG, tokens, lens, first, None, cache_len)
        return drafter.draft_block(params, target, CFG, dstate, first, jnp.full_like(first, k), GREEDY, None, False)

    drafted, valid, _, _ = draft(drafter, params, target, jnp.asarray(tokens), jnp.asarray(lens))
    assert np.asarray(valid).sum(1).tolist() == [2, 2]
    assert np.asarray(drafted)[:, :2].tolist() == [[5, 6], [5, 6]]  # per-position argmax: [4, 6]

    # without the EOS stop [I] the lattice goes on past position 1, and the summed scores favour the
    # path that ends there at EOS over [5, 6, 7, ...] (every further token only lowers a score): one draft
    no_stop = dataclasses.replace(drafter, eos_stop=False)
    drafted, valid, _, _ = draft(no_stop, params, target, jnp.asarray(tokens), jnp.asarray(lens))
    assert np.asarray(valid).sum(1).tolist() == [1, 1]
    assert np.asarray(drafted)[:, :1].tolist() == [[5], [5]]

    # the expected accepted length has no such bias (a token never lowers it): the whole block
    expected = dataclasses.replace(no_stop, objective="expected")
    drafted, valid, _, _ = draft(expected, params, target, jnp.asarray(tokens), jnp.asarray(lens))
    assert np.asarray(valid).sum(1).tolist() == [k, k]
    assert np.asarray(drafted).tolist() == [[5, 6, 7, 7, 7, 7]] * 2


def test_adl_reads_the_cps_path_length(target, dlm):
    """Through the chain engine: every round drafts the 2-token path, so ADL's generated-length EMA
    is 2 (1 - 0.5^rounds), and the drafted count is 2 a round, however long the block."""
    k, max_new = 6, 12
    drafter = HandMarginalsDrafter(dcfg=DCFG, k_max=k, tau=0.8, m_max=4, beam=3, lam=0.5, kernels="xla",
                                   objective="logprob", eos_stop=True)
    tokens, lens, cache_len = pack_prompts(CFG, PROMPTS, max_new, extra=k)
    res = speculative_generate(target, CFG, tokens, lens, jax.random.PRNGKey(0), drafter=drafter,
                               drafter_params=_hand_drafter_params(dlm), policy=ADLPolicy(k_max=k, k_min=2, delta=2),
                               policy_params=None, k_max=k, max_new=max_new, cache_len=cache_len, sampling=GREEDY,
                               verify="lossless", unroll=1)
    rounds = np.asarray(res.target_calls) - 1
    assert (rounds > 0).all()
    np.testing.assert_array_equal(res.drafted, 2 * rounds)
    np.testing.assert_allclose(np.asarray(res.policy_state.gen_ema), 2.0 * (1.0 - 0.5 ** rounds), rtol=1e-6)


def test_ssd_identical_to_stepwise(target, dlm):
    b, n_nodes, max_new = 4, 3, 20
    tokens, lens, _ = pack_prompts(CFG, PROMPTS, max_new)
    cache_len = SSD.cache_len_for(tokens.shape[1], max_new, b, n_nodes)
    kw = dict(dcfg=DCFG, b=b, max_new=max_new, cache_len=cache_len, kernels="xla")
    ref, n_ref, f_ref = SSD.stepwise_generate_jit(dlm, target, jnp.asarray(tokens), jnp.asarray(lens), **kw)
    out, n_out, f_out = SSD.ssd_generate_jit(dlm, target, jnp.asarray(tokens), jnp.asarray(lens), n_nodes=n_nodes, **kw)
    np.testing.assert_array_equal(n_out, n_ref)
    np.testing.assert_array_equal(out, ref)
    assert (np.asarray(f_ref) >= np.asarray(n_ref)).all()  # stepwise: one token per forward
    assert (np.asarray(f_out) < np.asarray(f_ref)).all()  # SSD: fewer forwards for the same tokens
    # stepwise decoding through SSD's N-node forward (the bf16 bit-for-bit reference) is the same rule
    same, n_same, f_same = SSD.stepwise_generate_jit(dlm, target, jnp.asarray(tokens), jnp.asarray(lens),
                                                     n_nodes=n_nodes, **kw)
    np.testing.assert_array_equal(same, ref)
    np.testing.assert_array_equal(f_same, f_ref)


def test_round_profile_times_the_dlm_forward_cps_and_ssd_steps(target, dlm):
    """The round-cost parts bench_dlm.py --rows profile reports: the DLM's block call and the CPS
    choice each timed alone, SSD's N-node step against the one-block step."""
    k = 6
    drafter = DiffuSpecDrafter(dcfg=DCFG, k_max=k, m_max=4, beam=2, kernels="xla")
    tokens, lens, cache_len = pack_prompts(CFG, PROMPTS, 16, extra=k)
    state = jax.jit(lambda tp, dp, t, ln: start_spec(tp, CFG, drafter, dp, ADLPolicy(k_max=k, k_min=2, delta=2), None, k,
                                                       16, cache_len, GREEDY, 1, t, ln, jax.random.PRNGKey(0)))(
        target, _diffuspec_params(dlm), jnp.asarray(tokens), jnp.asarray(lens))
    parts = RC.block_draft_us(target, CFG, drafter, _diffuspec_params(dlm), state, n=2)
    assert set(parts) == {"dlm_forward_us", "choose_us"} and min(parts.values()) > 0
    ssd = RC.ssd_forward_us(dlm, target, DCFG, batch=2, b=4, n_nodes=3, prompt_len=8, n=2)
    assert ssd["ssd_over_stepwise"] == pytest.approx(ssd["ssd_step_us"] / ssd["stepwise_step_us"]) and ssd["ssd_step_us"] > 0
