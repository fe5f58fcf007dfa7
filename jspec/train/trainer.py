"""The training loop: data -> jitted step -> metrics, with Orbax checkpoints and exact resume.

Resume is exact because everything a step depends on is either in the checkpoint (float32
params, optimizer state, step counter, base RNG key, the head's d2t / t2d) or a pure function
of the step number (the batch: `ShardedLoader.batch(step)`; the step's randomness:
fold_in(rng, step)). A run killed after checkpoint N and resumed therefore reproduces the
uninterrupted run's losses from step N on.
"""

from __future__ import annotations

import dataclasses
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
from ..model import cast_params, forward, init_cache
from . import step as S
from .config import RunConfig, TrainConfig
from .data import ShardedLoader, token_counts
from .vocab import init_lm_head_from_target


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
    total_steps: int = 0  # where the run (and its learning-rate schedule) ends
    stopped_by_budget: bool = False  # the time budget ended this process before total_steps

    @property
    def finished(self) -> bool:
        return self.last_step >= self.total_steps


class MetricsLog:
    """Interval means of the step metrics, to a JSONL file and a tqdm bar (process 0 only).

    Row keys: step, loss (the weighted TTT sum), loss_j / acc_j per TTT step j (acc = top-1 of
    the head == the target's argmax on response tokens), grad_norm, lr, tokens_per_s (non-padding
    tokens through the train step per wall-clock second), tokens_per_s_per_device, elapsed_s.
    """

    def __init__(self, path: str | None, bar, n_devices: int = 1):
        self.path, self.bar, self.n_devices = path, bar, n_devices
        self.start = time.perf_counter()
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
        row["tokens_per_s_per_device"] = row["tokens_per_s"] / self.n_devices
        row["elapsed_s"] = round(now - self.start, 2)
        self.t0 = now
        if self.path:
            with open(self.path, "a") as fh:
                fh.write(json.dumps(row) + "\n")
        if self.bar is not None:
            accs = " ".join(f"{row[k]:.2f}" for k in sorted(k for k in row if k.startswith("acc_")))
            accepts = " ".join(f"{row[k]:.2f}" for k in sorted(k for k in row if k.startswith("accept_")))
            self.bar.set_postfix_str(f"loss {row['loss']:.3f} acc [{accs}] accept [{accepts}] "
                                     f"{row['tokens_per_s']:.0f} tok/s")
        return row


def training_loader(data_dir: str, tc: TrainConfig, split: str = "train") -> ShardedLoader:
    """This process's loader of a dataset's `split` as training reads it (raises ValueError when
    the split cannot fill a batch)."""
    return ShardedLoader(data_dir, tc.batch_size, tc.seed, jax.process_index(), jax.process_count(),
                         seq_len_override=tc.seq_len, split=split, loop_cut=tc.loop_cut,
                         length_buckets=tc.length_buckets, pack_documents=tc.pack_documents)


def capture_rms(hcfg: H.HeadConfig, target_params: dict, batch: dict, rows: int = 8) -> np.ndarray:
    """Median token RMS of each captured layer input over the first `rows` rows of a batch, real
    positions after each document's first only (the first token is an attention sink whose
    activations are outsized in most models)."""
    tokens, segments = batch["tokens"][:rows], jnp.asarray(batch["segment_ids"][:rows])
    B, T = tokens.shape
    cache = init_cache(hcfg.target, B, T, target_params["embed"].dtype)
    out = forward(target_params, hcfg.target, jnp.asarray(tokens), cache, capture=hcfg.capture_layers,
                  positions=H.document_positions(segments), new_mask=H.document_mask(segments))
    real = np.asarray((H.document_positions(segments) >= 1) & (segments > 0))
    rms = [np.sqrt(np.mean(np.square(np.asarray(c, np.float32)), -1))[real] for c in out.captured]
    return np.asarray([np.median(r) for r in rms], np.float64)


