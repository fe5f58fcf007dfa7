"""Chain verification: pure functions over a padded [B, K+1] block.

All rules return (n_accepted [B], next_token [B]): the number of draft tokens kept and the token
the target emits after them (correction on rejection, bonus when every valid draft is accepted).
Rows emit n_accepted + 1 tokens per target call.

* `verify_greedy`: accept while the draft equals the target's argmax. Output is identical to
  autoregressive greedy decoding.
* `verify_sampling`: lossless speculative sampling (Leviathan et al. / Chen et al.): accept draft
  x_i with probability min(1, p_i(x_i) / q_i(x_i)); at the first rejection emit a sample of
  norm(max(0, p - q)); if all valid drafts pass, emit a bonus sample of p. Drafters that pick
  tokens deterministically (n-grams, argmax drafters) pass `draft_probs=None`: q is then a point
  mass on the drafted token (q = 1), the convention EAGLE-2 uses, and the residual is p with the
  rejected token removed. Both are exactly lossless. (Sampled chains run block verification by
  default, `verify/block.py`: the same law, more drafts kept; this rule is `verify="token"`.)
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from ...sampling import Sampling, logprobs


def accepted_prefix(ok: jax.Array) -> jax.Array:
    """Length of the all-True prefix of ok [B, K]."""
    return jnp.sum(jnp.cumprod(ok.astype(jnp.int32), axis=-1), axis=-1).astype(jnp.int32)


def verify_greedy(target_logits: jax.Array, draft_tokens: jax.Array, valid: jax.Array):
    """target_logits [B, K+1, V], draft_tokens [B, K], valid [B, K]."""
    target_tokens = jnp.argmax(target_logits, axis=-1).astype(jnp.int32)  # [B, K+1]
    n = accepted_prefix((draft_tokens == target_tokens[:, :-1]) & valid)
    next_token = jnp.take_along_axis(target_tokens, n[:, None], axis=1)[:, 0]
    return n, next_token


def verify_sampling(
    key: jax.Array,
    target_logits: jax.Array,
    draft_tokens: jax.Array,
    valid: jax.Array,
    sampling: Sampling,
    draft_probs: jax.Array | None = None,
):
    """Lossless speculative sampling. draft_probs [B, K, V] (processed like p) or None (q = 1)."""
    B, K = draft_tokens.shape
    p, p_draft, q_draft = drafted_probs(target_logits, draft_tokens, sampling, draft_probs)
    k_accept, k_resample = jax.random.split(key)
    u = jax.random.uniform(k_accept, (B, K))
    # u < p/q written without division; q_draft > 0 for any token the drafter could produce.
    ok = (u * q_draft < p_draft) & valid
    n = accepted_prefix(ok)
    rejected = n < accepted_prefix(valid)  # else: bonus token from p at position n
    return n, token_after(k_resample, p, draft_tokens, draft_probs, n, rejected)


def drafted_probs(target_logits: jax.Array, draft_tokens: jax.Array, sampling: Sampling, draft_probs: jax.Array | None):
    """(p [B, K+1, V], p(d_i) [B, K], q(d_i) [B, K]): the target's processed laws over the block and
    each draft's probability under the target and under the drafter (1 for point-mass drafts)."""
    K = draft_tokens.shape[1]
    p = jnp.exp(logprobs(target_logits, sampling))
    p_draft = jnp.take_along_axis(p[:, :K], draft_tokens[..., None], axis=-1)[..., 0]
    if draft_probs is None:
        q_draft = jnp.ones_like(p_draft)
    else:
        q_draft = jnp.take_along_axis(draft_probs, draft_tokens[..., None], axis=-1)[..., 0]
    return p, p_draft, q_draft


def token_after(key: jax.Array, p: jax.Array, draft_tokens: jax.Array, draft_probs: jax.Array | None, n: jax.Array,
                rejected: jax.Array, weight: jax.Array | float = 1.0) -> jax.Array:
    """The token [B] a row emits after its n kept drafts: where it stopped before its last valid
    draft, a sample of norm(max(0, weight * p_n - q_n)) (weight [B, 1]: block verification's w_n;
    1: the token rule's residual), else a bonus sample of p_n."""
    K = draft_tokens.shape[1]
    p_n = jnp.take_along_axis(p, n[:, None, None], axis=1)[:, 0]  # [B, V]
    tok_n = jnp.take_along_axis(draft_tokens, jnp.minimum(n, K - 1)[:, None], axis=1)[:, 0]
    if draft_probs is None:
        q_n = jax.nn.one_hot(tok_n, p.shape[-1], dtype=p.dtype)
    else:
        q_n = jnp.take_along_axis(draft_probs, jnp.minimum(n, K - 1)[:, None, None], axis=1)[:, 0]
    residual = jnp.maximum(weight * p_n - q_n, 0.0)
    mass = jnp.sum(residual, axis=-1, keepdims=True)
    # Stopping early has positive probability only where the residual has mass (float round-off aside).
    residual = jnp.where(mass > 0, residual / jnp.where(mass > 0, mass, 1.0), p_n)
    dist = jnp.where(rejected[:, None], residual, p_n)
    return jax.random.categorical(key, jnp.log(dist), axis=-1).astype(jnp.int32)
