"""Synthetic EAGLE-3 heads in the layouts published heads come in, and synthetic sharded targets
(random weights).

What SpecForge and the EAGLE authors publish for a Llama-3.1-8B target: a one-layer
`LlamaForCausalLMEagle3` config.json WITHOUT rope_theta (so RoPE base 10000, not the target's
500000 + llama3 scaling), `draft_vocab_size` 32000, captured layers either absent or given the way
vLLM (top-level `eagle_aux_hidden_state_layer_ids`, layer inputs) or SGLang / SpecForge
(`eagle_config.eagle_aux_hidden_state_layer_ids`, layer outputs) write them, optionally
EAGLE-3.1's per-layer `fc_norm`; weights as `model.safetensors`, `pytorch_model.bin`, or sharded
with an index. Used by the contract tests at a scaled-down shape and, at full size, by GPU
benchmarks of imported heads:

    python -m jspec.checkpoint.synthetic OUT_DIR [--target-config TARGET/config.json] [--layout bin]

(without --target-config: Llama-3.1-8B's shape; 0.85 GB in bfloat16). Importable without
torch: only the `bin` layouts need it, to write what `torch.save` writes.
"""

from __future__ import annotations

import argparse
import json
import os

import ml_dtypes
import numpy as np
from ..config import ModelConfig, config_from_hf
from .files import save_safetensors, save_safetensors_shards, shards_of_at_most
from .hf import CONFIG_FILE, hf_config_dict, hf_tensor_name
from .layout import expected_shape, global_tensor_names, layer_tensor_names

LAYOUTS = ("safetensors", "sharded", "bin", "sharded-bin")
LAYER_ID_STYLES = (None, "vllm", "sglang")
_DTYPES = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16, "float16": np.float16}

# meta-llama/Llama-3.1-8B-Instruct's config.json, the fields a head depends on
LLAMA31_8B = {
    "model_type": "llama", "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
    "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 128256,
    "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "max_position_embeddings": 131072,
    "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                     "original_max_position_embeddings": 8192},
    "bos_token_id": 128000, "eos_token_id": [128001, 128008, 128009], "tie_word_embeddings": False,
}


def llama31_8b_target() -> ModelConfig:
    """Llama-3.1-8B's ModelConfig (for writing a full-size synthetic head)."""
    return config_from_hf(LLAMA31_8B)


def published_eagle3_config(target: ModelConfig, *, draft_vocab_size: int = 32000, capture: tuple | None = None,
                            layer_ids: str | None = None, fc_norm: bool = False, num_heads: int | None = None,
                            num_kv_heads: int | None = None, head_dim: int | None = None,
                            rope_theta: float | None = None) -> dict:
    """A SpecForge-style draft config.json for `target`. layer_ids: None (no key: the engines'
    default layers), "vllm" (top-level key, layer inputs) or "sglang" (eagle_config key, layer
    outputs: input - 1) for the INPUT indices `capture`. num_heads etc. default to the target's;
    rope_theta None writes no rope_theta (base 10000 by Llama's default)."""
    if layer_ids not in LAYER_ID_STYLES:
        raise ValueError(f"layer_ids={layer_ids!r}: one of {LAYER_ID_STYLES}")
    if layer_ids is not None and capture is None:
        raise ValueError("explicit layer ids need capture=(low, mid, high) target layer inputs")
    cfg = {
        "architectures": ["LlamaForCausalLMEagle3"],
        "model_type": "llama",
        "hidden_size": target.hidden_size,
        "intermediate_size": target.intermediate_size,
        "num_attention_heads": num_heads or target.num_heads,
        "num_key_value_heads": num_kv_heads or target.num_kv_heads,
        "head_dim": head_dim or target.head_dim,
        "num_hidden_layers": 1,
        "hidden_act": "silu",
        "rms_norm_eps": target.rms_norm_eps,
        "max_position_embeddings": 2048,
        "vocab_size": target.vocab_size,
        "draft_vocab_size": draft_vocab_size,
        "tie_word_embeddings": False,
        "bos_token_id": target.bos_token_id,
        "eos_token_id": target.eos_token_ids[0] if target.eos_token_ids else None,
        "pad_token_id": 0,
        "torch_dtype": "bfloat16",
        "use_cache": True,
    }
    if rope_theta is not None:
        cfg["rope_theta"] = rope_theta
    if fc_norm:
        cfg["fc_norm"] = True
    if layer_ids == "vllm":
        cfg["eagle_aux_hidden_state_layer_ids"] = [int(i) for i in capture]
    elif layer_ids == "sglang":
        cfg["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": [int(i) - 1 for i in capture]}
    return cfg


