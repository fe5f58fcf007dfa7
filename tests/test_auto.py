"""The `auto` policy: budgets from a round-cost table, AR fallback, greedy identity."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jspec import model as M
from jspec.generate import SpeculativeConfig, generate
from jspec.speculative.engines.tree import TreeConfig
from jspec.speculative.policies import make_policy
from jspec.speculative.policies.auto import (PLAN_TOLERANCE, REFERENCE_COSTS, ROW_SPREAD, SAMPLED_US, TREE_SIZES, AutoPolicy,
                                             CostModel, acceptance_at,
                                             plan, sampled_tree_reach)
from test_spec import CFG, _drafters, _prompts

# verify grows steeply with the block: speculation cannot pay
COSTLY = {"verify_us": {"1": {"1": 100, "2": 190, "8": 800, "tree16": 1600, "tree60": 6000}},
          "draft_step_us": {"1": 50}, "tree_level_us": {"1": 80}}


def test_plan_picks_a_budget_or_plain_decoding():
    p = plan(REFERENCE_COSTS, batch=1, drafter_name="eagle", parallel=False)
    assert p.mode == "chain" and 1 <= p.k_max <= 8 and p.gain > 1 and p.policy.k_max == p.k_max
    t = plan(REFERENCE_COSTS, batch=1, drafter_name="eagle", parallel=False, tree=True)
    assert t.mode == "tree" and t.num_nodes in TREE_SIZES
    for tree in (False, True):
        assert plan(COSTLY, batch=1, drafter_name="eagle", parallel=False, tree=tree).mode == "ar"
    # the n-gram drafter costs nothing per step, so only verify's growth limits K
    assert plan(REFERENCE_COSTS, batch=1, drafter_name="ngram", parallel=True).mode == "chain"


def test_near_ties_go_to_the_smaller_budget():
    """Gains within PLAN_TOLERANCE of the best count as ties and the smallest budget wins, so a
    re-measured table whose entries moved by a few percent plans the same. A chain at batch 1 is
    the exception: its K only caps the row's own per-round choice, so the largest near-tie wins."""
    flat = {"verify_us": {b: {"1": 1000, "4": 1000, "8": 1000} for b in ("1", "8")},
            "draft_step_us": {"1": 2.0, "8": 2.0}, "tree_level_us": {"1": 2.0, "8": 2.0}}
    for batch, smaller in ((8, True), (1, False)):
        gains = {k: plan(flat, batch=batch, drafter_name="eagle", parallel=False, alpha=0.6, k_cap=k).gain for k in range(1, 9)}
        best_k = max(gains, key=gains.get)
        p = plan(flat, batch=batch, drafter_name="eagle", parallel=False, alpha=0.6)
        assert (p.k_max < best_k if smaller else p.k_max >= best_k) and p.gain >= gains[best_k] * (1 - PLAN_TOLERANCE)
    jittered = {**flat, "verify_us": {b: {"1": 1000, "4": 1010, "8": 990} for b in ("1", "8")}}
    assert plan(jittered, batch=1, drafter_name="eagle", parallel=False, alpha=0.6).k_max == p.k_max


def test_one_bad_verify_timing_does_not_collapse_the_plan():
    """A block costs at most what a larger measured block cost: an H100 table timed on GPUs shared
    with another process had verify(T=4, 8) at twice verify(16), and planned a one-token chain."""
    clean = {"verify_us": {"1": {"1": 850, "2": 850, "4": 855, "8": 785, "16": 770, "tree16": 790, "tree60": 1010}},
             "draft_step_us": {"1": 77}, "draft_first_us": {"1": 30}, "tree_level_us": {"1": 80}}
    bad = {**clean, "verify_us": {"1": {**clean["verify_us"]["1"], "4": 1627, "8": 1769}}}
    for tree in (False, True):
        a, b = (plan(t, batch=1, drafter_name="eagle", parallel=False, alpha=0.65, tree=tree) for t in (clean, bad))
        # a chain's cap may move by one where the replaced entries sat at a near-tie's edge
        assert (a.mode, a.num_nodes) == (b.mode, b.num_nodes) and abs(a.k_max - b.k_max) <= (0 if tree else 1)
    assert plan(bad, batch=1, drafter_name="eagle", parallel=False, alpha=0.65).k_max >= 3
    # plain decoding's own step stays as measured, even where a 2-token block timed faster
    from jspec.speculative.policies.auto import CostModel
    assert CostModel(clean, 1).ar_step() == 850 and CostModel(bad, 1).verify(5) == 770


def test_larger_batches_plan_for_a_slow_row():
    # a batch runs until its slowest row is done: the planned gain falls with the batch size at
    # the same per-row costs, and a large enough spread of row acceptance means plain decoding
    flat = {"verify_us": {"1": {"1": 1000, "4": 1100, "8": 1200, "tree16": 1300, "tree60": 1600}},
            "draft_step_us": {"1": 80}, "tree_level_us": {"1": 100}}
    gains = [plan(flat, batch=b, drafter_name="eagle", parallel=False, alpha=0.5).gain for b in (1, 8, 32)]
    assert gains[0] > gains[1] > gains[2] > 1
    assert plan(flat, batch=1, drafter_name="eagle", parallel=False, alpha=0.5, row_spread=0.5).mode != "ar"
    assert plan(flat, batch=32, drafter_name="eagle", parallel=False, alpha=0.5, row_spread=0.5).mode == "ar"
    # n-gram acceptance varies more from prompt to prompt than a trained head's: its slow row is slower
    ngram, as_head = (plan(flat, batch=32, drafter_name="ngram", parallel=True, alpha=0.5, row_spread=s)
                      for s in (None, ROW_SPREAD["eagle"]))
    assert ROW_SPREAD["ngram"] > ROW_SPREAD["eagle"] and ngram.gain < as_head.gain


