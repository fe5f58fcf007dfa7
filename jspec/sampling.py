"""Turning logits into tokens: temperature, top-k, top-p, applied identically to target and draft.

Speculative sampling is lossless only if the target distribution p and the draft distribution q
are processed by the same function, so every place that needs a distribution calls `logprobs`.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from .kernels.top_k import top_k

NEG_INF = -jnp.inf


@dataclasses.dataclass(frozen=True)
class Sampling:
    """Static sampling settings (hashable: part of the jitted function's identity)."""

    temperature: float = 0.0  # 0 means greedy (argmax)
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1 = off

    def __post_init__(self):
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


GREEDY = Sampling()


def logprobs(logits: jax.Array, sampling: Sampling) -> jax.Array:
    """Log-probabilities [..., V] after temperature, top-k and top-p (masked entries are -inf)."""
    x = logits.astype(jnp.float32)
    if not sampling.greedy:
        x = x / sampling.temperature
    if sampling.top_k:
        kth = top_k(x, sampling.top_k)[0][..., -1:]
        x = jnp.where(x < kth, NEG_INF, x)
    if sampling.top_p < 1.0:
        # Keep the smallest set of tokens whose probability mass reaches top_p (the token that
        # crosses the threshold is kept), computed on sorted probabilities.
        order = jnp.argsort(-x, axis=-1)
        sorted_x = jnp.take_along_axis(x, order, axis=-1)
        sorted_p = jax.nn.softmax(sorted_x, axis=-1)
        mass_before = jnp.cumsum(sorted_p, axis=-1) - sorted_p
        keep_sorted = mass_before < sampling.top_p
        keep = jnp.zeros_like(keep_sorted).at[
            tuple(jnp.indices(order.shape)[:-1]) + (order,)
        ].set(keep_sorted)
        x = jnp.where(keep, x, NEG_INF)
    return jax.nn.log_softmax(x, axis=-1)


def probs(logits: jax.Array, sampling: Sampling) -> jax.Array:
    return jnp.exp(logprobs(logits, sampling))


def sample(key: jax.Array, logits: jax.Array, sampling: Sampling) -> jax.Array:
    """One token per row of logits [..., V]; argmax when greedy."""
    if sampling.greedy:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    return jax.random.categorical(key, logprobs(logits, sampling), axis=-1).astype(jnp.int32)


def entropy(logits: jax.Array) -> jax.Array:
    """Entropy in nats of softmax(logits), computed stably in float32."""
    x = logits.astype(jnp.float32)
    lse = jax.nn.logsumexp(x, axis=-1)
    p = jnp.exp(x - lse[..., None])
    return lse - jnp.sum(p * x, axis=-1)
