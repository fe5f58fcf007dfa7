"""Autoregressive decoding core, jitted: prefill padded to buckets, then one `lax.while_loop`
with no host round trip. Also the pieces every speculative engine shares with it: prompt packing
and validation, the output buffer (`emit`), the stopping rules and the streaming host loop.

Rows of a batch may have different prompt lengths: each row keeps its own cache cursor, its own
output count and its own done flag (EOS or max_new_tokens). Finished rows ride along in the batch
(static shapes) until every row is done or the step budget runs out.

The host-side entry points `generate` / `generate_stream` live in jspec.generate, above the
speculative engines.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Iterator

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from . import model as M
from .config import ModelConfig
from .refill import cut_start, run_queue, run_rows
from .sampling import Sampling, sample

PROMPT_BUCKETS = (32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768)


class PromptError(ValueError):
    """A prompt cannot be run as given (empty, too long for the cache, ids outside the vocab)."""


@dataclasses.dataclass
class GenerationResult:
    tokens: np.ndarray  # [B, max_new] int32, -1 after each row's end
    lengths: np.ndarray  # [B] new tokens per row (EOS included when emitted)
    target_calls: np.ndarray  # [B] target forward passes that produced this row's tokens
    drafted: np.ndarray  # [B] draft tokens proposed (0 for AR)
    accepted: np.ndarray  # [B] draft tokens accepted (bonus tokens not counted)
    rounds: np.ndarray  # [B] target calls incl. the prefill (== target_calls)
    # speculative runs only: per target call, draft tokens behind it and tokens it added [B, max_new + 1]
    draft_lengths: np.ndarray | None = None
    step_tokens: np.ndarray | None = None
    # speculative runs only: the draft-length policy's final state (device arrays), e.g. TapOut's
    # bandit or AdaEDL's lambda; pass it back as generate(..., policy_state=) to carry it on
    policy_state: Any = None

    def row(self, b: int) -> list[int]:
        return self.tokens[b, : self.lengths[b]].tolist()

    @property
    def mean_accepted_tokens(self) -> np.ndarray:
        """Tokens added per target call, bonus included (1.0 for AR), per row."""
        return self.lengths / np.maximum(self.target_calls, 1)


def default_dtype() -> Any:
    """float32 on CPU (XLA's CPU bf16 is several times slower), bfloat16 on accelerators."""
    return jnp.float32 if jax.default_backend() == "cpu" else jnp.bfloat16


def bucket(n: int) -> int:
    for b in PROMPT_BUCKETS:
        if n <= b:
            return b
    return -(-n // 1024) * 1024


def plan_cache_len(prompt_bucket: int, max_new_tokens: int, extra: int = 0) -> int:
    """Cache slots: prompt bucket + generated tokens + a speculative block, rounded to 128."""
    need = prompt_bucket + max_new_tokens + extra + 1
    return -(-need // 128) * 128


def shared_cache_len(prompt_bucket: int, max_new_tokens: int, extra: int = 0) -> int:
    """`plan_cache_len` rounded up to a multiple of a quarter of its power of two (at least 128):
    the decode loop's program is keyed by its cache length, not by the prompt width, so prompt
    buckets whose caches round alike share it (at 1,024 new tokens and a 59-node tree, buckets
    32-128 share 1,280 slots; at 256, buckets 32 and 64 share 384). At most 25% more slots than
    the plan: a power of two would nearly double a long prompt's KV cache (an 8B model at batch 128
    with 4,096-token prompts would no longer fit an H200). Only where attention reads each row's
    committed slots alone (the GPU kernel): elsewhere a longer cache costs attention time."""
    need = plan_cache_len(prompt_bucket, max_new_tokens, extra)
    step = max(128, (1 << (need.bit_length() - 1)) // 4)
    return -(-need // step) * step


def check_token_lists(prompts) -> None:
    """Prompts are a non-empty list of token-id lists: a text or one prompt's flat ids, passed as
    they come, is named as such instead of failing deep in NumPy. Raises PromptError."""
    if isinstance(prompts, str):
        raise PromptError("prompts must be a list of token-id lists, got a str: tokenize it (jspec.tokenizer.prompt_ids) "
                          "and pass [ids]")
    for i, prompt in enumerate(prompts):
        if isinstance(prompt, str):
            raise PromptError(f"prompt {i} is a str, not token ids: tokenize it (jspec.tokenizer.prompt_ids)")
        if np.ndim(prompt) == 0:
            raise PromptError("prompts must be a list of token-id lists, got a flat list of ids: pass [ids] for one prompt")
        ids = np.asarray(prompt)
        if ids.ndim != 1 or (ids.size and not np.issubdtype(ids.dtype, np.integer)):
            raise PromptError(f"prompt {i} is not a list of integer token ids")
    if not len(prompts):
        raise PromptError("no prompts given")


def check_fits_context(cfg: ModelConfig, longest_prompt: int, max_new_tokens: int) -> None:
    """The longest prompt plus max_new_tokens fits the model's positions. Raises PromptError, one line."""
    if longest_prompt + max_new_tokens > cfg.max_position_embeddings:
        raise PromptError(
            f"prompt of {longest_prompt} tokens + max_new_tokens {max_new_tokens} exceeds the model's "
            f"context of {cfg.max_position_embeddings} positions"
        )


def pack_prompts(cfg: ModelConfig, prompts: list[list[int]], max_new_tokens: int, extra: int = 0, cache_len: int | None = None,
                 min_width: int = 0):
    """Validate prompts and right-pad them into a [B, bucket] array, the bucket of the longest
    prompt or of `min_width` if that is longer (one shape for calls whose prompts vary). Raises
    PromptError."""
    check_token_lists(prompts)
    if max_new_tokens < 1:
        raise PromptError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    lens = np.array([len(p) for p in prompts], np.int32)
    if (lens == 0).any():
        raise PromptError(f"prompt {int(np.argmin(lens))} is empty")
    for i, p in enumerate(prompts):
        arr = np.asarray(p)
        if arr.size and (arr.min() < 0 or arr.max() >= cfg.vocab_size):
            bad = int(arr[(arr < 0) | (arr >= cfg.vocab_size)][0])
            raise PromptError(f"prompt {i} has token id {bad} outside the vocabulary [0, {cfg.vocab_size})")
    pb = bucket(max(int(lens.max()), min_width))
    need = int(lens.max()) + max_new_tokens + extra + 1
    if cache_len is None:
        cache_len = plan_cache_len(pb, max_new_tokens, extra)
    if need > cache_len:
        raise PromptError(
            f"prompt of {int(lens.max())} tokens + max_new_tokens {max_new_tokens} (+{extra + 1} speculative slots) "
            f"needs {need} cache slots but the cache holds {cache_len}"
        )
    check_fits_context(cfg, int(lens.max()), max_new_tokens)
    if extra and int(lens.max()) + max_new_tokens + extra > cfg.max_position_embeddings:
        # checked before anything is allocated: a huge draft block (k_max) would otherwise size the cache
        room = cfg.max_position_embeddings - int(lens.max()) - max_new_tokens
        raise PromptError(
            f"a speculative block of {extra} slots (k_max + 1, or a tree's nodes + 1) does not fit the model's "
            f"context of {cfg.max_position_embeddings} positions after a prompt of {int(lens.max())} tokens + "
            f"max_new_tokens {max_new_tokens}: at most {max(room, 0)} slots, i.e. k_max <= {max(room - 1, 0)}"
        )
    pb = min(pb, cache_len)
    tokens = np.full((len(prompts), pb), cfg.pad_token_id, np.int32)
    for i, p in enumerate(prompts):
        tokens[i, : len(p)] = p
    return tokens, lens, cache_len


# ---------------------------------------------------------------------------------------------
# Autoregressive decoding
# ---------------------------------------------------------------------------------------------


@struct.dataclass
class DecodeState:
    cache: M.KVCache
    out: jax.Array  # [B, max_new] emitted tokens
    n_out: jax.Array  # [B] tokens emitted so far
    last: jax.Array  # [B] last emitted token (not yet in the cache)
    done: jax.Array  # [B]
    steps: jax.Array  # [B] target calls that produced tokens for the row
    key: jax.Array


def is_eos(cfg: ModelConfig, tok: jax.Array) -> jax.Array:
    if not cfg.eos_token_ids:
        return jnp.zeros(tok.shape, bool)
    return jnp.isin(tok, jnp.asarray(cfg.eos_token_ids, jnp.int32))


# The prompt forward's attention scores ([B, heads, chunk, cache slots], float32) are kept under
# this many bytes by running the prompt in chunks [I]: one pass over a prompt that fills a 4k cache
# would hold 137 GB of scores for an 8B target at batch 64.
PREFILL_SCORE_BYTES = 2 << 30
MIN_PREFILL_CHUNK = 16


def prefill_chunk(cfg: ModelConfig, batch: int, prompt_len: int, cache_len: int, score_bytes: int = PREFILL_SCORE_BYTES) -> int:
    """Tokens per prefill forward: the whole prompt when its scores fit `score_bytes`, else the
    largest power of two (>= MIN_PREFILL_CHUNK) that fits and divides the padded prompt length."""
    per_token = batch * cfg.num_heads * cache_len * 4
    if prompt_len * per_token <= score_bytes:
        return prompt_len
    chunk = MIN_PREFILL_CHUNK
    while chunk * 2 * per_token <= score_bytes and prompt_len % (chunk * 2) == 0:
        chunk *= 2
    return chunk if prompt_len % chunk == 0 else prompt_len


def prefill(params, cfg: ModelConfig, tokens, lens, cache: M.KVCache, *, capture=(), unroll=None, chunk=None):
    """Run padded prompts; return the last real position's logits, the cache and the forward output.

    unroll None keeps the layer scan here even for prompts short enough for the fused path: a
    prompt runs once per generation, and unrolling it only lengthens the compile. A long prompt
    runs in `chunk`-token forwards under one scan (default `prefill_chunk`), each attending to the
    cache the earlier ones wrote: the same outputs with bounded attention scores."""
    B, P = tokens.shape
    chunk = prefill_chunk(cfg, B, P, cache.k.shape[2]) if chunk is None else chunk
    if P % chunk:
        raise ValueError(f"prefill chunk {chunk} does not divide the padded prompt length {P}")
    run = functools.partial(M.forward, params, cfg, capture=capture, unroll=1 if unroll is None else unroll)
    if chunk == P:
        out = run(tokens, cache)
    else:
        def one_chunk(c, toks):
            o = run(toks, c)
            return M.advance(o.cache, jnp.full((B,), chunk, jnp.int32)), (o.hidden, o.captured)

        cache, (hidden, captured) = jax.lax.scan(one_chunk, cache, tokens.reshape(B, P // chunk, chunk).swapaxes(0, 1))
        joined = lambda x: x.swapaxes(0, 1).reshape(B, P, *x.shape[3:])  # noqa: E731  [n, B, chunk, ...] -> [B, P, ...]
        out = M.ForwardOut(joined(hidden), tuple(joined(c) for c in captured), cache)
    cache = out.cache.replace(lengths=lens.astype(jnp.int32))
    last_h = jnp.take_along_axis(out.hidden, (lens - 1)[:, None, None], axis=1)[:, 0]
    return M.lm_head(params, cfg, last_h), cache, out


def emit(cfg: ModelConfig, out, n_out, done, new_tokens, n_new, max_new):
    """Append n_new[b] tokens of new_tokens [B, T] to each unfinished row; stop rows at EOS/max_new.

    Returns (out, n_out, done). Tokens after a row's first EOS are dropped.
    """
    B, T = new_tokens.shape
    t = jnp.arange(T)[None]
    in_round = t < n_new[:, None]
    eos = is_eos(cfg, new_tokens) & in_round
    # keep tokens up to and including the first EOS
    first_eos = jnp.where(eos.any(axis=1), jnp.argmax(eos, axis=1), T)
    keep = in_round & (t <= first_eos[:, None]) & ~done[:, None]
    dst = jnp.where(keep, n_out[:, None] + t, out.shape[1])  # out of range -> dropped
    out = out.at[jnp.arange(B)[:, None], dst].set(new_tokens, mode="drop")
    n_kept = jnp.sum(keep, axis=1).astype(jnp.int32)
    n_out = jnp.minimum(n_out + n_kept, max_new)
    done = done | eos.any(axis=1) | (n_out >= max_new)
    return out, n_out, done


def cut_at_budgets(state, budgets):
    """A state (AR's or the speculative engines') with row b's output cut at budgets[b] tokens and
    the row done there; the tokens past the cut read -1, as past any row's end."""
    n_out = jnp.minimum(state.n_out, budgets)
    out = jnp.where(jnp.arange(state.out.shape[1])[None] < n_out[:, None], state.out, -1)
    return state.replace(out=out, n_out=n_out, done=state.done | (n_out >= budgets))


def _cut_decode(before, after, budgets):  # refill's `cut` for AR: one token a step, no statistics to correct
    return cut_at_budgets(after, budgets)


def decode_step(params, cfg: ModelConfig, sampling: Sampling, max_new: int, state: DecodeState, unroll=None) -> DecodeState:
    """One target call: feed each row's last token, sample the next."""
    fwd = M.forward(params, cfg, state.last[:, None], state.cache, unroll=unroll)
    logits = M.lm_head(params, cfg, fwd.hidden[:, 0])
    key, sub = jax.random.split(state.key)
    tok = sample(sub, logits, sampling)
    active = ~state.done
    out, n_out, done = emit(cfg, state.out, state.n_out, state.done, tok[:, None], jnp.ones_like(state.n_out), max_new)
    return DecodeState(
        cache=M.advance(fwd.cache, active.astype(jnp.int32)),
        out=out,
        n_out=n_out,
        last=jnp.where(active, tok, state.last),
        done=done,
        steps=state.steps + active.astype(jnp.int32),
        key=key,
    )


def start_decode(params, cfg, tokens, lens, key, *, max_new, cache_len, sampling, unroll=None) -> DecodeState:
    B = tokens.shape[0]
    cache = M.init_cache(cfg, B, cache_len, params["embed"].dtype)
    logits, cache, _ = prefill(params, cfg, tokens, lens, cache, unroll=unroll)
    key, sub = jax.random.split(key)
    first = sample(sub, logits, sampling)
    out = jnp.full((B, max_new), -1, jnp.int32)
    zeros = jnp.zeros((B,), jnp.int32)
    out, n_out, done = emit(cfg, out, zeros, jnp.zeros((B,), bool), first[:, None], jnp.ones_like(zeros), max_new)
    return DecodeState(cache=cache, out=out, n_out=n_out, last=first, done=done, steps=jnp.ones_like(zeros), key=key)


@functools.partial(jax.jit, static_argnames=("cfg", "max_new", "cache_len", "sampling", "unroll", "rows", "refill",
                                             "stop_at_running"))
def generate_ar_jit(params, cfg, tokens, lens, key, budgets=None, *, max_new, cache_len, sampling, unroll=None, rows=None,
                    refill=None, stop_at_running=0):
    """Whole AR generation under one jit: prefill + a while_loop of decode steps. ``rows``: that
    many rows in flight over the prompts (continuous batching, jspec.refill), ``refill`` started
    at a time; None: every prompt in one batch. ``stop_at_running``: return once no prompt waits
    and at most that many rows run, theirs partial (jspec.refill). ``budgets`` [B] (one batch
    only): row b stops at budgets[b] <= max_new tokens. Returns (out, n_out, steps) per prompt."""
    def start(t, l, k):
        return start_decode(params, cfg, t, l, k, max_new=max_new, cache_len=cache_len, sampling=sampling, unroll=unroll)

    loop = M.loop_params(params, cfg, unroll=unroll)  # per-layer weight buffers for the loop body

    def body(s):
        return decode_step(loop, cfg, sampling, max_new, s, unroll=unroll)

    def outputs(s):
        return s.out, s.n_out, s.steps

    return run_queue(start, body, outputs, tokens, lens, key, rows=rows, refill=refill, stop_at_running=stop_at_running,
                     budgets=budgets, cut=_cut_decode)[0]


@functools.partial(jax.jit, static_argnames=("cfg", "max_new", "cache_len", "sampling", "unroll"))
def start_decode_jit(params, cfg, tokens, lens, key, budgets=None, *, max_new, cache_len, sampling, unroll=None):
    """The prefill of `decode_loop_jit`'s state: one program per prompt width, small beside the loop's.
    ``budgets`` [B]: row b stops at budgets[b] tokens (the loop must be given the same)."""
    state = start_decode(params, cfg, tokens, lens, key, max_new=max_new, cache_len=cache_len, sampling=sampling,
                         unroll=unroll)
    return cut_start(state, budgets, _cut_decode)


@functools.partial(
    jax.jit, static_argnames=("cfg", "max_new", "sampling", "n_steps", "unroll", "stop_at_running"),
    donate_argnames=("state",))
def decode_loop_jit(params, cfg, state, budgets=None, *, max_new, sampling, n_steps=None, unroll=None, stop_at_running=0):
    """Decode steps on a started state (donated, its cache updated in place) until at most
    `stop_at_running` rows run, or `n_steps` steps (None: no cap; streaming takes a few at a time).
    Its shapes are the state's, not the prompt's: prompts of every width whose caches have the same
    length share this program (generate's `shared_cache_len`)."""
    loop = M.loop_params(params, cfg, unroll=unroll)
    return run_rows(lambda s: decode_step(loop, cfg, sampling, max_new, s, unroll=unroll), state,
                    stop_at_running=stop_at_running, max_steps=n_steps, budgets=budgets, cut=_cut_decode)


def stream_row0(state, advance) -> Iterator[tuple[list[int], Any]]:
    """Host loop shared by AR and speculative streaming: yield (row 0's new tokens, state) after
    each jitted chunk `advance(state)` until the row is done. One host sync per chunk."""
    sent = 0
    while True:
        n, done = (int(x) for x in jax.device_get((state.n_out[0], state.done[0])))
        if n > sent:
            yield np.asarray(jax.device_get(state.out[0, sent:n])).tolist(), state
            sent = n
        if done:
            return
        state = advance(state)
