import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jspec.speculative.policies import POLICY_NAMES, make_policy
from jspec.speculative.policies.adl import ADLPolicy
from jspec.speculative.policies.base import draft_log_probs, softmax_entropy, top_two_probs
from jspec.speculative.policies.ldlp import length_from_prediction
from jspec.speculative.policies.tapout import TAPOUT_ARMS

KEY = jax.random.key(0)


def logits_of(*rows):
    """Logits whose softmax is exactly each row of probabilities (0 -> -inf)."""
    with np.errstate(divide="ignore"):
        return jnp.asarray(np.log(np.array(rows, np.float64)), jnp.float32)


def ones(batch, value=True):
    return jnp.full((batch,), value)


def rounds(policy, state, history, batch=1):
    """Feed (n_drafted, n_accepted) pairs through update; return each round's limit and the state."""
    limits = []
    for n_drafted, n_accepted in history:
        limits.append(int(policy.round_limit(state, policy.k_max)[0]))
        state = policy.update(
            state, jnp.full((batch,), n_drafted), jnp.full((batch,), n_accepted), ones(batch)
        )
    return limits, state


# -- registry -------------------------------------------------------------------------------------


def test_make_policy_names_fields_and_hashing():
    with pytest.raises(ValueError, match="valid names: static, confidence"):
        make_policy("eagle")
    with pytest.raises(ValueError, match="no field.*threshhold"):
        make_policy("svip", threshhold=0.2)
    for name in POLICY_NAMES:
        policy = make_policy(name, k_max=8)
        assert policy.name == name
        assert hash(policy) == hash(make_policy(name, k_max=8))
    assert make_policy("ldlp").needs_draft_logits is False
    assert make_policy("ldlp", ddd=True).needs_draft_logits is True
    assert make_policy("svip").needs_draft_logits and not make_policy("adl").needs_draft_logits
    with pytest.raises(ValueError, match="lambda_rule"):
        make_policy("adaedl", lambda_rule="C")


def test_k_max_is_checked():
    policy = make_policy("heuristic", k_max=8)
    state = policy.init(1, KEY)
    with pytest.raises(ValueError, match="k_max=8 but the engine passes k_max=6"):
        policy.round_limit(state, 6, None)
    without = make_policy("heuristic")
    with pytest.raises(ValueError, match="k_max=K"):
        without.update(state, ones(1, 1), ones(1, 1), ones(1))


# -- stop predicates on crafted distributions -------------------------------------------------------


def test_entropy_of_crafted_distributions():
    logits = logits_of([0.5, 0.5, 0, 0], [0.25] * 4, [0.8, 0.2, 0, 0], [1, 0, 0, 0])
    expected = [math.log(2), math.log(4), -(0.8 * math.log(0.8) + 0.2 * math.log(0.2)), 0.0]
    np.testing.assert_allclose(softmax_entropy(logits), expected, atol=1e-6)
    # Shifting logits changes nothing; large finite logits stay finite.
    z = jax.random.normal(KEY, (3, 50)) * 30
    p = jax.nn.softmax(z)
    np.testing.assert_allclose(softmax_entropy(z + 1e4), -jnp.sum(p * jnp.log(p + 1e-30), -1), atol=1e-3)


def test_top_two_probs_in_one_pass():
    # ties count twice (as top_k would), zero-probability entries never rank, one-entry rows give 0
    logits = logits_of([0.4, 0.4, 0.2, 0], [0.1, 0.7, 0, 0.2], [0, 0, 1, 0])
    top1, top2 = top_two_probs(draft_log_probs(logits))
    np.testing.assert_allclose(top1, [0.4, 0.7, 1.0], atol=1e-6)
    np.testing.assert_allclose(top2, [0.4, 0.2, 0.0], atol=1e-6)
    z = jax.random.normal(KEY, (2, 3, 1000))
    ranked = np.sort(np.asarray(jax.nn.softmax(z)), axis=-1)
    top1, top2 = jax.jit(top_two_probs)(jax.nn.log_softmax(z))
    np.testing.assert_allclose(top1, ranked[..., -1], rtol=1e-5)
    np.testing.assert_allclose(top2, ranked[..., -2], rtol=1e-5)


