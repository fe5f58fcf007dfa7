"""GGUF (llama.cpp) checkpoints to jspec: metadata -> ModelConfig, tensors dequantized to float.

Conventions undone on load:
* numpy shapes of GGUF tensors are ggml's `ne` reversed, so a dequantized projection is already
  in PyTorch [out, in] orientation (we reshape to reversed(tensor.shape) explicitly).
* For the `llama` architecture llama.cpp permutes Q/K rows from rotate-half order to interleaved
  pairs; jspec's rope is rotate-half, so the permutation is inverted (K with n_head_kv).
* Gemma3 norm weights are stored with the `+1` already folded in (llama.cpp adds it when
  converting; transformers' GGUF loader subtracts it again), which is exactly jspec's layout.
* Llama 3 rope scaling is stored as a `rope_freqs` tensor of per-frequency divisors; we recover the
  llama3 parameters and check they reproduce that tensor.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import Any

import jax.numpy as jnp
import numpy as np

from ..config import ModelConfig, UnsupportedModelError, rope_inv_freq
from .errors import (
    CheckpointNotFoundError,
    CorruptCheckpointError,
    MissingTensorError,
    UnknownArchitectureError,
    UnsupportedQuantizationError,
)
from .layout import check_shape, expected_shape, global_tensor_names, layer_tensor_names
from .streaming import place_params

GGUF_ARCHITECTURES = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "gemma3": "gemma3"}

_LAYER_TENSORS = {
    "q_proj": "attn_q.weight",
    "k_proj": "attn_k.weight",
    "v_proj": "attn_v.weight",
    "o_proj": "attn_output.weight",
    "q_bias": "attn_q.bias",
    "k_bias": "attn_k.bias",
    "v_bias": "attn_v.bias",
    "q_norm": "attn_q_norm.weight",
    "k_norm": "attn_k_norm.weight",
    "gate_proj": "ffn_gate.weight",
    "up_proj": "ffn_up.weight",
    "down_proj": "ffn_down.weight",
    "attn_norm": "attn_norm.weight",
    "mlp_norm": "ffn_norm.weight",
    "post_attn_norm": "post_attention_norm.weight",
    "post_mlp_norm": "post_ffw_norm.weight",
}
_GLOBAL_TENSORS = {"embed": "token_embd.weight", "final_norm": "output_norm.weight", "lm_head": "output.weight"}

# Tokens that close a chat turn; added to the stop ids when the chat template emits them.
END_OF_TURN_MARKERS = ("<end_of_turn>", "<|im_end|>", "<|eot_id|>", "<|end|>")

GEMMA3_SLIDING_PATTERN = 6  # llama.cpp's (and transformers') default: every 6th layer is global
GEMMA3_LOCAL_ROPE_BASE = 10000.0  # llama.cpp hard-codes this for Gemma3's sliding layers


def gguf_tensor_name(name: str, layer: int | None) -> str:
    return _GLOBAL_TENSORS[name] if layer is None else f"blk.{layer}.{_LAYER_TENSORS[name]}"


# ---------------------------------------------------------------------------------------------
# Reading
# ---------------------------------------------------------------------------------------------


def _plain_get(self, offset, dtype, count=1, override_order=None):
    """GGUFReader._get over a plain ndarray view of the file instead of np.memmap slices.

    Every metadata item (262k vocabulary strings for Gemma) becomes several views, and memmap's
    Python-level __array_finalize__ makes parsing ~4x slower. Same bytes, same mapping, same
    result; only the view class differs.
    """
    plain = self.__dict__.get("_plain_bytes")
    if plain is None:
        plain = self.__dict__["_plain_bytes"] = self.data.view(np.ndarray)
    count = int(count)
    end = offset + np.dtype(dtype).itemsize * count
    arr = plain[offset:end].view(dtype=dtype)[:count]
    return arr.view(arr.dtype.newbyteorder(self.byte_order if override_order is None else override_order))


def _reader_class():
    import gguf

    return type("FastGGUFReader", (gguf.GGUFReader,), {"_get": _plain_get})


@contextlib.contextmanager
def fast_gguf_parsing():
    """Temporarily give every gguf.GGUFReader the fast `_get` (transformers' GGUF tokenizer and
    model loaders construct their own readers). Not thread-safe; results are unchanged."""
    import gguf

    original = gguf.GGUFReader._get
    gguf.GGUFReader._get = _plain_get
    try:
        yield
    finally:
        gguf.GGUFReader._get = original


def open_gguf(path: str | os.PathLike):
    """A GGUF reader, with parser failures turned into errors that name the file."""
    path = Path(path)
    if not path.is_file():
        raise CheckpointNotFoundError(f"{path}: GGUF file not found")
    try:
        return _reader_class()(str(path))
    except (ValueError, IndexError, KeyError, OverflowError, OSError) as e:
        if "GGMLQuantizationType" in str(e):
            raise UnsupportedQuantizationError(f"{path}: tensor of an unknown quantization type ({e})") from e
        raise CorruptCheckpointError(f"{path}: not a readable GGUF file ({type(e).__name__}: {e}); truncated or corrupt?") from e


class GGUFMetadata:
    """Typed access to a reader's key/value fields."""

    def __init__(self, reader, path: Path):
        self.reader = reader
        self.path = path

    def has(self, key: str) -> bool:
        return key in self.reader.fields

    def get(self, key: str, default: Any = None) -> Any:
        field = self.reader.fields.get(key)
        if field is None:
            return default
        try:
            return field.contents()
        except Exception as e:  # noqa: BLE001 - a malformed field is a corrupt file
            raise CorruptCheckpointError(f"{self.path}: metadata {key!r} is unreadable ({e})") from e

    def require(self, key: str) -> Any:
        value = self.get(key)
        if value is None:
            raise CorruptCheckpointError(f"{self.path}: required metadata {key!r} is missing")
        return value


