"""EAGLE head + n-gram lookup in one tree ("eagle3+ngram", drafters.hybrid): greedy identity to AR
(static, a pruning policy, auto), the tree's shape, and the lossless law of sampled tokens by
chi-square (the machinery of test_lossless_sampling)."""

import dataclasses
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from flax import struct

from jspec import model as M
from jspec.decode import pack_prompts
from jspec.generate import SpeculativeConfig, generate
from jspec.sampling import Sampling
from jspec.speculative.drafters.hybrid import HybridDrafter
from jspec.speculative.engines.chain import start_spec
from jspec.speculative.engines.tree import TreeConfig, looks_up_first, tree_round, with_ngram_branch
from jspec.speculative.factory import build_drafter, check_drafter_spec
from jspec.speculative.drafters.base import DrafterError
from jspec.speculative.policies import make_policy
from jspec.speculative.policies.auto import REFERENCE_COSTS, hybrid_tokens, plan
from jspec.speculative.policies.base import count_rounds
from jspec.speculative.policies.static import StaticPolicy
from jspec.speculative.verify.tree import Tree, ancestor_mask
import spec_tiny
import test_lossless_sampling as L

TC = TreeConfig(top_k=3, depth=4, num_nodes=12, verify_sizes=(6,), ngram=3)
# an n-gram branch longer than the head's tree: rounds verify and emit paths of up to 6 tokens past the root
DEEP = TreeConfig(top_k=3, depth=2, num_nodes=6, verify_sizes=(4,), ngram=6)


def test_the_ngram_branch_comes_first_and_shifts_the_heads_nodes():
    # head tree: root -> 7 (node 1) -> 8 (node 2); n-gram branch 5, 6 (valid), 9 (past the history)
    parent = jnp.asarray([[0, 0, 1]])
    tree = Tree(jnp.asarray([[1, 7, 8]]), parent, jnp.asarray([[0, 1, 2]]), ancestor_mask(parent, 2), jnp.ones((1, 3), bool))
    cfg = spec_tiny.CFG
    out = with_ngram_branch(cfg, tree, jnp.asarray([[5, 6, 9]]), jnp.asarray([[True, True, False]]), 3)
    assert np.asarray(out.tokens).tolist() == [[1, 5, 6, 9, 7, 8]]
    assert np.asarray(out.parent).tolist() == [[0, 0, 1, 2, 0, 4]]
    assert np.asarray(out.depth).tolist() == [[0, 1, 2, 3, 1, 2]]
    assert np.asarray(out.valid).tolist() == [[True, True, True, False, True, True]]
    assert np.asarray(out.ancestors[0, 5]).tolist() == [True, False, False, False, True, True]


def test_hybrid_spec_and_plan():
    assert check_drafter_spec("eagle3+ngram") is HybridDrafter and check_drafter_spec("ngram:2+eagle") is HybridDrafter
    with pytest.raises(DrafterError, match="one EAGLE head and n-gram"):
        check_drafter_spec("eagle3+model")
    with pytest.raises(DrafterError, match=r"eagle3:runs/head\+ngram"):  # the head's path given to the n-gram half
        check_drafter_spec("eagle3+ngram:runs/head")
    # the expected tokens of the longer of two independent paths: a branch never lowers it
    assert hybrid_tokens(0.5, 4, 0.9, 0) == pytest.approx(1 + 0.5 + 0.25 + 0.125 + 0.0625)
    assert hybrid_tokens(0.5, 4, 0.9, 4) > hybrid_tokens(0.5, 4, 0.9, 2) > hybrid_tokens(0.5, 4, 0.9, 0)
    kw = dict(batch=1, drafter_name="eagle", parallel=False, tree=True, hybrid=True)
    assert plan({**REFERENCE_COSTS, "acceptance": {"ngram": 0.5}}, alpha=0.7, **kw).ngram > 0
    assert plan({**REFERENCE_COSTS, "acceptance": {"ngram": 0.0}}, alpha=0.6, **kw).ngram == 0
    # lookup far ahead of a weak head: the hybrid runs its n-gram half alone, as a chain
    alone = plan({**REFERENCE_COSTS, "acceptance": {"ngram": 0.95}}, alpha=0.3, **kw)
    assert (alone.mode, alone.drafter, alone.ngram) == ("chain", "ngram", 0) and alone.policy.alpha0 == 0.95