def test_svip_stops_above_0_6_nats():
    policy = make_policy("svip")
    state = policy.init(3, KEY)
    # H = ln 2 = 0.693 > 0.6 -> stop; H = 0.500 -> go on; H = 0 -> go on.
    logits = logits_of([0.5, 0.5, 0, 0], [0.8, 0.2, 0, 0], [1, 0, 0, 0])
    np.testing.assert_array_equal(policy.stop(state, jnp.int32(0), logits), [True, False, False])


def test_adaedl_stop_uses_each_rows_lambda():
    policy = make_policy("adaedl", k_max=8)
    state = policy.init(3, KEY)
    # lambda 0.5: stop iff H > (1 - 0.5)^2 / 0.2 = 1.25 nats.  ln 3 = 1.099 < 1.25 < ln 4 = 1.386.
    logits = logits_of([1 / 3] * 3 + [0], [0.25] * 4, [0.25] * 4)
    state = state.replace(lam=jnp.array([0.5, 0.5, 0.2]))  # lambda 0.2: H must exceed 3.2
    np.testing.assert_array_equal(policy.stop(state, jnp.int32(1), logits), [False, True, False])
    # Checked before drafting: the first token is always drafted, and a stop drops its token.
    np.testing.assert_array_equal(policy.stop(state, jnp.int32(0), logits), [False, False, False])
    np.testing.assert_array_equal(policy.stop_skips_token(state), [True] * 3)
    assert not make_policy("svip").stop_skips_token(state).any()


def test_confidence_threshold():
    policy = make_policy("confidence", threshold=0.5)
    logits = logits_of([0.49, 0.3, 0.21], [0.51, 0.48, 0.01])
    np.testing.assert_array_equal(policy.stop(policy.init(2, KEY), 0, logits), [True, False])


# -- AdaEDL lambda -----------------------------------------------------------------------------------


def test_adaedl_lambda_rule_a_sequence():
    policy = make_policy("adaedl", k_max=16)
    state = policy.init(2, KEY)
    active = jnp.array([True, False])
    lams = [0.5]
    # Rates 0.8, 0.9 keep AR = 0.85, 0.875 below 0.9 (lambda up); rate 1.0 lifts AR to 0.9375 and
    # 5 != L = 16 accepted (lambda down).
    for n_drafted, n_accepted in [(5, 4), (10, 9), (5, 5)]:
        state = policy.update(state, ones(2, n_drafted), ones(2, n_accepted), active)
        lams.append(float(state.lam[0]))
    np.testing.assert_allclose(lams, [0.5, 0.501, 0.502, 0.501], atol=1e-6)
    np.testing.assert_allclose(state.acc_rate[0], 0.9375, atol=1e-6)
    np.testing.assert_allclose(state.lam[1], 0.5)  # finished row untouched
    # AR >= target and all L drafts accepted: lambda stays.
    state = policy.update(state, ones(2, 16), ones(2, 16), active)
    np.testing.assert_allclose(state.lam[0], 0.501, atol=1e-6)


def test_adaedl_lambda_rule_b():
    policy = make_policy("adaedl", k_max=4, lambda_rule="B")
    state = policy.init(1, KEY)
    # AR 0.95 > 0.9 but not all L=4 accepted: rule B keeps lambda (rule A would lower it).
    state = policy.update(state, ones(1, 2), ones(1, 2), ones(1))
    np.testing.assert_allclose(state.lam, [0.5], atol=1e-7)
    # All 4 accepted and AR > 0.9: lambda goes down by (1 - 0.9) * 0.01.
    state = policy.update(state, ones(1, 4), ones(1, 4), ones(1))
    np.testing.assert_allclose(state.lam, [0.499], atol=1e-6)


