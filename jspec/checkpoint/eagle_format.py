"""Import / export draft heads in the EAGLE layouts that SGLang and vLLM load.

A head directory holds `config.json` (a Llama config with one hidden layer) and the weights with
Hugging Face names, linear weights [out, in]:

EAGLE-1:
    fc.weight [D, 2D] (+ fc.bias [D], SGLang)         input order [embedding; feature]
    layers.0.self_attn.{q,k,v,o}_proj.weight          (no layers.0.input_layernorm: EAGLE skips it)
    layers.0.post_attention_layernorm.weight
    layers.0.mlp.{gate,up,down}_proj.weight
  The LM head and embedding are the target's and are not written.
EAGLE-3 (architectures ["LlamaForCausalLMEagle3"]):
    fc.weight [D, 3D]                                 input order [low; mid; high] captured layers
    fc_norm.{0,1,2}.weight [D]                        EAGLE-3.1 only (config "fc_norm": true)
    midlayer.input_layernorm.weight                   RMSNorm of the token embedding
    midlayer.hidden_norm.weight                       RMSNorm of the incoming feature
    midlayer.self_attn.q_proj.weight [Hq*hd, 2D], k_proj / v_proj [Hkv*hd, 2D], o_proj [D, Hq*hd]
    midlayer.post_attention_layernorm.weight, midlayer.mlp.{gate,up,down}_proj.weight
    norm.weight, lm_head.weight [Vd, D]
    d2t [Vd] int64: draft id -> target id OFFSET (target_id = draft_id + d2t[draft_id])
    t2d [V] bool: which target ids are in the draft vocabulary
  d2t / t2d are written only when the draft vocabulary is reduced; config.json always carries
  `draft_vocab_size` (= vocab_size when not reduced; without it SGLang takes the target's LM head).

What each engine reads differs (the loaders and their versions are cited in
tests/test_engine_contracts.py; the table is in docs/methods.md §2.2), so `save_eagle_head` takes
`engine`:
  * "vllm": EAGLE-1 architecture "LlamaForCausalLM" (vLLM prefixes "Eagle"); its fc has no bias,
    so a trained fc bias b is folded into attention biases (q/k/v bias = W_{q,k,v} b, o_proj bias
    = b: the same function, since the softmax weights sum to one), with "attention_bias": true.
    EAGLE-3 captured layers go to the top-level `eagle_aux_hidden_state_layer_ids` as target layer
    INPUT indices (vLLM's capture loop records the input of layer i).
  * "sglang": EAGLE-1 architecture "LlamaForCausalLMEagle" with fc.bias (SGLang's fc has a bias:
    a zero one is written when the head has none). EAGLE-3 captured layers go to
    `eagle_config.eagle_aux_hidden_state_layer_ids`, which SGLang reads as layer OUTPUT ids (+1)
    when the first id is 1 (always before sgl-project/sglang#25454, only then after it), so jspec
    writes them only in the form both read alike: lowest input index 2, written [1, m-1, h-1].
    The default layers (2, L//2, L-3) are what SGLang captures when the key is absent.
    EAGLE-3.1 heads (fc_norm) are refused: SGLang's EAGLE-3 model has no fc_norm and skips it.
  * None (jspec's own layout): the SGLang layout plus vLLM's top-level layer-id key and a `jspec`
    block (kind, capture layers), so a round trip through jspec is exact.
Nothing else may sit in the head folder as `*.safetensors` / `*.bin`: both engines read every such
file there and vLLM fails on a name it does not know. jspec's own extras (the LDLP predictor) live
in the `jspec/` subfolder (EXTRAS_DIR).

Import (`load_eagle_head`) follows the head's own config.json as the engines do: attention
geometry, RoPE (theta 10000 when absent, as the EAGLE-3 reference trainer and Hugging Face's
LlamaConfig use), scaling, norm epsilon, captured layers (the `jspec` block, else vLLM's
top-level key, else SGLang's nested key with SGLang's rule), EAGLE-3.1's fc_norm / norm_output
(vLLM's reading: norm_output feeds the post-norm hidden back). Weights come from
`model.safetensors`, `pytorch_model.bin` (read without torch) or a sharded index of either; a
tensor the head has no place for is an error naming it, never dropped.
"""

