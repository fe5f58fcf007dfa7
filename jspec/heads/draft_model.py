"""A small draft model cut from the target: a few of its layers, its embeddings and LM head tied.

The draft model is an ordinary decoder in jspec's parameter layout (`jspec.model`), with the
target's config except `num_layers`, so every engine runs it with `model.forward`. It is
initialised from `layers_from` (target layer indices, default evenly spaced, first and last
included) and then distilled (jspec.train.draft_model). Its `embed` and `lm_head` are the
target's own arrays, never trained and never saved: a checkpoint holds the layers and the final
norm only (jspec.checkpoint.draft_format), and loading ties them to the target again.

Pure functions over dicts; nothing here reads or writes files.
"""

from __future__ import annotations

import numpy as np

from ..config import ModelConfig

TIED_KEYS = ("embed", "lm_head")  # taken from the target, never trained or saved
TRAINABLE_KEYS = ("layers", "final_norm")


def default_layers_from(target_layers: int, num_layers: int) -> tuple[int, ...]:
    """`num_layers` target layers, evenly spaced, first and last included (e.g. 30 -> 4:
    0, 10, 19, 29). The first layers build token features and the last ones turn them into the
    output distribution, so keeping both ends starts the distillation near the target [I]."""
    if not 1 <= num_layers <= target_layers:
        raise ValueError(f"draft layers must be in [1, {target_layers}], got {num_layers}")
    if num_layers == 1:
        return (target_layers - 1,)
    return tuple(int(round(x)) for x in np.linspace(0, target_layers - 1, num_layers))


def draft_config(tcfg: ModelConfig, num_layers: int) -> ModelConfig:
    """The target's config with fewer layers (per-layer flags cut to match)."""
    sliding = tcfg.sliding_layers[:num_layers] if tcfg.sliding_layers else ()
    return tcfg.replace(num_layers=num_layers, sliding_layers=sliding)


def draft_config_from_layers(tcfg: ModelConfig, layers_from: tuple[int, ...]) -> ModelConfig:
    sliding = tuple(tcfg.sliding_layers[i] for i in layers_from) if tcfg.sliding_layers else ()
    return tcfg.replace(num_layers=len(layers_from), sliding_layers=sliding)


def init_from_target(tparams: dict, tcfg: ModelConfig, layers_from: tuple[int, ...]) -> tuple[ModelConfig, dict]:
    """(draft cfg, draft params): the chosen target layers (copies) and final norm, tied embeddings."""
    if not layers_from or min(layers_from) < 0 or max(layers_from) >= tcfg.num_layers:
        raise ValueError(f"layers_from must name target layers in [0, {tcfg.num_layers}), got {layers_from}")
    idx = np.asarray(layers_from, np.int32)
    dcfg = draft_config_from_layers(tcfg, tuple(layers_from))
    trainable = {"layers": {k: v[idx] for k, v in tparams["layers"].items()}, "final_norm": tparams["final_norm"]}
    return dcfg, tie(trainable, tparams)


def split_trainable(dparams: dict) -> dict:
    """The part that is trained and saved: layers and final norm."""
    return {k: dparams[k] for k in TRAINABLE_KEYS}


def tie(trainable: dict, tparams: dict) -> dict:
    """Full draft params: trained layers + final norm, the target's embeddings and LM head."""
    return {**{k: tparams[k] for k in TIED_KEYS if k in tparams}, **split_trainable(trainable)}


def trainable_bytes(trainable: dict, bytes_per_param: int = 2) -> int:
    return int(sum(np.prod(a.shape) for a in _leaves(trainable))) * bytes_per_param


def _leaves(tree):
    if isinstance(tree, dict):
        for v in tree.values():
            yield from _leaves(v)
    else:
        yield tree
