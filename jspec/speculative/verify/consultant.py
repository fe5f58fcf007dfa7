"""Consultant Decoding's chain rule (same return convention as `verify.chain`).

`verify_consultant`: Consultant Decoding's rule, LOSSY: accept while the target's NLL of the
  draft token is <= eps (default 2.0, docs/methods.md §4), correct from the target's own distribution.
  It does not preserve the target distribution; it is offered only as an explicit opt-in.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from ...sampling import Sampling, logprobs
from .chain import accepted_prefix


def verify_consultant(
    key: jax.Array,
    target_logits: jax.Array,
    draft_tokens: jax.Array,
    valid: jax.Array,
    sampling: Sampling,
    eps: float = 2.0,
):
    """LOSSY Consultant Decoding: accept while -log p(x) <= eps under the (processed) target."""
    K = draft_tokens.shape[1]
    lp = logprobs(target_logits, sampling)
    nll = -jnp.take_along_axis(lp[:, :K], draft_tokens[..., None], axis=-1)[..., 0]
    n = accepted_prefix((nll <= eps) & valid)
    lp_n = jnp.take_along_axis(lp, n[:, None, None], axis=1)[:, 0]
    if sampling.greedy:
        next_token = jnp.argmax(lp_n, axis=-1).astype(jnp.int32)
    else:
        next_token = jax.random.categorical(key, lp_n, axis=-1).astype(jnp.int32)
    return n, next_token
