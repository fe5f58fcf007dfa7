"""Each rule as its method specifies (issue 9 §2): AdaEDL stops before drafting, the heuristic
ignores empty rounds, Consultant Decoding's eps / running mean / untempered NLL, SVIP's cap,
drafted EOS ends a draft, TapOut's state round trip, tree slot reservation near the end of the
cache, EAGLE-2 autotuning, the k_max limit, and EAGLE-format import of an unsorted d2t."""

import functools
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from jspec import model as M
from jspec.checkpoint import eagle_format
from jspec.decode import PromptError, pack_prompts
from jspec import generate as generate_module
from jspec.generate import SpeculativeConfig, generate
from jspec.heads import eagle as H
from jspec.sampling import GREEDY, Sampling
from jspec.speculative.drafters.model import ModelDrafter
from jspec.speculative.engines.chain import after_first_eos, start_spec
from jspec.speculative.engines.tree import EAGLE_NODE_CANDIDATES, TreeConfig, autotuned_tree, below_eos, build_tree
from jspec.speculative.policies import make_policy
from jspec.speculative.verify.consultant import ConsultantRule, smoothed_nll, target_nll, verify_consultant
from jspec.speculative.verify.tree import ancestor_mask
from jspec.train.testing import numpy_params, tiny_target_config
from test_spec import CFG, _drafters, _prompts

K = 4
MAX_NEW = 16
KEY = jax.random.key(0)


@pytest.fixture(scope="module")
def target():
    return M.init_params(CFG, jax.random.PRNGKey(0), scale=0.35)


@pytest.fixture(scope="module")
def eagle(target):
    return _drafters(target)["eagle"]


def _run(target, drafter, prompts=None, *, policy_state=None, cache_len=None, **fields):
    """generate() with `drafter` (a (drafter, params) pair) and the other SpeculativeConfig `fields`."""
    drafter, dparams = drafter
    return generate(target, CFG, prompts or _prompts(1), max_new_tokens=MAX_NEW, policy_state=policy_state,
                    cache_len=cache_len,
                    speculative=SpeculativeConfig(drafter=drafter, drafter_params=dparams, **fields))


def _calls(res, b):
    """Per-call traces of row b, the prefill (call 0) left out."""
    n = int(res.target_calls[b])
    return res.draft_lengths[b, 1:n], res.step_tokens[b, 1:n]


# -- AdaEDL: checked before drafting ------------------------------------------------------------


def test_adaedl_stopping_token_is_not_drafted(target, eagle):
    # lambda > 1 stops before every token: only the first (always drafted) token is proposed, so
    # the stopping token never reaches the verifier and lambda's update sees n_drafted = 1. The
    # old rule kept it (2 per round).
    policy = make_policy("adaedl", k_max=K, lambda_init=1.5, step=0.0)
    prompts = _prompts(1)
    ar = generate(target, CFG, prompts, max_new_tokens=MAX_NEW)
    chain = _run(target, eagle, prompts, policy=policy, k_max=K)
    for b in range(len(prompts)):
        assert chain.row(b) == ar.row(b)
        drafted, _ = _calls(chain, b)
        assert (drafted == 1).all(), drafted
    # The tree stops before its second level: every round verifies depth-1 nodes only.
    tree = _run(target, eagle, prompts, policy=policy, tree=TreeConfig(top_k=3, depth=4, num_nodes=12))
    for b in range(len(prompts)):
        assert tree.row(b) == ar.row(b)
        assert (_calls(tree, b)[1] <= 2).all()
    # keep_checked_token: the checked token's forward ran and the padded verify block has room, so
    # it is drafted after all, then the draft stops: 2 a round, the same outputs
    keep = _run(target, eagle, prompts, policy=make_policy("adaedl", k_max=K, lambda_init=1.5, step=0.0,
                                                            keep_checked_token=True), k_max=K)
    for b in range(len(prompts)):
        assert keep.row(b) == ar.row(b)
        drafted, _ = _calls(keep, b)
        assert (drafted == 2).all(), drafted
    # the tree keeps the level it stopped at: both levels' 3 + 9 nodes are verified (3 without)
    keep_tree = _run(target, eagle, prompts, policy=make_policy("adaedl", k_max=4, lambda_init=1.5, step=0.0,
                                                                 keep_checked_token=True),
                     tree=TreeConfig(top_k=3, depth=4, num_nodes=12))
    for b in range(len(prompts)):
        assert keep_tree.row(b) == ar.row(b)
        nodes, emitted = _calls(keep_tree, b)
        assert (nodes == 12).all() and (emitted <= 3).all(), (nodes, emitted)
        assert (_calls(tree, b)[0] == 3).all()


