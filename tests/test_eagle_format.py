"""EAGLE / EAGLE-3 checkpoint layout: export per engine, reload (with and without jspec's own
config block), identical draft logits; the engines' captured-layer conventions in both
directions; unknown tensors refused. What the engines' loaders accept is checked separately in
test_engine_contracts.py."""

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from jspec.checkpoint import eagle_format
from jspec.checkpoint.errors import CheckpointError
from jspec.heads import eagle as H
from jspec.model import init_params
from jspec.train.testing import numpy_params, tiny_target_config

TARGET = tiny_target_config(num_layers=6)
TPARAMS = numpy_params(init_params, TARGET, seed=4, scale=0.1)
_run = jax.jit(H.head_forward, static_argnums=0)


def _head(hcfg, seed=3):
    hparams = numpy_params(H.init_head, hcfg, seed=seed, scale=0.1)
    hparams["layer"]["mlp_norm"] = hparams["layer"]["mlp_norm"] * 1.5  # norms not all-ones
    if hcfg.kind == "eagle1":
        hparams["fc_bias"] = np.random.default_rng(seed).normal(size=hcfg.hidden_size).astype(np.float32) * 0.3
    return H.with_draft_vocab(hcfg, hparams, np.random.default_rng(0).integers(0, 99, 128))


def _logits(hcfg, hparams):
    B, T = 2, 5
    rng = np.random.default_rng(5)
    tokens = jnp.asarray(rng.integers(0, TARGET.vocab_size, (B, T)), jnp.int32)
    feats = jnp.asarray(rng.normal(size=(B, T, TARGET.hidden_size)), jnp.float32)
    h, lg, _ = _run(hcfg, hparams, TPARAMS, tokens, feats, H.init_head_cache(hcfg, B, 8))
    return np.asarray(h), np.asarray(lg)


def _strip_jspec_block(path):
    """The same directory as a third party would publish it: no `jspec` block in config.json."""
    cfg = json.load(open(os.path.join(path, "config.json")))
    cfg.pop("jspec")
    json.dump(cfg, open(os.path.join(path, "config.json"), "w"))


@pytest.mark.parametrize("kind,draft_vocab,capture", [("eagle1", 0, ()), ("eagle3", 48, (1, 3, 5))])
def test_round_trip_identical_logits(tmp_path, kind, draft_vocab, capture):
    hcfg = H.HeadConfig(kind, TARGET, capture, draft_vocab)
    hparams = _head(hcfg)
    path = os.path.join(tmp_path, kind)
    eagle_format.save_eagle_head(path, hcfg, hparams)
    hcfg2, hparams2 = eagle_format.load_eagle_head(path, TARGET)
    assert hcfg2 == hcfg
    assert jax.tree.structure(hparams2) == jax.tree.structure(hparams)

    sd = load_file(os.path.join(path, "model.safetensors"))
    cfg = json.load(open(os.path.join(path, "config.json")))
    D = TARGET.hidden_size
    assert "bias" not in cfg and cfg["attention_bias"] is False  # both engines read "bias" as attention bias
    if kind == "eagle3":
        assert cfg["architectures"] == ["LlamaForCausalLMEagle3"] and cfg["draft_vocab_size"] == draft_vocab
        assert cfg["eagle_aux_hidden_state_layer_ids"] == [1, 3, 5]  # vLLM's key: layer inputs
        assert "eagle_config" not in cfg  # SGLang versions read [0, 2, 4] differently: not written
        assert sd["fc.weight"].shape == (D, 3 * D)
        assert sd["midlayer.self_attn.q_proj.weight"].shape == (TARGET.q_size, 2 * D)
        assert sd["lm_head.weight"].shape == (draft_vocab, D)
        assert sd["d2t"].dtype == np.int64 and sd["t2d"].dtype == bool
        # offsets: target id = draft id + d2t[draft id]
        np.testing.assert_array_equal(sd["d2t"] + np.arange(draft_vocab), np.asarray(hparams["d2t"]))
        assert {"midlayer.input_layernorm.weight", "midlayer.hidden_norm.weight", "norm.weight"} <= set(sd)
    else:
        assert cfg["architectures"] == ["LlamaForCausalLMEagle"]  # SGLang's EAGLE-1 name; its fc has a bias
        assert sd["fc.weight"].shape == (D, 2 * D) and "fc.bias" in sd
        assert "layers.0.input_layernorm.weight" not in sd and "lm_head.weight" not in sd
    h1, lg1 = _logits(hcfg, hparams)
    h2, lg2 = _logits(hcfg2, hparams2)
    np.testing.assert_array_equal(lg1, lg2)
    np.testing.assert_array_equal(h1, h2)

    _strip_jspec_block(path)  # the third-party path: everything from the engines' own keys
    hcfg3, _ = eagle_format.load_eagle_head(path, TARGET)
    assert hcfg3 == hcfg


