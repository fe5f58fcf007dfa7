"""Logical-axis sharding: name each array dimension, map names onto a `Mesh`, place with NamedSharding.

jspec code never mentions mesh axes directly. Every parameter, cache and activation dimension has
a logical name ("vocab", "heads", "batch", ...) and `RULES` maps logical names to mesh axes
("data", "model"; training adds "fsdp"). A dimension whose size does not divide the mesh axis is
replicated instead of failing, so one rule set serves any model on any mesh, from 1 GPU to a pod.

Jitted functions need no sharding annotations: GSPMD propagates the input shardings, so the same
jitted generation runs on one device or on weights placed by `shard_params` and gives the same
tokens (the portable path). `generate(mesh="model=N")` runs the tensor-parallel path below
instead: a per-head weight layout under shard_map, each device running the one-device program.
"""

from __future__ import annotations

import contextvars
import functools
import weakref
from typing import Any

import jax
import jax.numpy as jnp
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

    With both axes, each data shard's model group runs its own while_loop (its own number of
    rounds); the tensor-parallel collectives pair up only within a model group."""
    if mesh is None:
        return None
    if isinstance(mesh, Mesh):
        if not set(mesh.axis_names) <= set(MESH_AXES):
            raise ValueError(f"mesh axes {mesh.axis_names} not supported for generation; use 'data' and/or 'model'")
        return mesh
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
    return make_mesh(sizes["data"], sizes["model"], devices[:need])


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


# ---------------------------------------------------------------------------------------------
# Tensor parallelism: a per-head (Megatron) layout run under shard_map over the "model" axis
# ---------------------------------------------------------------------------------------------
#
# Device i of model=N holds q heads [i*Hq/N, (i+1)*Hq/N), the kv heads those q heads read (GQA
# groups never straddle devices), its slice of the gate and of the up projection, and the matching
# rows of wo and w_down. The fused products stay one product per layer: the columns of wqkv (and
# bqkv) and of w_gate_up are permuted once, at placement, so that device i's contiguous shard is
# [q_i | k_i | v_i] and [gate_i | up_i]. Each device then runs the one-device program (fused
# attention, the matvec kernel) on a per-device config with Hq/N and Hkv/N heads, and
# model.forward sums the row-parallel products (wo, w_down) with one psum each. The LM head is
# split over the vocabulary when that divides (its logits are all-gathered); the embedding and
# every norm are replicated. The KV cache is split on kv heads: each device allocates and updates
# a cache of its own kv heads only.

TP_AXIS = "model"
_IN_TENSOR_PARALLEL = contextvars.ContextVar("jspec_in_tensor_parallel", default=False)


def in_tensor_parallel() -> bool:
    """Whether the code being traced runs inside tensor_parallel_map's shard_map (where an untied
    LM head holds one device's slice of the vocabulary and the "model" axis is bound)."""
    return _IN_TENSOR_PARALLEL.get()


def check_tensor_parallel(cfg, n: int) -> None:
    """Raise a one-line ValueError unless model=n splits this model's heads and MLP evenly."""
    if n < 1 or cfg.num_kv_heads % n or cfg.num_heads % n or cfg.intermediate_size % n:
        raise ValueError(
            f"model={n} must divide num_kv_heads={cfg.num_kv_heads}, num_heads={cfg.num_heads} and "
            f"intermediate_size={cfg.intermediate_size} (each device holds whole kv heads): use model=N with N "
            f"dividing {np.gcd.reduce([cfg.num_kv_heads, cfg.num_heads, cfg.intermediate_size])}")