def test_long_contexts_make_drafting_cheaper_relative_to_a_step():
    """A table's context_us slopes (µs per 1k context tokens) join the costs of a call with long
    prompts: a verify block of up to 16 tokens reads the context once, as a one-token step does, so
    at long contexts n-gram drafting pays where the short-context table planned plain decoding."""
    from jspec.speculative.policies.auto import CostModel, mean_context

    table = {"verify_us": {"1": {"1": 1000, "2": 1250, "4": 1400, "8": 1600, "16": 2000}}, "draft_step_us": {"1": 50},
             "context_us": {"1": {"1": 600, "2": 600, "4": 600, "8": 620, "16": 650, "draft": 20}}, "context_base": 192}
    short, long = CostModel(table, 1, 192), CostModel(table, 1, 2192)
    assert short.verify(8) == 1600 and long.verify(8) == pytest.approx(1600 + 2 * 620)
    assert long.draft_step() == pytest.approx(50 + 2 * 20) and CostModel(table, 1, None).verify(8) == 1600
    assert CostModel({k: v for k, v in table.items() if k != "context_us"}, 1, 5000).verify(1) == 1000  # no slopes
    kw = dict(batch=1, drafter_name="ngram", parallel=True, alpha=0.25, row_spread=0.0)
    assert plan(table, **kw).mode == "ar"
    assert plan(table, context=8000, **kw).mode == "chain"
    assert mean_context([100, 300], 256) == 328.0


def test_context_slopes_are_measured_and_merged_into_a_table(target):
    from jspec.bench.round_cost import measure_context_costs

    drafter, dparams = _drafters(target)["eagle3"]
    costs = {"verify_us": {"1": {"1": 1.0}}}
    measure_context_costs(costs, target, CFG, drafter, dparams, batch=1, context=320, Ts=(1, 4), n=2, reps=1,
                          max_new=8, tree=TreeConfig(top_k=2, depth=2, num_nodes=4))
    row = costs["context_us"]["1"]
    assert set(row) == {"1", "4", "tree5", "draft", "tree_level"} and all(v >= 0 for v in row.values())
    assert costs["context_base"] == 192 and costs["verify_us"] == {"1": {"1": 1.0}}
    with pytest.raises(ValueError, match="more than the base"):
        measure_context_costs(costs, target, CFG, drafter, dparams, batch=1, context=100)


def test_round_limit_follows_acceptance():
    pol = AutoPolicy(k_max=8, alpha0=0.9, step_us=75, first_us=40, verify_us=1000)
    st = pol.init(2, jax.random.PRNGKey(0))
    st = st.replace(successes=jnp.asarray([0.2, 3.6], jnp.float32), trials=jnp.asarray([4.0, 4.0], jnp.float32))
    lim = pol.round_limit(st, 8)
    assert int(lim[0]) == 1 and int(lim[1]) > 3
    st2 = pol.update(st, jnp.asarray([8, 8]), jnp.asarray([0, 8]), jnp.asarray([True, True]))
    assert float(st2.alpha[0]) < 0.05 and float(st2.alpha[1]) > 0.9
    assert make_policy("auto", k_max=4).k_max == 4


def test_the_per_row_estimator_discounts_once_a_round_and_weighs_the_prior_as_its_trials():
    """AutoPolicy's per-row sums on a hand-computed sequence (discount 1/2, prior 1/4 worth 8
    trials: dyadic, so float32 is exact). A round accepting n of k drafts adds n successes and
    n + 1 trials (n when all k were accepted), after the older sums were discounted once; a row
    inactive in a round keeps its sums."""
    pol = AutoPolicy(k_max=4, alpha0=0.25, discount=0.5, prior_trials=8.0)
    st = pol.init(2, jax.random.PRNGKey(0))
    sums = lambda st: (np.asarray(st.successes).tolist(), np.asarray(st.trials).tolist())  # noqa: E731
    assert sums(st) == ([2.0, 2.0], [8.0, 8.0]) and np.asarray(st.alpha).tolist() == [0.25, 0.25]
    rounds = [  # (drafted, accepted, active) -> (successes, trials) per row
        (([3, 4], [3, 1], [True, True]), ([2 / 2 + 3, 2 / 2 + 1], [8 / 2 + 3, 8 / 2 + 1 + 1])),  # [4, 2], [7, 6]
        (([4, 4], [0, 4], [True, False]), ([4 / 2 + 0, 2.0], [7 / 2 + 0 + 1, 6.0])),  # [2, 2], [4.5, 6]
        (([2, 4], [1, 4], [True, True]), ([2 / 2 + 1, 2 / 2 + 4], [4.5 / 2 + 1 + 1, 6 / 2 + 4])),  # [2, 5], [4.25, 7]
    ]
    for (drafted, accepted, active), want in rounds:
        st = pol.update(st, jnp.asarray(drafted), jnp.asarray(accepted), jnp.asarray(active))
        assert sums(st) == (list(want[0]), list(want[1]))
    assert np.asarray(st.rounds).tolist() == [3, 2]
    np.testing.assert_allclose(np.asarray(st.alpha), [2 / 4.25, 5 / 7], rtol=1e-6)


