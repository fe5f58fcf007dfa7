"""TapOut: a per-row bandit that picks, each round, one parameter-free stop rule (an "arm")."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import struct

from .adaedl import AdaEDLPolicy, adaedl_stop
from .base import DraftStats, Policy, count_rounds, draft_stats, keep_finished, row_keys
from .static import max_confidence_stop
from .svip import SVIPPolicy, svip_stop


TAPOUT_ARMS = ("logit_margin", "max_conf", "svip", "adaedl", "static")


def logit_margin_stop(top1: jax.Array, top2: jax.Array) -> jax.Array:
    """Stop when the runner-up is closer to the top token than the top token's lead (p1 - p2 < p2)."""
    return top1 - top2 < top2


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

    [I] reconstruction. Source: docs/methods.md §3.6 (only
    the abstract and secondary summaries were available: sequence-level UCB1 by default, Thompson
    as an alternative, a blended length/rate reward, a logit-margin arm). Everything below is a
    configurable choice:

    * arms (``arms``, any subset of TAPOUT_ARMS, in this order by default): ``logit_margin`` stops
      if p1 - p2 < p2; ``max_conf`` if p1 < ``max_conf_threshold`` (0.5); ``svip`` and ``adaedl``
      with their own defaults (``svip``/``adaedl`` fields; the AdaEDL arm keeps its own per-row
      lambda, and like AdaEDL checks before drafting: its stopping token is dropped); ``static``
      never stops (drafts k_max).
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
        arm, keys = self._choose(counts, means, row_keys(key, batch))
        lam, acc_rate = self.adaedl.initial_thresholds(batch)
        return TapOutState(
            counts=counts, means=means, arm=arm, lam=lam, acc_rate=acc_rate, key=keys,
            rounds=jnp.zeros((batch,), jnp.int32),
        )

    def arm_stop_flags(self, state: TapOutState, draft_logits: jax.Array, step=1) -> jax.Array:
        """[B, A] bool: each arm's stop decision at draft step ``step`` (the AdaEDL arm checks
        before drafting the token and never before its ``min_draft``-th)."""
        return self.arm_flags_from_stats(state, draft_stats(draft_logits), step)

    def arm_flags_from_stats(self, state: TapOutState, stats: DraftStats, step=1) -> jax.Array:
        entropy, top1, top2 = stats.entropy, stats.top1, stats.top2
        rules = {
            "logit_margin": lambda: logit_margin_stop(top1, top2),
            "max_conf": lambda: max_confidence_stop(top1, self.max_conf_threshold),
            "svip": lambda: svip_stop(entropy, self.svip.entropy_scale, self.svip.threshold),
            "adaedl": lambda: adaedl_stop(entropy, state.lam, self.adaedl.gamma) & (step >= self.adaedl.min_draft),
            "static": lambda: jnp.zeros_like(top1, jnp.bool_),
        }
        return jnp.stack([rules[a]() for a in self.arms], axis=-1)

    def stop_from_stats(self, state, step, stats):
        flags = self.arm_flags_from_stats(state, stats, step)
        return jnp.take_along_axis(flags, state.arm[:, None], axis=-1)[:, 0]

    def stop_skips_token(self, state):
        """Rows playing the AdaEDL arm stop before drafting (unless that arm keeps the checked
        token, ``AdaEDLPolicy.keep_checked_token``); the other arms keep the token."""
        if "adaedl" not in self.arms:
            return jnp.zeros(state.arm.shape, bool)
        return (state.arm == self.arms.index("adaedl")) & self.adaedl.stops_before_drafting

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
        arm, keys = keep_finished(active, (arm, keys), (state.arm, state.key))
        return TapOutState(
            counts=counts, means=means, arm=arm, lam=lam, acc_rate=acc_rate, key=keys,
            rounds=count_rounds(state.rounds, active),
        )
