"""The jitted train step, the optimizer, and how state and batches are laid out on a device mesh.

Mesh axes ("data", "fsdp"): a batch is split over both axes (every device sees different rows);
head and target parameter matrices are split over "fsdp" along their last evenly divisible axis
(vectors and indivisible arrays are replicated), and so are the optimizer moments. XLA inserts
the all-gathers and reduce-scatters; on one device every sharding is trivial and the same code
runs unchanged.

Precision: the optimizer holds float32 master weights; the step casts them to the compute dtype
(bf16 by default) inside the loss, so gradients flow back to float32 through the cast.
"""

from __future__ import annotations

import functools
import os

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from ..heads import eagle as H
from ..model import cast_params
from . import losses
from .config import TrainConfig

BATCH_AXES = ("data", "fsdp")


# ---------------------------------------------------------------------------------------------
# Multi-host and mesh
# ---------------------------------------------------------------------------------------------


def maybe_initialize_distributed() -> None:
    """jax.distributed.initialize() when launched as several processes (env-driven):
    JAX_COORDINATOR_ADDRESS + JAX_NUM_PROCESSES + JAX_PROCESS_ID, or a cluster JAX detects itself
    (SLURM, Open MPI, TPU pods) when JSPEC_DISTRIBUTED=1. A single process skips it."""
    if os.environ.get("JAX_COORDINATOR_ADDRESS") and int(os.environ.get("JAX_NUM_PROCESSES", "1")) > 1:
        jax.distributed.initialize(
            coordinator_address=os.environ["JAX_COORDINATOR_ADDRESS"],
            num_processes=int(os.environ["JAX_NUM_PROCESSES"]),
            process_id=int(os.environ["JAX_PROCESS_ID"]),
        )
    elif os.environ.get("JSPEC_DISTRIBUTED") == "1":
        jax.distributed.initialize()


# XLA's GPU compiler times several Triton tilings of every matrix product in a program and keeps the
# fastest. A head's packed training step (64 rows of 768 tokens, SmolLM2-135M's target) has enough
# distinct products that this took over four minutes on a fresh H200; with the products on cuBLAS
# the same step reached its first update in 38 s and then ran at the same speed (0.572 s a step,
# against 0.577 with Triton). Turning autotuning off instead compiled fast but ran 3.9 s a step.
# So training steps compile with Triton GEMMs off on GPUs; JSPEC_TRAIN_TRITON_GEMM=1 keeps XLA's
# default. Other backends get no options.
GPU_TRAINING_COMPILER_OPTIONS = {"xla_gpu_enable_triton_gemm": False}


def training_compiler_options(backend: str, env=None) -> dict | None:
    """XLA compile options for a training step on `backend` ("gpu", "cpu", "tpu")."""
    env = os.environ if env is None else env
    if backend != "gpu" or env.get("JSPEC_TRAIN_TRITON_GEMM") == "1":
        return None
    return dict(GPU_TRAINING_COMPILER_OPTIONS)


class training_jit:
    """`jax.jit(fun, **jit_kwargs)` for a training step, compiled with `training_compiler_options`
    of the backend it first runs on. The jit is built at the first call or `lower`, when the
    backend is up, so importing a trainer initialises no backend."""

    def __init__(self, fun, **jit_kwargs):
        functools.update_wrapper(self, fun)
        self._fun, self._jit_kwargs, self._jitted = fun, jit_kwargs, None

    def jitted(self):
        if self._jitted is None:
            options = training_compiler_options(jax.default_backend())
            self._jitted = jax.jit(self._fun, compiler_options=options, **self._jit_kwargs)
        return self._jitted

    def __call__(self, *args, **kwargs):
        return self.jitted()(*args, **kwargs)

    def lower(self, *args, **kwargs):
        return self.jitted().lower(*args, **kwargs)


