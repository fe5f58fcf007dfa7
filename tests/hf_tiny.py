"""Tiny random Hugging Face models of every supported family, plus their jspec twins.

    hf_model, cfg, params = make_tiny("gemma3")

Each config exercises its family's quirks at toy size (hidden 64, 2-3 layers, vocab <= 192):
llama3 rope scaling, Mistral's sliding window, Qwen2's qkv bias and tied embeddings, Qwen3's
q/k norms with head_dim * heads != hidden, Gemma3's mixed local/global layers (window 4, shorter
than the test sequences), linear rope scaling on global layers, query_pre_attn_scalar != head_dim
and final-logit soft-capping. (Not attention soft-capping: transformers' Gemma3 ignores
attn_logit_softcapping, and real Gemma3 configs leave it None.) Weights are re-drawn at unit
scale (HF's 0.02 init makes attention nearly uniform and hides position bugs) and every norm
weight and bias is random, so a loader that drops or mis-maps any tensor changes the logits.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from jspec.checkpoint.hf import params_from_hf_state_dict
from jspec.config import config_from_hf

FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "gemma3")

_COMMON = dict(
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
    rms_norm_eps=1e-5,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
)


def hf_config(family: str):
    """The transformers config of the tiny model of `family`."""
    import transformers as tf

    if family == "llama":
        return tf.LlamaConfig(
            **_COMMON,
            vocab_size=160,
            head_dim=16,
            rope_parameters={
                "rope_type": "llama3",
                "rope_theta": 10000.0,
                "factor": 4.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 16,
            },
        )
    if family == "mistral":
        return tf.MistralConfig(**{**_COMMON, "num_key_value_heads": 1}, vocab_size=128, head_dim=16, sliding_window=5)
    if family == "qwen2":
        return tf.Qwen2Config(**_COMMON, vocab_size=128, tie_word_embeddings=True, rope_parameters={"rope_type": "default", "rope_theta": 1e6})
    if family == "qwen3":
        return tf.Qwen3Config(**_COMMON, vocab_size=144, head_dim=32)
    if family == "gemma3":
        return tf.Gemma3TextConfig(
            **{**_COMMON, "num_hidden_layers": 3, "bos_token_id": 2, "eos_token_id": [1, 106]},
            vocab_size=192,
            head_dim=16,
            layer_types=["sliding_attention", "full_attention", "sliding_attention"],
            sliding_window=4,
            query_pre_attn_scalar=24,
            final_logit_softcapping=30.0,
            rope_parameters={
                "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6},
                "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
            },
        )
    raise ValueError(f"unknown family {family!r}; choose from {FAMILIES}")


def _randomize(model, gemma: bool, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            if "norm" in name:
                # Gemma applies 1 + w, so a random w around 0 is a random multiplier around 1.
                p.copy_((0.0 if gemma else 1.0) + 0.2 * noise)
            elif name.endswith("bias"):
                p.copy_(0.3 * noise)
            elif "embed_tokens" in name:
                p.copy_(noise)
            else:
                p.copy_(noise / math.sqrt(p.shape[-1]))


def make_tiny(family: str, seed: int = 0):
    """(hf_model, cfg, params): a random fp32 transformers model in eval mode and its jspec twin."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    config = hf_config(family)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager", dtype=torch.float32)
    _randomize(model, gemma=family == "gemma3", seed=seed)
    model.tie_weights()
    model.eval()
    cfg = config_from_hf(model.config.to_dict())
    sd = {k: v.detach().numpy() for k, v in model.state_dict().items()}
    params = params_from_hf_state_dict(cfg, sd, source=f"tiny {family}")
    return model, cfg, params


def hf_logits(model, tokens) -> np.ndarray:
    """Full-sequence fp32 logits [B, T, V] of a transformers model (no padding)."""
    with torch.no_grad():
        out = model(torch.as_tensor(np.asarray(tokens), dtype=torch.long))
    return out.logits.float().numpy()
