"""`jspec train-ldlp`: AdaEAGLE's draft-length predictor, trained on a real head's acceptance.

    jspec train-ldlp --target smollm2-135m-instruct --head runs/eagle3/eagle --data runs/data

Alignment (one for training and inference; jspec.speculative.policies.ldlp's module doc). When a
chain round starts, the target has read x_0..x_t and verification has just emitted x_{t+1} (the
correction or bonus token, not yet read by the target). The engine hands the policy
    e = embed[x_{t+1}]   the raw embedding row (jspec.speculative.state.round_features)
    f = f_t              the target's final-normed hidden state at position t
which is also the EAGLE head's first input pair: the round's first draft is the head's prediction
from (f_t, x_{t+1}). `round_pairs` builds the same pairs for every position of a sequence.

Labels at every position at once. The head's training-time-test unroll (jspec.heads.eagle.ttt_step)
at step j and position t is the j-th draft of a chain started at (f_t, x_{t+1}), given that the
earlier drafts were x_{t+2}..x_{t+j+1}: exactly the case up to the first rejected draft. So on the
target's greedy answers the label is
    label_t = number of leading steps j < k_max with argmax(head step j at t) == x_{t+j+2}
(counted only while x_{t+j+2} is also the recomputed target argmax and a response token), which is
what greedy verification accepts from a k_max-token chain started at t: AdaEAGLE's "longest common
prefix of the k_max-token draft and the target's output" at every position of every answer.
Only greedy rows are used, from the dataset's held-out shards (the head never trained on them;
its own training shards would overstate acceptance); positions t are where x_{t+1} is an answer
token and the target's argmax.

Training: jspec.speculative.policies.ldlp.train_ldlp (asymmetric L1, λ = 3, AdamW, cosine), on 90%
of the rows, validated on the other 10% (split by row). [I] batch 512 and lr 1e-3 for 5 epochs
(the paper: batch 128, lr 5e-5, 5 epochs, 68k dialogues on 8 GPUs): a predictor trained for a
few thousand steps from the best constant needs the larger step. Reported (ldlp.json "metrics"):
MAE of the rounded, clipped length against the label, the best constant's MAE, and offline
round estimates: tokens per round (min(length, label) + 1) and drafts per round, for LDLP and
for every static K; also on the evaluation prompts' greedy answers (MT-Bench, HumanEval,
chitchat hold-out) when the dataset holds them.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import time

import jax
import jax.numpy as jnp
import numpy as np

from ..checkpoint.eagle_format import EXTRAS_DIR, load_eagle_head
from ..errors import UsageError
from ..heads import eagle as H
from ..model import cast_params
from ..presets import resolve_model
from ..speculative.policies import ldlp as L
from . import losses
from . import shards as S
from .config import TrainConfig


@dataclasses.dataclass(frozen=True)
class LDLPTrainConfig:
    k_max: int = 8
    seq_len: int = 1024
    batch_rows: int = 16
    max_positions: int = 400_000
    eval_positions: int = 100_000
    hidden: int = L.DEFAULT_HIDDEN
    num_layers: int = L.DEFAULT_NUM_LAYERS
    under_weight: float = L.DEFAULT_UNDER_WEIGHT
    epochs: float = 5.0
    batch_size: int = 512
    lr: float = 1e-3
    val_share: float = 0.1
    seed: int = 0


def round_pairs(tparams: dict, tokens: jax.Array, hidden: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(e, f) for every position t of [B, T] tokens: e[:, t] = embed[x_{t+1}] (raw row, as the
    engine passes it), f[:, t] = the target's final-normed hidden state at t."""
    return tparams["embed"][losses.shift_left(tokens, 1)], hidden


def chain_predictions(hcfg: H.HeadConfig, head_params: dict, tparams: dict, tokens: jax.Array, k_max: int,
                      logits_chunk: int = 128):
    """The head's k_max-step draft at every position (TTT unroll, no gradient), in target ids,
    plus the target outputs. Returns (preds [B, T, K] int32, TargetOut)."""
    tc = TrainConfig(kind=hcfg.kind, ttt_steps=1, seq_len=max(tokens.shape[1], 3), logits_chunk=logits_chunk)
    target = losses.target_outputs(hcfg, tc, tparams, tokens)
    dtype = head_params["fc"].dtype
    embeds = H.embed_tokens(tparams, hcfg.target, tokens).astype(dtype)
    feats = target.hidden.astype(dtype) if hcfg.kind == "eagle1" else H.fuse_captured(hcfg, head_params, target.captured)
    first = later = None
    preds = []
    for j in range(k_max):
        feats, first, later = H.ttt_step(hcfg, head_params, losses.shift_left(embeds, j + 1), feats, j, first, later)
        pred = jnp.argmax(H.draft_logits(hcfg, head_params, tparams, feats), -1).astype(jnp.int32)
        preds.append(head_params["d2t"][pred] if hcfg.reduced_vocab else pred)
    return jnp.stack(preds, -1), target


