"""Logical-axis sharding: name each array dimension, map names onto a `Mesh`, place with NamedSharding.

jspec code never mentions mesh axes directly. Every parameter, cache and activation dimension has
a logical name ("vocab", "heads", "batch", ...) and `RULES` maps logical names to mesh axes
("data", "model"; training adds "fsdp"). A dimension whose size does not divide the mesh axis is
replicated instead of failing, so one rule set serves any model on any mesh, from 1 GPU to a pod.

Jitted functions need no sharding annotations: GSPMD propagates the input shardings, so the same
`generate` runs on one device or on a mesh and gives the same tokens.
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

# logical dimension name -> mesh axis (or None: replicated)
RULES: dict[str, str | tuple[str, ...] | None] = {
    "batch": "data",
    "vocab": "model",
    "qkv": "model",  # fused q|k|v output features
    "heads_flat": "model",  # attention output features (input of wo)
    "mlp": "model",  # fused gate|up features, input of w_down
    "kv_heads": "model",
    "embed": None,
    "layers": None,
    "seq": None,
    "head_dim": None,
    "draft": None,
}

# logical axes of each parameter leaf (by name; per-layer leaves carry the leading "layers" axis)
PARAM_AXES: dict[str, tuple[str, ...]] = {
    "embed": ("vocab", "embed"),
    "lm_head": ("embed", "vocab"),
    "final_norm": ("embed",),
    "attn_norm": ("layers", "embed"),
    "wqkv": ("layers", "embed", "qkv"),
    "bqkv": ("layers", "qkv"),
    "q_norm": ("layers", "head_dim"),
    "k_norm": ("layers", "head_dim"),
    "wo": ("layers", "heads_flat", "embed"),
    "post_attn_norm": ("layers", "embed"),
    "mlp_norm": ("layers", "embed"),
    "w_gate_up": ("layers", "embed", "mlp"),
    "w_down": ("layers", "mlp", "embed"),
    "post_mlp_norm": ("layers", "embed"),
}

CACHE_AXES = ("layers", "batch", "seq", "kv_heads", "head_dim")


def make_mesh(data: int | None = None, model: int = 1, devices=None) -> Mesh:
    """A (data, model) mesh over the given (default: all) devices; data defaults to the rest."""
    devices = list(jax.devices() if devices is None else devices)
    if data is None:
        data = len(devices) // model
    if data * model != len(devices):
        raise ValueError(f"mesh data={data} x model={model} needs {data * model} devices, have {len(devices)}")
    return Mesh(np.asarray(devices).reshape(data, model), ("data", "model"))


MESH_AXES = ("data", "model")


def parse_mesh(mesh: "Mesh | str | None", devices=None) -> Mesh | None:
    """A generation mesh from what a caller passed: None (one device), a Mesh with axes named
    "data" and/or "model", or a spec string "data=2", "model=2", "data=2,model=2" that takes the
    first data x model devices. Raises ValueError naming the problem.

    One axis at a time may have more than one device: each data shard's while_loop runs its own
    number of rounds, so tensor-parallel collectives inside it could not pair up across shards."""
    if mesh is None:
        return None
    if isinstance(mesh, Mesh):
        if not set(mesh.axis_names) <= set(MESH_AXES):
            raise ValueError(f"mesh axes {mesh.axis_names} not supported for generation; use 'data' and/or 'model'")
        return _one_axis(mesh)
    sizes = {"data": 1, "model": 1}
    for part in str(mesh).replace(" ", "").split(","):
        name, eq, value = part.partition("=")
        if name not in sizes or not eq or not value.isdigit() or int(value) < 1:
            raise ValueError(f"mesh spec {mesh!r}: expected comma-separated data=N and/or model=N with N >= 1")
        sizes[name] = int(value)
    devices = list(jax.devices() if devices is None else devices)
    need = sizes["data"] * sizes["model"]
    if need > len(devices):
        raise ValueError(f"mesh {mesh!r} needs {need} devices, have {len(devices)}")
    return _one_axis(make_mesh(sizes["data"], sizes["model"], devices[:need]))


def _one_axis(mesh: Mesh) -> Mesh:
    if axis_size(mesh, "data") > 1 and axis_size(mesh, "model") > 1:
        raise ValueError(f"mesh {mesh_label(mesh)}: generation shards over data or over model, not both; "
                         "use data=N or model=N")
    return mesh


def axis_size(mesh: Mesh | None, name: str) -> int:
    return 1 if mesh is None or name not in mesh.axis_names else int(mesh.shape[name])


def mesh_label(mesh: Mesh | None) -> str:
    """"data=2,model=1"-style label for result rows ("" for no mesh: one device)."""
    return "" if mesh is None else ",".join(f"{a}={axis_size(mesh, a)}" for a in MESH_AXES)


def replicate(tree: Any, mesh: Mesh) -> Any:
    """Every leaf on every device of the mesh (drafter heads, policy weights)."""
    return jax.device_put(tree, NamedSharding(mesh, P()))


def spec_for(shape: tuple[int, ...], axes: tuple[str | None, ...], mesh: Mesh, rules=RULES) -> P:
    """PartitionSpec for an array with logical `axes`; non-dividing or reused mesh axes replicate."""
    used: set[str] = set()
    out = []
    for size, name in zip(shape, axes):
        mesh_axis = rules.get(name) if name else None
        names = (mesh_axis,) if isinstance(mesh_axis, str) else tuple(mesh_axis or ())
        n = int(np.prod([mesh.shape[a] for a in names])) if names else 1
        if names and not used.intersection(names) and size % n == 0 and n > 1:
            out.append(names[0] if len(names) == 1 else names)
            used.update(names)
        else:
            out.append(None)
    return P(*out)


def named(shape, axes, mesh: Mesh, rules=RULES) -> NamedSharding:
    return NamedSharding(mesh, spec_for(tuple(shape), tuple(axes), mesh, rules))


def param_shardings(params: dict, mesh: Mesh, rules=RULES) -> dict:
    """NamedSharding for every leaf of a jspec parameter tree (unknown leaves are replicated)."""

    def leaf(path, x):
        name = str(getattr(path[-1], "key", path[-1]))
        axes = PARAM_AXES.get(name, (None,) * x.ndim)
        if len(axes) != x.ndim:
            axes = (None,) * x.ndim
        return named(x.shape, axes, mesh, rules)

    return jax.tree_util.tree_map_with_path(leaf, params)


def shard_params(params: dict, mesh: Mesh, rules=RULES) -> dict:
    return jax.device_put(params, param_shardings(params, mesh, rules))


def shard_cache(cache: Any, mesh: Mesh, rules=RULES) -> Any:
    """Place a KVCache: rows over data, kv heads over model (when they divide)."""
    return cache.replace(
        k=jax.device_put(cache.k, named(cache.k.shape, CACHE_AXES, mesh, rules)),
        v=jax.device_put(cache.v, named(cache.v.shape, CACHE_AXES, mesh, rules)),
        lengths=jax.device_put(cache.lengths, named(cache.lengths.shape, ("batch",), mesh, rules)),
    )


def verify_shardings(mesh: Mesh, batch: int, k: int, vocab: int):
    """In-shardings for chain verification inputs: logits [B, K+1, V] over (data, -, model)."""
    logits = named((batch, k + 1, vocab), ("batch", None, "vocab"), mesh)
    rows = named((batch, k), ("batch", None), mesh)
    return logits, rows
