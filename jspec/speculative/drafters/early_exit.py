"""Self-drafting with the target's first layers (early exit): its own final norm and LM head, or a
trained exit head (heads/exit_head.py)."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from ... import model as M
from ...config import ModelConfig
from ...heads import exit_head as EH
from .base import DrafterError


@dataclasses.dataclass(frozen=True)
class EarlyExitDrafter:
    """Self-draft with the target's first `exit_layer` layers, then its final norm and LM head, or,
    with `head` (the config of a trained exit head; dparams are its weights), that one-layer head
    on the raw residual stream and the tied LM head.

    The draft shares the target's KV cache for those layers: an accepted token's early-layer K/V
    is the same whether computed while drafting or verifying, and the verify pass rewrites every
    drafted slot anyway. Without a head: no extra memory, no extra weights (dparams may be None).
    The head has its own one-layer cache (the drafter state), read and written at the target
    cache's cursor; its prompt part comes from the target's prefill (which captures layer E's input).
    """

    exit_layer: int
    head: ModelConfig | None = None
    name = "early-exit"
    parallel = False
    deterministic = False

    @property
    def capture_layers(self):
        return (self.exit_layer,) if self.head is not None else ()

    @property
    def cost_key(self) -> str:
        """Where a cost table keeps this drafter's draft-step costs (policies.auto.CostModel)."""
        return f"early-exit:{self.exit_layer}{':head' if self.head is not None else ''}"

    def check(self, tcfg: ModelConfig):
        if not 0 < self.exit_layer < tcfg.num_layers:
            raise DrafterError(f"exit_layer must be in [1, {tcfg.num_layers - 1}], got {self.exit_layer}")
        if self.head is not None and (self.head.hidden_size != tcfg.hidden_size or self.head.vocab_size != tcfg.vocab_size):
            raise DrafterError("the exit head was trained for another target (hidden size or vocabulary differ)")

    def init(self, dparams, tparams, tcfg, prompt, lens, first_token, prefill_out, cache_len):
        if self.head is None:
            return ()
        cache = M.init_cache(self.head, prompt.shape[0], cache_len, dparams["embed"].dtype)
        return EH.head_logits(dparams, self.head, prefill_out.captured[0], cache)[1]

    def _run(self, dparams, tparams, tcfg, tcache, hcache, token):
        if self.head is None:
            out = M.forward(tparams, tcfg, token[:, None], tcache, layer_range=(0, self.exit_layer))
            logits = M.lm_head(tparams, tcfg, out.hidden[:, 0])
        else:
            out = EH.trunk_hidden(tparams, tcfg, token[:, None], tcache, self.exit_layer)
            logits, hcache = EH.head_logits(dparams, self.head, out.hidden, hcache.replace(lengths=tcache.lengths))
            logits = logits[:, 0]
        return logits, M.advance(out.cache, jnp.ones_like(tcache.lengths)), hcache

    def begin(self, dparams, tparams, tcfg, dstate, tcache, last_token):
        logits, cache, hcache = self._run(dparams, tparams, tcfg, tcache, dstate, last_token)
        return logits, (cache, hcache), tcache.lengths

    def step(self, dparams, tparams, tcfg, consts, carry, token):
        cache, hcache = carry
        logits, cache, hcache = self._run(dparams, tparams, tcfg, cache, hcache, token)
        return logits, (cache, hcache)

    def finish(self, base, carry):
        cache, hcache = carry
        return hcache, cache.replace(lengths=base)

    def commit(self, dparams, tparams, tcfg, dstate, block_tokens, n_accepted, next_token, verify_out):
        return dstate