from __future__ import annotations

import glob
import json
import math
import os

import jax.numpy as jnp
import ml_dtypes
import numpy as np

from ..config import ModelConfig, UnsupportedModelError, config_from_hf
from ..heads.eagle import (
    HeadConfig,
    default_capture_layers,
    draft_vocab_maps,
    fold_capture_scales,
    head_layer_config,
)
from .errors import CheckpointError, CheckpointNotFoundError
from .files import SAFETENSORS_INDEX, save_safetensors, save_safetensors_shards, shards_of_at_most
from .hf import check_safetensors_file, load_safetensors
from .torch_pickle import load_torch_state_dict

WEIGHTS_FILE = "model.safetensors"
CONFIG_FILE = "config.json"
EXTRAS_DIR = "jspec"  # jspec-only files beside a head (LDLP predictor): a subfolder no engine reads
ENGINES = ("sglang", "vllm")
# Files a head's weights may come in, in the order the engines prefer them.
BIN_FILE = "pytorch_model.bin"
BIN_INDEX = "pytorch_model.bin.index.json"
_ARCH = {  # (kind, engine) -> architectures[0]
    ("eagle1", "sglang"): "LlamaForCausalLMEagle",
    ("eagle1", "vllm"): "LlamaForCausalLM",  # vLLM's EAGLEConfig prefixes "Eagle": EagleLlamaForCausalLM
    ("eagle3", "sglang"): "LlamaForCausalLMEagle3",
    ("eagle3", "vllm"): "LlamaForCausalLMEagle3",
}
_NP_DTYPES = {"float32": np.float32, "float16": np.float16, "bfloat16": ml_dtypes.bfloat16}
# Draft-config switches of other EAGLE-3 variants that jspec's head layer does not implement.
_UNSUPPORTED_FLAGS = ("norm_before_fc", "norm_before_residual", "attention_bias", "mlp_bias")


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


def _check_engine(engine: str | None) -> None:
    if engine is not None and engine not in ENGINES:
        raise ValueError(f"unknown engine {engine!r}; export targets: {', '.join(ENGINES)}")


def sglang_layer_ids(hcfg: HeadConfig) -> list[int] | None:
    """The `eagle_config.eagle_aux_hidden_state_layer_ids` SGLang needs for hcfg's captured
    layers (None: the default, write nothing); raises when SGLang versions disagree on them."""
    L = hcfg.target.num_layers
    if tuple(hcfg.capture_layers) == default_capture_layers(L):
        return None
    low, mid, high = hcfg.capture_layers
    if low != 2:
        raise ValueError(
            f"SGLang cannot be told capture layers {list(hcfg.capture_layers)} unambiguously: it reads "
            "eagle_aux_hidden_state_layer_ids as layer outputs (+1) before sgl-project/sglang#25454 and as "
            "layer inputs after it unless the first id is 1; only heads whose lowest captured input is layer 2 "
            "export for SGLang (vLLM takes any: --for vllm)"
        )
    return [1, mid - 1, high - 1]


