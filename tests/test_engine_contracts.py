"""Contract tests: EAGLE head folders against the rules SGLang's and vLLM's loaders apply.

Each rule below is restated from the engines' code (read, not copied), at these revisions:

vLLM (vllm-project/vllm)
  * model_executor/models/llama_eagle3.py @ 583507d: Eagle3LlamaForCausalLM.load_weights (t2d
    skipped; d2t -> draft_id_to_target_id, used as OFFSETS in compute_logits: target = arange + d2t;
    names outside lm_head get "model."; embed_tokens optional), LlamaModel.load_weights ("midlayer."
    -> "layers.0."; q/k/v -> qkv_proj, gate/up -> gate_up_proj; `params_dict[name]` raises KeyError
    on any other name); LlamaModel.__init__ (fc [D, 3 * target_hidden_size] without bias; qkv reads
    2D; draft_vocab_size defaults to vocab_size). A later revision (read through code search, with
    WeightsMapper) adds `fc_norm` (fc_norm.{i}.weight, RMSNorm per captured layer before fc) and
    `norm_output` (the post-norm hidden is fed back) - EAGLE-3.1.
  * model_executor/models/llama_eagle.py @ e1c4a55: EagleLlamaForCausalLM (fc [D, 2D], bias=False;
    layer 0's input_layernorm is Identity; embed_tokens skipped; unknown name -> KeyError).
  * model_executor/models/llama.py: LlamaDecoderLayer (attention bias on q/k/v AND o_proj when
    config `attention_bias` OR `bias`); get_eagle3_aux_hidden_state_layers (2, L//2, L-3); the
    capture loop records the INPUT of layer i.
  * transformers_utils/configs/eagle.py @ 23c5aa9: EAGLEConfig (method eagle: architecture names
    get an "Eagle" prefix, so LlamaForCausalLM -> EagleLlamaForCausalLM; method eagle3: names
    starting or ending with "Eagle3" are kept, others get an "Eagle3" prefix).
  * v1/spec_decode eagle3 utils get_eagle3_aux_layers_from_config: only the TOP-LEVEL
    `eagle_aux_hidden_state_layer_ids` of the draft config, as target layer inputs.
  * model_loader weight_utils / DefaultModelLoader._prepare_weights: the first of "*.safetensors",
    "*.bin", "*.pt" that matches files IN the folder (not below it), filtered by
    model.safetensors.index.json when present (filter_duplicate_safetensors_files).
SGLang (sgl-project/sglang)
  * python/sglang/srt/models/llama_eagle3.py @ 03d5a77: LlamaForCausalLMEagle3 (EntryClass);
    load_weights: d2t -> hot_token_id = d2t + arange (offsets), t2d skipped, stacked q/k/v and
    gate/up, `name` or "model." + name, and a name matching neither is SKIPPED SILENTLY; fc bias iff
    config `bias`; without draft_vocab_size the LM head is the target's; no fc_norm.
  * python/sglang/srt/models/llama_eagle.py @ 034b3be: LlamaForCausalLMEagle, fc = nn.Linear(2D, D)
    WITH a bias; layer 0 without input_layernorm; LlamaForCausalLM.load_weights skips unknown names.
  * python/sglang/srt/models/llama.py @ bf7a0e2: set_eagle3_layers_to_capture (None -> [2, L//2,
    L-3]; explicit ids -> id + 1: ids name layer OUTPUTS); model_runner reads only
    `eagle_config["eagle_aux_hidden_state_layer_ids"]`. sgl-project/sglang#25454 (merged 2026-05-16)
    adds 1 only when the first id is 1.
SpecForge (sgl-project/SpecForge @ a6b6b02): algorithms/model_providers.py
  resolve_eagle_capture_layers (eagle_config key, default [1, L//2-1, L-4] in SGLang's +1 form),
  export/to_sglang.py (identity names), configs/llama3-8B-eagle3.json (no rope_theta),
  configs/qwen3-30B-A3B-eagle3.1.json (fc_norm, norm_output), modeling/draft/llama3_eagle.py.
EAGLE (SafeAILab/EAGLE @ cb7e084): eagle/traineagle3/cnets.py (LlamaRotaryEmbedding base=10000,
  rope_theta not read).

The checks run on every shipped head (models/*/heads/*), on jspec's exports for each engine, and on
synthetic heads in the published layouts (a Llama-3.1-8B-shaped layout scaled down).
"""

from __future__ import annotations

import functools
import glob
import json
import os
from pathlib import Path

import numpy as np
import pytest
from safetensors import safe_open