def make_mesh(fsdp: int = 1, devices=None) -> Mesh:
    devices = list(jax.devices() if devices is None else devices)
    if len(devices) % fsdp:
        raise ValueError(f"fsdp={fsdp} does not divide {len(devices)} devices")
    return Mesh(np.asarray(devices).reshape(len(devices) // fsdp, fsdp), BATCH_AXES)


def fsdp_spec(shape: tuple[int, ...], fsdp: int) -> P:
    """Shard the last axis divisible by the fsdp size (matrices only); otherwise replicate."""
    if fsdp > 1 and len(shape) >= 2:
        for axis in reversed(range(len(shape))):
            if shape[axis] % fsdp == 0:
                spec = [None] * len(shape)
                spec[axis] = "fsdp"
                return P(*spec)
    return P()


def tree_shardings(mesh: Mesh, tree):
    """NamedSharding per leaf of a (possibly abstract) pytree, by fsdp_spec."""
    fsdp = mesh.shape["fsdp"]
    return jax.tree.map(lambda x: NamedSharding(mesh, fsdp_spec(tuple(x.shape), fsdp)), tree)


def batch_sharding(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, P(BATCH_AXES))


def global_batch(mesh: Mesh, local: dict[str, np.ndarray]) -> dict[str, jax.Array]:
    """Assemble each host's rows into global arrays sharded over (data, fsdp)."""
    sharding = batch_sharding(mesh)
    return {k: jax.make_array_from_process_local_data(sharding, v) for k, v in local.items()}


# ---------------------------------------------------------------------------------------------
# Optimizer and state
# ---------------------------------------------------------------------------------------------


def learning_rate(tc: TrainConfig, step, total_steps):
    """Linear warm-up to tc.lr, then cosine decay to tc.lr * final_lr_fraction at `total_steps`.

    `total_steps` is a value, not a constant of the compiled step: it lives in the train state, so a
    run whose length is fitted to a time budget after its first steps (`fit_total_steps`) keeps one
    compiled step and a schedule that ends where the run ends. Warm-up is tc.warmup_ratio of the
    total when set, else tc.warmup_steps.
    """
    step = jnp.asarray(step, jnp.float32)
    total = jnp.maximum(jnp.asarray(total_steps, jnp.float32), 1.0)
    warm = jnp.maximum(tc.warmup_ratio * total if tc.warmup_ratio > 0 else jnp.float32(tc.warmup_steps), 1.0)
    warm = jnp.minimum(warm, jnp.maximum(total - 1.0, 1.0))
    frac = jnp.clip((step - warm) / jnp.maximum(total - warm, 1.0), 0.0, 1.0)
    end = tc.final_lr_fraction
    cosine = end + (1.0 - end) * 0.5 * (1.0 + jnp.cos(jnp.pi * frac))
    return tc.lr * jnp.where(step < warm, step / warm, cosine)


def lr_schedule(tc: TrainConfig) -> optax.Schedule:
    """The schedule of a run of exactly tc.steps steps."""
    return lambda step: learning_rate(tc, step, tc.steps)


def make_optimizer(tc: TrainConfig) -> optax.GradientTransformation:
    """AdamW's direction (decay on matrices only) after global-norm clipping; the step multiplies
    it by -learning_rate(...) itself, which is exactly optax.adamw with that schedule."""
    decay_mask = lambda params: jax.tree.map(lambda p: p.ndim >= 2, params)  # noqa: E731
    return optax.chain(
        optax.clip_by_global_norm(tc.grad_clip),
        optax.scale_by_adam(b1=tc.b1, b2=tc.b2),
        optax.add_decayed_weights(tc.weight_decay, mask=decay_mask),
    )


def init_state(tc: TrainConfig, trainable: dict) -> dict:
    """{step, total_steps, params (float32 master), opt_state, rng}: everything a checkpoint must
    restore."""
    # a copy: the step donates its state, which must not delete the caller's arrays
    params = jax.tree.map(lambda p: jnp.array(p, jnp.float32, copy=True), trainable)
    return {
        "step": jnp.zeros((), jnp.int32),
        "total_steps": jnp.asarray(tc.steps, jnp.int32),
        "params": params,
        "opt_state": make_optimizer(tc).init(params),
        "rng": jax.random.PRNGKey(tc.seed),
    }


def place(mesh: Mesh, tree):
    """Put a tree on the mesh by fsdp_spec (parameters, optimizer state)."""
    return jax.device_put(tree, tree_shardings(mesh, tree))


def place_replicated(mesh: Mesh, tree):
    """Put a tree on every device of the mesh (the head's d2t / t2d)."""
    return jax.device_put(tree, NamedSharding(mesh, P()))


# ---------------------------------------------------------------------------------------------
# The step
# ---------------------------------------------------------------------------------------------


def _train_step(hcfg: H.HeadConfig, tc: TrainConfig, mesh: Mesh, state: dict, fixed: dict,
                target_params: dict, batch: dict):
    dtype = jnp.dtype(tc.compute_dtype)
    target = losses.target_outputs(hcfg, tc, target_params, batch["tokens"], batch["segment_ids"])
    key = jax.random.fold_in(state["rng"], state["step"])  # per-step randomness, resumable

    def loss_fn(params):
        head_params = {**cast_params(params, dtype), **fixed}
        return losses.ttt_loss(hcfg, tc, head_params, target_params, batch, target, key)

    (_, metrics), grads = jax.value_and_grad(loss_fn, has_aux=True)(state["params"])
    direction, opt_state = make_optimizer(tc).update(grads, state["opt_state"], state["params"])
    lr = learning_rate(tc, state["step"], state["total_steps"])
    updates = jax.tree.map(lambda d: -lr * d, direction)
    new_state = {
        "step": state["step"] + 1,
        "total_steps": state["total_steps"],
        "params": optax.apply_updates(state["params"], updates),
        "opt_state": opt_state,
        "rng": state["rng"],
    }
    new_state = jax.lax.with_sharding_constraint(new_state, tree_shardings(mesh, new_state))
    metrics["grad_norm"] = optax.tree.norm(grads)
    metrics["lr"] = lr
    metrics["tokens"] = jnp.sum(batch["lengths"])
    return new_state, metrics


def _eval_step(hcfg: H.HeadConfig, tc: TrainConfig, state: dict, fixed: dict, target_params: dict, batch: dict):
    """The training loss and per-step accuracies on a batch, without noise or an update."""
    target = losses.target_outputs(hcfg, tc, target_params, batch["tokens"], batch["segment_ids"])
    head_params = {**cast_params(state["params"], jnp.dtype(tc.compute_dtype)), **fixed}
    _, metrics = losses.ttt_loss(hcfg, tc, head_params, target_params, batch, target, state["rng"])
    return metrics


train_step = training_jit(_train_step, static_argnums=(0, 1, 2), donate_argnums=(3,))
eval_step = training_jit(_eval_step, static_argnums=(0, 1))
train_step.__doc__ = """train_step(hcfg, tc, mesh, state, fixed, target_params, batch) -> (state, metrics).

state: init_state(...) placed with `place`; fixed: the head's integer leaves (d2t, t2d);
target_params: frozen, already in the compute dtype; batch: global_batch(...) arrays of
ShardedLoader.batch (tokens, loss_mask, segment_ids, lengths)."""
