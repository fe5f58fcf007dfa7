"""Rules without learned state: a fixed draft length (static), the max-confidence stop
(confidence), and Hugging Face transformers' +2/-1 schedule (heuristic)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import struct

from .base import Policy, clip_limit, count_rounds


def max_confidence_stop(top1: jax.Array, threshold: float) -> jax.Array:
    return top1 < threshold


@dataclasses.dataclass(frozen=True)
class StaticPolicy(Policy):
    """Fixed draft length ``k`` every round (``k=None``: the engine's ``k_max``); never stops early."""

    name = "static"
    cuts_trees = False  # a full tree every round

    k: int | None = None

    def round_limit(self, state, k_max, features=None):
        self._check_k_max(k_max)
        return jnp.full(state.rounds.shape, self.fixed_steps(k_max), jnp.int32)

    def fixed_steps(self, k_max):
        return max(1, min(k_max if self.k is None else self.k, k_max))


@dataclasses.dataclass(frozen=True)
class ConfidencePolicy(Policy):
    """Max-confidence stop: stop after a draft token whose top softmax probability is < threshold.

    Default threshold 0.5, [I] reconstruction (docs/methods.md §3.2): the same constant as TapOut's
    reconstructed max-confidence arm; for comparison Hugging Face transformers' assistant
    confidence threshold defaults to 0.4. Tuned baselines sweep it per task (``threshold=``).
    """

    name = "confidence"
    needs_draft_logits = True

    threshold: float = 0.5

    def stop_from_stats(self, state, step, stats):
        return max_confidence_stop(stats.top1, self.threshold)


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
    budget). A round that drafted nothing (an n-gram miss) tells nothing about the draft length,
    so it leaves gamma unchanged. The cap at k_max follows SVIP's copy of this schedule (which
    caps at 40).
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
        return clip_limit(state.gamma, k_max)

    def update(self, state, n_drafted, n_accepted, active):
        k_max = self._required_k_max()
        all_accepted = n_accepted >= n_drafted
        gamma = jnp.where(
            all_accepted,
            jnp.minimum(state.gamma + self.increase, k_max),
            jnp.maximum(state.gamma - self.decrease, self.min_gamma),
        ).astype(jnp.int32)
        changes = active & (n_drafted > 0)
        return HeuristicState(
            gamma=jnp.where(changes, gamma, state.gamma), rounds=count_rounds(state.rounds, active)
        )
