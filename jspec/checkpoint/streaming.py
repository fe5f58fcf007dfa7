"""jspec parameters built in place on their device(s), one layer of one leaf at a time.

`build_params` (layout.py) holds a float32 copy of the whole model on the host before anything
reaches a device: 32 GB for an 8B model. `place_params` never holds more than one block: it
allocates each leaf where it will live (one device, or sharded over a mesh by `sharding.PARAM_AXES`),
then for each layer stacks that layer's tensors of the leaf on the host in the target dtype
(reading the checkpoint's rows, converting on the fly), sends them to their device(s), transposes them
there and writes them into the leaf with a donated, in-place update. Global tensors (embedding,
LM head) are assembled in row chunks into one host block of their own size. Peak host memory is
therefore the runtime plus the largest block (the embedding: 1 GB at Llama-3.1-8B's shape), not
the model; on a CPU host the placed parameters themselves are host memory too.

A checkpoint is described by `rows(name, layer, start, out)`, which writes rows [start, start +
len(out)) of a logical tensor (layout.py's names; PyTorch orientation, family quirks undone) into
`out`, converting to its dtype: a reader whose stored dtype matches reads straight into the block.
"""

from __future__ import annotations

import functools
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P, SingleDeviceSharding

from ..config import ModelConfig
from ..sharding import PARAM_AXES, named
from .layout import (
    expected_shape,
    fill_layer_leaf,
    fused_layer_leaves,
    global_tensor_names,
    layer_leaf_rows,
    layer_leaf_shape,
)

Rows = Callable[[str, "int | None", int, np.ndarray], None]

# Rows of a global tensor read at once (when its stored dtype needs converting, the read buffer).
CHUNK_BYTES = 64 << 20


def _placement(shape: tuple, leaf: str, mesh: Mesh | None, device) -> tuple:
    """Shardings of (the whole leaf, one layer's slice of it); None for JAX's default placement:
    uncommitted arrays on the default device, which a later jit or device_put may move, as arrays
    made by jnp.asarray would be."""
    if mesh is None:
        one = None if device is None else SingleDeviceSharding(device)
        return one, one
    whole = named(shape, PARAM_AXES[leaf], mesh)
    return whole, NamedSharding(mesh, P(*_padded_spec(whole, len(shape))[1:]))


def _padded_spec(sharding: NamedSharding, ndim: int) -> tuple:
    spec = tuple(sharding.spec)
    return spec + (None,) * (ndim - len(spec))


def _as_stored(sharding, ndim: int):
    """The sharding of the transposed array (PyTorch orientation): the same devices, axes reversed."""
    if not isinstance(sharding, NamedSharding):
        return sharding
    return NamedSharding(sharding.mesh, P(*_padded_spec(sharding, ndim)[::-1]))


def _jit(fn, sharding, **kw):
    return jax.jit(fn, **kw) if sharding is None else jax.jit(fn, out_shardings=sharding, **kw)


@functools.lru_cache(maxsize=None)
def _empty_fn(shape: tuple, dtype: np.dtype, sharding):
    return _jit(lambda: jnp.zeros(shape, dtype), sharding)


@functools.lru_cache(maxsize=None)
def _transpose_fn(sharding):
    # The rows arrive in PyTorch orientation and are transposed on the device: a strided transpose
    # on the host runs at a few hundred MB/s, and XLA's CPU backend is 2.5x slower when the
    # transpose is fused into the update below than when it runs on its own.
    return _jit(lambda rows: rows.T, sharding)


@functools.lru_cache(maxsize=None)
def _set_layer_fn(sharding):
    # Donating the leaf makes the update in place: the device never holds two copies of a leaf.
    return _jit(lambda full, layer, l: jax.lax.dynamic_update_index_in_dim(full, layer, l, 0), sharding,
                donate_argnums=0)


def _global_rows(cfg: ModelConfig, name: str, rows: Rows, dtype: np.dtype) -> np.ndarray:
    """A global tensor in PyTorch orientation and `dtype`, read in row chunks."""
    shape = expected_shape(cfg, name)
    block = np.empty(shape, dtype)
    row_bytes = int(np.prod(shape[1:], dtype=np.int64)) * 4
    step = max(1, CHUNK_BYTES // max(1, row_bytes))
    for start in range(0, shape[0], step):
        stop = min(shape[0], start + step)
        rows(name, None, start, block[start:stop])
    return block


def place_params(cfg: ModelConfig, rows: Rows, dtype=jnp.float32, *, mesh: Mesh | None = None, device=None) -> dict:
    """The jspec parameter tree (model.py's layout) of `dtype`, read through `rows` one block at a
    time: committed to `device`, or sharded over `mesh` by sharding.PARAM_AXES, or (neither) on
    JAX's default device, uncommitted."""
    dtype = np.dtype(dtype)
    params: dict = {}
    for name in global_tensor_names(cfg):
        block = _global_rows(cfg, name, rows, dtype)
        if name == "lm_head":  # [V, D] stored, [D, V] kept: placed as stored, transposed on the device
            whole, _ = _placement(block.shape[::-1], name, mesh, device)
            params[name] = _transpose_fn(whole)(jax.device_put(block, _as_stored(whole, 2)))
        else:
            params[name] = jax.device_put(block, _placement(block.shape, name, mesh, device)[0])
        params[name].block_until_ready()
        del block
    L = cfg.num_layers
    layers = {}
    for leaf in fused_layer_leaves(cfg):
        shape = (L, *layer_leaf_shape(cfg, leaf))
        whole, layer = _placement(shape, leaf, mesh, device)
        as_stored = _as_stored(layer, len(shape) - 1)
        full = _empty_fn(shape, dtype, whole)()
        set_layer, transpose = _set_layer_fn(whole), _transpose_fn(layer)
        for l in range(L):
            block = np.empty(layer_leaf_rows(cfg, leaf), dtype)
            fill_layer_leaf(block, cfg, leaf, lambda name, out, l=l: rows(name, l, 0, out))
            full = set_layer(full, transpose(jax.device_put(block, as_stored)), np.int32(l))
            # Waiting here frees this block before the next is built: host memory holds one block at a time.
            full.block_until_ready()
        layers[leaf] = full
    params["layers"] = layers
    return params


__all__ = ["CHUNK_BYTES", "place_params"]
