"""Dynamic draft-length policies for chain speculative decoding: device-side, pure and jittable.

The engine runs one round per target call for a batch of ``B`` rows, each row with its own state::

    state = policy.init(B, key)
    # each round, inside the engine's jitted loop:
    limit = policy.round_limit(state, k_max, features)          # [B] int32 in [1, k_max]
    # draft token `step` = 0, 1, ... while step < limit and not stopped:
    stop = policy.stop(state, step, draft_logits)               # [B] bool; the token is kept
    # verify, then:
    state = policy.update(state, n_drafted, n_accepted, active)

Policies are frozen, hashable dataclasses (static jit arguments); their states are
``flax.struct`` dataclasses whose arrays have a leading batch dim ``B`` (the one exception is the
LDLP predictor's weights, which every row shares).

Two things the four calls above cannot express, and how they are handled:

* ``update`` gets no ``k_max``, yet several rules need the engine's maximum draft length after
  verification (the heuristic's cap, AdaEDL's ``L``, TapOut's reward, ADL's clip). Every policy
  therefore has a field ``k_max``; build them with ``make_policy(name, k_max=K)``. Those rules
  raise at trace time if it is missing, and ``round_limit`` raises if it disagrees with the
  ``k_max`` the engine passes.
* AdaEAGLE-DDD (``make_policy("ldlp", ddd=True)``) needs state that changes inside a round (the
  predicted length and the running draft log-prob). For that, policies also offer the
  state-returning forms ``start_round(state, k_max, features) -> (state, limit)`` and
  ``observe(state, step, draft_logits, draft_token) -> (state, stop)``; for every other policy
  they just wrap ``round_limit`` and ``stop``. An engine that always uses them (carrying the
  state through its draft loop) serves every policy; an engine using the plain calls serves
  every policy except LDLP-DDD, whose plain calls raise.

Entropies are in nats, from softmax of the untempered fp32 draft logits (``-inf`` entries allowed).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from flax import struct

from jspec import ldlp as ldlp_lib

POLICY_NAMES = ("static", "confidence", "heuristic", "svip", "adaedl", "tapout", "ldlp", "adl")
TAPOUT_ARMS = ("logit_margin", "max_conf", "svip", "adaedl", "static")

Features = dict[str, jax.Array] | None


# ------------------------------------------------------------------------------------------------
# Pure statistics of one draft distribution and the stop predicates built on them.
# ------------------------------------------------------------------------------------------------


def draft_log_probs(draft_logits: jax.Array) -> jax.Array:
    return jax.nn.log_softmax(draft_logits.astype(jnp.float32), axis=-1)


def entropy_from_log_probs(log_probs: jax.Array) -> jax.Array:
    """Entropy in nats over the last axis; entries with probability 0 (logit -inf) contribute 0."""
    probs = jnp.exp(log_probs)
    # p * log p is 0 * -inf = nan for masked entries; their true contribution is 0.
    terms = jnp.where(probs > 0, probs * log_probs, 0.0)
    return jnp.maximum(-jnp.sum(terms, axis=-1), 0.0)


def top_two_probs(log_probs: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Largest and second-largest probability over the last axis."""
    top = jax.lax.top_k(jnp.exp(log_probs), 2)[0]
    return top[..., 0], top[..., 1]


def softmax_entropy(draft_logits: jax.Array) -> jax.Array:
    return entropy_from_log_probs(draft_log_probs(draft_logits))


def svip_stop(entropy: jax.Array, entropy_scale: float, threshold: float) -> jax.Array:
    """SVIP: stop when ``sqrt(entropy_scale * H) > threshold``."""
    return jnp.sqrt(entropy_scale * entropy) > threshold


def adaedl_stop(entropy: jax.Array, lam: jax.Array, gamma: float) -> jax.Array:
    """AdaEDL: stop when the acceptance lower bound ``1 - sqrt(gamma * H)`` falls below ``lam``."""
    return 1.0 - jnp.sqrt(gamma * entropy) < lam


def max_confidence_stop(top1: jax.Array, threshold: float) -> jax.Array:
    return top1 < threshold


def logit_margin_stop(top1: jax.Array, top2: jax.Array) -> jax.Array:
    """Stop when the runner-up is closer to the top token than the top token's lead (p1 - p2 < p2)."""
    return top1 - top2 < top2


# ------------------------------------------------------------------------------------------------
# Helpers
# ------------------------------------------------------------------------------------------------