def published_eagle3_tensors(cfg: dict, *, seed: int = 0, dtype: str = "bfloat16",
                             embedding: bool = False) -> dict[str, np.ndarray]:
    """Random weights with a published EAGLE-3 head's names and shapes for draft config `cfg`
    (float weights in `dtype`; d2t int64 offsets of a random sorted draft vocabulary; t2d bool).
    `embedding`: also an `embed_tokens.weight`, which some published heads carry (SpecForge's
    export drops it) and the engines replace with the target's; 1 GB more at Llama-3.1-8B's shape."""
    rng = np.random.default_rng(seed)
    D, F = cfg["hidden_size"], cfg["intermediate_size"]
    hd, Hq, Hkv = cfg["head_dim"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
    V, Vd = cfg["vocab_size"], cfg["draft_vocab_size"]
    np_dtype = _DTYPES[dtype]

    def dense(out_dim, in_dim):  # fan-in scaled, so activations stay O(1) through the layer
        return (rng.standard_normal((out_dim, in_dim), dtype=np.float32) * in_dim**-0.5).astype(np_dtype)

    def norm(n):
        return (1.0 + 0.1 * rng.standard_normal(n, dtype=np.float32)).astype(np_dtype)

    sd = {
        "fc.weight": dense(D, 3 * D),
        "midlayer.input_layernorm.weight": norm(D),
        "midlayer.hidden_norm.weight": norm(D),
        "midlayer.self_attn.q_proj.weight": dense(Hq * hd, 2 * D),
        "midlayer.self_attn.k_proj.weight": dense(Hkv * hd, 2 * D),
        "midlayer.self_attn.v_proj.weight": dense(Hkv * hd, 2 * D),
        "midlayer.self_attn.o_proj.weight": dense(D, Hq * hd),
        "midlayer.post_attention_layernorm.weight": norm(D),
        "midlayer.mlp.gate_proj.weight": dense(F, D),
        "midlayer.mlp.up_proj.weight": dense(F, D),
        "midlayer.mlp.down_proj.weight": dense(D, F),
        "norm.weight": norm(D),
        "lm_head.weight": dense(Vd, D),
    }
    if cfg.get("fc_norm"):
        sd.update({f"fc_norm.{i}.weight": norm(D) for i in range(3)})
    if embedding:
        sd["embed_tokens.weight"] = (0.02 * rng.standard_normal((V, D), dtype=np.float32)).astype(np_dtype)
    if Vd < V:
        ids = np.sort(rng.choice(V, Vd, replace=False)).astype(np.int64)
        sd["d2t"] = ids - np.arange(Vd, dtype=np.int64)
        t2d = np.zeros(V, bool)
        t2d[ids] = True
        sd["t2d"] = t2d
    return sd


def _shards(sd: dict, n: int) -> list[dict]:
    names = sorted(sd)
    return [{k: sd[k] for k in names[i::n]} for i in range(n)]


def _torch_save(sd: dict, path: str) -> None:
    import torch  # only the bin layouts need torch: they are what torch.save writes

    def to_torch(a):
        if a.dtype == ml_dtypes.bfloat16:
            return torch.from_numpy(np.ascontiguousarray(a).view(np.int16)).view(torch.bfloat16)
        return torch.from_numpy(np.ascontiguousarray(a))

    torch.save({k: to_torch(v) for k, v in sd.items()}, path)


def write_tensors(path: str, sd: dict, layout: str = "safetensors", num_shards: int = 2) -> list[str]:
    """Write a state dict in one of LAYOUTS; returns the files written (index included)."""
    if layout not in LAYOUTS:
        raise ValueError(f"layout {layout!r}: one of {', '.join(LAYOUTS)}")
    os.makedirs(path, exist_ok=True)
    if layout == "safetensors":
        save_safetensors(sd, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
        return ["model.safetensors"]
    if layout == "bin":
        _torch_save(sd, os.path.join(path, "pytorch_model.bin"))
        return ["pytorch_model.bin"]
    if layout == "sharded":
        return save_safetensors_shards(path, _shards(sd, num_shards))
    files, weight_map = [], {}  # sharded_bin: torch's files, the same index
    for i, part in enumerate(_shards(sd, num_shards)):
        name = f"pytorch_model-{i + 1:05d}-of-{num_shards:05d}.bin"
        _torch_save(part, os.path.join(path, name))
        files.append(name)
        weight_map.update({k: name for k in part})
    total = int(sum(v.nbytes for v in sd.values()))
    with open(os.path.join(path, "pytorch_model.bin.index.json"), "w") as fh:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, fh, indent=1)
    return files + ["pytorch_model.bin.index.json"]


def write_published_eagle3_head(path: str, target: ModelConfig, *, layout: str = "safetensors", seed: int = 0,
                                dtype: str = "bfloat16", embedding: bool = False, **config_kw) -> dict:
    """Write config.json + weights of a synthetic published EAGLE-3 head for `target` (config_kw:
    published_eagle3_config's options). Returns the config written."""
    cfg = published_eagle3_config(target, **config_kw)
    cfg["torch_dtype"] = dtype
    sd = published_eagle3_tensors(cfg, seed=seed, dtype=dtype, embedding=embedding)
    write_tensors(path, sd, layout)
    with open(os.path.join(path, "config.json"), "w") as fh:
        json.dump(cfg, fh, indent=2)
    return cfg


def write_sharded_target(path: str, cfg: ModelConfig, *, dtype: str = "bfloat16", max_shard_bytes: int = 5 * 10**9,
                         seed: int = 0, reuse: bool = False) -> list[str]:
    """Write a random target of config `cfg` as Hugging Face writes a large model: config.json,
    model-0000i-of-0000N.safetensors shards of at most `max_shard_bytes` (tensors in HF's order,
    never split) and model.safetensors.index.json. Holds one shard in memory at a time.
    `reuse`: one random tensor per shape, shared by every layer (a 16 GB checkpoint in seconds;
    for load benchmarks, where values don't matter). Returns the files written."""
    os.makedirs(path, exist_ok=True)
    rng = np.random.default_rng(seed)
    np_dtype = _DTYPES[dtype]
    made: dict[tuple, np.ndarray] = {}

    def tensor(name: str) -> np.ndarray:
        shape = expected_shape(cfg, name)
        key = (shape, name.endswith("norm"))
        if reuse and key in made:
            return made[key]
        if len(shape) == 2:  # fan-in scaled, so activations stay O(1)
            t = (rng.standard_normal(shape, dtype=np.float32) * shape[1] ** -0.5).astype(np_dtype)
        else:
            t = ((1.0 if name.endswith("norm") else 0.0) + 0.1 * rng.standard_normal(shape, dtype=np.float32)).astype(np_dtype)
        made[key] = t
        return t

    order = [("embed", None)]
    for layer in range(cfg.num_layers):
        order += sorted(((n, layer) for n in layer_tensor_names(cfg)), key=lambda t: hf_tensor_name(cfg, *t))
    order += [(n, None) for n in global_tensor_names(cfg) if n != "embed"]

    tensors = ((hf_tensor_name(cfg, name, layer), tensor(name)) for name, layer in order)  # made as written
    files = save_safetensors_shards(path, shards_of_at_most(tensors, max_shard_bytes))
    with open(os.path.join(path, CONFIG_FILE), "w") as fh:
        json.dump(hf_config_dict(cfg, dtype), fh, indent=2)
    return files + [CONFIG_FILE]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m jspec.checkpoint.synthetic", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("out", help="head directory to write")
    p.add_argument("--target-config", default=None, help="the target's Hugging Face config.json (default: Llama-3.1-8B)")
    p.add_argument("--layout", default="safetensors", choices=LAYOUTS)
    p.add_argument("--dtype", default="bfloat16", choices=sorted(_DTYPES))
    p.add_argument("--draft-vocab", type=int, default=32000)
    p.add_argument("--fc-norm", action="store_true", help="EAGLE-3.1 per-layer norms before the fc")
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    if a.target_config:
        with open(a.target_config) as fh:
            target = config_from_hf(json.load(fh))
    else:
        target = llama31_8b_target()
    write_published_eagle3_head(a.out, target, layout=a.layout, seed=a.seed, dtype=a.dtype,
                                draft_vocab_size=a.draft_vocab, fc_norm=a.fc_norm)
    print(f"wrote a synthetic {a.layout} EAGLE-3 head for a {target.num_layers}-layer, hidden {target.hidden_size} target to {a.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