@functools.partial(jax.jit, static_argnames=("hcfg", "k_max", "logits_chunk"))
def label_positions(hcfg: H.HeadConfig, head_params: dict, tparams: dict, tokens: jax.Array, loss_mask: jax.Array,
                    *, k_max: int, logits_chunk: int = 128):
    """(e [B, T, D], f [B, T, D], label [B, T] int32, valid [B, T] bool) for packed greedy rows."""
    preds, target = chain_predictions(hcfg, head_params, tparams, tokens, k_max, logits_chunk)
    match = []
    for j in range(k_max):
        nxt = losses.shift_left(tokens, j + 2)
        ok = (preds[..., j] == nxt) & (nxt == losses.shift_left(target.top, j + 1))
        match.append(ok & losses.shift_left(loss_mask, j + 2, False))
    label = jnp.sum(jnp.cumprod(jnp.stack(match, -1).astype(jnp.int32), -1), -1)
    x1 = losses.shift_left(tokens, 1)
    valid = losses.shift_left(loss_mask, 1, False) & (x1 == target.top)
    e, f = round_pairs(tparams, tokens, target.hidden)
    return e, f, label, valid


def _greedy_rows(data_dir: str, split: str):
    """(prompt + response ids, prompt length, item) of the greedy rows of a split."""
    meta = S.read_meta(data_dir)
    for s in S.shard_files(meta, split):
        rows = S.load_rows(data_dir, s["file"])
        for r in range(len(rows["items"])):
            if float(rows["temperature"][r]) == 0.0:
                yield S.row_tokens(rows, r), int(rows["prompt_lens"][r]), int(rows["items"][r])


def label_split(data_dir: str) -> str:
    """The split LDLP labels: the held-out shards when they hold a greedy row, else the training
    shards. A dataset without greedy rows (e.g. `jspec distill --sample-share 1.0`) has nothing to
    label, since a sampled answer is not what verification accepts: that is an error, raised before
    any model is loaded."""
    for split in ("holdout", "train"):
        if next(_greedy_rows(data_dir, split), None) is not None:
            return split
    raise UsageError(f"{data_dir}: no greedy rows to label (LDLP needs answers distilled at temperature 0; "
                     f"this dataset's are all sampled: distil with --sample-share below 1.0)")


def collect(hcfg, head_params, tparams, data_dir: str, split: str, lc: LDLPTrainConfig, *, limit: int,
            pad_id: int, deadline: float | None = None, log=print) -> dict[str, np.ndarray]:
    """Labelled (e, f) pairs from the greedy rows of a split, up to `limit` positions."""
    es, fs, labels, rows_of = [], [], [], []
    n = 0
    batch: list[tuple[np.ndarray, int, int]] = []

    def flush():
        nonlocal n
        tokens = np.full((lc.batch_rows, lc.seq_len), pad_id, np.int32)
        mask = np.zeros((lc.batch_rows, lc.seq_len), bool)
        for k, (seq, plen, _) in enumerate(batch):
            L_ = min(len(seq), lc.seq_len)
            tokens[k, :L_] = seq[:L_]
            mask[k, min(plen, L_) : L_] = True
        e, f, label, valid = jax.device_get(label_positions(hcfg, head_params, tparams, jnp.asarray(tokens),
                                                            jnp.asarray(mask), k_max=lc.k_max))
        for k, (_, _, item) in enumerate(batch):
            sel = np.flatnonzero(valid[k])
            es.append(np.asarray(e[k, sel], np.float16))
            fs.append(np.asarray(f[k, sel], np.float16))
            labels.append(np.asarray(label[k, sel], np.int8))
            rows_of.append(np.full(len(sel), item, np.int64))
            n += len(sel)
        batch.clear()

    for row in _greedy_rows(data_dir, split):
        batch.append(row)
        if len(batch) == lc.batch_rows:
            flush()
            if n >= limit or (deadline is not None and time.perf_counter() > deadline):
                break
    if batch and n < limit:
        flush()
    if not labels:
        return {"e": np.zeros((0, hcfg.hidden_size), np.float16), "f": np.zeros((0, hcfg.hidden_size), np.float16),
                "label": np.zeros((0,), np.int8), "row": np.zeros((0,), np.int64)}
    out = {"e": np.concatenate(es)[:limit], "f": np.concatenate(fs)[:limit], "label": np.concatenate(labels)[:limit],
           "row": np.concatenate(rows_of)[:limit]}
    log(f"ldlp: {len(out['label']):,} labelled positions from the {split} split (mean label {out['label'].mean():.2f})")
    return out