def _keep_finished(active: jax.Array, new: Any, old: Any) -> Any:
    """Take ``new`` for active rows and ``old`` for finished ones, leaf by leaf (leading dim B)."""

    def pick(n, o):
        mask = active.reshape(active.shape + (1,) * (n.ndim - 1))
        return jnp.where(mask, n, o)

    return jax.tree_util.tree_map(pick, new, old)


def _full_limit(batch: int, k_max: int) -> jax.Array:
    return jnp.full((batch,), k_max, jnp.int32)


def _clip_limit(limit: jax.Array, k_max: int) -> jax.Array:
    return jnp.clip(limit, 1, k_max).astype(jnp.int32)


def _never_stop(draft_logits: jax.Array) -> jax.Array:
    return jnp.zeros(draft_logits.shape[:1], jnp.bool_)


def _count_rounds(rounds: jax.Array, active: jax.Array) -> jax.Array:
    return rounds + active.astype(rounds.dtype)


def _row_keys(key: jax.Array, batch: int) -> jax.Array:
    """One raw uint32 PRNG key per row (raw keys work with jnp.where and any key style input)."""
    keys = jax.random.split(key, batch)
    if jax.dtypes.issubdtype(keys.dtype, jax.dtypes.prng_key):
        keys = jax.random.key_data(keys)
    return keys


@struct.dataclass
class RoundCountState:
    """State of the stateless rules: just the number of verified rounds per row."""

    rounds: jax.Array  # [B] int32


# ------------------------------------------------------------------------------------------------
# Base class
# ------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Policy:
    """Base of all draft-length policies. See the module docstring for the calling protocol.

    k_max: the engine's maximum draft length. Needed by rules that use it in ``update``
      (heuristic, adaedl, tapout, adl); optional elsewhere. When set, ``round_limit`` checks it
      equals the ``k_max`` the engine passes.
    """

    name = "base"  # class attributes, not dataclass fields
    needs_draft_logits = False
    needs_in_round_state = False

    k_max: int | None = None

    # -- the four engine calls ------------------------------------------------------------------
    def init(self, batch: int, key: jax.Array) -> Any:
        del key
        return RoundCountState(rounds=jnp.zeros((batch,), jnp.int32))

    def round_limit(self, state: Any, k_max: int, features: Features = None) -> jax.Array:
        self._check_k_max(k_max)
        return _full_limit(state.rounds.shape[0], k_max)

    def stop(self, state: Any, step: jax.Array, draft_logits: jax.Array) -> jax.Array:
        return _never_stop(draft_logits)

    def update(
        self, state: Any, n_drafted: jax.Array, n_accepted: jax.Array, active: jax.Array
    ) -> Any:
        return state.replace(rounds=_count_rounds(state.rounds, active))

    # -- state-returning forms (needed only by policies with needs_in_round_state) --------------
    def start_round(self, state: Any, k_max: int, features: Features = None) -> tuple[Any, jax.Array]:
        return state, self.round_limit(state, k_max, features)

    def observe(
        self,
        state: Any,
        step: jax.Array,
        draft_logits: jax.Array,
        draft_token: jax.Array | None = None,
    ) -> tuple[Any, jax.Array]:
        """``stop`` plus any in-round state change. draft_token [B]: the token drafted at ``step``."""
        del draft_token
        return state, self.stop(state, step, draft_logits)

    # -- k_max bookkeeping ----------------------------------------------------------------------
    def _check_k_max(self, k_max: int) -> None:
        if not isinstance(k_max, int) or k_max < 1:
            raise ValueError(f"k_max must be a positive Python int (static), got {k_max!r}")
        if self.k_max is not None and self.k_max != k_max:
            raise ValueError(
                f"policy {self.name!r} was built with k_max={self.k_max} but the engine passes "
                f"k_max={k_max}"
            )

    def _required_k_max(self) -> int:
        if self.k_max is None:
            raise ValueError(
                f"policy {self.name!r} needs the engine's maximum draft length after verification; "
                f"build it with make_policy({self.name!r}, k_max=K)"
            )
        return self.k_max


# ------------------------------------------------------------------------------------------------
# static, confidence, svip: no state beyond the round count
# ------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class StaticPolicy(Policy):
    """Fixed draft length ``k`` every round (``k=None``: the engine's ``k_max``); never stops early."""

    name = "static"

    k: int | None = None

    def round_limit(self, state, k_max, features=None):
        self._check_k_max(k_max)
        k = k_max if self.k is None else self.k
        return _clip_limit(jnp.full(state.rounds.shape, k, jnp.int32), k_max)


