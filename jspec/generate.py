"""Host-side generation API: `generate` (batched) and `generate_stream` (one prompt, chunked).

`generate` is the one entry point: plain autoregressive decoding (jspec.decode) when `drafter` is
None, speculative decoding otherwise, with chains (jspec.speculative.engines.chain) or EAGLE-2
trees (jspec.speculative.engines.tree). All paths share the prompt handling, the output buffer and
the stopping rules, so their greedy outputs can be compared token for token.

This module sits above every engine; engines import jspec.decode, never this module.
"""

from __future__ import annotations

from typing import Iterator

import jax
import jax.numpy as jnp
import numpy as np

from .config import ModelConfig
from .decode import GenerationResult, decode_chunk_jit, generate_ar_jit, pack_prompts, start_decode_jit, stream_row0
from .sampling import GREEDY, Sampling
from .speculative.engines.chain import speculative_generate
from .speculative.engines.tree import TreeConfig, tree_generate
from .speculative.factory import build_drafter


def generate(
    params: dict,
    cfg: ModelConfig,
    prompts: list[list[int]],
    *,
    max_new_tokens: int = 128,
    sampling: Sampling | None = None,
    drafter=None,
    drafter_params=None,
    policy=None,
    policy_params=None,
    k_max: int = 8,
    verify: str = "lossless",
    tree=None,
    seed: int = 0,
    cache_len: int | None = None,
    unroll: int | bool = 1,
) -> GenerationResult:
    """Generate up to max_new_tokens per prompt (token-id lists), batched.

    drafter=None: autoregressive decoding. Otherwise speculative decoding with the given drafter
    (jspec.speculative.drafters, or a spec string for jspec.speculative.factory.build_drafter) and
    draft-length policy (jspec.speculative.policies, default static K=k_max); `verify` is "lossless"
    (greedy identity / lossless sampling) or "consultant" (lossy, opt-in).
    `tree` (a jspec.speculative.engines.tree.TreeConfig, or True for EAGLE-2's defaults) drafts EAGLE-2 dynamic
    trees with an EAGLE head instead of chains.
    """
    sampling = sampling or GREEDY
    if isinstance(drafter, str):
        drafter, drafter_params = build_drafter(drafter, cfg, params)
    if tree is True:
        tree = TreeConfig()
    extra = (tree.num_nodes + 1 if tree is not None else k_max + 1) if drafter is not None else 0
    tokens, lens, cache_len = pack_prompts(cfg, prompts, max_new_tokens, extra, cache_len)
    key = jax.random.PRNGKey(seed)
    if drafter is None:
        out, n_out, steps = generate_ar_jit(
            params, cfg, jnp.asarray(tokens), jnp.asarray(lens), key,
            max_new=max_new_tokens, cache_len=cache_len, sampling=sampling, unroll=unroll,
        )
        out, n_out, steps = jax.device_get((out, n_out, steps))
        zeros = np.zeros_like(n_out)
        return GenerationResult(out, n_out, steps, zeros, zeros, steps)
    if tree is not None:
        return tree_generate(
            params, cfg, tokens, lens, key, drafter=drafter, drafter_params=drafter_params, policy=policy,
            policy_params=policy_params, tree=tree, max_new=max_new_tokens, cache_len=cache_len,
            sampling=sampling, unroll=unroll,
        )
    return speculative_generate(
        params, cfg, tokens, lens, key,
        drafter=drafter, drafter_params=drafter_params, policy=policy, policy_params=policy_params,
        k_max=k_max, max_new=max_new_tokens, cache_len=cache_len, sampling=sampling, verify=verify, unroll=unroll,
    )


def generate_stream(
    params: dict,
    cfg: ModelConfig,
    prompt: list[int],
    *,
    max_new_tokens: int = 128,
    sampling: Sampling | None = None,
    seed: int = 0,
    chunk: int = 8,
    unroll: int | bool = 1,
) -> Iterator[list[int]]:
    """Yield new tokens as they come, `chunk` jitted decode steps at a time (one host sync per chunk)."""
    sampling = sampling or GREEDY
    tokens, lens, cache_len = pack_prompts(cfg, [prompt], max_new_tokens)
    state = start_decode_jit(
        params, cfg, jnp.asarray(tokens), jnp.asarray(lens), jax.random.PRNGKey(seed),
        max_new=max_new_tokens, cache_len=cache_len, sampling=sampling, unroll=unroll,
    )
    advance = lambda st: decode_chunk_jit(params, cfg, st, max_new=max_new_tokens, sampling=sampling, n_steps=chunk, unroll=unroll)
    for tokens, _ in stream_row0(state, advance):
        yield tokens
