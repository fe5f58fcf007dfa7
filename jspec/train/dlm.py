"""Train the masked-diffusion drafter (jspec.heads.dlm) on the distilled token shards.

    python scripts/train_dlm.py --target smollm2-135m-instruct --data DATA --out OUT --time-budget-s 390

Objective (block diffusion with shifted prediction, as Dream / DiffuLLaMA adapt an AR model): each
row is cut into blocks of b tokens (b drawn per row from `train_block_sizes`, a random offset per
row); in every block the first token is the clean *anchor* and each other token is replaced by the
mask token with probability t (t = 1 for half of the blocks: the one-forward drafting case of
DiffuSpec; t ~ U(0.05, 1) otherwise: the partly-decoded states SSD and refinement steps see). The
two-stream forward (`heads.dlm.two_stream_hidden`) gives, for every noised position i, a
distribution for token i + 1; cross-entropy counts where token i + 1 is a response token that the
block does not show (masked, or the next block's anchor). Embeddings and LM head are the target's,
frozen; the layers (initialised from the target's) and the final norm train.

Mesh / optimizer / checkpoints follow head training (jspec.train.step, trainer): a ("data",
"fsdp") mesh over the local devices, the batch sharded over it, float32 master weights, AdamW
after global-norm clipping with a host-chosen learning rate (warm-up then cosine over the run's
progress; with a time budget, progress is elapsed time, so a budgeted run ends at the bottom of
its schedule), Orbax checkpoints of {params, optimizer state, step}.

Outputs in OUT: dlm.safetensors (bfloat16 layers + final norm; the embeddings are not shipped),
metrics.jsonl (training curve: loss and denoising accuracy every `log_every` steps) and
dlm_metrics.json (summary + held-out denoising accuracy by distance from the anchor, fully masked
block, and at mask ratio 0.5).
"""

from __future__ import annotations

import dataclasses
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
from ..config import ModelConfig
from ..heads import dlm as D
from . import shards as SH
from . import step as S
from .loop import run_timed_loop
from .trainer import Checkpointer


@dataclasses.dataclass(frozen=True)
class DLMTrainConfig:
    num_layers: int = 6
    init_layers: tuple[int, ...] | None = None
    block_size: int = 32  # inference block (drafting / SSD upper bound)
    train_block_sizes: tuple[int, ...] = (8, 32)
    full_mask_fraction: float = 0.5  # blocks trained fully masked (one-forward drafting)
    batch_size: int = 32  # global
    seq_len: int = 384
    steps: int = 100_000  # upper bound when time_budget_s is set
    time_budget_s: float | None = None  # whole run, evaluation and export included
    lr: float = 3e-4
    warmup_steps: int = 50
    final_lr_fraction: float = 0.1
    weight_decay: float = 0.0
    b1: float = 0.9
    b2: float = 0.95
    grad_clip: float = 1.0
    compute_dtype: str = "bfloat16"
    log_every: int = 20
    ckpt_every: int = 0  # 0: only at the end
    eval_rows: int = 64
    seed: int = 0
    mask_token_id: int | None = None  # None: the smallest id < 256 absent from the data


# ---------------------------------------------------------------------------------------------
# Data
# ---------------------------------------------------------------------------------------------


def load_rows(data_dir: str, seq_len: int, split: str) -> dict[str, np.ndarray]:
    """tokens [n, T] int32, loss_mask [n, T] bool, lengths [n] of a split of a v2 dataset."""
    meta = SH.read_meta(data_dir)
    if meta.get("format") != SH.FORMAT:
        raise ValueError(f"{data_dir}: expected a {SH.FORMAT} dataset, found {meta.get('format')!r}")
    parts = [SH.pack_rows(SH.load_rows(data_dir, s["file"]), seq_len, meta.get("pad_id", 0), loop_cut=SH.LoopCut())
             for s in SH.shard_files(meta, split)]
    if not parts:
        return {}
    t, m, n = (np.concatenate(x) for x in zip(*parts))
    keep = m.any(axis=1)
    return {"tokens": t[keep], "loss_mask": m[keep], "lengths": n[keep]}


