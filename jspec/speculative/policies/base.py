"""Dynamic draft-length policies for chain speculative decoding: device-side, pure and jittable.

The engine runs one round per target call for a batch of ``B`` rows, each row with its own state::

    state = policy.init(B, key)
    # each round, inside the engine's jitted loop:
    limit = policy.round_limit(state, k_max, features)          # [B] int32 in [1, k_max]
    # draft token `step` = 0, 1, ... while step < limit and not stopped:
    stop = policy.stop(state, step, draft_logits)               # [B] bool
    skip = stop & policy.stop_skips_token(state)                # [B] bool: token `step` not drafted
    # verify, then:
    state = policy.update(state, n_drafted, n_accepted, active)

When a rule decides matters. Most rules look at the distribution a token was drawn from and stop
AFTER it (SVIP, max-confidence): that token is kept. AdaEDL decides BEFORE drafting the next token:
when its stop fires at ``step``, the token of that step is not drafted (not verified, not counted
in ``n_drafted``). ``stop_skips_token(state)`` says which applies, per row (TapOut's depends on the
arm it plays). The first token of a round (step 0) is always drafted, whatever the rule says.

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


Features = dict[str, jax.Array] | None

# ------------------------------------------------------------------------------------------------
# Pure statistics of one draft distribution (the stop predicates built on them live with their
# policies: svip.py, adaedl.py, static.py, tapout.py).
# ------------------------------------------------------------------------------------------------


def draft_log_probs(draft_logits: jax.Array) -> jax.Array:
    return jax.nn.log_softmax(draft_logits.astype(jnp.float32), axis=-1)


def entropy_from_log_probs(log_probs: jax.Array) -> jax.Array:
    """Entropy in nats over the last axis; entries with probability 0 (logit -inf) contribute 0."""
    probs = jnp.exp(log_probs)
    # p * log p is 0 * -inf = nan for masked entries; their true contribution is 0.
    terms = jnp.where(probs > 0, probs * log_probs, 0.0)
    return jnp.maximum(-jnp.sum(terms, axis=-1), 0.0)


def _merge_top_two(a, b):
    """The two largest of two (largest, second largest) pairs: associative and commutative."""
    (a1, a2), (b1, b2) = a, b
    return jnp.maximum(a1, b1), jnp.maximum(jnp.minimum(a1, b1), jnp.maximum(a2, b2))


def top_two_probs(log_probs: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Largest and second-largest probability over the last axis (a tie counts twice, as top_k
    would). One pass: a reduction over (value, -inf) pairs, which has no dependence on another
    reduction's result, so it can share a kernel with the entropy's over the same row, where
    argmax, a gather and a masked max ran one after another. TapOut reads all three statistics at
    every draft step, max-confidence the first."""
    ninf = jnp.array(-jnp.inf, log_probs.dtype)
    top1, top2 = jax.lax.reduce((log_probs, jnp.full_like(log_probs, -jnp.inf)), (ninf, ninf), _merge_top_two,
                                (log_probs.ndim - 1,))
    return jnp.exp(top1), jnp.exp(top2)


def softmax_entropy(draft_logits: jax.Array) -> jax.Array:
    return entropy_from_log_probs(draft_log_probs(draft_logits))


@struct.dataclass
class DraftStats:
    """What the stop rules read of one draft distribution, per row [B]. The rules take these
    (`Policy.stop_from_stats`) rather than logits, so that calibration can replay recorded
    rounds through the policies' own rules (policies.calibration)."""

    entropy: jax.Array  # nats
    top1: jax.Array  # largest probability
    top2: jax.Array  # second largest
    token_logprob: jax.Array  # log q of the drafted token (the top log-prob when none is given)


def draft_stats(draft_logits: jax.Array, draft_token: jax.Array | None = None) -> DraftStats:
    log_probs = draft_log_probs(draft_logits)
    top1, top2 = top_two_probs(log_probs)
    if draft_token is None:
        token_logprob = jnp.max(log_probs, axis=-1)
    else:
        token_logprob = jnp.take_along_axis(log_probs, draft_token[:, None].astype(jnp.int32), axis=-1)[:, 0]
    return DraftStats(entropy_from_log_probs(log_probs), top1, top2, token_logprob)


