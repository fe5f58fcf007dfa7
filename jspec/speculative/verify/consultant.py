"""Consultant Decoding's chain rule (LOSSY; same (n, next token) convention as `verify.chain`).

Accept the longest prefix of drafts whose negative log-likelihood under the TARGET's own
distribution (untempered, unfiltered softmax of its logits) is at most ``eps``; the draft's
probability plays no part. At the first failure, or after the last draft, emit the target's own
choice: argmax when greedy, else a sample of the target's sampling distribution (temperature /
top-k / top-p applied), as the user asked for.

The NLL is taken from the raw distribution so that the test measures what the target thinks of
the token, not how the user's sampler would treat it: under top-k/top-p processing every token
outside the kept set has NLL = inf and would always fail.

Variants (`ConsultantRule`):
* ``smoothing = 0`` (default): the plain rule ``nll_i <= eps`` with ``eps = 2.0`` (the paper's
  single fixed value, as reported by secondary summaries).
* ``smoothing = beta > 0``: the running-mean (smoothed) rule the summaries also describe:
  ``r_i = beta * r_{i-1} + (1 - beta) * nll_i``, accept while ``r_i <= eps`` (beta 0.2 in one
  summary). [I] r is carried per row across rounds over the emitted tokens (accepted drafts and
  the target's own token), starting at 0.

Not lossless: output does not follow the target's distribution. Opt-in only.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from ...sampling import Sampling, logprobs
from .chain import accepted_prefix

DEFAULT_EPS = 2.0


@dataclasses.dataclass(frozen=True)
class ConsultantRule:
    """Consultant Decoding's settings: threshold ``eps`` (nats) and the running-mean weight
    ``smoothing`` (beta; 0 = the plain per-token rule). Frozen: a static jit argument."""

    eps: float = DEFAULT_EPS
    smoothing: float = 0.0

    name = "consultant"

    def __post_init__(self):
        if not self.eps > 0:
            raise ValueError(f"consultant eps must be > 0 nats, got {self.eps}")
        if not 0.0 <= self.smoothing < 1.0:
            raise ValueError(f"consultant smoothing (beta) must be in [0, 1), got {self.smoothing}")

    @property
    def running(self) -> bool:
        return self.smoothing > 0


def target_nll(target_logits: jax.Array, tokens: jax.Array) -> jax.Array:
    """-log p(token) under the target's untempered, unfiltered softmax. logits [B, T, V], tokens [B, T]."""
    lp = jax.nn.log_softmax(target_logits.astype(jnp.float32), axis=-1)
    return -jnp.take_along_axis(lp, tokens[..., None], axis=-1)[..., 0]


def smoothed_nll(nll: jax.Array, beta: float, r0: jax.Array) -> jax.Array:
    """r_i = beta * r_{i-1} + (1 - beta) * nll_i along the last axis of nll [B, K], from r0 [B]."""

    def step(r, x):
        r = beta * r + (1.0 - beta) * x
        return r, r

    _, rs = jax.lax.scan(step, r0.astype(jnp.float32), jnp.moveaxis(nll, -1, 0))
    return jnp.moveaxis(rs, 0, -1)


def verify_consultant(
    key: jax.Array,
    target_logits: jax.Array,
    draft_tokens: jax.Array,
    valid: jax.Array,
    sampling: Sampling,
    rule: ConsultantRule = ConsultantRule(),
    running_nll: jax.Array | None = None,
):
    """LOSSY Consultant Decoding over a padded chain. target_logits [B, K+1, V], draft_tokens and
    valid [B, K]; running_nll [B] (r before this round) is needed when ``rule.running``.

    Returns (n accepted [B], next token [B], running_nll after the emitted tokens [B] or None)."""
    K = draft_tokens.shape[1]
    nll = target_nll(target_logits[:, :K], draft_tokens)
    if rule.running:
        score = smoothed_nll(nll, rule.smoothing, running_nll)
    else:
        score = nll
    n = accepted_prefix((score <= rule.eps) & valid)
    lp_n = jnp.take_along_axis(logprobs(target_logits, sampling), n[:, None, None], axis=1)[:, 0]
    if sampling.greedy:
        next_token = jnp.argmax(lp_n, axis=-1).astype(jnp.int32)
    else:
        next_token = jax.random.categorical(key, lp_n, axis=-1).astype(jnp.int32)
    if not rule.running:
        return n, next_token, None
    # r after the accepted prefix, then after the target's own token at position n
    r_prefix = jnp.where(n > 0, jnp.take_along_axis(score, jnp.maximum(n - 1, 0)[:, None], axis=1)[:, 0], running_nll)
    logits_n = jnp.take_along_axis(target_logits, n[:, None, None], axis=1)  # [B, 1, V]
    nll_next = target_nll(logits_n, next_token[:, None])[:, 0]
    return n, next_token, rule.smoothing * r_prefix + (1.0 - rule.smoothing) * nll_next


# The lossless rules by name: "lossless" (sampled chains: block verification) and "token" (token by token)
LOSSLESS_RULES = ("lossless", "token")


def resolve_verify(verify) -> str | ConsultantRule:
    """"lossless" (block verification) or "token" (token by token), or a ConsultantRule from
    "consultant" / a ConsultantRule."""
    if isinstance(verify, ConsultantRule):
        return verify
    if verify == "consultant":
        return ConsultantRule()
    if verify in LOSSLESS_RULES:
        return verify
    raise ValueError(f"unknown verification rule {verify!r}; choose lossless, token, consultant or a ConsultantRule")
