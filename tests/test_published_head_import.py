"""The import check: a synthetic head in the published EAGLE-3 layout, imported into jspec, drafts
the same tokens as a NumPy implementation of the head's forward written from the reference
(EAGLE eagle/traineagle3/cnets.py; SpecForge modeling/draft/llama3_eagle.py; vLLM
llama_eagle3.py for EAGLE-3.1's fc_norm / norm_output) with the DRAFT's own RoPE: its config has
no rope_theta, so base 10000 and no scaling, while the target uses 500000 + llama3 scaling. The
head's attention geometry (heads, KV heads, head_dim) also differs from the target's and must
come from its own config."""

from __future__ import annotations

import json

import jax.numpy as jnp
import numpy as np
import pytest

from jspec.checkpoint import eagle_format, synthetic
from jspec.config import ModelConfig
from jspec.heads import eagle as H
from jspec.model import init_params
from jspec.train.testing import numpy_params

TARGET = ModelConfig(arch="llama", vocab_size=512, hidden_size=64, intermediate_size=160, num_layers=8,
                     num_heads=8, num_kv_heads=2, head_dim=8, rms_norm_eps=1e-5, rope_theta=500000.0,
                     rope_scaling=("llama3", 8.0, 1.0, 4.0, 64), bos_token_id=0, eos_token_ids=(1,))
HEAD_GEOMETRY = dict(num_heads=4, num_kv_heads=1, head_dim=16)  # not the target's 8 / 2 / 8
T, K = 12, 5  # prompt pairs, drafted tokens


def rms(x, w, eps):
    return x / np.sqrt(np.mean(x * x, -1, keepdims=True) + eps) * w