def holdout_evaluator(hcfg: H.HeadConfig, tc: TrainConfig, run: RunConfig, mesh: Mesh, data_dir: str,
                      out_dir: str | None, log_fn):
    """A function (step, state, fixed, target_params) that appends the mean metrics of the same
    `run.eval_batches` held-out batches to out_dir/holdout_metrics.jsonl; None when run.eval_every
    is 0 or the dataset has no holdout shards."""
    if not run.eval_every:
        return None
    try:
        loader = training_loader(data_dir, tc, split="holdout")
    except ValueError as e:  # no holdout split (v1 datasets, tiny test sets)
        log_fn(f"no held-out metrics: {e}")
        return None
    n = min(run.eval_batches, loader.steps_in_epoch(0))
    tc_eval = dataclasses.replace(tc, feature_noise_std=0.0)
    path = os.path.join(out_dir, "holdout_metrics.jsonl") if out_dir else None

    def evaluate(step: int, state: dict, fixed: dict, target_params: dict) -> dict:
        rows = [S.eval_step(hcfg, tc_eval, state, fixed, target_params, S.global_batch(mesh, loader.batch(i)))
                for i in range(n)]
        rows = jax.device_get(rows)
        row = {"step": step, **{k: float(np.mean([r[k] for r in rows])) for k in rows[0]}}
        if path:
            with open(path, "a") as fh:
                fh.write(json.dumps(row) + "\n")
        return row

    def compile_all(state: dict, fixed: dict, target_params: dict) -> None:
        """Compile the eval step for every shape its batches take (one per length bucket they
        use): compiled inside the run it took minutes on a GPU and broke the budget fit."""
        shapes = {}
        for i in range(n):
            b = loader.batch(i)
            shapes.setdefault(tuple((k, v.shape) for k, v in sorted(b.items())), b)
        for b in shapes.values():
            S.eval_step.lower(hcfg, tc_eval, state, fixed, target_params, S.global_batch(mesh, b)).compile()

    evaluate.compile_all = compile_all
    return evaluate


