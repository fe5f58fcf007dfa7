"""The time-budgeted training loop shared by the drafter trainers (tied draft model / exit head, DLM).

With a time budget, the cosine schedule runs on the wall clock: its clock starts when the first
(compiling) step has finished and ends `reserve` seconds before the deadline, so a run cut by its
budget still ends its schedule. Without one it runs on the step count.
"""

from __future__ import annotations

import json
import math
import time
from typing import Any, Callable

import jax
import numpy as np


def lr_at(tc, step: int, progress: float) -> float:
    """Warm-up over `tc.warmup_steps`, then cosine from tc.lr to tc.lr * final_lr_fraction over progress."""
    warm = min(1.0, (step + 1) / max(tc.warmup_steps, 1))
    cos = 0.5 * (1 + math.cos(math.pi * min(max(progress, 0.0), 1.0)))
    return tc.lr * warm * (tc.final_lr_fraction + (1 - tc.final_lr_fraction) * cos)


def run_timed_loop(state, step_fn: Callable[[Any, float, int], tuple[Any, dict]], tc, *, deadline: float,
                   reserve: float, t_start: float, metric_keys: tuple[str, ...], log_path: str,
                   describe: Callable[[dict], str] | None = None, ckpt=None,
                   stop_at: int | None = None) -> tuple[Any, int, list[dict], float]:
    """Run `step_fn(state, lr, step) -> (state, metrics)` until tc.steps or the deadline (or
    `stop_at`, a kill's stand-in: the schedule is still tc.steps').

    Logs the mean of `metric_keys` every tc.log_every steps to `log_path` (process 0; `describe`
    prints a line too), checkpoints every tc.ckpt_every steps when `ckpt` is given.
    Returns (state, steps done, logged rows, seconds in the loop)."""
    first = jax.process_index() == 0
    pending, history, step_times = [], [], []
    step = int(state["step"])
    t_loop = time.perf_counter()
    t_clock = None  # when the first (compiling) step finished: the schedule's clock starts there
    while step < tc.steps and (stop_at is None or step < stop_at):
        now = time.perf_counter()
        if tc.time_budget_s:
            est = float(np.median(step_times[-20:])) if step_times else 0.0
            if now + est > deadline - reserve:  # the next step must end before the reserve
                break
            frac = (now - t_clock) / max(deadline - reserve - t_clock, 1e-6) if t_clock else 0.0
        else:
            frac = step / max(tc.steps, 1)
        lr = lr_at(tc, step, frac)
        state, metrics = step_fn(state, lr, step)
        jax.block_until_ready(metrics)  # one sync a step keeps the deadline exact
        done = time.perf_counter()
        if t_clock is None:
            t_clock = done
        else:
            step_times.append(done - now)
        pending.append(metrics)
        step += 1
        if step % tc.log_every == 0:
            ms = jax.device_get(pending)
            pending = []
            row = {"step": step, **{k: float(np.mean([m[k] for m in ms])) for k in metric_keys},
                   "lr": lr, "elapsed_s": done - t_start}
            history.append(row)
            if first:
                with open(log_path, "a") as fh:
                    fh.write(json.dumps(row) + "\n")
                if describe:
                    print(describe(row), flush=True)
        if ckpt and tc.ckpt_every and step % tc.ckpt_every == 0:
            ckpt.save(step, state, {}, {"step": step})
    return state, step, history, time.perf_counter() - t_loop
