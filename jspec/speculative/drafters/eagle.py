"""EAGLE-1 / EAGLE-3 head drafter: drafts with a feature head over the target's features."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import struct

from ... import model as M
from ...config import ModelConfig
from ...heads import eagle as H
from ..state import take_row
from .base import DrafterError


def shifted_pairs(tokens: jax.Array, lens: jax.Array, next_token: jax.Array) -> jax.Array:
    """Tokens x_{t+1} for t in [0, T): tokens shifted left by one, next_token at index lens-1."""
    shifted = jnp.concatenate([tokens[:, 1:], tokens[:, -1:]], axis=1)
    t = jnp.arange(tokens.shape[1])[None]
    return jnp.where(t == (lens - 1)[:, None], next_token[:, None], shifted)


@struct.dataclass
class EagleState:
    cache: M.KVCache  # the head's own one-layer cache; cursor = target cursor
    feature: jax.Array  # [B, D] head output at the last committed pair (fed to the next step)
    logits: jax.Array  # [B, Vd] draft-vocab logits (float32) of the first token of the next round


@dataclasses.dataclass(frozen=True)
class EagleDrafter:
    """EAGLE-1 / EAGLE-3 feature head (jspec.heads.eagle). dparams: the head's weights.

    Pair t of the head's sequence is (target feature f_t, token x_{t+1}). After each verification
    the head re-reads the accepted pairs with the target's true features (overwriting what it wrote
    while drafting), so its cache always holds exact-feature K/V for the committed prefix.
    """

    head: H.HeadConfig
    # per-token acceptance measured for this head (its config.json "jspec": {"acceptance": {"alpha"}}):
    # the `auto` policy's prior for the static budget, before the rows' own estimates take over
    acceptance: float | None = None
    # ((temperature, acceptance), ...) measured when sampling (config.json "acceptance": {"by_temperature"}),
    # which `auto` plans sampled calls with; None: policies.auto.TEMPERATURE_RATIO of `acceptance`
    acceptance_by_temperature: tuple[tuple[float, float], ...] | None = None
    # how the head's draft steps run attention (model.KERNEL_IMPLS; None: model.default_kernels() at
    # trace time, the fused kernel on a single GPU). A set value is part of the drafter, a static jit
    # argument, so one process can compile and time both paths
    kernels: str | None = None
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
        """Write T pairs' exact-feature K/V; the LM head runs only on the row that drafts next."""
        h, _, cache = H.head_forward(self.head, dparams, tparams, tokens, feats, cache,  # logits: dead code
                                     kernels=self.kernels)
        h = take_row(h, last_idx)
        return h, H.draft_logits(self.head, dparams, tparams, h), cache

    def init(self, dparams, tparams, tcfg, prompt, lens, first_token, prefill_out, cache_len):
        B = prompt.shape[0]
        cache = H.init_head_cache(self.head, B, cache_len, tparams["embed"].dtype)
        feats = H.head_features(self.head, dparams, prefill_out)
        pairs = shifted_pairs(prompt, lens, first_token)
        h, logits, cache = self._read_pairs(dparams, tparams, cache, pairs, feats, lens - 1)
        return EagleState(cache=cache.replace(lengths=lens.astype(jnp.int32)), feature=h, logits=logits)

    # Chain drafting. A step attends to the committed cache (its cursor moved past the earlier
    # drafts of this round, whose K/V the step wrote there) and to itself; `finish` rewinds the
    # cursor, and `commit` overwrites those slots with exact-feature K/V.
    def begin(self, dparams, tparams, tcfg, dstate, tcache, last_token):
        index = H.target_index(self.head, dparams)
        return H.gather_target_vocab(dstate.logits, index), (dstate.cache, dstate.feature), (dstate, tcache, index)

    def step(self, dparams, tparams, tcfg, consts, carry, token):
        (cache, feat), (_, _, index) = carry, consts
        h, logits, cache = H.head_chain_step(self.head, dparams, tparams, token[:, None], feat[:, None], cache,
                                             kernels=self.kernels)  # K/V written at the cursor
        cache = M.advance(cache, jnp.ones_like(cache.lengths))
        return H.gather_target_vocab(logits[:, 0], index), (cache, h[:, 0])

    def finish(self, consts, carry):
        (dstate, tcache, _), (cache, _) = consts, carry
        return dstate.replace(cache=cache.replace(lengths=dstate.cache.lengths)), tcache

    def commit(self, dparams, tparams, tcfg, dstate, block_tokens, n_accepted, next_token, verify_out):
        feats = H.head_features(self.head, dparams, verify_out)  # f_c .. f_{c+K}
        T = block_tokens.shape[1]
        pairs = shifted_pairs(block_tokens, jnp.full_like(n_accepted, T), next_token)
        t = jnp.arange(T)[None]
        pairs = jnp.where(t == n_accepted[:, None], next_token[:, None], pairs)
        h, logits, cache = self._read_pairs(dparams, tparams, dstate.cache, pairs, feats, n_accepted)
        return EagleState(cache=M.advance(cache, n_accepted + 1), feature=h, logits=logits)