def test_tapout_adaedl_arm_skips_its_stopping_token():
    policy = make_policy("tapout", k_max=8)
    state = policy.init(5, KEY).replace(arm=jnp.arange(5, dtype=jnp.int32))
    np.testing.assert_array_equal(policy.stop_skips_token(state), [False, False, False, True, False])
    flat = jnp.zeros((5, 4))  # H = ln 4: the AdaEDL arm (lambda 0.5) stops, but never at step 0
    assert not bool(policy.stop(state, jnp.int32(0), flat)[3]) and bool(policy.stop(state, jnp.int32(1), flat)[3])
    keeping = make_policy("tapout", k_max=8, adaedl=make_policy("adaedl", k_max=8, keep_checked_token=True))
    assert not np.asarray(keeping.stop_skips_token(state)).any()


# -- heuristic: an empty round --------------------------------------------------------------------


def test_heuristic_ignores_a_round_with_no_draft():
    policy = make_policy("heuristic", k_max=8)
    state = policy.init(2, KEY)
    zero, one = jnp.zeros((2,), jnp.int32), jnp.ones((2,), bool)
    state = policy.update(state, zero, zero, one)  # an n-gram miss: nothing drafted
    np.testing.assert_array_equal(state.gamma, [5, 5])
    np.testing.assert_array_equal(state.rounds, [1, 1])
    state = policy.update(state, jnp.array([5, 5]), jnp.array([5, 2]), one)
    np.testing.assert_array_equal(state.gamma, [7, 4])


# -- SVIP's cap -------------------------------------------------------------------------------------


def test_svip_caps_rounds_at_40_or_k_max():
    state = make_policy("svip").init(1, KEY)
    assert int(make_policy("svip", k_max=64).round_limit(state, 64)[0]) == 40  # the paper's cap
    assert int(make_policy("svip", k_max=8).round_limit(state, 8)[0]) == 8  # the verify block's
    assert int(make_policy("svip", k_max=8, max_draft=3).round_limit(state, 8)[0]) == 3


# -- Consultant Decoding ----------------------------------------------------------------------------


def _consultant_logits():
    # position 0: p = (0.6, 0.3, 0.1, 0); the draft token 1 has NLL -ln 0.3 = 1.20 nats
    p0 = np.array([0.6, 0.3, 0.1, 1e-9])
    return jnp.asarray(np.log(np.stack([p0, p0]))[None], jnp.float32)  # [1, 2, V=4]


def test_consultant_nll_is_the_targets_own_and_eps_is_configurable():
    logits, draft, valid = _consultant_logits(), jnp.array([[1]]), jnp.array([[True]])
    n, nxt, r = verify_consultant(KEY, logits, draft, valid, GREEDY)
    assert int(n[0]) == 1 and r is None  # 1.20 <= 2.0
    # Top-k = 1 sampling keeps only token 0, but the test reads the untempered, unfiltered p.
    n, _, _ = verify_consultant(KEY, logits, draft, valid, Sampling(temperature=0.5, top_k=1))
    assert int(n[0]) == 1
    n, nxt, _ = verify_consultant(KEY, logits, draft, valid, GREEDY, ConsultantRule(eps=1.0))
    assert int(n[0]) == 0 and int(nxt[0]) == 0  # rejected; the target's own argmax replaces it
    with pytest.raises(ValueError, match="eps"):
        ConsultantRule(eps=0.0)


