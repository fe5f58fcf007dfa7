"""Block verification of a sampled chain (Sun, Mendlovic, Leviathan, Aharoni, Beirami, Ro, Suresh,
*Block Verification Accelerates Speculative Decoding*, ICLR 2025, arXiv 2403.10444).

Same convention as `verify.chain`: (n_accepted [B], next_token [B]), rows emit n + 1 tokens.

Token-by-token verification (`verify.chain.verify_sampling`) decides each draft alone: a draft
that q over-proposes is rejected with probability 1 - p/q even when the drafts before it were
under-proposed and left probability to spare. Block verification judges the drafts as one block:
  * a running weight w_i = min(1, w_{i-1} p_i(x_i) / q_i(x_i)), w_0 = 1, carries the spare mass;
  * with g valid drafts, coin i passes with probability h_i: h_g = w_g, and for i < g
    h_i = r_i / (r_i + 1 - w_i), r_i = sum_x max(0, w_i p_{i+1}(x) - q_{i+1}(x));
  * the row keeps n = the LAST i whose coin passes (0 if none), so a draft may be kept although a
    token rule would have stopped before it;
  * after n < g kept drafts it emits a sample of norm(max(0, w_n p_{n+1} - q_{n+1})); after all g,
    a bonus sample of p_{g+1}.
The output has exactly the target's law (for any draft length the drafter chose from its own
drafts, such as a stop rule's), and given the tokens before it and its position in the round each
emitted token follows p. In expectation it keeps at least as many drafts as the token rule; the
paper proves it optimal for one drafted block. With point-mass drafts (q = 1: n-grams, argmax
drafters) every ratio is p <= 1 and it keeps as many as the token rule. Greedy rows keep
`verify.chain.verify_greedy`, where the rules coincide.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from ...sampling import Sampling
from .chain import accepted_prefix, drafted_probs, token_after


def block_weights(ratio_log: jax.Array) -> jax.Array:
    """w_1..w_K [B, K] from log(p_i(x_i) / q_i(x_i)) [B, K]: w_i = min(1, w_{i-1} * ratio_i), w_0 = 1.

    In logs, log w_i = c_i - max(0, c_1..c_i) with c_i the cumulative sum of the log ratios: the
    recursion's running product, measured from its highest point so far."""
    c = jnp.cumsum(ratio_log, axis=-1)
    return jnp.exp(c - jnp.maximum(jax.lax.cummax(c, axis=c.ndim - 1), 0.0))


def verify_block(key: jax.Array, target_logits: jax.Array, draft_tokens: jax.Array, valid: jax.Array,
                 sampling: Sampling, draft_probs: jax.Array | None = None):  # verify_sampling's arguments
    """Block verification (module docstring). draft_probs [B, K, V] (processed like p) or None (q = 1);
    a row's valid drafts are those before its first invalid one [B, K]."""
    B, K = draft_tokens.shape
    p, p_draft, q_draft = drafted_probs(target_logits, draft_tokens, sampling, draft_probs)
    # Padding drafts (q may be 0 there) get ratio 1; they are never kept (h = 0 below).
    with_q = valid & (q_draft > 0)
    ratio_log = jnp.where(with_q, jnp.log(jnp.where(with_q, p_draft, 1.0)) - jnp.log(jnp.where(with_q, q_draft, 1.0)), 0.0)
    w = block_weights(ratio_log)  # [B, K]: w_1..w_K
    w_all = jnp.concatenate([jnp.ones((B, 1), w.dtype), w], axis=1)  # [B, K+1]: w_0..w_K
    # r_i for i = 1..K-1: the residual mass left at draft i+1 (0-based position i) by weight w_i
    if draft_probs is None:
        r = w[:, :-1] * (1.0 - p_draft[:, 1:])  # q a point mass on the drafted token
    else:
        r = jnp.sum(jnp.maximum(w[:, :-1, None] * p[:, 1:K] - draft_probs[:, 1:], 0.0), axis=-1)
    denom = r + 1.0 - w[:, :-1]
    h_inner = jnp.where(denom > 0, r / jnp.where(denom > 0, denom, 1.0), 1.0)  # 0/0: p = q ahead, keep going
    n_valid = accepted_prefix(valid)  # drafts after a row's first invalid one are not drafted
    i = jnp.arange(1, K + 1)[None]  # the accepted length each coin decides
    h = jnp.where(i < n_valid[:, None], jnp.pad(h_inner, ((0, 0), (0, 1))), jnp.where(i == n_valid[:, None], w, 0.0))
    k_accept, k_resample = jax.random.split(key)
    u = jax.random.uniform(k_accept, (B, K))
    n = jnp.max(jnp.where(u < h, i, 0), axis=-1).astype(jnp.int32)  # the last coin that passes
    rejected = n < n_valid  # else: bonus token from p at position n

    w_n = jnp.take_along_axis(w_all, n[:, None], axis=1)  # [B, 1]
    return n, token_after(k_resample, p, draft_tokens, draft_probs, n, rejected, w_n)