def choose_mask_token(tokens: np.ndarray, cfg: ModelConfig, limit: int = 256) -> int:
    """The smallest token id below `limit` that never occurs in the data and is not EOS/BOS/pad:
    a spare special token serves as the mask, so the tied embedding table needs no new row."""
    seen = np.bincount(tokens.ravel().astype(np.int64), minlength=cfg.vocab_size)
    reserved = set(cfg.eos_token_ids) | {cfg.pad_token_id} | ({cfg.bos_token_id} if cfg.bos_token_id is not None else set())
    for t in range(min(limit, cfg.vocab_size)):
        if seen[t] == 0 and t not in reserved:
            return t
    raise ValueError(f"every token id below {limit} occurs in the data; pass mask_token_id explicitly")


class Loader:
    """Global batch `step`: rows of a (seed, epoch) permutation (a pure function of the step)."""

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
# Noise, loss, step
# ---------------------------------------------------------------------------------------------


def noise_blocks(key, clean, dcfg: D.DLMConfig, block_sizes, full_mask_fraction: float, fixed_t: float | None = None):
    """(noisy, anchor, block_id, masked, full) for clean [B, L]: per-row block size and offset,
    per-block mask ratio (fixed_t: every block at that ratio, offset 0, for evaluation)."""
    B, L = clean.shape
    k_b, k_off, k_t, k_full, k_m = jax.random.split(key, 5)
    sizes = jnp.asarray(block_sizes, jnp.int32)
    b = sizes[jax.random.randint(k_b, (B,), 0, len(block_sizes))][:, None]  # [B, 1]
    off = jnp.zeros((B, 1), jnp.int32) if fixed_t is not None else jax.random.randint(k_off, (B, 1), 0, 1 << 20) % b
    pos = jnp.arange(L, dtype=jnp.int32)[None]
    block_id = jnp.floor_divide(pos - off, b)  # -1 for the head before the first full block
    anchor = jnp.maximum(off + block_id * b, 0)
    nb = L + 1
    if fixed_t is None:
        t_blk = jax.random.uniform(k_t, (B, nb), minval=0.05, maxval=1.0)
        full_blk = jax.random.uniform(k_full, (B, nb)) < full_mask_fraction
        t_blk = jnp.where(full_blk, 1.0, t_blk)
    else:
        t_blk = jnp.full((B, nb), fixed_t)
        full_blk = jnp.full((B, nb), fixed_t >= 1.0)
    bid = block_id + 1
    t = jnp.take_along_axis(t_blk, bid, axis=1)
    full = jnp.take_along_axis(full_blk, bid, axis=1)
    masked = (pos != anchor) & (jax.random.uniform(k_m, (B, L)) < t)
    noisy = jnp.where(masked, dcfg.mask_token_id, clean)
    return noisy, anchor, block_id, masked, full


def denoising_terms(own, tparams, dcfg: D.DLMConfig, clean, loss_mask, noisy, anchor, block_id, masked):
    """Per-position (nll, correct, counted) [B, L-1]: output i vs token i + 1."""
    h = D.two_stream_hidden(own, tparams, dcfg, clean, noisy, anchor, block_id)
    logits = M.lm_head(D.full_params(own, tparams), dcfg.model, h[:, :-1])
    tgt = clean[:, 1:]
    hidden_from_block = jnp.where(block_id[:, 1:] == block_id[:, :-1], masked[:, 1:], True)
    counted = loss_mask[:, 1:] & hidden_from_block
    lp = jax.nn.log_softmax(logits, axis=-1)
    nll = -jnp.take_along_axis(lp, tgt[..., None], axis=-1)[..., 0]
    correct = jnp.argmax(logits, axis=-1) == tgt
    return nll, correct, counted


def _mean(x, m):
    m = m.astype(jnp.float32)
    return jnp.sum(x * m) / jnp.maximum(jnp.sum(m), 1.0)


def make_optimizer(tc: DLMTrainConfig) -> optax.GradientTransformation:
    decay_mask = lambda params: jax.tree.map(lambda p: p.ndim >= 2, params)  # noqa: E731
    # unit learning rate: the step scales the update by the host-chosen lr (AdamW at that lr)
    adamw = optax.adamw(1.0, b1=tc.b1, b2=tc.b2, weight_decay=tc.weight_decay, mask=decay_mask)
    return optax.chain(optax.clip_by_global_norm(tc.grad_clip), adamw)


