"""An independent small draft model sharing the target's vocabulary."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import struct

from ... import model as M
from ...config import ModelConfig
from ..state import take_row
from .base import DrafterError


@struct.dataclass
class ModelDraftState:
    cache: M.KVCache  # cursor = position of prev_token (its K/V gets rewritten each round)
    prev_token: jax.Array  # [B] the token before the pending one


def approx_params(cfg: ModelConfig) -> int:
    """Weights a decode step reads: every layer's attention and MLP, and the LM head."""
    attention = cfg.hidden_size * (cfg.q_size + 2 * cfg.kv_size) + cfg.q_size * cfg.hidden_size
    return cfg.num_layers * (attention + 3 * cfg.hidden_size * cfg.intermediate_size) + cfg.vocab_size * cfg.hidden_size


# [I] A decode step at batch 1 as a fixed latency per layer plus the bytes of its weights, in
# units of bytes: a layer costs what reading LAYER_LATENCY_BYTES more would. Fitted to the one pair
# measured (H100, bf16): Qwen2.5-Coder 1.5B 1,923 µs a step (28 layers, 3.1 GB), 0.5B 934 µs
# (24 layers, 1.0 GB), i.e. 21 µs a layer and 0.43 µs a MB.
LAYER_LATENCY_BYTES = 48e6


def step_fraction(dcfg: ModelConfig, tcfg: ModelConfig, bytes_per_weight: int = 2) -> float:
    """[I] A draft model's step as a fraction of its target's, before anything is timed: each
    model's layers times LAYER_LATENCY_BYTES (a small model's step is bound by per-layer launch
    and latency cost) plus its weights' bytes (a large one's by reading them). Qwen2.5-Coder 0.5B
    for the 1.5B: 0.49, as measured on an H100. `auto` plans with it until a cost table holds the
    pair's measured draft step (policies.auto.CostModel)."""
    def cost(c: ModelConfig) -> float:
        return c.num_layers * LAYER_LATENCY_BYTES + bytes_per_weight * approx_params(c)
    return cost(dcfg) / cost(tcfg)


@dataclasses.dataclass(frozen=True)
class ModelDrafter:
    """An independent small draft model sharing the target's vocabulary (dparams: its weights).
    `step_fraction`: its step as a share of the target's (`step_fraction`), which `auto` plans
    with where no cost table holds its measured draft step; None: unknown. `acceptance` and
    `acceptance_by_temperature`: what `jspec calibrate` recorded for this pair (fields below)."""

    cfg: ModelConfig
    step_fraction: float | None = None
    # per-token acceptance `jspec calibrate` recorded for this draft model and target, which `auto`
    # plans with (policies.auto.plan_for); None: the cost table's or the default prior
    acceptance: float | None = None
    # ((temperature, acceptance), ...) `jspec calibrate --temperatures` recorded, which `auto` plans
    # sampled calls with; None: policies.auto.TEMPERATURE_RATIO of `acceptance`
    acceptance_by_temperature: tuple[tuple[float, float], ...] | None = None
    name = "model"
    parallel = False
    deterministic = False
    capture_layers = ()

    @property
    def cost_key(self) -> str:
        """Where a cost table keeps this drafter's own draft-step costs (policies.auto.CostModel):
        a draft model's step is a forward of its own shape, not an EAGLE head's."""
        c = self.cfg
        return f"model:{c.num_layers}x{c.hidden_size}x{c.intermediate_size}:{c.vocab_size}"

    def check(self, tcfg: ModelConfig):
        if self.cfg.vocab_size != tcfg.vocab_size:
            raise DrafterError(
                f"draft model vocabulary ({self.cfg.vocab_size} tokens) does not match the target's "
                f"({tcfg.vocab_size} tokens); speculative decoding needs a shared tokenizer"
            )

    def loop_params(self, dparams):
        return M.loop_params(dparams, self.cfg)  # per-layer buffers, as the target's in the round loop

    def init(self, dparams, tparams, tcfg, prompt, lens, first_token, prefill_out, cache_len):
        B = prompt.shape[0]
        cache = M.init_cache(self.cfg, B, cache_len, dparams["embed"].dtype)
        out = M.forward(dparams, self.cfg, prompt, cache, unroll=1)  # a prompt: scanned
        cache = out.cache.replace(lengths=(lens - 1).astype(jnp.int32))
        return ModelDraftState(cache=cache, prev_token=take_row(prompt[:, :, None], lens - 1)[:, 0])

    def begin(self, dparams, tparams, tcfg, dstate, tcache, last_token):
        # Rewrite prev_token (harmless if already cached) and feed the pending token: a static
        # 2-token block covers both "n < K" and "all K accepted" rounds.
        base = dstate.cache.lengths
        block = jnp.stack([dstate.prev_token, last_token], axis=1)
        out = M.forward(dparams, self.cfg, block, dstate.cache)
        logits = M.lm_head(dparams, self.cfg, out.hidden[:, 1])
        return logits, M.advance(out.cache, jnp.full_like(base, 2)), (dstate, tcache)

    def step(self, dparams, tparams, tcfg, consts, cache, token):
        out = M.forward(dparams, self.cfg, token[:, None], cache)
        logits = M.lm_head(dparams, self.cfg, out.hidden[:, 0])
        return logits, M.advance(out.cache, jnp.ones_like(cache.lengths))

    def finish(self, consts, cache):
        dstate, tcache = consts
        return dstate.replace(cache=cache.replace(lengths=dstate.cache.lengths)), tcache

    def commit(self, dparams, tparams, tcfg, dstate, block_tokens, n_accepted, next_token, verify_out):
        prev = take_row(block_tokens[:, :, None], n_accepted)[:, 0]
        return ModelDraftState(cache=M.advance(dstate.cache, n_accepted + 1), prev_token=prev)
