#!/usr/bin/env python
"""Distil, train, benchmark: the EAGLE-3 head pipeline on the GPUs of one host, with jspec installed.

    python scripts/gpu_pipeline.py distill  --target T --corpus C --out RUN [--devices N] [--budget-s S]
    python scripts/gpu_pipeline.py train    --target T --out RUN [--data DIR] [--devices N] [--budget-s S]
                                            [--init-head DIR]
    python scripts/gpu_pipeline.py bench    --target T --head DIR --out RUN [--devices N]
    python scripts/gpu_pipeline.py pipeline --target T --corpus C --out RUN [--devices N]
                                            [--distill-s S] [--train-s S] [--init-head DIR]

Every step is a `jspec` command on paths (`--dry-run` prints them instead of running them):
  distill   `jspec distill` on the first N GPUs (default all): RUN/data
  train     `jspec train-head` data parallel on the first N GPUs (resumable, the step count fitted
            to --budget-s), then `jspec train-ldlp` for the exported head: RUN/eagle3/eagle
  bench     `jspec bench` groups, one process per GPU (round robin over N): MT-Bench at batch 1 (AR,
            the head's K = 6 chain, its EAGLE-2 tree, LDLP when the head has a predictor), HumanEval
            at batch 1 (AR and the tree), MT-Bench at batch 8/16/32 with the `auto` policies;
            results under RUN/bench/<group>/ (rows.json, table.md)
  pipeline  distill -> train -> bench, each on all N GPUs in turn

The recipe is training/<recipe>.json for the target (SmolLM2: smollm2-eagle3-corpus.json; Gemma-3:
gemma3-eagle3-corpus.json; Qwen2.5-Coder 1.5B: qwen2.5-coder-1.5b-eagle3-corpus.json) unless --recipe
says otherwise. The prompt corpus comes from
`jspec build-corpus --target T --out C` (training/README.md). Logs go beside the outputs
(RUN/*.log); a step that fails stops the pipeline with its exit code.
"""

from __future__ import annotations

import argparse
import os
import shlex
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from jspec.local_gpus import gpu_ids  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
RECIPES = {"smollm2-135m-instruct": "training/smollm2-eagle3-corpus.json", "gemma3-270m": "training/gemma3-eagle3-corpus.json",
           "qwen2.5-coder-1.5b-instruct": "training/qwen2.5-coder-1.5b-eagle3-corpus.json"}
JSPEC = [sys.executable, "-m", "jspec.cli"]  # the installed jspec, run by this interpreter


class Runner:
    """Runs (or, dry, prints) `jspec` commands on chosen GPUs, each logged to a file."""

    def __init__(self, dry_run: bool):
        self.dry_run = dry_run

    def start(self, argv: list[str], gpus: list[int], log: Path) -> subprocess.Popen | None:
        env_text = f"CUDA_VISIBLE_DEVICES={','.join(map(str, gpus))}"
        print(f"{env_text} {shlex.join(argv)} > {log}", flush=True)
        if self.dry_run:
            return None
        log.parent.mkdir(parents=True, exist_ok=True)
        env = {**os.environ, "CUDA_VISIBLE_DEVICES": ",".join(map(str, gpus)), "PYTHONUNBUFFERED": "1"}
        return subprocess.Popen(argv, env=env, stdout=open(log, "w"), stderr=subprocess.STDOUT)

    def wait(self, procs: list[subprocess.Popen | None]) -> None:
        codes = [p.wait() for p in procs if p is not None]
        bad = [c for c in codes if c]
        if bad:
            sys.exit(f"gpu_pipeline: a step exited with {bad[0]}; see its log")

    def run(self, argv: list[str], gpus: list[int], log: Path) -> None:
        self.wait([self.start(argv, gpus, log)])


def distill(a, r: Runner) -> None:
    r.run(JSPEC + ["distill", "--target", a.target, "--recipe", a.recipe, "--corpus", a.corpus, "--out",
                   str(a.out / "data"), "--time-budget-s", str(a.budget_s)], a.gpus, a.out / "distill.log")