def _train_step(dcfg, tc, mesh, state, tparams, lr, batch):
    dtype = jnp.dtype(tc.compute_dtype)
    key = jax.random.fold_in(jax.random.PRNGKey(tc.seed), state["step"])
    clean, loss_mask = batch["tokens"], batch["loss_mask"]
    noisy, anchor, block_id, masked, full = noise_blocks(key, clean, dcfg, tc.train_block_sizes, tc.full_mask_fraction)

    def loss_fn(params):
        nll, correct, counted = denoising_terms(M.cast_params(params, dtype), tparams, dcfg, clean, loss_mask,
                                                noisy, anchor, block_id, masked)
        return _mean(nll, counted), {"loss": _mean(nll, counted), "acc": _mean(correct, counted),
                                     "acc_full_mask": _mean(correct, counted & full[:, 1:]),
                                     "targets": jnp.sum(counted)}

    (_, metrics), grads = jax.value_and_grad(loss_fn, has_aux=True)(state["params"])
    updates, opt_state = make_optimizer(tc).update(grads, state["opt_state"], state["params"])
    updates = jax.tree.map(lambda u: u * lr, updates)
    new = {"step": state["step"] + 1, "params": optax.apply_updates(state["params"], updates), "opt_state": opt_state}
    new = jax.lax.with_sharding_constraint(new, S.tree_shardings(mesh, new))
    metrics["grad_norm"] = optax.tree.norm(grads)
    return new, metrics


train_step = S.training_jit(_train_step, static_argnums=(0, 1, 2), donate_argnums=(3,))


def evaluate(own, tparams, dcfg: D.DLMConfig, rows: dict, batch: int, mask_ratio: float) -> dict:
    """Held-out denoising accuracy with blocks of dcfg.block_size at one mask ratio: overall and
    by distance d = 1..block_size from the anchor (fully masked: what one-forward drafting sees)."""
    if not rows:
        return {}
    b = dcfg.block_size

    @jax.jit
    def fn(own, tparams, clean, loss_mask, key):
        noisy, anchor, block_id, masked, _ = noise_blocks(key, clean, dcfg, (b,), 0.0, fixed_t=mask_ratio)
        nll, correct, counted = denoising_terms(own, tparams, dcfg, clean, loss_mask, noisy, anchor, block_id, masked)
        dist = jnp.arange(1, clean.shape[1])[None] - anchor[:, :-1]  # target i+1 minus its block's anchor
        onehot = jax.nn.one_hot(dist - 1, b, dtype=jnp.float32) * counted[..., None]
        return (jnp.sum(onehot * correct[..., None], axis=(0, 1)), jnp.sum(onehot, axis=(0, 1)),
                jnp.sum(nll * counted), jnp.sum(correct * counted), jnp.sum(counted))

    hit, cnt = np.zeros(b), np.zeros(b)
    nll_s = cor_s = tot = 0.0
    n = len(rows["tokens"])
    for i in range(0, max(n - batch + 1, 1), batch):
        out = jax.device_get(fn(own, tparams, jnp.asarray(rows["tokens"][i : i + batch]), jnp.asarray(rows["loss_mask"][i : i + batch]),
                                jax.random.PRNGKey(i)))
        hit += out[0]
        cnt += out[1]
        nll_s, cor_s, tot = nll_s + float(out[2]), cor_s + float(out[3]), tot + float(out[4])
    return {"mask_ratio": mask_ratio, "block_size": b, "nll": nll_s / max(tot, 1), "accuracy": cor_s / max(tot, 1),
            "targets": int(tot), "accuracy_by_distance": [float(h / c) if c else None for h, c in zip(hit, cnt)]}


# ---------------------------------------------------------------------------------------------
# The run
# ---------------------------------------------------------------------------------------------