def eagle_config_json(hcfg: HeadConfig, dtype: str = "bfloat16", engine: str | None = None) -> dict:
    """The draft model's config.json (a one-layer Llama config plus EAGLE fields) for `engine`
    ("sglang", "vllm", or None: jspec's own layout)."""
    _check_engine(engine)
    lc, t = head_layer_config(hcfg), hcfg.target
    cfg = {
        "architectures": [_ARCH[hcfg.kind, engine or "sglang"]],
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
        "attention_bias": False,  # vLLM's EAGLE-1 export sets it when it folds an fc bias
        "bos_token_id": t.bos_token_id,
        "eos_token_id": list(t.eos_token_ids) if len(t.eos_token_ids) != 1 else t.eos_token_ids[0],
        "pad_token_id": t.pad_token_id,
        "torch_dtype": dtype,
    }
    if engine is None:
        cfg["jspec"] = {"kind": hcfg.kind, "capture_layers": list(hcfg.capture_layers)}
        if hcfg.attention_window is not None:
            cfg["jspec"]["attention_window"] = hcfg.attention_window
    if hcfg.kind == "eagle3":
        cfg["draft_vocab_size"] = hcfg.draft_vocab
        if hcfg.fc_norm:
            cfg["fc_norm"] = True
        if hcfg.norm_output:
            cfg["norm_output"] = True
        if engine in (None, "vllm"):
            cfg["eagle_aux_hidden_state_layer_ids"] = list(hcfg.capture_layers)
        if engine == "sglang" and (hcfg.fc_norm or hcfg.norm_output):
            raise ValueError("SGLang's EAGLE-3 model has no fc_norm / norm_output (EAGLE-3.1): export it --for vllm")
        try:
            nested = sglang_layer_ids(hcfg)
        except ValueError:
            if engine == "sglang":
                raise
            nested = None  # jspec's own layout: the jspec block and vLLM's key carry the layers
        if nested is not None:
            cfg["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": nested}
    return cfg


# ---------------------------------------------------------------------------------------------
# Parameter <-> state-dict mapping
# ---------------------------------------------------------------------------------------------


def _layer_prefix(hcfg: HeadConfig) -> str:
    return "layers.0." if hcfg.kind == "eagle1" else "midlayer."


def eagle_state_dict(hcfg: HeadConfig, head_params: dict, dtype=None, engine: str | None = None) -> dict[str, np.ndarray]:
    """jspec head params -> EAGLE tensor names for `engine` (numpy; floats cast to `dtype` when
    given). A training-time fc_in_scale is folded into fc.weight, which the format can hold."""
    _check_engine(engine)
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
        bias = np.asarray(head_params["fc_bias"])
        if engine != "vllm":
            sd["fc.bias"] = bias
        elif np.any(bias != 0):  # fold: W(x + b) = Wx + Wb; o_proj's bias carries b on the residual
            b = bias.astype(np.float32)
            wqkv = p["wqkv"].astype(np.float32)
            for name, cols in (("q", slice(0, q)), ("k", slice(q, q + kv)), ("v", slice(q + kv, None))):
                sd[pre + f"self_attn.{name}_proj.bias"] = (b @ wqkv[:, cols]).astype(bias.dtype)
            sd[pre + "self_attn.o_proj.bias"] = bias
    else:
        sd[pre + "input_layernorm.weight"] = p["embed_norm"]
        sd[pre + "hidden_norm.weight"] = p["hidden_norm"]
        sd["norm.weight"] = np.asarray(head_params["final_norm"])
        sd["lm_head.weight"] = np.asarray(head_params["lm_head"]).T
        if hcfg.fc_norm:
            D = hcfg.hidden_size
            g = np.asarray(head_params["fc_norm"])
            sd.update({f"fc_norm.{i}.weight": g[i * D : (i + 1) * D] for i in range(3)})
    if dtype is not None:
        sd = {k: v.astype(dtype) for k, v in sd.items()}
    sd = {k: np.ascontiguousarray(v) for k, v in sd.items()}
    if hcfg.reduced_vocab:
        d2t = np.asarray(head_params["d2t"], np.int64)
        sd["d2t"] = d2t - np.arange(len(d2t), dtype=np.int64)  # EAGLE stores offsets
        sd["t2d"] = np.asarray(head_params["t2d"], bool)
    return sd


def expected_shapes(hcfg: HeadConfig) -> dict[str, tuple]:
    """The shape of every weight of a head of this config in the EAGLE layout ([out, in])."""
    lc, D = head_layer_config(hcfg), hcfg.hidden_size
    pre, A, F = _layer_prefix(hcfg), hcfg.attn_input_size, hcfg.mlp_size
    shapes = {
        "fc.weight": (D, hcfg.fc_inputs * D), pre + "self_attn.q_proj.weight": (lc.q_size, A),
        pre + "self_attn.k_proj.weight": (lc.kv_size, A), pre + "self_attn.v_proj.weight": (lc.kv_size, A),
        pre + "self_attn.o_proj.weight": (D, lc.q_size), pre + "post_attention_layernorm.weight": (D,),
        pre + "mlp.gate_proj.weight": (F, D), pre + "mlp.up_proj.weight": (F, D), pre + "mlp.down_proj.weight": (D, F),
    }
    if hcfg.kind == "eagle3":
        shapes.update({pre + "input_layernorm.weight": (D,), pre + "hidden_norm.weight": (D,), "norm.weight": (D,),
                       "lm_head.weight": (hcfg.draft_vocab, D)})
    return shapes