def test_consultant_running_mean_variant():
    nll = jnp.array([[3.0, 0.5, 0.5]])
    r = smoothed_nll(nll, 0.2, jnp.zeros((1,)))
    np.testing.assert_allclose(r, [[2.4, 0.88, 0.576]], rtol=1e-6)
    # Every NLL is ln 4 = 1.386 > eps = 1.2, so the plain rule rejects the first draft; the running
    # mean accepts while it stays <= 1.2, and carries r (running_nll) from round to round.
    logits = jnp.log(jnp.full((1, 3, 4), 0.25))
    draft, valid = jnp.array([[0, 1]]), jnp.ones((1, 2), bool)
    rule = ConsultantRule(eps=1.2, smoothing=0.5)
    n, _, r = verify_consultant(KEY, logits, draft, valid, GREEDY, rule, jnp.array([0.0]))
    # r1 = 0.693 <= 1.2, r2 = 1.040 <= 1.2: both accepted; then the bonus token's NLL: r = 1.213
    assert int(n[0]) == 2
    np.testing.assert_allclose(r, [0.5 * 1.0397 + 0.5 * 1.3863], rtol=1e-3)
    n, _, _ = verify_consultant(KEY, logits, draft, valid, GREEDY, rule, jnp.array([2.0]))
    assert int(n[0]) == 0  # r1 = 1.693 > 1.2


def test_consultant_accepts_an_nll_exactly_at_eps():
    """The rule is nll <= eps: a draft whose NLL equals eps (in float32, as computed) is accepted,
    one a float32 ulp above it is not; the same for the running mean."""
    logits = jnp.zeros((1, 3, 4), jnp.float32)  # uniform: every NLL is ln 4, as the verifier computes it
    draft, valid = jnp.array([[0, 1]]), jnp.ones((1, 2), bool)
    nll = float(target_nll(logits[:, :1], draft[:, :1])[0, 0])
    below = float(np.nextafter(np.float32(nll), np.float32(0)))
    assert int(verify_consultant(KEY, logits, draft, valid, GREEDY, ConsultantRule(eps=nll))[0][0]) == 2
    assert int(verify_consultant(KEY, logits, draft, valid, GREEDY, ConsultantRule(eps=below))[0][0]) == 0
    # running mean from r0 = nll: r stays exactly nll (beta r + (1 - beta) nll, beta = 0.5)
    r0 = jnp.array([nll], jnp.float32)
    n, _, _ = verify_consultant(KEY, logits, draft, valid, GREEDY, ConsultantRule(eps=nll, smoothing=0.5), r0)
    assert int(n[0]) == 2
    n, _, _ = verify_consultant(KEY, logits, draft, valid, GREEDY, ConsultantRule(eps=below, smoothing=0.5), r0)
    assert int(n[0]) == 0


def test_consultant_through_generate(target, eagle):
    # eps reaches the engine (and the running mean's state rides through the loop).
    lenient = _run(target, eagle, k_max=K, verify=ConsultantRule(eps=50.0, smoothing=0.5))
    assert (lenient.accepted == lenient.drafted).all() and lenient.drafted.sum() > 0
    strict = _run(target, eagle, k_max=K, verify=ConsultantRule(eps=1e-6))
    assert (strict.accepted == 0).all()


# -- drafted EOS ends the draft ---------------------------------------------------------------------


def test_after_first_eos_mask():
    cfg = CFG.replace(eos_token_ids=(3,))
    tokens = jnp.array([[5, 3, 6, 3], [5, 6, 7, 8], [3, 9, 9, 9]])
    valid = jnp.array([[True] * 4, [True] * 4, [False] * 4])
    np.testing.assert_array_equal(after_first_eos(cfg, tokens, valid),
                                  [[False, False, True, True], [False] * 4, [False] * 4])


def test_tree_nodes_below_a_drafted_eos_are_invalid():
    cfg = CFG.replace(eos_token_ids=(3,))
    tokens = jnp.array([[3, 1, 3, 4, 5]])  # root(0) is the last emitted token, never a draft
    parent = jnp.array([[0, 0, 0, 2, 3]])  # node 2 = EOS -> node 3 -> node 4
    below = below_eos(cfg, tokens, ancestor_mask(parent, 3))
    np.testing.assert_array_equal(below, [[False, False, False, True, True]])