from jspec import cli
from jspec.checkpoint import eagle_format, synthetic
from jspec.checkpoint.errors import CheckpointNotFoundError
from jspec.checkpoint.gguf_io import config_from_gguf, open_gguf
from jspec.checkpoint.hf import hf_config_dict
from jspec.checkpoint.torch_pickle import load_torch_state_dict
from jspec.config import ModelConfig
from jspec.heads import eagle as H
from jspec.presets import load_preset
from jspec.train.testing import numpy_params

ROOT = Path(__file__).resolve().parent.parent
SHIPPED = sorted(p for p in glob.glob(str(ROOT / "models" / "*" / "heads" / "*")) if os.path.isdir(p))
# A Llama-3.1-8B head's layout (32 heads over 8 KV heads, head_dim 128, draft vocab 32000 of
# 128256, rope 500000 + llama3 scaling on the target), scaled down so the test stays fast.
TARGET = ModelConfig(arch="llama", vocab_size=512, hidden_size=64, intermediate_size=160, num_layers=8,
                     num_heads=8, num_kv_heads=2, head_dim=8, rms_norm_eps=1e-5, rope_theta=500000.0,
                     rope_scaling=("llama3", 8.0, 1.0, 4.0, 64), bos_token_id=0, eos_token_ids=(1,))
DRAFT_VOCAB = 64
CAPTURE = (2, 3, 6)  # explicit, not the default (2, 4, 5); lowest input 2 so SGLang's versions agree


# ------------------------------------------------------------------------------------------------
# What the engines read
# ------------------------------------------------------------------------------------------------


def engine_weight_files(folder) -> list[str]:
    """DefaultModelLoader._prepare_weights (vLLM; SGLang's loader is the same): the first pattern
    with files in the folder itself, safetensors filtered by their index."""
    for pattern in ("*.safetensors", "*.bin", "*.pt"):
        files = sorted(glob.glob(os.path.join(folder, pattern)))
        files = [f for f in files if not f.endswith("training_args.bin")]
        if not files:
            continue
        index = os.path.join(folder, "model.safetensors.index.json")
        if pattern == "*.safetensors" and os.path.isfile(index):
            named = set(json.load(open(index))["weight_map"].values())
            files = [f for f in files if os.path.basename(f) in named]
        return files
    return []


def tensor_shapes(folder) -> dict[str, tuple]:
    shapes = {}
    for file in engine_weight_files(folder):
        if file.endswith(".safetensors"):
            with safe_open(file, "np") as fh:
                shapes.update({k: tuple(fh.get_slice(k).get_shape()) for k in fh.keys()})
        else:
            shapes.update({k: v.shape for k, v in load_torch_state_dict(file).items()})
    return shapes


def _geometry(cfg):
    D, Hq = cfg["hidden_size"], cfg["num_attention_heads"]
    Hkv = cfg.get("num_key_value_heads") or Hq
    hd = cfg.get("head_dim") or D // Hq
    return D, Hq * hd, Hkv * hd, cfg["intermediate_size"]


def _layer_params(cfg, prefix, attn_in, bias_qkv, bias_o, input_norm):
    """{checkpoint name: shape} of one Llama decoder layer as the engines allocate it."""
    D, q, kv, F = _geometry(cfg)
    out = {
        f"{prefix}self_attn.q_proj.weight": (q, attn_in), f"{prefix}self_attn.k_proj.weight": (kv, attn_in),
        f"{prefix}self_attn.v_proj.weight": (kv, attn_in), f"{prefix}self_attn.o_proj.weight": (D, q),
        f"{prefix}post_attention_layernorm.weight": (D,), f"{prefix}mlp.gate_proj.weight": (F, D),
        f"{prefix}mlp.up_proj.weight": (F, D), f"{prefix}mlp.down_proj.weight": (D, F),
    }
    if input_norm:
        out[f"{prefix}input_layernorm.weight"] = (D,)
    if bias_qkv:
        out.update({f"{prefix}self_attn.{n}_proj.bias": (s,) for n, s in (("q", q), ("k", kv), ("v", kv))})
    if bias_o:
        out[f"{prefix}self_attn.o_proj.bias"] = (D,)
    return out


def _compare(params, optional, shapes, unknown_is):
    """Problems loading `shapes` into `params` (all required but `optional`)."""
    problems = [f"{unknown_is}: {n}" for n in sorted(set(shapes) - set(params))]
    problems += [f"shape {n}: {shapes[n]} != {params[n]}" for n in sorted(set(shapes) & set(params)) if tuple(shapes[n]) != params[n]]
    problems += [f"missing (left at init): {n}" for n in sorted(set(params) - set(shapes) - optional)]
    return problems


