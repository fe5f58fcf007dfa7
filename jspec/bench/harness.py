"""Runs methods over prompts, times every ``run`` call, and turns the timings into JSON rows.

All methods of a group share one batch size and dtype and run back to back in this process, AR
first, so every ratio (speedup, greedy identity) compares runs on the same card in the same run.
"""

from __future__ import annotations

import dataclasses
import datetime
from concurrent.futures import ThreadPoolExecutor
import os
import sys
import time
from pathlib import Path
from typing import Any, Sequence

import jax
import numpy as np

from jspec.bench import metrics
from jspec.bench.device import jax_peak_memory_bytes
from jspec.cards import card_name
from jspec.bench.metrics import TimedBatch
from jspec.bench.protocol import Method, RowResult

# Timed passes over the prompts at most, when one pass is shorter than the run's min_timed_s.
MAX_TIMED_PASSES = 5


@dataclasses.dataclass
class RunContext:
    """What every row of one run shares."""

    target: str
    max_new_tokens: int
    reproduce: str = ""
    card: str = dataclasses.field(default_factory=card_name)
    jax_version: str = jax.__version__
    timestamp: str = dataclasses.field(
        default_factory=lambda: datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    )


@dataclasses.dataclass
class MethodRun:
    method: Method
    batches: list[TimedBatch]
    compile_s: float
    peak_mem_bytes: int | None
    timed_passes: int = 1
    compile_workers: int = 1

    @property
    def outputs(self) -> list[list[int]]:
        return [list(r.new_tokens) for b in self.batches for r in b.rows]


def batches_of(prompts: Sequence[Sequence[int]], batch: int) -> list[tuple[list[list[int]], int]]:
    """Consecutive groups of ``batch`` prompts as (prompts, number of real prompts). The last group
    is filled up by repeating its own prompts (or the first ones) so every call has the compiled
    shape; the results of those fillers are thrown away."""
    if batch < 1:
        raise ValueError(f"batch must be >= 1, got {batch}")
    groups = []
    for start in range(0, len(prompts), batch):
        real = [list(p) for p in prompts[start : start + batch]]
        fillers = [real[i % len(real)] for i in range(batch - len(real))]
        groups.append((real + fillers, len(real)))
    return groups


def _now() -> float:
    """Wall clock for timing (its own function so tests can drive it)."""
    return time.perf_counter()


def _peak_memory(method: Method) -> int | None:
    own = getattr(method, "peak_memory_bytes", None)  # e.g. torch's allocator for HF peers
    return own() if own is not None else jax_peak_memory_bytes()


def _prepare(method: Method, groups) -> float:
    reset = getattr(method, "reset_peak_memory", None)
    if reset is not None:
        reset()
    # Every timed batch is offered for warm-up: a method that compiles per shape (jspec buckets
    # prompt lengths) can warm each shape; others just use the first batch.
    return float(method.prepare([p for batch_prompts, _ in groups for p in batch_prompts]))


def _timed_pass(method: Method, groups) -> list[tuple[float, list[RowResult]]]:
    """(seconds, real rows) of each batch, timed with perf_counter around ``method.run``."""
    out = []
    for batch_prompts, n_real in groups:
        start = _now()
        rows = method.run(batch_prompts)
        seconds = _now() - start
        if len(rows) != len(batch_prompts):
            raise RuntimeError(f"{method.name}: run returned {len(rows)} rows for {len(batch_prompts)} prompts")
        out.append((seconds, list(rows[:n_real])))
    return out


class TimingBarrier:
    """Processes benchmarking side by side on one host start each group's timed passes together.

    Compiling is CPU-heavy (XLA uses every core). On an H200 host, the same AR program measured
    1,008 tok/s in a process timing while another compiled and 1,139 in one timing alone (the
    speculative rows, with a host round trip per round instead of per token, moved under 1%).
    Each process marks `<dir>/<group>-<pid>` once its group is
    compiled and waits until `parties` marks of that group exist (at most `timeout_s`; then it
    times anyway and says so)."""

    def __init__(self, directory: str, parties: int, timeout_s: float = 900.0, poll_s: float = 0.2):
        if parties < 1:
            raise ValueError(f"timing barrier: parties must be >= 1, got {parties}")
        self.directory, self.parties, self.timeout_s, self.poll_s = Path(directory), parties, timeout_s, poll_s
        self.group = 0

    def wait(self) -> bool:
        """Mark this process ready for its next group and wait for the others; False on timeout."""
        self.directory.mkdir(parents=True, exist_ok=True)
        tag = f"{self.group:03d}-"
        (self.directory / f"{tag}{os.getpid()}").touch()
        self.group += 1
        deadline = time.monotonic() + self.timeout_s
        while len(list(self.directory.glob(tag + "*"))) < self.parties:
            if time.monotonic() > deadline:
                print(f"timing barrier: {self.parties} processes expected at {self.directory}, timing without them",
                      file=sys.stderr)
                return False
            time.sleep(self.poll_s)
        return True