@functools.partial(jax.jit, static_argnames=("k_max",))
def _lengths(params, e, f, *, k_max: int):
    return L.length_from_prediction(L.ldlp_apply(params, e.astype(jnp.float32), f.astype(jnp.float32)), k_max)


def predicted_lengths(params, e, f, k_max: int, batch: int = 65536) -> np.ndarray:
    """The policy's draft length, clip(round(LDLP(e, f)), 1, k_max), for stored pairs."""
    preds = [np.asarray(_lengths(params, e[i : i + batch], f[i : i + batch], k_max=k_max))
             for i in range(0, len(e), batch)]
    return np.concatenate(preds) if preds else np.zeros((0,), np.int32)


def round_estimates(lengths: np.ndarray, labels: np.ndarray, k_max: int) -> dict:
    """Offline per-round estimates: tokens per round (accepted + 1) and drafts per round, for the
    given lengths and for every static K, averaged over *positions*. That overestimates tokens per
    target call (a long accepted run holds many positions but one round start: 3.0 here against
    1.93 measured at K = 6 for the shipped head); jspec.bench.acceptance walks whole answers as
    the engine does and gives the exact figure. Good for ranking policies, not for reporting."""
    labels = labels.astype(np.int64)
    out = {"ldlp": {"tokens_per_round": float(np.mean(np.minimum(lengths, labels) + 1)),
                    "drafts_per_round": float(np.mean(lengths))}}
    for k in range(1, k_max + 1):
        out[f"static_{k}"] = {"tokens_per_round": float(np.mean(np.minimum(k, labels) + 1)), "drafts_per_round": float(k)}
    return out


def evaluate(params, data: dict, k_max: int, under_weight: float) -> dict:
    labels = data["label"].astype(np.float64)
    if not len(labels):
        return {}
    lengths = predicted_lengths(params, data["e"], data["f"], k_max)
    const = float(np.clip(np.round(np.quantile(labels, under_weight / (1 + under_weight))), 1, k_max))
    hist = np.bincount(data["label"].astype(np.int64), minlength=k_max + 1)
    return {"positions": int(len(labels)), "mean_label": float(labels.mean()),
            "label_histogram": hist.tolist(),
            "mae": float(np.mean(np.abs(lengths - labels))),
            "mae_best_constant": float(np.mean(np.abs(const - labels))), "best_constant": const,
            "mean_predicted_length": float(lengths.mean()),
            "rounds": round_estimates(lengths, data["label"], k_max)}


def fit(data: dict, lc: LDLPTrainConfig, log=print) -> tuple[dict, dict]:
    """Train on 90% of the rows; return (params, metrics on the other 10%)."""
    mixed = (data["row"].astype(np.uint64) * np.uint64(2654435761) + np.uint64(lc.seed)) % np.uint64(1 << 32)
    held = mixed.astype(np.float64) / float(1 << 32) < lc.val_share  # split by row, not by position
    train = {k: v[~held] for k, v in data.items()}
    val = {k: v[held] for k, v in data.items()}
    n = len(train["label"])
    if n == 0:
        raise ValueError("no labelled positions to train LDLP on")
    steps = max(int(lc.epochs * n / lc.batch_size), 1)
    t = time.perf_counter()
    params = L.train_ldlp(train["e"], train["f"], train["label"].astype(np.float32), steps, lc.lr,
                          jax.random.PRNGKey(lc.seed), hidden=lc.hidden, num_layers=lc.num_layers,
                          under_weight=lc.under_weight, batch_size=lc.batch_size)
    params = jax.device_get(params)
    log(f"ldlp: {steps} steps on {n:,} positions in {time.perf_counter() - t:.1f}s")
    return params, {"train": evaluate(params, train, lc.k_max, lc.under_weight),
                    "val": evaluate(params, val, lc.k_max, lc.under_weight), "steps": steps}