@dataclasses.dataclass(frozen=True)
class ConfidencePolicy(Policy):
    """Max-confidence stop: stop after a draft token whose top softmax probability is < threshold.

    Default threshold 0.5: the same constant as TapOut's parameter-free max-confidence arm
    (docs/ALGORITHMS.md section 5); for comparison Hugging Face transformers' assistant
    confidence threshold defaults to 0.4. Tuned baselines sweep it per task.
    """

    name = "confidence"
    needs_draft_logits = True

    threshold: float = 0.5

    def stop(self, state, step, draft_logits):
        top1, _ = top_two_probs(draft_log_probs(draft_logits))
        return max_confidence_stop(top1, self.threshold)


@dataclasses.dataclass(frozen=True)
class SVIPPolicy(Policy):
    """SVIP (official code, vanilla-sd/eval_specbench.py): stop after a draft token with
    ``sqrt(entropy_scale * H) > threshold``, i.e. H > 0.6 nats with the defaults 0.15 and 0.3.
    The code's hard cap of 40 draft tokens is the engine's ``k_max`` here.
    """

    name = "svip"
    needs_draft_logits = True

    entropy_scale: float = 0.15
    threshold: float = 0.3

    def stop(self, state, step, draft_logits):
        return svip_stop(softmax_entropy(draft_logits), self.entropy_scale, self.threshold)


# ------------------------------------------------------------------------------------------------
# heuristic (Hugging Face transformers' "heuristic" assistant schedule)
# ------------------------------------------------------------------------------------------------


@struct.dataclass
class HeuristicState:
    gamma: jax.Array  # [B] int32: draft length for the next round
    rounds: jax.Array  # [B] int32


@dataclasses.dataclass(frozen=True)
class HeuristicPolicy(Policy):
    """Hugging Face transformers' heuristic schedule, per row:
    ``gamma <- min(gamma + increase, k_max)`` if every drafted token was accepted, else
    ``gamma <- max(min_gamma, gamma - decrease)``; starts at ``initial``.

    transformers compares the accepted count with the requested gamma; here "every drafted token"
    means ``n_accepted >= n_drafted``. The two differ only when a round was cut short (EOS, length
    budget). The cap at k_max follows SVIP's copy of this schedule (which caps at 40).
    """

    name = "heuristic"

    initial: int = 5
    increase: int = 2
    decrease: int = 1
    min_gamma: int = 1

    def init(self, batch, key):
        del key
        initial = self.initial if self.k_max is None else min(self.initial, self.k_max)
        return HeuristicState(
            gamma=jnp.full((batch,), initial, jnp.int32), rounds=jnp.zeros((batch,), jnp.int32)
        )

    def round_limit(self, state, k_max, features=None):
        self._check_k_max(k_max)
        return _clip_limit(state.gamma, k_max)

    def update(self, state, n_drafted, n_accepted, active):
        k_max = self._required_k_max()
        all_accepted = n_accepted >= n_drafted
        gamma = jnp.where(
            all_accepted,
            jnp.minimum(state.gamma + self.increase, k_max),
            jnp.maximum(state.gamma - self.decrease, self.min_gamma),
        ).astype(jnp.int32)
        return HeuristicState(
            gamma=jnp.where(active, gamma, state.gamma), rounds=_count_rounds(state.rounds, active)
        )


# ------------------------------------------------------------------------------------------------
# AdaEDL
# ------------------------------------------------------------------------------------------------


@struct.dataclass
class AdaEDLState:
    lam: jax.Array  # [B] float32: stop threshold lambda
    acc_rate: jax.Array  # [B] float32: EMA of the per-round acceptance rate (AR)
    rounds: jax.Array  # [B] int32