def test_auto_plans_lookup_first_at_batch_1_when_the_tree_beats_weak_lookup_rounds():
    from jspec.speculative.drafters.hybrid import MAX_NGRAM_BRANCH

    kw = dict(drafter_name="eagle", parallel=False, tree=True, hybrid=True, lookup_first=3)
    # a good head: rounds after a full match verify the n-gram branch alone, the others the tree
    # with a full branch; chosen over lookup alone even where lookup alone models higher
    for ngram_alpha in (0.4, 0.6):
        p = plan(REFERENCE_COSTS, batch=1, alpha=0.66, ngram_alpha=ngram_alpha, **kw)
        assert (p.mode, p.ngram, p.lookup_first) == ("tree", MAX_NGRAM_BRANCH, 3)
        assert p == plan(REFERENCE_COSTS, batch=1, alpha=0.66, ngram_alpha=ngram_alpha, **kw)  # deterministic
    assert plan(REFERENCE_COSTS, batch=1, alpha=0.66, ngram_alpha=0.6, **{**kw, "lookup_first": 0}).drafter == "ngram"
    # a batch skips the head only when every row matched: no lookup-first there
    assert plan(REFERENCE_COSTS, batch=16, alpha=0.66, ngram_alpha=0.6, **kw).lookup_first == 0
    # a head whose trees do no better than lookup's weak rounds: lookup alone
    weak = plan(REFERENCE_COSTS, batch=1, alpha=0.2, ngram_alpha=0.5, **kw)
    assert (weak.mode, weak.drafter, weak.lookup_first) == ("chain", "ngram", 0)
    # what each plan runs, in one line (jspec generate prints it, bench rows record it)
    assert weak.describe() == "chain K = 8, the n-gram half alone"
    first = plan(REFERENCE_COSTS, batch=1, alpha=0.66, ngram_alpha=0.4, **kw)
    assert first.describe().endswith(", lookup first after 3-gram matches") and "8-node n-gram branch" in first.describe()


def test_a_hybrid_at_batch_16_plans_its_heads_chain_and_runs_it(target):
    """Where a chain beats every tree (a tree's verify grows with the batch), the hybrid's `auto`
    plan is its head alone as a chain (AutoPlan.drafter "head"): the chain engine runs the EAGLE
    drafter, and the output is still the target's."""
    flat = {**REFERENCE_COSTS, "verify_us": {b: {**v, **{k: v["16"] * 3 for k in v if k.startswith("tree")}}
                                             for b, v in REFERENCE_COSTS["verify_us"].items()}}
    p = plan(flat, batch=16, drafter_name="eagle", parallel=False, tree=True, alpha=0.7, hybrid=True,
             ngram_alpha=0.3, lookup_first=3)
    assert (p.mode, p.drafter, p.lookup_first) == ("chain", "head", 0) and p.k_max >= 1
    drafter, dparams = spec_tiny._drafters(target)["eagle3"]
    prompts = spec_tiny._prompts(7)
    ar = generate(target, spec_tiny.CFG, prompts, max_new_tokens=16)
    out = generate(target, spec_tiny.CFG, prompts, max_new_tokens=16, speculative=SpeculativeConfig(
        drafter=HybridDrafter(drafter), drafter_params=dparams, tree=TreeConfig(top_k=3, depth=4, num_nodes=12), policy=p))
    for b in range(len(prompts)):
        assert out.row(b) == ar.row(b)
    assert out.draft_lengths.max() <= p.k_max  # a chain of at most K drafts, no tree nodes


