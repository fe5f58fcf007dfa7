"""Measure the `auto` policy's per-card cost table with random weights of a preset's shape.

Timing does not depend on the weights' values, so a new card's table can be measured without its
checkpoint. One process measures every batch size the planner's committed tables hold
(1, 8, 16, 32, 64; each timing the median of --reps loops, with the spread recorded) and writes
them where the planner reads them, models/<preset>/round_cost_<card>.json (merged per batch into
a table of the same version already there):

    python3 scripts/measure_card_costs.py
    python3 scripts/measure_card_costs.py --gpus 4    # the batch sizes spread over 4 GPUs of one host, merged
                                                      # into the table as each one is measured
    python3 scripts/measure_card_costs.py --batch 16 --out /tmp/b16.json     # one batch size elsewhere
    python3 scripts/measure_card_costs.py --merge /tmp/b*.json --out models/smollm2-135m-instruct/round_cost_<card>.json
    python3 scripts/measure_card_costs.py --context 2048 --gpus 4    # add context_us (long-prompt slopes) to the table
    python3 scripts/measure_card_costs.py --sampled 1.0 --batch 1 16 # add sampled_us (what sampling adds) to the table

The shape is SmolLM2-135M's with an EAGLE-3 head (the shipped preset's drafter).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import jax
import jax.numpy as jnp

from jspec import model as M
from jspec.local_gpus import gpu_ids
from jspec.bench.round_cost import (CONTEXT_BASE, load_card_costs, measure_batch_costs, measure_context_costs, sampled_us,
                                    save_card_costs)
from jspec.sampling import Sampling
from jspec.speculative.policies.auto import cost_table_path
from jspec.config import ModelConfig
from jspec.heads import eagle as H
from jspec.speculative.drafters.eagle import EagleDrafter
from jspec.speculative.engines.tree import TreeConfig

SMOLLM2 = ModelConfig(arch="llama", vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30,
                      num_heads=9, num_kv_heads=3, head_dim=64, rms_norm_eps=1e-5, rope_theta=100000.0,
                      max_position_embeddings=8192, tie_word_embeddings=True, eos_token_ids=())
TABLE_BATCHES = (1, 8, 16, 32, 64)
SHIPPED_HEAD = Path(__file__).resolve().parent.parent / "models" / "smollm2-135m-instruct" / "heads" / "eagle3" / "config.json"


def shipped_head_window() -> int | None:
    """The shipped head's attention window (its config.json): at long contexts its draft steps
    read only that much, and the table's context slopes should say so."""
    if not SHIPPED_HEAD.is_file():
        return None
    return (json.loads(SHIPPED_HEAD.read_text()).get("jspec") or {}).get("attention_window")


