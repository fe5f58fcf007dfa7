"""Checkpoint I/O: HF safetensors, GGUF (tiny files written here), Orbax, conversion, presets, errors.

Tiny GGUF files are written with gguf's GGUFWriter following llama.cpp's conventions, from an
explicit HF -> GGUF name table kept here (not the loader's), so a naming or permutation bug in
the loader cannot cancel out against the writer.
"""

from __future__ import annotations

import argparse
import json
import math

import gguf
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from hf_tiny import FAMILIES, hf_logits, make_tiny
from jspec.checkpoint import (
    CheckpointNotFoundError,
    CorruptCheckpointError,
    MissingTensorError,
    TensorShapeError,
    UnknownArchitectureError,
    UnsupportedQuantizationError,
)
from jspec.checkpoint.convert import add_convert_args, convert, run_convert
from jspec.checkpoint.gguf_io import dequantize_tensor, load_gguf, open_gguf
from jspec.checkpoint.hf import export_hf, load_hf, params_from_hf_state_dict
from jspec.checkpoint.orbax_io import restore_params, save_params
from jspec.model import cast_params
from jspec import presets

Q = gguf.GGMLQuantizationType


def assert_trees_equal(a, b, rtol=0.0, atol=0.0):
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for (path, x), y in zip(jax.tree_util.tree_leaves_with_path(a), jax.tree.leaves(b)):
        assert x.dtype == y.dtype and x.shape == y.shape, path
        np.testing.assert_allclose(np.asarray(x, np.float32), np.asarray(y, np.float32), rtol=rtol, atol=atol, err_msg=str(path))


def state_dict_np(hf) -> dict[str, np.ndarray]:
    return {k: v.detach().float().numpy() for k, v in hf.state_dict().items()}


@pytest.fixture(scope="module")
def tiny():
    cache = {}

    def get(family):
        if family not in cache:
            cache[family] = make_tiny(family)
        return cache[family]

    return get


# ---------------------------------------------------------------------------------------------
# Hugging Face
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("family", FAMILIES)
def test_save_pretrained_then_load_hf(tiny, family, tmp_path):
    hf, cfg, params = tiny(family)
    hf.save_pretrained(tmp_path)
    got_cfg, got = load_hf(tmp_path)
    assert got_cfg == cfg
    assert_trees_equal(got, params)


def test_load_hf_sharded_bfloat16(tiny, tmp_path):
    hf, cfg, _ = tiny("gemma3")
    bf16 = make_tiny("gemma3")[0].to(torch.bfloat16)
    bf16.save_pretrained(tmp_path, max_shard_size="40KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    got_cfg, got = load_hf(tmp_path, dtype=jnp.bfloat16)
    assert got_cfg == cfg
    # Reference: torch's own exact bf16 -> fp32 widening, fed through the state-dict path.
    want = params_from_hf_state_dict(cfg, state_dict_np(bf16), dtype=jnp.bfloat16)
    assert_trees_equal(got, want)


@pytest.mark.parametrize("family", FAMILIES)
def test_export_hf_loads_in_transformers_with_same_logits(tiny, family, tmp_path):
    from transformers import AutoModelForCausalLM

    hf, cfg, params = tiny(family)
    export_hf(params, cfg, tmp_path)
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32, attn_implementation="eager").eval()
    tokens = np.random.RandomState(0).randint(0, cfg.vocab_size, (2, 11))
    ref, got = hf_logits(hf, tokens), hf_logits(reloaded, tokens)
    assert np.abs(got - ref).max() <= 1e-5 * np.abs(ref).max()
    cfg2, params2 = load_hf(tmp_path)
    assert cfg2 == cfg
    assert_trees_equal(params2, params, atol=1e-6)  # Gemma's (1 + w) - 1 may round in the last bit


