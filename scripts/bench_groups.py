"""Run several `jspec bench` groups on the GPUs of one host: one process per GPU, in waves.

Each group is one `jspec bench` command line (its methods share a process, so their ratios are
comparable). A wave starts one group per GPU (CUDA_VISIBLE_DEVICES), and its processes start their
timed passes together once all have compiled (`--timing-barrier`): a process timing while another
compiles measures lower. Results go to OUT/<name>/ (rows.json, table.md), logs to OUT/<name>.log.

    python scripts/bench_groups.py --gpus 2 --out R \\
        --group "chain=--model smollm2-135m-instruct --tasks mt_bench --batch 1 --methods ar,spec:eagle3:static:k=6,spec:eagle3:auto" \\
        --group "tree=--model smollm2-135m-instruct --tasks mt_bench --batch 1 --methods ar,spec:eagle3:static:tree,spec:eagle3:auto:tree"
"""

from __future__ import annotations

import argparse
import os
import shlex
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from jspec.errors import UsageError  # noqa: E402
from jspec.local_gpus import gpu_ids  # noqa: E402


def parse_group(text: str) -> tuple[str, list[str]]:
    """"NAME=ARGS" -> (NAME, the bench arguments)."""
    name, sep, args = text.partition("=")
    if not sep or not name.isidentifier() or not args.strip():
        raise UsageError(f"--group {text!r}: expected NAME=ARGS (NAME a plain identifier)")
    argv = shlex.split(args)
    if any(a.startswith(("--out", "--timing-barrier")) for a in argv):
        raise UsageError(f"--group {name}: --out and --timing-barrier are set by this script")
    return name, argv


def waves(groups: list[tuple[str, list[str]]], gpus: int, out: Path) -> list[list[tuple[int, str, list[str]]]]:
    """The processes to start, wave by wave: (GPU, group name, full argv)."""
    planned = []
    for w in range(0, len(groups), gpus):
        wave = groups[w : w + gpus]
        barrier = f"{out / '.barrier' / str(w // gpus)}:{len(wave)}"
        planned.append([(gpu, name, [sys.executable, "-m", "jspec.cli", "bench", *argv, "--out", str(out / name),
                                     "--timing-barrier", barrier])
                        for gpu, (name, argv) in enumerate(wave)])
    return planned


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gpus", type=int, default=1, help="processes per wave, one per GPU")
    ap.add_argument("--out", required=True, help="results folder")
    ap.add_argument("--group", action="append", default=[], metavar="NAME=ARGS", help="one jspec bench group (repeat)")
    args = ap.parse_args(argv)
    if args.gpus < 1 or not args.group:
        raise UsageError("need --gpus >= 1 and at least one --group")
    groups = [parse_group(g) for g in args.group]
    if len({n for n, _ in groups}) != len(groups):
        raise UsageError("group names must be unique")
    try:
        gpus = gpu_ids(args.gpus)
    except ValueError as e:
        raise UsageError(f"--gpus {args.gpus}: {e}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    failed = []
    for wave in waves(groups, args.gpus, out):
        procs = []
        for gpu, name, cmd in wave:
            log = open(out / f"{name}.log", "w")
            procs.append((name, log, subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT,
                                                      env={**os.environ, "CUDA_VISIBLE_DEVICES": gpus[gpu]})))
        for name, log, proc in procs:
            rc = proc.wait()
            log.close()
            table = out / name / "table.md"
            print(f"== {name} (exit {rc})")
            print(table.read_text() if table.exists() else (out / f"{name}.log").read_text()[-2000:])
            if rc:
                failed.append(name)
    if failed:
        print(f"failed groups: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    from jspec.cli import report_user_errors

    raise SystemExit(report_user_errors(main, "bench_groups.py"))
