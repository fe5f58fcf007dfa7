"""An exit head behind layer E of the target: one decoder layer, a norm and the tied LM head.

PPSD (speculative/engines/ppsd.py) drafts with the target's first E layers plus this head. The
head is a one-layer decoder in jspec's parameter layout (`exit_config`: the target's config with
`num_layers = 1`), so `model.forward(..., hidden_in=h_E)` runs it on the raw residual stream
after layer E−1 with its own one-layer KV cache, and `model.lm_head` reads its output with the
target's embeddings / LM head (tied: never trained, never saved). Initialised from the target's
last layer and final norm [I: the layer that already maps features to the output distribution;
EESD and Kangaroo also put a transformer layer in the exit adapter], then self-distilled with
KL(p_full ‖ q_exit) (jspec.train.draft_model with `student="exit"`). A checkpoint is a tied
draft-model directory (checkpoint/draft_format.py) whose `layers_from` is the one initialising
layer and whose extra field `exit_layer` is E.

Pure functions over dicts; nothing here reads or writes files.
"""

from __future__ import annotations

import jax

from .. import model as M
from ..config import ModelConfig
from . import draft_model as DM


def default_exit_layer(num_layers: int) -> int:
    """E = L // 2: the two pipeline stages (layers [0, E) + head, layers [E, L)) then cost about
    the same, which PPSD's per-token time max(E, L − E) rewards [I: the paper's reviews say the
    layers are split into balanced blocks]."""
    return max(1, num_layers // 2)


def check_exit_layer(tcfg: ModelConfig, exit_layer: int) -> None:
    if not 1 <= exit_layer < tcfg.num_layers:
        raise ValueError(f"exit layer must be in [1, {tcfg.num_layers - 1}] for a {tcfg.num_layers}-layer target, got {exit_layer}")


def exit_config(tcfg: ModelConfig, exit_layer: int) -> ModelConfig:
    """One decoder layer with the target's shapes (sliding flag of the layer it sits behind)."""
    sliding = (tcfg.sliding_layers[exit_layer - 1],) if tcfg.sliding_layers else ()
    return tcfg.replace(num_layers=1, sliding_layers=sliding)


def init_from_target(tparams: dict, tcfg: ModelConfig, exit_layer: int, init_layer: int | None = None) -> tuple[ModelConfig, dict]:
    """(exit cfg, exit params tied to the target): a copy of `init_layer` (default the last) and
    the final norm."""
    check_exit_layer(tcfg, exit_layer)
    init_layer = tcfg.num_layers - 1 if init_layer is None else init_layer
    ecfg = exit_config(tcfg, exit_layer)
    _, params = DM.init_from_target(tparams, tcfg, (init_layer,))
    return ecfg, params


def trunk_hidden(tparams: dict, tcfg: ModelConfig, tokens: jax.Array, cache: M.KVCache, exit_layer: int, *,
                 kernels: str | None = None) -> M.ForwardOut:
    """The target's layers [0, E) on `tokens`: the raw residual stream (the head's input)."""
    return M.forward(tparams, tcfg, tokens, cache, layer_range=(0, exit_layer), final_norm=False, kernels=kernels)


def head_logits(eparams: dict, ecfg: ModelConfig, h: jax.Array, cache: M.KVCache, *, kernels: str | None = None):
    """(logits [B, T, V] float32, exit cache) of the head on the trunk's output h [B, T, D]."""
    out = M.forward(eparams, ecfg, None, cache, hidden_in=h, kernels=kernels)
    return M.lm_head(eparams, ecfg, out.hidden), out.cache


def exit_hidden(tparams: dict, tcfg: ModelConfig, eparams: dict, ecfg: ModelConfig, tokens: jax.Array, exit_layer: int,
                *, trunk_grad: bool = False) -> jax.Array:
    """Final-normed head output [B, T, D] over whole rows (training, evaluation): the trunk is
    frozen (no gradient) unless `trunk_grad`."""
    B, T = tokens.shape
    h = trunk_hidden(tparams, tcfg, tokens, M.init_cache(tcfg, B, T, tparams["embed"].dtype), exit_layer,
                     kernels="xla").hidden
    if not trunk_grad:
        h = jax.lax.stop_gradient(h)
    out = M.forward(eparams, ecfg, None, M.init_cache(ecfg, B, T, eparams["embed"].dtype), hidden_in=h, kernels="xla")
    return out.hidden