def test_the_ngram_branch_may_be_longer_than_the_heads_tree():
    """The branch's length is bounded by MAX_NGRAM_BRANCH, not the depth: the verified path, the
    emitted tokens and the cache reserve grow to max(depth, ngram); the plan searches 0..8 whatever
    the depth, and the expected tokens count the branch's levels past the head's."""
    from jspec.speculative.drafters.hybrid import MAX_NGRAM_BRANCH

    assert DEEP.path_depth == 6 and DEEP.total_nodes == 12 and DEEP.cache_slots == 13
    assert TreeConfig(depth=2, num_nodes=15, ngram=8).cache_slots == 24 and TC.path_depth == TC.depth
    with pytest.raises(ValueError, match=f"ngram .* must be in \\[0, {MAX_NGRAM_BRANCH}\\]"):
        TreeConfig(depth=2, num_nodes=15, ngram=MAX_NGRAM_BRANCH + 1)
    assert hybrid_tokens(0.5, 2, 0.8, 6) == pytest.approx(1 + (1 - 0.5 * 0.2) + (1 - 0.75 * 0.36) + sum(0.8 ** j for j in range(3, 7)))
    assert hybrid_tokens(0.5, 2, 0.8, 6) > hybrid_tokens(0.5, 2, 0.8, 2)
    p = plan(REFERENCE_COSTS, batch=1, drafter_name="eagle", parallel=False, tree=True, alpha=0.66, hybrid=True,
             tree_depth=2, ngram_alpha=0.44)
    assert p.mode == "tree" and p.k_max == 2 and p.ngram > 2
    assert plan(REFERENCE_COSTS, batch=1, drafter_name="eagle", parallel=False, tree=True, alpha=0.66, hybrid=True,
                tree_depth=2, ngram_alpha=0.0).ngram == 0


@pytest.fixture(scope="module")
def target():
    return spec_tiny.make_target()


@pytest.mark.parametrize("policy", ["static", make_policy("confidence", threshold=0.4), "auto"])
def test_hybrid_tree_greedy_identical_to_ar(target, policy):
    drafter, dparams = spec_tiny._drafters(target)["eagle3"]
    hybrid = HybridDrafter(drafter)
    prompts = spec_tiny._prompts(7)
    ar = generate(target, spec_tiny.CFG, prompts, max_new_tokens=16)
    tree = TC if policy != "auto" else TreeConfig(top_k=3, depth=4, num_nodes=12)
    out = generate(target, spec_tiny.CFG, prompts, max_new_tokens=16,
                   speculative=SpeculativeConfig(drafter=hybrid, drafter_params=dparams, tree=tree, policy=policy))
    for b in range(len(prompts)):
        assert out.row(b) == ar.row(b)
    if policy == "static":  # the n-gram branch is drafted: more nodes per call than the head keeps
        calls = out.draft_lengths[:, 1:] > 0
        assert out.draft_lengths[:, 1:][calls].max() > TC.num_nodes


def test_a_hybrid_planned_as_lookup_alone_runs_its_ngram_chain(target):
    """`auto` may give a hybrid none of its head's tree: the call runs the n-gram half as a chain,
    and its output is still the target's."""
    drafter, dparams = spec_tiny._drafters(target)["eagle3"]
    hybrid = HybridDrafter(drafter)
    lookup = plan(REFERENCE_COSTS, batch=1, drafter_name="eagle", parallel=False, tree=True, alpha=0.3, hybrid=True,
                  ngram_alpha=0.95)
    assert (lookup.mode, lookup.drafter) == ("chain", "ngram")
    prompts = spec_tiny._prompts(3)
    ar = generate(target, spec_tiny.CFG, prompts, max_new_tokens=16)
    out = generate(target, spec_tiny.CFG, prompts, max_new_tokens=16,
                   speculative=SpeculativeConfig(drafter=hybrid, drafter_params=dparams, tree=TreeConfig(top_k=3, depth=4, num_nodes=12),
                                                 policy=lookup))
    for b in range(len(prompts)):
        assert out.row(b) == ar.row(b)
    assert out.draft_lengths.max() <= lookup.k_max  # a chain of at most K drafts, no tree nodes


def successor_cycles():
    """The cycles `cycling_target` follows: spec_tiny's non-EOS tokens in a fixed random order, 8 at
    a time (7 in the last)."""
    cfg = spec_tiny.CFG
    order = np.random.RandomState(0).permutation([t for t in range(cfg.vocab_size) if t not in cfg.eos_token_ids])
    return [order[c:c + 8] for c in range(0, len(order), 8)]