def train_ldlp_for_head(hcfg, head_params, tparams, data_dir: str, out_dir: str, lc: LDLPTrainConfig, *,
                        pad_id: int, deadline: float | None = None, split: str | None = None, log=print) -> dict:
    """Collect labels, fit, save (by default in the head's jspec/ subfolder), then evaluate on the evaluation answers.
    `split`: the one `label_split` chose, if the caller already asked it."""
    split = split or label_split(data_dir)
    if split == "train":
        log("ldlp: the dataset has no greedy held-out rows; labelling training rows (acceptance is overstated)")
    collect_deadline = None if deadline is None else time.perf_counter() + 0.6 * (deadline - time.perf_counter())
    data = collect(hcfg, head_params, tparams, data_dir, split, lc, limit=lc.max_positions, pad_id=pad_id,
                   deadline=collect_deadline, log=log)
    params, metrics = fit(data, lc, log)
    config = {"d_model": int(hcfg.hidden_size), "hidden": lc.hidden, "num_layers": lc.num_layers,
              "k_max": lc.k_max, "under_weight": lc.under_weight, "head_kind": hcfg.kind,
              "alignment": "e = embed[x_{t+1}] (raw row), f = final-normed target hidden at t; x_{t+1} = the token "
                           "verification just emitted (jspec.speculative.policies.ldlp)",
              "labels_from": split, "train_config": dataclasses.asdict(lc), "metrics": metrics}
    # saved before the optional evaluation on the evaluation answers, which labels another split
    # (other prompt lengths, new compilations): a time limit then costs its metrics, not the fit
    L.save_ldlp(out_dir, params, config)
    if S.shard_files(S.read_meta(data_dir), "eval") and (deadline is None or time.perf_counter() < deadline):
        ev = collect(hcfg, head_params, tparams, data_dir, "eval", lc, limit=lc.eval_positions, pad_id=pad_id,
                     deadline=deadline, log=log)
        metrics["eval_answers"] = evaluate(params, ev, lc.k_max, lc.under_weight)
        L.save_ldlp(out_dir, params, config)
    v = metrics["val"]
    if v:
        log(f"ldlp: validation MAE {v['mae']:.3f} (best constant {v['mae_best_constant']:.3f}), "
            f"tokens/round {v['rounds']['ldlp']['tokens_per_round']:.2f} with "
            f"{v['rounds']['ldlp']['drafts_per_round']:.2f} drafts; saved to {out_dir}")
    return config


# ---------------------------------------------------------------------------------------------
# Command line
# ---------------------------------------------------------------------------------------------


def add_ldlp_args(p):
    p.add_argument("--target", required=True, help="target preset or path")
    p.add_argument("--head", required=True, help="EAGLE head directory (config.json + model.safetensors)")
    p.add_argument("--data", required=True, help="jspec-distill-v2 dataset (jspec distill)")
    p.add_argument("--out", default=None,
                   help="where ldlp.safetensors / ldlp.json go (default: the head's jspec/ subfolder, which no engine reads)")
    p.add_argument("--time-budget-s", type=float, default=None)
    p.add_argument("--dtype", default="auto", help="target dtype: auto (bf16 on GPU, f32 on CPU), bfloat16, float32")
    for f in dataclasses.fields(LDLPTrainConfig):
        p.add_argument("--" + f.name.replace("_", "-"), type={"int": int, "float": float}[f.type], default=None)
    return p


def run_train_ldlp(args) -> int:
    t0 = time.perf_counter()
    over = {f.name: getattr(args, f.name) for f in dataclasses.fields(LDLPTrainConfig) if getattr(args, f.name) is not None}
    lc = LDLPTrainConfig(**over)
    if lc.k_max < 1 or lc.seq_len < lc.k_max + 2:
        raise UsageError(f"--k-max {lc.k_max} must be >= 1 and --seq-len {lc.seq_len} >= k_max + 2")
    if not os.path.isdir(args.head):
        raise UsageError(f"--head {args.head}: no head directory there (`jspec train-head` exports one)")
    S.require_dataset(args.data)
    split = label_split(args.data)  # a dataset with nothing to label fails here, before the target loads
    dtype = jnp.float32 if args.dtype == "auto" and jax.default_backend() == "cpu" else (
        jnp.bfloat16 if args.dtype == "auto" else jnp.dtype(args.dtype))
    cfg, params, _ = resolve_model(args.target, dtype=dtype, tokenizer=False)
    hcfg, head = load_eagle_head(args.head, cfg)
    head = cast_params(head, dtype)
    deadline = None if args.time_budget_s is None else t0 + args.time_budget_s
    config = train_ldlp_for_head(hcfg, head, params, args.data, args.out or os.path.join(args.head, EXTRAS_DIR), lc, pad_id=cfg.pad_token_id,
                                 deadline=deadline, split=split)
    print(json.dumps({k: config["metrics"][k] for k in ("val", "steps")}))
    return 0


def main(argv=None) -> int:
    import argparse

    parser = add_ldlp_args(argparse.ArgumentParser(prog="jspec train-ldlp", description=__doc__,
                                                   formatter_class=argparse.RawDescriptionHelpFormatter))
    return run_train_ldlp(parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
