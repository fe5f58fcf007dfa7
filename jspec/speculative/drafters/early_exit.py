"""Self-drafting with the target's first layers (early exit) and its own LM head."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from ... import model as M
from ...config import ModelConfig
from .base import DrafterError


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
