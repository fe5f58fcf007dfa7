"""Compile seconds against layer count: first run (empty cache) and cached, for AR, the chain and
the tree, per layer-loop setting (`unroll`), with the steady-state speed of each program.

    python scripts/bench_compile.py                      # the sweep below, on this machine's GPU
    python scripts/bench_compile.py --tiny               # a CPU check of the script (tiny shapes)
    python scripts/bench_compile.py --shapes llama-3.1-8b --methods ar --unrolls auto,1,4

A cell is (shape, layers, method, unroll). Each runs in a process of its own with an empty
compilation-cache directory of its own (a new user's first run: no compiled program, no XLA
autotuning result, on disk or in memory), batch 1, random weights (bench_shapes.random_params),
a 64-token prompt and 256 new tokens. The program is the method's whole generation in one program
(jspec.bench.programs), as a queue (continuous batching) compiles it; one batch compiles the same
code as a prefill per prompt width and a loop that widths share (programs' *_loop_program), not yet
timed apart here:
  first   seconds to trace, lower and compile it;
  cached  the same again after jax.clear_caches() in that process: traced and lowered again, the
          executable read from the cache (what a second `jspec generate` pays once its weights
          are loaded; the process start and the weights are not counted);
  steady  tokens/s of the compiled program (median of --reps runs after one warm-up).
Chain: an EAGLE-3 head at the target's shape, static K = 6. Tree: the same head, EAGLE-2's tree
(top_k 10, depth 6, 59 nodes). Random weights accept few drafts, so chain and tree rows time the
rounds that unroll changes, not a real speed-up.

unroll: "auto" (None, the default: every layer unrolled over per-layer weight buffers on the GPU
kernels' path, a scan of one layer elsewhere), N (lax.scan over the stacked layers, N layers per
step: 1 is a plain scan, 5 of 30 scans 6 groups) or "true" (every layer unrolled in the scan).

Cells run in this order, so the bars come first: every method at the first shape, then AR at the
others, then the chain and the tree at the others. A cell starts only if the time measured for the
slowest cell so far fits the rest of --budget-s; rows go to <out>/<card>.json after every cell, and
cells already there are skipped (--fresh redoes them), so a second run finishes a sweep. Shapes with
two or more layer counts (a shape cut: llama-3.1-70b:8 and :16) also get rows extrapolated
linearly to the shape's own layer count (`extrapolated_to`).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))  # this checkout's jspec

import jax  # noqa: E402

from bench_shapes import SHAPES, random_eagle3_head, random_params  # noqa: E402 (this script's folder is on sys.path)
from jspec import model as M  # noqa: E402
from jspec.bench import programs as P  # noqa: E402
from jspec.cards import card_key, card_name  # noqa: E402
from jspec.compile_cache import use_compile_cache  # noqa: E402
from jspec.speculative.drafters.eagle import EagleDrafter  # noqa: E402
from jspec.speculative.engines.tree import TreeConfig  # noqa: E402

DEFAULT_SHAPES = "smollm2-135m,llama-3.1-8b,llama-3.1-70b:8,llama-3.1-70b:16,llama-3.2-1b"
TINY = dict(shapes="tiny:2,tiny:8", unrolls="auto,true", max_new=32, reps=2)
METHODS = ("ar", "chain", "tree")
PROMPT, NEW, K_MAX = 64, 256, 6
HITS, MISSES = "/jax/compilation_cache/cache_hits", "/jax/compilation_cache/cache_misses"


def parse_shape(spec: str):
    """"name" or "name:L" (the shape with L layers) -> (name, its ModelConfig)."""
    name, _, layers = spec.partition(":")
    cfg = SHAPES[name]
    return name, cfg.replace(num_layers=int(layers)) if layers else cfg


def unroll_value(text: str):
    if text == "auto":
        return None
    if text == "true":
        return True
    return int(text)


def ordered_cells(shapes: list[str], methods: list[str], unrolls: list[str]) -> list[dict]:
    """Every (shape, method, unroll), the bars first (see the module doc)."""
    cells = [dict(shape=s, method=m, unroll=u) for s in shapes for m in methods for u in unrolls]

    def tier(c):
        return 0 if c["shape"] == shapes[0] else 1 if c["method"] == "ar" else 2

    return sorted(cells, key=tier)  # stable: shapes, methods and unrolls keep their order within a tier


def cell_key(row: dict) -> tuple:
    return row["shape"], row["method"], row["unroll"]


# ---- one cell (a process of its own) -------------------------------------------------------------


def build(method: str, cfg, params, head, unroll, max_new: int) -> P.Program:
    kw = dict(batch=1, prompt_len=PROMPT, max_new=max_new, unroll=unroll)
    if method == "ar":
        return P.ar_program(params, cfg, **kw)
    hcfg, hparams = head
    if method == "chain":
        return P.chain_program(params, cfg, EagleDrafter(hcfg), hparams, k_max=K_MAX, **kw)
    return P.tree_program(params, cfg, EagleDrafter(hcfg), hparams, tree=TreeConfig(), **kw)


def timed_compile(program: P.Program, events: list) -> dict:
    """Seconds to trace, lower and compile `program`, and the persistent cache's hits and misses."""
    start = len(events)
    t0 = time.perf_counter()
    traced = program.trace()
    t1 = time.perf_counter()
    lowered = traced.lower()
    t2 = time.perf_counter()
    lowered.compile()
    t3 = time.perf_counter()
    seen = events[start:]
    return dict(trace_s=round(t1 - t0, 2), lower_s=round(t2 - t1, 2), compile_s=round(t3 - t2, 2),
                total_s=round(t3 - t0, 2), cache_hits=seen.count(HITS), cache_misses=seen.count(MISSES))