def dequantize_tensor(tensor, path: Path) -> np.ndarray:
    """float32 array in numpy (PyTorch) orientation, i.e. ggml's ne reversed."""
    from gguf import quants

    shape = tuple(int(n) for n in reversed(tensor.shape))
    try:
        values = quants.dequantize(np.asarray(tensor.data), tensor.tensor_type)
        return np.asarray(values, np.float32).reshape(shape)
    except NotImplementedError as e:
        raise UnsupportedQuantizationError(
            f"{path}: tensor {tensor.name!r} uses quantization {tensor.tensor_type.name}, which cannot be "
            f"dequantized; supported: {', '.join(supported_quantizations())}"
        ) from e
    except ValueError as e:
        raise CorruptCheckpointError(f"{path}: tensor {tensor.name!r} has inconsistent data ({e}); truncated?") from e


def supported_quantizations() -> list[str]:
    """Names of the tensor types gguf.quants.dequantize handles (for error messages)."""
    from gguf import GGMLQuantizationType, quants

    traits = getattr(quants, "_type_traits", {})  # private in gguf; only used to list names
    return sorted({"F32", "F16", *(GGMLQuantizationType(t).name for t in traits)})


def unpermute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    """Invert llama.cpp's Q/K row permutation (interleaved rope pairs -> rotate-half halves)."""
    hd = w.shape[0] // n_head
    return w.reshape(n_head, hd // 2, 2, -1).swapaxes(1, 2).reshape(w.shape)


# ---------------------------------------------------------------------------------------------
# Config
# ---------------------------------------------------------------------------------------------


def _token_ids(meta: GGUFMetadata, arch: str) -> dict[str, Any]:
    bos = meta.get("tokenizer.ggml.bos_token_id")
    eos = [meta.get(k) for k in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id")]
    eos = [int(t) for t in eos if t is not None]
    template = meta.get("tokenizer.chat_template") or ""
    markers = [m for m in END_OF_TURN_MARKERS if m in template]
    if arch == "gemma3":
        # Every Gemma3 checkpoint's generation_config stops on <end_of_turn> as well as <eos>.
        markers.append("<end_of_turn>")
    if markers and meta.has("tokenizer.ggml.tokens"):
        vocab = meta.get("tokenizer.ggml.tokens")
        index = {tok: i for i, tok in enumerate(vocab) if tok in markers}
        eos += [index[m] for m in markers if m in index]
    return dict(
        bos_token_id=None if bos is None else int(bos),
        eos_token_ids=tuple(dict.fromkeys(eos)),
        pad_token_id=int(meta.get("tokenizer.ggml.padding_token_id", 0)),
    )


def _rope_scaling(meta: GGUFMetadata, prefix: str) -> tuple | None:
    kind = meta.get(f"{prefix}.rope.scaling.type")
    if kind in (None, "none"):
        return None
    if kind == "linear":
        return ("linear", float(meta.require(f"{prefix}.rope.scaling.factor")))
    raise UnknownArchitectureError(f"{meta.path}: rope scaling type {kind!r} is not supported (linear, llama3)")


def _llama3_scaling_from_rope_freqs(cfg: ModelConfig, divisors: np.ndarray, meta: GGUFMetadata, prefix: str) -> tuple:
    """The llama3 rope-scaling tuple that reproduces llama.cpp's stored per-frequency divisors."""
    base = rope_inv_freq(cfg.replace(rope_scaling=None), cfg.rope_theta)
    target = base / divisors.astype(np.float64)
    factor = float(divisors.max())
    orig_candidates = [meta.get(f"{prefix}.rope.scaling.original_context_length"), 8192]
    for orig in [int(o) for o in orig_candidates if o]:
        candidate = ("llama3", factor, 1.0, 4.0, orig)
        got = rope_inv_freq(cfg.replace(rope_scaling=candidate), cfg.rope_theta)
        if np.allclose(got, target, rtol=1e-5, atol=0):
            return candidate
    raise UnknownArchitectureError(
        f"{meta.path}: rope_freqs.weight does not match llama3 rope scaling with factor {factor}; unsupported rope scaling"
    )


def _sliding_layers(meta: GGUFMetadata, prefix: str, n_layers: int) -> tuple[bool, ...]:
    pattern = meta.get(f"{prefix}.attention.sliding_window_pattern")
    if isinstance(pattern, list):  # newer converters write one flag per layer (True = local)
        if len(pattern) != n_layers:
            raise CorruptCheckpointError(f"{meta.path}: sliding_window_pattern has {len(pattern)} entries, expected {n_layers}")
        return tuple(bool(p) for p in pattern)
    # llama.cpp: with period n, the last layer of every n is global; n = 0 means all local.
    every = GEMMA3_SLIDING_PATTERN if pattern is None else int(pattern)
    if every == 0:
        return (True,) * n_layers
    return tuple((i + 1) % every != 0 for i in range(n_layers))


def config_from_gguf(reader, path: Path) -> ModelConfig:
    meta = GGUFMetadata(reader, path)
    gguf_arch = meta.require("general.architecture")
    arch = GGUF_ARCHITECTURES.get(gguf_arch)
    if arch is None:
        raise UnknownArchitectureError(
            f"{path}: unknown GGUF architecture {gguf_arch!r}; supported: {', '.join(GGUF_ARCHITECTURES)}"
        )
    p = gguf_arch
    tensors = {t.name: t for t in reader.tensors}
    if _GLOBAL_TENSORS["embed"] not in tensors:
        raise MissingTensorError(f"{path}: tensor 'token_embd.weight' is missing")
    vocab_size, hidden = (int(n) for n in reversed(tensors[_GLOBAL_TENSORS["embed"]].shape))
    n_heads = int(meta.require(f"{p}.attention.head_count"))
    n_kv = meta.get(f"{p}.attention.head_count_kv", n_heads)
    if isinstance(n_kv, list):
        raise UnknownArchitectureError(f"{path}: per-layer head_count_kv is not supported")
    head_dim = int(meta.get(f"{p}.attention.key_length") or hidden // n_heads)
    rope_dims = meta.get(f"{p}.rope.dimension_count")
    if rope_dims is not None and int(rope_dims) != head_dim:
        raise UnknownArchitectureError(f"{path}: partial rotary embedding ({rope_dims} of {head_dim} dims) is not supported")
    n_layers = int(meta.require(f"{p}.block_count"))
    rope_theta = float(meta.get(f"{p}.rope.freq_base", 10000.0))
    kw: dict[str, Any] = dict(
        arch=arch,
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=int(meta.require(f"{p}.feed_forward_length")),
        num_layers=n_layers,
        num_heads=n_heads,
        num_kv_heads=int(n_kv),
        head_dim=head_dim,
        rms_norm_eps=float(meta.get(f"{p}.attention.layer_norm_rms_epsilon", 1e-5)),
        rope_theta=rope_theta,
        rope_scaling=_rope_scaling(meta, p),
        max_position_embeddings=int(meta.get(f"{p}.context_length", 8192)),
        tie_word_embeddings=_GLOBAL_TENSORS["lm_head"] not in tensors,
        attention_bias="blk.0.attn_q.bias" in tensors,
        qk_norm="blk.0.attn_q_norm.weight" in tensors,
        **_token_ids(meta, arch),
    )
    window = meta.get(f"{p}.attention.sliding_window")
    if arch == "llama" and window:
        kw.update(arch="mistral", sliding_window=int(window), sliding_layers=(True,) * n_layers, rope_local_theta=rope_theta)
    if arch == "gemma3":
        # llama.cpp scales Gemma3-27B queries by (hidden / heads) instead of head_dim.
        scalar = hidden // n_heads if n_layers == 62 else head_dim
        kw.update(
            mlp_activation="gelu_tanh",
            embed_scale=float(hidden) ** 0.5,
            sandwich_norm=True,
            qk_norm=True,
            query_pre_attn_scalar=float(scalar),
            sliding_window=int(window or 512),
            sliding_layers=_sliding_layers(meta, p, n_layers),
            rope_local_theta=float(meta.get(f"{p}.rope.freq_base_swa", GEMMA3_LOCAL_ROPE_BASE)),
            final_logit_softcap=meta.get(f"{p}.final_logit_softcapping"),
            attn_logit_softcap=None,
        )
    try:
        cfg = ModelConfig(**kw)
    except UnsupportedModelError as e:
        raise UnknownArchitectureError(f"{path}: {e}") from e
    if "rope_freqs.weight" in tensors:
        divisors = dequantize_tensor(tensors["rope_freqs.weight"], path)
        cfg = cfg.replace(rope_scaling=_llama3_scaling_from_rope_freqs(cfg, divisors, meta, p))
    return cfg


# ---------------------------------------------------------------------------------------------
# Loading
# ---------------------------------------------------------------------------------------------


def load_gguf(path: str | os.PathLike, dtype=jnp.float32) -> tuple[ModelConfig, dict]:
    """(config, params) from a GGUF file; every quantized tensor is dequantized to `dtype`. The
    parameters are placed one layer of one leaf at a time (streaming.place_params): the host holds
    one dequantized tensor, not a float32 copy of the model beside the placed one (Qwen2.5-1.5B
    in float32 on a CPU: 15 GB at the peak before, the model's 6 GB and a block after)."""
    path = Path(path)
    reader = open_gguf(path)
    cfg = config_from_gguf(reader, path)
    tensors = {t.name: t for t in reader.tensors}
    _reject_output_bias(tensors, path)
    needed = [gguf_tensor_name(n, None) for n in global_tensor_names(cfg)]
    needed += [gguf_tensor_name(n, layer) for layer in range(cfg.num_layers) for n in layer_tensor_names(cfg)]
    missing = [n for n in needed if n not in tensors]
    if missing:  # before anything is dequantized or placed
        raise MissingTensorError(f"{path}: tensor {missing[0]!r} is missing (needed for {cfg.arch}; "
                                 f"{len(missing)} of {len(needed)} missing)")

    def fetch(name: str, layer: int | None, shape: tuple) -> np.ndarray:
        gname = gguf_tensor_name(name, layer)  # present: checked above
        w = dequantize_tensor(tensors[gname], path)
        if cfg.arch in ("llama", "mistral") and name in ("q_proj", "q_bias"):
            w = unpermute_qk(w, cfg.num_heads)
        elif cfg.arch in ("llama", "mistral") and name in ("k_proj", "k_bias"):
            w = unpermute_qk(w, cfg.num_kv_heads)
        return check_shape(w, shape, gname, str(path))

    last: dict = {}  # the tensor being read: a global one is read in row chunks, dequantized once

    def rows(name: str, layer: int | None, start: int, out: np.ndarray) -> None:
        if (name, layer) not in last:
            last.clear()
            last[name, layer] = fetch(name, layer, expected_shape(cfg, name))
        whole = last[name, layer]
        out[...] = whole[start : start + len(out)]
        if start + len(out) >= len(whole):  # read to its end: not held beside the next block
            last.clear()

    return cfg, place_params(cfg, rows, dtype)


def _reject_output_bias(tensors: dict, path: Path) -> None:
    if any(name.endswith("attn_output.bias") for name in tensors):
        raise UnknownArchitectureError(f"{path}: attention output bias (attn_output.bias) is not supported")


def gguf_chat_template(path: str | os.PathLike) -> str | None:
    return GGUFMetadata(open_gguf(path), Path(path)).get("tokenizer.chat_template")


__all__ = ["config_from_gguf", "dequantize_tensor", "fast_gguf_parsing", "load_gguf", "open_gguf", "unpermute_qk"]