# -- heuristic, ADL ---------------------------------------------------------------------------------


def test_heuristic_schedule():
    policy = make_policy("heuristic", k_max=8)
    limits, state = rounds(policy, policy.init(1, KEY), [(5, 5), (7, 7), (8, 8), (8, 3), (7, 0)])
    assert limits == [5, 7, 8, 8, 7]
    assert int(state.gamma[0]) == 6
    _, state = rounds(policy, state, [(1, 0)] * 8)
    assert int(state.gamma[0]) == 1  # floor
    frozen = policy.update(state, ones(1, 1), ones(1, 1), ones(1, False))
    assert int(frozen.gamma[0]) == 1


def test_adl_emas_and_lengths():
    policy = make_policy("adl", k_max=8)  # delta = max(1, 8 // 3) = 2, k_min = 1
    history = [(8, 8), (6, 2), (5, 5), (1, 1)]
    limits, state = rounds(policy, policy.init(1, KEY), history)
    # G: 4, 5, 5, 3;  A: 4, 3, 4, 2.5;  k: 4 + 2, 5, 5, 3 + 0.
    assert limits == [8, 6, 5, 5]
    np.testing.assert_allclose([state.gen_ema[0], state.acc_ema[0]], [3.0, 2.5])
    assert int(policy.round_limit(state, 8)[0]) == 3
    # The paper's diffusion-drafter constants clip to [20, 30], then to the engine's k_max.
    paper = ADLPolicy.paper(k_max=8)
    assert (paper.k_min, paper.k_max_adl, paper.delta) == (20, 30, 10)
    _, state = rounds(paper, paper.init(1, KEY), [(8, 8)])
    assert int(state.next_k[0]) == 20 and int(paper.round_limit(state, 8)[0]) == 8


# -- TapOut -----------------------------------------------------------------------------------------


def test_tapout_stop_follows_the_chosen_arm():
    policy = make_policy("tapout", k_max=8)
    state = policy.init(5, KEY).replace(arm=jnp.arange(5, dtype=jnp.int32))
    # p = (0.6, 0.4): margin 0.2 < 0.4 stops; max_conf 0.6 goes on; H = 0.673 > 0.6 stops SVIP;
    # AdaEDL 1 - sqrt(0.2 * 0.673) = 0.633 >= 0.5 goes on; static never stops.
    logits = jnp.tile(logits_of([0.6, 0.4, 0.0]), (5, 1))
    assert TAPOUT_ARMS == ("logit_margin", "max_conf", "svip", "adaedl", "static")
    np.testing.assert_array_equal(policy.stop(state, 0, logits), [True, False, True, False, False])


def test_tapout_ucb1_counts_and_means():
    policy = make_policy("tapout", k_max=8)  # reward = 0.5 * n_acc / 8 + 0.5 * n_acc / n_drafted
    state = policy.init(2, KEY)
    active = jnp.array([True, False])
    history = [(8, 8), (4, 2), (2, 2), (1, 0), (8, 4), (8, 4)]
    rewards = [1.0, 0.375, 0.625, 0.0, 0.5, 0.5]
    arms = []
    for n_drafted, n_accepted in history:
        arms.append(int(state.arm[0]))
        state = policy.update(state, ones(2, n_drafted), ones(2, n_accepted), active)
    # Each arm once in order, then the best mean (equal bonuses): arm 0.
    assert arms == [0, 1, 2, 3, 4, 0]
    np.testing.assert_array_equal(state.counts[0], [2, 1, 1, 1, 1])
    np.testing.assert_allclose(state.means[0], [(1.0 + 0.5) / 2] + rewards[1:5], atol=1e-6)
    # t = 6: arm 0 scores 0.75 + sqrt(2 ln 6 / 2) = 2.089, arm 2 scores 0.625 + sqrt(2 ln 6) = 2.518.
    assert int(state.arm[0]) == 2
    # Only the AdaEDL arm's round (1 drafted, 0 accepted) moved its lambda up.
    np.testing.assert_allclose(state.lam[0], 0.501, atol=1e-6)
    # The finished row kept its initial tables.
    assert int(state.counts[1].sum()) == 0 and int(state.arm[1]) == 0


