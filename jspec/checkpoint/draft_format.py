"""Save / load a tied draft model (jspec.heads.draft_model): its layers and final norm only.

A draft-model directory holds

    config.json        {"jspec_draft_model": {"layers_from": [...], "target": {...fingerprint},
                        "exit_layer": E (PPSD exit heads only)},
                        "config": ModelConfig.to_dict() of the draft}
    model-00000.safetensors, model-00001...   jspec-layout tensors, usually bfloat16:
                       "final_norm" [D] and "layers.<i>.<name>" per layer (wqkv, wo, w_gate_up,
                       w_down, attn_norm, mlp_norm, ...), split into files of at most
                       `max_file_bytes` (15 MB by default: small enough to move anywhere)

The embeddings and LM head are the target's and are not written: loading needs the target's
params and ties them (`load_draft_model`). The fingerprint (vocabulary, hidden size, heads)
catches a draft model paired with the wrong target before any compute.
"""

from __future__ import annotations

import glob
import json
import os

import jax.numpy as jnp
import ml_dtypes
import numpy as np
from ..config import ModelConfig
from ..heads import draft_model as DM
from .errors import CheckpointError, CorruptCheckpointError
from .files import save_safetensors
from .hf import check_safetensors_file, load_safetensors

CONFIG_FILE = "config.json"
WEIGHTS_GLOB = "model-*.safetensors"
MARKER = "jspec_draft_model"
_NP_DTYPES = {"bfloat16": ml_dtypes.bfloat16, "float16": np.float16, "float32": np.float32}


def target_fingerprint(tcfg: ModelConfig) -> dict:
    return {"arch": tcfg.arch, "vocab_size": tcfg.vocab_size, "hidden_size": tcfg.hidden_size,
            "num_layers": tcfg.num_layers, "num_heads": tcfg.num_heads, "num_kv_heads": tcfg.num_kv_heads}


def is_draft_model_dir(path) -> bool:
    file = os.path.join(str(path), CONFIG_FILE)
    if not os.path.isfile(file):
        return False
    try:
        with open(file) as fh:
            return MARKER in json.load(fh)
    except (OSError, json.JSONDecodeError):
        return False


def save_draft_model(path: str, dcfg: ModelConfig, dparams: dict, tcfg: ModelConfig, layers_from,
                     dtype: str = "bfloat16", extra: dict | None = None, max_file_bytes: int = 15 << 20) -> int:
    """Write config.json + model-*.safetensors (layers and final norm). Returns the weight bytes."""
    os.makedirs(path, exist_ok=True)
    np_dtype = _NP_DTYPES[dtype]
    trainable = DM.split_trainable(dparams)
    tensors = {"final_norm": np.asarray(trainable["final_norm"], np.float32).astype(np_dtype)}
    for k, v in trainable["layers"].items():
        v = np.asarray(v, np.float32).astype(np_dtype)
        for i in range(v.shape[0]):
            tensors[f"layers.{i}.{k}"] = v[i]
    files: list[dict] = [{}]
    for name, t in tensors.items():
        if files[-1] and sum(x.nbytes for x in files[-1].values()) + t.nbytes > max_file_bytes:
            files.append({})
        files[-1][name] = t
    for old in glob.glob(os.path.join(path, WEIGHTS_GLOB)):
        os.remove(old)
    meta = {MARKER: {"layers_from": [int(i) for i in layers_from], "target": target_fingerprint(tcfg),
                     "dtype": dtype, **(extra or {})},
            "config": dcfg.to_dict()}
    with open(os.path.join(path, CONFIG_FILE), "w") as fh:
        json.dump(meta, fh, indent=1)
    total = 0
    for i, sd in enumerate(files):
        file = os.path.join(path, f"model-{i:05d}.safetensors")
        save_safetensors(sd, file)
        total += os.path.getsize(file)
    return total


def check_draft_model(path: str, tcfg: ModelConfig) -> dict:
    """A draft-model directory's config.json (returned), checked without reading a weight: it was
    trained for this target (the fingerprint), and each weight file's header covers its tensors.
    Raises CheckpointError / CorruptCheckpointError, one line naming the directory or file."""
    with open(os.path.join(str(path), CONFIG_FILE)) as fh:
        meta = json.load(fh)
    if MARKER not in meta:
        raise CorruptCheckpointError(f"{path}: not a jspec draft-model directory (no {MARKER!r} in {CONFIG_FILE})")
    want, have = meta[MARKER]["target"], target_fingerprint(tcfg)
    if want != have:
        diff = ", ".join(f"{k} {want.get(k)} != {have[k]}" for k in have if want.get(k) != have[k])
        raise CheckpointError(f"{path}: draft model was trained for another target ({diff})")
    files = sorted(glob.glob(os.path.join(str(path), WEIGHTS_GLOB)))
    if not files:
        raise CorruptCheckpointError(f"{path}: no weight files ({WEIGHTS_GLOB})")
    for file in files:
        check_safetensors_file(file)
    return meta


def load_draft_model(path: str, tcfg: ModelConfig, tparams: dict, dtype=None) -> tuple[ModelConfig, dict]:
    """(draft cfg, draft params tied to `tparams`). dtype defaults to the target's."""
    meta = check_draft_model(path, tcfg)
    dcfg = ModelConfig.from_dict(meta["config"])
    dtype = jnp.dtype(dtype) if dtype is not None else tparams["embed"].dtype
    sd: dict[str, np.ndarray] = {}
    for file in sorted(glob.glob(os.path.join(str(path), WEIGHTS_GLOB))):
        sd.update(load_safetensors(file))
    names = sorted({k.split(".", 2)[2] for k in sd if k.startswith("layers.")})
    try:
        layers = {n: jnp.asarray(np.stack([sd[f"layers.{i}.{n}"].astype(np.float32) for i in range(dcfg.num_layers)]), dtype)
                  for n in names}
        trainable = {"layers": layers, "final_norm": jnp.asarray(sd["final_norm"].astype(np.float32), dtype)}
    except KeyError as e:
        raise CorruptCheckpointError(f"{path}: missing tensor {e} for {dcfg.num_layers} layers") from e
    if "wqkv" not in layers:
        raise CorruptCheckpointError(f"{path}: no layer tensors in {WEIGHTS_GLOB}")
    return dcfg, DM.tie(trainable, tparams)


def exit_layer_of(path) -> int | None:
    """E when the directory holds a PPSD exit head (trained behind target layer E), else None."""
    if not is_draft_model_dir(path):
        return None
    with open(os.path.join(str(path), CONFIG_FILE)) as fh:
        value = json.load(fh)[MARKER].get("exit_layer")
    return None if value is None else int(value)
