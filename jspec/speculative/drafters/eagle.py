"""Drafters: who proposes the tokens the target verifies.

Two shapes of drafter, both frozen (hashable) dataclasses whose weights travel separately as a
pytree (`dparams`), so the whole speculative loop is one jitted function:

* Autoregressive drafters (EAGLE heads, a small draft model, the target's early exit) produce one
  distribution per step. The engine drives them through
      begin(dparams, tparams, tcfg, dstate, tcache, last_token) -> (logits [B, V], carry)
      step(dparams, tparams, tcfg, carry, token [B])             -> (logits [B, V], carry)
      finish(carry)                                               -> (dstate, tcache)
  so the engine owns the loop, the policy's stop decisions and the sampling. While drafting, a
  drafter may advance its cache cursor as if its drafts were committed (chain attention is then
  plain causal attention); `finish` rewinds it.
* Parallel drafters (n-gram prompt lookup) propose all K tokens at once:
      propose(dstate, last_token, k) -> (tokens [B, K], valid [B, K])

After verification every drafter gets
      commit(dparams, tparams, tcfg, dstate, block_tokens [B, K+1], n_accepted [B], next_token [B], verify_out)
with the verified block ([last_token, d_1..d_K]) and the target's ForwardOut over it, and returns
its state for the next round. `init(...)` builds the state after the target's prefill.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from flax import struct

from .. import model as M
from ..config import ModelConfig


class DrafterError(ValueError):
    """The drafter cannot serve this target (vocabulary mismatch, missing weights, bad option)."""


def _take_row(x: jax.Array, idx: jax.Array) -> jax.Array:
    """x [B, T, ...], idx [B] -> x[b, idx[b]]."""
    return jnp.take_along_axis(x, idx.reshape((-1, 1) + (1,) * (x.ndim - 2)), axis=1)[:, 0]


def shifted_pairs(tokens: jax.Array, lens: jax.Array, next_token: jax.Array) -> jax.Array:
    """Tokens x_{t+1} for t in [0, T): tokens shifted left by one, next_token at index lens-1."""
    shifted = jnp.concatenate([tokens[:, 1:], tokens[:, -1:]], axis=1)
    t = jnp.arange(tokens.shape[1])[None]
    return jnp.where(t == (lens - 1)[:, None], next_token[:, None], shifted)


# ---------------------------------------------------------------------------------------------
# N-gram prompt lookup (model-free, on device)
# ---------------------------------------------------------------------------------------------


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
                tail = _take_row(hist[:, :, None], L - 1 - m)[:, 0]  # [B]
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


# ---------------------------------------------------------------------------------------------
# Autoregressive drafters
# ---------------------------------------------------------------------------------------------


@struct.dataclass
class ModelDraftState:
    cache: M.KVCache  # cursor = position of prev_token (its K/V gets rewritten each round)
    prev_token: jax.Array  # [B] the token before the pending one


@dataclasses.dataclass(frozen=True)
class ModelDrafter:
    """An independent small draft model sharing the target's vocabulary (dparams: its weights)."""

    cfg: ModelConfig
    name = "model"
    parallel = False
    deterministic = False
    capture_layers = ()

    def check(self, tcfg: ModelConfig):
        if self.cfg.vocab_size != tcfg.vocab_size:
            raise DrafterError(
                f"draft model vocabulary ({self.cfg.vocab_size} tokens) does not match the target's "
                f"({tcfg.vocab_size} tokens); speculative decoding needs a shared tokenizer"
            )

    def init(self, dparams, tparams, tcfg, prompt, lens, first_token, prefill_out, cache_len):
        B = prompt.shape[0]
        cache = M.init_cache(self.cfg, B, cache_len, dparams["embed"].dtype)
        out = M.forward(dparams, self.cfg, prompt, cache)
        cache = out.cache.replace(lengths=(lens - 1).astype(jnp.int32))
        return ModelDraftState(cache=cache, prev_token=_take_row(prompt[:, :, None], lens - 1)[:, 0])

    def begin(self, dparams, tparams, tcfg, dstate, tcache, last_token):
        # Rewrite prev_token (harmless if already cached) and feed the pending token: a static
        # 2-token block covers both "n < K" and "all K accepted" rounds.
        base = dstate.cache.lengths
        block = jnp.stack([dstate.prev_token, last_token], axis=1)
        out = M.forward(dparams, self.cfg, block, dstate.cache)
        logits = M.lm_head(dparams, self.cfg, out.hidden[:, 1])
        return logits, (M.advance(out.cache, jnp.full_like(base, 2)), base, dstate, tcache)

    def step(self, dparams, tparams, tcfg, carry, token):
        cache, base, dstate, tcache = carry
        out = M.forward(dparams, self.cfg, token[:, None], cache)
        logits = M.lm_head(dparams, self.cfg, out.hidden[:, 0])
        return logits, (M.advance(out.cache, jnp.ones_like(base)), base, dstate, tcache)

    def finish(self, carry):
        cache, base, dstate, tcache = carry
        return dstate.replace(cache=cache.replace(lengths=base)), tcache

    def commit(self, dparams, tparams, tcfg, dstate, block_tokens, n_accepted, next_token, verify_out):
        prev = _take_row(block_tokens[:, :, None], n_accepted)[:, 0]
        return ModelDraftState(cache=M.advance(dstate.cache, n_accepted + 1), prev_token=prev)


