"""Conversion between per-tensor checkpoints and jspec's fused, layer-stacked parameter layout.

Loaders describe a checkpoint as a `fetch(name, layer, shape)` callback returning one float32
numpy tensor in PyTorch orientation ([out, in] for projections), with family quirks (Gemma's
`1 + w` norms, llama.cpp's Q/K row permutation) already undone. `build_params` fuses and stacks
those into the layout documented in `jspec/model.py`; `split_params` is its exact inverse and
feeds the exporters.

Logical tensor names (per layer unless noted):
  embed, lm_head, final_norm                                   (global)
  q_proj, k_proj, v_proj, o_proj, q_bias, k_bias, v_bias, q_norm, k_norm
  gate_proj, up_proj, down_proj
  attn_norm, mlp_norm, post_attn_norm, post_mlp_norm
"""

from __future__ import annotations

from typing import Callable, Iterator

import jax.numpy as jnp
import numpy as np

from ..config import ModelConfig
from .errors import TensorShapeError

Fetch = Callable[[str, "int | None", tuple], np.ndarray]


def global_tensor_names(cfg: ModelConfig) -> list[str]:
    names = ["embed", "final_norm"]
    if not cfg.tie_word_embeddings:
        names.append("lm_head")
    return names


def layer_tensor_names(cfg: ModelConfig) -> list[str]:
    """The logical per-layer tensors this config needs, in a stable order."""
    names = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    names += ["attn_norm", "mlp_norm"]
    if cfg.attention_bias:
        names += ["q_bias", "k_bias", "v_bias"]
    if cfg.qk_norm:
        names += ["q_norm", "k_norm"]
    if cfg.sandwich_norm:
        names += ["post_attn_norm", "post_mlp_norm"]
    return names


def expected_shape(cfg: ModelConfig, name: str) -> tuple[int, ...]:
    """Shape of a logical tensor in PyTorch orientation."""
    D, F, V, hd = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size, cfg.head_dim
    shapes = {
        "embed": (V, D),
        "lm_head": (V, D),
        "final_norm": (D,),
        "q_proj": (cfg.q_size, D),
        "k_proj": (cfg.kv_size, D),
        "v_proj": (cfg.kv_size, D),
        "o_proj": (D, cfg.q_size),
        "q_bias": (cfg.q_size,),
        "k_bias": (cfg.kv_size,),
        "v_bias": (cfg.kv_size,),
        "q_norm": (hd,),
        "k_norm": (hd,),
        "gate_proj": (F, D),
        "up_proj": (F, D),
        "down_proj": (D, F),
        "attn_norm": (D,),
        "mlp_norm": (D,),
        "post_attn_norm": (D,),
        "post_mlp_norm": (D,),
    }
    return shapes[name]


def check_shape(array: np.ndarray, shape: tuple, tensor: str, source: str) -> np.ndarray:
    if tuple(array.shape) != tuple(shape):
        raise TensorShapeError(
            f"{source}: tensor {tensor!r} has shape {tuple(array.shape)}, but the config implies {tuple(shape)}"
        )
    return array


def fused_layer_leaves(cfg: ModelConfig) -> dict[str, list[tuple[str, int]]]:
    """Each per-layer leaf of the parameter tree as the logical tensors it is made of, with the
    offset of each along the leaf's last axis (projections enter transposed, [in, out])."""
    q, kv, F = cfg.q_size, cfg.kv_size, cfg.intermediate_size
    names = set(layer_tensor_names(cfg))
    leaves = {
        "attn_norm": [("attn_norm", 0)],
        "wqkv": [("q_proj", 0), ("k_proj", q), ("v_proj", q + kv)],
        "wo": [("o_proj", 0)],
        "mlp_norm": [("mlp_norm", 0)],
        "w_gate_up": [("gate_proj", 0), ("up_proj", F)],
        "w_down": [("down_proj", 0)],
    }
    if cfg.attention_bias:
        leaves["bqkv"] = [("q_bias", 0), ("k_bias", q), ("v_bias", q + kv)]
    for extra in ("q_norm", "k_norm", "post_attn_norm", "post_mlp_norm"):
        if extra in names:
            leaves[extra] = [(extra, 0)]
    return leaves


def layer_leaf_rows(cfg: ModelConfig, leaf: str) -> tuple[int, ...]:
    """Shape of one layer's slice of a per-layer leaf in PyTorch orientation: the leaf's tensors
    stacked along their first axis ([out, in] for projections, so the leaf is [L, in, out])."""
    parts = fused_layer_leaves(cfg)[leaf]
    last_name, last_offset = parts[-1]
    last = expected_shape(cfg, last_name)
    return (last_offset + last[0], *last[1:])


