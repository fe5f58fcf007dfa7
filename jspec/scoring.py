"""Scoring sampled completions: the target's log-probabilities of the tokens it emitted.

What a policy-gradient loss needs from a rollout (examples/rl_rollout.py, scripts/bench_rollout.py):
one teacher-forced forward over prompt + completion, whatever decoded it (lossless speculation
samples exactly the target's law, so the scores are those of the target's own samples).
"""

from __future__ import annotations

import jax.numpy as jnp

from . import model as M
from .sampling import Sampling, logprobs

T1 = Sampling(temperature=1.0)


def completion_logprobs(params, cfg, prompts, prompt_lens, completions, n_new, sampling=T1):
    """log p_target(completion token t | prompt, earlier tokens) [B, N], 0 past each row's end.

    One teacher-forced forward over prompt + completion (right-padded rows of different lengths):
    the logits at position prompt_len + t - 1 score completion token t."""
    B, P = prompts.shape
    N = completions.shape[1]
    t = jnp.arange(N)[None]
    valid = t < n_new[:, None]
    seq = jnp.zeros((B, P + N), jnp.int32).at[:, :P].set(jnp.where(jnp.arange(P)[None] < prompt_lens[:, None], prompts, 0))
    dst = jnp.where(valid, prompt_lens[:, None] + t, P + N)  # past the end: dropped
    seq = seq.at[jnp.arange(B)[:, None], dst].set(jnp.maximum(completions, 0), mode="drop")
    cache = M.init_cache(cfg, B, P + N, params["embed"].dtype)
    hidden = M.forward(params, cfg, seq, cache).hidden  # causal: padding after a row never leaks back
    pos = jnp.clip(prompt_lens[:, None] + t - 1, 0, P + N - 1)
    logits = M.lm_head(params, cfg, jnp.take_along_axis(hidden, pos[..., None], axis=1))  # [B, N, V]
    lp = jnp.take_along_axis(logprobs(logits, sampling), jnp.maximum(completions, 0)[..., None], axis=-1)[..., 0]
    return jnp.where(valid, lp, 0.0)
