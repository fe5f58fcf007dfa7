"""Count the target's answer tokens, which a draft model's draft vocabulary ranks by
(`--draft-vocab N`, FR-Spec: ModelDrafter.draft_vocab).

    python scripts/token_counts.py --model qwen2.5-coder-1.5b-instruct --data runs/q2/data

DATA: one or more distilled datasets (`jspec distill`: the target answering training prompts,
never the evaluation sets). Counts the training split's response tokens and writes them to the
preset's folder as token_counts.npz (`--out` elsewhere), then prints how much of the hold-out
split's response tokens the most frequent N cover, for a few N.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from jspec.errors import UsageError  # noqa: E402

SIZES = (8192, 16384, 32768, 49152, 65536)


def coverage(counts: np.ndarray, holdout: np.ndarray, sizes=SIZES) -> dict[int, float]:
    """Share of the hold-out tokens inside the `n` most frequent ids of `counts`, per n."""
    from jspec.heads.eagle import draft_vocab_from_counts

    total = max(int(holdout.sum()), 1)
    return {n: round(float(holdout[np.asarray(draft_vocab_from_counts(counts, n)[0])].sum()) / total, 4)
            for n in sizes if n <= len(counts)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="the target's preset (its vocabulary; where the counts go)")
    ap.add_argument("--data", required=True, action="append", help="a distilled dataset directory (repeatable)")
    ap.add_argument("--out", default=None, help="output file (default: models/<preset>/token_counts.npz)")
    a = ap.parse_args(argv)
    from jspec.presets import list_presets, models_dir, resolve_config
    from jspec.speculative.factory import TOKEN_COUNTS_FILE
    from jspec.train import shards as S

    cfg = resolve_config(a.model)
    out = a.out or (str(models_dir() / a.model / TOKEN_COUNTS_FILE) if a.model in list_presets() else None)
    if out is None:
        raise UsageError(f"--model {a.model} is not a preset: give --out FILE")
    for d in a.data:
        S.require_dataset(d)
        vocab = S.read_meta(d)["vocab_size"]
        if vocab != cfg.vocab_size:
            raise UsageError(f"--data {d}: a dataset of a {vocab}-token vocabulary, and {a.model} has {cfg.vocab_size}")
    counts = sum(S.response_token_counts(d, cfg.vocab_size, "train") for d in a.data)
    holdout = sum(S.response_token_counts(d, cfg.vocab_size, "holdout") for d in a.data)
    source = {"data": [os.path.basename(os.path.normpath(d)) for d in a.data], "split": "train",
              "tokens": int(counts.sum()), "distinct": int((counts > 0).sum())}
    np.savez_compressed(out, counts=counts.astype(np.int32 if counts.max() < 2**31 else np.int64),
                        source=np.asarray(json.dumps(source)))
    print(f"wrote {out}: {source['tokens']:,} response tokens, {source['distinct']:,} distinct ids")
    print(json.dumps({"holdout_tokens": int(holdout.sum()), "holdout_coverage": coverage(counts, holdout)}))
    return 0


if __name__ == "__main__":
    from jspec.cli import report_user_errors

    raise SystemExit(report_user_errors(main, "token_counts.py"))