# -- LDLP -------------------------------------------------------------------------------------------


def constant_ldlp_params(d_model, value):
    """Predictor weights whose output is `value` for every input."""
    params = jax.tree_util.tree_map(
        jnp.zeros_like, make_policy("ldlp", d_model=d_model, hidden=4).init(1, KEY).params
    )
    params["b_out"] = jnp.float32(value)
    return params


def test_ldlp_round_limit_clipping():
    prediction = jnp.array([-3.0, 0.4, 2.4, 2.6, 100.0, jnp.nan])
    np.testing.assert_array_equal(length_from_prediction(prediction, 6), [1, 1, 2, 3, 6, 6])
    policy = make_policy("ldlp", k_max=6)
    features = {"token_embedding": jnp.ones((2, 4)), "target_feature": jnp.ones((2, 4))}
    state = policy.init(2, KEY, params=constant_ldlp_params(4, 4.6))
    np.testing.assert_array_equal(policy.round_limit(state, 6, features), [5, 5])
    with pytest.raises(ValueError, match="params"):
        make_policy("ldlp").init(2, KEY)
    ddd = make_policy("ldlp", ddd=True)
    with pytest.raises(ValueError, match="start_round"):
        ddd.stop(ddd.init(2, KEY, params=state.params), 0, jnp.zeros((2, 3)))


# -- every policy inside a jitted lax.while_loop ----------------------------------------------------

K_MAX = 6
CONFIDENT = [0.97, 0.01, 0.01, 0.01]  # H = 0.168: nobody stops
SPLIT = [0.55, 0.45, 0.0, 0.0]  # H = 0.688: SVIP and logit margin stop
FLAT = [0.25] * 4  # H = 1.386, p1 = 0.25: every rule stops
STEP_LOGITS = jnp.stack(
    [
        logits_of(row0, row1)
        for row0, row1 in zip(
            [CONFIDENT, CONFIDENT, SPLIT, FLAT, CONFIDENT, CONFIDENT],
            [CONFIDENT, SPLIT, CONFIDENT, CONFIDENT, FLAT, CONFIDENT],
        )
    ]
)  # [K_MAX, B=2, V=4]
ACCEPT_CAP = jnp.array([[6, 2]] * 5)  # 5 rounds; row 0 accepts everything, row 1 at most 2
FEATURES = {"token_embedding": jnp.ones((2, 4)), "target_feature": jnp.ones((2, 4))}


@functools.partial(jax.jit, static_argnames=("policy", "in_round_state"))
def simulate(policy, state, in_round_state):
    """Engine-like loop: a while_loop drafts each round (a scan over rounds); returns n_drafted [R, B]."""
    batch = STEP_LOGITS.shape[1]

    def one_round(state, accept_cap):
        if in_round_state:
            state, limit = policy.start_round(state, K_MAX, FEATURES)
        else:
            limit = policy.round_limit(state, K_MAX, FEATURES)

        def cond(carry):
            step, done, _, _ = carry
            return (step < K_MAX) & ~jnp.all(done)

        def body(carry):
            step, done, n_drafted, st = carry
            logits = STEP_LOGITS[step]
            if in_round_state:
                st, stop = policy.observe(st, step, logits, jnp.argmax(logits, -1))
            else:
                stop = policy.stop(st, step, logits)
            # as the engine: token 0 always drafted; a rule checked before drafting drops its token
            skip = stop & policy.stop_skips_token(st) & (step > 0)
            n_drafted = n_drafted + (~done & ~skip).astype(jnp.int32)
            return step + 1, done | stop | (n_drafted >= limit), n_drafted, st

        init = (jnp.int32(0), jnp.zeros(batch, bool), jnp.zeros(batch, jnp.int32), state)
        _, _, n_drafted, state = jax.lax.while_loop(cond, body, init)
        n_accepted = jnp.minimum(n_drafted, accept_cap)
        return policy.update(state, n_drafted, n_accepted, jnp.ones(batch, bool)), n_drafted

    return jax.lax.scan(one_round, state, ACCEPT_CAP)


