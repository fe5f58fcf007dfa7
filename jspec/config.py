"""Model configuration: one frozen, hashable dataclass for every supported decoder family.

The config is a static argument of every jitted function, so it must be hashable and must hold
only Python scalars and tuples. Family quirks (Gemma's scaled embeddings and sandwich norms, Qwen2's
qkv bias, Qwen3's q/k norms, sliding-window layers, llama3 rope scaling) are flags here, so one
forward function serves every family.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import numpy as np

SUPPORTED_ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3", "gemma3")


class UnsupportedModelError(ValueError):
    """The checkpoint describes an architecture or feature jspec does not implement."""


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    arch: str  # one of SUPPORTED_ARCHITECTURES
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    # ("llama3", factor, low_freq_factor, high_freq_factor, original_max_position) or
    # ("linear", factor) or None.
    rope_scaling: tuple | None = None
    max_position_embeddings: int = 8192
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # Qwen2: bias on q, k, v projections
    qk_norm: bool = False  # Qwen3 / Gemma3: RMSNorm on each head of q and k
    mlp_activation: str = "silu"  # "silu" (SwiGLU) or "gelu_tanh" (GeGLU)
    # Gemma3 specifics
    embed_scale: float = 1.0  # embeddings multiplied by this (sqrt(hidden) for Gemma)
    sandwich_norm: bool = False  # extra post-attention / post-MLP norms (Gemma)
    query_pre_attn_scalar: float | None = None  # attention scale = this ** -0.5 (else head_dim)
    sliding_window: int | None = None
    # Per-layer: True where the layer uses local sliding-window attention.
    sliding_layers: tuple[bool, ...] = ()
    rope_local_theta: float | None = None  # rope base of sliding-window layers
    final_logit_softcap: float | None = None
    attn_logit_softcap: float | None = None
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    pad_token_id: int = 0
    # > 1 only in the per-device config of model=N tensor parallelism (sharding.tensor_parallel_config):
    # the heads and MLP above are one device's share, and forward sums the row-parallel products
    # (wo, w_down) over the mesh's model axis. A static field, so such a trace is never reused
    # for a whole model of the same shape.
    tensor_parallel_shards: int = 1
    # > 0 (generate(invariant=True)): every forward of 1..fixed_block new tokens with a causal mask
    # (AR decode steps, chain verify blocks) and every LM head over them runs padded to fixed_block
    # tokens on the portable kernels. Decoding and verification then multiply the same shapes, so
    # their logits round alike, bit for bit, and greedy speculative output equals AR's in bf16 too
    # (model.forward). A run-time choice like the field above: not saved by to_dict.
    fixed_block: int = 0
    # The preset this config was loaded from (jspec.presets.resolve_model / resolve_config), so
    # generate() finds the drafters, calibrated constants and cost tables it ships, as the CLI
    # does; None for a checkpoint path. Not compared or hashed (two loads of one model share their
    # compiled programs) and not saved by to_dict (where a model was loaded from is not the model).
    preset: str | None = dataclasses.field(default=None, compare=False)

    def __post_init__(self):
        if self.arch not in SUPPORTED_ARCHITECTURES:
            raise UnsupportedModelError(
                f"unknown architecture {self.arch!r}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        if self.num_heads % self.num_kv_heads:
            raise UnsupportedModelError(
                f"num_heads={self.num_heads} is not a multiple of num_kv_heads={self.num_kv_heads}"
            )
        if self.sliding_layers and len(self.sliding_layers) != self.num_layers:
            raise UnsupportedModelError("sliding_layers must have one entry per layer")

    # ---- derived -------------------------------------------------------------------------------
    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def attn_scale(self) -> float:
        base = self.query_pre_attn_scalar if self.query_pre_attn_scalar else self.head_dim
        return float(base) ** -0.5

    @property
    def has_sliding(self) -> bool:
        return any(self.sliding_layers)

    def replace(self, **kw) -> "ModelConfig":
        return dataclasses.replace(self, **kw)

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        if self.tensor_parallel_shards == 1:  # a run-time split, not part of a saved model's config
            del d["tensor_parallel_shards"]
        del d["fixed_block"]  # how a run multiplies, not the model
        del d["preset"]
        return {k: (list(v) if isinstance(v, tuple) else v) for k, v in d.items()}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "ModelConfig":
        names = {f.name for f in dataclasses.fields(cls)}
        kw = {k: (tuple(v) if isinstance(v, list) else v) for k, v in d.items() if k in names}
        return cls(**kw)


def rope_inv_freq(cfg: ModelConfig, theta: float, *, scaled: bool = True) -> np.ndarray:
    """Inverse frequencies [head_dim // 2] with the config's rope scaling applied."""
    hd = cfg.head_dim
    inv = 1.0 / (theta ** (np.arange(0, hd, 2, dtype=np.float64) / hd))
    rs = cfg.rope_scaling if scaled else None
    if rs is None:
        return inv.astype(np.float32)
    if rs[0] == "linear":
        return (inv / rs[1]).astype(np.float32)
    if rs[0] == "llama3":
        _, factor, low_ff, high_ff, orig = rs
        low_wavelen = orig / low_ff
        high_wavelen = orig / high_ff
        wavelen = 2 * math.pi / inv
        scaled_inv = np.where(wavelen > low_wavelen, inv / factor, inv)
        smooth = (orig / wavelen - low_ff) / (high_ff - low_ff)
        smoothed = (1 - smooth) * scaled_inv / factor + smooth * scaled_inv
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        return np.where(medium, smoothed, scaled_inv).astype(np.float32)
    raise UnsupportedModelError(f"unsupported rope scaling {rs[0]!r} (supported: llama3, linear)")


def _rope_scaling_from_hf(rs: dict | None) -> tuple | None:
    if not rs:
        return None
    kind = rs.get("rope_type", rs.get("type"))
    if kind in (None, "default"):
        return None
    if kind == "llama3":
        return (
            "llama3",
            float(rs["factor"]),
            float(rs.get("low_freq_factor", 1.0)),
            float(rs.get("high_freq_factor", 4.0)),
            int(rs["original_max_position_embeddings"]),
        )
    if kind == "linear":
        return ("linear", float(rs["factor"]))
    raise UnsupportedModelError(f"unsupported rope scaling type {kind!r} (supported: llama3, linear)")


def config_from_hf(hf: dict[str, Any]) -> ModelConfig:
    """Build a ModelConfig from a Hugging Face ``config.json`` dict."""
    if "text_config" in hf and hf.get("model_type") in ("gemma3",):
        hf = {**hf["text_config"], "model_type": "gemma3_text"}
    mt = hf.get("model_type", "")
    arch = {
        "llama": "llama",
        "mistral": "mistral",
        "qwen2": "qwen2",
        "qwen3": "qwen3",
        "gemma3_text": "gemma3",
        "gemma3": "gemma3",
    }.get(mt)
    if arch is None:
        raise UnsupportedModelError(
            f"unknown model_type {mt!r}; supported: llama, mistral, qwen2, qwen3, gemma3_text"
        )
    n_heads = hf["num_attention_heads"]
    hidden = hf["hidden_size"]
    head_dim = hf.get("head_dim") or hidden // n_heads
    eos = hf.get("eos_token_id")
    eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
    # transformers 5 moves rope_theta into rope_parameters
    rp = hf.get("rope_parameters") or {}
    if "full_attention" in rp or "sliding_attention" in rp:  # gemma3 per-layer-type params
        full = rp.get("full_attention", {})
        local = rp.get("sliding_attention", {})
        rope_theta = float(full.get("rope_theta", hf.get("rope_theta", 1e6)))
        rope_local = float(local.get("rope_theta", hf.get("rope_local_base_freq", 10000.0)))
        rope_scaling = _rope_scaling_from_hf(full if full.get("rope_type") not in (None, "default") else None)
    else:
        rope_theta = float(rp.get("rope_theta", hf.get("rope_theta", 10000.0)))
        rope_local = hf.get("rope_local_base_freq")
        rs = hf.get("rope_scaling") or (rp if rp.get("rope_type") not in (None, "default") else None)
        rope_scaling = _rope_scaling_from_hf(rs)
    common = dict(
        arch=arch,
        vocab_size=hf["vocab_size"],
        hidden_size=hidden,
        intermediate_size=hf["intermediate_size"],
        num_layers=hf["num_hidden_layers"],
        num_heads=n_heads,
        num_kv_heads=hf.get("num_key_value_heads") or n_heads,
        head_dim=head_dim,
        rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        rope_theta=rope_theta,
        rope_scaling=rope_scaling,
        max_position_embeddings=int(hf.get("max_position_embeddings", 8192)),
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", arch == "gemma3")),
        bos_token_id=hf.get("bos_token_id"),
        eos_token_ids=eos_ids,
        pad_token_id=hf.get("pad_token_id") or 0,
    )
    if arch in ("llama", "mistral"):
        if hf.get("mlp_bias"):
            raise UnsupportedModelError("mlp_bias=True is not supported")
        common["attention_bias"] = bool(hf.get("attention_bias", False))
        if arch == "mistral" and hf.get("sliding_window"):
            w = int(hf["sliding_window"])
            common["sliding_window"] = w
            common["sliding_layers"] = (True,) * common["num_layers"]
            common["rope_local_theta"] = rope_theta
    elif arch == "qwen2":
        common["attention_bias"] = True
        if hf.get("use_sliding_window"):
            raise UnsupportedModelError("qwen2 use_sliding_window=True is not supported")
    elif arch == "qwen3":
        common["qk_norm"] = True
        common["attention_bias"] = bool(hf.get("attention_bias", False))
    elif arch == "gemma3":
        n = common["num_layers"]
        layer_types = hf.get("layer_types")
        if layer_types is None:
            pattern = int(hf.get("sliding_window_pattern", 6))
            layer_types = [
                "full_attention" if (i + 1) % pattern == 0 else "sliding_attention" for i in range(n)
            ]
        common.update(
            qk_norm=True,
            mlp_activation="gelu_tanh",
            embed_scale=float(hidden) ** 0.5,
            sandwich_norm=True,
            query_pre_attn_scalar=float(hf.get("query_pre_attn_scalar", head_dim)),
            sliding_window=int(hf.get("sliding_window", 512)),
            sliding_layers=tuple(t == "sliding_attention" for t in layer_types),
            rope_local_theta=float(rope_local or 10000.0),
            final_logit_softcap=hf.get("final_logit_softcapping"),
            # transformers' Gemma3 ignores attn_logit_softcapping (Gemma2 used it); so do we.
            attn_logit_softcap=None,
        )
        common["attention_bias"] = bool(hf.get("attention_bias", False))
    return ModelConfig(**common)
