"""Train SpecBranch's H-RAD classifier (jspec.heads.hrad) for a target and a draft model.

    python scripts/train_hrad.py --target smollm2-135m-instruct --drafter model:DRAFT_DIR \
        --data DATA --out OUT --time-budget-s 240

Examples come from the distilled rows (the draft-model trainer's data, jspec.train.draft_model
.load_packed), labelled by teacher forcing [I: the paper trains on logged decoding rounds; for
greedy decoding these labels are what a logged round would record]: at every response position t
with token x_{t+1} as the branch head, the input is (the target's four feature layers at t,
embedding of x_{t+1}) and the label is the class of the number of consecutive positions after
the head at which the draft model's argmax equals the target's argmax, {0, 1–6, ≥ 7}. The target
and the draft model run frozen inside the jitted step, so no features are stored.

Loss: cross-entropy over counted positions; AdamW (lr 1e-3, constant) [I: the paper trains 20
epochs at batch 32]; dropout 0.2 as in the authors' network. Writes OUT/hrad (hrad.safetensors +
hrad.json) and OUT/metrics.json (held-out accuracy, class frequencies, a confusion matrix).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

from .. import model as M
from ..config import ModelConfig
from ..heads import hrad as HR
from .draft_model import PackedLoader, load_packed


@dataclasses.dataclass(frozen=True)
class HradTrainConfig:
    batch_size: int = 16
    seq_len: int = 512
    steps: int = 100_000  # an upper bound when time_budget_s is set
    time_budget_s: float | None = None
    lr: float = 1e-3
    weight_decay: float = 0.01
    dropout: float = 0.2
    eval_rows: int = 64
    compute_dtype: str = "bfloat16"
    log_every: int = 20
    seed: int = 0


def _forward(params, cfg, tokens, capture=()):
    B, T = tokens.shape
    return M.forward(params, cfg, tokens, M.init_cache(cfg, B, T, params["embed"].dtype), capture=capture, kernels="xla")


def examples(tparams, tcfg: ModelConfig, dparams, dcfg: ModelConfig, tokens, loss_mask):
    """(pre-features [B, T, H1], head embeddings [B, T, D], labels [B, T], counted [B, T]) for the
    head at t + 1 behind position t."""
    out = _forward(tparams, tcfg, tokens, HR.feature_layers(tcfg))
    t_top = jnp.argmax(M.lm_head(tparams, tcfg, out.hidden), -1)
    d_top = jnp.argmax(M.lm_head(dparams, dcfg, _forward(dparams, dcfg, tokens).hidden), -1)
    match = (t_top == d_top).astype(jnp.int32)  # [B, T]: the draft would be accepted at t + 1

    def run(nxt, m):  # consecutive matches from position i on, right to left
        r = m * (1 + nxt)
        return r, r

    _, runs = jax.lax.scan(run, jnp.zeros(tokens.shape[0], jnp.int32), match.T, reverse=True)
    runs = runs.T  # runs[b, i]: accepted drafts starting with the one predicted at i
    # head x_{t+1}; its continuation is predicted from t+1 on
    labels = HR.label_of(jnp.pad(runs[:, 1:], ((0, 0), (0, 1))))
    counted = jnp.pad(loss_mask[:, 1:], ((0, 0), (0, 1))) & jnp.pad(loss_mask[:, 2:], ((0, 0), (0, 2)))
    feats = jax.lax.stop_gradient(HR.target_features(out.captured, out.hidden))
    head_emb = tparams["embed"][jnp.pad(tokens[:, 1:], ((0, 0), (0, 1)))]
    return feats, head_emb, labels, counted


def _loss(hp, feats, head_emb, labels, counted, key, rate):
    logits = HR.classify(hp, HR.pre_features(hp, feats), head_emb, dropout_key=key, rate=rate)
    ce = optax.softmax_cross_entropy_with_integer_labels(logits, labels)
    m = counted.astype(jnp.float32)
    acc = (jnp.argmax(logits, -1) == labels).astype(jnp.float32)
    n = jnp.maximum(m.sum(), 1.0)
    return jnp.sum(ce * m) / n, {"loss": jnp.sum(ce * m) / n, "acc": jnp.sum(acc * m) / n}


@functools.partial(jax.jit, static_argnames=("tcfg", "dcfg", "hc"), donate_argnames=("state",))
def train_step(state, tparams, dparams, tokens, loss_mask, key, *, tcfg, dcfg, hc: HradTrainConfig):
    feats, emb, labels, counted = examples(tparams, tcfg, dparams, dcfg, tokens, loss_mask)
    (_, metrics), grads = jax.value_and_grad(_loss, has_aux=True)(state["hp"], feats, emb, labels, counted, key, hc.dropout)
    opt = optax.adamw(hc.lr, weight_decay=hc.weight_decay)
    updates, opt_state = opt.update(grads, state["opt"], state["hp"])
    return {"hp": optax.apply_updates(state["hp"], updates), "opt": opt_state}, metrics


@functools.partial(jax.jit, static_argnames=("tcfg", "dcfg"))
def _eval_step(hp, tparams, dparams, tokens, loss_mask, *, tcfg, dcfg):
    feats, emb, labels, counted = examples(tparams, tcfg, dparams, dcfg, tokens, loss_mask)
    pred = jnp.argmax(HR.classify(hp, HR.pre_features(hp, feats), emb), -1)
    conf = jnp.zeros((HR.NUM_CLASSES, HR.NUM_CLASSES), jnp.int32)
    return conf.at[labels, pred].add(counted.astype(jnp.int32))


def evaluate(hp, tparams, tcfg, dparams, dcfg, rows: dict, batch: int) -> dict:
    """Held-out accuracy, class frequencies and the confusion matrix (rows: true class)."""
    if not rows:
        return {}
    conf = np.zeros((HR.NUM_CLASSES, HR.NUM_CLASSES), np.int64)
    for i in range(0, len(rows["tokens"]) - batch + 1 or 1, batch):
        conf += np.asarray(_eval_step(hp, tparams, dparams, jnp.asarray(rows["tokens"][i : i + batch]),
                                      jnp.asarray(rows["loss_mask"][i : i + batch]), tcfg=tcfg, dcfg=dcfg))
    n = max(int(conf.sum()), 1)
    return {"accuracy": float(np.trace(conf) / n), "class_freq": (conf.sum(1) / n).tolist(),
            "majority_accuracy": float(conf.sum(1).max() / n), "confusion": conf.tolist(), "positions": int(conf.sum())}


def train_hrad(tcfg: ModelConfig, tparams: dict, dcfg: ModelConfig, dparams: dict, data_dir: str, out_dir: str,
               hc: HradTrainConfig, *, drafter_spec: str = "", progress: bool = True) -> dict:
    """Train, write OUT/hrad and OUT/metrics.json; returns the summary."""
    t_start = time.perf_counter()
    deadline = t_start + hc.time_budget_s if hc.time_budget_s else math.inf
    os.makedirs(out_dir, exist_ok=True)
    dtype = jnp.dtype(hc.compute_dtype)
    tparams, dparams = M.cast_params(tparams, dtype), M.cast_params(dparams, dtype)
    rows = load_packed(data_dir, hc.seq_len, "train")
    if not rows:
        raise ValueError(f"{data_dir}: no training rows")
    held = load_packed(data_dir, hc.seq_len, "holdout") or load_packed(data_dir, hc.seq_len, "eval")
    held = {k: v[: hc.eval_rows] for k, v in held.items()} if held else {}
    loader = PackedLoader(rows, hc.batch_size, hc.seed)
    hp = HR.init_hrad(jax.random.PRNGKey(hc.seed), tcfg)
    state = {"hp": hp, "opt": optax.adamw(hc.lr, weight_decay=hc.weight_decay).init(hp)}
    reserve = 30.0 if hc.time_budget_s and hc.time_budget_s > 90 else 0.0
    step, history, pending, times = 0, [], [], []
    key = jax.random.PRNGKey(hc.seed + 1)
    while step < hc.steps:
        now = time.perf_counter()
        if now + (float(np.median(times[-20:])) if times else 0.0) > deadline - reserve:
            break
        b = loader(step)
        state, metrics = train_step(state, tparams, dparams, jnp.asarray(b["tokens"]), jnp.asarray(b["loss_mask"]),
                                    jax.random.fold_in(key, step), tcfg=tcfg, dcfg=dcfg, hc=hc)
        jax.block_until_ready(metrics)
        if step:
            times.append(time.perf_counter() - now)
        pending.append(metrics)
        step += 1
        if step % hc.log_every == 0:
            ms = jax.device_get(pending)
            pending = []
            row = {"step": step, "loss": float(np.mean([m["loss"] for m in ms])), "acc": float(np.mean([m["acc"] for m in ms])),
                   "elapsed_s": time.perf_counter() - t_start}
            history.append(row)
            if progress:
                print(f"step {step} loss {row['loss']:.3f} acc {row['acc']:.3f}", flush=True)
    hp = jax.device_get(state["hp"])
    summary = {"steps": step, "batch_size": hc.batch_size, "seq_len": hc.seq_len, "drafter": drafter_spec,
               "last": history[-1] if history else None,
               "held_out": evaluate(hp, tparams, tcfg, dparams, dcfg, held, hc.batch_size) if held else {},
               "train_s": time.perf_counter() - t_start}
    HR.save_hrad(os.path.join(out_dir, "hrad"), hp, tcfg, {"drafter": drafter_spec, "steps": step,
                                                           "held_out_accuracy": summary["held_out"].get("accuracy")})
    with open(os.path.join(out_dir, "metrics.json"), "w") as fh:
        json.dump(summary, fh, indent=1)
    return summary
