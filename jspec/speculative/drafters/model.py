"""An independent small draft model sharing the target's vocabulary."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from ... import model as M
from ...config import ModelConfig
from ..state import take_row
from .base import DrafterError


@struct.dataclass
class ModelDraftState:
    cache: M.KVCache  # cursor = position of prev_token (its K/V gets rewritten each round)
    prev_token: jax.Array  # [B] the token before the pending one


def approx_params(cfg: ModelConfig, draft_vocab: int = 0) -> int:
    """Weights a decode step reads: every layer's attention and MLP, and the LM head (its
    `draft_vocab` columns when the draft scores only those)."""
    attention = cfg.hidden_size * (cfg.q_size + 2 * cfg.kv_size) + cfg.q_size * cfg.hidden_size
    vocab = draft_vocab or cfg.vocab_size
    return cfg.num_layers * (attention + 3 * cfg.hidden_size * cfg.intermediate_size) + vocab * cfg.hidden_size


# [I] A decode step at batch 1 as a fixed latency per layer plus the bytes of its weights, in
# units of bytes: a layer costs what reading LAYER_LATENCY_BYTES more would. Fitted to the one pair
# measured (H100, bf16): Qwen2.5-Coder 1.5B 1,923 µs a step (28 layers, 3.1 GB), 0.5B 934 µs
# (24 layers, 1.0 GB), i.e. 21 µs a layer and 0.43 µs a MB.
LAYER_LATENCY_BYTES = 48e6


def step_fraction(dcfg: ModelConfig, tcfg: ModelConfig, bytes_per_weight: int = 2, draft_vocab: int = 0) -> float:
    """[I] A draft model's step as a fraction of its target's, before anything is timed: each
    model's layers times LAYER_LATENCY_BYTES (a small model's step is bound by per-layer launch
    and latency cost) plus its weights' bytes (a large one's by reading them). Qwen2.5-Coder 0.5B
    for the 1.5B: 0.49, as measured on an H100. `auto` plans with it until a cost table holds the
    pair's measured draft step (policies.auto.CostModel)."""
    def cost(c: ModelConfig, vocab: int = 0) -> float:
        return c.num_layers * LAYER_LATENCY_BYTES + bytes_per_weight * approx_params(c, vocab)
    return cost(dcfg, draft_vocab) / cost(tcfg)


def restrict_vocab(dparams: dict, cfg: ModelConfig, token_ids) -> dict:
    """dparams with a draft vocabulary (token_ids: e.g. heads.eagle.draft_vocab_from_counts' d2t): `d2t` [Vd] (the target ids the draft scores, sorted) and
    `draft_lm_head` [D, Vd] (those columns of its LM head, or rows of its tied embedding). The
    full LM head stays, unread by the drafter's steps."""
    ids = np.unique(np.asarray(token_ids, np.int64))
    if not len(ids) or ids[0] < 0 or ids[-1] >= cfg.vocab_size:
        raise ValueError(f"draft vocabulary: token ids must lie in [0, {cfg.vocab_size}) and not be empty")
    d2t = jnp.asarray(ids, jnp.int32)
    tied = cfg.tie_word_embeddings or "lm_head" not in dparams
    weight = dparams["embed"][d2t].T if tied else dparams["lm_head"][:, d2t]  # [D, Vd] either way
    return {**dparams, "d2t": d2t, "draft_lm_head": weight}


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
    # [I] FR-Spec's frequency-ranked draft vocabulary: the draft's LM head scores only these many
    # target ids (dparams from `restrict_vocab`), the rest get NEG_INF; 0: the whole vocabulary.
    # A small model's LM head is a large share of its step (Qwen2.5-Coder 0.5B: 136M of its 494M
    # weights); drafts outside the set are never proposed, which verification keeps lossless.
    draft_vocab: int = 0
    name = "model"
    parallel = False
    deterministic = False
    capture_layers = ()

    @property
    def cost_key(self) -> str:
        """Where a cost table keeps this drafter's own draft-step costs (policies.auto.CostModel):
        a draft model's step is a forward of its own shape, not an EAGLE head's."""
        c = self.cfg
        vocab = f"{c.vocab_size}" + (f"/{self.draft_vocab}" if self.draft_vocab else "")
        return f"model:{c.num_layers}x{c.hidden_size}x{c.intermediate_size}:{vocab}"

    def check(self, tcfg: ModelConfig):
        if self.cfg.vocab_size != tcfg.vocab_size:
            raise DrafterError(
                f"draft model vocabulary ({self.cfg.vocab_size} tokens) does not match the target's "
                f"({tcfg.vocab_size} tokens); speculative decoding needs a shared tokenizer"
            )
        if not 0 <= self.draft_vocab <= tcfg.vocab_size:
            raise DrafterError(f"draft_vocab {self.draft_vocab}: choose 0 (the whole vocabulary) to {tcfg.vocab_size}")

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
        logits = self.logits(dparams, out.hidden[:, 1])
        return logits, M.advance(out.cache, jnp.full_like(base, 2)), (dstate, tcache)

    def step(self, dparams, tparams, tcfg, consts, cache, token):
        out = M.forward(dparams, self.cfg, token[:, None], cache)
        logits = self.logits(dparams, out.hidden[:, 0])
        return logits, M.advance(out.cache, jnp.ones_like(cache.lengths))

    def logits(self, dparams, hidden):
        """float32 logits over the target's vocabulary [B, V]; with a draft vocabulary, only its
        columns are computed and every other id gets NEG_INF (probability 0 when sampled)."""
        if not self.draft_vocab:
            return M.lm_head(dparams, self.cfg, hidden)
        small = M.matmul(hidden, dparams["draft_lm_head"], out_dtype=jnp.float32)
        if self.cfg.final_logit_softcap:
            small = jnp.tanh(small / self.cfg.final_logit_softcap) * self.cfg.final_logit_softcap
        full = jnp.full(small.shape[:-1] + (self.cfg.vocab_size,), M.NEG_INF, small.dtype)
        return full.at[..., dparams["d2t"]].set(small)

    def finish(self, consts, cache):
        dstate, tcache = consts
        return dstate.replace(cache=cache.replace(lengths=dstate.cache.lengths)), tcache

    def commit(self, dparams, tparams, tcfg, dstate, block_tokens, n_accepted, next_token, verify_out):
        prev = take_row(block_tokens[:, :, None], n_accepted)[:, 0]
        return ModelDraftState(cache=M.advance(dstate.cache, n_accepted + 1), prev_token=prev)
