"""Where a tensor-parallel decode step's time goes, GPU by GPU, from a GPU trace.

Random weights of a named real shape (scripts/bench_shapes.py's SHAPES; the default is Llama-3.1-8B).
For one device and for `--mesh model=N` (generate()'s per-head layout under shard_map, as
`bench_shapes.py --parts tp` times it), at each --batches, it runs whole jitted generations of
`--new` and `--new / 4` tokens after a 64-token prompt under `jax.profiler.trace`. The difference
between the two, divided by the extra steps, is one decode step without prefill, so:

  * wall_ms: a step's wall time;
  * for each GPU: busy_ms (the sum of its kernels), idle_ms = wall - busy (launch gaps, waits
    outside kernels), and busy time by kind of kernel (KINDS: products = the matrix products and
    the LM head, attention, collective = NCCL kernels and XLA's fusions of a psum, whose durations
    include waiting for the slowest peer; other = norms, rotary, residual adds, cache writes,
    sampling), with collective_launches, and the top kernels by µs per step.

Against the one-device row this says what tensor parallelism adds (collectives, idle gaps, kernels
that do not shrink with the shard). Together with the per-device weight bytes
(`device_bytes`) this says how far a step is from streaming its shard at the card's bandwidth.

    python scripts/profile_tp.py --out OUT [--shape llama-3.1-8b] [--mesh model=2] [--batches 1,16]
        [--new 256] [--top 40] [--variants default,one_shot,...]

--variants compiles the tensor-parallel program with each named XLA option set (VARIANTS) and
profiles each beside the one-device row; a set that does not compile or run is recorded as an error.

Writes OUT/profile_tp.json (a row per device count and batch) and prints each row as measured.
"""

from __future__ import annotations

import argparse
import collections
import glob
import gzip
import json
import os
import re
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from jspec.errors import UsageError  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from bench_shapes import PROMPT, SHAPES, bandwidth, random_params, weight_bytes  # noqa: E402
from jspec import decode as D  # noqa: E402
from jspec import model as M  # noqa: E402
from jspec import sharding as S  # noqa: E402
from jspec.cards import card_name  # noqa: E402
from jspec.sampling import Sampling  # noqa: E402

KINDS = (("collective", re.compile(r"nccl|psum|all.?reduce|all.?gather|reduce.?scatter|collective", re.IGNORECASE)),
         ("products", re.compile(r"matvec|gemm|cublas|dot", re.IGNORECASE)),
         ("attention", re.compile(r"attention|fmha|flash", re.IGNORECASE)))


# XLA option sets the tensor-parallel program can be compiled with (--variants): the layer's two
# all-reduces are 8-128 KB at decode, where a collective's fixed cost is several µs a call. On a
# 2xH200 host none of these moved the 8B step (3.74-3.77 ms at batch 1; benchmarks/shapes/h200x2_s15_tp_variants.json).
ALL_REDUCE_ONE_SHOT = {"xla_gpu_unsupported_use_all_reduce_one_shot_kernel": True}
COMMAND_BUFFER_COLLECTIVES = {"xla_gpu_enable_command_buffer": "FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,COLLECTIVES"}
VARIANTS = {
    "default": {},
    "one_shot": ALL_REDUCE_ONE_SHOT,
    "cmdbuf_collectives": COMMAND_BUFFER_COLLECTIVES,
    "one_shot_cmdbuf": {**ALL_REDUCE_ONE_SHOT, **COMMAND_BUFFER_COLLECTIVES},
    "sync_all_reduce": {"xla_gpu_disable_async_collectives": "ALLREDUCE"},
}