def test_the_per_row_estimator_is_its_closed_form():
    """After rounds i = 1..n with (k_i drafted, a_i accepted): successes = d^n alpha0 P + sum_i
    d^(n-i) a_i and trials = d^n P + sum_i d^(n-i) (a_i + [a_i < k_i]) (d the discount, P the
    prior's trials), on random rounds and constants."""
    rng = np.random.default_rng(1)
    for _ in range(3):
        d, alpha0, prior = float(rng.uniform(0.5, 1.0)), float(rng.uniform(0.1, 0.9)), float(rng.uniform(1.0, 10.0))
        pol = AutoPolicy(k_max=6, alpha0=alpha0, discount=d, prior_trials=prior)
        k = rng.integers(1, 7, 12)
        a = np.minimum(rng.integers(0, 7, 12), k)
        st = pol.init(1, jax.random.PRNGKey(0))
        for ki, ai in zip(k, a):
            st = pol.update(st, jnp.asarray([ki]), jnp.asarray([ai]), jnp.asarray([True]))
        w = d ** np.arange(len(k) - 1, -1, -1)  # the weight of round i after the last
        n = len(k)
        np.testing.assert_allclose(float(st.successes[0]), d**n * alpha0 * prior + np.sum(w * a), rtol=1e-5)
        np.testing.assert_allclose(float(st.trials[0]), d**n * prior + np.sum(w * (a + (a < k))), rtol=1e-5)


def test_acceptance_estimate_is_unbiased_on_geometric_rounds():
    """Rounds of K = 6 drafts whose tokens are each accepted with probability 0.65 (the accepted
    prefix is geometric, cut at K): the discounted success / trial sums estimate 0.65, where a
    smoothed mean of each round's own ratio n / (n + 1), the estimator before, sits near 0.44."""
    rng = np.random.default_rng(0)
    true_alpha, K, rounds, rows = 0.65, 6, 400, 64
    accepted_each = rng.random((rounds, rows, K)) < true_alpha
    n_acc = np.argmin(np.concatenate([accepted_each, np.zeros((rounds, rows, 1), bool)], 2), axis=2)  # first rejection
    pol = AutoPolicy(k_max=K, alpha0=0.45)
    st = pol.init(rows, jax.random.PRNGKey(0))
    update = jax.jit(pol.update)
    old = np.full(rows, 0.45)
    drafted, active = jnp.full((rows,), K), jnp.ones((rows,), bool)
    for r in range(rounds):
        st = update(st, drafted, jnp.asarray(n_acc[r]), active)
        rejected = n_acc[r] < K
        old = 0.7 * old + 0.3 * n_acc[r] / np.maximum(n_acc[r] + rejected, 1)  # the old smoothed per-round ratio
    assert abs(float(np.mean(st.alpha)) - true_alpha) < 0.02
    assert float(np.mean(old)) < 0.5


def test_plan_is_deterministic_for_a_fixed_table():
    table = json.loads(json.dumps(REFERENCE_COSTS))  # a copy, as read from a committed file
    for kw in (dict(tree=False), dict(tree=True), dict(tree=False, drafter_name="ngram", parallel=True)):
        kw = {"drafter_name": "eagle", "parallel": False, **kw}
        plans = [plan(table, batch=b, **kw) for b in (1, 16) for _ in range(3)]
        assert plans[0] == plans[1] == plans[2] and plans[3] == plans[4] == plans[5]
        assert plans[0].mode != "ar"


def test_a_noisy_on_the_fly_table_falls_back_to_the_nearest_trusted_one(tmp_path, monkeypatch):
    """A batch measured with a large spread is replaced by the nearest trusted batch of the same
    table, scaled by its own AR step; the spread and the source are recorded."""
    from jspec.bench import round_cost as RC

    (tmp_path / "tiny").mkdir()
    trusted = {"version": RC.COST_TABLE_VERSION, "card": "x", "spread": {"8": 0.02},
               "verify_us": {"8": {"1": 1000.0, "8": 1200.0}}, "draft_step_us": {"8": 100.0}}
    RC.save_card_costs(trusted, RC.cost_table_path("tiny", str(tmp_path)))

    def noisy_measure(costs, *args, batch, reps, **kw):
        assert reps == RC.ROBUST_REPS
        b = str(batch)
        costs["verify_us"][b] = {"1": 500.0, "8": 9000.0}  # one bad timing
        costs["draft_step_us"][b] = 400.0
        costs["spread"][b], costs.setdefault("source", {})[b] = 0.8, "measured"
        return costs

    monkeypatch.setattr(RC, "measure_batch_costs", noisy_measure)
    drafter = type("D", (), {"parallel": False})()
    costs = RC.ensure_costs(None, None, drafter, None, batch=1, preset="tiny", models_dir=str(tmp_path), tree=False)
    assert costs["verify_us"]["1"] == {"1": 500.0, "8": 600.0} and costs["draft_step_us"]["1"] == 50.0
    assert costs["spread"]["1"] == 0.8 and "batch 8" in costs["source"]["1"]
    assert plan(costs, batch=1, drafter_name="eagle", parallel=False).mode == "chain"


@pytest.fixture(scope="module")
def target():
    return M.init_params(CFG, jax.random.PRNGKey(0), scale=0.35)