@dataclasses.dataclass(frozen=True)
class AdaEDLPolicy(Policy):
    """AdaEDL: stop after a draft token with ``1 - sqrt(gamma * H) < lambda``; lambda adapts per row.

    [I] reconstruction. Source: docs/OPEN-POINTS.md section 1 (no primary text; three independent
    reimplementations agree on the stop rule and gamma = 0.2). After each round, with
    ``n_drafted`` drafted and ``n_acc`` accepted::

        AR     <- beta1 * AR + (1 - beta1) * n_acc / n_drafted
        lam'   =  lam + step   if AR < target_rate
        rule A:   lam - step   elif n_acc != L                      (reimplementation A, default)
        rule B:   lam - step   elif AR > target_rate and n_acc == L (reimplementation B)
                  lam          otherwise
        lam    <- beta2 * lam + (1 - beta2) * lam'

    with ``L = k_max`` (the engine's maximum draft length). Defaults (A's, said to be the paper's):
    beta1 0.5, beta2 0.9, step 0.01, target_rate 0.9, lambda_init 0.5. ``ar_init=None`` starts AR
    at target_rate (A); reimplementation B starts it at 0. Which branch the paper uses was not
    checked; under rule B lambda can fall only after a round where all k_max drafts were accepted.
    round_limit is always k_max.
    """

    name = "adaedl"
    needs_draft_logits = True

    gamma: float = 0.2
    lambda_init: float = 0.5
    beta1: float = 0.5
    beta2: float = 0.9
    step: float = 0.01
    target_rate: float = 0.9
    ar_init: float | None = None
    lambda_rule: str = "A"

    def __post_init__(self):
        if self.lambda_rule not in ("A", "B"):
            raise ValueError(f"lambda_rule must be 'A' or 'B', got {self.lambda_rule!r}")

    def initial_thresholds(self, batch: int) -> tuple[jax.Array, jax.Array]:
        ar = self.target_rate if self.ar_init is None else self.ar_init
        return jnp.full((batch,), self.lambda_init, jnp.float32), jnp.full((batch,), ar, jnp.float32)

    def next_thresholds(
        self,
        lam: jax.Array,
        acc_rate: jax.Array,
        n_drafted: jax.Array,
        n_accepted: jax.Array,
        max_len: int,
    ) -> tuple[jax.Array, jax.Array]:
        """One round of the online lambda update; returns ``(lam, acc_rate)``."""
        # The engine drafts at least one token; max(., 1) only guards a 0/0 on a padded row.
        round_rate = n_accepted.astype(jnp.float32) / jnp.maximum(n_drafted, 1).astype(jnp.float32)
        acc_rate = self.beta1 * acc_rate + (1.0 - self.beta1) * round_rate
        below_target = acc_rate < self.target_rate
        full_accept = n_accepted == max_len
        if self.lambda_rule == "A":
            lower = ~full_accept
        else:
            lower = (acc_rate > self.target_rate) & full_accept
        proposal = jnp.where(below_target, lam + self.step, jnp.where(lower, lam - self.step, lam))
        lam = self.beta2 * lam + (1.0 - self.beta2) * proposal
        return lam, acc_rate

    def init(self, batch, key):
        del key
        lam, acc_rate = self.initial_thresholds(batch)
        return AdaEDLState(lam=lam, acc_rate=acc_rate, rounds=jnp.zeros((batch,), jnp.int32))

    def stop(self, state, step, draft_logits):
        return adaedl_stop(softmax_entropy(draft_logits), state.lam, self.gamma)

    def update(self, state, n_drafted, n_accepted, active):
        lam, acc_rate = self.next_thresholds(
            state.lam, state.acc_rate, n_drafted, n_accepted, self._required_k_max()
        )
        return AdaEDLState(
            lam=jnp.where(active, lam, state.lam),
            acc_rate=jnp.where(active, acc_rate, state.acc_rate),
            rounds=_count_rounds(state.rounds, active),
        )


# ------------------------------------------------------------------------------------------------
# TapOut
# ------------------------------------------------------------------------------------------------


@struct.dataclass
class TapOutState:
    counts: jax.Array  # [B, A] int32: rounds each arm was played
    means: jax.Array  # [B, A] float32: mean reward of each arm
    arm: jax.Array  # [B] int32: arm chosen for the coming round
    lam: jax.Array  # [B] float32: the AdaEDL arm's threshold
    acc_rate: jax.Array  # [B] float32: the AdaEDL arm's acceptance-rate EMA
    key: jax.Array  # [B, 2] uint32: Thompson sampling randomness
    rounds: jax.Array  # [B] int32


def ucb1_choice(counts: jax.Array, means: jax.Array, exploration: float) -> jax.Array:
    """UCB1 per row: an untried arm first (lowest index), else argmax ``mean + c*sqrt(2 ln t / n)``
    with t the row's total number of plays."""
    plays = jnp.maximum(jnp.sum(counts, axis=-1, keepdims=True), 1).astype(jnp.float32)
    n = jnp.maximum(counts, 1).astype(jnp.float32)
    score = means + exploration * jnp.sqrt(2.0 * jnp.log(plays) / n)
    score = jnp.where(counts == 0, jnp.inf, score)
    return jnp.argmax(score, axis=-1).astype(jnp.int32)