def expected_tensor_names(hcfg: HeadConfig, folded_bias: bool = False) -> set[str]:
    """Every tensor name a head of this config has in the EAGLE layout (d2t / t2d included when
    the vocabulary is reduced; fc.bias for EAGLE-1; the four attention biases of a vLLM EAGLE-1
    export with a folded fc bias when `folded_bias`)."""
    pre = _layer_prefix(hcfg)
    names = {"fc.weight"} | {pre + f"self_attn.{n}_proj.weight" for n in "qkvo"}
    names |= {pre + "post_attention_layernorm.weight"} | {pre + f"mlp.{n}_proj.weight" for n in ("gate", "up", "down")}
    if hcfg.kind == "eagle1":
        names.add("fc.bias")
        if folded_bias:
            names |= {pre + f"self_attn.{n}_proj.bias" for n in "qkvo"}
        return names
    names |= {pre + "input_layernorm.weight", pre + "hidden_norm.weight", "norm.weight", "lm_head.weight"}
    if hcfg.fc_norm:
        names |= {f"fc_norm.{i}.weight" for i in range(3)}
    if hcfg.reduced_vocab:
        names |= {"d2t", "t2d"}
    return names


# Tensors published heads carry that the head does not use: the embedding (jspec uses the
# target's) and, when the vocabulary is not reduced, an identity t2d / d2t.
_IGNORED = {"embed_tokens.weight", "d2t", "t2d"}


def _unfold_fc_bias(hcfg: HeadConfig, sd: dict) -> np.ndarray:
    """The fc bias of a vLLM EAGLE-1 export that folded it into attention biases (checked: the
    q/k/v biases must be the projections of the o_proj bias)."""
    pre = _layer_prefix(hcfg)
    b = np.asarray(sd[pre + "self_attn.o_proj.bias"], np.float32)
    for n in "qkv":
        w = np.asarray(sd[pre + f"self_attn.{n}_proj.weight"], np.float32)
        got = np.asarray(sd[pre + f"self_attn.{n}_proj.bias"], np.float32)
        want = w @ b
        if not np.allclose(got, want, rtol=2e-2, atol=2e-2 * (np.abs(want).max() + 1e-6)):
            raise CheckpointError(
                f"EAGLE-1 head has attention biases that are not a folded fc bias ({n}_proj.bias != W_{n} o_proj.bias); "
                "jspec's head layer has no attention biases"
            )
    return b


def head_params_from_state_dict(hcfg: HeadConfig, sd: dict[str, np.ndarray], dtype=jnp.float32) -> dict:
    """EAGLE tensor names -> jspec head params (a leading `model.` prefix is accepted). A tensor
    the head has no place for raises CheckpointError naming it."""
    sd = {k.removeprefix("model."): v for k, v in sd.items()}
    pre = _layer_prefix(hcfg)
    folded = hcfg.kind == "eagle1" and pre + "self_attn.o_proj.bias" in sd
    unknown = sorted(set(sd) - expected_tensor_names(hcfg, folded) - _IGNORED)
    if unknown:
        raise CheckpointError(
            f"EAGLE checkpoint has tensors a {hcfg.kind} head of this config has no place for: {', '.join(unknown[:8])}"
            + (f" (+{len(unknown) - 8} more)" if len(unknown) > 8 else "")
        )

    wrong = [f"{n} {tuple(np.shape(sd[n]))} (config: {want})" for n, want in expected_shapes(hcfg).items()
             if n in sd and tuple(np.shape(sd[n])) != want]
    if wrong:
        raise CheckpointError(f"EAGLE checkpoint tensors do not match its config.json: {'; '.join(wrong[:4])}")

    def get(name):
        if name not in sd:
            raise CheckpointError(f"EAGLE checkpoint lacks {name!r} (has: {', '.join(sorted(sd)[:12])}...)")
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
        if folded:
            params["fc_bias"] = f(_unfold_fc_bias(hcfg, sd))
        else:
            params["fc_bias"] = f(get("fc.bias")) if "fc.bias" in sd else jnp.zeros((hcfg.hidden_size,), dtype)
        return params
    layer["embed_norm"] = f(get(pre + "input_layernorm.weight"))
    layer["hidden_norm"] = f(get(pre + "hidden_norm.weight"))
    params["final_norm"] = f(get("norm.weight"))
    if hcfg.fc_norm:
        params["fc_norm"] = f(np.concatenate([get(f"fc_norm.{i}.weight") for i in range(3)]))
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