def vllm_problems(folder) -> list[str]:
    """Why vLLM's loader would fail on (or mis-load) this head folder; [] when it loads."""
    cfg = json.load(open(os.path.join(folder, "config.json")))
    shapes = {k: v for k, v in tensor_shapes(folder).items() if "t2d" not in k}  # t2d: skipped
    arch = cfg["architectures"][0]
    D, V = cfg["hidden_size"], cfg["vocab_size"]
    attn_bias = bool(cfg.get("attention_bias") or cfg.get("bias"))
    if "Eagle3" in arch or "draft_vocab_size" in cfg:
        name = arch if arch.startswith("Eagle3") or arch.endswith("Eagle3") else f"Eagle3{arch}"
        problems = [] if name in ("Eagle3LlamaForCausalLM", "LlamaForCausalLMEagle3") else [f"architecture {name} not registered"]
        Vd = cfg.get("draft_vocab_size") or V
        TD = cfg.get("target_hidden_size", D)
        params = {"fc.weight": (D, 3 * TD), "norm.weight": (D,), "lm_head.weight": (Vd, D), "embed_tokens.weight": (V, D),
                  "midlayer.hidden_norm.weight": (D,), "d2t": (Vd,)}
        params.update(_layer_params(cfg, "midlayer.", 2 * D, bool(cfg.get("attention_bias")), attn_bias, True))
        if cfg.get("fc_norm"):
            params.update({f"fc_norm.{i}.weight": (TD,) for i in range(3)})
        return problems + _compare(params, {"embed_tokens.weight", "d2t"}, shapes, "KeyError (unknown name)")
    name = arch if arch.startswith("Eagle") else f"Eagle{arch}"
    problems = [] if name == "EagleLlamaForCausalLM" else [f"architecture {name} not registered"]
    params = {"fc.weight": (D, 2 * D), "embed_tokens.weight": (V, D)}
    params.update(_layer_params(cfg, "layers.0.", D, attn_bias, attn_bias, False))
    return problems + _compare(params, {"embed_tokens.weight"}, shapes, "KeyError (unknown name)")


def sglang_problems(folder) -> list[str]:
    """Why SGLang's loader would fail on, or silently mis-load, this head folder; [] when it loads."""
    cfg = json.load(open(os.path.join(folder, "config.json")))
    shapes = {k: v for k, v in tensor_shapes(folder).items() if "t2d" not in k}
    arch = cfg["architectures"][0]
    D, V = cfg["hidden_size"], cfg["vocab_size"]
    attn_bias = bool(cfg.get("attention_bias") or cfg.get("bias"))
    if arch == "LlamaForCausalLMEagle3":
        problems = []
        if cfg.get("draft_vocab_size") is None:
            problems.append("no draft_vocab_size: the target's LM head replaces the head's")
        if cfg.get("tie_word_embeddings"):
            problems.append("tie_word_embeddings: the embedding replaces the head's LM head")
        Vd = cfg.get("draft_vocab_size") or V
        TD = cfg.get("target_hidden_size", D)
        params = {"fc.weight": (D, 3 * TD), "norm.weight": (D,), "lm_head.weight": (Vd, D), "embed_tokens.weight": (V, D),
                  "midlayer.hidden_norm.weight": (D,), "d2t": (Vd,)}
        if cfg.get("bias"):
            params["fc.bias"] = (D,)
        params.update(_layer_params(cfg, "midlayer.", 2 * D, False, attn_bias, True))
        return problems + _compare(params, {"embed_tokens.weight", "d2t"}, shapes, "silently skipped")
    if arch != "LlamaForCausalLMEagle":
        return [f"architecture {arch} is not an SGLang EAGLE model"]
    params = {"fc.weight": (D, 2 * D), "fc.bias": (D,), "embed_tokens.weight": (V, D)}
    params.update(_layer_params(cfg, "layers.0.", D, attn_bias, attn_bias, False))
    return _compare(params, {"embed_tokens.weight"}, shapes, "silently skipped")