def test_bf16_export_and_default_capture(tmp_path):
    hcfg = H.default_head_config("eagle3", TARGET)  # full vocab, default layers
    hparams = numpy_params(H.init_head, hcfg, seed=3)
    eagle_format.save_eagle_head(str(tmp_path), hcfg, hparams, dtype="bfloat16")
    cfg = json.load(open(os.path.join(tmp_path, "config.json")))
    assert "eagle_config" not in cfg and cfg["draft_vocab_size"] == TARGET.vocab_size
    assert cfg["torch_dtype"] == "bfloat16" and cfg["tie_word_embeddings"] is False
    sd = load_file(os.path.join(tmp_path, "model.safetensors"))
    assert "d2t" not in sd and str(sd["fc.weight"].dtype) == "bfloat16"
    hcfg2, hp2 = eagle_format.load_eagle_head(str(tmp_path), TARGET)
    assert hcfg2 == hcfg
    np.testing.assert_allclose(hp2["lm_head"], hparams["lm_head"], rtol=1e-2, atol=1e-3)


def test_vllm_eagle1_folds_the_fc_bias_exactly(tmp_path):
    """vLLM's EAGLE-1 fc has no bias: the export moves it into attention biases (the same function)."""
    hcfg = H.HeadConfig("eagle1", TARGET)
    hparams = _head(hcfg)
    eagle_format.save_eagle_head(str(tmp_path), hcfg, hparams, engine="vllm")
    cfg = json.load(open(os.path.join(tmp_path, "config.json")))
    sd = load_file(os.path.join(tmp_path, "model.safetensors"))
    assert cfg["architectures"] == ["LlamaForCausalLM"] and cfg["attention_bias"] is True and "jspec" not in cfg
    assert "fc.bias" not in sd and {f"layers.0.self_attn.{n}_proj.bias" for n in "qkvo"} <= set(sd)
    hcfg2, hparams2 = eagle_format.load_eagle_head(str(tmp_path), TARGET)
    assert hcfg2 == hcfg
    np.testing.assert_allclose(np.asarray(hparams2["fc_bias"]), hparams["fc_bias"], rtol=1e-6)
    np.testing.assert_allclose(_logits(hcfg2, hparams2)[1], _logits(hcfg, hparams)[1], rtol=1e-4, atol=1e-4)

    sd["layers.0.self_attn.q_proj.bias"] = sd["layers.0.self_attn.q_proj.bias"] + 1.0  # not a folded bias
    save_file(sd, os.path.join(tmp_path, "model.safetensors"))
    with pytest.raises(CheckpointError, match="not a folded fc bias"):
        eagle_format.load_eagle_head(str(tmp_path), TARGET)


def test_sglang_layer_ids_written_only_where_every_version_reads_them_alike(tmp_path):
    hcfg = H.HeadConfig("eagle3", TARGET, (2, 3, 5), 48)
    hparams = _head(hcfg)
    eagle_format.save_eagle_head(str(tmp_path), hcfg, hparams, engine="sglang")
    cfg = json.load(open(os.path.join(tmp_path, "config.json")))
    assert cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 2, 4]  # outputs: SGLang adds 1
    assert "eagle_aux_hidden_state_layer_ids" not in cfg and "jspec" not in cfg
    assert eagle_format.load_eagle_head(str(tmp_path), TARGET)[0] == hcfg
    with pytest.raises(ValueError, match="sglang#25454"):
        eagle_format.save_eagle_head(str(tmp_path / "x"), hcfg.replace(capture_layers=(1, 3, 5)), hparams,
                                     engine="sglang")
    assert not (tmp_path / "x").exists()  # refused before writing


