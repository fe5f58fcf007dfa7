"""Train SpecBranch's H-RAD classifier (jspec.train.hrad) for a target and its draft model.

    python scripts/train_hrad.py --target smollm2-135m-instruct --drafter model:DRAFT_DIR \
        --data DATA_DIR --out OUT --time-budget-s 240

DATA_DIR: distilled shards (the draft model's data). Writes OUT/hrad (hrad.safetensors + hrad.json;
use it as SpecBranch's `hrad_params`, bench_pearl.py --hrad OUT/hrad) and OUT/metrics.json
(held-out accuracy against the majority class, class frequencies, confusion matrix).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from jspec.errors import UsageError  # noqa: E402


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", required=True, help="target preset or checkpoint path")
    ap.add_argument("--drafter", required=True, help="model:PATH (the draft model SpecBranch drafts with)")
    ap.add_argument("--data", required=True, help="distilled dataset directory")
    ap.add_argument("--out", required=True)
    ap.add_argument("--time-budget-s", type=float, default=None)
    ap.add_argument("--steps", type=int, default=None, help="step cap (default: 100000 with a budget, else 500)")
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--dtype", default=None, help="compute dtype (default bfloat16 on GPU, float32 on CPU)")
    args = ap.parse_args(argv)
    if not args.drafter.startswith("model"):
        raise UsageError(f"--drafter must be a draft model (model:PATH), got {args.drafter!r}")
    from jspec.train.shards import require_dataset

    require_dataset(args.data)

    import jax

    from jspec.presets import resolve_model
    from jspec.speculative.factory import build_drafter
    from jspec.train.hrad import HradTrainConfig, train_hrad

    tcfg, tparams, _ = resolve_model(args.target, dtype="float32", tokenizer=False)
    drafter, dparams = build_drafter(args.drafter, tcfg, tparams, model_name=args.target)
    dtype = args.dtype or ("float32" if jax.default_backend() == "cpu" else "bfloat16")
    hc = HradTrainConfig(batch_size=args.batch_size, seq_len=args.seq_len, lr=args.lr, compute_dtype=dtype,
                         steps=args.steps or (100_000 if args.time_budget_s else 500), time_budget_s=args.time_budget_s)
    summary = train_hrad(tcfg, tparams, drafter.cfg, dparams, args.data, args.out, hc, drafter_spec=args.drafter)
    print(json.dumps({k: summary.get(k) for k in ("steps", "train_s", "last", "held_out")}, indent=1))


if __name__ == "__main__":
    from jspec.cli import report_user_errors

    raise SystemExit(report_user_errors(main, "train_hrad.py"))