def kernel_table(trace_dir: str) -> dict[int, dict[str, list[float]]]:
    """{GPU index: {kernel name: [total µs, launches]}} from the Perfetto trace in trace_dir (each
    GPU's tracks; an empty dict off a GPU)."""
    path = sorted(glob.glob(os.path.join(trace_dir, "**", "*.trace.json.gz"), recursive=True))[-1]
    with gzip.open(path) as fh:
        events = json.load(fh)["traceEvents"]
    gpu_of = {}
    for e in events:
        if e.get("ph") == "M" and e.get("name") == "process_name":
            found = re.search(r"GPU:(\d+)", str(e.get("args", {}).get("name", "")), re.IGNORECASE)
            if found:
                gpu_of[e["pid"]] = int(found.group(1))
    if not gpu_of and jax.default_backend() == "gpu":
        print("no GPU track among the trace's processes", flush=True)
    table: dict[int, dict[str, list[float]]] = collections.defaultdict(lambda: collections.defaultdict(lambda: [0.0, 0]))
    for e in events:
        if e.get("ph") == "X" and e.get("pid") in gpu_of:
            entry = table[gpu_of[e["pid"]]][e["name"]]
            entry[0] += float(e.get("dur", 0.0))
            entry[1] += 1
    return {gpu: dict(kernels) for gpu, kernels in table.items()}


def kind_of(kernel: str) -> str:
    """Which KINDS a kernel name belongs to (the first that matches), else "other"."""
    return next((kind for kind, pattern in KINDS if pattern.search(kernel)), "other")


def traced_run(run) -> tuple[float, dict[int, dict[str, list[float]]]]:
    """(wall s, per-GPU kernel table) of one call of `run`, compiled and warmed beforehand."""
    jax.block_until_ready(run())
    t0 = time.perf_counter()
    jax.block_until_ready(run())
    wall = time.perf_counter() - t0
    with tempfile.TemporaryDirectory() as d:
        with jax.profiler.trace(d, create_perfetto_trace=True):
            jax.block_until_ready(run())
        return wall, kernel_table(d)


