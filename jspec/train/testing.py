"""Helpers for fast CPU tests of heads and training: tiny configs and compile-free random params.

On CPU, `jax.random` initialisers compile one threefry kernel per shape, which costs seconds per
model; tests only need *some* well-scaled parameters, so these fill the init functions' shapes
from numpy instead.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from ..config import ModelConfig
from .shards import RowWriter


def tiny_target_config(**overrides) -> ModelConfig:
    """Hidden 64, 2 layers, vocab 128: small enough for a 2-core CI machine."""
    base = dict(
        arch="llama", vocab_size=128, hidden_size=64, intermediate_size=128, num_layers=2,
        num_heads=4, num_kv_heads=2, head_dim=16, rms_norm_eps=1e-6, pad_token_id=0,
        eos_token_ids=(1,),
    )
    return ModelConfig(**{**base, **overrides})


def numpy_params(init_fn, *args, seed: int = 0, scale: float = 0.02, **kwargs) -> dict:
    """Parameters with the structure of `init_fn(*args, key, **kwargs)`, filled from numpy:
    norms are ones, other floats N(0, scale²); d2t / t2d are the identity draft vocabulary."""
    shapes = jax.eval_shape(lambda k: init_fn(*args, k, **kwargs), jax.random.PRNGKey(0))
    rng = np.random.default_rng(seed)

    def fill(path, s):
        name = jax.tree_util.keystr(path)
        if "d2t" in name:
            return jnp.arange(s.shape[0], dtype=s.dtype)
        if "norm" in name:
            return jnp.ones(s.shape, s.dtype)
        return jnp.asarray(rng.normal(0.0, scale, s.shape), s.dtype)

    params = jax.tree_util.tree_map_with_path(fill, {k: v for k, v in shapes.items() if k != "t2d"})
    if "t2d" in shapes:
        params["t2d"] = jnp.zeros(shapes["t2d"].shape, bool).at[params["d2t"]].set(True)
    return params


def write_patterned_shards(directory: str, vocab_size: int, *, rows: int = 40, low: int = 2,
                           lengths: tuple[int, int] = (6, 20), temperature: float = 0.0) -> str:
    """Distilled shards (jspec-distill-v2) a drafter can learn fast: 4-token random prompts and
    responses following x <- 3x + c (mod the vocabulary, tokens >= `low`), EOS (1) last; 8 rows a
    shard, every 4th row held out, each row marked as answered at `temperature` (0 = greedy).
    Returns `directory`."""
    w = RowWriter(directory, vocab_size=vocab_size, pad_id=0, eos_token_ids=(1,), sources=["t"], rows_per_shard=8,
                  holdout_every=4)
    rng = np.random.default_rng(0)
    for i in range(rows):
        x, c, resp = int(rng.integers(low, 100)), int(rng.integers(1, 7)), []
        for _ in range(int(rng.integers(*lengths))):
            x = (3 * x + c) % (vocab_size - low) + low
            resp.append(x)
        w.add(rng.integers(low, 128, 4), np.asarray(resp + [1]), item=i, source=0, temperature=temperature, ended=True)
    w.flush()
    return directory