def tensor_parallel_config(cfg, n: int):
    """The per-device ModelConfig of model=n tensor parallelism (Hq/n, Hkv/n heads, F/n MLP)."""
    check_tensor_parallel(cfg, n)
    if n == 1:
        return cfg
    return cfg.replace(num_heads=cfg.num_heads // n, num_kv_heads=cfg.num_kv_heads // n,
                       intermediate_size=cfg.intermediate_size // n, tensor_parallel_shards=n)


def _qkv_order(cfg, n: int) -> np.ndarray:
    """Column order of wqkv whose n contiguous shards are [q_i | k_i | v_i]."""
    q, kv = cfg.q_size, cfg.kv_size
    qs, kvs = q // n, kv // n
    return np.concatenate([np.concatenate([np.arange(i * qs, (i + 1) * qs),
                                           q + np.arange(i * kvs, (i + 1) * kvs),
                                           q + kv + np.arange(i * kvs, (i + 1) * kvs)]) for i in range(n)])


def _gate_up_order(F: int, n: int) -> np.ndarray:
    """Column order of w_gate_up whose n contiguous shards are [gate_i | up_i]."""
    f = F // n
    return np.concatenate([np.concatenate([np.arange(i * f, (i + 1) * f), F + np.arange(i * f, (i + 1) * f)])
                           for i in range(n)])


_PERMUTED = {"wqkv": "qkv", "bqkv": "qkv", "w_gate_up": "gate_up"}


def _orders(cfg, n: int) -> dict[str, np.ndarray]:
    return {"qkv": _qkv_order(cfg, n), "gate_up": _gate_up_order(cfg.intermediate_size, n)}


def _laid_out(name: str, x, orders: dict[str, np.ndarray], inverse: bool):
    """One leaf in (or, `inverse`, out of) the per-head column order; leaves it doesn't permute as given."""
    kind = _PERMUTED.get(name)
    if kind is None:
        return x
    order = np.argsort(orders[kind]) if inverse else orders[kind]
    return jnp.take(x, jnp.asarray(order), axis=-1)


def tensor_parallel_layout(params: dict, cfg, n: int, *, inverse: bool = False) -> dict:
    """params with the fused columns in model=n's per-head order (`inverse`: back to jspec's layout)."""
    check_tensor_parallel(cfg, n)
    orders = _orders(cfg, n)
    layers = {name: _laid_out(name, x, orders, inverse) for name, x in params["layers"].items()}
    return {**params, "layers": layers}


# the sharded dimension of each split leaf under tensor parallelism (the rest are replicated)
_TP_DIM = {"wqkv": -1, "bqkv": -1, "w_gate_up": -1, "wo": -2, "w_down": -2}


def tensor_parallel_specs(params: dict, cfg, n: int) -> tuple:
    """The shard_map in_specs of a parameter tree under model=n, as a hashable (treedef, specs) pair."""

    def leaf(path, x):
        name = str(getattr(path[-1], "key", path[-1]))
        dim = _TP_DIM.get(name)
        if name == "lm_head" and x.shape[-1] % n == 0:
            dim = -1
        if dim is None or n == 1:
            return P()
        spec = [None] * x.ndim
        spec[dim] = TP_AXIS
        return P(*spec)

    specs = jax.tree_util.tree_map_with_path(leaf, params)
    leaves, treedef = jax.tree_util.tree_flatten(specs, is_leaf=lambda s: isinstance(s, P))
    return treedef, tuple(leaves)


def place_tensor_parallel(params: dict, cfg, mesh: Mesh) -> dict:
    """params laid out per head (tensor_parallel_layout) and split over the mesh's model axis. Leaf
    by leaf: a permuted leaf is permuted where it lies (one device, or a mesh) and its shards sent
    on, so at most one leaf's permuted copy exists at a time besides the placed weights."""
    n = axis_size(mesh, TP_AXIS)
    treedef, specs = tensor_parallel_specs(params, cfg, n)
    orders = _orders(cfg, n)

    def place(path, x, spec):
        x = _laid_out(str(getattr(path[-1], "key", path[-1])), x, orders, False) if path[0].key == "layers" else x
        return jax.device_put(x, NamedSharding(mesh, spec))

    return jax.tree_util.tree_map_with_path(place, params, jax.tree_util.tree_unflatten(treedef, specs))


# The latest placement: (mesh, cfg, ids of the source leaves) -> (weakrefs of those leaves, placed params)
_PLACEMENT: dict = {}


def placed_tensor_parallel(params: dict, cfg, mesh: Mesh) -> dict:
    """place_tensor_parallel, once per parameter tree and mesh: generate(mesh="model=N") calls this,
    so its next call on the same weights reuses their placed copy instead of moving and permuting
    every weight again. One placement is kept (the latest), and dropped as soon as any source
    weight is freed. Only trees of jax arrays are cached (immutable, so their identity is their
    value); others are placed anew."""
    leaves = jax.tree_util.tree_leaves(params)
    if not all(isinstance(a, jax.Array) for a in leaves):
        return place_tensor_parallel(params, cfg, mesh)
    key = (mesh, cfg, tuple(map(id, leaves)))
    hit = _PLACEMENT.get(key)
    if hit is not None and all(ref() is a for ref, a in zip(hit[0], leaves)):
        return hit[1]
    _PLACEMENT.clear()  # the previous placement's device memory goes before this one's is taken
    placed = place_tensor_parallel(params, cfg, mesh)
    drop = lambda _ref: _PLACEMENT.pop(key, None)  # noqa: E731 - a source leaf was freed
    _PLACEMENT[key] = (tuple(weakref.ref(a, drop) for a in leaves), placed)
    return placed


def tensor_parallel_map(fn, mesh: Mesh, params_name: str, param_specs: tuple, static_items: tuple,
                        rows: tuple[str, ...] = (), compiler_options: tuple = ()):
    """jit(shard_map(fn)) over every mesh axis: `fn(**{params_name: params}, **kwargs, **static)`
    run whole on each device with its shard of the parameters (param_specs, from
    tensor_parallel_specs). Call it as mapped(params, kwargs). The kwargs named in `rows` are split
    over the data axis by their leading (row) dimension, as is every output, and a "key" kwarg is
    folded with the data shard's index (independent random streams per shard); the other kwargs
    are replicated. Without `rows` every output is replicated (psums make every device's values
    the same). compiler_options: XLA options as (name, value) items; none by default (on a 2xH200
    host the one-shot all-reduce kernel, collectives in command buffers and synchronous
    all-reduces each left the 8B step where it was: scripts/profile_tp.py --variants). Cached: one
    compile per (fn, mesh, layout, static arguments, rows, options)."""
    return _tensor_parallel_map(fn, mesh, params_name, param_specs, static_items, tuple(rows), tuple(compiler_options))


@functools.lru_cache(maxsize=64)
def _tensor_parallel_map(fn, mesh, params_name, param_specs, static_items, rows, compiler_options):
    static = dict(static_items)
    treedef, specs = param_specs

    def per_device(params, split, shared):
        if rows and "key" in shared:
            shared = {**shared, "key": jax.random.fold_in(shared["key"], jax.lax.axis_index("data"))}
        token = _IN_TENSOR_PARALLEL.set(True)
        try:
            return fn(**{params_name: params}, **split, **shared, **static)
        finally:
            _IN_TENSOR_PARALLEL.reset(token)

    mapped = jax.shard_map(per_device, mesh=mesh, in_specs=(jax.tree_util.tree_unflatten(treedef, specs), P("data"), P()),
                           out_specs=P("data") if rows else P(), check_vma=False)
    jitted = jax.jit(mapped, compiler_options=dict(compiler_options) or None)

    def call(params, kwargs):
        return jitted(params, {k: v for k, v in kwargs.items() if k in rows},
                      {k: v for k, v in kwargs.items() if k not in rows})

    return call