def thompson_choice(counts: jax.Array, means: jax.Array, keys: jax.Array) -> jax.Array:
    """Beta-posterior Thompson sampling per row: a reward r in [0, 1] counts as r successes and
    1 - r failures on a uniform Beta(1, 1) prior, so arm a's posterior is
    ``Beta(1 + n_a * mean_a, 1 + n_a * (1 - mean_a))``. keys: [B, 2] raw keys."""
    n = counts.astype(jnp.float32)
    alpha = 1.0 + n * means
    beta = 1.0 + n * (1.0 - means)
    draws = jax.vmap(lambda k, a, b: jax.random.beta(k, a, b))(keys, alpha, beta)
    return jnp.argmax(draws, axis=-1).astype(jnp.int32)


@dataclasses.dataclass(frozen=True)
class TapOutPolicy(Policy):
    """TapOut: a per-row bandit picks, for each round, one parameter-free stop rule ("arm"); the
    chosen arm makes that round's token-by-token stop decisions.

    [I] reconstruction. Source: docs/ALGORITHMS.md section 5 and OPEN-POINTS.md section 2 (only
    the abstract and secondary summaries were available: sequence-level UCB1 by default, Thompson
    as an alternative, a blended length/rate reward, a logit-margin arm). Everything below is a
    configurable choice:

    * arms (``arms``, any subset of TAPOUT_ARMS, in this order by default): ``logit_margin`` stops
      if p1 - p2 < p2; ``max_conf`` if p1 < ``max_conf_threshold`` (0.5); ``svip`` and ``adaedl``
      with their own defaults (``svip``/``adaedl`` fields; the AdaEDL arm keeps its own per-row
      lambda); ``static`` never stops (drafts k_max).
    * reward after verification: ``w * n_acc / k_max + (1 - w) * n_acc / max(n_drafted, 1)``,
      ``w = reward_weight = 0.5``; both terms lie in [0, 1].
    * ``bandit="ucb1"``: each arm once first, then argmax ``mean + exploration * sqrt(2 ln t / n)``
      (exploration 1.0 = textbook UCB1); ``bandit="thompson"``: Beta posterior (see
      ``thompson_choice``), with a per-row PRNG key in the state.
    * The AdaEDL arm's lambda learns only from rounds it played
      (``adaedl_learns_from_all_arms=False``): its update reacts to the draft lengths it chose.
    * Bandit state lives in the policy state; it persists across prompts exactly as long as the
      engine keeps the state (re-``init`` to reset).

    The arm for the coming round is chosen at ``init`` and at the end of each ``update``, and kept in
    ``state.arm``; round_limit is k_max for every row (the chosen arm decides where to stop).
    """

    name = "tapout"
    needs_draft_logits = True

    arms: tuple[str, ...] = TAPOUT_ARMS
    bandit: str = "ucb1"
    exploration: float = 1.0
    reward_weight: float = 0.5
    max_conf_threshold: float = 0.5
    svip: SVIPPolicy = SVIPPolicy()
    adaedl: AdaEDLPolicy = AdaEDLPolicy()
    adaedl_learns_from_all_arms: bool = False

    def __post_init__(self):
        object.__setattr__(self, "arms", tuple(self.arms))
        unknown = [a for a in self.arms if a not in TAPOUT_ARMS]
        if unknown or not self.arms or len(set(self.arms)) != len(self.arms):
            raise ValueError(
                f"arms must be distinct names from {TAPOUT_ARMS}, got {self.arms!r}"
            )
        if self.bandit not in ("ucb1", "thompson"):
            raise ValueError(f"bandit must be 'ucb1' or 'thompson', got {self.bandit!r}")

    def _choose(self, counts, means, keys):
        """(arm [B], keys after use [B, 2])."""
        if self.bandit == "ucb1":
            return ucb1_choice(counts, means, self.exploration), keys
        split = jax.vmap(jax.random.split)(keys)  # [B, 2, 2]
        return thompson_choice(counts, means, split[:, 1]), split[:, 0]

    def init(self, batch, key):
        num_arms = len(self.arms)
        counts = jnp.zeros((batch, num_arms), jnp.int32)
        means = jnp.zeros((batch, num_arms), jnp.float32)
        arm, keys = self._choose(counts, means, _row_keys(key, batch))
        lam, acc_rate = self.adaedl.initial_thresholds(batch)
        return TapOutState(
            counts=counts, means=means, arm=arm, lam=lam, acc_rate=acc_rate, key=keys,
            rounds=jnp.zeros((batch,), jnp.int32),
        )

    def arm_stop_flags(self, state: TapOutState, draft_logits: jax.Array) -> jax.Array:
        """[B, A] bool: each arm's stop decision for this draft token."""
        log_probs = draft_log_probs(draft_logits)
        entropy = entropy_from_log_probs(log_probs)
        top1, top2 = top_two_probs(log_probs)
        rules = {
            "logit_margin": lambda: logit_margin_stop(top1, top2),
            "max_conf": lambda: max_confidence_stop(top1, self.max_conf_threshold),
            "svip": lambda: svip_stop(entropy, self.svip.entropy_scale, self.svip.threshold),
            "adaedl": lambda: adaedl_stop(entropy, state.lam, self.adaedl.gamma),
            "static": lambda: jnp.zeros_like(top1, jnp.bool_),
        }
        return jnp.stack([rules[a]() for a in self.arms], axis=-1)

    def stop(self, state, step, draft_logits):
        flags = self.arm_stop_flags(state, draft_logits)
        return jnp.take_along_axis(flags, state.arm[:, None], axis=-1)[:, 0]

    def reward(self, n_drafted: jax.Array, n_accepted: jax.Array, k_max: int) -> jax.Array:
        n_acc = n_accepted.astype(jnp.float32)
        length_term = n_acc / k_max
        rate_term = n_acc / jnp.maximum(n_drafted, 1).astype(jnp.float32)
        return self.reward_weight * length_term + (1.0 - self.reward_weight) * rate_term

    def update(self, state, n_drafted, n_accepted, active):
        k_max = self._required_k_max()
        played = jax.nn.one_hot(state.arm, len(self.arms), dtype=jnp.int32)
        played = played * active[:, None].astype(jnp.int32)
        counts = state.counts + played
        reward = self.reward(n_drafted, n_accepted, k_max)
        # Incremental mean: mean += (r - mean) / n for the played arm only.
        means = state.means + played * (reward[:, None] - state.means) / jnp.maximum(counts, 1)

        lam, acc_rate = state.lam, state.acc_rate
        if "adaedl" in self.arms:
            new_lam, new_rate = self.adaedl.next_thresholds(
                lam, acc_rate, n_drafted, n_accepted, k_max
            )
            learns = active
            if not self.adaedl_learns_from_all_arms:
                learns = learns & (state.arm == self.arms.index("adaedl"))
            lam = jnp.where(learns, new_lam, lam)
            acc_rate = jnp.where(learns, new_rate, acc_rate)

        arm, keys = self._choose(counts, means, state.key)
        arm, keys = _keep_finished(active, (arm, keys), (state.arm, state.key))
        return TapOutState(
            counts=counts, means=means, arm=arm, lam=lam, acc_rate=acc_rate, key=keys,
            rounds=_count_rounds(state.rounds, active),
        )


