"""Import / export draft heads in the EAGLE layout that SGLang and vLLM load.

A head directory holds `config.json` (a Llama config with one hidden layer) and
`model.safetensors` with Hugging Face names, linear weights [out, in]:

EAGLE-1 (architectures ["LlamaForCausalLMEagle"]):
    fc.weight [D, 2D], fc.bias [D]                    input order [embedding; feature]
    layers.0.self_attn.{q,k,v,o}_proj.weight          (no layers.0.input_layernorm: EAGLE skips it)
    layers.0.post_attention_layernorm.weight
    layers.0.mlp.{gate,up,down}_proj.weight
  The LM head and embedding are the target's and are not written.
EAGLE-3 (architectures ["LlamaForCausalLMEagle3"]):
    fc.weight [D, 3D]                                 input order [low; mid; high] captured layers
    midlayer.input_layernorm.weight                   RMSNorm of the token embedding
    midlayer.hidden_norm.weight                       RMSNorm of the incoming feature
    midlayer.self_attn.q_proj.weight [Hq*hd, 2D], k_proj / v_proj [Hkv*hd, 2D], o_proj [D, Hq*hd]
    midlayer.post_attention_layernorm.weight, midlayer.mlp.{gate,up,down}_proj.weight
    norm.weight, lm_head.weight [Vd, D]
    d2t [Vd] int64: draft id -> target id OFFSET (target_id = draft_id + d2t[draft_id])
    t2d [V] bool: which target ids are in the draft vocabulary
  d2t / t2d are written only when the draft vocabulary is reduced; config.json then carries
  `draft_vocab_size` (always written, = vocab_size when not reduced, so that SGLang uses the
  head's own lm_head rather than the target's).

Captured layers. jspec's `capture_layers` are target layer INPUT indices (= Hugging Face
`hidden_states[i]`). The default (2, L//2, L-3) is what SGLang and vLLM capture when the config
says nothing, so it is not written; other choices go to
`eagle_config.eagle_aux_hidden_state_layer_ids` in that same input-index convention (the one
vLLM's loop uses and SGLang's default path uses; SGLang adds 1 to explicit ids whose first
entry is 1, see sgl-project/sglang#25454). jspec also records its own `jspec` block so a round
trip through jspec is exact. Public checkpoints that ship `embed_tokens.weight` load fine: the
head always uses the target's embedding, so that tensor is ignored.
"""

from __future__ import annotations

import json
import os

import jax.numpy as jnp
import ml_dtypes
import numpy as np
from safetensors.numpy import load_file, save_file

from ..config import ModelConfig
from ..heads.eagle import (
    HeadConfig,
    default_capture_layers,
    draft_vocab_maps,
    fold_capture_scales,
    head_layer_config,
)

WEIGHTS_FILE = "model.safetensors"
CONFIG_FILE = "config.json"
_ARCH = {"eagle1": "LlamaForCausalLMEagle", "eagle3": "LlamaForCausalLMEagle3"}
_NP_DTYPES = {"float32": np.float32, "float16": np.float16, "bfloat16": ml_dtypes.bfloat16}


def _rope_scaling_to_hf(rs: tuple | None) -> dict | None:
    if rs is None:
        return None
    if rs[0] == "llama3":
        _, factor, low, high, orig = rs
        return {
            "rope_type": "llama3", "factor": factor, "low_freq_factor": low,
            "high_freq_factor": high, "original_max_position_embeddings": orig,
        }
    return {"rope_type": rs[0], "factor": rs[1]}


def eagle_config_json(hcfg: HeadConfig, dtype: str = "bfloat16") -> dict:
    """The draft model's config.json (a one-layer Llama config plus EAGLE fields)."""
    lc, t = head_layer_config(hcfg), hcfg.target
    cfg = {
        "architectures": [_ARCH[hcfg.kind]],
        "model_type": "llama",
        "hidden_size": lc.hidden_size,
        "intermediate_size": lc.intermediate_size,
        "num_attention_heads": lc.num_heads,
        "num_key_value_heads": lc.num_kv_heads,
        "head_dim": lc.head_dim,
        "num_hidden_layers": 1,
        "hidden_act": "silu",
        "rms_norm_eps": lc.rms_norm_eps,
        "rope_theta": lc.rope_theta,
        "rope_scaling": _rope_scaling_to_hf(lc.rope_scaling),
        "max_position_embeddings": lc.max_position_embeddings,
        "vocab_size": t.vocab_size,
        "tie_word_embeddings": False,  # the EAGLE-3 lm_head is the head's own, never the embedding
        "attention_bias": False,
        "bos_token_id": t.bos_token_id,
        "eos_token_id": list(t.eos_token_ids) if len(t.eos_token_ids) != 1 else t.eos_token_ids[0],
        "pad_token_id": t.pad_token_id,
        "torch_dtype": dtype,
        "jspec": {"kind": hcfg.kind, "capture_layers": list(hcfg.capture_layers)},
    }
    if hcfg.kind == "eagle1":
        cfg["bias"] = True
    else:
        cfg["draft_vocab_size"] = hcfg.draft_vocab
        if tuple(hcfg.capture_layers) != default_capture_layers(t.num_layers):
            cfg["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": list(hcfg.capture_layers)}
    return cfg