def cycling_target():
    """spec_tiny's target shape with weak layers and an LM head that scores each token's successor
    in fixed cycles of 8 tokens (7 for the last) by the last token's embedding: greedy text mostly
    cycles, with periods long enough for prompt lookup to draft DEEP's whole branch, and the layers
    still move some rows off a cycle (the context, and so the cache, matters)."""
    cfg = spec_tiny.CFG
    params = M.init_params(cfg, jax.random.PRNGKey(0), scale=0.35)
    params["layers"] = {k: 0.3 * w if w.ndim == 3 else w for k, w in params["layers"].items()}  # the embedding dominates
    successor = np.arange(cfg.vocab_size)
    for cycle in successor_cycles():
        successor[cycle] = np.roll(cycle, -1)
    unit = params["embed"] / jnp.linalg.norm(params["embed"], axis=-1, keepdims=True)
    return {**params, "lm_head": 20.0 * unit[np.argsort(successor)].T}


@pytest.mark.parametrize("which, policy", [("cycling", "static"), ("cycling", make_policy("confidence", threshold=0.4)),
                                           ("random", "static")])
def test_a_branch_deeper_than_the_tree_is_greedy_identical_to_ar(target, which, policy):
    """ngram > depth: rounds accept paths longer than the head's tree (more tokens per call than
    depth + 1, on text that repeats itself), and the output is plain greedy decoding's."""
    params = cycling_target() if which == "cycling" else target
    drafter, dparams = spec_tiny._drafters(params)["eagle3"]
    prompts = spec_tiny._prompts(7) + spec_tiny._prompts(3)
    ar = generate(params, spec_tiny.CFG, prompts, max_new_tokens=32)
    out = generate(params, spec_tiny.CFG, prompts, max_new_tokens=32, speculative=SpeculativeConfig(
        drafter=HybridDrafter(drafter), drafter_params=dparams, tree=DEEP, policy=policy))
    for b in range(len(prompts)):
        assert out.row(b) == ar.row(b)
    if which == "cycling":
        assert out.step_tokens[:, 1:].max() == DEEP.ngram + 1


@pytest.mark.parametrize("which, policy", [("cycling", "static"), ("cycling", make_policy("confidence", threshold=0.4)),
                                           ("random", "static")])
def test_lookup_first_rounds_skip_the_head_and_stay_greedy_identical_to_ar(target, which, policy):
    """TreeConfig.lookup_first: a round whose every row matched an n-gram of that order verifies the
    n-gram branch alone (at most `ngram` draft nodes, none of the head's); the output is still
    plain greedy decoding's, on text that repeats itself (lookup rounds) and on text that does not."""
    params = cycling_target() if which == "cycling" else target
    drafter, dparams = spec_tiny._drafters(params)["eagle3"]
    prompts = spec_tiny._prompts(7) + spec_tiny._prompts(3)
    ar = generate(params, spec_tiny.CFG, prompts, max_new_tokens=32)
    tree = dataclasses.replace(DEEP, lookup_first=2)
    out = generate(params, spec_tiny.CFG, prompts, max_new_tokens=32, speculative=SpeculativeConfig(
        drafter=HybridDrafter(drafter), drafter_params=dparams, tree=tree, policy=policy))
    for b in range(len(prompts)):
        assert out.row(b) == ar.row(b)
    if which == "cycling":
        nodes = out.draft_lengths[:, 1:][out.draft_lengths[:, 1:] > 0]
        assert (nodes <= tree.ngram).any() and (nodes > tree.ngram).any()  # lookup rounds and head rounds
        assert out.step_tokens[:, 1:].max() == tree.ngram + 1


def test_a_round_looks_up_first_exactly_when_every_running_row_matched_the_order():
    """The lookup-first rule over batches whose rows differ: every (order, done) combination of
    three rows against the rule as the docs state it (all running rows matched at least
    lookup_first; finished rows do not count; a batch with none running looks up)."""
    orders, dones = [], []
    for order in itertools.product(range(4), repeat=3):
        for done in itertools.product((False, True), repeat=3):
            orders.append(order)
            dones.append(done)
    for lookup_first in (1, 2, 3):
        got = jax.vmap(looks_up_first, in_axes=(0, 0, None))(jnp.asarray(orders), jnp.asarray(dones), lookup_first)
        want = [all(o >= lookup_first or d for o, d in zip(order, done)) for order, done in zip(orders, dones)]
        assert np.asarray(got).tolist() == want


@struct.dataclass
class LastUpdate:
    rounds: jax.Array  # [B] rounds the policy was updated for
    drafted: jax.Array  # [B] n_drafted of the last update (-1: none, or the row was inactive)
    accepted: jax.Array  # [B] n_accepted of the last update