def prepare_all(methods: Sequence[Method], groups, progress=None, workers: int = 1) -> list[float]:
    """Each method's untimed warm-up (its compiles), in seconds. With workers > 1 that many
    methods warm up at once in threads: XLA compiles with the GIL released, so a host's cores
    serve several programs (a method's compile seconds then overlap others'; rows say so)."""
    if workers <= 1 or len(methods) <= 1:
        out = []
        for m, g in zip(methods, groups):
            if progress is not None:
                progress.set_description(f"{m.name} b{m.batch} {m.dtype} (compile)")
            out.append(_prepare(m, g))
        return out
    if progress is not None:
        progress.set_description(f"{len(methods)} methods (compile, {workers} at a time)")
    with ThreadPoolExecutor(max_workers=workers) as pool:
        return list(pool.map(_prepare, methods, groups))


def run_methods(methods: Sequence[Method], prompts: Sequence[Sequence[int]], progress=None, *,
                min_timed_s: float = 0.0, max_passes: int = MAX_TIMED_PASSES,
                barrier: TimingBarrier | None = None, compile_workers: int = 1) -> list[MethodRun]:
    """Prepare every method (untimed; `prepare_all`), then time whole passes over the prompts, the methods
    taking turns pass by pass.

    A fast method's pass can take about a second (batch 32), where the clock, the GPU's clocks
    and the host move timings by several percent for seconds at a time. So passes repeat until
    each method has `min_timed_s` seconds timed (at most `max_passes` passes), interleaved so a
    slow stretch of the machine falls on every method alike, and each batch keeps its median
    time. The outputs are the first pass's (every pass computes the same ones)."""
    # a queue method (continuous batching) serves every prompt in one call, `batch` rows in flight
    groups = [[([list(p) for p in prompts], len(prompts))] if getattr(m, "queue", False) else batches_of(prompts, m.batch)
              for m in methods]
    compile_s = prepare_all(methods, groups, progress, compile_workers)
    if barrier is not None:
        barrier.wait()
    passes: list[list[list[tuple[float, list[RowResult]]]]] = [[] for _ in methods]
    peak: list[int | None] = [None] * len(methods)
    while True:
        for i, (m, g) in enumerate(zip(methods, groups)):
            if progress is not None:
                progress.set_description(f"{m.name} b{m.batch} {m.dtype}")
            passes[i].append(_timed_pass(m, g))
            if len(passes[i]) == 1:
                peak[i] = _peak_memory(m)  # as before interleaving: the process's peak after its first pass
                if progress is not None:
                    progress.update(len(g))
        n = len(passes[0])
        timed = min(sum(sec for p in mp for sec, _ in p) for mp in passes)
        if n >= max_passes or timed >= min_timed_s:
            break
    runs = []
    for m, mp, c, pk in zip(methods, passes, compile_s, peak):
        batches = [TimedBatch(float(np.median([p[b][0] for p in mp])), mp[0][b][1]) for b in range(len(mp[0]))]
        runs.append(MethodRun(m, batches, c, pk, len(mp), min(compile_workers, len(methods))))
    return runs


def run_method(method: Method, prompts: Sequence[Sequence[int]], progress=None, *, min_timed_s: float = 0.0,
               max_passes: int = MAX_TIMED_PASSES) -> MethodRun:
    """One method's run (see run_methods)."""
    return run_methods([method], prompts, progress, min_timed_s=min_timed_s, max_passes=max_passes)[0]


def first_trace(run: MethodRun) -> dict[str, list[int]] | None:
    """Per-round traces of the first prompt's generation, kept in the row for plots."""
    row: RowResult = run.batches[0].rows[0]
    trace = {k: list(v) for k, v in (("draft_lengths", row.draft_lengths), ("step_tokens", row.step_tokens)) if v is not None}
    return trace or None