def train(a, r: Runner) -> None:
    data = a.data or str(a.out / "data")
    run = a.out / "eagle3"
    # a head trained on: its vocabulary kept, a lower peak rate and a short warm-up (the shipped heads' v2+)
    init = ["--init-head", a.init_head, "--lr", "3e-4", "--warmup-ratio", "0.03"] if a.init_head else []
    r.run(JSPEC + ["train-head", "--target", a.target, "--recipe", a.recipe, "--data", data, "--out", str(run),
                   "--resume", "--fit-steps-to-budget", "--time-budget-s", str(a.budget_s), "--no-progress", *init],
          a.gpus, a.out / "train.log")
    r.run(JSPEC + ["train-ldlp", "--target", a.target, "--head", str(run / "eagle"), "--data", data],
          a.gpus[:1], a.out / "ldlp.log")


def bench_groups(a) -> list[tuple[str, list[str]]]:
    """(name, bench arguments) per group, each group one process on one GPU."""
    head = a.head or str(a.out / "eagle3" / "eagle")
    h = f"eagle3:{head}"
    b1 = f"ar,spec:{h}:static:k=6,spec:{h}:static:tree"
    if a.dry_run or (Path(head) / "ldlp.safetensors").is_file():
        b1 += f",spec:{h}:ldlp"
    common = ["--model", a.target, "--max-new-tokens", "256", "--dtype", "bfloat16", "--no-plots"]
    return [
        ("mt_bench_b1", common + ["--tasks", "mt_bench", "--batch", "1", "--methods", b1, "--round-cost", "1"]),
        ("humaneval_b1", common + ["--tasks", "humaneval", "--batch", "1", "--methods", f"ar,spec:{h}:static:tree"]),
        ("mt_bench_auto", common + ["--tasks", "mt_bench", "--batch", "8,16,32", "--methods",
                                    f"ar,spec:{h}:auto,spec:{h}:auto:tree,spec:ngram:auto"]),
    ]


def bench(a, r: Runner) -> None:
    groups = bench_groups(a)
    for first in range(0, len(groups), len(a.gpus)):  # one group per GPU at a time
        procs = []
        for gpu, (name, args) in zip(a.gpus, groups[first:first + len(a.gpus)]):
            out = a.out / "bench" / name
            procs.append(r.start(JSPEC + ["bench", *args, "--out", str(out)], [gpu], a.out / "bench" / f"{name}.log"))
        r.wait(procs)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("step", choices=["distill", "train", "bench", "pipeline"])
    p.add_argument("--target", default="smollm2-135m-instruct", help="preset name or checkpoint path")
    p.add_argument("--out", required=True, type=Path, help="run directory: data/, eagle3/, bench/ and the logs")
    p.add_argument("--corpus", help="distill, pipeline: the prompt corpus (jspec build-corpus)")
    p.add_argument("--data", help="train: the distilled dataset (default RUN/data)")
    p.add_argument("--head", help="bench: the EAGLE-3 head directory (default RUN/eagle3/eagle)")
    p.add_argument("--recipe", help="training recipe (default: training/ for the target)")
    p.add_argument("--init-head", help="train, pipeline: continue training this exported head")
    p.add_argument("--devices", type=int, default=None, help="GPUs to use, the first N (default: all)")
    p.add_argument("--budget-s", type=int, default=540, help="distill / train: time budget in seconds")
    p.add_argument("--distill-s", type=int, default=210, help="pipeline: distillation budget")
    p.add_argument("--train-s", type=int, default=600, help="pipeline: training budget")
    p.add_argument("--dry-run", action="store_true", help="print the commands instead of running them")
    a = p.parse_args(argv)
    if a.devices is not None and a.devices < 1:
        p.error(f"--devices must be >= 1, got {a.devices}")
    try:
        a.gpus = gpu_ids(a.devices)
    except ValueError as e:
        p.error(f"--devices {a.devices}: {e}")
    if a.recipe is None and a.target not in RECIPES:
        p.error(f"no recipe ships for {a.target!r}: pass --recipe (training/*.json)")
    a.recipe = a.recipe or str(ROOT / RECIPES[a.target])
    if a.step in ("distill", "pipeline") and not a.corpus:
        p.error(f"{a.step} needs --corpus (jspec build-corpus --target {a.target} --out CORPUS)")
    r = Runner(a.dry_run)
    if a.step == "distill":
        distill(a, r)
    elif a.step == "train":
        train(a, r)
    elif a.step == "bench":
        bench(a, r)
    else:
        a.budget_s = a.distill_s
        distill(a, r)
        a.budget_s = a.train_s
        train(a, r)
        bench(a, r)
    return 0


if __name__ == "__main__":
    from jspec.cli import report_user_errors

    raise SystemExit(report_user_errors(main, "gpu_pipeline.py"))