# ---------------------------------------------------------------------------------------------
# Parameter <-> state-dict mapping
# ---------------------------------------------------------------------------------------------


def _layer_prefix(hcfg: HeadConfig) -> str:
    return "layers.0." if hcfg.kind == "eagle1" else "midlayer."


def eagle_state_dict(hcfg: HeadConfig, head_params: dict, dtype=None) -> dict[str, np.ndarray]:
    """jspec head params -> EAGLE tensor names (numpy; floats cast to `dtype` when given). A
    training-time fc_in_scale is folded into fc.weight, which the format can hold."""
    head_params = fold_capture_scales(head_params)
    lc = head_layer_config(hcfg)
    p = {k: np.asarray(v) for k, v in head_params["layer"].items()}
    q, kv = lc.q_size, lc.kv_size
    F = p["w_down"].shape[0]
    pre = _layer_prefix(hcfg)
    sd = {
        "fc.weight": np.asarray(head_params["fc"]).T,
        pre + "self_attn.q_proj.weight": p["wqkv"][:, :q].T,
        pre + "self_attn.k_proj.weight": p["wqkv"][:, q : q + kv].T,
        pre + "self_attn.v_proj.weight": p["wqkv"][:, q + kv :].T,
        pre + "self_attn.o_proj.weight": p["wo"].T,
        pre + "post_attention_layernorm.weight": p["mlp_norm"],
        pre + "mlp.gate_proj.weight": p["w_gate_up"][:, :F].T,
        pre + "mlp.up_proj.weight": p["w_gate_up"][:, F:].T,
        pre + "mlp.down_proj.weight": p["w_down"].T,
    }
    if hcfg.kind == "eagle1":
        sd["fc.bias"] = np.asarray(head_params["fc_bias"])
    else:
        sd[pre + "input_layernorm.weight"] = p["embed_norm"]
        sd[pre + "hidden_norm.weight"] = p["hidden_norm"]
        sd["norm.weight"] = np.asarray(head_params["final_norm"])
        sd["lm_head.weight"] = np.asarray(head_params["lm_head"]).T
    if dtype is not None:
        sd = {k: v.astype(dtype) for k, v in sd.items()}
    sd = {k: np.ascontiguousarray(v) for k, v in sd.items()}
    if hcfg.reduced_vocab:
        d2t = np.asarray(head_params["d2t"], np.int64)
        sd["d2t"] = d2t - np.arange(len(d2t), dtype=np.int64)  # EAGLE stores offsets
        sd["t2d"] = np.asarray(head_params["t2d"], bool)
    return sd


def head_params_from_state_dict(hcfg: HeadConfig, sd: dict[str, np.ndarray], dtype=jnp.float32) -> dict:
    """EAGLE tensor names -> jspec head params (a leading `model.` prefix is accepted)."""
    sd = {k.removeprefix("model."): v for k, v in sd.items()}
    pre = _layer_prefix(hcfg)

    def get(name):
        if name not in sd:
            raise KeyError(f"EAGLE checkpoint lacks {name!r} (has: {sorted(sd)[:12]}...)")
        return np.asarray(sd[name], np.float32)

    f = lambda a: jnp.asarray(a, dtype)  # noqa: E731
    layer = {
        "wqkv": f(np.concatenate([get(pre + f"self_attn.{n}_proj.weight").T for n in "qkv"], 1)),
        "wo": f(get(pre + "self_attn.o_proj.weight").T),
        "mlp_norm": f(get(pre + "post_attention_layernorm.weight")),
        "w_gate_up": f(np.concatenate([get(pre + "mlp.gate_proj.weight").T, get(pre + "mlp.up_proj.weight").T], 1)),
        "w_down": f(get(pre + "mlp.down_proj.weight").T),
    }
    params = {"fc": f(get("fc.weight").T), "layer": layer}
    if hcfg.kind == "eagle1":
        params["fc_bias"] = f(get("fc.bias")) if "fc.bias" in sd else jnp.zeros((hcfg.hidden_size,), dtype)
        return params
    layer["embed_norm"] = f(get(pre + "input_layernorm.weight"))
    layer["hidden_norm"] = f(get(pre + "hidden_norm.weight"))
    params["final_norm"] = f(get("norm.weight"))
    lm_head = get("lm_head.weight")  # [Vd, D]: row i scores draft id i, i.e. target id d2t[i]
    if hcfg.reduced_vocab:
        target_ids = draft_to_target_ids(sd["d2t"], hcfg.target.vocab_size)
        # jspec keeps d2t sorted (target_index counts t2d); a third-party table need not be, so
        # sort the ids and move the LM-head rows with them: draft id i still scores d2t[i].
        order = np.argsort(target_ids, kind="stable")
        lm_head = lm_head[order]
        params["d2t"], params["t2d"] = draft_vocab_maps(target_ids[order], hcfg.target.vocab_size)
    params["lm_head"] = f(lm_head.T)
    return params


