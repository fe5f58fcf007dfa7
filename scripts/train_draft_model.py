"""Distil a small tied draft model from the target (jspec.train.draft_model) on one device.

    python scripts/train_draft_model.py --target smollm2-135m-instruct --data DATA_DIR --out OUT \
        --layers 4 --time-budget-s 360

DATA_DIR: distilled shards (jspec distill / scripts/distill_data.py). Writes OUT/draft/
(config.json + bfloat16 model-*.safetensors of at most 15 MB each: layers and final norm, no
embeddings), OUT/metrics.json
(summary: held-out KL, expected acceptance sum(min(p, q)), top-1 agreement, before and after) and
OUT/metrics.jsonl. Use the result as `--drafter model:OUT/draft`.

With --exit-layer E it trains a PPSD exit head instead (jspec.heads.exit_head: one layer behind the
target's layer E, initialised from its last layer, KL to the full model); OUT/draft records E:

    python scripts/train_draft_model.py --target smollm2-135m-instruct --data DATA_DIR --out OUT \
        --exit-layer 15 --time-budget-s 360
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
    ap.add_argument("--data", required=True, help="distilled dataset directory")
    ap.add_argument("--out", required=True)
    ap.add_argument("--layers", type=int, default=4, help="draft layers (default 4)")
    ap.add_argument("--layers-from", default=None, help="comma-separated target layer ids to start from")
    ap.add_argument("--exit-layer", type=int, default=None,
                    help="train a PPSD exit head behind this target layer instead of a draft model")
    ap.add_argument("--time-budget-s", type=float, default=None, help="whole run, export included")
    ap.add_argument("--steps", type=int, default=None, help="step cap (default: 100000 with a budget, else 1000)")
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--lr", type=float, default=4e-4)
    ap.add_argument("--logits-chunk", type=int, default=128)
    ap.add_argument("--dtype", default=None, help="compute dtype (default bfloat16 on GPU, float32 on CPU)")
    ap.add_argument("--ckpt-dir", default=None, help="Orbax checkpoints (default: none)")
    ap.add_argument("--resume", action="store_true", help="continue from --ckpt-dir")
    ap.add_argument("--no-progress", action="store_true")
    args = ap.parse_args(argv)
    if args.layers < 1:
        raise UsageError(f"--layers must be >= 1, got {args.layers}")
    from jspec.train.shards import require_dataset

    require_dataset(args.data)

    import jax

    from jspec.presets import resolve_model
    from jspec.train.draft_model import DraftTrainConfig, train_draft_model

    tcfg, tparams, _ = resolve_model(args.target, dtype="float32", tokenizer=False)
    if args.layers > tcfg.num_layers:
        raise UsageError(f"--layers {args.layers} exceeds the target's {tcfg.num_layers} layers")
    layers_from = tuple(int(x) for x in args.layers_from.split(",")) if args.layers_from else None
    if args.exit_layer is not None and not 1 <= args.exit_layer < tcfg.num_layers:
        raise UsageError(f"--exit-layer must be in [1, {tcfg.num_layers - 1}], got {args.exit_layer}")
    dtype = args.dtype or ("float32" if jax.default_backend() == "cpu" else "bfloat16")
    tc = DraftTrainConfig(
        num_layers=len(layers_from) if layers_from else args.layers, layers_from=layers_from,
        batch_size=args.batch_size, seq_len=args.seq_len, lr=args.lr, logits_chunk=args.logits_chunk,
        steps=args.steps or (100_000 if args.time_budget_s else 1000), time_budget_s=args.time_budget_s,
        compute_dtype=dtype, exit_layer=args.exit_layer,
    )
    summary = train_draft_model(tcfg, tparams, args.data, args.out, tc, ckpt_dir=args.ckpt_dir, resume=args.resume,
                                progress=not args.no_progress)
    print(json.dumps({k: summary.get(k) for k in ("steps", "epochs", "train_s", "held_out_init", "held_out", "weights_bytes")}, indent=1))


if __name__ == "__main__":
    from jspec.cli import report_user_errors

    raise SystemExit(report_user_errors(main, "train_draft_model.py"))