@pytest.mark.parametrize("tree", [None, TreeConfig(top_k=3, depth=4, num_nodes=12)])
def test_auto_greedy_identical_to_ar(target, tree):
    drafter, dparams = _drafters(target)["eagle3"]
    prompts = _prompts(3)
    ar = generate(target, CFG, prompts, max_new_tokens=12)
    costs = {**REFERENCE_COSTS, "verify_us": {"1": {"1": 1000, "8": 1050, "tree16": 1100, "tree60": 1400}}}
    p = plan(costs, batch=len(prompts), drafter_name="eagle", parallel=False, tree=tree is not None,
             tree_top_k=3, tree_depth=4, alpha=0.8)
    assert p.mode != "ar"
    out = generate(target, CFG, prompts, max_new_tokens=12,
                   speculative=SpeculativeConfig(drafter=drafter, drafter_params=dparams, policy=p, tree=tree))
    for b in range(len(prompts)):
        assert out.row(b) == ar.row(b)
    assert int(out.drafted.sum()) > 0
    slow = plan(COSTLY, batch=len(prompts), drafter_name="eagle", parallel=False)
    out = generate(target, CFG, prompts, max_new_tokens=12,
                   speculative=SpeculativeConfig(drafter=drafter, drafter_params=dparams, policy=slow))
    assert int(out.drafted.sum()) == 0 and all(out.row(b) == ar.row(b) for b in range(len(prompts)))


def test_bench_cli_auto_rows_carry_round_costs(tmp_path, monkeypatch):
    import argparse
    import json

    from jspec.bench import cli
    from jspec.config import ModelConfig
    from test_bench import CharTokenizer

    cfg = ModelConfig(arch="llama", vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=1,
                      num_heads=2, num_kv_heads=1, head_dim=16, max_position_embeddings=256, eos_token_ids=(3,))
    params = M.init_params(cfg, jax.random.PRNGKey(0))
    monkeypatch.setattr(cli, "resolve_model", lambda name: (cfg, params, CharTokenizer()))
    monkeypatch.setenv("JSPEC_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(cli, "VERIFY_TS", (1, 2))
    # a cached table for this card: the bench reads it instead of measuring
    from jspec.speculative.policies.auto import cost_table_path
    path = cost_table_path("tiny", str(tmp_path / "models"))
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps({"verify_us": {"1": {"1": 100.0, "2": 101.0, "8": 110.0}}}))
    args = cli.add_bench_args(argparse.ArgumentParser()).parse_args(
        ["--model", "tiny", "--tasks", "mt_bench", "--n-prompts", "2", "--max-new-tokens", "4", "--batch", "1",
         "--methods", "ar,spec:ngram:auto", "--round-cost", "1", "--no-plots",
         "--models-dir", str(tmp_path / "models"), "--out", str(tmp_path / "results")])
    rows = cli.run_bench(args)
    spec = [r for r in rows if r["method"] == "spec"][0]
    assert spec["policy"] == "auto"
    assert "plan" in spec["round_cost"] or (spec["round_us"] > 0 and spec["verify_us"]["1"] > 0)
    assert spec["round_cost"]["verify_us"]["2"] > 0 and "round_us" in spec  # ngram plan: a chain


def test_round_cost_profiles_a_learned_policy_with_its_weights(target):
    """The bench's round-cost profile passes a policy's weights (LDLP's predictor) to its start."""
    from jspec.bench.round_cost import profile_method
    from jspec.speculative.policies.ldlp import init_ldlp

    drafter, dparams = _drafters(target)["eagle3"]
    weights = init_ldlp(CFG.hidden_size, jax.random.key(0), hidden=8)
    prof = profile_method(target, CFG, drafter, dparams, batch=1, policy=make_policy("ldlp", k_max=3), k_max=3,
                          prompt_len=8, max_new=8, n=2, verify_ts=(1,), policy_params=weights)
    # a differential timing: on a busy CPU the per-step difference can come out negative
    assert prof["round_us"] > 0 and "draft_step_us" in prof and "policy_us" in prof


def test_a_heads_measured_acceptance_sets_the_budget(target):
    """auto's static budget reads the head's own acceptance (EagleDrafter.acceptance) when it has one."""
    import dataclasses

    from jspec.speculative.policies.auto import auto_budget, plan_for

    drafter, _ = _drafters(target)["eagle3"]

    def budget(d):
        return auto_budget(plan_for(d, REFERENCE_COSTS, batch=1, k_cap=8, tree=None), d, 8, None)

    poor = budget(dataclasses.replace(drafter, acceptance=0.02))
    good = budget(dataclasses.replace(drafter, acceptance=0.9))
    assert poor[0] is None  # plain decoding is expected to be faster
    assert good[0] is not None and good[2] >= 4


def test_cost_tables_of_another_version_are_measured_anew(tmp_path, monkeypatch):
    """A table measured under older jspec code (rounds got cheaper since) is not trusted: ensure_costs
    measures the batch again into the user's cache, and the committed file is left as it was."""
    from jspec.bench import round_cost as RC
    from jspec.speculative.policies.auto import cost_table_path

    (tmp_path / "tiny").mkdir()
    path = cost_table_path("tiny", str(tmp_path))
    old = {"card": "x", "verify_us": {"1": {"1": 5.0}, "8": {"1": 9.0}}}  # no version: before versions
    path.write_text(__import__("json").dumps(old))
    measured = []

    def fake_measure(costs, *args, batch, **kw):
        measured.append(batch)
        costs["version"] = RC.COST_TABLE_VERSION
        costs.setdefault("verify_us", {})[str(batch)] = {"1": 1.0}
        return costs

    monkeypatch.setattr(RC, "measure_batch_costs", fake_measure)
    costs = RC.ensure_costs(None, None, None, None, batch=1, preset="tiny", models_dir=str(tmp_path), tree=False)
    assert measured == [1] and costs["verify_us"] == {"1": {"1": 1.0}}
    assert RC.load_card_costs(path) == old  # a user's run never writes into the repository
    cached = cost_table_path("tiny", str(tmp_path), committed=False)
    assert cached.parent == tmp_path / "cache"
    assert RC.load_card_costs(cached) == {"version": RC.COST_TABLE_VERSION, "verify_us": {"1": {"1": 1.0}}}
    RC.ensure_costs(None, None, None, None, batch=1, preset="tiny", models_dir=str(tmp_path), tree=False)
    assert measured == [1]  # current version, batch present: read from the cache