def save_eagle_head(path: str, hcfg: HeadConfig, head_params: dict, dtype: str | None = None,
                    engine: str | None = None, acceptance: dict | None = None,
                    max_file_bytes: int | None = None) -> None:
    """Write config.json + model.safetensors for `engine` ("sglang", "vllm", or None: jspec's
    own layout). dtype: "bfloat16" / "float16" / "float32", or None to keep the parameters' own
    dtype (exact round trip). `acceptance` ({"alpha": a, "from": ...}, jspec's layout only) goes
    to the jspec block, where `auto` reads the head's acceptance (factory.head_acceptance).
    A head larger than `max_file_bytes` is written as Hugging Face shards with their index
    (`weight_shards`), which both engines and `load_eagle_head` read.
    Raises ValueError, before writing, when the engine cannot hold the head or one tensor is
    larger than `max_file_bytes`."""
    cfg = eagle_config_json(hcfg, dtype or str(np.asarray(head_params["fc"]).dtype), engine)
    if acceptance is not None and "jspec" in cfg:
        cfg["jspec"]["acceptance"] = acceptance
    sd = eagle_state_dict(hcfg, head_params, _NP_DTYPES[dtype] if dtype else None, engine)
    if "layers.0.self_attn.o_proj.bias" in sd:  # vLLM's EAGLE-1 with a folded fc bias
        cfg["attention_bias"] = True
    shards = weight_shards(sd, max_file_bytes)
    os.makedirs(path, exist_ok=True)
    for stale in glob.glob(os.path.join(path, "*.safetensors")) + [os.path.join(path, SAFETENSORS_INDEX)]:
        if os.path.isfile(stale):  # the engines read every weight file in the folder
            os.remove(stale)
    with open(os.path.join(path, CONFIG_FILE), "w") as fh:
        json.dump(cfg, fh, indent=2)
    if len(shards) == 1:
        save_safetensors(sd, os.path.join(path, WEIGHTS_FILE), metadata={"format": "pt"})
    else:
        save_safetensors_shards(path, shards)


def mib_limit(mib: float) -> int | None:
    """A per-file limit given in MiB as bytes; 0 (or less) means one file (None)."""
    return int(mib * 2**20) if mib > 0 else None


def weight_shards(sd: dict[str, np.ndarray], max_file_bytes: int | None) -> list[dict[str, np.ndarray]]:
    """The state dict as the files it is written to: one without a limit, else groups of at most
    `max_file_bytes` in its order. Raises ValueError for a tensor larger than the limit."""
    if max_file_bytes is None:
        return [sd]
    for name, a in sd.items():
        if a.nbytes > max_file_bytes:
            raise ValueError(f"tensor {name} is {a.nbytes / 2**20:.1f} MiB, over the per-file limit of "
                             f"{max_file_bytes / 2**20:.1f} MiB")
    return list(shards_of_at_most(sd.items(), max_file_bytes))


def _sglang_ids_to_inputs(ids: list[int]) -> tuple[int, ...]:
    """SGLang's reading of eagle_config ids as target layer INPUT indices (after
    sgl-project/sglang#25454: +1 when the first id is 1, the ids themselves otherwise)."""
    return tuple(i + 1 for i in ids) if ids[0] == 1 else tuple(ids)