@dataclasses.dataclass(frozen=True)
class RecordsUpdates(StaticPolicy):
    """The static policy, recording what its update receives."""

    name = "records_updates"

    def init(self, batch, key):
        none = jnp.full((batch,), -1, jnp.int32)
        return LastUpdate(rounds=jnp.zeros((batch,), jnp.int32), drafted=none, accepted=none)

    def update(self, state, n_drafted, n_accepted, active):
        return LastUpdate(rounds=count_rounds(state.rounds, active), drafted=jnp.where(active, n_drafted, -1),
                          accepted=jnp.where(active, n_accepted, -1))


def test_hybrid_rounds_run_the_lookup_rule_and_give_the_policy_counts_within_the_heads_depth():
    """One hybrid round (head depth 2, a 6-node n-gram branch, lookup_first 2) on two rows that
    differ: row 0 repeats a cycle of the cycling target (a 3-gram match, its branch accepted past
    the head's depth), row 1 matches a 1-gram only. Both running: the head's tree runs for both
    rows, and the policy's update gets drafted = accepted capped at the head's depth (the branch
    past it counts as depth 2). Row 1 finished: the round verifies the n-gram chain alone, and the
    policy's state is left as it was (a lookup round drafted none of the head's levels)."""
    params = cycling_target()
    cfg = spec_tiny.CFG
    drafter, dparams = spec_tiny._drafters(params)["eagle3"]
    hybrid = HybridDrafter(drafter)
    tree = TreeConfig(top_k=3, depth=2, num_nodes=8, ngram=6, lookup_first=2)
    policy = RecordsUpdates(k_max=tree.depth)
    cycle = [int(t) for t in successor_cycles()[0]]
    tokens, lens, cache_len = pack_prompts(cfg, [cycle * 2 + cycle[:2], [40, 41, 7, 30, 22, 9, 17]], 16, tree.cache_slots)
    start = jax.jit(lambda p, dp, t, n: start_spec(p, cfg, hybrid, dp, policy, None, tree.depth, 16, cache_len, Sampling(),
                                                   1, t, n, jax.random.PRNGKey(0)))
    one_round = jax.jit(lambda p, dp, s: tree_round(p, cfg, hybrid, dp, policy, tree, 16, Sampling(), 1, s))
    state = start(params, dparams, jnp.asarray(tokens), jnp.asarray(lens))
    _, branch_valid, order = hybrid.ngram.propose_ordered(state.dstate.ngram, tree.ngram)
    assert np.asarray(order).tolist() == [3, 1] and np.asarray(branch_valid).all()  # both branches 6 deep

    after = one_round(params, dparams, state)  # row 1 short of the order: the head's tree, for both rows
    nodes, accepted = np.asarray(after.drafted - state.drafted), np.asarray(after.accepted - state.accepted)
    assert (nodes > tree.ngram).all(), nodes
    assert accepted[0] > tree.depth, accepted  # the branch accepted past the head's levels
    seen = after.pstate
    assert np.asarray(seen.rounds).tolist() == [1, 1]
    assert np.asarray(seen.drafted).tolist() == [tree.depth, tree.depth]  # 6-deep branches count as the head's 2
    assert np.asarray(seen.accepted).tolist() == np.minimum(accepted, tree.depth).tolist()

    finished = state.replace(done=jnp.asarray([False, True]))  # every running row matched: lookup alone
    after = one_round(params, dparams, finished)
    nodes = np.asarray(after.drafted - finished.drafted)
    assert 0 < nodes[0] <= tree.ngram and nodes[1] == 0, nodes
    assert int(after.accepted[0] - finished.accepted[0]) > 0
    for field in ("rounds", "drafted", "accepted"):
        np.testing.assert_array_equal(getattr(after.pstate, field), getattr(finished.pstate, field))