def test_a_drafted_eos_ends_the_draft(target):
    # The target drafts for itself, so every draft is accepted; make the token it emits at a
    # position inside a round (not a bonus position, a multiple of K + 1) the EOS.
    free = CFG.replace(eos_token_ids=())
    for seed in range(20):
        prompts = _prompts(seed, batch=1)
        row = generate(target, free, prompts, max_new_tokens=MAX_NEW).row(0)
        pos = next((i for i in range(2, MAX_NEW) if i % (K + 1) and row[i] not in row[:i]), None)
        if pos is not None:
            break
    cfg = CFG.replace(eos_token_ids=(row[pos],))
    ar = generate(target, cfg, prompts, max_new_tokens=MAX_NEW)
    sp = generate(target, cfg, prompts, max_new_tokens=MAX_NEW,
                  speculative=SpeculativeConfig(drafter=ModelDrafter(cfg), drafter_params=target, k_max=K))
    assert sp.row(0) == ar.row(0) == row[: pos + 1]
    drafted, added = _calls(sp, 0)
    # The last round drafted up to the EOS and nothing after it: all of it was kept and the
    # bonus token after the EOS is dropped, so it added exactly what it drafted.
    assert drafted[-1] == added[-1] < K, (drafted, added)


# -- TapOut's bandit state survives across calls ----------------------------------------------------


def test_tapout_state_round_trip(target, eagle):
    policy = make_policy("tapout", k_max=K)
    prompts = _prompts(5, batch=2)
    first = _run(target, eagle, prompts, policy=policy, k_max=K)
    state = first.policy_state
    np.testing.assert_array_equal(np.asarray(state.counts).sum(-1), first.target_calls - 1)
    second = _run(target, eagle, prompts, policy=policy, k_max=K, policy_state=state)
    counts = np.asarray(second.policy_state.counts)
    np.testing.assert_array_equal(counts.sum(-1), first.target_calls + second.target_calls - 2)
    assert (counts >= np.asarray(state.counts)).all()
    fresh = _run(target, eagle, prompts, policy=policy, k_max=K)
    np.testing.assert_array_equal(np.asarray(fresh.policy_state.counts), np.asarray(state.counts))


# -- tree K/V slots at the end of the cache, EAGLE-2 autotuning -------------------------------------


WIDE = TreeConfig(top_k=4, depth=4, num_nodes=5)  # (depth - 1) * top_k = 12 > num_nodes + 1


def test_tree_at_the_end_of_the_cache_matches_a_roomy_cache(target, eagle):
    drafter, dparams = eagle
    prompts = _prompts(2, batch=2)
    assert WIDE.cache_slots >= WIDE.depth + 1
    policy = make_policy("static", k_max=WIDE.depth)

    @functools.partial(jax.jit, static_argnums=2)
    def draft(tokens, lens, cache_len):
        state = start_spec(target, CFG, drafter, dparams, policy, None, WIDE.depth, 1, cache_len, GREEDY, 1,
                           tokens, lens, jax.random.PRNGKey(0))
        tree, _ = build_tree(drafter, dparams, target, CFG, state.dstate, state.last, WIDE, policy, state.pstate,
                             jnp.full((len(prompts),), WIDE.depth))
        return tree.tokens, tree.parent

    def tree_at(cache_len):
        tokens, lens, cache_len = pack_prompts(CFG, prompts, 1, WIDE.cache_slots, cache_len)
        return [np.asarray(x) for x in draft(jnp.asarray(tokens), jnp.asarray(lens), cache_len)]

    # The same prefix drafted in the smallest cache generate allows for one more token (the
    # longest row's cursor sits cache_slots + 2 below the end) and in a cache with room to spare.
    lens = np.array([len(p) for p in prompts])
    tight = int(lens.max()) + 1 + WIDE.cache_slots + 1
    for a, b in zip(tree_at(tight), tree_at(256)):
        np.testing.assert_array_equal(a, b)
    # generate accepts that smallest cache for a whole generation and stays exact.
    need = int(lens.max()) + MAX_NEW + WIDE.cache_slots + 1
    small = _run(target, eagle, prompts, tree=WIDE, cache_len=need)
    ar = generate(target, CFG, prompts, max_new_tokens=MAX_NEW)
    assert [small.row(b) for b in range(2)] == [ar.row(b) for b in range(2)]