def make_row(
    ctx: RunContext,
    run: MethodRun,
    *,
    task: str,
    ar_run: MethodRun | None,
    hf_run: MethodRun | None,
) -> dict[str, Any]:
    m = run.method
    tps = metrics.tokens_per_s(run.batches)
    sampling = getattr(m, "sampling", None)
    sampled = sampling is not None and not sampling.greedy
    return {
        "card": ctx.card,
        "jax_version": ctx.jax_version,
        "target": ctx.target,
        "method": m.method,
        "name": m.name,
        "drafter": m.drafter,
        # the first 16 hex digits of the SHA-256 of the drafter's weights (an EAGLE head's files, a draft
        # model's; calibration.head_fingerprint), so rows of a head trained on under one path tell its versions apart
        "drafter_weights": getattr(m, "drafter_weights", None),
        "policy": m.policy,
        "policy_constants": getattr(m, "policy_constants", None),  # calibrated policies: "calibrated" | "paper"
        "auto_plan": getattr(m, "auto_plan", None),  # `auto`: what the plan ran (AutoPlan.describe)
        "tree": bool(m.tree),
        "verify": getattr(m, "verify_rule", None),  # sampled chains: "block" (since 2026-12-05) or "token"
        "dtype": m.dtype,
        "batch": m.batch,
        "queue": bool(getattr(m, "queue", False)),  # batch = rows in flight over every prompt (continuous batching)
        "refill": getattr(m, "refill", None) if getattr(m, "queue", False) else None,  # rows started together (None: batch // 4)
        "devices": getattr(m, "devices", 1),  # HF peers run on one device
        "mesh": getattr(m, "mesh", ""),  # "data=2,model=1"; "" = one device, no mesh
        "task": task,
        "n_prompts": len(run.outputs),
        "max_new_tokens": ctx.max_new_tokens,
        "tokens_per_s": tps,
        "speedup_vs_ar": metrics.speedup(tps, metrics.tokens_per_s(ar_run.batches)) if ar_run else None,
        "speedup_vs_hf": metrics.speedup(tps, metrics.tokens_per_s(hf_run.batches)) if hf_run else None,
        "mean_accepted_tokens": metrics.mean_accepted_tokens(run.batches),
        "acceptance_rate": metrics.acceptance_rate(run.batches),
        "rollback_rate": metrics.rollback_rate(run.batches),  # parallel engines only
        "draft_tokens_per_round": metrics.draft_tokens_per_round(run.batches),
        "greedy_identical_to_ar": (  # sampled rows: the law check's rows test losslessness instead
            metrics.greedy_identical_fraction(run.outputs, ar_run.outputs) if ar_run and not sampled else None
        ),
        "temperature": sampling.temperature if sampled else 0.0,
        "top_p": sampling.top_p if sampled else 1.0,
        "top_k": sampling.top_k if sampled else 0,
        "seed": getattr(m, "seed", None) if sampled else None,  # batch seeds: seed + a hash of the batch's prompts
        "mean_new_tokens": sum(map(len, run.outputs)) / len(run.outputs),
        "peak_mem_bytes": run.peak_mem_bytes,
        "compile_s": run.compile_s,
        "compiled_with": getattr(run, "compile_workers", 1),  # methods warmed up at once (their compile seconds overlap)
        "timed_passes": run.timed_passes,
        "accepted_length_hist": metrics.accepted_length_histogram(run.batches),
        "trace": first_trace(run),
        "reproduce": ctx.reproduce,
        "timestamp": ctx.timestamp,
    }


def _is_plain_hf(m: Method) -> bool:
    return m.method == "hf" and not m.drafter


def benchmark_group(
    ctx: RunContext,
    methods: Sequence[Method],
    prompts: Sequence[Sequence[int]],
    *,
    task: str,
    progress=None,
    min_timed_s: float = 0.0,
    barrier: TimingBarrier | None = None,
    compile_workers: int = 1,
) -> list[dict[str, Any]]:
    """Rows for methods sharing one batch size and dtype. The AR method (if any) runs first so the
    others can be compared against it; plain HF generate is the second reference. min_timed_s:
    see run_method."""
    shapes = {(m.batch, m.dtype) for m in methods}
    if len(shapes) > 1:
        raise ValueError(f"one group must share batch and dtype, got {sorted(shapes)}")
    ordered = sorted(methods, key=lambda m: (m.method != "ar", not _is_plain_hf(m)))
    runs = run_methods(ordered, prompts, progress, min_timed_s=min_timed_s, barrier=barrier, compile_workers=compile_workers)
    ar_run = next((r for r in runs if r.method.method == "ar"), None)
    hf_run = next((r for r in runs if _is_plain_hf(r.method)), None)
    return [make_row(ctx, r, task=task, ar_run=ar_run, hf_run=hf_run) for r in runs]