def train_dlm(tcfg: ModelConfig, tparams: dict, data_dir: str, out_dir: str, tc: DLMTrainConfig, *,
              mesh: Mesh | None = None, resume: bool = False, progress: bool = True,
              stop_at: int | None = None, init_own: dict | None = None) -> dict:
    """Train, export OUT/dlm.safetensors, write OUT/dlm_metrics.json; returns the summary.

    Checkpoints (Orbax, OUT/checkpoints) every tc.ckpt_every steps and at the end; `resume`
    continues from the latest one. `stop_at` ends the run after that step as a kill would (no
    final checkpoint, no export; returns {"steps": stop_at}): how the tests stop a run midway.
    init_own: a trained DLM's own parameters (load_dlm) to train on instead of the target's layers
    (a new schedule and optimizer over new data; tc must describe that DLM: layers, mask token,
    blocks)."""
    t_start = time.perf_counter()
    deadline = t_start + tc.time_budget_s if tc.time_budget_s else math.inf
    mesh = mesh or S.make_mesh(1)
    os.makedirs(out_dir, exist_ok=True)
    rows = load_rows(data_dir, tc.seq_len, "train")
    if not rows:
        raise ValueError(f"{data_dir}: no training rows")
    held = load_rows(data_dir, tc.seq_len, "holdout") or load_rows(data_dir, tc.seq_len, "eval")
    held = {k: v[: tc.eval_rows] for k, v in held.items()} if held else {}
    mask_id = tc.mask_token_id if tc.mask_token_id is not None else choose_mask_token(rows["tokens"], tcfg)
    dcfg = D.DLMConfig(target=tcfg, num_layers=tc.num_layers, mask_token_id=mask_id, block_size=tc.block_size,
                       init_layers=tc.init_layers, train_block_sizes=tuple(tc.train_block_sizes))
    compute = jnp.dtype(tc.compute_dtype)
    tparams_c = S.place_replicated(mesh, M.cast_params({k: v for k, v in tparams.items() if k != "layers"}, compute))
    own0 = jax.tree.map(lambda a: jnp.array(a, jnp.float32, copy=True),
                        D.init_dlm(dcfg, tparams) if init_own is None else init_own)
    state = S.place(mesh, {"step": jnp.zeros((), jnp.int32), "params": own0, "opt_state": make_optimizer(tc).init(own0)})
    ckpt = Checkpointer(os.path.join(out_dir, "checkpoints"), 2)
    if resume and ckpt.latest_step() is not None:
        state, _, _ = ckpt.restore(ckpt.latest_step(), state, {})
    loader = Loader(rows, tc.batch_size, tc.seed)
    # evaluation (two compiles) and export after the last step
    reserve = 50.0 if tc.time_budget_s and tc.time_budget_s > 120 else 0.0

    first = jax.process_index() == 0
    describe = (lambda r: f"step {r['step']} loss {r['loss']:.3f} acc {r['acc']:.3f} full-mask acc "
                          f"{r['acc_full_mask']:.3f} ({r['elapsed_s']:.0f}s)") if progress else None
    state, step, history, train_s = run_timed_loop(
        state, lambda st, lr, i: train_step(dcfg, tc, mesh, st, tparams_c, lr, S.global_batch(mesh, loader(i))), tc,
        deadline=deadline, reserve=reserve, t_start=t_start, metric_keys=("loss", "acc", "acc_full_mask", "grad_norm"),
        log_path=os.path.join(out_dir, "metrics.jsonl"), describe=describe, ckpt=ckpt, stop_at=stop_at)
    if stop_at is not None and step >= stop_at:
        ckpt.close()
        return {"steps": step}
    if step:
        ckpt.save(step, state, {}, {"step": step})
    ckpt.close()

    own = jax.device_get(state["params"])
    own_c = M.cast_params(jax.tree.map(jnp.asarray, own), compute)
    eval_batch = max(1, min(tc.batch_size, 8))
    summary = {
        "dlm": dcfg.to_json() | {"target": None}, "steps": step, "batch_size": tc.batch_size, "seq_len": tc.seq_len,
        "train_rows": int(len(rows["tokens"])), "epochs": step * tc.batch_size / len(rows["tokens"]),
        "train_s": train_s, "shipped_params": D.num_shipped_params(own), "curve": history,
        "held_out_full_mask": evaluate(own_c, tparams_c, dcfg, held, eval_batch, 1.0),
        "held_out_half_mask": evaluate(own_c, tparams_c, dcfg, held, eval_batch, 0.5),
    }
    if first:
        path = os.path.join(out_dir, "dlm.safetensors")
        D.save_dlm(path, dcfg, own, extra_meta={"steps": step})
        summary["weights_bytes"] = os.path.getsize(path)
        summary["total_s"] = time.perf_counter() - t_start
        with open(os.path.join(out_dir, "dlm_metrics.json"), "w") as fh:
            json.dump(summary, fh, indent=1)
    return summary