def test_tree_auto_uses_eagles_candidates(target, eagle, monkeypatch):
    tc = autotuned_tree(target, CFG, 1, 128, top_k=3, depth=3, reps=1)
    assert tc.num_nodes in [min(n, TreeConfig(3, 3, 1).max_nodes) for n in EAGLE_NODE_CANDIDATES]
    # SpeculativeConfig(tree="auto") times EAGLE-2's default tree at this batch and cache (a stand-in
    # timer here: the real one compiles five target blocks and a 59-node tree).
    calls = []

    def fake_autotune(tparams, tcfg, batch, cache_len, top_k, depth):
        calls.append((batch, top_k, depth))
        return TreeConfig(top_k=3, depth=3, num_nodes=4)

    monkeypatch.setattr(generate_module, "autotuned_tree", fake_autotune)
    prompts = _prompts(4, batch=1)
    ar = generate(target, CFG, prompts, max_new_tokens=8)
    auto = generate(target, CFG, prompts, max_new_tokens=8,
                    speculative=SpeculativeConfig(drafter=eagle[0], drafter_params=eagle[1], tree="auto"))
    assert calls == [(1, 10, 6)] and auto.row(0) == ar.row(0)


# -- the k_max limit ------------------------------------------------------------------------------


def test_k_max_beyond_the_context_is_rejected_before_allocation(target, eagle):
    with pytest.raises(PromptError, match=r"context of 512 positions.*k_max <= "):
        _run(target, eagle, k_max=100_000)


# -- EAGLE-format import of an unsorted d2t ---------------------------------------------------------


def test_unsorted_third_party_d2t_maps_rows_correctly(tmp_path):
    tcfg = tiny_target_config(num_layers=4)
    hcfg = H.HeadConfig("eagle3", tcfg, (0, 2, 3), 24)
    hparams = numpy_params(H.init_head, hcfg, seed=3, scale=0.1)
    hparams = H.with_draft_vocab(hcfg, hparams, np.random.default_rng(0).integers(0, 99, tcfg.vocab_size))
    tparams = numpy_params(M.init_params, tcfg, seed=4, scale=0.1)
    path = os.path.join(tmp_path, "head")
    eagle_format.save_eagle_head(path, hcfg, hparams)

    # Rewrite it as a third party might: draft ids in another order (rows of lm_head and the
    # d2t offsets permuted together).
    file = os.path.join(path, "model.safetensors")
    sd = load_file(file)
    perm = np.random.default_rng(1).permutation(24)
    ids = sd["d2t"] + np.arange(24)
    sd["lm_head.weight"] = sd["lm_head.weight"][perm]
    sd["d2t"] = ids[perm] - np.arange(24)
    assert (np.diff(ids[perm]) < 0).any()
    save_file(sd, file)

    hcfg2, hparams2 = eagle_format.load_eagle_head(path, tcfg)
    rng = np.random.default_rng(5)
    tokens = jnp.asarray(rng.integers(0, tcfg.vocab_size, (2, 5)), jnp.int32)
    feats = jnp.asarray(rng.normal(size=(2, 5, tcfg.hidden_size)), jnp.float32)
    _, lg1, _ = H.head_forward(hcfg, hparams, tparams, tokens, feats, H.init_head_cache(hcfg, 2, 8))
    _, lg2, _ = H.head_forward(hcfg2, hparams2, tparams, tokens, feats, H.init_head_cache(hcfg2, 2, 8))
    np.testing.assert_allclose(np.asarray(lg1), np.asarray(lg2), rtol=1e-6, atol=1e-6)

    sd["d2t"][0] = tcfg.vocab_size + 5  # a target id outside the vocabulary
    save_file(sd, file)
    with pytest.raises(ValueError, match="outside the target vocabulary"):
        eagle_format.load_eagle_head(path, tcfg)
