"""EAGLE-2 dynamic trees: structure invariants, greedy identity to AR, lossless tree sampling."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from flax import struct
from hypothesis import strategies as st

from jspec import model as M
from jspec.generate import SpeculativeConfig, generate
from jspec.sampling import Sampling
from jspec.decode import pack_prompts, prefill
from jspec.speculative.engines.chain import start_spec
from jspec.speculative.engines.tree import TreeConfig, build_tree, draft_tree, tree_round, verify_pruned, verify_size_index
from jspec.speculative.policies import make_policy
from jspec.speculative.policies.auto import AutoPolicy
from jspec.speculative.policies.base import Policy
from jspec.speculative.verify.tree import Tree, ancestor_mask, path_of, verify_tree_greedy, verify_tree_sampling
from test_spec import CFG, _drafters, _prompts

TC = TreeConfig(top_k=3, depth=4, num_nodes=12)


@pytest.fixture(scope="module")
def target():
    return M.init_params(CFG, jax.random.PRNGKey(0), scale=0.35)


def test_tree_structure_invariants(target):
    drafter, dparams = _drafters(target)["eagle"]
    prompts = _prompts(1)
    from jspec.decode import pack_prompts
    from jspec.speculative.engines.chain import start_spec

    tokens, lens, cache_len = pack_prompts(CFG, prompts, 8, TC.num_nodes + 1)
    policy = make_policy("static", k_max=TC.depth)

    @jax.jit  # one program, as the engine runs it (eager op-by-op dispatch is slow to compile on CPU)
    def prefill_and_tree(target, dparams, tokens, lens):
        state = start_spec(target, CFG, drafter, dparams, policy, None, TC.depth, 8, cache_len, Sampling(), 1,
                           tokens, lens, jax.random.PRNGKey(0))
        tree, _ = build_tree(drafter, dparams, target, CFG, state.dstate, state.last, TC, policy, state.pstate,
                             jnp.full((len(prompts),), TC.depth))
        return state.last, tree

    last, tree = prefill_and_tree(target, dparams, jnp.asarray(tokens), jnp.asarray(lens))
    parent, depth, anc = (np.asarray(x) for x in (tree.parent, tree.depth, tree.ancestors))
    n = parent.shape[1]
    assert (parent[:, 1:] < np.arange(1, n)).all()  # every node's parent precedes it
    for b in range(parent.shape[0]):
        for i in range(1, n):
            assert depth[b, i] == depth[b, parent[b, i]] + 1  # positions are depths
            assert (anc[b, i] >= anc[b, parent[b, i]]).all() and anc[b, i, i]  # ancestor-closed
            assert anc[b, i].sum() == depth[b, i] + 1
    assert (np.asarray(tree.tokens[:, 0]) == np.asarray(last)).all()


# EAGLE-1 trees under every policy are checked against a transformers greedy loop in
# test_greedy_reference.py; here the EAGLE-3 head on a 4-layer target (multi-layer K/V moves).
@pytest.mark.parametrize("drafter_name", ["eagle3"])
@pytest.mark.parametrize("policy_name", ["static", "svip", "heuristic"])
def test_tree_greedy_identical_to_ar(target, drafter_name, policy_name):
    drafter, dparams = _drafters(target)[drafter_name]

    @settings(max_examples=2, deadline=None, suppress_health_check=list(HealthCheck))
    @given(st.integers(0, 10_000))
    def check(seed):
        prompts = _prompts(seed)
        ar = generate(target, CFG, prompts, max_new_tokens=16)
        tr = generate(target, CFG, prompts, max_new_tokens=16,
                      speculative=SpeculativeConfig(drafter=drafter, drafter_params=dparams, tree=TC, policy=policy_name))
        for b in range(len(prompts)):
            assert tr.row(b) == ar.row(b)
        assert (tr.step_tokens.sum(1) == tr.lengths).all() and (tr.draft_lengths.sum(1) == tr.drafted).all()

    check()


def _toy_tree():
    # root(0) -> a=1 (node 1), b=2 (node 2); node 1 -> c=3 (node 3)
    tokens = jnp.asarray([[0, 1, 2, 3]])
    parent = jnp.asarray([[0, 0, 0, 1]])
    depth = jnp.asarray([[0, 1, 1, 2]])
    return Tree(tokens, parent, depth, ancestor_mask(parent, 2), jnp.ones((1, 4), bool))


def test_verify_tree_greedy_picks_deepest_matching_path():
    tree = _toy_tree()
    V = 5
    tgt = np.zeros((1, 4, V), np.float32)
    tgt[0, 0, 1] = tgt[0, 1, 3] = tgt[0, 3, 4] = tgt[0, 2, 0] = 5.0  # root->1, 1->3, 3->4
    best, n, nxt = verify_tree_greedy(tree, jnp.asarray(tgt), 2)
    assert (int(best[0]), int(n[0]), int(nxt[0])) == (3, 2, 4)
    assert np.asarray(path_of(tree, best, 2)).tolist() == [[0, 1, 3]]


def test_verify_tree_sampling_is_lossless():
    """First token ~ p_root; second token given the first is a (a node with a child) ~ p_a."""
    tree = _toy_tree()
    V, n = 5, 40000
    p_root = np.array([0.1, 0.3, 0.25, 0.15, 0.2])
    p_a = np.array([0.2, 0.1, 0.1, 0.5, 0.1])
    other = np.full(V, 0.2)
    logits = jnp.log(jnp.asarray(np.stack([p_root, p_a, other, other]), jnp.float32))
    batch = lambda x: jnp.broadcast_to(x, (n,) + x.shape[1:])
    tree_b = Tree(*(batch(x) for x in (tree.tokens, tree.parent, tree.depth, tree.ancestors, tree.valid)))
    best, acc, nxt = verify_tree_sampling(jax.random.PRNGKey(0), tree_b, batch(logits[None]), Sampling(temperature=1.0), 2)
    path = np.asarray(path_of(tree_b, best, 2))
    toks = np.asarray(tree_b.tokens)
    acc, nxt = np.asarray(acc), np.asarray(nxt)
    first = np.where(acc >= 1, toks[np.arange(n), path[:, 1]], nxt)
    np.testing.assert_allclose(np.bincount(first, minlength=V) / n, p_root, atol=0.01)
    on_a = first == 1
    second = np.where(acc[on_a] >= 2, toks[on_a][:, 3], nxt[on_a])
    np.testing.assert_allclose(np.bincount(second, minlength=V) / on_a.sum(), p_a, atol=0.015)

def test_a_token_two_siblings_share_counts_once():
    """Two root children carry the same token a, each with its own child (c under the first, d
    under the second): the second token given the first is a must still follow p_a. Matching both
    duplicates and keeping the deeper path would favour the drafted children c and d."""
    V, n = 5, 60000
    a, c, d = 1, 3, 4
    tokens = jnp.asarray([[0, a, a, c, d]])
    parent = jnp.asarray([[0, 0, 0, 1, 2]])
    depth = jnp.asarray([[0, 1, 1, 2, 2]])
    tree = Tree(tokens, parent, depth, ancestor_mask(parent, 2), jnp.ones((1, 5), bool))
    p_root = np.array([0.1, 0.5, 0.1, 0.2, 0.1])
    p_a = np.array([0.3, 0.1, 0.2, 0.2, 0.2])
    logits = jnp.log(jnp.asarray(np.stack([p_root, p_a, p_a, np.full(V, 0.2), np.full(V, 0.2)]), jnp.float32))
    batch = lambda x: jnp.broadcast_to(x, (n,) + x.shape[1:])
    tree_b = Tree(*(batch(x) for x in (tree.tokens, tree.parent, tree.depth, tree.ancestors, tree.valid)))
    best, acc, nxt = verify_tree_sampling(jax.random.PRNGKey(1), tree_b, batch(logits[None]), Sampling(temperature=1.0), 2)
    best, acc, nxt = np.asarray(best), np.asarray(acc), np.asarray(nxt)
    assert not np.isin(best, [2, 4]).any()  # the second duplicate is never taken
    first = np.where(acc >= 1, a, nxt)
    np.testing.assert_allclose(np.bincount(first, minlength=V) / n, p_root, atol=0.01)
    second = np.where(acc[first == a] >= 2, c, nxt[first == a])
    np.testing.assert_allclose(np.bincount(second, minlength=V) / (first == a).sum(), p_a, atol=0.01)

# Tree generation's lossless sampling, every position and bonus tokens: test_lossless_sampling.py.


PRUNED = TreeConfig(top_k=3, depth=4, num_nodes=12, verify_sizes=(3, 6))


@pytest.mark.parametrize("skip_levels", [False, True])
def test_a_pruned_tree_stops_drafting_and_verifies_fewer_nodes(target, skip_levels):
    """A policy that stops after the first level: the kept nodes are the first level's (the deeper
    levels skipped under skip_levels, masked otherwise), and the round verifies the smallest
    compiled block (3 nodes, not 12). `auto` never cuts: its tree is the static one even when its
    per-row limit is 1."""
    drafter, dparams = _drafters(target)["eagle3"]
    prompts = _prompts(2)
    from jspec.decode import pack_prompts
    from jspec.speculative.engines.chain import start_spec
    from jspec.speculative.engines.tree import draft_tree, verify_size_index

    tokens, lens, cache_len = pack_prompts(CFG, prompts, 8, PRUNED.num_nodes + 1)
    sizes = PRUNED.block_sizes(True)
    assert sizes == (3, 6, 12) and PRUNED.block_sizes(False) == (12,)

    tc = dataclasses.replace(PRUNED, skip_levels=skip_levels)

    def run(policy):
        @jax.jit
        def go(target, dparams, tokens, lens):
            state = start_spec(target, CFG, drafter, dparams, policy, None, tc.depth, 8, cache_len, Sampling(), 1,
                               tokens, lens, jax.random.PRNGKey(0))
            pstate, limit = policy.start_round(state.pstate, tc.depth)
            tree, _, _ = draft_tree(drafter, dparams, target, CFG, state.dstate, state.last, tc, policy, pstate, limit)
            return tree, verify_size_index(tree.valid, sizes)

        return go(target, dparams, jnp.asarray(tokens), jnp.asarray(lens))

    tree, index = run(make_policy("confidence", threshold=1.01))  # no draft is that sure: stop after level 1
    assert (np.asarray(tree.valid[:, 1:]).sum(1) == PRUNED.top_k).all() and int(index) == 0
    assert (np.asarray(tree.valid[:, 1 : PRUNED.top_k + 1])).all()  # the valid nodes come first
    tree, index = run(make_policy("static", k_max=PRUNED.depth))
    assert int(index) == len(sizes) - 1 and np.asarray(tree.valid).sum() > 2 * PRUNED.top_k
    assert not make_policy("static", k_max=PRUNED.depth).cuts_trees and make_policy("confidence").cuts_trees


def smallest_holding_block(valid: np.ndarray, sizes) -> int:
    """The rule: the first of the ascending block sizes (draft nodes) that holds every row's last
    valid node (node 0 the root, so a block of n holds nodes 0..n); the largest if none does."""
    last = max(int(np.flatnonzero(row).max()) for row in valid)
    return next((i for i, n in enumerate(sizes) if n >= last), len(sizes) - 1)


def test_pruned_verification_picks_the_smallest_block_that_holds_the_kept_nodes():
    """verify_size_index against the rule, on random valid masks whose rows differ, and on every
    last valid node 0..N (a node that exactly fills a block takes that block, not the next)."""
    rng = np.random.default_rng(0)
    sizes, N = (3, 6, 12), 12
    masks = [rng.random((3, N + 1)) < rng.uniform(0.05, 0.6) for _ in range(64)]
    for last in range(N + 1):  # two rows, the other's last valid node below this one
        mask = np.zeros((2, N + 1), bool)
        mask[0, last] = mask[1, last // 2] = True
        masks.append(mask)
    for mask in masks:
        mask[:, 0] = True  # the root
        assert int(verify_size_index(jnp.asarray(mask), sizes)) == smallest_holding_block(mask, sizes), mask.astype(int)


def test_a_pruned_verify_block_accepts_every_kept_node(target):
    """verify_pruned over chains of the target's own greedy tokens whose first v nodes are kept
    (v differing by row): every kept node is in the block it verifies, so all v are accepted, for
    v = 0..N, including the v that exactly fill a block."""
    sizes, N = (3, 6, 12), 12
    prompts = _prompts(5)  # test_pruned_tree_greedy_identical_to_ar's call: one compiled AR program
    ar = generate(target, CFG, prompts, max_new_tokens=16)
    assert (ar.lengths == 16).all()  # no EOS: N + 1 greedy tokens a row
    B = len(prompts)
    tokens, lens, cache_len = pack_prompts(CFG, prompts, 16, N + 1)
    chain = jnp.asarray(ar.tokens[:, : N + 1])  # the root (the first emitted token), then N greedy tokens
    parent = jnp.broadcast_to(jnp.maximum(jnp.arange(N + 1) - 1, 0), (B, N + 1)).astype(jnp.int32)
    depth = jnp.broadcast_to(jnp.arange(N + 1), (B, N + 1)).astype(jnp.int32)

    @jax.jit
    def accepted(target, tokens, lens, kept):
        _, cache, _ = prefill(target, CFG, tokens, lens, M.init_cache(CFG, B, cache_len, target["embed"].dtype))
        tree = Tree(chain, parent, depth, ancestor_mask(parent, N), jnp.arange(N + 1)[None] <= kept[:, None])
        return verify_pruned(target, CFG, (), 1, Sampling(), N, tree, cache, jax.random.PRNGKey(0), sizes)[1]

    for v in range(N + 1):
        kept = np.asarray([v, (5 * v) % (N + 1), (3 * v + 7) % (N + 1)])
        got = accepted(target, jnp.asarray(tokens), jnp.asarray(lens), jnp.asarray(kept))
        np.testing.assert_array_equal(np.asarray(got), kept, err_msg=f"kept {kept}")


@struct.dataclass
class CapsState:
    rounds: jax.Array  # [B]
    caps: jax.Array  # [B] the depth each row keeps this round
    observed: jax.Array  # [B] draft distributions the policy saw: one per level that ran


@dataclasses.dataclass(frozen=True)
class RowCaps(Policy):
    """A cutting policy that keeps each row's tree to its own depth (state.caps) and counts the
    levels that ran (level 1 always, a skipped level never calls observe)."""

    name = "row_caps"

    def init(self, batch, key):
        zeros = jnp.zeros((batch,), jnp.int32)
        return CapsState(rounds=zeros, caps=zeros + self._required_k_max(), observed=zeros)

    def round_limit(self, state, k_max, features=None):
        return state.caps

    def observe(self, state, step, draft_logits, draft_token=None):
        return state.replace(observed=state.observed + 1), jnp.zeros(state.caps.shape, bool)


# 20 nodes: more than the 12 candidates within depth 2, fewer than the 21 within depth 3 (a row capped at 2
# keeps all of its candidates, one capped at 3 the best 20 of its)
WIDE = TreeConfig(top_k=3, depth=4, num_nodes=20, verify_sizes=(3, 12))


def test_levels_run_exactly_when_some_row_keeps_them(target):
    """Level skipping (TreeConfig.skip_levels) on rows with different depth caps: a level runs
    exactly when some row keeps it (the policy sees max(caps) levels), a row gets no candidate past
    its own cap (none among its valid nodes, none taking a kept node's place), and the kept tree
    is the one drafted with every level run."""
    drafter, dparams = _drafters(target)["eagle3"]
    tokens, lens, cache_len = pack_prompts(CFG, _prompts(4), 8, WIDE.num_nodes + 1)
    policy = RowCaps(k_max=WIDE.depth)

    @functools.partial(jax.jit, static_argnames="skip")
    def drafted(target, dparams, tokens, lens, caps, skip):
        tc = dataclasses.replace(WIDE, skip_levels=skip)
        state = start_spec(target, CFG, drafter, dparams, policy, None, tc.depth, 8, cache_len, Sampling(), 1,
                           tokens, lens, jax.random.PRNGKey(0))
        pstate, limit = policy.start_round(state.pstate.replace(caps=caps), tc.depth)
        tree, pstate, _ = draft_tree(drafter, dparams, target, CFG, state.dstate, state.last, tc, policy, pstate, limit)
        return tree, pstate.observed

    args = (target, dparams, jnp.asarray(tokens), jnp.asarray(lens))
    for caps in ((1, 1, 1), (1, 3, 2), (2, 1, 4), (4, 4, 4), (1, 1, 2)):
        (tree, observed), (whole, _) = (drafted(*args, jnp.asarray(caps, jnp.int32), skip) for skip in (True, False))
        assert np.asarray(observed).tolist() == [max(caps)] * 3, (caps, observed)
        valid, depth = np.asarray(tree.valid), np.asarray(tree.depth)
        np.testing.assert_array_equal(valid, np.asarray(whole.valid))
        for field in ("tokens", "parent", "depth"):
            np.testing.assert_array_equal(np.where(valid, getattr(tree, field), -1), np.where(valid, getattr(whole, field), -1))
        for b, cap in enumerate(caps):
            assert depth[b][valid[b]].max() <= cap, (caps, b, depth[b][valid[b]])
            if cap < WIDE.depth:  # the best candidates within the cap fill the budget (here no drafted EOS cuts a branch)
                within = WIDE.top_k + (cap - 1) * WIDE.top_k**2
                assert valid[b, 1:].sum() == min(WIDE.num_nodes, within), (caps, b, valid[b].sum())


def test_auto_keeps_its_planned_tree_whole(target):
    """`auto` does not cut trees (Policy.cuts_trees): a round under an auto policy whose rows would
    limit the depth to 1 drafts and verifies the whole tree, as the static policy does."""
    drafter, dparams = _drafters(target)["eagle3"]
    tokens, lens, cache_len = pack_prompts(CFG, _prompts(2), 8, PRUNED.num_nodes + 1)
    timid = AutoPolicy(k_max=PRUNED.depth, alpha0=0.01, step_us=1000.0, first_us=0.0, verify_us=10.0)  # limit 1 per row
    assert not timid.cuts_trees and int(timid.round_limit(timid.init(2, None), PRUNED.depth).max()) == 1

    def drafted(policy):
        state = start_spec(target, CFG, drafter, dparams, policy, None, PRUNED.depth, 8, cache_len, Sampling(), 1,
                           jnp.asarray(tokens), jnp.asarray(lens), jax.random.PRNGKey(0))
        after = jax.jit(lambda s: tree_round(target, CFG, drafter, dparams, policy, PRUNED, 8, Sampling(), 1, s))(state)
        return np.asarray(after.drafted)

    np.testing.assert_array_equal(drafted(timid), drafted(make_policy("static", k_max=PRUNED.depth)))


@pytest.mark.parametrize("policy", [make_policy("confidence", threshold=1.01), make_policy("confidence", threshold=0.2)])
def test_pruned_tree_greedy_identical_to_ar(target, policy):
    drafter, dparams = _drafters(target)["eagle3"]
    prompts = _prompts(5)
    ar = generate(target, CFG, prompts, max_new_tokens=16)
    tr = generate(target, CFG, prompts, max_new_tokens=16,
                  speculative=SpeculativeConfig(drafter=drafter, drafter_params=dparams, tree=PRUNED, policy=policy))
    for b in range(len(prompts)):
        assert tr.row(b) == ar.row(b)
    assert int(tr.accepted.sum()) > 0