def test_generate_with_auto_at_batch_1_looks_up_first():
    """generate(policy="auto") with a hybrid tree and one row in flight: the plan looks up first,
    rounds of both kinds run, and the output is plain greedy decoding's."""
    params = cycling_target()
    drafter, dparams = spec_tiny._drafters(params)["eagle3"]
    prompts = spec_tiny._prompts(7)[:3]
    ar = generate(params, spec_tiny.CFG, prompts, max_new_tokens=32)
    out = generate(params, spec_tiny.CFG, prompts, max_new_tokens=32, batch_size=1, speculative=SpeculativeConfig(
        drafter=HybridDrafter(drafter), drafter_params=dparams, tree=TreeConfig(top_k=3, depth=4, num_nodes=12),
        policy="auto"))
    for b in range(len(prompts)):
        assert out.row(b) == ar.row(b)
    nodes = out.draft_lengths[:, 1:][out.draft_lengths[:, 1:] > 0]
    assert (nodes <= 8).any() and (nodes > 8).any()  # lookup rounds (the 8-node branch alone) and tree rounds


def test_lookup_first_needs_a_hybrid_and_a_reachable_order(target):
    drafter, dparams = spec_tiny._drafters(target)["eagle3"]
    with pytest.raises(ValueError, match="lookup_first .* must be >= 0"):
        TreeConfig(lookup_first=-1)
    prompts = spec_tiny._prompts(3)
    with pytest.raises(ValueError, match="use a hybrid drafter"):
        generate(target, spec_tiny.CFG, prompts, max_new_tokens=4, speculative=SpeculativeConfig(
            drafter=drafter, drafter_params=dparams, tree=dataclasses.replace(TC, ngram=0, lookup_first=2)))
    with pytest.raises(ValueError, match="above the n-gram drafter's longest match"):
        generate(target, spec_tiny.CFG, prompts, max_new_tokens=4, speculative=SpeculativeConfig(
            drafter=HybridDrafter(drafter), drafter_params=dparams, tree=dataclasses.replace(TC, lookup_first=4)))


def test_build_drafter_makes_a_hybrid(target):
    drafter, dparams = spec_tiny._drafters(target)["eagle3"]
    from jspec.checkpoint.eagle_format import save_eagle_head
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        save_eagle_head(d, drafter.head, dparams)
        built, _ = build_drafter(f"eagle3:{d}+ngram:2", spec_tiny.CFG, target)
    assert isinstance(built, HybridDrafter) and built.ngram.max_ngram == 2 and built.head == drafter.head


def prompt_cycling(tparams, weight: float = 2.0):
    """test_lossless_sampling's target with its LM head pulled toward a fixed successor of the last
    token, the next token of L.PROMPT read as a cycle (the other tokens in a second cycle): about
    0.8 of p on it, so the sampled text often continues the prompt and prompt lookup's drafts are
    accepted several tokens deep, and every token keeps some probability."""
    successor = np.arange(L.CFG.vocab_size)
    for cycle in (L.PROMPT, [t for t in range(L.CFG.vocab_size) if t not in L.PROMPT]):
        successor[cycle] = np.roll(cycle, -1)
    pull = tparams["embed"][np.argsort(successor)].T / tparams["final_norm"][:, None] / np.sqrt(L.CFG.hidden_size)
    return {**tparams, "lm_head": tparams["lm_head"] + weight * pull}