def rope(x, pos, theta):
    """Rotate-half RoPE (Llama) over [T, H, hd] at positions pos [T]."""
    hd = x.shape[-1]
    inv = 1.0 / theta ** (np.arange(0, hd, 2, dtype=np.float64) / hd)
    ang = np.concatenate([pos[:, None] * inv] * 2, -1)[:, None, :]
    rot = np.concatenate([-x[..., hd // 2 :], x[..., : hd // 2]], -1)
    return x * np.cos(ang) + rot * np.sin(ang)


class Reference:
    """The EAGLE-3 draft forward in float64 NumPy, from the checkpoint's tensors and config."""

    def __init__(self, cfg, sd, embed, theta):
        self.sd = {k: np.asarray(v, np.float64) for k, v in sd.items() if k not in ("d2t", "t2d")}
        self.d2t = sd["d2t"] + np.arange(len(sd["d2t"]))
        self.cfg, self.embed, self.theta = cfg, np.asarray(embed, np.float64), theta
        self.eps = cfg["rms_norm_eps"]
        self.k, self.v = [], []  # the head's KV cache

    def fuse(self, captured):
        if self.cfg.get("fc_norm"):
            captured = [rms(c, self.sd[f"fc_norm.{i}.weight"], self.eps) for i, c in enumerate(captured)]
        return np.concatenate(captured, -1) @ self.sd["fc.weight"].T

    def step(self, tokens, feats, pos):
        """New pairs (token x_{t+1}, feature f_t) at positions pos; returns (h_out, draft-vocab logits)."""
        sd, c = self.sd, self.cfg
        Hq, Hkv, hd = c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"]
        a = np.concatenate([rms(self.embed[tokens], sd["midlayer.input_layernorm.weight"], self.eps),
                            rms(feats, sd["midlayer.hidden_norm.weight"], self.eps)], -1)
        q = rope((a @ sd["midlayer.self_attn.q_proj.weight"].T).reshape(len(pos), Hq, hd), pos, self.theta)
        k = rope((a @ sd["midlayer.self_attn.k_proj.weight"].T).reshape(len(pos), Hkv, hd), pos, self.theta)
        v = (a @ sd["midlayer.self_attn.v_proj.weight"].T).reshape(len(pos), Hkv, hd)
        self.k.append(k)
        self.v.append(v)
        K_, V_ = np.concatenate(self.k), np.concatenate(self.v)
        allpos = np.arange(len(K_))
        out = np.zeros((len(pos), Hq, hd))
        for h in range(Hq):
            g = h // (Hq // Hkv)
            s = q[:, h] @ K_[:, g].T / np.sqrt(hd)
            s = np.where(allpos[None] <= pos[:, None], s, -np.inf)
            w = np.exp(s - s.max(-1, keepdims=True))
            out[:, h] = (w / w.sum(-1, keepdims=True)) @ V_[:, g]
        h_ = feats + out.reshape(len(pos), -1) @ sd["midlayer.self_attn.o_proj.weight"].T
        m = rms(h_, sd["midlayer.post_attention_layernorm.weight"], self.eps)
        gate, up = m @ sd["midlayer.mlp.gate_proj.weight"].T, m @ sd["midlayer.mlp.up_proj.weight"].T
        h_ = h_ + (gate / (1 + np.exp(-gate)) * up) @ sd["midlayer.mlp.down_proj.weight"].T
        normed = rms(h_, sd["norm.weight"], self.eps)
        logits = normed @ sd["lm_head.weight"].T
        return (normed if self.cfg.get("norm_output") else h_), logits

    def draft(self, tokens, captured):
        """Greedy chain of K target ids after the prompt pairs."""
        h, logits = self.step(tokens, self.fuse(captured), np.arange(T))
        out = []
        for j in range(K):
            tok = int(self.d2t[np.argmax(logits[-1])])
            out.append(tok)
            h, logits = self.step(np.array([tok]), h[-1:], np.array([T + j]))
        return out, logits


def jspec_draft(hcfg, params, tparams, tokens, captured):
    cache = H.init_head_cache(hcfg, 1, T + K + 1)
    feats = H.fuse_captured(hcfg, params, [jnp.asarray(c[None], jnp.float32) for c in captured])
    h, logits, cache = H.head_forward(hcfg, params, tparams, jnp.asarray(tokens[None], jnp.int32), feats, cache)
    cache = cache.replace(lengths=cache.lengths + T)
    out = []
    for _ in range(K):
        tok = int(jnp.argmax(logits[0, -1]))
        out.append(tok)
        h, logits, cache = H.head_forward(hcfg, params, tparams, jnp.asarray([[tok]], jnp.int32), h[:, -1:], cache)
        cache = cache.replace(lengths=cache.lengths + 1)
    return out, np.asarray(logits[0, -1])


@pytest.mark.parametrize("variant", ["eagle3", "eagle3.1"])
def test_imported_published_head_drafts_like_the_reference(tmp_path, variant):
    eagle31 = variant == "eagle3.1"
    cfg = synthetic.write_published_eagle3_head(
        str(tmp_path), TARGET, dtype="float32", draft_vocab_size=64, seed=3, fc_norm=eagle31,
        layer_ids="sglang", capture=(2, 3, 6), **HEAD_GEOMETRY)
    if eagle31:  # vLLM's reading of EAGLE-3.1: the post-norm hidden is fed back
        cfg["norm_output"] = True
        (tmp_path / "config.json").write_text(json.dumps(cfg))
    hcfg, params = eagle_format.load_eagle_head(str(tmp_path), TARGET)
    assert (hcfg.num_heads, hcfg.num_kv_heads, hcfg.head_dim) == (4, 1, 16)
    assert (hcfg.rope_theta, hcfg.rope_scaling, hcfg.capture_layers) == (10000.0, None, (2, 3, 6))
    tparams = numpy_params(init_params, TARGET, seed=4, scale=0.5)
    rng = np.random.default_rng(7)
    tokens = rng.integers(0, TARGET.vocab_size, T)
    captured = [rng.normal(size=(T, TARGET.hidden_size)) * s for s in (1.0, 3.0, 10.0)]

    sd = eagle_format.read_head_tensors(str(tmp_path))
    ref_tokens, ref_logits = Reference(cfg, sd, tparams["embed"], 10000.0).draft(tokens, captured)
    got_tokens, got_logits = jspec_draft(hcfg, params, tparams, tokens, captured)
    assert got_tokens == ref_tokens and len(set(ref_tokens)) > 1
    in_vocab = got_logits > -1e20
    np.testing.assert_allclose(np.sort(got_logits[in_vocab]), np.sort(ref_logits[-1]), rtol=2e-4, atol=2e-4)

    # the check has teeth: the target's RoPE (what jspec used to take) gives other logits
    _, wrong = Reference(cfg, sd, tparams["embed"], TARGET.rope_theta).draft(tokens, captured)
    assert np.abs(wrong[-1] - ref_logits[-1]).max() > 1e-2
