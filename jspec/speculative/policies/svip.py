"""SVIP: stop drafting once the draft distribution's entropy bound says the next token is
unlikely to be accepted."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from .base import Policy, softmax_entropy


def svip_stop(entropy: jax.Array, entropy_scale: float, threshold: float) -> jax.Array:
    """SVIP: stop when ``sqrt(entropy_scale * H) > threshold``."""
    return jnp.sqrt(entropy_scale * entropy) > threshold


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
