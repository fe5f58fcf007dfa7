"""N-gram prompt lookup: a model-free, parallel drafter that runs on device."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import struct

from ..state import take_row


@struct.dataclass
class NgramState:
    history: jax.Array  # [B, H] prompt + emitted tokens
    length: jax.Array  # [B] valid entries in history


@dataclasses.dataclass(frozen=True)
class NgramDrafter:
    """Prompt lookup: find the latest earlier occurrence of the last n tokens (n = max..min) and
    propose the tokens that followed it. Deterministic, so q is a point mass (q = 1)."""

    max_ngram: int = 3
    min_ngram: int = 1
    name = "ngram"
    parallel = True
    deterministic = True
    capture_layers = ()

    def init(self, dparams, tparams, tcfg, prompt, lens, first_token, prefill_out, cache_len):
        B = prompt.shape[0]
        hist = jnp.zeros((B, cache_len), jnp.int32).at[:, : prompt.shape[1]].set(prompt)
        hist = hist.at[jnp.arange(B), lens].set(first_token)
        return NgramState(history=hist, length=lens + 1)

    def propose(self, dstate: NgramState, last_token, k: int):
        hist, L = dstate.history, dstate.length
        B, H = hist.shape
        j = jnp.arange(H)[None]  # candidate end index of an earlier match
        found = jnp.zeros((B,), bool)
        start = jnp.zeros((B,), jnp.int32)
        for n in range(self.max_ngram, self.min_ngram - 1, -1):
            match = (j >= n - 1) & (j < L[:, None] - 1)
            for m in range(n):
                tail = take_row(hist[:, :, None], L - 1 - m)[:, 0]  # [B]
                cand = jnp.take_along_axis(hist, jnp.clip(j - m, 0, H - 1), axis=1)
                match &= cand == tail[:, None]
            last_match = jnp.max(jnp.where(match, j, -1), axis=1)
            use = ~found & (last_match >= 0) & (L > n)
            start = jnp.where(use, last_match + 1, start)
            found = found | use
        idx = start[:, None] + jnp.arange(k)[None]
        tokens = jnp.take_along_axis(hist, jnp.clip(idx, 0, H - 1), axis=1)
        valid = found[:, None] & (idx < L[:, None])
        return tokens, valid

    def commit(self, dparams, tparams, tcfg, dstate: NgramState, block_tokens, n_accepted, next_token, verify_out):
        B, T = block_tokens.shape
        emitted = jnp.concatenate([block_tokens[:, 1:], next_token[:, None]], axis=1)  # [B, K+1]
        t = jnp.arange(T)[None]
        emitted = jnp.where(t == n_accepted[:, None], next_token[:, None], emitted)
        dst = jnp.where(t <= n_accepted[:, None], dstate.length[:, None] + t, dstate.history.shape[1])
        hist = dstate.history.at[jnp.arange(B)[:, None], dst].set(emitted, mode="drop")
        return NgramState(history=hist, length=jnp.minimum(dstate.length + n_accepted + 1, hist.shape[1]))
