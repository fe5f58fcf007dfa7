"""H-RAD: SpecBranch's classifier of how many draft tokens the target will accept next.

Shen et al., *SpecBranch*, ICLR 2026, arXiv 2506.01979; network from the authors' code
(`Sylvan820/Specbranch`, `src/gamma_predictor.py`): an MLP over the concatenation of the target's
last-4-layer hidden states at the position before a token and that token's embedding,
`Linear(4D + D → 256) → ReLU → Dropout(0.2) → Linear(256 → 64) → ReLU → Dropout → Linear(64 → 3)`.
Classes: the accepted length of the draft that follows, {0, 1–6, ≥ 7}.

The four feature layers [I: the code concatenates four layer outputs without naming them]: the
inputs of layers L−3, L−2, L−1 (= outputs of L−4 .. L−2) and the final-normed output, what
`model.forward(capture=feature_layers(cfg))` returns beside `hidden`.

The first layer is split as `W1 = [W_f; W_e]` so the target's device can apply `W_f` to its
features before it knows which token was chosen (`pre_features`), and the rest runs once the token
is known (`classify`): same function, no feature tensor crosses devices.

Pure functions over dicts; files: `save_hrad` / `load_hrad` (safetensors + json).
"""

from __future__ import annotations

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
from safetensors.numpy import load_file

from ..checkpoint.files import save_safetensors
from ..config import ModelConfig

NUM_CLASSES = 3
CLASS_EDGES = (1, 7)  # accepted length 0 -> class 0, 1..6 -> 1, >= 7 -> 2
WEIGHTS_FILE = "hrad.safetensors"
CONFIG_FILE = "hrad.json"


def feature_layers(cfg: ModelConfig) -> tuple[int, ...]:
    """Layers whose inputs are three of the four features (the fourth is the final hidden state)."""
    L = cfg.num_layers
    return tuple(i for i in (L - 3, L - 2, L - 1) if i >= 0)


def feature_size(cfg: ModelConfig) -> int:
    return (len(feature_layers(cfg)) + 1) * cfg.hidden_size


def target_features(captured: tuple, hidden: jax.Array) -> jax.Array:
    """[..., 4 D] from a forward's `captured` (feature_layers) and `hidden`."""
    return jnp.concatenate([*captured, hidden], axis=-1)


def label_of(accepted_length):
    """Class of an accepted length (array or int)."""
    return (accepted_length >= CLASS_EDGES[0]).astype(jnp.int32) + (accepted_length >= CLASS_EDGES[1]).astype(jnp.int32)


def init_hrad(key, cfg: ModelConfig, hidden=(256, 64), dtype=jnp.float32) -> dict:
    F, D = feature_size(cfg), cfg.hidden_size
    k = jax.random.split(key, 4)

    def dense(key, n_in, n_out):  # PyTorch's default Linear init (uniform ±1/sqrt(n_in))
        lim = 1.0 / np.sqrt(n_in)
        return jax.random.uniform(key, (n_in, n_out), dtype, -lim, lim)

    h1, h2 = hidden
    w1 = dense(k[0], F + D, h1)
    return {"w_f": w1[:F], "w_e": w1[F:], "b1": jnp.zeros((h1,), dtype), "w2": dense(k[1], h1, h2),
            "b2": jnp.zeros((h2,), dtype), "w3": dense(k[2], h2, NUM_CLASSES), "b3": jnp.zeros((NUM_CLASSES,), dtype)}


def pre_features(hp: dict, features: jax.Array) -> jax.Array:
    """The target-side part of the first layer: features [..., 4D] -> [..., 256]."""
    return jnp.dot(features.astype(jnp.float32), hp["w_f"].astype(jnp.float32)) + hp["b1"]


def classify(hp: dict, pre: jax.Array, token_embedding: jax.Array, *, dropout_key=None, rate: float = 0.2) -> jax.Array:
    """Class logits [..., 3] from `pre_features` and the chosen token's embedding [..., D]."""
    h = pre + jnp.dot(token_embedding.astype(jnp.float32), hp["w_e"].astype(jnp.float32))
    h = _dropout(jax.nn.relu(h), dropout_key, 0, rate)
    h = _dropout(jax.nn.relu(h @ hp["w2"] + hp["b2"]), dropout_key, 1, rate)
    return h @ hp["w3"] + hp["b3"]


def _dropout(x, key, i, rate):
    if key is None:
        return x
    keep = jax.random.bernoulli(jax.random.fold_in(key, i), 1.0 - rate, x.shape)
    return jnp.where(keep, x / (1.0 - rate), 0.0)


def save_hrad(path: str, hp: dict, cfg: ModelConfig, meta: dict | None = None) -> None:
    os.makedirs(path, exist_ok=True)
    save_safetensors({k: np.asarray(v, np.float32) for k, v in hp.items()}, os.path.join(path, WEIGHTS_FILE))
    with open(os.path.join(path, CONFIG_FILE), "w") as fh:
        json.dump({"hidden_size": cfg.hidden_size, "num_layers": cfg.num_layers, "vocab_size": cfg.vocab_size,
                   "feature_layers": list(feature_layers(cfg)), **(meta or {})}, fh, indent=1)


def load_hrad(path: str, cfg: ModelConfig) -> dict:
    with open(os.path.join(path, CONFIG_FILE)) as fh:
        meta = json.load(fh)
    have = {"hidden_size": cfg.hidden_size, "num_layers": cfg.num_layers, "vocab_size": cfg.vocab_size}
    bad = {k: (meta.get(k), v) for k, v in have.items() if meta.get(k) != v}
    if bad:
        raise ValueError(f"{path}: H-RAD trained for another target ({', '.join(f'{k} {a} != {b}' for k, (a, b) in bad.items())})")
    return {k: jnp.asarray(v) for k, v in load_file(os.path.join(path, WEIGHTS_FILE)).items()}
