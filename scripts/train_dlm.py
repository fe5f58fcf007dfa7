"""Train the masked-diffusion drafter (DiffuSpec / SSD) on distilled shards, on one device.

    python scripts/train_dlm.py --target smollm2-135m-instruct --data DATA_DIR --out OUT \
        --time-budget-s 390 [--layers 6] [--init prefix] [--resume]

--init ends (default) starts from the target's first and last layers (half each); --init prefix
from its first --layers layers, the target cut at that depth (DiffuSpec's drafters are the AR
model itself adapted to denoise; `--layers` = the target's depth adapts all of it); --init-dlm
PATH trains a DLM written by this script on, on new data (its layers, mask token and blocks). Either way the
network and the file format are the same (jspec.heads.dlm): the layers and final norm, the
embeddings and LM head read from the target at load time. --resume continues the Orbax checkpoint
in OUT/checkpoints (saved every --ckpt-every steps and at the end).

DATA_DIR: distilled shards (jspec.train.shards, "jspec-distill-v2"). Writes OUT/dlm.safetensors
(bfloat16 layers + final norm; embeddings and LM head are the target's and are not shipped; 6
SmolLM2-135M layers = 42 MB), OUT/dlm_metrics.json (training curve, held-out denoising accuracy by
distance from the anchor) and OUT/metrics.jsonl.
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
    ap.add_argument("--data", required=True, help="distilled dataset directory (jspec-distill-v2)")
    ap.add_argument("--out", required=True)
    ap.add_argument("--layers", type=int, default=6, help="DLM layers (default 6: 42 MB in bf16 for SmolLM2-135M)")
    ap.add_argument("--init", choices=("ends", "prefix"), default="ends",
                    help="ends: the target's first and last layers (default); prefix: its first --layers layers")
    ap.add_argument("--init-layers", default=None, help="comma-separated target layer ids to start from")
    ap.add_argument("--init-dlm", default=None, metavar="DLM.safetensors",
                    help="train this DLM on (a fresh schedule over --data) instead of starting from target layers")
    ap.add_argument("--block-size", type=int, default=32, help="inference block (longest draft), default 32")
    ap.add_argument("--time-budget-s", type=float, default=None, help="whole run, evaluation and export included")
    ap.add_argument("--steps", type=int, default=None, help="step cap (default: 100000 with a budget, else 500)")
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--seq-len", type=int, default=384)
    ap.add_argument("--lr", type=float, default=3e-4)
    ap.add_argument("--mask-token-id", type=int, default=None, help="default: smallest id < 256 absent from the data")
    ap.add_argument("--dtype", default=None, help="compute dtype (default bfloat16 on GPU, float32 on CPU)")
    ap.add_argument("--max-mb", type=float, default=60.0, help="fail before training if the weights would exceed this")
    ap.add_argument("--resume", action="store_true", help="continue from OUT/checkpoints")
    ap.add_argument("--ckpt-every", type=int, default=1000, help="checkpoint every N steps (and at the end)")
    ap.add_argument("--no-progress", action="store_true")
    args = ap.parse_args(argv)
    if args.layers < 1:
        raise UsageError(f"--layers must be >= 1, got {args.layers}")
    from jspec.train.shards import require_dataset

    require_dataset(args.data)

    if args.init_layers and args.init != "ends":
        raise UsageError("--init-layers names the layers itself; leave --init at its default")
    if args.init_dlm and not os.path.isfile(args.init_dlm):
        raise UsageError(f"--init-dlm {args.init_dlm}: no such file")
    if args.init_dlm and (args.init_layers or args.init != "ends" or args.resume):
        raise UsageError("--init-dlm takes its layers from the file: drop --init, --init-layers "
                         "and --resume")

    import jax

    from jspec.heads.dlm import load_dlm
    from jspec.presets import resolve_config, resolve_model
    from jspec.train.dlm import DLMTrainConfig, train_dlm

    depth = resolve_config(args.target).num_layers
    if args.init == "prefix" and args.layers > depth:
        raise UsageError(f"--init prefix --layers {args.layers}: the target has {depth} layers")
    tcfg, tparams, _ = resolve_model(args.target, dtype="float32", tokenizer=False)
    init_layers = tuple(int(x) for x in args.init_layers.split(",")) if args.init_layers else None
    if args.init == "prefix":
        init_layers = tuple(range(args.layers))
    n_layers = len(init_layers) if init_layers else args.layers
    init_own, mask_id, blocks = None, args.mask_token_id, tuple(sorted({8, args.block_size}))
    if args.init_dlm:
        try:
            dcfg, init_own = load_dlm(args.init_dlm, tcfg)
        except ValueError as e:
            raise UsageError(f"--init-dlm {e}") from None
        n_layers, init_layers, mask_id = dcfg.num_layers, dcfg.init_layers, dcfg.mask_token_id
        blocks, args.block_size = tuple(dcfg.train_block_sizes), dcfg.block_size
    per_layer = sum(int(v[0].size) for v in tparams["layers"].values())
    mb = (n_layers * per_layer + tcfg.hidden_size) * 2 / 1e6
    if mb > args.max_mb:
        raise UsageError(f"{n_layers} layers are {mb:.1f} MB in bf16, over --max-mb {args.max_mb}")
    dtype = args.dtype or ("float32" if jax.default_backend() == "cpu" else "bfloat16")
    tc = DLMTrainConfig(
        num_layers=n_layers, init_layers=init_layers, block_size=args.block_size, batch_size=args.batch_size,
        seq_len=args.seq_len, lr=args.lr, steps=args.steps or (100_000 if args.time_budget_s else 500),
        time_budget_s=args.time_budget_s, compute_dtype=dtype, mask_token_id=mask_id,
        train_block_sizes=blocks, ckpt_every=args.ckpt_every,
    )
    summary = train_dlm(tcfg, tparams, args.data, args.out, tc, resume=args.resume, progress=not args.no_progress,
                        init_own=init_own)
    keys = ("steps", "epochs", "train_s", "weights_bytes", "shipped_params")
    print(json.dumps({k: summary.get(k) for k in keys}, indent=1))
    full = summary.get("held_out_full_mask") or {}
    print("held-out full-mask accuracy by distance:", [round(a, 3) if a is not None else None for a in full.get("accuracy_by_distance", [])[:8]])


if __name__ == "__main__":
    from jspec.cli import report_user_errors

    raise SystemExit(report_user_errors(main, "train_dlm.py"))
