"""Multi-device throughput: the same methods on one device, data-parallel and tensor-parallel.

Groups run in this order, each one AR first then the speculative method, all in one process:

    bf16  one device     | bf16  data=N (rows split; each device loops on its own rows)
    fp32  one device AR  | fp32  model=N AR   (tensor-parallel outputs must equal one device's)
    bf16  model=N (tensor-parallel target)

(--dtype, --meshes and --no-fp32-tp-check trim the list; the model=N groups are skipped, with a
line saying why, for a model whose KV heads N does not divide.)

--weak-scaling gives each device of data=N the one-device batch (N x the rows and prompts), the
way data-parallel users grow the batch with the devices; by default the global batch is the same.

Every row carries `devices` and `mesh`, plus `speedup_vs_1_device` (tokens/s over the same
method and dtype on one device) and `identical_to_1_device` (fraction of prompts whose output
equals the one-device output). A group is started only while the time budget allows; rows are
rewritten after every group, so a run cut short keeps what it measured.
"""

from __future__ import annotations

import argparse
import json
import shlex
import time
from pathlib import Path
from typing import Any

import jax

from jspec import model as M
from jspec import presets
from jspec.bench.harness import RunContext, make_row, run_method
from jspec.bench.methods import JspecMethod
from jspec.bench.prompts import encode_questions
from jspec.bench.protocol import parse_method_spec
from jspec.errors import UsageError
from jspec.model import cast_params
from jspec.sharding import axis_size, check_tensor_parallel, mesh_label, parse_mesh
from jspec.speculative.factory import build_drafter
from jspec.tasks import load_task


def add_parallel_args(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    p.add_argument("--model", default="smollm2-135m-instruct", help="preset name or checkpoint path")
    p.add_argument("--out-dir", required=True, help="rows go to OUT_DIR/parallel.json")
    p.add_argument("--task", default="mt_bench")
    p.add_argument("--n-prompts", type=int, default=64, help="prompts per method (cycled if the task has fewer)")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--spec", default="spec:eagle3:static,spec:ngram:heuristic",
                   help="speculative methods to try in order; the first whose drafter builds is measured")
    p.add_argument("--k-max", type=int, default=4)
    p.add_argument("--devices", type=int, default=2, help="N in data=N and model=N")
    p.add_argument("--weak-scaling", action="store_true",
                   help="data=N runs N x --batch rows (and N x --n-prompts prompts): --batch rows per device, "
                        "as data-parallel users grow the batch with the devices (default: the same global batch)")
    p.add_argument("--dtype", default="bfloat16", help="dtype of the one-device / data / model groups")
    p.add_argument("--meshes", default="data,model", help="multi-device groups to run: data, model or both")
    p.add_argument("--no-fp32-tp-check", action="store_true",
                   help="skip the float32 AR pair (one device vs model=N) that checks tensor-parallel identity")
    p.add_argument("--time-budget-s", type=float, default=240.0,
                   help="start no new group once this many seconds (model load included) have passed")
    return p


def _groups(args: argparse.Namespace) -> list[tuple[str, str, bool]]:
    """(dtype, mesh spec, with the speculative method) in run order."""
    axes = [a.strip() for a in args.meshes.split(",") if a.strip()]
    if not set(axes) <= {"data", "model"}:
        raise UsageError(f"--meshes {args.meshes!r}: expected data and/or model")
    groups = [(args.dtype, "", True)] + [(args.dtype, f"data={args.devices}", True)] * ("data" in axes)
    if not args.no_fp32_tp_check:  # before the bf16 model group: the identity check matters more
        groups += [("float32", "", False), ("float32", f"model={args.devices}", False)]
    return groups + [(args.dtype, f"model={args.devices}", True)] * ("model" in axes)


def _pick_spec(candidates: str, cfg, params, model: str):
    """The first speculative method whose drafter builds (e.g. no trained EAGLE-3 head -> ngram)."""
    errors = []
    for text in candidates.split(","):
        spec = parse_method_spec(text)
        try:
            return spec, build_drafter(spec.drafter, cfg, params, model_name=model)
        except Exception as e:  # noqa: BLE001 - any failure means "try the next method"
            errors.append(f"{text}: {e}")
    raise UsageError("no speculative method could be built: " + "; ".join(errors))


def _kernels(mesh=None) -> str:
    """The kernels generate() runs for this mesh: every mesh runs whole on each device (a model
    axis too: tensor parallelism runs under shard_map), so the GPU kernels on GPUs."""
    with M.per_device_program():
        return M.default_kernels()


def add_cross_device_fields(rows: list[dict[str, Any]], outputs: dict[int, list[list[int]]]) -> None:
    """speedup_vs_1_device and identical_to_1_device against the same method and dtype without a mesh."""
    base = {(r["name"], r["dtype"]): i for i, r in enumerate(rows) if not r["mesh"]}
    for i, r in enumerate(rows):
        j = base.get((r["name"], r["dtype"]))
        if j is None:
            r["speedup_vs_1_device"] = r["identical_to_1_device"] = None
            continue
        r["speedup_vs_1_device"] = r["tokens_per_s"] / rows[j]["tokens_per_s"]
        a, b = outputs[i], outputs[j]  # weak scaling: the one-device prompts are the first ones of the mesh run
        n = min(len(a), len(b))
        r["identical_to_1_device"] = sum(x == y for x, y in zip(a[:n], b[:n])) / n


