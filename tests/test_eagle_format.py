"""EAGLE / EAGLE-3 checkpoint layout: export, reload, identical draft logits."""

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file

from jspec.heads import eagle as H
from jspec.checkpoint import eagle_format
from jspec.model import init_params
from jspec.train.testing import numpy_params, tiny_target_config

TARGET = tiny_target_config(num_layers=6)


@pytest.mark.parametrize("kind,draft_vocab,capture", [("eagle1", 0, ()), ("eagle3", 48, (1, 3, 5))])
def test_round_trip_identical_logits(tmp_path, kind, draft_vocab, capture):
    hcfg = H.HeadConfig(kind, TARGET, capture, draft_vocab)
    hparams = numpy_params(H.init_head, hcfg, seed=3, scale=0.1)
    hparams["layer"]["mlp_norm"] = hparams["layer"]["mlp_norm"] * 1.5  # norms not all-ones
    hparams = H.with_draft_vocab(hcfg, hparams, np.random.default_rng(0).integers(0, 99, 128))
    tparams = numpy_params(init_params, TARGET, seed=4, scale=0.1)

    path = os.path.join(tmp_path, kind)
    eagle_format.save_eagle_head(path, hcfg, hparams)
    hcfg2, hparams2 = eagle_format.load_eagle_head(path, TARGET)
    assert hcfg2 == hcfg
    assert jax.tree.structure(hparams2) == jax.tree.structure(hparams)

    sd = load_file(os.path.join(path, "model.safetensors"))
    cfg = json.load(open(os.path.join(path, "config.json")))
    D = TARGET.hidden_size
    if kind == "eagle3":
        assert cfg["architectures"] == ["LlamaForCausalLMEagle3"] and cfg["draft_vocab_size"] == draft_vocab
        assert cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 3, 5]
        assert sd["fc.weight"].shape == (D, 3 * D)
        assert sd["midlayer.self_attn.q_proj.weight"].shape == (TARGET.q_size, 2 * D)
        assert sd["lm_head.weight"].shape == (draft_vocab, D)
        assert sd["d2t"].dtype == np.int64 and sd["t2d"].dtype == bool
        # offsets: target id = draft id + d2t[draft id]
        np.testing.assert_array_equal(sd["d2t"] + np.arange(draft_vocab), np.asarray(hparams["d2t"]))
        assert {"midlayer.input_layernorm.weight", "midlayer.hidden_norm.weight", "norm.weight"} <= set(sd)
    else:
        assert cfg["architectures"] == ["LlamaForCausalLMEagle"]
        assert sd["fc.weight"].shape == (D, 2 * D) and "fc.bias" in sd
        assert "layers.0.input_layernorm.weight" not in sd and "lm_head.weight" not in sd

    B, T = 2, 5
    rng = np.random.default_rng(5)
    tokens = jnp.asarray(rng.integers(0, TARGET.vocab_size, (B, T)), jnp.int32)
    feats = jnp.asarray(rng.normal(size=(B, T, D)), jnp.float32)
    run = jax.jit(H.head_forward, static_argnums=0)
    h1, lg1, _ = run(hcfg, hparams, tparams, tokens, feats, H.init_head_cache(hcfg, B, 8))
    h2, lg2, _ = run(hcfg2, hparams2, tparams, tokens, feats, H.init_head_cache(hcfg2, B, 8))
    np.testing.assert_array_equal(np.asarray(lg1), np.asarray(lg2))
    np.testing.assert_array_equal(np.asarray(h1), np.asarray(h2))


def test_bf16_export_and_default_capture_not_written(tmp_path):
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