def steady_tokens_per_s(program: P.Program, reps: int) -> tuple[float, float]:
    """(tokens/s, new tokens per target call) of the program's runs after a warm-up run."""
    def run():
        out = program.fn(*program.args, **program.static)
        return jax.device_get(out[1:3])  # tokens per row, target calls per row

    run()
    rates, per_call = [], 0.0
    for _ in range(reps):
        t0 = time.perf_counter()
        n_out, calls = run()
        rates.append(float(n_out.sum()) / (time.perf_counter() - t0))
        per_call = float(n_out.sum()) / max(float(calls.sum()), 1.0)
    return statistics.median(rates), per_call


def run_cell(cell: dict, cache_dir: str, max_new: int, reps: int) -> dict:
    use_compile_cache(cache_dir)
    events: list = []
    jax.monitoring.register_event_listener(lambda name, **kw: events.append(name))
    name, cfg = parse_shape(cell["shape"])
    params = random_params(cfg)
    head = random_eagle3_head(cfg) if cell["method"] != "ar" else None
    jax.block_until_ready((params, head))
    unroll = unroll_value(cell["unroll"])
    with M.per_device_program():  # one device's program, as generate() traces it
        first = timed_compile(build(cell["method"], cfg, params, head, unroll, max_new), events)
        jax.clear_caches()  # as a second process: nothing traced or compiled in memory
        program = build(cell["method"], cfg, params, head, unroll, max_new)
        cached = timed_compile(program, events)
        rate, per_call = steady_tokens_per_s(program, reps)
    return dict(
        **cell, layers=cfg.num_layers, shape_layers=SHAPES[name].num_layers, batch=1, prompt=PROMPT, max_new=max_new,
        kernels=M.default_kernels(), **{f"first_{k}": v for k, v in first.items()},
        **{f"cached_{k}": v for k, v in cached.items()}, tokens_per_s=round(rate, 1),
        tokens_per_call=round(per_call, 3), card=card_name(), jax=jax.__version__,
    )


# ---- the sweep -----------------------------------------------------------------------------------


def extrapolated(rows: list[dict]) -> list[dict]:
    """For each (shape, method, unroll) measured at two or more layer counts below the shape's own:
    first and cached seconds fitted linearly in the layer count, at the shape's layer count."""
    groups: dict = {}
    for r in rows:
        if "extrapolated_to" not in r and r["layers"] < r["shape_layers"]:
            groups.setdefault((parse_shape(r["shape"])[0], r["method"], r["unroll"]), []).append(r)
    out = []
    for (name, method, unroll), rs in groups.items():
        if len({r["layers"] for r in rs}) < 2:
            continue
        target = rs[0]["shape_layers"]
        row = dict(shape=name, method=method, unroll=unroll, layers=target, shape_layers=target, extrapolated_to=target,
                   from_layers=sorted(r["layers"] for r in rs), card=rs[0]["card"])
        for key in ("first_total_s", "cached_total_s"):
            layers, seconds = [r["layers"] for r in rs], [r[key] for r in rs]
            slope, intercept = linear_fit(layers, seconds)
            if slope <= 0:  # more layers measured no slower (noise over a flat cost): no growth to extend,
                # so the figure is the slowest cut's, not a line run down past zero
                row[key], row[key.replace("total_s", "s_per_layer")] = round(max(seconds), 1), 0.0
                continue
            row[key] = round(intercept + slope * target, 1)
            row[key.replace("total_s", "s_per_layer")] = round(slope, 3)
        out.append(row)
    return out


