"""AdaEDL: an entropy-based lower bound on acceptance, compared with a per-row threshold lambda
that adapts to the observed acceptance rate."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import struct

from .base import Policy, count_rounds


def adaedl_stop(entropy: jax.Array, lam: jax.Array, gamma: float) -> jax.Array:
    """AdaEDL: stop when the acceptance lower bound ``1 - sqrt(gamma * H)`` falls below ``lam``."""
    return 1.0 - jnp.sqrt(gamma * entropy) < lam


@struct.dataclass
class AdaEDLState:
    lam: jax.Array  # [B] float32: stop threshold lambda
    acc_rate: jax.Array  # [B] float32: EMA of the per-round acceptance rate (AR)
    rounds: jax.Array  # [B] int32


@dataclasses.dataclass(frozen=True)
class AdaEDLPolicy(Policy):
    """AdaEDL: before drafting the next token, stop if ``1 - sqrt(gamma * H(q)) < lambda``, where
    q is the distribution that token would be drawn from; lambda adapts per row.

    The token whose distribution triggers the stop is not drafted (``stops_before_drafting``), so
    it is neither verified nor counted in lambda's update. The first ``min_draft = 1`` tokens of a
    round are drafted unchecked (reimplementation A: a round with no draft would make the
    acceptance rate 0/0).

    [I] ``keep_checked_token=True`` (jspec's option, not the paper's; `jspec calibrate` fits it per
    head and card): draft that token after all, then stop. Its distribution came from a draft
    forward that already ran, and a chain verifies its padded block of k_max + 1 whatever the
    draft's length, so the token costs nothing more and may be accepted; it then counts in
    lambda's update like any drafted token. False (the default) drops it as the paper does.

    [I] reconstruction. Source: docs/methods.md §3.5 (no primary text; three independent
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
    min_draft: int = 1
    keep_checked_token: bool = False

    def __post_init__(self):
        if self.lambda_rule not in ("A", "B"):
            raise ValueError(f"lambda_rule must be 'A' or 'B', got {self.lambda_rule!r}")
        if self.min_draft < 1:
            raise ValueError(f"min_draft must be >= 1 (the engine drafts at least one token), got {self.min_draft}")

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
        # The engine drafts at least one token (min_draft); max(., 1) only guards a 0/0 on a
        # round with no draft (a finished row, or an EOS-only round).
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

    def stop_from_stats(self, state, step, stats):
        """Stop before drafting token ``step`` (never before the first ``min_draft``)."""
        return adaedl_stop(stats.entropy, state.lam, self.gamma) & (step >= self.min_draft)

    @property
    def stops_before_drafting(self) -> jax.Array:
        """Unless ``keep_checked_token`` (a float 0/1 while calibration replays constants vmapped)."""
        return jnp.asarray(self.keep_checked_token) == 0

    def update(self, state, n_drafted, n_accepted, active):
        lam, acc_rate = self.next_thresholds(
            state.lam, state.acc_rate, n_drafted, n_accepted, self._required_k_max()
        )
        return AdaEDLState(
            lam=jnp.where(active, lam, state.lam),
            acc_rate=jnp.where(active, acc_rate, state.acc_rate),
            rounds=count_rounds(state.rounds, active),
        )