def refit_steps(total: int, step: int, steps_timed: int, seconds: float, seconds_left: float,
                margin: float = 1.04) -> int:
    """A budget-fitted run's step count, shrunk so that it ends in seconds_left.

    The fit sizes the run from the mean of a few bare steps; held-out evaluations and checkpoints
    then cost time it did not count, and the run overran its budget and stopped unexported.
    seconds: the wall time the last steps_timed steps took, evaluations and checkpoints included.
    Never grows the run (the learning-rate schedule was set for `total`) and never ends it before
    `step`, the step just taken."""
    per_step = margin * seconds / max(steps_timed, 1)
    return int(min(total, max(step, step + int(seconds_left / per_step))))


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
    deadline: float | None = None,
    fit_to_deadline: bool = False,
    lm_head_init: str = "random",
    input_scale: str = "none",
    warm_start: bool = False,
    log_fn=print,
) -> TrainResult:
    """Train a draft head for tc.steps. `stop_at` ends the run after that step as a kill would
    (no extra checkpoint), for resume tests.

    head_params: initial parameters (default: init_head with tc.seed); a reduced EAGLE-3 vocab is
    chosen from the data's response-token counts; lm_head_init="target" starts EAGLE-3's LM head
    from the target's output rows (jspec.train.vocab). warm_start: head_params are a trained head
    (`jspec train-head --init-head`) whose vocabulary and LM head are kept as they are.
    Checkpoints go to out_dir/checkpoints, metrics to out_dir/metrics.jsonl.

    deadline (a time.perf_counter() value): the process stops before it, with a checkpoint, when
    the next step would not fit (resume continues exactly). fit_to_deadline: on a fresh run, after
    measuring the step time (steps 3..23 after the start), set the run's total steps to what fits
    before the deadline (at most tc.steps); the learning-rate schedule then ends where the run ends.
    """
    from tqdm import tqdm

    mesh = mesh or S.make_mesh(run.fsdp)  # every device of every host: data parallel (fsdp groups within)
    if tc.batch_size % mesh.size:
        raise ValueError(f"batch_size {tc.batch_size} does not split over {mesh.size} devices: "
                         f"use a multiple of {mesh.size}")
    first_host = jax.process_index() == 0
    log_fn(f"training on {mesh.size} device(s): data {mesh.shape['data']} x fsdp {mesh.shape['fsdp']}, "
           f"{tc.batch_size // mesh.size} rows of {tc.seq_len} tokens per device per step"
           + (", documents packed" if tc.pack_documents else ""))
    os.makedirs(out_dir, exist_ok=True)
    if head_params is None:
        head_params = jax.jit(H.init_head, static_argnums=0)(hcfg, jax.random.PRNGKey(tc.seed))
    if hcfg.reduced_vocab and not warm_start:  # a warm start keeps the trained head's vocabulary
        head_params = H.with_draft_vocab(hcfg, head_params, token_counts(data_dir, hcfg.target.vocab_size))
    if lm_head_init == "target" and not warm_start:
        head_params = init_lm_head_from_target(hcfg, jax.device_get(head_params), jax.device_get(target_params))
    loader = training_loader(data_dir, tc)
    compute_target = cast_params(target_params, jnp.dtype(tc.compute_dtype))
    if input_scale == "rms" and "fc_in_scale" not in head_params:  # a resumed run restores the same leaf
        first_rows = ShardedLoader(data_dir, tc.batch_size, tc.seed, 0, 1, seq_len_override=tc.seq_len,
                                   loop_cut=tc.loop_cut, length_buckets=tc.length_buckets,
                                   pack_documents=tc.pack_documents).batch(0)
        rms = capture_rms(hcfg, compute_target, first_rows)  # every host measures the same rows
        scales = H.capture_scales(rms)
        if warm_start:  # an exported head has the scale folded into fc: unfold it (exact), same function
            head_params = H.fold_capture_scales(H.with_capture_scales(hcfg, head_params, 1.0 / scales))
        head_params = H.with_capture_scales(hcfg, head_params, scales)
        log_fn(f"captured layers {hcfg.capture_layers}: token RMS {np.round(rms, 1).tolist()}, "
               f"fc_in_scale {scales.tolist()}")
    trainable, fixed = H.split_trainable(head_params)
    state = S.place(mesh, S.init_state(tc, trainable))
    fixed = S.place_replicated(mesh, fixed)
    target_params = S.place(mesh, compute_target)

    ckpt = Checkpointer(os.path.join(out_dir, "checkpoints"), run.keep_checkpoints)
    fitted = False
    if resume and ckpt.latest_step() is not None:
        state, fixed, meta = ckpt.restore(ckpt.latest_step(), state, fixed)
        assert meta["data_position"] == int(state["step"]), "checkpoint data position != step"
        fitted = bool(meta.get("total_fitted"))

    evaluate = holdout_evaluator(hcfg, tc, run, mesh, data_dir, out_dir if first_host else None, log_fn)
    start = int(state["step"])
    total = int(state["total_steps"])
    bar = tqdm(total=total, initial=start, desc=f"train {hcfg.kind}", disable=not (progress and first_host))
    log = MetricsLog(os.path.join(out_dir, "metrics.jsonl") if first_host else None, bar if progress else None,
                     n_devices=mesh.size)
    meta = {"kind": hcfg.kind, "seed": tc.seed, "data_dir": os.path.abspath(data_dir)}
    fit_pending = fit_to_deadline and deadline is not None and not fitted and start == 0
    measure_from, measure_to = start + 3, start + 23  # after compilation; synced at both ends
    # Compile the step for every batch shape now (each length bucket, else seq_len), so none compiles
    # inside the timed window, and `--stop-at 0` is a compile-only run that fills the compilation cache.
    first_batch = loader.batch(start) if start < total else None
    t_compile = time.perf_counter()
    shapes = (tc.length_buckets or (tc.seq_len,)) if first_batch is not None else ()
    for T in shapes:
        shaped = {k: np.resize(v, (v.shape[0], T)) if v.ndim == 2 else v for k, v in first_batch.items()}
        S.train_step.lower(hcfg, tc, mesh, state, fixed, target_params, S.global_batch(mesh, shaped)).compile()
    if evaluate is not None:
        evaluate.compile_all(state, fixed, target_params)
    if shapes:
        options = S.training_compiler_options(jax.default_backend())
        log_fn(f"compiled the step for {len(shapes)} batch shape(s){' and the held-out step' if evaluate is not None else ''} in "
               f"{time.perf_counter() - t_compile:.1f} s (or loaded them from the compilation cache)"
               + (f"; XLA options {options}" if options else ""))
    t_measure = step_seconds = None
    t_ckpt = time.perf_counter()
    stopped = False
    reserve = 20.0  # seconds kept for the last checkpoint and the export
    step = start
    try:
        while step < total and (stop_at is None or step < stop_at):
            if deadline is not None and time.perf_counter() + 1.5 * (step_seconds or 0.0) + reserve > deadline:
                stopped = True
                break
            batch = S.global_batch(mesh, loader.batch(step))
            state, metrics = S.train_step(hcfg, tc, mesh, state, fixed, target_params, batch)
            log.add(step + 1, metrics)
            bar.update(1)
            step += 1
            if step in (measure_from, measure_to) and (fit_pending or deadline is not None):
                jax.block_until_ready(state["step"])
                if step == measure_from:
                    t_measure = time.perf_counter()
                elif t_measure is not None:
                    step_seconds = (time.perf_counter() - t_measure) / (measure_to - measure_from)
                    if fit_pending:
                        room = deadline - time.perf_counter() - reserve
                        # 8% margin: batches of different lengths make the measured mean step noisy
                        total = int(min(tc.steps, step + max(int(0.92 * room / step_seconds), 1)))
                        state["total_steps"] = jax.device_put(jnp.asarray(total, jnp.int32), state["total_steps"].sharding)
                        fitted, fit_pending = True, False
                        bar.total = total
                        bar.refresh()
                        log_fn(f"fitted the run to the time budget: {total} steps at {step_seconds:.3f} s/step")
            if step % run.log_every == 0 or step == total:
                log.flush()  # reads the metrics back: the device has caught up
                if fitted and deadline is not None and t_measure is not None and step > measure_to:
                    refit = refit_steps(total, step, step - measure_from, time.perf_counter() - t_measure,
                                        deadline - time.perf_counter() - reserve)
                    if refit < total:
                        total = refit
                        state["total_steps"] = jax.device_put(jnp.asarray(total, jnp.int32), state["total_steps"].sharding)
                        bar.total = total
                        log_fn(f"refitted the run to the time budget: {total} steps (evaluations and checkpoints "
                               f"took more than the fit counted)")
            if evaluate is not None and (step % run.eval_every == 0 or step == total):
                evaluate(step, state, fixed, target_params)
            ckpt_due = step % run.ckpt_every == 0 or step == total  # stop_at acts like a kill
            if run.ckpt_every_s and time.perf_counter() - t_ckpt > run.ckpt_every_s:
                ckpt_due = True
            if ckpt_due:
                ckpt.save(step, state, fixed, {**meta, "data_position": step, "total_fitted": fitted})
                t_ckpt = time.perf_counter()
        if stopped and ckpt.latest_step() != step:
            ckpt.save(step, state, fixed, {**meta, "data_position": step, "total_fitted": fitted})
        if stopped and step == start:  # the budget went to start-up and compilation
            log_fn(f"stopped by the time budget before step {start + 1}: start-up and compiling the "
                   f"{len(tc.length_buckets) or 1} step shapes took it all; give a larger time budget "
                   f"(with $JAX_COMPILATION_CACHE_DIR set, a rerun reuses the compiled steps)")
        elif stopped:
            log_fn(f"stopped by the time budget at step {step} of {total}; resume continues from here")
    finally:
        log.flush()
        bar.close()
        ckpt.close()
    params = jax.device_get({**state["params"], **fixed})
    return TrainResult(hcfg, params, log.losses, int(state["step"]), total, stopped)