def linear_fit(xs, ys) -> tuple[float, float]:
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    return slope, my - slope * mx


def write_rows(path: Path, rows: list[dict]) -> None:
    measured = [r for r in rows if "extrapolated_to" not in r]
    path.write_text(json.dumps(measured + extrapolated(measured), indent=1))


def run_sweep(args) -> int:
    out = Path(args.out) / f"{card_key()}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    rows = [] if args.fresh or not out.exists() else [r for r in json.loads(out.read_text()) if "extrapolated_to" not in r]
    done = {cell_key(r) for r in rows}
    cells = [c for c in ordered_cells(args.shapes.split(","), args.methods.split(","), args.unrolls.split(","))
             if cell_key(c) not in done]
    t_start, slowest = time.perf_counter(), 0.0
    print(f"{card_name()}: {len(cells)} cells to run ({len(done)} already in {out}), budget {args.budget_s:.0f}s",
          flush=True)
    with tempfile.TemporaryDirectory(prefix="jspec-compile-") as caches:
        for i, cell in enumerate(cells):
            left = args.budget_s - (time.perf_counter() - t_start)
            if slowest > left:
                print(f"skipped {cell}: the slowest cell so far took {slowest:.0f}s, {left:.0f}s left", flush=True)
                continue
            t0 = time.perf_counter()
            cmd = [sys.executable, __file__, "--cell", json.dumps(cell), "--cache-dir", os.path.join(caches, str(i)),
                   "--max-new", str(args.max_new), "--reps", str(args.reps)]
            try:
                proc = subprocess.run(cmd, capture_output=True, text=True, timeout=max(left, 1.0))
            except subprocess.TimeoutExpired:
                print(f"timed out: {cell}", flush=True)
                break
            slowest = max(slowest, time.perf_counter() - t0)
            lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
            if proc.returncode or not lines:
                print(f"failed: {cell}\n{proc.stderr[-3000:]}", flush=True)
                continue
            row = dict(json.loads(lines[-1]), cell_wall_s=round(time.perf_counter() - t0, 1))
            rows.append(row)
            write_rows(out, rows)
            print(f"{row['shape']:>18} L={row['layers']:<3} {row['method']:<5} unroll={row['unroll']:<4} "
                  f"first {row['first_total_s']:6.1f}s (trace {row['first_trace_s']:.1f}, lower {row['first_lower_s']:.1f}) "
                  f"cached {row['cached_total_s']:5.1f}s  {row['tokens_per_s']:8.1f} tok/s  [{row['cell_wall_s']:.0f}s]",
                  flush=True)
    print(f"rows: {out} ({time.perf_counter() - t_start:.0f}s)")
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", default=DEFAULT_SHAPES, help="comma list of bench_shapes shapes, NAME:L for L layers")
    ap.add_argument("--methods", default=",".join(METHODS))
    ap.add_argument("--unrolls", default="auto,1", help="comma list of auto, true and layer counts per scan step")
    ap.add_argument("--max-new", type=int, default=NEW)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--budget-s", type=float, default=360.0,
                    help="start no cell that the slowest so far says would end after this many seconds")
    ap.add_argument("--out", default="benchmarks/compile")
    ap.add_argument("--fresh", action="store_true", help="redo cells already in the output file")
    ap.add_argument("--tiny", action="store_true", help=f"a CPU check: {TINY}")
    ap.add_argument("--cell", default=None, help=argparse.SUPPRESS)  # the worker: one cell, one JSON line out
    ap.add_argument("--cache-dir", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.cell:
        print(json.dumps(run_cell(json.loads(args.cell), args.cache_dir, args.max_new, args.reps)), flush=True)
        return 0
    if args.tiny:
        for k, v in TINY.items():
            setattr(args, k, v)
    for u in args.unrolls.split(","):
        unroll_value(u)  # a bad value fails before any cell runs
    return run_sweep(args)


if __name__ == "__main__":
    sys.exit(main())
