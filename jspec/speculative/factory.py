"""Build a drafter (and its weights) from a short spec string, as the CLI and the bench take them.

    ngram[:N]          prompt lookup with n-grams of length N..1 (default 3)
    early-exit         the exit head shipped with the preset (preset.json "drafters":
                       {"early-exit": DIR}); without one, early-exit:L//4
    early-exit:E       the target's first E layers + its own final norm and LM head (untrained)
    early-exit:PATH    the target's first E layers + a trained exit head (heads/exit_head.py;
                       `scripts/train_draft_model.py --exit-layer E` writes PATH, which records E)
    model[:PATH]       an independent draft model (preset, HF dir, GGUF or Orbax dir), or a
                       tied draft model distilled from the target (jspec.train.draft_model),
                       whose embeddings and LM head are the target's (default: the draft model
                       shipped with the preset, preset.json "drafters": {"model": DIR})
    eagle[:PATH]       EAGLE-1 head (default: the head shipped with the preset)
    eagle3[:PATH]      EAGLE-3 head (default: the head shipped with the preset)
    eagle3+ngram[:N]   the head's EAGLE-2 tree plus an n-gram prompt-lookup branch per row
                       (drafters.hybrid; trees only); eagle[:PATH]+ngram[:N] likewise
    dlm[:PATH]         DiffuSpec: a masked-diffusion LM built from the target's layers drafts a
                       block of the engine's k_max tokens in one forward (build_drafter's k_max,
                       default 8, at most the DLM's block size). PATH: dlm.safetensors from
                       scripts/train_dlm.py or its directory (default: the DLM shipped with the
                       preset, preset.json "drafters": {"dlm": DIR}). Pair it with policy adl.
                       Drafts are the per-position argmax, verified as point masses (sampling
                       stays exactly lossless; greedy is identical to AR). With a 3-gram proxy
                       table beside the DLM (proxy.npz, written by `scripts/bench_dlm.py
                       --save-proxy` from the distilled data; none ships: it is tens of MB) the
                       draft is causal-consistency path search's (CPS) best path instead.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import numpy as np

from ..cards import card_key
from ..checkpoint.draft_format import check_draft_model, exit_layer_of, is_draft_model_dir, load_draft_model
from ..checkpoint.eagle_format import (CONFIG_FILE as HEAD_CONFIG, EXTRAS_DIR, WEIGHTS_FILE as HEAD_WEIGHTS, check_head_files,
                                       head_weight_files_exist, load_eagle_head)
from ..checkpoint.errors import CheckpointError, CheckpointNotFoundError
from ..config import ModelConfig, UnsupportedModelError
from ..heads import dlm as D
from ..heads.eagle import draft_vocab_from_counts
from ..presets import list_presets, load_preset, models_dir, resolve_config, resolve_model
from .drafters.base import DrafterError
from .drafters.diffusion import PROXY_FILE, DiffuSpecDrafter, load_proxy
from .drafters.eagle import EagleDrafter
from .drafters.hybrid import HybridDrafter
from .drafters.early_exit import EarlyExitDrafter
from .drafters.model import ModelDrafter, restrict_vocab, step_fraction
from .drafters.ngram import NgramDrafter
from .policies import POLICY_NAMES, make_policy
from .policies.auto import plan_for
from .policies.calibration import (CALIBRATED_POLICIES, best_stop_rule, calibrated_acceptance, calibrated_constants,
                                   policy_from_constants)
from .policies.ldlp import WEIGHTS_FILE as LDLP_WEIGHTS_FILE, load_ldlp

DRAFTER_NAMES = ("ngram", "early-exit", "model", "eagle", "eagle3", "dlm")
DEFAULT_DLM_K_MAX = 8  # DiffuSpec drafts a block of k_max tokens; the engine's k_max must be the same


DRAFTER_CLASSES = {"ngram": NgramDrafter, "early-exit": EarlyExitDrafter, "model": ModelDrafter,
                   "eagle": EagleDrafter, "eagle1": EagleDrafter, "eagle3": EagleDrafter, "dlm": DiffuSpecDrafter}


def _split(spec: str) -> tuple[str, str | None]:
    name, _, arg = spec.partition(":")
    return name.strip(), (arg.strip() or None)


def split_hybrid(spec: str) -> tuple[str, str] | None:
    """(head spec, n-gram spec) of a hybrid spec "eagle3[:PATH]+ngram[:N]", else None. Raises
    DrafterError when a "+" joins anything else."""
    if "+" not in spec:
        return None
    parts = [p.strip() for p in spec.split("+")]
    heads = [p for p in parts if _split(p)[0] in ("eagle", "eagle1", "eagle3")]
    ngrams = [p for p in parts if _split(p)[0] == "ngram"]
    if len(parts) != 2 or len(heads) != 1 or len(ngrams) != 1:
        raise DrafterError(f"drafter {spec!r}: a hybrid joins one EAGLE head and n-gram lookup, e.g. eagle3+ngram")
    return heads[0], ngrams[0]


def check_drafter_name(spec: str) -> None:
    """A drafter spec names known drafters (a hybrid: one EAGLE head and n-gram lookup), whatever
    its arguments say; nothing is read. Raises DrafterError, one line."""
    hybrid = split_hybrid(spec)
    for part in hybrid or (spec,):
        if _split(part)[0] not in DRAFTER_CLASSES:
            raise DrafterError(f"unknown drafter {spec!r}; choose from {', '.join(DRAFTER_NAMES)} (e.g. ngram, early-exit:8, "
                               "model:PATH)")


def _check_draft_vocab_drafter(spec: str, draft_vocab: int) -> None:
    if draft_vocab and _split(spec)[0] != "model":
        raise DrafterError(f"draft_vocab {draft_vocab}: a draft vocabulary is for draft models (--drafter model); "
                           f"{spec!r} is not one (an EAGLE-3 head has its own)")


def check_drafter_spec(spec: str, model_name: str | None = None, k_max: int | None = None,
                       cfg: ModelConfig | None = None, draft_vocab: int = 0) -> type:
    """Validate a drafter spec without loading any weights (so a CLI can reject it before the
    model loads): the name, the argument's form, and that a path given exists and holds what the
    drafter reads (an EAGLE head's config.json and weights, a draft model's checkpoint);
    for ``dlm`` also, when given, that ``model_name``'s preset ships one (no PATH) and that
    ``k_max`` fits its block (read from the file's header). With the target's ``cfg`` (read from
    its header, jspec.presets.resolve_config): an early-exit layer lies inside the target, and a
    ``draft_vocab`` fits its vocabulary and has the preset's token counts to rank by.
    Returns the drafter's class (its class attributes, e.g. `parallel`, say what policies it can
    serve)."""
    _check_draft_vocab_drafter(spec, draft_vocab)
    hybrid = split_hybrid(spec)
    if hybrid is not None:
        n_gram_arg = _split(hybrid[1])[1]
        if n_gram_arg is not None and not n_gram_arg.isdigit() and _split(hybrid[0])[1] is None:
            raise DrafterError(f"drafter {spec!r}: a hybrid's head path goes with the head, "
                               f"{_split(hybrid[0])[0]}:{n_gram_arg}+ngram (ngram:N takes the longest n-gram)")
        for part in hybrid:
            check_drafter_spec(part, model_name, k_max, cfg)
        return HybridDrafter
    check_drafter_name(spec)
    name, arg = _split(spec)
    if name == "dlm":
        if arg is not None or model_name is not None:
            path = dlm_file(spec, model_name)
            block = _dlm_block_size(path)
            if k_max is not None and not 1 <= k_max <= block:
                raise DrafterError(f"drafter {spec!r}: --k-max {k_max} is more than the DLM drafts in one forward "
                                   f"(its block size, {block}): use --k-max {block} or less")
        return DiffuSpecDrafter
    if name == "early-exit" and arg is not None and not arg.isdigit():
        if exit_layer_of(arg) is None:
            raise DrafterError(f"drafter {spec!r}: {arg} is neither an exit layer (a positive integer) nor an exit-head "
                               "directory (scripts/train_draft_model.py --exit-layer E)")
    elif name in ("ngram", "early-exit") and arg is not None and not (arg.isdigit() and int(arg) >= 1):
        what = "the longest n-gram" if name == "ngram" else "the exit layer"
        raise DrafterError(f"drafter {spec!r}: {what} must be a positive integer, e.g. {name}:3")
    if name.startswith("eagle") and arg is not None:
        _check_eagle_dir(spec, Path(arg), cfg)
    if name == "model" and arg is not None and not Path(arg).exists() and arg not in list_presets():
        raise DrafterError(f"drafter {spec!r}: {arg} is neither a draft-model checkpoint path nor a preset "
                           f"(presets: {', '.join(list_presets()) or 'none'})")
    if name == "model" and cfg is not None:
        draft = arg or shipped_head_path(model_name, "model")
        if draft is not None:
            _check_draft_model(spec, str(draft), cfg)
    if draft_vocab and cfg is not None:
        if not 1 <= draft_vocab <= cfg.vocab_size:
            raise DrafterError(f"draft_vocab {draft_vocab}: choose 1 to {cfg.vocab_size} (the target's vocabulary)")
        token_counts(model_name, cfg)
    if name == "early-exit" and cfg is not None:
        layer = (int(arg) if arg.isdigit() else exit_layer_of(arg)) if arg is not None else None
        if layer is not None and not 0 < layer < cfg.num_layers:
            raise DrafterError(f"drafter {spec!r}: exit layer {layer} is outside the target's layers: use 1 to "
                               f"{cfg.num_layers - 1} (the target has {cfg.num_layers})")
    return DRAFTER_CLASSES[name]


def check_shipped_drafter(spec: str, model_name: str) -> None:
    """A drafter named without PATH (eagle, eagle3, a hybrid's head, model) that `model_name`
    does not ship, or a draft-model preset whose weights are not installed, is refused in one
    line before the target's weights load (after the flags: check_drafter_spec)."""
    hybrid = split_hybrid(spec)
    name, arg = _split(hybrid[0] if hybrid else spec)
    if name == "model":
        draft = arg if arg is not None else shipped_head_path(model_name, "model")
        if draft is None:
            raise none_shipped("model", model_name)
        if isinstance(draft, str) and draft in list_presets():
            try:
                load_preset(draft).check_installed()
            except (CheckpointError, CheckpointNotFoundError) as e:
                raise DrafterError(f"drafter {spec!r}: {e}") from None
    elif name.startswith("eagle") and arg is None:
        kind = "eagle3" if name == "eagle3" else "eagle"
        if shipped_head_path(model_name, kind) is None:
            raise none_shipped(kind, model_name)


def _check_eagle_dir(spec: str, path: Path, cfg: ModelConfig | None) -> None:
    """An EAGLE head directory holds config.json (with the target's hidden size) and its weights:
    model.safetensors, pytorch_model.bin, or Hugging Face shards with their index."""
    if not (path / HEAD_CONFIG).is_file() or not head_weight_files_exist(path):
        missing = [f for f, ok in ((HEAD_CONFIG, (path / HEAD_CONFIG).is_file()), (HEAD_WEIGHTS, head_weight_files_exist(path)))
                   if not ok]
        raise DrafterError(f"drafter {spec!r}: {path} is not an EAGLE head directory (no {' or '.join(missing)}; "
                           f"`jspec train-head` writes {HEAD_CONFIG} + {HEAD_WEIGHTS}, or shards with their index)")
    try:
        hidden = json.loads((path / HEAD_CONFIG).read_text())["hidden_size"]
    except (ValueError, KeyError, TypeError) as e:
        raise DrafterError(f"drafter {spec!r}: {path / HEAD_CONFIG} is not an EAGLE head config ({type(e).__name__}: {e})") from None
    if cfg is not None and hidden != cfg.hidden_size:
        raise DrafterError(f"drafter {spec!r}: the head's hidden size {hidden} is not the target's {cfg.hidden_size}")
    try:
        check_head_files(str(path))
    except (CheckpointError, CheckpointNotFoundError) as e:
        raise DrafterError(f"drafter {spec!r}: {e}") from None


def _check_draft_model(spec: str, path: str, cfg: ModelConfig) -> None:
    """A draft model serves this target: a tied one (jspec.train.draft_model) was trained for it and
    its files are whole; an independent one (a preset or checkpoint, its header read) shares the
    target's vocabulary. Nothing but headers is read."""
    try:
        if is_draft_model_dir(path):
            check_draft_model(path, cfg)
            return
        vocab = resolve_config(path).vocab_size
    except (CheckpointError, CheckpointNotFoundError, UnsupportedModelError) as e:
        raise DrafterError(f"drafter {spec!r}: {' '.join(str(e).split())}") from None
    if vocab != cfg.vocab_size:
        raise DrafterError(f"drafter {spec!r}: the draft model's vocabulary ({vocab} tokens) is not the target's "
                           f"({cfg.vocab_size} tokens); speculative decoding needs a shared tokenizer")


def dlm_file(spec: str, model_name: str | None) -> Path:
    """The DLM weights a ``dlm[:PATH]`` spec names: PATH (a dlm.safetensors file, or a directory
    holding one), else the preset's shipped "dlm" directory. Raises DrafterError, one line."""
    name, arg = _split(spec)
    if arg is None:
        shipped = shipped_head_path(model_name, "dlm")
        if shipped is None:
            raise DrafterError(f"no DLM given and none shipped for model {model_name!r}: --drafter dlm:PATH "
                               "(a dlm.safetensors from scripts/train_dlm.py, or its directory)")
        arg = str(shipped)
    path = Path(arg)
    if path.is_dir():
        path = path / "dlm.safetensors"
    if not path.is_file():
        raise DrafterError(f"drafter {spec!r}: no DLM weights at {path} (scripts/train_dlm.py writes dlm.safetensors)")
    return path


def _dlm_block_size(path: Path) -> int:
    """The block size recorded in a DLM file's header (no tensors read)."""
    from safetensors import safe_open

    try:
        with safe_open(str(path), "np") as fh:
            meta = fh.metadata() or {}
        if meta.get("format") != D.SAFETENSORS_FORMAT:
            raise ValueError(f"format {meta.get('format')!r}, not {D.SAFETENSORS_FORMAT!r}")
        return int(json.loads(meta["config"])["block_size"])
    except Exception as e:  # a truncated or foreign file: one line
        raise DrafterError(f"{path}: not a DLM written by scripts/train_dlm.py ({' '.join(str(e).split())})") from None


def head_dir(spec: str, model_name: str | None) -> Path | None:
    """The EAGLE head directory a drafter spec uses (given by path, or shipped with the preset);
    None for other drafters or when there is none."""
    hybrid = split_hybrid(spec)
    name, arg = _split(hybrid[0] if hybrid else spec)
    if not name.startswith("eagle"):
        return None
    return Path(arg) if arg else shipped_head_path(model_name, "eagle3" if name == "eagle3" else "eagle")


def calibration_home(spec: str, model_name: str | None) -> tuple[Path | None, str | None]:
    """(folder, target) of a drafter's policy fits (`jspec calibrate`): an EAGLE head's folder
    (target None: a head drafts for its own target only); a draft model's folder (its preset's
    under models/, or PATH) with the target `model_name`, since one draft model may serve several
    targets and accepts differently for each. (None, None) for drafters without calibration."""
    hybrid = split_hybrid(spec)
    name, arg = _split(hybrid[0] if hybrid else spec)
    if name.startswith("eagle"):
        return head_dir(spec, model_name), None
    if name != "model":
        return None, None
    draft = arg or shipped_head_path(model_name, "model")
    if draft is None:
        return None, None
    draft = str(draft)
    home = models_dir() / draft if draft in list_presets() else Path(draft)
    return home, str(model_name) if model_name else "target"


def auto_plan(drafter, drafter_spec: str | None, model_name: str | None, costs: dict, *, batch: int, k_cap: int, tree,
              context: float | None = None, prompts=None, sampling=None):
    """`auto`'s plan for a generate call (policies.auto.plan_for), with the drafter's calibrated
    stop rule in a batch-1 chain where one pays (`with_calibrated_stop_rule`). `drafter_spec` and
    `model_name` say where the drafter's fits live (None: no fits are looked for). The one place
    `generate`, `jspec generate` and `jspec bench` plan `auto`."""
    plan = plan_for(drafter, costs, batch=batch, k_cap=k_cap, tree=tree, context=context, prompts=prompts,
                    sampling=sampling)
    return with_calibrated_stop_rule(plan, drafter_spec, model_name, batch=batch, sampling=sampling, k_cap=k_cap)


def with_calibrated_stop_rule(plan, drafter_spec: str | None, model_name: str | None, *, batch: int, sampling=None,
                              k_cap: int):
    """`auto`'s plan (policies.auto.AutoPlan), its batch-1 greedy chain running the drafter's best
    calibrated stop rule on this card, up to `k_cap` drafts a round, where `jspec calibrate`'s
    replay puts that rule STOP_RULE_MARGIN above the best static K (calibration.best_stop_rule).
    A stop rule reads each draft's own confidence, which the plan's geometric acceptance model
    cannot: on code most rounds accept every draft and the rule drafts on, on chat it stops before
    drafts that will be rejected. Trees, hybrids, batches of several rows (the longest row's draft
    sets every row's verify) and sampled calls (the fits replay greedy rounds) keep the plan."""
    if (plan.mode != "chain" or plan.drafter or batch != 1 or not drafter_spec or split_hybrid(drafter_spec)
            or not (sampling is None or sampling.greedy)):
        return plan
    home, target = calibration_home(drafter_spec, model_name)
    best = None if home is None else best_stop_rule(home, card_key(), target)
    if best is None:
        return plan
    name, fit, gain = best
    return dataclasses.replace(plan, k_max=k_cap, stop_rule=policy_from_constants(name, fit.constants, k_cap),
                               stop_rule_name=f"{name} stop rule ({fit.describe()}; replayed {gain:.2f}x the best static K)")


def find_ldlp_weights(drafter_spec: str | None, model_name: str | None, explicit: str | None = None) -> Path:
    """The directory holding LDLP predictor weights (ldlp.safetensors + ldlp.json, written by
    `jspec train-ldlp`): ``explicit`` if given, else the drafter's EAGLE head's jspec/ subfolder
    (EXTRAS_DIR: the engines read every *.safetensors in the head folder itself, so jspec's extras
    stay out of it). Raises DrafterError, one line."""
    if explicit:
        if not (Path(explicit) / LDLP_WEIGHTS_FILE).is_file():
            raise DrafterError(f"no LDLP predictor weights at {Path(explicit) / LDLP_WEIGHTS_FILE}")
        return Path(explicit)
    hybrid = split_hybrid(drafter_spec) if drafter_spec else None
    name = _split(hybrid[0] if hybrid else drafter_spec)[0] if drafter_spec else None
    if not name or not name.startswith("eagle"):
        raise DrafterError(
            f"policy ldlp predicts draft lengths for an EAGLE head, and its weights ship beside the head: "
            f"use --drafter eagle3 (or eagle), or pass --ldlp-weights DIR for drafter {name!r}"
        )
    head = head_dir(drafter_spec, model_name)
    if head is None:
        raise DrafterError(f"policy ldlp: no {name} head shipped for model {model_name!r}, so no predictor weights either")
    extras = head / EXTRAS_DIR
    if (extras / LDLP_WEIGHTS_FILE).is_file():
        return extras
    raise DrafterError(
        f"policy ldlp needs trained predictor weights and none ship with this head ({extras / LDLP_WEIGHTS_FILE} "
        f"is missing): train them with `jspec train-ldlp --head {head}`, or pass --ldlp-weights DIR"
    )


TOKEN_COUNTS_FILE = "token_counts.npz"  # in a target preset's folder: scripts/token_counts.py writes it


def token_counts(model_name: str | None, cfg: ModelConfig) -> np.ndarray:
    """How often each token id occurs in the target's own answers to training prompts ([V]), which
    a draft vocabulary ranks by: the preset's TOKEN_COUNTS_FILE. Raises DrafterError, one line."""
    path = models_dir() / str(model_name) / TOKEN_COUNTS_FILE if model_name in list_presets() else None
    if path is None or not path.is_file():
        raise DrafterError(f"a draft vocabulary ranks the target's answer tokens, and model {model_name!r} ships no "
                           f"{TOKEN_COUNTS_FILE}: count them with scripts/token_counts.py --data DISTILLED_DIR")
    with np.load(path) as blob:
        counts = blob["counts"]
    if counts.shape != (cfg.vocab_size,):
        raise DrafterError(f"{path}: {counts.shape[0]} token counts for a vocabulary of {cfg.vocab_size}")
    return counts


def with_draft_vocab(dparams: dict, dcfg: ModelConfig, model_name: str | None, cfg: ModelConfig, draft_vocab: int) -> dict:
    """A draft model's params scoring only the target's `draft_vocab` most frequent answer tokens
    (`token_counts`, ranked by heads.eagle.draft_vocab_from_counts; drafters.model.restrict_vocab)."""
    return restrict_vocab(dparams, dcfg, draft_vocab_from_counts(token_counts(model_name, cfg), draft_vocab)[0])


def shipped_head_path(model_name: str | None, kind: str):
    """The head a preset ships for `kind` ("eagle", "eagle3", "model", "dlm", ...: preset.json
    "drafters"), or None. A draft model ("model") may be another preset, named as one (the
    Qwen2.5-Coder 1.5B's is the 0.5B): that preset's name, which `--drafter model:NAME` takes too."""
    if not model_name:
        return None
    presets = list_presets()
    if model_name not in presets:
        return None
    preset = load_preset(model_name)
    if kind == "model" and preset.drafters.get("model") in presets:
        return preset.drafters["model"]
    path = preset.drafter_path(kind)
    return path if path is not None and path.exists() else None


def none_shipped(kind: str, model_name: str | None) -> DrafterError:
    """The one-line error for a drafter named without PATH (``kind``: "eagle", "eagle3" or
    "model") whose model ships none."""
    if kind == "model":
        return DrafterError(f"no draft model given and none shipped for model {model_name!r}: "
                            "--drafter model:PATH (train one with scripts/train_draft_model.py)")
    return DrafterError(f"no {kind} head given and none shipped for model {model_name!r}; "
                        f"train one with `jspec train-head` or pass --drafter {kind}:PATH")


def planned_acceptance(home: Path | None, target: str | None) -> tuple[float | None, tuple[tuple[float, float], ...] | None]:
    """(greedy acceptance, ((temperature, acceptance), ...)) `jspec calibrate` recorded for the
    drafter at `home` (for `target`, a draft model's), which `auto` plans with before a head's own
    config.json record; (None, None) where nothing was recorded."""
    record = (calibrated_acceptance(home, card_key(), target) if home is not None else None) or {}
    sampled = tuple(sorted((float(t), float(a)) for t, a in (record.get("by_temperature") or {}).items()))
    return record.get("alpha"), sampled or None


def _head_acceptance_record(head_dir) -> dict:
    try:
        with open(Path(head_dir) / "config.json") as fh:
            record = json.load(fh).get("jspec", {}).get("acceptance", {})
    except (OSError, ValueError, AttributeError):
        return {}
    return record if isinstance(record, dict) else {}


def head_acceptance(head_dir) -> float | None:
    """The per-token acceptance a head's config.json records ("jspec": {"acceptance": {"alpha": a}}), if any."""
    alpha = _head_acceptance_record(head_dir).get("alpha")
    return float(alpha) if alpha is not None else None


def head_acceptance_by_temperature(head_dir) -> tuple[tuple[float, float], ...] | None:
    """((temperature, acceptance), ...) a head's config.json records for sampling
    ("acceptance": {"by_temperature": {"0.7": a, ...}}), if any."""
    table = _head_acceptance_record(head_dir).get("by_temperature")
    if not isinstance(table, dict) or not table:
        return None
    return tuple(sorted((float(t), float(a)) for t, a in table.items()))


def build_drafter(spec: str, cfg: ModelConfig, params: dict, *, model_name: str | None = None, dtype=None,
                  k_max: int | None = None, draft_vocab: int = 0) -> tuple[Any, Any]:
    """(drafter, drafter_params) for a spec string; raises DrafterError with the fix in the message.
    ``k_max``: the engine's k_max, which a block drafter (``dlm``) drafts every round (default
    ``DEFAULT_DLM_K_MAX``); other drafters take it per call. Without a PATH a drafter is the one
    ``model_name``'s preset ships, by default the preset ``cfg`` was loaded from (``cfg.preset``).
    ``draft_vocab``: a draft model scores only the target's N most frequent answer tokens
    (``token_counts``; ModelDrafter.draft_vocab); 0: the whole vocabulary."""
    model_name = cfg.preset if model_name is None else model_name
    _check_draft_vocab_drafter(spec, draft_vocab)  # its size is the drafter's check, its counts token_counts'
    hybrid = split_hybrid(spec)
    if hybrid is not None:
        head, head_params = build_drafter(hybrid[0], cfg, params, model_name=model_name, dtype=dtype)
        ngram, _ = build_drafter(hybrid[1], cfg, params)
        return HybridDrafter(head, ngram), head_params
    name, arg = _split(spec)
    if name == "dlm":
        path = dlm_file(spec, model_name)
        try:
            dcfg, own = D.load_dlm(str(path), cfg, dtype=dtype or params["embed"].dtype)
        except ValueError as e:
            raise DrafterError(str(e)) from None
        # CPS only with a proxy table beside the DLM (none ships). sampling_q="point": the draft
        # verified as a point mass keeps sampling exactly lossless (the paper's "l2r" is not).
        proxy_file = Path(path).parent / PROXY_FILE
        drafter = DiffuSpecDrafter(dcfg=dcfg, k_max=DEFAULT_DLM_K_MAX if k_max is None else k_max,
                                   cps=proxy_file.is_file(), sampling_q="point")
        drafter.check(cfg)
        return drafter, {"dlm": own, **({"proxy": load_proxy(str(proxy_file))} if drafter.cps else {})}
    if name == "ngram":
        n = int(arg) if arg else 3
        return NgramDrafter(max_ngram=n), None
    if name == "early-exit" and arg is None:  # like every drafter: what the preset ships, if anything
        shipped = shipped_head_path(model_name, "early-exit")
        arg = None if shipped is None else str(shipped)
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
            raise none_shipped("model", model_name)
        arg = str(arg)
        if is_draft_model_dir(arg):
            dcfg, dparams = load_draft_model(arg, cfg, params, dtype=dtype)
        else:
            dcfg, dparams, _ = resolve_model(arg, dtype=dtype or params["embed"].dtype, tokenizer=False)
        alpha, sampled = planned_acceptance(*calibration_home(spec, model_name))
        drafter = ModelDrafter(dcfg, step_fraction=round(step_fraction(dcfg, cfg, draft_vocab=draft_vocab), 3),
                               acceptance=alpha, acceptance_by_temperature=sampled, draft_vocab=draft_vocab)
        drafter.check(cfg)
        if draft_vocab:
            dparams = with_draft_vocab(dparams, dcfg, model_name, cfg, draft_vocab)
        return drafter, dparams
    if name in ("eagle", "eagle1", "eagle3"):
        kind = "eagle3" if name == "eagle3" else "eagle"
        path = arg or shipped_head_path(model_name, kind)
        if path is None:
            raise none_shipped(kind, model_name)
        hcfg, hparams = load_eagle_head(str(path), cfg, dtype=dtype or params["embed"].dtype)
        alpha, sampled = planned_acceptance(Path(path), None)
        drafter = EagleDrafter(hcfg, acceptance=head_acceptance(path) if alpha is None else alpha,
                               acceptance_by_temperature=sampled or head_acceptance_by_temperature(path))
        drafter.check(cfg)
        return drafter, hparams
    raise DrafterError(f"unknown drafter {spec!r}; choose from {', '.join(DRAFTER_NAMES)} (e.g. ngram, early-exit:8, model:PATH)")


POLICY_CONSTANTS = ("paper", "calibrated")  # policy spec suffixes: svip:paper, svip:calibrated


def split_policy_spec(text: str) -> tuple[str, str | None]:
    """("svip", "paper") for "svip:paper"; ("svip", None) for "svip". Raises DrafterError, one line."""
    name, _, which = text.partition(":")
    if name not in POLICY_NAMES:
        raise DrafterError(f"unknown policy {name!r}; valid names: {', '.join(POLICY_NAMES)}")
    if which and (which not in POLICY_CONSTANTS or name not in CALIBRATED_POLICIES):
        raise DrafterError(f"policy {text!r}: the suffix :paper or :calibrated applies to {', '.join(CALIBRATED_POLICIES)}")
    return name, which or None


def policy_for_drafter(policy, policy_params, drafter_spec: str, model_name: str | None, k_max: int):
    """(policy, policy_params) for a policy given by name beside a drafter given by spec, read as
    `jspec generate` reads them: "svip", "adaedl", ... with the constants `jspec calibrate` fit for
    the spec's EAGLE head on this card (resolve_policy_spec), "ldlp" with the predictor weights
    beside that head unless ``policy_params`` are given. A Policy object is returned as is."""
    if not isinstance(policy, str):
        return policy, policy_params
    if split_policy_spec(policy)[0] == "ldlp" and policy_params is None:
        policy_params = load_ldlp(str(find_ldlp_weights(drafter_spec, model_name)))[0]
    return resolve_policy_spec(policy, drafter_spec, model_name, k_max)[0], policy_params


def resolve_policy_spec(text: str, drafter_spec: str | None, model_name: str | None, k_max: int):
    """(policy, constants) from a policy spec: "NAME" (the constants `jspec calibrate` fit for this
    head on this card when there are some, else the paper's), "NAME:paper" (the paper's),
    "NAME:calibrated" (this card's fit, or an error saying how to make one). The policy is the name
    itself when nothing is calibrated (built later as usual), else a Policy; `constants` says in
    one line which constants it runs (None for a policy without calibrated constants)."""
    name, which = split_policy_spec(text)
    if name not in CALIBRATED_POLICIES:
        return name, None
    if which == "paper":
        return make_policy(name, k_max=k_max), "the paper's constants (:paper)"
    head, target = calibration_home(drafter_spec, model_name) if drafter_spec else (None, None)
    card = card_key()
    found = None if head is None else calibrated_constants(head, name, card, target)
    if found is not None:
        return policy_from_constants(name, found.constants, k_max), found.describe()
    kind = "head" if target is None else "draft model"
    if which == "calibrated":
        what = kind if target is None else f"{kind} (for target {target})"
        where = f"{what} {head}" if head is not None else "this drafter (neither an EAGLE head nor a draft model)"
        raise DrafterError(f"policy {text!r}: no {name} fit for {where} on {card}: run `jspec calibrate --drafter "
                           f"{drafter_spec or 'eagle3'} --policy {name}`")
    reason = "no EAGLE head or draft model to calibrate" if head is None else f"no `jspec calibrate` fit for this {kind} on {card}"
    return name, f"the paper's constants ({reason})"