def vllm_capture(cfg, L) -> tuple:
    ids = cfg.get("eagle_aux_hidden_state_layer_ids")
    return tuple(ids) if ids else (2, L // 2, L - 3)


def sglang_capture(cfg, L, after_25454: bool) -> tuple:
    ids = (cfg.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    if not ids:
        return (2, L // 2, L - 3)
    return tuple(i + 1 for i in ids) if (ids[0] == 1 or not after_25454) else tuple(ids)


def _preset_config(head_dir) -> ModelConfig:
    """The shipped head's target config, from its preset's GGUF header (no weights read)."""
    return _gguf_config(Path(head_dir).parents[1].name)


@functools.lru_cache(maxsize=None)
def _installed_gguf_config(name: str) -> ModelConfig | str:
    """The preset's config, or why it cannot be read here (an opt-in preset not installed)."""
    try:
        path = load_preset(name).checkpoint_path()
    except CheckpointNotFoundError as e:
        return str(e)
    return config_from_gguf(open_gguf(path), path)


def _gguf_config(name: str) -> ModelConfig:
    cfg = _installed_gguf_config(name)
    if isinstance(cfg, str):  # e.g. the Qwen presets, which CI does not install (`make models-qwen`)
        pytest.skip(cfg)
    return cfg


# ------------------------------------------------------------------------------------------------
# Shipped heads
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("head", SHIPPED, ids=lambda p: "/".join(Path(p).parts[-3:]))
def test_shipped_head_folders_hold_only_the_head(head):
    """Both engines read every *.safetensors (else *.bin, *.pt) in the head folder: jspec's extras
    (the LDLP predictor) must sit in jspec/, below it."""
    files = [os.path.basename(f) for f in engine_weight_files(head)]
    if files != ["model.safetensors"]:  # Hugging Face shards (files of at most 60 MB), every one its index names
        index = json.load(open(os.path.join(head, "model.safetensors.index.json")))
        n = len(files)
        assert files == [f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)], files
        assert set(index["weight_map"].values()) == set(files)
    assert all(os.path.getsize(os.path.join(head, f)) <= 60_000_000 for f in files)  # the repo's file limit
    names = set(tensor_shapes(head))
    cfg = json.load(open(os.path.join(head, "config.json")))
    hcfg = eagle_format.head_config_from_json(cfg, _preset_config(head), cfg.get("draft_vocab_size") if "d2t" in names else None)
    assert names <= eagle_format.expected_tensor_names(hcfg), names - eagle_format.expected_tensor_names(hcfg)


@pytest.mark.parametrize("head", SHIPPED, ids=lambda p: "/".join(Path(p).parts[-3:]))
def test_shipped_heads_against_both_loaders(head):
    cfg = json.load(open(os.path.join(head, "config.json")))
    target = _preset_config(head)
    if cfg["jspec"]["kind"] == "eagle3":
        assert vllm_problems(head) == [] and sglang_problems(head) == []
        want = tuple(cfg["jspec"]["capture_layers"])  # what jspec captures for this head
        L = target.num_layers
        assert vllm_capture(cfg, L) == want
        assert sglang_capture(cfg, L, after_25454=False) == want == sglang_capture(cfg, L, after_25454=True)
        d2t = eagle_format.read_head_tensors(head).get("d2t")
        if d2t is not None:  # offsets: every draft id lands on a distinct target id
            ids = eagle_format.draft_to_target_ids(d2t, target.vocab_size)
            assert len(ids) == cfg["draft_vocab_size"]
    else:  # the shipped EAGLE-1 head is SGLang's layout (fc.bias); vLLM takes `export-head --for vllm`
        assert sglang_problems(head) == []
        problems = vllm_problems(head)
        assert any("not registered" in p for p in problems) and any("fc.bias" in p for p in problems)


@pytest.mark.parametrize("engine", eagle_format.ENGINES)
@pytest.mark.parametrize("kind", ["eagle3", "eagle"])
def test_export_head_writes_what_the_engine_loads(tmp_path, capsys, engine, kind):
    """`jspec export-head --for ENGINE` on the shipped SmolLM2 heads."""
    head = ROOT / "models" / "smollm2-135m-instruct" / "heads" / ("eagle3" if kind == "eagle3" else "eagle1")
    target_json = tmp_path / "target.json"  # the target's config alone: no weights to load
    target = _preset_config(head)
    target_json.write_text(json.dumps(hf_config_dict(target)))
    out = tmp_path / "out"
    assert cli.main(["export-head", "--for", engine, "--target", str(target_json), "--head", str(head), str(out)]) == 0
    assert f"for {engine}" in capsys.readouterr().out
    problems = vllm_problems(out) if engine == "vllm" else sglang_problems(out)
    assert problems == []
    cfg = json.loads((out / "config.json").read_text())
    assert "jspec" not in cfg and "bias" not in cfg
    if kind == "eagle3":
        L = target.num_layers
        got = vllm_capture(cfg, L) if engine == "vllm" else sglang_capture(cfg, L, after_25454=True)
        assert got == (2, 15, 27)
    hcfg, _ = eagle_format.load_eagle_head(str(out), target)  # and jspec reads the export back
    assert hcfg.kind == ("eagle3" if kind == "eagle3" else "eagle1")
    assert cli.main(["export-head", "--for", engine, "--target", str(target_json), "--head", str(head), str(out)]) == 2


# ------------------------------------------------------------------------------------------------
# jspec's exports of any head
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("engine", eagle_format.ENGINES)
@pytest.mark.parametrize("kind,fc_norm", [("eagle1", False), ("eagle3", False), ("eagle3", True)])
def test_exports_pass_the_engines_loader(tmp_path, engine, kind, fc_norm):
    hcfg = H.HeadConfig(kind, TARGET, CAPTURE if kind == "eagle3" else (), DRAFT_VOCAB if kind == "eagle3" else 0,
                        fc_norm=fc_norm)
    params = numpy_params(H.init_head, hcfg, seed=1, scale=0.1)
    if kind == "eagle1":
        params["fc_bias"] = np.full(TARGET.hidden_size, 0.1, np.float32)
    if engine == "sglang" and fc_norm:
        with pytest.raises(ValueError, match="fc_norm"):
            eagle_format.save_eagle_head(str(tmp_path), hcfg, params, engine=engine)
        return
    eagle_format.save_eagle_head(str(tmp_path), hcfg, params, engine=engine)
    problems = vllm_problems(tmp_path) if engine == "vllm" else sglang_problems(tmp_path)
    assert problems == []
    cfg = json.load(open(tmp_path / "config.json"))
    if kind == "eagle3":
        L = TARGET.num_layers
        if engine == "vllm":
            assert vllm_capture(cfg, L) == CAPTURE
        else:
            assert sglang_capture(cfg, L, False) == CAPTURE == sglang_capture(cfg, L, True)
    assert eagle_format.load_eagle_head(str(tmp_path), TARGET)[0] == hcfg


def test_jspec_layout_loads_in_both_engines(tmp_path):
    """jspec's own layout (train-head's export) of an EAGLE-3 head serves in both as it is."""
    hcfg = H.HeadConfig("eagle3", TARGET, CAPTURE, DRAFT_VOCAB)
    eagle_format.save_eagle_head(str(tmp_path), hcfg, numpy_params(H.init_head, hcfg, seed=1), dtype="bfloat16")
    assert vllm_problems(tmp_path) == [] and sglang_problems(tmp_path) == []
    cfg = json.load(open(tmp_path / "config.json"))
    assert vllm_capture(cfg, 8) == CAPTURE == sglang_capture(cfg, 8, True) == sglang_capture(cfg, 8, False)


# ------------------------------------------------------------------------------------------------
# Published layouts
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("layout", synthetic.LAYOUTS)
@pytest.mark.parametrize("layer_ids", synthetic.LAYER_ID_STYLES)
def test_published_layouts(tmp_path, layout, layer_ids):
    if layout.endswith("bin"):
        pytest.importorskip("torch")  # to write what torch.save writes; jspec reads it without torch
    cfg = synthetic.write_published_eagle3_head(str(tmp_path), TARGET, layout=layout, dtype="float32",
                                                draft_vocab_size=DRAFT_VOCAB, layer_ids=layer_ids,
                                                capture=CAPTURE if layer_ids else None, embedding=layer_ids is None)
    assert vllm_problems(tmp_path) == [] and sglang_problems(tmp_path) == []
    L = TARGET.num_layers
    engine_reads = {None: (2, 4, 5), "vllm": vllm_capture(cfg, L), "sglang": sglang_capture(cfg, L, True)}[layer_ids]
    hcfg, params = eagle_format.load_eagle_head(str(tmp_path), TARGET)
    assert hcfg.capture_layers == engine_reads == (CAPTURE if layer_ids else (2, 4, 5))
    assert hcfg.rope_theta == 10000.0 and hcfg.rope_scaling is None  # the draft's RoPE, not the target's
    sd = eagle_format.read_head_tensors(str(tmp_path))
    np.testing.assert_array_equal(np.asarray(params["d2t"]), sd["d2t"] + np.arange(DRAFT_VOCAB))


def test_published_eagle31_fc_norm(tmp_path):
    cfg = synthetic.write_published_eagle3_head(str(tmp_path), TARGET, dtype="float32", draft_vocab_size=DRAFT_VOCAB,
                                                fc_norm=True, layer_ids="vllm", capture=CAPTURE)
    assert vllm_problems(tmp_path) == []
    assert sglang_problems(tmp_path) == [f"silently skipped: fc_norm.{i}.weight" for i in range(3)]
    hcfg, params = eagle_format.load_eagle_head(str(tmp_path), TARGET)
    assert hcfg.fc_norm and params["fc_norm"].shape == (3 * TARGET.hidden_size,)
    assert cfg["fc_norm"] is True
