"""SVIP: stop drafting once the draft distribution's entropy bound says the next token is
unlikely to be accepted."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from .base import Policy, clip_limit


def svip_stop(entropy: jax.Array, entropy_scale: float, threshold: float) -> jax.Array:
    """SVIP: stop when ``sqrt(entropy_scale * H) > threshold``."""
    return jnp.sqrt(entropy_scale * entropy) > threshold


@dataclasses.dataclass(frozen=True)
class SVIPPolicy(Policy):
    """SVIP (official code, vanilla-sd/eval_specbench.py): stop after a draft token with
    ``sqrt(entropy_scale * H) > threshold``, i.e. H > 0.6 nats with the defaults 0.15 and 0.3;
    the token that triggered the stop is kept.

    ``max_draft = 40`` is the code's hard cap on draft tokens per round. A round drafts at most
    ``min(max_draft, k_max)``: the engine's verify block holds k_max + 1 tokens (default k_max 8),
    so to follow the paper run with ``k_max=40`` (``--k-max 40``).
    """

    name = "svip"
    needs_draft_logits = True

    entropy_scale: float = 0.15
    threshold: float = 0.3
    max_draft: int = 40

    def round_limit(self, state, k_max, features=None):
        self._check_k_max(k_max)
        return clip_limit(jnp.full(state.rounds.shape, min(self.max_draft, k_max), jnp.int32), k_max)

    def stop_from_stats(self, state, step, stats):
        return svip_stop(stats.entropy, self.entropy_scale, self.threshold)
