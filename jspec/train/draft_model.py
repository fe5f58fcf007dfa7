"""Distil a small tied draft model (jspec.heads.draft_model) from the target with KL.

    python scripts/train_draft_model.py --target smollm2-135m-instruct --data DATA --out OUT \
        --layers 4 --time-budget-s 360

Loss: forward KL(p_target || q_draft) at every position whose next token is a response token
(the `loss_mask` of the distilled rows), temperature 1, averaged over counted positions. The
target runs frozen inside the step on the same tokens (its logits are never stored); logits of
both models are computed `logits_chunk` positions at a time under `jax.checkpoint`, so a
[B, T, V] float32 tensor never lives in memory.

Data: the distilled shards of jspec.train.shards ("jspec-distill-v2": rows of prompt + response)
or the older fixed-length "jspec-distill-v1" shards. Rows are packed to `seq_len` once, shuffled
by (seed, epoch) and dealt as global batches: batch `step` is a pure function of the step.

Mesh, optimizer and checkpoints follow head training (jspec.train.step / trainer): a
("data", "fsdp") mesh over every local device, float32 master weights with AdamW after
global-norm clipping, Orbax checkpoints of {params, optimizer state, step}. The learning rate is
an injected hyper-parameter: warm-up then cosine over the *run's progress*, which is the step
fraction, or with `time_budget_s` the elapsed-time fraction, so a budgeted run always ends at the
bottom of its schedule.

Exit heads (PPSD, jspec.heads.exit_head) train with the same loop: `exit_layer=E` makes the
student the target's frozen layers [0, E) (read off the target's own forward, which captures the
input of layer E) followed by the one-layer head; the loss, data, schedule and files are the same,
and the export's `exit_layer` field marks the directory as an exit head.

Outputs in OUT: draft/ (config.json + bfloat16 model-*.safetensors of layers and final norm),
metrics.jsonl (interval means), metrics.json (summary: losses, held-out KL, top-1 agreement with
the target, mean sum(min(p, q)) = the expected per-token acceptance at temperature 1, bytes).
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
from jax.sharding import Mesh

from .. import model as M
from ..checkpoint.draft_format import save_draft_model
from ..config import ModelConfig
from ..heads import draft_model as DM
from ..heads import exit_head as EH
from . import data as D1
from . import shards as D2
from . import step as S
from .loop import run_timed_loop
from .trainer import Checkpointer


@dataclasses.dataclass(frozen=True)
class DraftTrainConfig:
    num_layers: int = 4
    layers_from: tuple[int, ...] | None = None  # default: DM.default_layers_from
    batch_size: int = 16  # global
    seq_len: int = 512
    steps: int = 100_000  # an upper bound when time_budget_s is set
    time_budget_s: float | None = None  # whole run, export included
    lr: float = 4e-4
    warmup_steps: int = 50
    final_lr_fraction: float = 0.1
    weight_decay: float = 0.0
    b1: float = 0.9
    b2: float = 0.95
    grad_clip: float = 1.0
    compute_dtype: str = "bfloat16"
    logits_chunk: int = 128
    log_every: int = 20
    ckpt_every: int = 0  # 0: only at the end
    eval_rows: int = 64  # held-out rows for the summary metrics
    export_dtype: str = "bfloat16"
    seed: int = 0
    exit_layer: int | None = None  # set: train a PPSD exit head behind this layer instead of a draft model


# ---------------------------------------------------------------------------------------------
# Data
# ---------------------------------------------------------------------------------------------


def load_packed(data_dir: str, seq_len: int, split: str = "train") -> dict[str, np.ndarray]:
    """tokens [n, T] int32, loss_mask [n, T] bool, lengths [n] of every row of a split."""
    with open(os.path.join(data_dir, "meta.json")) as fh:
        meta = json.load(fh)
    parts = []
    if meta.get("format") == D2.FORMAT:
        for s in D2.shard_files(meta, split):
            t, m, n = D2.pack_rows(D2.load_rows(data_dir, s["file"]), seq_len, meta.get("pad_id", 0),
                                   loop_cut=D2.LoopCut())
            parts.append((t, m, n))
    elif meta.get("format") == D1.FORMAT:
        if split != "train":
            return {}
        for s in meta["shards"]:
            z = D1.load_shard(data_dir, s["file"])
            t = z["tokens"][:, :seq_len]
            pad = seq_len - t.shape[1]
            m = z["loss_mask"][:, :seq_len]
            if pad > 0:
                t = np.pad(t, ((0, 0), (0, pad)), constant_values=meta["pad_id"])
                m = np.pad(m, ((0, 0), (0, pad)))
            parts.append((t.astype(np.int32), m, np.minimum(z["lengths"], seq_len).astype(np.int32)))
    else:
        raise ValueError(f"{data_dir}: unknown dataset format {meta.get('format')!r}")
    if not parts:
        return {}
    t, m, n = (np.concatenate(x) for x in zip(*parts))
    keep = m.any(axis=1)  # rows whose response was cut away teach nothing
    return {"tokens": t[keep], "loss_mask": m[keep], "lengths": n[keep]}


class PackedLoader:
    """Global batch `step` = rows of a (seed, epoch) permutation; a pure function of the step."""

    def __init__(self, rows: dict[str, np.ndarray], batch: int, seed: int):
        n = len(rows["tokens"])
        if n < batch:
            raise ValueError(f"{n} training rows, fewer than one batch of {batch}")
        self.rows, self.batch, self.seed, self.per_epoch = rows, batch, seed, n // batch
        self._perm: dict[int, np.ndarray] = {}

    def __call__(self, step: int) -> dict[str, np.ndarray]:
        epoch, i = divmod(step, self.per_epoch)
        if epoch not in self._perm:
            self._perm = {epoch: np.random.default_rng([self.seed, epoch]).permutation(len(self.rows["tokens"]))}
        idx = self._perm[epoch][i * self.batch : (i + 1) * self.batch]
        return {k: v[idx] for k, v in self.rows.items()}


# ---------------------------------------------------------------------------------------------
# Loss and step
# ---------------------------------------------------------------------------------------------


def _hidden(params, cfg: ModelConfig, tokens):
    B, T = tokens.shape
    cache = M.init_cache(cfg, B, T, params["embed"].dtype)
    return M.forward(params, cfg, tokens, cache, kernels="xla").hidden


def kl_terms(tparams, tcfg, dparams, dcfg, tokens, loss_mask, chunk: int, exit_layer: int | None = None):
    """Per-position (KL(p||q), sum min(p, q), top-1 agree) [B, T] for predicting x_{t+1}, and the
    counted-position mask [B, T] (x_{t+1} is a response token). With `exit_layer` the student is
    the target's frozen layers [0, E) plus the exit head `dparams`."""
    if exit_layer is None:
        th = jax.lax.stop_gradient(_hidden(tparams, tcfg, tokens))
        dh = _hidden(dparams, dcfg, tokens)
    else:
        B, T = tokens.shape
        full = M.forward(tparams, tcfg, tokens, M.init_cache(tcfg, B, T, tparams["embed"].dtype), capture=(exit_layer,),
                         kernels="xla")
        th, trunk = jax.lax.stop_gradient((full.hidden, full.captured[0]))
        dh = M.forward(dparams, dcfg, None, M.init_cache(dcfg, B, T, dparams["embed"].dtype), hidden_in=trunk,
                       kernels="xla").hidden
    B, T, D = th.shape
    counted = jnp.pad(loss_mask[:, 1:], ((0, 0), (0, 1)))
    c = math.gcd(T, chunk)

    @jax.checkpoint
    def one(args):
        t, d = args  # [B, c, D]
        lp = jax.nn.log_softmax(M.lm_head(tparams, tcfg, t), -1)
        lq = jax.nn.log_softmax(M.lm_head(dparams, dcfg, d), -1)
        p = jnp.exp(lp)
        kl = jnp.sum(p * (lp - lq), -1)
        overlap = jnp.sum(jnp.minimum(p, jnp.exp(lq)), -1)
        agree = (jnp.argmax(lp, -1) == jnp.argmax(lq, -1)).astype(jnp.float32)
        return kl, overlap, agree

    split = lambda h: h.reshape(B, T // c, c, D).swapaxes(0, 1)  # noqa: E731
    kl, overlap, agree = jax.lax.map(one, (split(th), split(dh)))
    join = lambda x: x.swapaxes(0, 1).reshape(B, T)  # noqa: E731
    return join(kl), join(overlap), join(agree), counted


def _masked_mean(x, m):
    return jnp.sum(x * m) / jnp.maximum(jnp.sum(m), 1)


def make_optimizer(tc: DraftTrainConfig) -> optax.GradientTransformation:
    decay_mask = lambda params: jax.tree.map(lambda p: p.ndim >= 2, params)  # noqa: E731
    # Unit learning rate: the step multiplies the updates by the host-chosen lr (AdamW's decay
    # term is scaled by the lr too, so this is AdamW at that lr).
    adamw = optax.adamw(1.0, b1=tc.b1, b2=tc.b2, weight_decay=tc.weight_decay, mask=decay_mask)
    return optax.chain(optax.clip_by_global_norm(tc.grad_clip), adamw)


def _train_step(tcfg, dcfg, tc, mesh, state, tparams, lr, batch):
    dtype = jnp.dtype(tc.compute_dtype)

    def loss_fn(trainable):
        dparams = DM.tie(M.cast_params(trainable, dtype), tparams)
        kl, overlap, agree, m = kl_terms(tparams, tcfg, dparams, dcfg, batch["tokens"], batch["loss_mask"], tc.logits_chunk,
                                         tc.exit_layer)
        m = m.astype(jnp.float32)
        return _masked_mean(kl, m), {"kl": _masked_mean(kl, m), "overlap": _masked_mean(overlap, m),
                                     "agree": _masked_mean(agree, m), "positions": jnp.sum(m)}

    (_, metrics), grads = jax.value_and_grad(loss_fn, has_aux=True)(state["params"])
    opt = make_optimizer(tc)
    updates, opt_state = opt.update(grads, state["opt_state"], state["params"])
    updates = jax.tree.map(lambda u: u * lr, updates)
    new = {"step": state["step"] + 1, "params": optax.apply_updates(state["params"], updates), "opt_state": opt_state}
    new = jax.lax.with_sharding_constraint(new, S.tree_shardings(mesh, new))
    metrics["grad_norm"] = optax.tree.norm(grads)
    return new, metrics


train_step = S.training_jit(_train_step, static_argnums=(0, 1, 2, 3), donate_argnums=(4,))


@functools.partial(jax.jit, static_argnames=("tcfg", "dcfg", "chunk", "exit_layer"))
def _eval_jit(tparams, dparams, tokens, loss_mask, *, tcfg, dcfg, chunk, exit_layer=None):
    return kl_terms(tparams, tcfg, dparams, dcfg, tokens, loss_mask, chunk, exit_layer)


def evaluate(tparams, tcfg, dparams, dcfg, rows: dict, batch: int, chunk: int, exit_layer: int | None = None) -> dict:
    """Held-out KL, overlap (expected acceptance at T=1) and greedy top-1 agreement."""
    if not rows:
        return {}
    fn = functools.partial(_eval_jit, tcfg=tcfg, dcfg=dcfg, chunk=chunk, exit_layer=exit_layer)
    sums = np.zeros(3)
    count = 0.0
    for i in range(0, len(rows["tokens"]) - batch + 1 or 1, batch):
        t, m = rows["tokens"][i : i + batch], rows["loss_mask"][i : i + batch]
        kl, ov, ag, cm = jax.device_get(fn(tparams, dparams, jnp.asarray(t), jnp.asarray(m)))
        cm = cm.astype(np.float64)
        sums += [float((kl * cm).sum()), float((ov * cm).sum()), float((ag * cm).sum())]
        count += float(cm.sum())
    c = max(count, 1.0)
    return {"kl": sums[0] / c, "overlap": sums[1] / c, "agree": sums[2] / c, "positions": int(count)}


# ---------------------------------------------------------------------------------------------
# The run
# ---------------------------------------------------------------------------------------------


def train_draft_model(tcfg: ModelConfig, tparams: dict, data_dir: str, out_dir: str, tc: DraftTrainConfig, *,
                      mesh: Mesh | None = None, ckpt_dir: str | None = None, resume: bool = False,
                      progress: bool = True) -> dict:
    """Distil, export OUT/draft, write OUT/metrics.json; returns the summary dict. Orbax
    checkpoints (float32 params + AdamW moments: keep them out of small result folders) go to
    ckpt_dir when given, every `ckpt_every` steps and at the end; `resume` continues from there."""
    t_start = time.perf_counter()
    deadline = t_start + tc.time_budget_s if tc.time_budget_s else math.inf
    mesh = mesh or S.make_mesh(1)
    if tc.batch_size % mesh.devices.size:
        raise ValueError(f"batch size {tc.batch_size} must be a multiple of the {mesh.devices.size} devices of the mesh")
    os.makedirs(out_dir, exist_ok=True)
    if tc.exit_layer is not None:
        layers_from = tuple(tc.layers_from) if tc.layers_from else (tcfg.num_layers - 1,)
        if len(layers_from) != 1:
            raise ValueError(f"an exit head has one layer; layers_from names {len(layers_from)}")
        dcfg, dparams0 = EH.init_from_target(tparams, tcfg, tc.exit_layer, layers_from[0])
    else:
        layers_from = tuple(tc.layers_from) if tc.layers_from else DM.default_layers_from(tcfg.num_layers, tc.num_layers)
        dcfg, dparams0 = DM.init_from_target(tparams, tcfg, layers_from)
    compute = jnp.dtype(tc.compute_dtype)
    tparams_c = S.place_replicated(mesh, M.cast_params(tparams, compute))
    trainable = jax.tree.map(lambda a: jnp.array(a, jnp.float32, copy=True), DM.split_trainable(dparams0))
    state = {"step": jnp.zeros((), jnp.int32), "params": trainable, "opt_state": make_optimizer(tc).init(trainable)}
    state = S.place(mesh, state)

    ckpt = Checkpointer(ckpt_dir, 2) if ckpt_dir else None
    if ckpt and resume and ckpt.latest_step() is not None:
        state, _, _ = ckpt.restore(ckpt.latest_step(), state, {})

    rows = load_packed(data_dir, tc.seq_len, "train")
    if not rows:
        raise ValueError(f"{data_dir}: no training rows")
    held = load_packed(data_dir, tc.seq_len, "holdout") or load_packed(data_dir, tc.seq_len, "eval")
    if held:
        held = {k: v[: tc.eval_rows] for k, v in held.items()}
    loader = PackedLoader(rows, tc.batch_size, tc.seed)
    # Reserve time for the held-out evaluation and the export after the last step.
    reserve = 45.0 if tc.time_budget_s and tc.time_budget_s > 120 else 0.0

    first = jax.process_index() == 0
    describe = (lambda r: f"step {r['step']} kl {r['kl']:.3f} overlap {r['overlap']:.3f} agree {r['agree']:.3f}") if progress else None
    state, step, history, train_s = run_timed_loop(
        state, lambda st, lr, i: train_step(tcfg, dcfg, tc, mesh, st, tparams_c, lr, S.global_batch(mesh, loader(i))), tc,
        deadline=deadline, reserve=reserve, t_start=t_start, metric_keys=("kl", "overlap", "agree", "grad_norm"),
        log_path=os.path.join(out_dir, "metrics.jsonl"), describe=describe, ckpt=ckpt)
    if ckpt:
        if step:
            ckpt.save(step, state, {}, {"step": step})
        ckpt.close()

    trained = jax.device_get(state["params"])
    dparams = DM.tie(jax.tree.map(lambda a: jnp.asarray(a, compute), trained), tparams_c)
    summary = {
        "target_layers": tcfg.num_layers, "layers_from": list(layers_from), "exit_layer": tc.exit_layer, "steps": step,
        "batch_size": tc.batch_size, "seq_len": tc.seq_len, "train_rows": int(len(rows["tokens"])),
        "epochs": step * tc.batch_size / len(rows["tokens"]), "train_s": train_s,
        "last": history[-1] if history else None,
        "held_out_init": evaluate(tparams_c, tcfg, DM.tie(M.cast_params(DM.split_trainable(dparams0), compute), tparams_c),
                                  dcfg, held, tc.batch_size, tc.logits_chunk, tc.exit_layer) if held else {},
        "held_out": evaluate(tparams_c, tcfg, dparams, dcfg, held, tc.batch_size, tc.logits_chunk, tc.exit_layer) if held else {},
    }
    if first:
        nbytes = save_draft_model(os.path.join(out_dir, "draft"), dcfg, {k: jax.device_get(v) for k, v in dparams.items()},
                                  tcfg, layers_from, dtype=tc.export_dtype,
                                  extra={"steps": step, "held_out": summary["held_out"],
                                         **({"exit_layer": tc.exit_layer} if tc.exit_layer is not None else {})})
        summary["weights_bytes"] = nbytes
        summary["total_s"] = time.perf_counter() - t_start
        with open(os.path.join(out_dir, "metrics.json"), "w") as fh:
            json.dump(summary, fh, indent=1)
    return summary
