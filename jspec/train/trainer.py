"""The training loop: data -> jitted step -> metrics, with Orbax checkpoints and exact resume.

Resume is exact because everything a step depends on is either in the checkpoint (float32
params, optimizer state, step counter, base RNG key, the head's d2t / t2d) or a pure function
of the step number (the batch: `ShardedLoader.batch(step)`; the step's randomness:
fold_in(rng, step)). A run killed after checkpoint N and resumed therefore reproduces the
uninterrupted run's losses from step N on.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, field

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from jax.sharding import Mesh

from ..heads import eagle as H
from ..model import cast_params
from . import step as S
from .config import RunConfig, TrainConfig
from .data import ShardedLoader, token_counts


class Checkpointer:
    """Orbax CheckpointManager: async saves of {state, head's fixed leaves, JSON meta}, last k kept."""

    def __init__(self, directory: str, keep: int):
        self.manager = ocp.CheckpointManager(
            os.path.abspath(directory),
            options=ocp.CheckpointManagerOptions(max_to_keep=keep, enable_async_checkpointing=True, create=True),
        )

    def latest_step(self) -> int | None:
        return self.manager.latest_step()

    def save(self, step: int, state: dict, fixed: dict, meta: dict) -> None:
        items = {"state": ocp.args.StandardSave(state), "meta": ocp.args.JsonSave(meta)}
        if fixed:
            items["fixed"] = ocp.args.StandardSave(fixed)
        self.manager.save(step, args=ocp.args.Composite(**items))

    def restore(self, step: int, state_like: dict, fixed_like: dict) -> tuple[dict, dict, dict]:
        """Restore into the shapes, dtypes and shardings of the given (live) trees."""
        abstract = lambda t: jax.tree.map(ocp.utils.to_shape_dtype_struct, t)  # noqa: E731
        items = {"state": ocp.args.StandardRestore(abstract(state_like)), "meta": ocp.args.JsonRestore()}
        if fixed_like:
            items["fixed"] = ocp.args.StandardRestore(abstract(fixed_like))
        r = self.manager.restore(step, args=ocp.args.Composite(**items))
        return r["state"], (r["fixed"] if fixed_like else {}), r["meta"]

    def close(self) -> None:
        self.manager.wait_until_finished()
        self.manager.close()


@dataclass
class TrainResult:
    hcfg: H.HeadConfig
    head_params: dict  # float32, fixed leaves included; host numpy
    losses: dict[int, float] = field(default_factory=dict)  # step (1-based, after update) -> loss
    last_step: int = 0


class MetricsLog:
    """Interval means of the step metrics, to a JSONL file and a tqdm bar (process 0 only).

    Row keys: step, loss (the weighted TTT sum), loss_j / acc_j per TTT step j (acc = top-1 of
    the head == the target's argmax on response tokens), grad_norm, lr, and tokens_per_s
    (non-padding tokens through the train step per wall-clock second).
    """

    def __init__(self, path: str | None, bar):
        self.path, self.bar = path, bar
        self.pending: list[tuple[int, dict]] = []
        self.t0 = time.perf_counter()
        self.losses: dict[int, float] = {}

    def add(self, step: int, metrics: dict) -> None:
        self.pending.append((step, metrics))

    def flush(self) -> dict | None:
        if not self.pending:
            return None
        rows = jax.device_get(self.pending)
        self.pending = []
        now = time.perf_counter()
        for step, m in rows:
            self.losses[step] = float(m["loss"])
        keys = [k for k in rows[0][1] if k not in ("tokens", "lr")]
        row = {"step": rows[-1][0], **{k: float(np.mean([m[k] for _, m in rows])) for k in keys}}
        row["lr"] = float(rows[-1][1]["lr"])
        row["tokens_per_s"] = float(sum(m["tokens"] for _, m in rows) / max(now - self.t0, 1e-9))
        self.t0 = now
        if self.path:
            with open(self.path, "a") as fh:
                fh.write(json.dumps(row) + "\n")
        if self.bar is not None:
            accs = " ".join(f"{row[k]:.2f}" for k in sorted(k for k in row if k.startswith("acc_")))
            self.bar.set_postfix_str(f"loss {row['loss']:.3f} acc [{accs}] {row['tokens_per_s']:.0f} tok/s")
        return row


def train(
    hcfg: H.HeadConfig,
    tc: TrainConfig,
    target_params: dict,
    data_dir: str,
    out_dir: str,
    *,
    run: RunConfig = RunConfig(),
    resume: bool = False,
    stop_at: int | None = None,
    mesh: Mesh | None = None,
    head_params: dict | None = None,
    progress: bool = True,
) -> TrainResult:
    """Train a draft head for tc.steps. `stop_at` ends the run after that step as a kill would
    (no extra checkpoint), for resume tests.

    head_params: initial parameters (default: init_head with tc.seed); a reduced EAGLE-3 vocab is
    chosen from the data's response-token counts. Checkpoints go to out_dir/checkpoints, metrics
    to out_dir/metrics.jsonl.
    """
    from tqdm import tqdm

    mesh = mesh or S.make_mesh(run.fsdp)
    first_host = jax.process_index() == 0
    os.makedirs(out_dir, exist_ok=True)
    if head_params is None:
        head_params = jax.jit(H.init_head, static_argnums=0)(hcfg, jax.random.PRNGKey(tc.seed))
    if hcfg.reduced_vocab:
        head_params = H.with_draft_vocab(hcfg, head_params, token_counts(data_dir, hcfg.target.vocab_size))
    trainable, fixed = H.split_trainable(head_params)
    state = S.place(mesh, S.init_state(tc, trainable))
    fixed = S.place_replicated(mesh, fixed)
    target_params = S.place(mesh, cast_params(target_params, jnp.dtype(tc.compute_dtype)))

    ckpt = Checkpointer(os.path.join(out_dir, "checkpoints"), run.keep_checkpoints)
    if resume and ckpt.latest_step() is not None:
        state, fixed, meta = ckpt.restore(ckpt.latest_step(), state, fixed)
        assert meta["data_position"] == int(state["step"]), "checkpoint data position != step"

    loader = ShardedLoader(data_dir, tc.batch_size, tc.seed, jax.process_index(), jax.process_count())
    start = int(state["step"])
    end = min(tc.steps, stop_at) if stop_at is not None else tc.steps
    bar = tqdm(total=tc.steps, initial=start, desc=f"train {hcfg.kind}", disable=not (progress and first_host))
    log = MetricsLog(os.path.join(out_dir, "metrics.jsonl") if first_host else None, bar if progress else None)
    meta = {"kind": hcfg.kind, "seed": tc.seed, "data_dir": os.path.abspath(data_dir)}
    try:
        for step in range(start, end):
            batch = S.global_batch(mesh, loader.batch(step))
            state, metrics = S.train_step(hcfg, tc, mesh, state, fixed, target_params, batch)
            log.add(step + 1, metrics)
            bar.update(1)
            done = step + 1
            if done % run.log_every == 0 or done == end:
                log.flush()
            if done % run.ckpt_every == 0 or done == tc.steps:  # stop_at acts like a kill
                ckpt.save(done, state, fixed, {**meta, "data_position": done})
    finally:
        log.flush()
        bar.close()
        ckpt.close()
    params = jax.device_get({**state["params"], **fixed})
    return TrainResult(hcfg, params, log.losses, int(state["step"]))