def step_profile(long, short, steps: int, top: int) -> dict:
    """Per-step figures from the long and short runs' (wall, kernel table) difference."""
    (wl, kl), (ws, ks) = long, short
    wall_us = 1e6 * (wl - ws) / steps
    gpus = {}
    for gpu in sorted(kl):
        long_k, short_k = kl[gpu], ks.get(gpu, {})
        per = {}  # kernel name -> [µs, launches] per step
        for n in set(long_k) | set(short_k):
            (lu, ln), (su, sn) = long_k.get(n, (0.0, 0)), short_k.get(n, (0.0, 0))
            per[n] = [(lu - su) / steps, (ln - sn) / steps]
        busy = sum(us for us, _ in per.values())
        by_kind = {kind: 0.0 for kind, _ in KINDS} | {"other": 0.0}
        coll_n = 0.0
        for name, (us, count) in per.items():
            kind = kind_of(name)
            by_kind[kind] += us
            coll_n += count if kind == "collective" else 0.0
        ranked = sorted(per.items(), key=lambda kv: -kv[1][0])[:top]
        gpus[str(gpu)] = dict(
            busy_ms=round(busy / 1e3, 4), idle_ms=round((wall_us - busy) / 1e3, 4),
            **{f"{kind}_ms": round(us / 1e3, 4) for kind, us in by_kind.items()},
            collective_launches=round(coll_n, 2), launches=round(sum(n for _, n in per.values()), 1),
            top=[dict(kernel=n[:120], us=round(us, 2), launches=round(c, 2)) for n, (us, c) in ranked])
    return dict(wall_ms=round(wall_us / 1e3, 4), gpus=gpus)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--shape", default="llama-3.1-8b", help=f"one of {', '.join(SHAPES)}")
    ap.add_argument("--mesh", default="model=2", help="tensor parallelism: model=N, N >= 2")
    ap.add_argument("--batches", default="1,16")
    ap.add_argument("--new", type=int, default=256, help="new tokens of the long run (the short one runs a quarter)")
    ap.add_argument("--top", type=int, default=40, help="kernels listed per GPU")
    ap.add_argument("--variants", default="default",
                    help=f"XLA option sets of the tensor-parallel program, comma-separated: {', '.join(VARIANTS)}")
    args = ap.parse_args(argv)
    variants = args.variants.split(",")
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown:
        raise UsageError(f"--variants {','.join(unknown)}: expected names from {', '.join(VARIANTS)}")
    if args.shape not in SHAPES:
        raise UsageError(f"--shape {args.shape!r}: expected one of {', '.join(SHAPES)}")
    try:
        mesh = S.parse_mesh(args.mesh)
    except ValueError as e:
        raise UsageError(f"--mesh {args.mesh!r}: {e}") from None
    n = S.axis_size(mesh, "model")
    if S.axis_size(mesh, "data") > 1 or n < 2:
        raise UsageError(f"--mesh {args.mesh!r}: expected model=N with N >= 2")
    if args.new < 8:
        raise UsageError(f"--new {args.new}: at least 8 (the short run decodes a quarter of it)")
    batches = [int(b) for b in args.batches.split(",")]
    cfg = SHAPES[args.shape]
    try:
        S.check_tensor_parallel(cfg, n)
    except ValueError as e:
        raise UsageError(str(e)) from None
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "profile_tp.json")

    params = random_params(cfg)
    wbytes = weight_bytes(params)
    placed = S.place_tensor_parallel(params, cfg, mesh)
    device_bytes = int(sum(a.addressable_shards[0].data.nbytes for a in jax.tree.leaves(placed)))
    local = S.tensor_parallel_config(cfg, n)
    specs = S.tensor_parallel_specs(params, cfg, n)
    bw = bandwidth()
    rows = []
    print(f"{card_name()}: {args.shape}, {wbytes / 1e9:.2f} GB of weights, {device_bytes / 1e9:.2f} GB a device "
          f"under {args.mesh}", flush=True)
    with M.per_device_program():
        for b in batches:
            toks = jax.random.randint(jax.random.PRNGKey(b), (b, PROMPT), 0, cfg.vocab_size).astype(jnp.int32)
            lens = jnp.full((b,), PROMPT, jnp.int32)
            for devices, variant in [(1, None)] + [(n, v) for v in variants]:
                traces = []
                try:
                    for new in (args.new, args.new // 4):
                        common = dict(max_new=new, cache_len=D.plan_cache_len(D.bucket(PROMPT), args.new),
                                      sampling=Sampling())
                        if devices == 1:
                            run = lambda c=common: D.generate_ar_jit(params, cfg, toks, lens, jax.random.PRNGKey(0), **c)
                        else:
                            tp = S.tensor_parallel_map(D.generate_ar_jit, mesh, "params", specs,
                                                       tuple(sorted(dict(cfg=local, **common).items())),
                                                       compiler_options=tuple(sorted(VARIANTS[variant].items())))
                            run = lambda tp=tp: tp(placed, dict(tokens=toks, lens=lens, key=jax.random.PRNGKey(0)))
                        traces.append(traced_run(run))
                except Exception as e:  # an option set this XLA build cannot compile or run: say so, go on
                    print(f"batch {b} variant {variant}: {type(e).__name__}: {str(e)[:300]}", flush=True)
                    rows.append(dict(shape=args.shape, card=card_name(), batch=b, devices=devices, mesh=args.mesh,
                                     variant=variant, options=VARIANTS[variant], error=str(e)[:300]))
                    continue
                prof = step_profile(traces[0], traces[1], args.new - args.new // 4, args.top)
                streamed = wbytes if devices == 1 else device_bytes
                row = dict(shape=args.shape, card=card_name(), batch=b, devices=devices,
                           mesh=None if devices == 1 else args.mesh, variant=variant,
                           options=None if variant is None else VARIANTS[variant], device_bytes=streamed,
                           stream_floor_ms=round(1e3 * streamed / bw, 4) if bw else None, **prof)
                rows.append(row)
                with open(path, "w") as fh:
                    json.dump(rows, fh, indent=1)
                short = {g: {k: v for k, v in d.items() if k != "top"} for g, d in row["gpus"].items()}
                print(json.dumps(dict(batch=b, devices=devices, variant=variant, wall_ms=row["wall_ms"],
                                      stream_floor_ms=row["stream_floor_ms"], gpus=short)), flush=True)
                for g, d in row["gpus"].items():
                    for k in d["top"][:6]:
                        print(f"   gpu{g} {k['us']:9.2f} µs x{k['launches']:6.2f}  {k['kernel']}", flush=True)


if __name__ == "__main__":
    from jspec.cli import report_user_errors

    raise SystemExit(report_user_errors(main, "profile_tp.py"))
