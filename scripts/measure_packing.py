"""Useful (non-padding) tokens per train step of a recipe: padded rows (with its length buckets) vs
packed rows (`train.pack_documents`), through the training loader itself. CPU only, no model.

    python scripts/measure_packing.py --recipe training/smollm2-eagle3-corpus.json --data DATA
    python scripts/measure_packing.py --recipe training/smollm2-eagle3-corpus.json   # synthetic rows

Without --data the rows are synthetic, shaped like the data of the shipped SmolLM2 EAGLE-3 head
(its data_report.json: 112,558 training rows averaging 288 tokens after the loop cut, i.e. 62.5%
padding at 768, 0.65% of rows longer than 768): prompts log-normal around 49 tokens (6% of rows
continuations around 400), three responses in four ending on their own (log-normal around 150
tokens), the rest cut by max_new_tokens or the loop cut (uniform 150..512). Only lengths matter.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import tempfile

import numpy as np

from jspec.train.config import load_recipe
from jspec.train.data import ShardedLoader
from jspec.train.shards import RowWriter


def synthetic_rows(n: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    cont = rng.random(n) < 0.06
    prompt = np.where(cont, rng.lognormal(np.log(400), 0.5, n).clip(100, 1024),
                      rng.lognormal(np.log(49), 0.7, n).clip(8, 256)).astype(int)
    ended = rng.random(n) < 0.75
    resp = np.where(ended, rng.lognormal(np.log(150), 0.6, n).clip(4, 511), rng.uniform(150, 512, n)).astype(int)
    return prompt, resp


def write_synthetic(out: str, n: int, vocab: int = 49152) -> None:
    w = RowWriter(out, vocab_size=vocab, pad_id=0, eos_token_ids=[2], sources=["synthetic"], rows_per_shard=2048,
                  holdout_every=0)
    rng = np.random.default_rng(1)
    for k, (p, r) in enumerate(zip(*synthetic_rows(n))):
        toks = rng.integers(3, vocab, p + r)  # random ids: no loops for the loop cut to find
        w.add(toks[:p], toks[p:], item=k, source=0, temperature=0.0, ended=True)
    w.flush()


def measure(data: str, tc, steps: int | None) -> dict:
    loader = ShardedLoader(data, tc.batch_size, tc.seed, seq_len_override=tc.seq_len, loop_cut=tc.loop_cut,
                           length_buckets=tc.length_buckets, pack_documents=tc.pack_documents)
    n = min(steps or loader.steps_in_epoch(0), loader.steps_in_epoch(0))
    useful = padded = docs = 0
    for s in range(n):
        b = loader.batch(s)
        useful += int(b["lengths"].sum())
        padded += b["tokens"].size
        docs += int(b["segment_ids"].max(axis=1).sum())
    return {"steps": n, "useful_tokens_per_step": useful / n, "row_tokens_per_step": padded / n,
            "padding_share": round(1 - useful / padded, 4), "documents_per_step": docs / n}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--recipe", required=True)
    ap.add_argument("--data", default=None, help="a distilled dataset (default: synthetic rows, see above)")
    ap.add_argument("--rows", type=int, default=20480, help="synthetic rows (default %(default)s)")
    ap.add_argument("--steps", type=int, default=None, help="measure the first N steps of epoch 0 (default all)")
    a = ap.parse_args(argv)
    tc = load_recipe(a.recipe).train
    with tempfile.TemporaryDirectory() as tmp:
        data = a.data or tmp
        if a.data is None:
            write_synthetic(tmp, a.rows)
        buckets = tc.length_buckets or (tc.seq_len,)
        padded = measure(data, dataclasses.replace(tc, pack_documents=False, length_buckets=buckets), a.steps)
        packed = measure(data, dataclasses.replace(tc, pack_documents=True, length_buckets=()), a.steps)
    ratio = packed["useful_tokens_per_step"] / padded["useful_tokens_per_step"]
    print(json.dumps({"recipe": a.recipe, "data": a.data or f"synthetic ({a.rows} rows)",
                      "batch_size": tc.batch_size, "seq_len": tc.seq_len, "padded_with_buckets": padded,
                      "packed": packed, "useful_tokens_per_step_ratio": round(ratio, 2)}, indent=1))
    return 0


if __name__ == "__main__":
    from jspec.cli import report_user_errors

    raise SystemExit(report_user_errors(main, "measure_packing.py"))
