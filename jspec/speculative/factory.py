"""Build a drafter (and its weights) from a short spec string, as the CLI and the bench take them.

    ngram[:N]          prompt lookup with n-grams of length N..1 (default 3)
    early-exit[:E]     the target's first E layers + its LM head (default L // 4)
    early-exit:PATH    the target's first E layers + a trained exit head (heads/exit_head.py;
                       `scripts/train_draft_model.py --exit-layer E` writes PATH, which records E)
    model[:PATH]       an independent draft model (preset, HF dir, GGUF or Orbax dir), or a
                       tied draft model distilled from the target (jspec.train.draft_model),
                       whose embeddings and LM head are the target's (default: the draft model
                       shipped with the preset, preset.json "drafters": {"model": DIR})
    eagle[:PATH]       EAGLE-1 head (default: the head shipped with the preset)
    eagle3[:PATH]      EAGLE-3 head (default: the head shipped with the preset)
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ..checkpoint.draft_format import exit_layer_of, is_draft_model_dir, load_draft_model
from ..checkpoint.eagle_format import load_eagle_head
from ..config import ModelConfig
from ..presets import list_presets, load_preset, resolve_model
from .drafters.base import DrafterError
from .drafters.eagle import EagleDrafter
from .drafters.early_exit import EarlyExitDrafter
from .drafters.model import ModelDrafter
from .drafters.ngram import NgramDrafter
from .policies.ldlp import WEIGHTS_FILE as LDLP_WEIGHTS_FILE

DRAFTER_NAMES = ("ngram", "early-exit", "model", "eagle", "eagle3")


DRAFTER_CLASSES = {"ngram": NgramDrafter, "early-exit": EarlyExitDrafter, "model": ModelDrafter,
                   "eagle": EagleDrafter, "eagle1": EagleDrafter, "eagle3": EagleDrafter}


def _split(spec: str) -> tuple[str, str | None]:
    name, _, arg = spec.partition(":")
    return name.strip(), (arg.strip() or None)


def check_drafter_spec(spec: str) -> type:
    """Validate a drafter spec without loading anything (so a CLI can reject it before the model
    loads): the name, the argument's form, and that a head path given exists. Returns the
    drafter's class (its class attributes, e.g. `parallel`, say what policies it can serve)."""
    name, arg = _split(spec)
    if name not in DRAFTER_CLASSES:
        raise DrafterError(f"unknown drafter {spec!r}; choose from {', '.join(DRAFTER_NAMES)} (e.g. ngram, early-exit:8, model:PATH)")
    if name == "early-exit" and arg is not None and not arg.isdigit():
        if exit_layer_of(arg) is None:
            raise DrafterError(f"drafter {spec!r}: {arg} is neither an exit layer (a positive integer) nor an exit-head "
                               "directory (scripts/train_draft_model.py --exit-layer E)")
    elif name in ("ngram", "early-exit") and arg is not None and not (arg.isdigit() and int(arg) >= 1):
        what = "the longest n-gram" if name == "ngram" else "the exit layer"
        raise DrafterError(f"drafter {spec!r}: {what} must be a positive integer, e.g. {name}:3")
    if name.startswith("eagle") and arg is not None and not Path(arg).is_dir():
        raise DrafterError(f"drafter {spec!r}: {arg} is not a head directory (config.json + model.safetensors)")
    return DRAFTER_CLASSES[name]


def head_dir(spec: str, model_name: str | None) -> Path | None:
    """The EAGLE head directory a drafter spec uses (given by path, or shipped with the preset);
    None for other drafters or when there is none."""
    name, arg = _split(spec)
    if not name.startswith("eagle"):
        return None
    return Path(arg) if arg else shipped_head_path(model_name, "eagle3" if name == "eagle3" else "eagle")


def find_ldlp_weights(drafter_spec: str | None, model_name: str | None, explicit: str | None = None) -> Path:
    """The directory holding LDLP predictor weights (ldlp.safetensors + ldlp.json, written by
    `jspec train-ldlp`): ``explicit`` if given, else beside the drafter's EAGLE head
    (models/<preset>/heads/<head>/ for a preset's shipped head). Raises DrafterError, one line."""
    if explicit:
        if not (Path(explicit) / LDLP_WEIGHTS_FILE).is_file():
            raise DrafterError(f"no LDLP predictor weights at {Path(explicit) / LDLP_WEIGHTS_FILE}")
        return Path(explicit)
    name = _split(drafter_spec)[0] if drafter_spec else None
    if not name or not name.startswith("eagle"):
        raise DrafterError(
            f"policy ldlp predicts draft lengths for an EAGLE head, and its weights ship beside the head: "
            f"use --drafter eagle3 (or eagle), or pass --ldlp-weights DIR for drafter {name!r}"
        )
    head = head_dir(drafter_spec, model_name)
    if head is None:
        raise DrafterError(f"policy ldlp: no {name} head shipped for model {model_name!r}, so no predictor weights either")
    for candidate in (head, *sorted(p for p in head.glob("ldlp*") if p.is_dir())):
        if (candidate / LDLP_WEIGHTS_FILE).is_file():
            return candidate
    raise DrafterError(
        f"policy ldlp needs trained predictor weights and none ship with this head ({head / LDLP_WEIGHTS_FILE} "
        f"is missing): train them with `jspec train-ldlp --head {head}`, or pass --ldlp-weights DIR"
    )


def shipped_head_path(model_name: str | None, kind: str):
    """The head a preset ships for `kind` ("eagle", "eagle3" or "model": preset.json "drafters"), or None."""
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
    if name == "early-exit" and arg is not None and not arg.isdigit():
        if exit_layer_of(arg) is None:
            raise DrafterError(f"drafter {spec!r}: {arg} is not an exit-head directory")
        hcfg, hparams = load_draft_model(arg, cfg, params, dtype=dtype)
        drafter = EarlyExitDrafter(exit_layer=exit_layer_of(arg), head=hcfg)
        drafter.check(cfg)
        return drafter, hparams
    if name == "early-exit":
        exit_layer = int(arg) if arg else max(1, cfg.num_layers // 4)
        drafter = EarlyExitDrafter(exit_layer=exit_layer)
        drafter.check(cfg)
        return drafter, None
    if name == "model":
        arg = arg or shipped_head_path(model_name, "model")
        if not arg:
            raise DrafterError(f"no draft model given and none shipped for model {model_name!r}: "
                               "--drafter model:PATH (train one with scripts/train_draft_model.py)")
        arg = str(arg)
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