@pytest.mark.parametrize("depth, ngram, lookup_first", [(L.K, L.K, 0), (2, L.K + 2, 0), (2, L.K + 2, 1)])
def test_hybrid_sampling_follows_the_target_law(depth, ngram, lookup_first):
    """Every emitted position, stratified as in test_lossless_sampling, follows the target's law
    under the hybrid tree, with an n-gram branch as deep as the head's tree or deeper (on a target
    that continues its prompt, so the branch is accepted past the head's levels); the branch is
    drafted in most rounds."""
    tparams = L.make_target() if ngram <= depth else prompt_cycling(L.make_target())
    hc, hp = L.eagle_copy_head(tparams)
    from jspec.speculative.drafters.eagle import EagleDrafter

    drafter = HybridDrafter(EagleDrafter(hc))
    tree = TreeConfig(top_k=3, depth=depth, num_nodes=10, ngram=ngram, lookup_first=lookup_first)
    sampling = Sampling(temperature=1.0)
    # lookup rounds need every row of a batch to match: one row in flight at a time (a queue) has them
    res = generate(tparams, L.CFG, [L.PROMPT] * L.N, max_new_tokens=L.MAX_NEW, sampling=sampling, seed=4,
                   cache_len=L.CACHE_LEN + ngram, batch_size=1 if lookup_first else None, speculative=SpeculativeConfig(
                       drafter=drafter, drafter_params=L.noised(hp, jax.random.PRNGKey(3), L.NOISE), tree=tree))
    assert (res.lengths == L.MAX_NEW).all()
    calls = res.draft_lengths[:, 1:] > 0
    drafted = res.draft_lengths[:, 1:][calls]
    if lookup_first:  # lookup rounds (the n-gram branch alone) and head rounds both ran
        assert 0.1 < (drafted <= ngram).mean() < 0.9, (drafted <= ngram).mean()
    else:
        assert (drafted > tree.num_nodes).mean() > 0.5  # n-gram nodes drafted beside the head's
    seqs = np.concatenate([np.tile(L.PROMPT, (L.N, 1)), res.tokens], 1)
    p = np.asarray(L.teacher_forced_probs(tparams, jnp.asarray(seqs, jnp.int32), sampling))
    group = {"tokens": res.tokens, "probs": p, "offsets": L.round_offsets(res.step_tokens, L.MAX_NEW)}
    reached = np.bincount(group["offsets"].ravel(), minlength=L.K + 1) / L.N
    assert (reached[1:L.K + 1] > 0.2).all(), reached
    if ngram > depth:  # tokens accepted past the head's deepest level
        assert reached[depth + 1:].sum() > 0.05, reached
    for n in range(L.MAX_NEW):
        pval, df = L.group_pvalue(group, positions=[n])
        assert pval > L.PASS, f"position {n}: p = {pval:.2e} (df {df})"
    pval, df = L.group_pvalue(group)
    assert pval > L.PASS, f"all positions: p = {pval:.2e} (df {df})"


def test_bench_runs_hybrid_auto_trees_and_paper_constants(tmp_path, monkeypatch):
    import argparse
    import json

    from jspec import model as M
    from jspec.bench import cli
    from jspec.bench.round_cost import COST_TABLE_VERSION
    from jspec.checkpoint.eagle_format import save_eagle_head
    from jspec.config import ModelConfig
    from jspec.heads import eagle as H
    from jspec.speculative.policies.auto import cost_table_path
    from test_bench import CharTokenizer

    cfg = ModelConfig(arch="llama", vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=1,
                      num_heads=2, num_kv_heads=1, head_dim=16, max_position_embeddings=256, eos_token_ids=(3,))
    params = M.init_params(cfg, jax.random.PRNGKey(0))
    hcfg = H.default_head_config("eagle1", cfg)
    head = tmp_path / "head"
    save_eagle_head(str(head), hcfg, H.init_head(hcfg, jax.random.PRNGKey(1)))
    monkeypatch.setattr(cli, "resolve_model", lambda name: (cfg, params, CharTokenizer()))
    monkeypatch.setenv("JSPEC_CACHE", str(tmp_path / "cache"))
    path = cost_table_path("tiny", str(tmp_path / "models"))
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps({**REFERENCE_COSTS, "version": COST_TABLE_VERSION, "acceptance": {"ngram": 0.9}}))
    methods = f"ar,spec:eagle:{head}+ngram:auto:tree,spec:eagle:{head}:svip:paper"
    args = cli.add_bench_args(argparse.ArgumentParser()).parse_args(
        ["--model", "tiny", "--tasks", "longdoc", "--n-prompts", "2", "--max-new-tokens", "4", "--batch", "1",
         "--methods", methods, "--no-plots", "--models-dir", str(tmp_path / "models"), "--out", str(tmp_path / "results"),
         "--benchmarks-md", str(tmp_path / "B.md")])
    monkeypatch.chdir(tmp_path)
    rows = {r["name"]: r for r in cli.run_bench(args)}
    assert not (tmp_path / "jspec-results").exists()  # the test's rows go to its --out, not the repository
    hybrid = rows[f"spec:eagle:{head}+ngram:auto:tree"]
    assert hybrid["greedy_identical_to_ar"] == 1.0 and hybrid["policy_constants"] is None
    paper = rows[f"spec:eagle:{head}:svip:paper"]
    assert paper["policy"] == "svip" and paper["policy_constants"] == "paper" and paper["greedy_identical_to_ar"] == 1.0
    assert hybrid["auto_plan"].startswith(("tree depth", "chain K")) and paper["auto_plan"] is None