def draft_to_target_ids(d2t_offsets, target_vocab: int) -> np.ndarray:
    """Absolute target ids from EAGLE's offset table (target id = draft id + d2t[draft id]),
    checked: every id inside the target vocabulary and no id twice."""
    offsets = np.asarray(d2t_offsets, np.int64)
    ids = offsets + np.arange(len(offsets), dtype=np.int64)
    bad = (ids < 0) | (ids >= target_vocab)
    if bad.any():
        i = int(np.argmax(bad))
        raise ValueError(f"d2t maps draft id {i} to target id {int(ids[i])}, outside the target vocabulary [0, {target_vocab})")
    if len(np.unique(ids)) != len(ids):
        raise ValueError("d2t maps two draft ids to the same target id")
    return ids


# ---------------------------------------------------------------------------------------------
# Files
# ---------------------------------------------------------------------------------------------


def save_eagle_head(path: str, hcfg: HeadConfig, head_params: dict, dtype: str | None = None) -> None:
    """Write config.json + model.safetensors. dtype: "bfloat16" / "float16" / "float32", or None
    to keep the parameters' own dtype (exact round trip)."""
    os.makedirs(path, exist_ok=True)
    np_dtype = _NP_DTYPES[dtype] if dtype else None
    sd = eagle_state_dict(hcfg, head_params, np_dtype)
    stored = dtype or str(np.asarray(head_params["fc"]).dtype)
    with open(os.path.join(path, CONFIG_FILE), "w") as fh:
        json.dump(eagle_config_json(hcfg, stored), fh, indent=2)
    save_file(sd, os.path.join(path, WEIGHTS_FILE), metadata={"format": "pt"})


def head_config_from_json(cfg: dict, target_cfg: ModelConfig, d2t_len: int | None) -> HeadConfig:
    arch = (cfg.get("architectures") or [""])[0]
    own = cfg.get("jspec", {})
    kind = own.get("kind") or ("eagle3" if "Eagle3" in arch or "draft_vocab_size" in cfg else "eagle1")
    if cfg["hidden_size"] != target_cfg.hidden_size:
        raise ValueError(f"head hidden_size {cfg['hidden_size']} != target {target_cfg.hidden_size}")
    inter = cfg.get("intermediate_size")
    inter = None if inter in (None, target_cfg.intermediate_size) else int(inter)
    if kind == "eagle1":
        return HeadConfig("eagle1", target_cfg, intermediate_size=inter)
    capture = own.get("capture_layers") or (cfg.get("eagle_config") or {}).get(
        "eagle_aux_hidden_state_layer_ids"
    ) or default_capture_layers(target_cfg.num_layers)
    return HeadConfig("eagle3", target_cfg, tuple(int(i) for i in capture), d2t_len or 0, inter)


def load_eagle_head(path: str, target_cfg: ModelConfig, dtype=jnp.float32) -> tuple[HeadConfig, dict]:
    """Read a head directory written by jspec, the EAGLE authors, SpecForge, etc."""
    with open(os.path.join(path, CONFIG_FILE)) as fh:
        cfg = json.load(fh)
    sd = load_file(os.path.join(path, WEIGHTS_FILE))
    d2t_len = len(sd["d2t"]) if "d2t" in sd and len(sd["d2t"]) < target_cfg.vocab_size else None
    hcfg = head_config_from_json(cfg, target_cfg, d2t_len)
    return hcfg, head_params_from_state_dict(hcfg, sd, dtype)