def reproduce_command(args: argparse.Namespace) -> str:
    parts = ["python", "scripts/bench_parallel.py"]
    for k, v in vars(args).items():
        flag = "--" + k.replace("_", "-")
        if k == "out_dir" or v is False:
            continue
        parts += [flag] if v is True else [flag, str(v)]
    return shlex.join(parts + ["--out-dir", "OUT"])


def run_parallel_bench(args: argparse.Namespace, resolve=presets.resolve_model) -> list[dict[str, Any]]:
    t_start = time.perf_counter()
    groups = _groups(args)
    for _, mesh, _ in groups:
        parse_mesh(mesh or None)  # too few devices fails here, before the model loads
    cfg, params, tokenizer = resolve(args.model, dtype="float32")  # cast per group below
    try:
        check_tensor_parallel(cfg, args.devices)
    except ValueError as e:  # e.g. SmolLM2-135M's 3 kv heads on model=2: the data groups still run
        if any(m.startswith("model=") for _, m, _ in groups):
            print(f"skip the model={args.devices} groups: {e}", flush=True)
        groups = [g for g in groups if not g[1].startswith("model=")]
    questions = load_task(args.task)
    prompts = encode_questions(tokenizer, questions)
    prompts = [prompts[i % len(prompts)] for i in range(args.n_prompts)]
    spec, (drafter, dparams_f32) = _pick_spec(args.spec, cfg, params, args.model)
    ctx = RunContext(target=Path(args.model).name, max_new_tokens=args.max_new_tokens,
                     reproduce=reproduce_command(args))
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    rows: list[dict[str, Any]] = []
    outputs: dict[int, list[list[int]]] = {}
    last_group_s = 0.0
    print(f"parallel bench on {jax.device_count()} x {ctx.card}: {spec.name}, batch {args.batch}, "
          f"{args.n_prompts} prompts, {args.max_new_tokens} new tokens, kernels {_kernels()}", flush=True)
    for dtype, mesh_spec, with_spec in groups:
        grow = args.devices if args.weak_scaling and mesh_spec.startswith("data=") else 1
        batch, group_prompts = args.batch * grow, [prompts[i % len(prompts)] for i in range(args.n_prompts * grow)]
        elapsed = time.perf_counter() - t_start
        if elapsed + last_group_s > args.time_budget_s:
            print(f"skip {dtype} mesh '{mesh_spec}': {elapsed:.0f}s used of {args.time_budget_s:.0f}s", flush=True)
            continue
        t_group = time.perf_counter()
        mesh = parse_mesh(mesh_spec or None)
        p = cast_params(params, jax.numpy.dtype(dtype))
        methods = [JspecMethod(p, cfg, parse_method_spec("ar"), dtype=dtype, batch=batch,
                               max_new_tokens=args.max_new_tokens, generate_kwargs={"mesh": mesh})]
        if with_spec:
            dparams = None if dparams_f32 is None else cast_params(dparams_f32, jax.numpy.dtype(dtype))
            methods.append(JspecMethod(p, cfg, spec, dtype=dtype, batch=batch, max_new_tokens=args.max_new_tokens,
                                       generate_kwargs={"mesh": mesh, "drafter": drafter, "drafter_params": dparams,
                                                        "k_max": args.k_max}))
        runs = [run_method(m, group_prompts) for m in methods]
        for r in runs:
            row = make_row(ctx, r, task=args.task, ar_run=runs[0], hf_run=None)
            row["kernels"] = _kernels(mesh)
            row["rows_per_device"] = batch // max(1, axis_size(mesh, "data"))
            outputs[len(rows)] = r.outputs
            rows.append(row)
            print(f"  {dtype:8s} {mesh_label(mesh) or 'one device':16s} {row['name']:24s} "
                  f"{row['tokens_per_s']:9.1f} tok/s  acc.len {row['mean_accepted_tokens']:.2f}  "
                  f"compile {row['compile_s']:.1f}s", flush=True)
        add_cross_device_fields(rows, outputs)
        (out / "parallel.json").write_text(json.dumps(rows, indent=1) + "\n")
        last_group_s = time.perf_counter() - t_group
    for r in rows:
        if r["mesh"]:
            print(f"  {r['name']} {r['dtype']} @ {r['mesh']}: {r['speedup_vs_1_device']:.2f}x one device, "
                  f"identical outputs {r['identical_to_1_device']:.2f}", flush=True)
    print(f"rows: {out / 'parallel.json'} ({time.perf_counter() - t_start:.0f}s)", flush=True)
    return rows


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    return run_parallel_bench(add_parallel_args(argparse.ArgumentParser(description=__doc__)).parse_args(argv))