@dataclasses.dataclass(frozen=True)
class EarlyExitDrafter:
    """Self-draft with the target's first `exit_layer` layers, its final norm and LM head.

    The draft shares the target's KV cache for those layers: an accepted token's early-layer K/V
    is the same whether computed while drafting or verifying, and the verify pass rewrites every
    drafted slot anyway. No extra memory, no extra weights (dparams may be None).
    """

    exit_layer: int
    name = "early-exit"
    parallel = False
    deterministic = False
    capture_layers = ()

    def check(self, tcfg: ModelConfig):
        if not 0 < self.exit_layer < tcfg.num_layers:
            raise DrafterError(f"exit_layer must be in [1, {tcfg.num_layers - 1}], got {self.exit_layer}")

    def init(self, dparams, tparams, tcfg, prompt, lens, first_token, prefill_out, cache_len):
        return ()

    def _run(self, tparams, tcfg, tcache, token):
        out = M.forward(tparams, tcfg, token[:, None], tcache, layer_range=(0, self.exit_layer))
        logits = M.lm_head(tparams, tcfg, out.hidden[:, 0])
        return logits, M.advance(out.cache, jnp.ones_like(tcache.lengths))

    def begin(self, dparams, tparams, tcfg, dstate, tcache, last_token):
        logits, cache = self._run(tparams, tcfg, tcache, last_token)
        return logits, (cache, tcache.lengths)

    def step(self, dparams, tparams, tcfg, carry, token):
        cache, base = carry
        logits, cache = self._run(tparams, tcfg, cache, token)
        return logits, (cache, base)

    def finish(self, carry):
        cache, base = carry
        return (), cache.replace(lengths=base)

    def commit(self, dparams, tparams, tcfg, dstate, block_tokens, n_accepted, next_token, verify_out):
        return dstate


@struct.dataclass
class EagleState:
    cache: M.KVCache  # the head's own one-layer cache; cursor = target cursor
    feature: jax.Array  # [B, D] head output at the last committed pair (fed to the next step)
    logits: jax.Array  # [B, V] draft distribution of the first token of the next round


@dataclasses.dataclass(frozen=True)
class EagleDrafter:
    """EAGLE-1 / EAGLE-3 feature head (jspec.heads). dparams: the head's weights.

    Pair t of the head's sequence is (target feature f_t, token x_{t+1}). After each verification
    the head re-reads the accepted pairs with the target's true features (overwriting what it wrote
    while drafting), so its cache always holds exact-feature K/V for the committed prefix.
    """

    head: Any  # jspec.heads.HeadConfig
    name = "eagle"
    parallel = False
    deterministic = False

    @property
    def capture_layers(self):
        return tuple(self.head.capture_layers) if self.head.kind == "eagle3" else ()

    def check(self, tcfg: ModelConfig):
        if self.head.target.vocab_size != tcfg.vocab_size or self.head.target.hidden_size != tcfg.hidden_size:
            raise DrafterError(
                f"EAGLE head was built for a target with vocab {self.head.target.vocab_size} and hidden "
                f"{self.head.target.hidden_size}; this target has vocab {tcfg.vocab_size}, hidden {tcfg.hidden_size}"
            )

    def _read_pairs(self, dparams, tparams, cache, tokens, feats, last_idx):
        from .. import heads as H

        h, logits, cache = H.head_forward(self.head, dparams, tparams, tokens, feats, cache)
        return _take_row(h, last_idx), _take_row(logits, last_idx), cache

    def init(self, dparams, tparams, tcfg, prompt, lens, first_token, prefill_out, cache_len):
        from .. import heads as H

        B = prompt.shape[0]
        cache = H.init_head_cache(self.head, B, cache_len, tparams["embed"].dtype)
        feats = H.head_features(self.head, dparams, prefill_out)
        pairs = shifted_pairs(prompt, lens, first_token)
        h, logits, cache = self._read_pairs(dparams, tparams, cache, pairs, feats, lens - 1)
        return EagleState(cache=cache.replace(lengths=lens.astype(jnp.int32)), feature=h, logits=logits)

    def begin(self, dparams, tparams, tcfg, dstate, tcache, last_token):
        return dstate.logits, (dstate.cache, dstate.feature, dstate, tcache)

    def step(self, dparams, tparams, tcfg, carry, token):
        from .. import heads as H

        cache, feat, dstate, tcache = carry
        h, logits, cache = H.head_forward(self.head, dparams, tparams, token[:, None], feat[:, None], cache)
        return logits[:, 0], (M.advance(cache, jnp.ones_like(cache.lengths)), h[:, 0], dstate, tcache)

    def finish(self, carry):
        cache, feat, dstate, tcache = carry
        return dstate.replace(cache=cache.replace(lengths=dstate.cache.lengths)), tcache

    def commit(self, dparams, tparams, tcfg, dstate, block_tokens, n_accepted, next_token, verify_out):
        from .. import heads as H

        feats = H.head_features(self.head, dparams, verify_out)  # f_c .. f_{c+K}
        T = block_tokens.shape[1]
        pairs = shifted_pairs(block_tokens, jnp.full_like(n_accepted, T), next_token)
        t = jnp.arange(T)[None]
        pairs = jnp.where(t == n_accepted[:, None], next_token[:, None], pairs)
        h, logits, cache = self._read_pairs(dparams, tparams, dstate.cache, pairs, feats, n_accepted)
        return EagleState(cache=M.advance(cache, n_accepted + 1), feature=h, logits=logits)


DRAFTER_NAMES = ("ngram", "early-exit", "model", "eagle", "eagle3")