# ------------------------------------------------------------------------------------------------
# Helpers shared by the policies
# ------------------------------------------------------------------------------------------------


def keep_finished(active: jax.Array, new: Any, old: Any) -> Any:
    """Take ``new`` for active rows and ``old`` for finished ones, leaf by leaf (leading dim B)."""

    def pick(n, o):
        mask = active.reshape(active.shape + (1,) * (n.ndim - 1))
        return jnp.where(mask, n, o)

    return jax.tree_util.tree_map(pick, new, old)


def full_limit(batch: int, k_max: int) -> jax.Array:
    return jnp.full((batch,), k_max, jnp.int32)


def clip_limit(limit: jax.Array, k_max: int) -> jax.Array:
    return jnp.clip(limit, 1, k_max).astype(jnp.int32)


def never_stop(draft_logits: jax.Array) -> jax.Array:
    return jnp.zeros(draft_logits.shape[:1], jnp.bool_)


def count_rounds(rounds: jax.Array, active: jax.Array) -> jax.Array:
    return rounds + active.astype(rounds.dtype)


def row_keys(key: jax.Array, batch: int) -> jax.Array:
    """One raw uint32 PRNG key per row (raw keys work with jnp.where and any key style input)."""
    keys = jax.random.split(key, batch)
    if jax.dtypes.issubdtype(keys.dtype, jax.dtypes.prng_key):
        keys = jax.random.key_data(keys)
    return keys


@struct.dataclass
class RoundCountState:
    """State of the stateless rules: just the number of verified rounds per row."""

    rounds: jax.Array  # [B] int32


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
    stops_before_drafting = False  # see stop_skips_token
    # trees (engines.tree): whether this policy's cuts get the machinery that turns them into saved
    # work (per-round verify block sizes, optionally skipped levels). Each piece is a data-dependent
    # branch with a cost of its own; a policy whose cuts cannot pay says False.
    cuts_trees = True

    k_max: int | None = None

    # -- the four engine calls ------------------------------------------------------------------
    def init(self, batch: int, key: jax.Array) -> Any:
        del key
        return RoundCountState(rounds=jnp.zeros((batch,), jnp.int32))

    def round_limit(self, state: Any, k_max: int, features: Features = None) -> jax.Array:
        self._check_k_max(k_max)
        return full_limit(state.rounds.shape[0], k_max)

    def stop(self, state: Any, step: jax.Array, draft_logits: jax.Array) -> jax.Array:
        """Stop after (or, `stop_skips_token`, before) draft token `step`: the rule of
        `stop_from_stats` on the distribution's statistics."""
        if type(self).stop_from_stats is Policy.stop_from_stats:
            return never_stop(draft_logits)
        return self.stop_from_stats(state, step, draft_stats(draft_logits))

    def stop_from_stats(self, state: Any, step: jax.Array, stats: DraftStats) -> jax.Array:
        """[B] bool: the stop rule on a draft distribution's statistics (default: never)."""
        return jnp.zeros(stats.top1.shape, jnp.bool_)

    def update(
        self, state: Any, n_drafted: jax.Array, n_accepted: jax.Array, active: jax.Array
    ) -> Any:
        return state.replace(rounds=count_rounds(state.rounds, active))

    @property
    def stops_in_round(self) -> bool:
        """Whether `stop` / `observe` can end a row's draft before its round limit. A round under a
        rule that cannot is drafted as max(limit) steps, a loop whose length the compiler knows
        (engines.chain.draft_autoregressive)."""
        cls = type(self)
        return cls.stop is not Policy.stop or cls.stop_from_stats is not Policy.stop_from_stats or cls.observe is not Policy.observe

    def fixed_steps(self, k_max: int) -> int | None:
        """The draft length of every round and row when the policy fixes it before tracing (static);
        None when it is decided on the device. A fixed length drafts in a loop the compiler knows,
        with no branch on the round's step count."""
        return None

    def stop_skips_token(self, state: Any) -> jax.Array:
        """[B] bool: True where a stop at this step drops the step's token (a rule checked before
        drafting it, AdaEDL); False where the token that triggered the stop is kept."""
        return jnp.full(state.rounds.shape, self.stops_before_drafting)

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