def test_export_hf_bfloat16_keeps_dtype(tiny, tmp_path):
    from safetensors import safe_open

    _, cfg, params = tiny("qwen3")
    export_hf(cast_params(params, jnp.bfloat16), cfg, tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["dtype"] == "bfloat16"
    with safe_open(str(tmp_path / "model.safetensors"), framework="numpy") as f:
        assert str(f.get_tensor("model.embed_tokens.weight").dtype) == "bfloat16"
    _, got = load_hf(tmp_path, dtype=jnp.bfloat16)
    assert_trees_equal(got, cast_params(params, jnp.bfloat16))


def test_export_hf_files_honour_the_umask(tiny, tmp_path):
    """safetensors writes through a 0600 temporary file; the exported weights get 0666 & ~umask."""
    import os

    _, cfg, params = tiny("qwen3")
    old = os.umask(0o022)
    try:
        export_hf(params, cfg, tmp_path / "a")
    finally:
        os.umask(old)
    assert {p.name: p.stat().st_mode & 0o777 for p in (tmp_path / "a").iterdir()} == {
        "config.json": 0o644, "generation_config.json": 0o644, "model.safetensors": 0o644}


def test_hf_missing_directory_and_weights(tmp_path):
    with pytest.raises(CheckpointNotFoundError, match="nope"):
        load_hf(tmp_path / "nope")
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(CheckpointNotFoundError, match="model.safetensors"):
        load_hf(tmp_path)


def test_hf_truncated_safetensors(tiny, tmp_path):
    hf, _, _ = tiny("llama")
    hf.save_pretrained(tmp_path)
    weights = tmp_path / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    with pytest.raises(CorruptCheckpointError, match=r"model\.safetensors.*truncated"):
        load_hf(tmp_path)


def test_hf_unknown_architecture(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2", "n_layer": 2}))
    with pytest.raises(UnknownArchitectureError, match=r"config\.json.*'gpt2'.*supported: llama"):
        load_hf(tmp_path)


def test_hf_missing_and_misshapen_tensors(tiny):
    hf, cfg, _ = tiny("qwen2")
    sd = state_dict_np(hf)
    del sd["model.layers.1.self_attn.k_proj.bias"]
    with pytest.raises(MissingTensorError, match=r"model\.layers\.1\.self_attn\.k_proj\.bias"):
        params_from_hf_state_dict(cfg, sd)
    with pytest.raises(TensorShapeError, match=r"model\.layers\.0\.mlp\.gate_proj\.weight.*\(96, 64\).*\(80, 64\)"):
        params_from_hf_state_dict(cfg.replace(intermediate_size=80), state_dict_np(hf))


def test_hf_output_projection_bias_is_rejected(tiny):
    hf, cfg, _ = tiny("llama")
    sd = state_dict_np(hf)
    sd["model.layers.0.self_attn.o_proj.bias"] = np.ones(cfg.hidden_size, np.float32)
    with pytest.raises(UnknownArchitectureError, match="o_proj.bias"):
        params_from_hf_state_dict(cfg, sd)


def test_gemma3_multimodal_prefixes(tiny):
    hf, cfg, params = tiny("gemma3")
    sd = {k.replace("model.", "model.language_model.", 1): v for k, v in state_dict_np(hf).items()}
    sd["model.vision_tower.some.weight"] = np.zeros(3, np.float32)  # ignored
    assert_trees_equal(params_from_hf_state_dict(cfg, sd), params)


# ---------------------------------------------------------------------------------------------
# GGUF
# ---------------------------------------------------------------------------------------------

# HF suffix -> llama.cpp suffix (per layer), as in llama.cpp's tensor_mapping.
GGUF_LAYER_NAMES = {
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "input_layernorm": "attn_norm",
}
LLAMA_NORMS = {"post_attention_layernorm": "ffn_norm"}
GEMMA_NORMS = {
    "post_attention_layernorm": "post_attention_norm",
    "pre_feedforward_layernorm": "ffn_norm",
    "post_feedforward_layernorm": "post_ffw_norm",
}
GGUF_ARCH = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "gemma3": "gemma3"}


def gguf_name(hf_name: str, family: str) -> str | None:
    if hf_name == "model.embed_tokens.weight":
        return "token_embd.weight"
    if hf_name == "model.norm.weight":
        return "output_norm.weight"
    if hf_name == "lm_head.weight":
        return "output.weight"
    _, _, layer, rest = hf_name.split(".", 3)
    module, kind = rest.rsplit(".", 1)
    table = {**GGUF_LAYER_NAMES, **(GEMMA_NORMS if family == "gemma3" else LLAMA_NORMS)}
    return f"blk.{layer}.{table[module]}.{kind}"


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's HF -> GGUF Q/K row permutation (rotate-half halves -> interleaved pairs)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def llama3_rope_divisors(cfg) -> np.ndarray:
    """llama.cpp's rope_freqs.weight for llama3 rope scaling."""
    _, factor, low, high, orig = cfg.rope_scaling
    freqs = 1.0 / cfg.rope_theta ** (np.arange(0, cfg.head_dim, 2) / cfg.head_dim)
    out = []
    for f in freqs:
        wavelen = 2 * math.pi / f
        if wavelen < orig / high:
            out.append(1.0)
        elif wavelen > orig / low:
            out.append(factor)
        else:
            smooth = (orig / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.asarray(out, np.float32)


def write_tiny_gguf(path, family, hf, cfg, qtype=Q.F32, *, arch=None, drop=(), override=None):
    """Write `hf` as llama.cpp would; returns the HF state dict the loader should reproduce
    (2-D weights passed through quantize -> dequantize, norms and biases kept in F32)."""
    w = gguf.GGUFWriter(str(path), arch or GGUF_ARCH[family])
    w.add_block_count(cfg.num_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_heads)
    w.add_head_count_kv(cfg.num_kv_heads)
    w.add_key_length(cfg.head_dim)
    w.add_value_length(cfg.head_dim)
    w.add_rope_freq_base(cfg.rope_theta)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_bos_token_id(cfg.bos_token_id)
    w.add_eos_token_id(cfg.eos_token_ids[0])
    w.add_pad_token_id(cfg.pad_token_id)
    tokens = [f"t{i}" for i in range(cfg.vocab_size)]
    if family == "gemma3":
        tokens[106] = "<end_of_turn>"
        w.add_sliding_window(cfg.sliding_window)
        w.add_sliding_window_pattern(list(cfg.sliding_layers))
        w.add_rope_freq_base_swa(cfg.rope_local_theta)
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(cfg.rope_scaling[1])
        w.add_float32("gemma3.final_logit_softcapping", cfg.final_logit_softcap)
    if family == "llama":
        w.add_uint32("llama.rope.scaling.original_context_length", cfg.rope_scaling[4])
        w.add_tensor("rope_freqs.weight", llama3_rope_divisors(cfg))
    w.add_token_list(tokens)

    expected = {}
    for hf_name, tensor in state_dict_np(hf).items():
        if hf_name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        name = gguf_name(hf_name, family)
        if family == "gemma3" and "norm" in name:
            tensor = tensor + 1.0  # llama.cpp folds Gemma's (1 + w)
            expected[hf_name] = tensor - 1.0
        else:
            expected[hf_name] = tensor
        if family == "llama" and name.endswith(("attn_q.weight", "attn_k.weight")):
            tensor = llama_cpp_permute(tensor, cfg.num_heads if "attn_q" in name else cfg.num_kv_heads)
        if name in drop:
            continue
        if override and name in override:
            raw, raw_type = override[name]
            w.add_tensor(name, raw, raw_dtype=raw_type)
        elif tensor.ndim == 2 and qtype != Q.F32:
            quantized = gguf.quants.quantize(tensor, qtype)
            w.add_tensor(name, quantized, raw_dtype=qtype)
            # Row permutation commutes with row-wise block quantization.
            expected[hf_name] = gguf.quants.dequantize(gguf.quants.quantize(expected[hf_name], qtype), qtype)
        else:
            w.add_tensor(name, tensor.astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return expected


@pytest.mark.parametrize(
    "family,qtype", [("llama", Q.F32), ("llama", Q.Q4_1), ("qwen2", Q.F16), ("qwen3", Q.Q8_0), ("gemma3", Q.BF16), ("gemma3", Q.Q4_0)]
)
def test_load_gguf_matches_source(tiny, family, qtype, tmp_path):
    hf, cfg, _ = tiny(family)
    path = tmp_path / "m.gguf"
    expected_sd = write_tiny_gguf(path, family, hf, cfg, qtype)
    got_cfg, got = load_gguf(path)
    # GGUF stores eps as float32, and has no field for Gemma's query_pre_attn_scalar (llama.cpp
    # derives it from head_dim).
    want_cfg = cfg.replace(rms_norm_eps=float(np.float32(cfg.rms_norm_eps)))
    if family == "gemma3":
        want_cfg = want_cfg.replace(query_pre_attn_scalar=float(cfg.head_dim))
    assert got_cfg == want_cfg
    assert_trees_equal(got, params_from_hf_state_dict(cfg, expected_sd))
    if qtype in (Q.Q4_1, Q.Q8_0):  # bfloat16, the accelerators' default: each tensor rounded once, as the float32 is
        _, half = load_gguf(path, jnp.bfloat16)
        assert_trees_equal(half, jax.tree.map(lambda x: x.astype(jnp.bfloat16), got))


# Where each block keeps its float16 scales (ggml's block layouts); every other byte of a block is
# quant bits, valid whatever its value, so random bytes with finite scales are a valid block.
F16_SCALE_BYTES = {Q.Q8_0: (0, 2), Q.Q5_0: (0, 2), Q.Q4_K: (0, 4), Q.Q6_K: (208, 210)}


@pytest.mark.parametrize("qtype", list(F16_SCALE_BYTES))  # the quantized types of the Qwen2.5-Coder GGUFs
def test_gguf_random_blocks_dequantize_as_the_gguf_reference(qtype, tmp_path):
    """Random blocks written to a GGUF and read back through jspec's reader: the gguf package's
    reference dequantization, bit for bit, in [rows, columns] orientation."""
    rng = np.random.default_rng(int(qtype))
    block, type_size = gguf.GGML_QUANT_SIZES[qtype]
    rows, cols = 3, 512
    raw = rng.integers(0, 256, (rows, cols // block, type_size), dtype=np.uint8)
    lo, hi = F16_SCALE_BYTES[qtype]
    scales = rng.uniform(-2, 2, (rows, cols // block, (hi - lo) // 2)).astype(np.float16)
    raw[..., lo:hi] = scales.view(np.uint8)
    raw = raw.reshape(rows, -1)
    path = tmp_path / "q.gguf"
    w = gguf.GGUFWriter(str(path), "qwen2")
    w.add_tensor("blk.0.ffn_up.weight", raw, raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    (tensor,) = open_gguf(path).tensors
    got = dequantize_tensor(tensor, path)
    want = gguf.quants.dequantize(raw, qtype)
    assert got.shape == (rows, cols) and got.dtype == np.float32 and np.isfinite(got).all()
    np.testing.assert_array_equal(got, want)


def test_gguf_missing_file(tmp_path):
    with pytest.raises(CheckpointNotFoundError, match="missing.gguf"):
        load_gguf(tmp_path / "missing.gguf")


def test_gguf_truncated(tiny, tmp_path):
    hf, cfg, _ = tiny("qwen3")
    path = tmp_path / "m.gguf"
    write_tiny_gguf(path, "qwen3", hf, cfg)
    data = path.read_bytes()
    for keep in (len(data) // 2, 200, 0):
        path.write_bytes(data[:keep])
        with pytest.raises(CorruptCheckpointError, match=r"m\.gguf.*truncated or corrupt"):
            load_gguf(path)


def test_gguf_unknown_quantization(tiny, tmp_path):
    hf, cfg, _ = tiny("qwen3")
    path = tmp_path / "m.gguf"
    # Q8_1 is a llama.cpp activation format that gguf cannot dequantize.
    block, type_size = gguf.GGML_QUANT_SIZES[Q.Q8_1]
    raw = np.zeros((cfg.q_size, cfg.hidden_size // block * type_size), np.uint8)
    write_tiny_gguf(path, "qwen3", hf, cfg, override={"blk.0.attn_q.weight": (raw, Q.Q8_1)})
    with pytest.raises(UnsupportedQuantizationError, match=r"m\.gguf.*blk\.0\.attn_q\.weight.*Q8_1.*supported:.*Q4_K"):
        load_gguf(path)


def test_gguf_unknown_architecture_and_missing_tensor(tiny, tmp_path, monkeypatch):
    hf, cfg, _ = tiny("qwen3")
    path = tmp_path / "m.gguf"
    write_tiny_gguf(path, "qwen3", hf, cfg, arch="phi3")
    with pytest.raises(UnknownArchitectureError, match=r"m\.gguf.*'phi3'"):
        load_gguf(path)
    write_tiny_gguf(path, "qwen3", hf, cfg, drop={"blk.1.ffn_up.weight"})
    import jspec.checkpoint.gguf_io as gguf_io

    # named before any tensor is dequantized or placed
    monkeypatch.setattr(gguf_io, "place_params", lambda *a, **kw: pytest.fail("placed before the check"))
    with pytest.raises(MissingTensorError, match=r"m\.gguf.*blk\.1\.ffn_up\.weight"):
        load_gguf(path)


# ---------------------------------------------------------------------------------------------
# Orbax, conversion, presets
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_orbax_round_trip(tiny, dtype, tmp_path):
    _, cfg, params = tiny("gemma3")
    params = cast_params(params, dtype)
    save_params(tmp_path / "ck", params, cfg)
    got_cfg, got = restore_params(tmp_path / "ck")
    assert got_cfg == cfg
    assert_trees_equal(got, params)
    with pytest.raises(FileExistsError, match="ck"):
        save_params(tmp_path / "ck", params, cfg)
    with pytest.raises(CheckpointNotFoundError, match="not a jspec Orbax checkpoint"):
        restore_params(tmp_path)


def test_convert_hf_to_orbax_to_hf(tiny, tmp_path):
    from transformers import AutoModelForCausalLM

    hf, cfg, params = tiny("llama")
    hf.save_pretrained(tmp_path / "hf")
    convert(tmp_path / "hf", tmp_path / "orbax")
    parser = add_convert_args(argparse.ArgumentParser())
    assert run_convert(parser.parse_args([str(tmp_path / "orbax"), str(tmp_path / "back")])) == 0
    back = AutoModelForCausalLM.from_pretrained(tmp_path / "back", dtype=torch.float32, attn_implementation="eager")
    tokens = np.arange(9)[None] % cfg.vocab_size
    np.testing.assert_allclose(hf_logits(back.eval(), tokens), hf_logits(hf, tokens), rtol=0, atol=1e-5)


def test_a_preset_names_another_preset_as_its_draft_model():
    """Qwen2.5-Coder 1.5B's preset ships its 0.5B sibling as the draft model by name, so
    `--drafter model` needs no argument; a kind a preset ships no file for is still None. Reads
    preset.json only: the chunk packages need not be installed."""
    from jspec.speculative.factory import shipped_head_path

    assert shipped_head_path("qwen2.5-coder-1.5b-instruct", "model") == "qwen2.5-coder-0.5b-instruct"
    assert shipped_head_path("qwen2.5-coder-1.5b-instruct", "eagle") is None
    assert shipped_head_path("qwen2.5-coder-1.5b-instruct", "eagle3").name == "eagle3"
    assert shipped_head_path("qwen2.5-coder-0.5b-instruct", "model") is None


def test_presets_listed_and_resolved(tiny, tmp_path, monkeypatch):
    assert {"smollm2-135m-instruct", "gemma3-270m"} <= set(presets.list_presets())
    smol = presets.load_preset("smollm2-135m-instruct")
    assert smol.chat and smol.dtype["cpu"] == "float32" and smol.dtype["gpu"] == "bfloat16"
    assert not presets.load_preset("gemma3-270m").chat
    path, kind, preset = presets.resolve_checkpoint("smollm2-135m-instruct")
    assert kind == "gguf" and path.is_file() and preset.name == "smollm2-135m-instruct"

    hf, cfg, params = tiny("qwen2")
    hf.save_pretrained(tmp_path / "weights")
    (tmp_path / "models" / "tiny").mkdir(parents=True)
    blob = {"source": {"type": "path", "path": "../../weights"}, "dtype": {"cpu": "bfloat16"}, "chat": False}
    (tmp_path / "models" / "tiny" / "preset.json").write_text(json.dumps(blob))
    monkeypatch.setenv("JSPEC_MODELS_DIR", str(tmp_path / "models"))
    assert presets.list_presets() == ["tiny"]
    got_cfg, got, tok = presets.resolve_model("tiny")
    assert got_cfg == cfg and tok is None  # save_pretrained wrote no tokenizer
    assert_trees_equal(got, cast_params(params, jnp.bfloat16))
    with pytest.raises(CheckpointNotFoundError, match="available presets: tiny"):
        presets.resolve_model("no-such-model")