# ------------------------------------------------------------------------------------------------
# LDLP (AdaEAGLE) and AdaEAGLE-DDD
# ------------------------------------------------------------------------------------------------


@struct.dataclass
class LDLPState:
    params: Any  # LDLP weights, shared by all rows (no batch dim)
    predicted_len: jax.Array  # [B] int32: this round's LDLP length (DDD mode)
    cum_logprob: jax.Array  # [B] float32: this round's draft log-prob so far (DDD mode)
    rounds: jax.Array  # [B] int32


def length_from_prediction(prediction: jax.Array, k_max: int) -> jax.Array:
    """``clip(round(prediction), 1, k_max)``; a non-finite prediction drafts k_max.

    The paper allows a length of 0 (skip drafting); jspec always drafts at least one token, since
    the engine's round is built around one draft + verify step.
    """
    safe = jnp.where(jnp.isfinite(prediction), prediction, k_max)
    return _clip_limit(jnp.round(jnp.clip(safe, 0, k_max)), k_max)


@dataclasses.dataclass(frozen=True)
class LDLPPolicy(Policy):
    """AdaEAGLE: draft ``clip(round(LDLP(e, f)), 1, k_max)`` tokens, predicted before drafting
    from the last accepted token's embedding ``e`` and final-normed target feature ``f``
    (``features["token_embedding"]``, ``features["target_feature"]``); see ``jspec.ldlp``.

    Predictor weights are data, not configuration, so they live in the state (shared by all rows,
    without a batch dim): ``policy.init(batch, key, params=trained)``. Without ``params``, init
    draws random (untrained) weights of width ``d_model``, which is only useful for smoke tests.

    ``ddd=True``: AdaEAGLE-DDD (OPEN-POINTS section 3): keep drafting past the LDLP length while
    the draft sequence's cumulative log-prob is >= ``ddd_threshold`` (-0.6, the paper's value);
    stop only when both ``step + 1 >= predicted length`` and ``cum_logprob < ddd_threshold``. So
    the longer of the two lengths is drafted, up to k_max. This needs in-round state: use
    ``start_round`` / ``observe`` (``observe`` adds log q(draft_token), or the top log-prob when
    no token is given, i.e. greedy drafting as in the paper); the plain calls raise.
    """

    name = "ldlp"

    ddd: bool = False
    ddd_threshold: float = -0.6
    d_model: int | None = None
    hidden: int = ldlp_lib.DEFAULT_HIDDEN
    num_layers: int = ldlp_lib.DEFAULT_NUM_LAYERS

    @property
    def needs_draft_logits(self) -> bool:  # type: ignore[override]
        return self.ddd

    @property
    def needs_in_round_state(self) -> bool:  # type: ignore[override]
        return self.ddd

    def init(self, batch, key, params=None):
        if params is None:
            if self.d_model is None:
                raise ValueError(
                    "ldlp needs predictor weights: init(batch, key, params=...) "
                    "(or set d_model for random, untrained weights)"
                )
            params = ldlp_lib.init_ldlp(
                self.d_model, key, hidden=self.hidden, num_layers=self.num_layers
            )
        return LDLPState(
            params=jax.tree_util.tree_map(jnp.asarray, params),
            predicted_len=jnp.ones((batch,), jnp.int32),
            cum_logprob=jnp.zeros((batch,), jnp.float32),
            rounds=jnp.zeros((batch,), jnp.int32),
        )

    def _predicted_length(self, state: LDLPState, k_max: int, features: Features) -> jax.Array:
        if not features or "token_embedding" not in features or "target_feature" not in features:
            raise ValueError("ldlp needs features['token_embedding'] and features['target_feature']")
        prediction = ldlp_lib.ldlp_apply(
            state.params, features["token_embedding"], features["target_feature"]
        )
        return length_from_prediction(prediction, k_max)

    def _plain_calls_unsupported(self) -> None:
        if self.ddd:
            raise ValueError(
                "ldlp with ddd=True keeps in-round state: call start_round(...) and observe(...) "
                "instead of round_limit(...) and stop(...)"
            )

    def round_limit(self, state, k_max, features=None):
        self._plain_calls_unsupported()
        self._check_k_max(k_max)
        return self._predicted_length(state, k_max, features)

    def stop(self, state, step, draft_logits):
        self._plain_calls_unsupported()
        return _never_stop(draft_logits)

    def start_round(self, state, k_max, features=None):
        if not self.ddd:
            return super().start_round(state, k_max, features)
        self._check_k_max(k_max)
        predicted = self._predicted_length(state, k_max, features)
        state = state.replace(
            predicted_len=predicted, cum_logprob=jnp.zeros_like(state.cum_logprob)
        )
        return state, _full_limit(predicted.shape[0], k_max)

    def observe(self, state, step, draft_logits, draft_token=None):
        if not self.ddd:
            return super().observe(state, step, draft_logits, draft_token)
        log_probs = draft_log_probs(draft_logits)
        if draft_token is None:
            token_logprob = jnp.max(log_probs, axis=-1)
        else:
            token_logprob = jnp.take_along_axis(
                log_probs, draft_token[:, None].astype(jnp.int32), axis=-1
            )[:, 0]
        cum_logprob = state.cum_logprob + token_logprob
        reached_length = step + 1 >= state.predicted_len
        stop = reached_length & (cum_logprob < self.ddd_threshold)
        return state.replace(cum_logprob=cum_logprob), stop