@pytest.mark.parametrize("cfg,want", [
    ({"eagle_aux_hidden_state_layer_ids": [1, 3, 4]}, (1, 3, 4)),  # vLLM: layer inputs as written
    ({"eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 2, 4]}}, (2, 3, 5)),  # SGLang: first id 1 -> +1
    ({"eagle_config": {"eagle_aux_hidden_state_layer_ids": [2, 3, 5]}}, (2, 3, 5)),  # after sglang#25454: as is
    ({}, H.default_capture_layers(6)),
])
def test_capture_layers_read_with_each_engines_convention(cfg, want):
    assert eagle_format.capture_layers_from_json(cfg, 6) == want


def test_disagreeing_layer_id_keys_are_refused():
    cfg = {"eagle_aux_hidden_state_layer_ids": [2, 3, 5], "eagle_config": {"eagle_aux_hidden_state_layer_ids": [2, 3, 5]}}
    assert eagle_format.capture_layers_from_json(cfg, 6) == (2, 3, 5)
    cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] = [1, 2, 4]
    assert eagle_format.capture_layers_from_json(cfg, 6) == (2, 3, 5)
    cfg["eagle_aux_hidden_state_layer_ids"] = [1, 2, 4]
    with pytest.raises(CheckpointError, match="two different captured layers"):
        eagle_format.capture_layers_from_json(cfg, 6)


def test_unknown_tensors_and_stray_files_are_named(tmp_path):
    hcfg = H.HeadConfig("eagle3", TARGET, (2, 3, 5), 48)
    eagle_format.save_eagle_head(str(tmp_path), hcfg, _head(hcfg))
    save_file({"w_in": np.zeros((4, 4), np.float32)}, os.path.join(tmp_path, "ldlp.safetensors"))  # the old layout
    with pytest.raises(CheckpointError, match="no place for: w_in"):
        eagle_format.load_eagle_head(str(tmp_path), TARGET)
    os.remove(os.path.join(tmp_path, "ldlp.safetensors"))
    sd = load_file(os.path.join(tmp_path, "model.safetensors"))
    sd["fc_norm.0.weight"] = np.ones(TARGET.hidden_size, np.float32)  # EAGLE-3.1 tensor, config says no fc_norm
    save_file(sd, os.path.join(tmp_path, "model.safetensors"))
    with pytest.raises(CheckpointError, match="fc_norm.0.weight"):
        eagle_format.load_eagle_head(str(tmp_path), TARGET)


def test_tensors_that_contradict_the_config_are_refused(tmp_path):
    hcfg = H.HeadConfig("eagle3", TARGET, (2, 3, 5), 48)
    eagle_format.save_eagle_head(str(tmp_path), hcfg, _head(hcfg))
    path = os.path.join(tmp_path, "config.json")
    cfg = json.load(open(path))
    json.dump({**cfg, "num_attention_heads": cfg["num_attention_heads"] * 2, "head_dim": cfg["head_dim"] // 2,
               "num_key_value_heads": cfg["num_key_value_heads"] * 4}, open(path, "w"))
    with pytest.raises(CheckpointError, match="do not match its config.json: midlayer.self_attn.k_proj.weight"):
        eagle_format.load_eagle_head(str(tmp_path), TARGET)
    json.dump({**cfg, "draft_vocab_size": 40}, open(path, "w"))
    with pytest.raises(CheckpointError, match="draft_vocab_size 40 but the d2t table has 48"):
        eagle_format.load_eagle_head(str(tmp_path), TARGET)


def test_a_head_over_the_file_limit_is_written_as_indexed_shards(tmp_path):
    """max_file_bytes: Hugging Face shards of at most that size with their index, read back to the
    same logits; one file again when re-exported without a limit (no shard left behind); a tensor
    larger than the limit is refused before anything is written."""
    hcfg = H.HeadConfig("eagle3", TARGET, (1, 3, 5), 48)
    hparams = _head(hcfg)
    sd = eagle_format.eagle_state_dict(hcfg, hparams)
    biggest = max(a.nbytes for a in sd.values())
    path = str(tmp_path / "head")
    eagle_format.save_eagle_head(path, hcfg, hparams, max_file_bytes=biggest)
    index = json.load(open(os.path.join(path, "model.safetensors.index.json")))
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 1 and sorted(f for f in os.listdir(path) if f.endswith(".safetensors")) == files
    assert all(os.path.getsize(os.path.join(path, f)) <= biggest + 4096 for f in files)  # + the header
    assert set(index["weight_map"]) == set(sd) and index["metadata"]["total_size"] == sum(a.nbytes for a in sd.values())
    hcfg2, hparams2 = eagle_format.load_eagle_head(path, TARGET)
    np.testing.assert_array_equal(_logits(hcfg2, hparams2)[1], _logits(hcfg, hparams)[1])
    # a sharded head is a drafter as `--drafter eagle3:DIR` names it (the spec check, then the load)
    from jspec.model import init_params
    from jspec.speculative.factory import build_drafter, check_drafter_spec

    check_drafter_spec(f"eagle3:{path}", cfg=TARGET)
    drafter, dparams = build_drafter(f"eagle3:{path}", TARGET, init_params(TARGET, jax.random.PRNGKey(0)))
    assert drafter.head.kind == "eagle3" and set(dparams) == set(hparams2)

    eagle_format.save_eagle_head(path, hcfg, hparams)
    assert sorted(f for f in os.listdir(path) if f != "config.json") == ["model.safetensors"]
    with pytest.raises(ValueError, match="over the per-file limit"):
        eagle_format.save_eagle_head(str(tmp_path / "new"), hcfg, hparams, max_file_bytes=biggest - 1)
    assert not (tmp_path / "new").exists()
