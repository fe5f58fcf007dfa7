"""Build a drafter (and its weights) from a short spec string, as the CLI and the bench take them.

    ngram[:N]          prompt lookup with n-grams of length N..1 (default 3)
    early-exit[:E]     the target's first E layers + its LM head (default L // 4)
    model:PATH         an independent draft model (preset, HF dir, GGUF or Orbax dir), or a
                       tied draft model distilled from the target (jspec.train.draft_model),
                       whose embeddings and LM head are the target's
    eagle[:PATH]       EAGLE-1 head (default: the head shipped with the preset)
    eagle3[:PATH]      EAGLE-3 head (default: the head shipped with the preset)
"""

from __future__ import annotations

from typing import Any

from ..checkpoint.draft_format import is_draft_model_dir, load_draft_model
from ..checkpoint.eagle_format import load_eagle_head
from ..config import ModelConfig
from ..presets import list_presets, load_preset, resolve_model
from .drafters.base import DrafterError
from .drafters.eagle import EagleDrafter
from .drafters.early_exit import EarlyExitDrafter
from .drafters.model import ModelDrafter
from .drafters.ngram import NgramDrafter

DRAFTER_NAMES = ("ngram", "early-exit", "model", "eagle", "eagle3")


def _split(spec: str) -> tuple[str, str | None]:
    name, _, arg = spec.partition(":")
    return name.strip(), (arg.strip() or None)


def shipped_head_path(model_name: str | None, kind: str):
    """The head a preset ships for `kind` ("eagle" or "eagle3"), or None."""
    if not model_name:
        return None
    if model_name not in list_presets():
        return None
    path = load_preset(model_name).drafter_path(kind)
    return path if path is not None and path.exists() else None


def build_drafter(spec: str, cfg: ModelConfig, params: dict, *, model_name: str | None = None, dtype=None) -> tuple[Any, Any]:
    """(drafter, drafter_params) for a spec string; raises DrafterError with the fix in the message."""
    name, arg = _split(spec)
    if name == "ngram":
        n = int(arg) if arg else 3
        return NgramDrafter(max_ngram=n), None
    if name == "early-exit":
        exit_layer = int(arg) if arg else max(1, cfg.num_layers // 4)
        drafter = EarlyExitDrafter(exit_layer=exit_layer)
        drafter.check(cfg)
        return drafter, None
    if name == "model":
        if not arg:
            raise DrafterError("model drafter needs a path or preset: --drafter model:PATH")
        if is_draft_model_dir(arg):
            dcfg, dparams = load_draft_model(arg, cfg, params, dtype=dtype)
        else:
            dcfg, dparams, _ = resolve_model(arg, dtype=dtype or params["embed"].dtype, tokenizer=False)
        drafter = ModelDrafter(dcfg)
        drafter.check(cfg)
        return drafter, dparams
    if name in ("eagle", "eagle1", "eagle3"):
        kind = "eagle3" if name == "eagle3" else "eagle"
        path = arg or shipped_head_path(model_name, kind)
        if path is None:
            raise DrafterError(
                f"no {kind} head given and none shipped for model {model_name!r}; "
                f"train one with `jspec train-head` or pass --drafter {kind}:PATH"
            )
        hcfg, hparams = load_eagle_head(str(path), cfg, dtype=dtype or params["embed"].dtype)
        drafter = EagleDrafter(hcfg)
        drafter.check(cfg)
        return drafter, hparams
    raise DrafterError(f"unknown drafter {spec!r}; choose from {', '.join(DRAFTER_NAMES)} (e.g. ngram, early-exit:8, model:PATH)")