# ------------------------------------------------------------------------------------------------
# ADL (DiffuSpec)
# ------------------------------------------------------------------------------------------------


@struct.dataclass
class ADLState:
    gen_ema: jax.Array  # [B] float32: EMA of generated (drafted) length, G-bar
    acc_ema: jax.Array  # [B] float32: EMA of accepted length, A-bar
    next_k: jax.Array  # [B] int32: draft length for the next round; 0 = first round (upper bound)
    rounds: jax.Array  # [B] int32


ADL_PAPER_DEFAULTS = {"k_min": 20, "k_max_adl": 30, "delta": 10, "rho": 0.5}


@dataclasses.dataclass(frozen=True)
class ADLPolicy(Policy):
    """DiffuSpec's adaptive draft length (docs/ALGORITHMS.md section 9), per row::

        G <- (1 - rho) G + rho * n_drafted,   A <- (1 - rho) A + rho * n_accepted   (both start 0)
        k_next = clip(floor(G) + delta * [A >= G], k_min, k_upper),   k_1 = k_upper

    ``k_upper = k_max_adl`` if set, else the engine's k_max; round_limit also clips to the engine's
    k_max. The generated length of an autoregressive drafter is n_drafted (the engine already
    stops drafting at EOS).

    The paper's values (k_min 20, k_max 30, delta 10, rho 0.5; ``ADL_PAPER_DEFAULTS``,
    ``ADLPolicy.paper()``) are for a diffusion drafter that drafts 20-30 tokens per pass.
    [I] reconstruction, source: none (library choice): for an autoregressive drafter the defaults
    scale to the engine: ``k_min = 1``, ``delta = max(1, k_upper // 3)``.
    """

    name = "adl"

    rho: float = 0.5
    k_min: int = 1
    delta: int | None = None
    k_max_adl: int | None = None

    @classmethod
    def paper(cls, **overrides) -> "ADLPolicy":
        return cls(**{**ADL_PAPER_DEFAULTS, **overrides})

    def _upper(self) -> int:
        return self.k_max_adl if self.k_max_adl is not None else self._required_k_max()

    def _delta(self) -> int:
        return self.delta if self.delta is not None else max(1, self._upper() // 3)

    def init(self, batch, key):
        del key
        return ADLState(
            gen_ema=jnp.zeros((batch,), jnp.float32),
            acc_ema=jnp.zeros((batch,), jnp.float32),
            next_k=jnp.zeros((batch,), jnp.int32),
            rounds=jnp.zeros((batch,), jnp.int32),
        )

    def round_limit(self, state, k_max, features=None):
        self._check_k_max(k_max)
        first_k = self.k_max_adl if self.k_max_adl is not None else k_max
        return _clip_limit(jnp.where(state.next_k > 0, state.next_k, first_k), k_max)

    def update(self, state, n_drafted, n_accepted, active):
        upper = self._upper()
        gen_ema = (1.0 - self.rho) * state.gen_ema + self.rho * n_drafted.astype(jnp.float32)
        acc_ema = (1.0 - self.rho) * state.acc_ema + self.rho * n_accepted.astype(jnp.float32)
        bonus = jnp.where(acc_ema >= gen_ema, self._delta(), 0)
        next_k = jnp.clip(jnp.floor(gen_ema).astype(jnp.int32) + bonus, self.k_min, upper)
        gen_ema, acc_ema, next_k = _keep_finished(
            active,
            (gen_ema, acc_ema, next_k.astype(jnp.int32)),
            (state.gen_ema, state.acc_ema, state.next_k),
        )
        return ADLState(
            gen_ema=gen_ema, acc_ema=acc_ema, next_k=next_k,
            rounds=_count_rounds(state.rounds, active),
        )


# ------------------------------------------------------------------------------------------------
# Registry
# ------------------------------------------------------------------------------------------------

_POLICY_CLASSES: dict[str, type[Policy]] = {
    cls.name: cls
    for cls in (
        StaticPolicy, ConfidencePolicy, HeuristicPolicy, SVIPPolicy, AdaEDLPolicy, TapOutPolicy,
        LDLPPolicy, ADLPolicy,
    )
}
assert tuple(_POLICY_CLASSES) == POLICY_NAMES


def make_policy(name: str, **overrides) -> Policy:
    """Build the policy called ``name`` (one of POLICY_NAMES) with field overrides, e.g.
    ``make_policy("adaedl", k_max=8, lambda_rule="B")``."""
    if name not in _POLICY_CLASSES:
        raise ValueError(f"unknown policy {name!r}; valid names: {', '.join(POLICY_NAMES)}")
    cls = _POLICY_CLASSES[name]
    fields = [f.name for f in dataclasses.fields(cls)]
    unknown = sorted(set(overrides) - set(fields))
    if unknown:
        hint = ""
        if name == "ldlp" and "params" in unknown:
            hint = " (predictor weights are state: pass them to init(batch, key, params=...))"
        raise ValueError(
            f"policy {name!r} has no field(s) {', '.join(unknown)}; valid fields: "
            f"{', '.join(fields)}{hint}"
        )
    return cls(**overrides)