def test_load_costs_skips_tables_of_another_version(tmp_path, monkeypatch):
    """A committed or cached table measured under another COST_TABLE_VERSION is never planned on:
    the next place is read, and without one the reference table."""
    from jspec.speculative.policies import auto as A

    monkeypatch.setenv("JSPEC_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(A, "card_key", lambda: "TEST_CARD")
    (tmp_path / "m" / "p").mkdir(parents=True)
    committed = tmp_path / "m" / "p" / "round_cost_TEST_CARD.json"
    committed.write_text(json.dumps({"card": "old", "verify_us": {"8": {"1": 5.0}}}))  # no version: an old jspec's
    assert A.load_costs("p", models_dir=str(tmp_path / "m")) is A.REFERENCE_COSTS
    cached = A.cost_table_path("p", str(tmp_path / "m"), committed=False)
    cached.parent.mkdir(parents=True)
    cached.write_text(json.dumps({"version": A.COST_TABLE_VERSION, "card": "new", "verify_us": {"1": {"1": 9.0}}}))
    assert A.load_costs("p", models_dir=str(tmp_path / "m"))["card"] == "new"


def _lookup_rounds_on_device(prompt, draft, max_ngram, min_ngram):
    """replay_lookup's rounds, each proposed by the drafter itself (NgramDrafter.propose on the
    history so far): (accepted drafts, trials, rounds)."""
    from jspec.speculative.drafters.ngram import NgramDrafter, NgramState

    drafter = NgramDrafter(max_ngram=max_ngram, min_ngram=min_ngram)
    hist = jnp.asarray([prompt], jnp.int32)
    accepted = trials = rounds = t = 0
    while t + draft < len(prompt):
        tokens, valid = drafter.propose(NgramState(history=hist, length=jnp.asarray([t + 1])), None, draft)
        right = np.asarray(valid[0]) & (np.asarray(tokens[0]) == np.asarray(prompt[t + 1: t + 1 + draft]))
        n = int(np.argmin(np.append(right, False)))
        accepted, trials, rounds, t = accepted + n, trials + n + (n < draft), rounds + 1, t + n + 1
    return accepted, trials, rounds


def test_replaying_the_ngram_rule_over_prompts_matches_the_drafter():
    """replay_lookup (host numpy) scores each round as the device drafter's own proposal would be."""
    from jspec.speculative.drafters.ngram import replay_lookup

    rng = np.random.default_rng(0)
    phrase = list(rng.integers(5, 40, 12))
    prompts = [list(rng.integers(5, 40, 20)) + phrase + list(rng.integers(5, 40, 6)) + phrase[:9] + [7, 7, 7, 7, 7],
               list(rng.integers(5, 12, 30)), [9], []]
    for draft, max_ngram, min_ngram in ((4, 3, 1), (3, 2, 2)):
        got = replay_lookup(prompts, draft, max_ngram, min_ngram)
        want = [_lookup_rounds_on_device(p, draft, max_ngram, min_ngram) if p else (0, 0, 0) for p in prompts]
        assert got.tolist() == [list(map(float, w)) for w in want]
    assert got[0, 0] > 0 and got[2].tolist() == [0, 0, 0]


def test_ngram_acceptance_is_estimated_from_the_prompts():
    """Prompts that repeat themselves plan n-gram lookup above its prior, prompts that never do
    below it; fewer replayed rounds stay nearer the prior; no prompts, or no estimate, plan the prior."""
    import dataclasses

    from jspec.speculative.drafters.hybrid import HybridDrafter
    from jspec.speculative.drafters.ngram import NgramDrafter
    from jspec.speculative.policies.auto import (ACCEPTANCE_PRIOR, ACCEPTANCE_STEP, NGRAM_ESTIMATE, ngram_acceptance,
                                                   plan_for)

    prior = ACCEPTANCE_PRIOR["ngram"]
    rng = np.random.default_rng(1)
    phrase = list(rng.integers(5, 60, 40))
    copying = [list(rng.integers(5, 60, 30)) + phrase * 4 for _ in range(4)]
    fresh = [list(rng.permutation(np.arange(5, 200))[:150]) for _ in range(4)]
    high, low = ngram_acceptance(copying, prior), ngram_acceptance(fresh, prior)
    assert NGRAM_ESTIMATE.low <= low < prior < high <= NGRAM_ESTIMATE.high
    assert low < ngram_acceptance(fresh[:1], prior) < prior  # shrunk toward the prior: one prompt moves less
    assert ngram_acceptance([], prior) == prior and ngram_acceptance([[4, 4]], prior) == prior  # nothing replayed
    assert ngram_acceptance(copying, prior, dataclasses.replace(NGRAM_ESTIMATE, high=0.5)) == 0.5
    ngram = NgramDrafter()
    plans = {name: plan_for(ngram, REFERENCE_COSTS, batch=1, k_cap=8, tree=None, prompts=p)
             for name, p in (("copying", copying), ("fresh", fresh), ("none", None))}
    # the policy carries the estimate on a coarse grid (it is part of the compiled program)
    grid = dict(abs=ACCEPTANCE_STEP / 2 + 1e-9)
    assert plans["copying"].gain > plans["none"].gain and plans["copying"].policy.alpha0 == pytest.approx(high, **grid)
    assert plans["fresh"].policy.alpha0 == pytest.approx(low, **grid)
    assert plans["none"].policy.alpha0 == pytest.approx(prior, **grid)
    assert plan_for(ngram, REFERENCE_COSTS, batch=1, k_cap=8, tree=None, prompts=copying, ngram_estimate=None) == plans["none"]
    # a hybrid's n-gram branch: the estimate of its own lookup rule; its head's acceptance is untouched
    drafter, _ = _drafters(M.init_params(CFG, jax.random.PRNGKey(0)))["eagle3"]
    hybrid = HybridDrafter(dataclasses.replace(drafter, acceptance=0.6))
    tree = TreeConfig(top_k=10, depth=6, num_nodes=59)
    branch = [plan_for(hybrid, REFERENCE_COSTS, batch=1, k_cap=8, tree=tree, prompts=p) for p in (copying, fresh)]
    # copying prompts: lookup alone models far above the head's tree (at the estimate), so the
    # batch-1 plan looks up first with a full branch; fresh ones: the tree, which looks up first too
    assert (branch[0].mode, branch[0].ngram, branch[0].lookup_first) == ("tree", 8, hybrid.ngram.max_ngram)
    assert branch[0].gain > branch[1].gain
    assert branch[1].mode == "tree" and branch[1].policy.alpha0 == 0.6


def test_a_hybrid_branch_pays_its_own_round_cost():
    """The n-gram branch's lookup and commits cost a round more than its verify block: priced, a
    hybrid whose branch adds little plans the head's tree alone; a table may price it itself."""
    from jspec.speculative.policies.auto import HYBRID_BRANCH_US

    flat = {"verify_us": {"1": {"1": 1000, "8": 1010, "tree16": 1020, "tree32": 1040, "tree48": 1060, "tree60": 1100}},
            "draft_step_us": {"1": 40}, "draft_first_us": {"1": 20}, "tree_level_us": {"1": 40}}
    kw = dict(batch=1, drafter_name="eagle", parallel=False, tree=True, alpha=0.65, hybrid=True)
    free, priced = (plan({**flat, "hybrid_branch_us": {"1": us}}, ngram_alpha=0.4, **kw) for us in (0.0, 2000.0))
    assert free.ngram > 0 and priced.ngram == 0
    assert HYBRID_BRANCH_US > 0 and plan(flat, ngram_alpha=0.85, **kw).drafter == "ngram"  # text that copies its prompt: lookup


def test_alpha_for_chain_tokens_inverts_expected_tokens():
    from jspec.speculative.policies.auto import alpha_for_chain_tokens, expected_tokens

    for a in (0.1, 0.5, 0.648, 0.9):
        assert abs(alpha_for_chain_tokens(float(expected_tokens(a, 6)), 6) - a) < 1e-4
    with pytest.raises(ValueError, match=r"must lie in \[1, 7\]"):
        alpha_for_chain_tokens(7.5, 6)


def test_alpha_from_ttt_accuracy_reads_the_steps_as_a_chain():
    """A constant accuracy a is the geometric chain itself; falling accuracies give less; the
    shipped SmolLM2 heads' held-out accuracies give their documented estimates."""
    from jspec.speculative.policies.auto import alpha_from_ttt_accuracy

    assert abs(alpha_from_ttt_accuracy([0.6] * 7) - 0.6) < 1e-4
    assert abs(alpha_from_ttt_accuracy([0.6]) - 0.6) < 1e-4  # the last step repeats
    assert alpha_from_ttt_accuracy([0.7, 0.6, 0.5]) < 0.7
    assert abs(alpha_from_ttt_accuracy([0.673, 0.640, 0.625, 0.615, 0.607, 0.596, 0.588]) - 0.647) < 2e-3
    with pytest.raises(ValueError, match="no training-time-test accuracies"):
        alpha_from_ttt_accuracy([])


def test_auto_plans_for_the_sampling_in_force():
    """Sampling lowers the acceptance the plan expects (the drafter's own table when it has one),
    prices what sampling adds to rounds, plans sampled-sibling trees, and falls back to a chain or
    plain decoding where a tree would lose; greedy plans are unchanged by a table's sampled_us."""
    assert acceptance_at(0.7, 0.0, "eagle") == 0.7
    assert acceptance_at(0.7, 1.0, "eagle") < acceptance_at(0.7, 0.7, "eagle") < 0.7
    assert acceptance_at(0.7, 1.0, "eagle", ((0.7, 0.6), (1.0, 0.5))) == pytest.approx(0.5)
    costs = dict(REFERENCE_COSTS)
    kw = dict(batch=1, drafter_name="eagle", parallel=False, tree=True, alpha=0.71)
    greedy, warm, hot = (plan(costs, **kw, temperature=t) for t in (0.0, 0.7, 1.0))
    assert greedy.gain > warm.gain > hot.gain > 1.0
    assert plan(dict(costs, sampled_us={"tree": {"1": 1e5}}), **kw) == greedy  # greedy plans ignore it
    dear_trees = dict(costs, sampled_us={"ar": {"1": 0.0}, "chain": {"1": 0.0}, "tree": {"1": 1e5}})
    assert plan(dear_trees, **kw, temperature=1.0).mode == "chain"
    dear_rounds = dict(costs, sampled_us={"ar": {"1": 0.0}, "chain": {"1": 1e5}, "tree": {"1": 1e5}})
    assert plan(dear_rounds, **kw, temperature=1.0).mode == "ar"
    # a sampled tree's reach: each depth at most 1, and it falls with depth and with the acceptance
    reach = sampled_tree_reach(31, 5, 10, 0.55, 1.0)
    assert (reach <= 1).all() and (np.diff(reach) < 0).all()
    assert (sampled_tree_reach(31, 5, 10, 0.4, 1.0) < reach).all()


def test_a_draft_models_costs_live_beside_the_heads_and_plan_it(tmp_path, monkeypatch):
    """A draft model's step is a forward of its own shape: a card's table keeps its draft costs under
    drafters[cost_key], measured when missing (a table holding a head's alone does not cover it),
    and its plans read them, while a head's plans keep reading the top level."""
    from jspec.bench import round_cost as RC
    from jspec.speculative.drafters.model import ModelDrafter
    from jspec.speculative.policies.auto import CostModel, plan_for

    tparams = M.init_params(CFG, jax.random.PRNGKey(0))
    drafter, _ = _drafters(tparams)["model"]
    assert isinstance(drafter, ModelDrafter) and drafter.cost_key.startswith("model:")
    (tmp_path / "tiny").mkdir()
    head_table = {"version": RC.COST_TABLE_VERSION, "card": RC.card_key(), "spread": {"1": 0.01},
                  "verify_us": {"1": {"1": 1000.0, "2": 1010.0, "4": 1020.0, "8": 1040.0}},
                  "draft_step_us": {"1": 30.0}, "draft_first_us": {"1": 30.0}}
    RC.save_card_costs(head_table, RC.cost_table_path("tiny", str(tmp_path)))
    measured = []

    def fake_profile(tparams, tcfg, d, dparams, *, batch, **kw):
        measured.append(d.cost_key)
        return {"draft_step_us": 450.0, "draft_first_us": 450.0, "round_us": 2500.0}

    monkeypatch.setattr(RC, "profile_method", fake_profile)
    monkeypatch.setattr(RC, "verify_us", lambda *a, spread, **kw: spread.update(x=0.01) or dict(head_table["verify_us"]["1"]))
    costs = RC.ensure_costs(tparams, CFG, drafter, None, batch=1, preset="tiny", models_dir=str(tmp_path), tree=False)
    assert measured == [drafter.cost_key]  # the head's draft step does not stand in for the draft model's
    assert costs["draft_step_us"] == {"1": 30.0}  # the head's, untouched
    assert costs["drafters"][drafter.cost_key]["draft_step_us"] == {"1": 450.0}
    assert RC.ensure_costs(tparams, CFG, drafter, None, batch=1, preset="tiny", models_dir=str(tmp_path), tree=False) == costs
    assert measured == [drafter.cost_key]  # cached: measured once
    assert CostModel(costs, 1, drafter_key=drafter.cost_key).draft_step() == 450.0
    assert CostModel(costs, 1).draft_step() == 30.0
    as_model = plan_for(drafter, costs, batch=1, k_cap=8, tree=None)
    as_head = plan(costs, batch=1, drafter_name="model", parallel=False, alpha=getattr(drafter, "acceptance", None))
    assert as_model.k_max < as_head.k_max or as_model.mode == "ar"  # a dear draft step drafts less


def test_bench_queue_auto_rows_name_the_tail_they_ran(tmp_path, monkeypatch):
    """`jspec bench --queue` with `auto`: the tail the plan adds runs (generate's tail_rows, as
    planned from the same table) and the row's auto_plan says so; outputs stay AR's."""
    import argparse

    import jspec.generate as G
    from jspec.bench import cli
    from jspec.bench import round_cost as RC
    from jspec.config import ModelConfig
    from test_bench import CharTokenizer

    cfg = ModelConfig(arch="llama", vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=1,
                      num_heads=2, num_kv_heads=1, head_dim=16, max_position_embeddings=256, eos_token_ids=(3,))
    params = M.init_params(cfg, jax.random.PRNGKey(0), scale=0.35)
    monkeypatch.setattr(cli, "resolve_model", lambda name: (cfg, params, CharTokenizer()))
    # the H200 table (a step of 8 rows costs 0.97x one of 2, and 8 rows plan shorter chains)
    monkeypatch.setattr(cli, "ensure_costs", lambda *a, **kw: dict(REFERENCE_COSTS))
    monkeypatch.setattr(RC, "ensure_costs", lambda *a, **kw: dict(REFERENCE_COSTS))
    tails = []
    finish = G._finish_in_tail
    monkeypatch.setattr(G, "_finish_in_tail", lambda *a, **kw: tails.append(kw["tail"]) or finish(*a, **kw))
    args = cli.add_bench_args(argparse.ArgumentParser()).parse_args(
        ["--model", "tiny", "--tasks", "mt_bench", "--n-prompts", "10", "--max-new-tokens", "6", "--batch", "8",
         "--methods", "ar,spec:ngram:auto", "--queue", "--no-plots", "--min-timed-s", "0",
         "--out", str(tmp_path / "results")])
    rows = cli.run_bench(args)
    spec = [r for r in rows if r["method"] == "spec"][0]
    from jspec.speculative.drafters.ngram import NgramDrafter
    from jspec.speculative.policies.auto import tail_rows

    planned = tail_rows(NgramDrafter(), REFERENCE_COSTS, rows=8, k_cap=8, tree=None)
    assert spec["greedy_identical_to_ar"] == 1.0 and planned == 2
    assert spec["auto_plan"].endswith("; the last 2 rows in a 2-row tail, planned afresh") and set(tails) == {2}


def test_an_unmeasured_draft_model_is_planned_with_its_share_of_the_ar_step():
    """Before a table holds a draft model's measured step, `auto` prices it as step_fraction times
    the AR step (a latency per layer plus its weights' bytes, against the target's: 0.49 for the
    Qwen2.5-Coder pair, as measured on an H100), not as an EAGLE head's."""
    from jspec.config import ModelConfig
    from jspec.speculative.drafters.model import ModelDrafter, step_fraction
    from jspec.speculative.policies.auto import CostModel, plan_for

    def qwen(layers, hidden, ffn, heads):
        return ModelConfig(arch="qwen2", vocab_size=151936, hidden_size=hidden, intermediate_size=ffn, num_layers=layers,
                           num_heads=heads, num_kv_heads=2, head_dim=hidden // heads)

    target, draft = qwen(28, 1536, 8960, 12), qwen(24, 896, 4864, 14)
    assert step_fraction(draft, target) == pytest.approx(0.49, abs=0.01)
    drafter = ModelDrafter(draft, step_fraction=0.59)
    cm = CostModel(REFERENCE_COSTS, 1, drafter_key=drafter.cost_key, step_fraction=0.59)
    assert cm.draft_step() == pytest.approx(0.59 * CostModel(REFERENCE_COSTS, 1).ar_step())
    assert CostModel(REFERENCE_COSTS, 1).draft_step() < 0.2 * cm.draft_step()  # the head's, far cheaper
    p = plan_for(drafter, REFERENCE_COSTS, batch=1, k_cap=8, tree=None)
    head_priced = plan(REFERENCE_COSTS, batch=1, drafter_name="model", parallel=False)
    assert p.mode == "ar" or (p.k_max <= head_priced.k_max and p.gain < head_priced.gain)


def test_plans_of_nearby_prompt_sets_share_one_compiled_policy():
    """An `auto` policy is a static argument: calls whose prompts give nearby acceptance estimates
    and costs get the same policy, so a loop over prompt batches compiles one program."""
    from jspec.speculative.drafters.ngram import NgramDrafter
    from jspec.speculative.policies.auto import coarse_acceptance, coarse_us, plan_for

    rng = np.random.default_rng(2)
    phrase = list(rng.integers(5, 60, 40))
    batches = [[list(rng.integers(5, 60, 30)) + phrase * 4 for _ in range(4)] for _ in range(3)]
    policies = {plan_for(NgramDrafter(), REFERENCE_COSTS, batch=1, k_cap=8, tree=None, prompts=p).policy for p in batches}
    assert len(policies) == 1
    assert coarse_acceptance(0.612) == coarse_acceptance(0.619) == pytest.approx(0.6)
    assert coarse_acceptance(0.0) > 0 and coarse_acceptance(1.0) < 1
    assert coarse_us(891.816) == 890.0 and coarse_us(62.0166) == 62.0 and coarse_us(1041.6) == 1000.0


def test_sampled_costs_beyond_the_measured_batches_grow_as_the_reference_does():
    """A table that measured sampling at 1 and 16 rows: between them it interpolates; at 64 rows its
    16-row figure grows as SAMPLED_US's does from 16 to 64, not along the line through 1 and 16
    (which priced an H100's 64-row chain round 17% dearer and planned plain decoding there)."""
    costs = {"sampled_us": {"chain": {"1": 51.4, "16": 135.0}}}
    assert CostModel(costs, 16).sampled("chain") == pytest.approx(135.0)
    assert CostModel(costs, 8).sampled("chain") == pytest.approx(51.4 + (135.0 - 51.4) * 7 / 15)
    growth = SAMPLED_US["chain"]["64"] / SAMPLED_US["chain"]["16"]
    assert CostModel(costs, 64).sampled("chain") == pytest.approx(135.0 * growth)
    assert CostModel(costs, 64).sampled("tree") == pytest.approx(SAMPLED_US["tree"]["64"])  # not measured: the reference


def test_a_chain_of_k_drafts_costs_the_table_s_first_step_and_k_minus_one_more():
    """The cost table measures the draft loop at K = 1 (its first token included) and the step as
    the slope beyond it, so a draft model's chain of k drafts costs first + (k - 1) steps besides its
    verify and round overhead: the plan's gain and the per-row limit price it so (one step more had
    planned plain decoding for a draft model whose step is half the target's). An EAGLE head's
    rounds keep HEAD_EXTRA_FORWARDS more, as its fitted constants assume."""
    from jspec.speculative.policies.auto import HEAD_EXTRA_FORWARDS, AutoPolicy, expected_tokens

    costs = {"verify_us": {"1": {"1": 1000, "2": 1000, "4": 1000, "8": 1000}},
             "draft_first_us": {"1": 500}, "draft_step_us": {"1": 500}, "round_overhead_us": {"1": 100}}
    gain = {k: float(expected_tokens(0.8, k)) * 1000 / (500 + (k - 1) * 500 + 1000 + 100) for k in range(1, 9)}
    for cap in (1, 2, 4, 8):
        p = plan(costs, batch=1, drafter_name="model", parallel=False, alpha=0.8, k_cap=cap, min_gain=0.0,
                 drafter_key="model:x")
        assert p.mode == "chain" and p.gain == pytest.approx(gain[p.k_max])
        assert p.gain >= max(gain[k] for k in range(1, cap + 1)) * (1 - PLAN_TOLERANCE)
    head = plan(costs, batch=1, drafter_name="eagle", parallel=False, alpha=0.8, k_cap=2, min_gain=0.0)  # below 1: "ar"
    assert head.gain == pytest.approx(max(float(expected_tokens(0.8, k)) * 1000
                                          / (500 + (k - 1 + HEAD_EXTRA_FORWARDS) * 500 + 1000 + 100) for k in (1, 2)))
    policy = AutoPolicy(k_max=4, alpha0=0.8, step_us=500.0, first_us=600.0, verify_us=1000.0)
    rates = [float(expected_tokens(0.8, k)) / (600 + (k - 1) * 500 + 1000) for k in range(1, 5)]
    state = policy.init(1, None)
    assert int(policy.round_limit(state, 4)[0]) == 1 + max(range(4), key=lambda i: rates[i])