def capture_layers_from_json(cfg: dict, num_layers: int) -> tuple[int, ...]:
    """An EAGLE-3 config's captured layers as target layer INPUT indices: the `jspec` block,
    else vLLM's top-level key, else SGLang's nested key, else (2, L//2, L-3). The two engine keys
    must agree when both are present."""
    own = (cfg.get("jspec") or {}).get("capture_layers")
    if own:
        return tuple(int(i) for i in own)
    top = cfg.get("eagle_aux_hidden_state_layer_ids")
    nested = (cfg.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    top = tuple(int(i) for i in top) if top else None
    nested = _sglang_ids_to_inputs([int(i) for i in nested]) if nested else None
    if top and nested and top != nested:
        raise CheckpointError(
            f"config.json names two different captured layers: eagle_aux_hidden_state_layer_ids {list(top)} (vLLM, "
            f"layer inputs) and eagle_config's, layer inputs {list(nested)} by SGLang's rule"
        )
    return top or nested or default_capture_layers(num_layers)


def head_config_from_json(cfg: dict, target_cfg: ModelConfig, d2t_len: int | None) -> HeadConfig:
    """HeadConfig from a draft config.json, with the head's own attention geometry, RoPE and
    norm epsilon (kept as None where they equal the target's)."""
    arch = (cfg.get("architectures") or [""])[0]
    own = cfg.get("jspec") or {}
    kind = own.get("kind") or ("eagle3" if "Eagle3" in arch or "draft_vocab_size" in cfg else "eagle1")
    if cfg.get("hidden_size") != target_cfg.hidden_size:
        raise CheckpointError(f"head hidden_size {cfg.get('hidden_size')} != target {target_cfg.hidden_size}")
    if cfg.get("target_hidden_size") not in (None, target_cfg.hidden_size):
        raise CheckpointError(f"head target_hidden_size {cfg['target_hidden_size']} != target hidden {target_cfg.hidden_size}")
    if cfg.get("num_hidden_layers", 1) != 1:
        raise CheckpointError(f"head has {cfg['num_hidden_layers']} layers; jspec runs one-layer EAGLE heads")
    folded_bias = kind == "eagle1" and cfg.get("attention_bias")  # vLLM export of an fc bias
    on = [k for k in _UNSUPPORTED_FLAGS if cfg.get(k) and not (k == "attention_bias" and folded_bias)]
    if on:
        raise CheckpointError(f"head config sets {', '.join(on)}, which jspec's EAGLE head layer does not implement")
    if kind == "eagle3" and cfg.get("bias"):
        raise CheckpointError("EAGLE-3 head config sets bias (an fc bias); jspec's EAGLE-3 fc has none")
    try:
        dc = config_from_hf({**cfg, "model_type": "llama", "attention_bias": False})
    except (KeyError, UnsupportedModelError) as e:
        raise CheckpointError(f"head config.json: {' '.join(str(e).split())}") from None
    t = target_cfg
    differs = lambda mine, theirs: None if mine == theirs else mine  # noqa: E731
    own_rope = (dc.rope_theta, dc.rope_scaling) != (t.rope_theta, t.rope_scaling)
    geometry = dict(
        num_heads=differs(dc.num_heads, t.num_heads),
        num_kv_heads=differs(dc.num_kv_heads, t.num_kv_heads),
        head_dim=differs(dc.head_dim, t.head_dim),
        rope_theta=dc.rope_theta if own_rope else None,
        rope_scaling=dc.rope_scaling if own_rope else None,
        # a float32 round trip of the epsilon (9.9999997e-06 for 1e-5) is the same epsilon
        rms_norm_eps=None if math.isclose(dc.rms_norm_eps, t.rms_norm_eps, rel_tol=1e-6) else dc.rms_norm_eps,
    )
    inter = cfg.get("intermediate_size")
    inter = None if inter in (None, t.intermediate_size) else int(inter)
    window = own.get("attention_window")
    try:
        if kind == "eagle1":
            return HeadConfig("eagle1", t, intermediate_size=inter, attention_window=window, **geometry)
        return HeadConfig(
            "eagle3", t, capture_layers_from_json(cfg, t.num_layers), d2t_len or 0, inter,
            fc_norm=bool(cfg.get("fc_norm")), norm_output=bool(cfg.get("norm_output")), attention_window=window,
            **geometry,
        )
    except ValueError as e:
        raise CheckpointError(f"head config.json: {e}") from None


def weight_files(path: str) -> list[str]:
    """The files a head's weights are read from, as the engines pick them: the safetensors files
    (those an index names, else every *.safetensors in the folder), else pytorch_model.bin or the
    shards its index names."""
    index = os.path.join(path, SAFETENSORS_INDEX)
    if os.path.isfile(index):
        with open(index) as fh:
            return [os.path.join(path, f) for f in sorted(set(json.load(fh)["weight_map"].values()))]
    files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    if files:
        return files
    index = os.path.join(path, BIN_INDEX)
    if os.path.isfile(index):
        with open(index) as fh:
            return [os.path.join(path, f) for f in sorted(set(json.load(fh)["weight_map"].values()))]
    if os.path.isfile(os.path.join(path, BIN_FILE)):
        return [os.path.join(path, BIN_FILE)]
    raise CheckpointNotFoundError(
        f"no head weights in {path}: expected {WEIGHTS_FILE}, {BIN_FILE} or a sharded index ({SAFETENSORS_INDEX}, {BIN_INDEX})"
    )


def check_head_files(path: str) -> None:
    """Every weight file a head directory names exists and, for safetensors, its header covers its
    tensors (check_safetensors_file): a truncated head is one line naming the file, before any
    weight is read. Raises CheckpointNotFoundError / CorruptCheckpointError."""
    for file in weight_files(path):
        if not os.path.isfile(file):
            raise CheckpointNotFoundError(f"{file}: named by the index but missing")
        if file.endswith(".safetensors"):
            check_safetensors_file(file)


def head_weight_files_exist(path) -> bool:
    """Whether a head folder holds weights in a form `read_head_tensors` reads: model.safetensors,
    pytorch_model.bin, or the index of shards of either (`check_head_files` checks their contents)."""
    return any(os.path.isfile(os.path.join(path, f)) for f in (WEIGHTS_FILE, SAFETENSORS_INDEX, BIN_FILE, BIN_INDEX))


def read_head_tensors(path: str) -> dict[str, np.ndarray]:
    """{name: array} over every weight file of a head directory (weight_files); a name in two
    files is an error."""
    sd: dict[str, np.ndarray] = {}
    for file in weight_files(path):
        if not os.path.isfile(file):
            raise CheckpointNotFoundError(f"{file}: named by the index but missing")
        part = load_safetensors(file) if file.endswith(".safetensors") else load_torch_state_dict(file)
        twice = sorted(set(part) & set(sd))
        if twice:
            raise CheckpointError(f"{file}: tensors {', '.join(twice[:5])} also appear in another weight file")
        sd.update(part)
    return sd


def load_eagle_head(path: str, target_cfg: ModelConfig, dtype=jnp.float32) -> tuple[HeadConfig, dict]:
    """Read a head directory written by jspec, the EAGLE authors, SpecForge, etc."""
    config_path = os.path.join(path, CONFIG_FILE)
    if not os.path.isfile(config_path):
        raise CheckpointNotFoundError(f"no EAGLE head config at {config_path}")
    with open(config_path) as fh:
        cfg = json.load(fh)
    sd = {k.removeprefix("model."): v for k, v in read_head_tensors(path).items()}
    d2t_len = len(sd["d2t"]) if "d2t" in sd and len(sd["d2t"]) < target_cfg.vocab_size else None
    declared = cfg.get("draft_vocab_size")
    if declared is not None and declared < target_cfg.vocab_size and declared != d2t_len:
        raise CheckpointError(
            f"{path}: config.json says draft_vocab_size {declared} but the d2t table has "
            f"{'no entries' if d2t_len is None else d2t_len} (target vocabulary {target_cfg.vocab_size})"
        )
    hcfg = head_config_from_json(cfg, target_cfg, d2t_len)
    return hcfg, head_params_from_state_dict(hcfg, sd, dtype)