def layer_leaf_shape(cfg: ModelConfig, leaf: str) -> tuple[int, ...]:
    """Shape of one layer's slice of a per-layer leaf (the leaf is [L, *this]): projections are
    kept [in, out], since jspec multiplies x @ W."""
    return layer_leaf_rows(cfg, leaf)[::-1]


def fill_layer_leaf(rows: np.ndarray, cfg: ModelConfig, leaf: str, read: Callable[[str, np.ndarray], None]) -> None:
    """Stack one layer's tensors of a fused leaf into `rows` (C-contiguous, shape `layer_leaf_rows`):
    `read(name, out)` writes a logical tensor, in PyTorch orientation, into `out` (a contiguous
    row range of `rows`, in its dtype). Every copy is of whole rows: no strided transpose here."""
    for name, offset in fused_layer_leaves(cfg)[leaf]:
        read(name, rows[offset : offset + expected_shape(cfg, name)[0]])


def _stack_layers(cfg: ModelConfig, fetch: Fetch) -> dict[str, np.ndarray]:
    """Fill each fused [L, ...] array layer by layer (one float32 copy of the weights at a time)."""
    out = {}
    for leaf in fused_layer_leaves(cfg):
        out[leaf] = np.empty((cfg.num_layers, *layer_leaf_shape(cfg, leaf)), np.float32)
        rows = np.empty(layer_leaf_rows(cfg, leaf), np.float32)
        for l in range(cfg.num_layers):

            def read(name, into, l=l):
                into[...] = fetch(name, l, expected_shape(cfg, name))

            fill_layer_leaf(rows, cfg, leaf, read)
            out[leaf][l] = rows.T
    return out


def build_params(cfg: ModelConfig, fetch: Fetch, dtype=jnp.float32) -> dict:
    """jspec parameter pytree (jax arrays of `dtype`) from a per-tensor fetch callback."""
    layers = _stack_layers(cfg, fetch)
    params = {
        "embed": fetch("embed", None, expected_shape(cfg, "embed")),
        "final_norm": fetch("final_norm", None, expected_shape(cfg, "final_norm")),
        "layers": layers,
    }
    if not cfg.tie_word_embeddings:
        params["lm_head"] = fetch("lm_head", None, expected_shape(cfg, "lm_head")).T
    return to_jax(params, dtype)


def to_jax(tree: dict, dtype) -> dict:
    return {
        k: to_jax(v, dtype) if isinstance(v, dict) else jnp.asarray(np.asarray(v, np.float32), dtype=dtype)
        for k, v in tree.items()
    }


def split_params(cfg: ModelConfig, params: dict) -> Iterator[tuple[str, int | None, np.ndarray]]:
    """Inverse of build_params: yields (logical name, layer or None, tensor in PyTorch orientation).

    Tensors keep the parameters' dtype (float32 or bfloat16 via ml_dtypes) and are contiguous.
    """
    host = _to_numpy(params)
    q, kv = cfg.q_size, cfg.kv_size
    yield "embed", None, _c(host["embed"])
    yield "final_norm", None, _c(host["final_norm"])
    if not cfg.tie_word_embeddings:
        if "lm_head" not in host:
            raise TensorShapeError("parameters have no 'lm_head' but the config does not tie embeddings")
        yield "lm_head", None, _c(host["lm_head"].T)
    lay = host["layers"]
    F = lay["w_gate_up"].shape[-1] // 2
    for l in range(cfg.num_layers):
        wqkv = lay["wqkv"][l]
        yield "q_proj", l, _c(wqkv[:, :q].T)
        yield "k_proj", l, _c(wqkv[:, q : q + kv].T)
        yield "v_proj", l, _c(wqkv[:, q + kv :].T)
        yield "o_proj", l, _c(lay["wo"][l].T)
        yield "gate_proj", l, _c(lay["w_gate_up"][l, :, :F].T)
        yield "up_proj", l, _c(lay["w_gate_up"][l, :, F:].T)
        yield "down_proj", l, _c(lay["w_down"][l].T)
        if cfg.attention_bias:
            b = lay["bqkv"][l]
            yield "q_bias", l, _c(b[:q])
            yield "k_bias", l, _c(b[q : q + kv])
            yield "v_bias", l, _c(b[q + kv :])
        for norm in ("attn_norm", "mlp_norm", "q_norm", "k_norm", "post_attn_norm", "post_mlp_norm"):
            if norm in layer_tensor_names(cfg):
                yield norm, l, _c(lay[norm][l])


def _to_numpy(tree):
    if isinstance(tree, dict):
        return {k: _to_numpy(v) for k, v in tree.items()}
    return np.asarray(tree)


def _c(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(a)