def merge(paths: list[str]) -> dict:
    """Union of per-batch tables (each file measured one batch size on the same card)."""
    out: dict = {}
    for p in paths:
        part = json.loads(Path(p).read_text())
        for key, value in part.items():
            if isinstance(value, dict):
                out.setdefault(key, {}).update(value)
            else:
                out.setdefault(key, value)
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, nargs="+", default=list(TABLE_BATCHES), help="batch sizes to measure (default: %(default)s)")
    ap.add_argument("--reps", type=int, default=5, help="timed loops per timing; the table keeps their median")
    ap.add_argument("--draft-vocab", type=int, default=32000)
    ap.add_argument("--merge", nargs="*", help="per-batch tables to merge instead of measuring")
    ap.add_argument("--gpus", type=int, default=1, help="spread the batch sizes over this many GPUs (one process each)")
    ap.add_argument("--preset", default="smollm2-135m-instruct")
    ap.add_argument("--out", default=None, help="default: models/<preset>/round_cost_<this card>.json")
    ap.add_argument("--context", type=int, default=0,
                    help="measure only the long-context slopes (context_us) against a cache of this many tokens and "
                         "add them to the table at --out (e.g. 2048)")
    ap.add_argument("--sampled", type=float, default=0.0, metavar="T",
                    help="measure only what sampling at temperature T adds to AR steps, chain and tree rounds "
                         "(sampled_us) and add it to the table at --out (e.g. 1.0)")
    args = ap.parse_args(argv)
    if args.out is None:
        args.out = str(cost_table_path(args.preset))
    if args.merge:
        save_card_costs(merge(args.merge), Path(args.out))
        print(f"merged {len(args.merge)} tables -> {args.out}")
        return
    if not args.batch or min(args.batch) < 1 or args.reps < 1 or args.gpus < 1:
        sys.exit("measure_card_costs: error: --batch takes positive batch sizes, --reps and --gpus positive counts")
    if args.context and args.context <= CONTEXT_BASE:  # measure_context_costs's rule, checked before any timing
        sys.exit(f"measure_card_costs: error: --context {args.context}: expected more than the base tables' "
                 f"{CONTEXT_BASE} tokens (e.g. 2048)")
    if args.gpus > 1:
        spread(args)
        return
    dtype = jnp.bfloat16 if jax.default_backend() != "cpu" else jnp.float32
    tparams = M.init_params(SMOLLM2, jax.random.PRNGKey(0), dtype)
    hcfg = H.HeadConfig("eagle3", SMOLLM2, draft_vocab_size=args.draft_vocab, attention_window=shipped_head_window())
    hparams = H.init_head(hcfg, jax.random.PRNGKey(1), dtype)
    costs: dict = (load_card_costs(Path(args.out)) or {}) if (args.context or args.sampled) else {}
    for batch in args.batch:  # saved after each batch size: a killed run keeps what it measured
        if args.sampled:  # only sampling's extra cost, added to the table already there
            extra = sampled_us(tparams, SMOLLM2, EagleDrafter(hcfg), hparams, batch=batch,
                               sampling=Sampling(temperature=args.sampled), reps=args.reps)
            for kind, us in extra.items():
                costs.setdefault("sampled_us", {}).setdefault(kind, {})[str(batch)] = round(max(us, 0.0), 1)
        elif args.context:  # only the context slopes, added to the table already there
            measure_context_costs(costs, tparams, SMOLLM2, EagleDrafter(hcfg), hparams, batch=batch, context=args.context,
                                  tree=TreeConfig(), reps=args.reps)
        else:
            measure_batch_costs(costs, tparams, SMOLLM2, EagleDrafter(hcfg), hparams, batch=batch, tree=TreeConfig(),
                                reps=args.reps)
        save_card_costs(costs, Path(args.out))
        print(f"batch {batch} measured -> {args.out}", flush=True)
    print(json.dumps({k: v for k, v in costs.items() if k in ("card", "draft_step_us", "tree_level_us", "spread")}))


def spread(args) -> None:
    """One process per GPU, each measuring every gpus-th batch size into its own file (saved after
    each batch size), merged into --out whenever one of them saves: a run cut short by a time limit
    or a signal keeps every batch size measured so far. A process that fails leaves its batch sizes
    out (named in the message)."""
    try:
        devices = gpu_ids(args.gpus)
    except ValueError as e:
        sys.exit(f"measure_card_costs: error: --gpus {args.gpus}: {e}")
    base = [args.out] if args.context and Path(args.out).is_file() else []  # context slopes join the table there
    with tempfile.TemporaryDirectory() as tmp:
        procs = []
        for gpu in range(args.gpus):
            batches = args.batch[gpu :: args.gpus]
            if not batches:
                continue
            out = Path(tmp) / f"gpu{gpu}.json"
            cmd = [sys.executable, __file__, "--batch", *map(str, batches), "--reps", str(args.reps),
                   "--draft-vocab", str(args.draft_vocab), "--out", str(out), "--context", str(args.context)]
            procs.append((batches, out, subprocess.Popen(cmd, env={**os.environ, "CUDA_VISIBLE_DEVICES": devices[gpu]})))

        def merge_saved(seen: dict) -> None:
            stamps = {out: out.stat().st_mtime_ns for _, out, _ in procs if out.is_file()}
            if stamps and stamps != seen:
                save_card_costs(merge(base + [str(out) for out in stamps]), Path(args.out))
                print(f"merged {len(stamps)} tables -> {args.out}", flush=True)
                seen.clear()
                seen.update(stamps)

        # a time limit's SIGTERM stops the children too, after the last merge
        previous = signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
        seen: dict = {}
        try:
            while any(proc.poll() is None for *_, proc in procs):
                merge_saved(seen)
                time.sleep(2.0)
        finally:
            signal.signal(signal.SIGTERM, previous)
            for *_, proc in procs:
                if proc.poll() is None:
                    proc.terminate()
            merge_saved(seen)
        for batches, out, proc in procs:
            if proc.returncode != 0 or not out.is_file():
                print(f"measure_card_costs: batch sizes {batches} failed (exit {proc.returncode})", file=sys.stderr)


if __name__ == "__main__":
    from jspec.cli import report_user_errors

    raise SystemExit(report_user_errors(main, "measure_card_costs.py"))