@pytest.mark.parametrize(
    "name, overrides, expected",
    [
        ("static", {}, [[6, 6]] * 5),
        ("static", {"k": 3}, [[3, 3]] * 5),
        ("confidence", {}, [[4, 5]] * 5),
        ("svip", {}, [[3, 2]] * 5),
        # AdaEDL checks before drafting: the FLAT step's token is not drafted (max-confidence keeps it).
        ("adaedl", {}, [[3, 4]] * 5),
        # Row 0 accepts all: 5 -> 7, capped at 6. Row 1 accepts 2: 5, 4, 3, 2, then all 2 -> 4.
        ("heuristic", {}, [[5, 5], [6, 4], [6, 3], [6, 2], [6, 4]]),
        # delta = 2. Row 0: G = A = 3, 4, 5 -> k = G + 2 (capped at 6). Row 1: G = 3 > A -> k = 3.
        ("adl", {}, [[6, 6], [5, 3], [6, 3], [6, 3], [6, 3]]),
        # UCB1 tries the arms in order: margin, max_conf, svip, adaedl, static.
        ("tapout", {}, [[3, 2], [4, 5], [3, 2], [3, 4], [6, 6]]),
    ],
)
def test_policy_runs_in_jitted_while_loop(name, overrides, expected):
    policy = make_policy(name, k_max=K_MAX, **overrides)
    _, n_drafted = simulate(policy, policy.init(2, KEY), in_round_state=False)
    np.testing.assert_array_equal(n_drafted, expected)


def test_ldlp_and_ddd_in_jitted_while_loop():
    plain = make_policy("ldlp", k_max=K_MAX)
    state = plain.init(2, KEY, params=constant_ldlp_params(4, 1.0))
    _, n_drafted = simulate(plain, state, in_round_state=False)
    np.testing.assert_array_equal(n_drafted, [[1, 1]] * 5)
    # DDD keeps drafting past the predicted 1 until the running log-prob drops below -0.6:
    # row 0: ln .97 * 2 + ln .55 = -0.659 at the 3rd token; row 1: ln .97 + ln .55 = -0.628 at the 2nd.
    ddd = make_policy("ldlp", k_max=K_MAX, ddd=True)
    _, n_drafted = simulate(ddd, state, in_round_state=True)
    np.testing.assert_array_equal(n_drafted, [[3, 2]] * 5)
    # With a predicted length of 4 the LDLP length is the longer one.
    state = ddd.init(2, KEY, params=constant_ldlp_params(4, 4.0))
    _, n_drafted = simulate(ddd, state, in_round_state=True)
    np.testing.assert_array_equal(n_drafted, [[4, 4]] * 5)


def test_tapout_thompson_in_jitted_while_loop():
    policy = make_policy("tapout", k_max=K_MAX, bandit="thompson")
    state, n_drafted = simulate(policy, policy.init(2, KEY), in_round_state=True)
    assert n_drafted.shape == (5, 2) and bool(jnp.all((n_drafted >= 1) & (n_drafted <= K_MAX)))
    np.testing.assert_array_equal(state.counts.sum(-1), [5, 5])
    np.testing.assert_array_equal(state.rounds, [5, 5])
    # Same key, same choices.
    again, _ = simulate(policy, policy.init(2, KEY), in_round_state=True)
    np.testing.assert_array_equal(state.counts, again.counts)
