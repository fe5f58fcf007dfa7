"""Draft-head losses with target features computed online, and the training-time test unroll.

Index convention (tokens x_0..x_{T-1}; f_t = target feature after reading x_0..x_t; the target's
distribution p_t is over x_{t+1}): at TTT step j the row at position t reads x_{t+j+1} and the
previous step's output (f_t at step 0) and predicts x_{t+j+2}, whose target distribution is
p_{t+j+1}. Its loss counts only where x_{t+j+2} is a response token (loss_mask) of the same
document as x_t, so positions that run past the sequence end or into the next document of a
packed row drop out on their own.

Packed rows (batch["segment_ids"] [B, T]: 1, 2, ... per document, 0 on padding): the frozen
target and the head's TTT unroll both attend within a document only, with positions counted
from each document's start, so a document's losses are those it would have alone in a row.

EAGLE-1 (§1.1): regression_weight * SmoothL1(h_out, f_{t+j+1}) + ce_weight * CE(softmax(lm(f_{t+j+1})),
  lm(h_out)), uniform noise on the step-0 input features; usually one step (ttt_steps=1).
EAGLE-3 (§1.3): soft CE against softmax of the target logits restricted to the draft vocabulary,
  masked where the target's argmax (over the full vocabulary) is outside it; sum_j decay^j L_j.
Acceptance term (both kinds, off by default) [I]: acceptance_weight * (1 - sum_v min(p_tau(v), q_tau(v))),
  p_tau and q_tau the target's and the head's laws at acceptance_temperature over the head's
  vocabulary (the target's renormalised on the draft vocabulary, as the CE's). At temperature tau
  a drafted token sampled from q_tau is accepted with probability sum_v min(p_tau, q_tau) = 1 - TV:
  the quantity sampled speculation runs on, which the CE (a KL) only bounds. Its mean is logged at
  every TTT step (accept_j) whatever the weight: the head's expected sampled acceptance.
Each loss is a mean over its counted positions (EAGLE averages over all positions; this only
rescales the step size per batch, and keeps weights comparable across steps) [I].
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp

from ..heads import eagle as H
from ..config import ModelConfig
from ..model import forward, init_cache, lm_head
from .config import TrainConfig


class TargetOut(NamedTuple):
    hidden: jax.Array  # [B, T, D] final-normed
    captured: tuple  # EAGLE-3 layer inputs, each [B, T, D]
    top: jax.Array  # [B, T] int32 argmax of the target logits (full vocab)


def shift_left(x: jax.Array, n: int, fill=0) -> jax.Array:
    """x[:, n:] padded at the end back to length T (position t gets x[:, t + n])."""
    pad = [(0, 0)] * x.ndim
    pad[1] = (0, n)
    return jnp.pad(x[:, n:], pad, constant_values=fill)


def chunked_argmax_logits(tparams: dict, tcfg: ModelConfig, hidden: jax.Array, chunk: int) -> jax.Array:
    """argmax of the target's full-vocab logits, `chunk` positions at a time (a [B, T, V]
    float32 tensor would not fit for large vocabularies)."""
    B, T, D = hidden.shape
    c = math.gcd(T, chunk)
    blocks = hidden.reshape(B, T // c, c, D).swapaxes(0, 1)
    top = jax.lax.map(lambda h: jnp.argmax(lm_head(tparams, tcfg, h), -1).astype(jnp.int32), blocks)
    return top.swapaxes(0, 1).reshape(B, T)


def target_outputs(hcfg: H.HeadConfig, tc: TrainConfig, tparams: dict, tokens: jax.Array,
                   segment_ids: jax.Array | None = None) -> TargetOut:
    """One frozen target forward over the whole sequence (a cache of the sequence length); with
    segment_ids [B, T], each document of a packed row is read on its own (positions from its
    start, attention within it)."""
    tcfg = hcfg.target
    B, T = tokens.shape
    cache = init_cache(tcfg, B, T, tparams["embed"].dtype)
    capture = hcfg.capture_layers if hcfg.kind == "eagle3" else ()
    if segment_ids is None:
        out = forward(tparams, tcfg, tokens, cache, capture=capture)
    else:
        out = forward(tparams, tcfg, tokens, cache, capture=capture, positions=H.document_positions(segment_ids),
                      new_mask=H.document_mask(segment_ids))
    top = chunked_argmax_logits(tparams, tcfg, out.hidden, tc.logits_chunk)
    return jax.lax.stop_gradient(TargetOut(out.hidden, out.captured, top))


def _target_lm_weight(tparams: dict, tcfg: ModelConfig) -> jax.Array:
    return tparams["embed"].T if tcfg.tie_word_embeddings or "lm_head" not in tparams else tparams["lm_head"]


def target_draft_logits(hcfg: H.HeadConfig, head_params: dict, tparams: dict, hidden: jax.Array) -> jax.Array:
    """Target logits over the head's vocabulary (the draft vocab for a reduced EAGLE-3 head)."""
    tcfg = hcfg.target
    if not hcfg.reduced_vocab:
        return lm_head(tparams, tcfg, hidden)
    w = _target_lm_weight(tparams, tcfg)[:, head_params["d2t"]]
    return lm_head({"lm_head": w}, tcfg.replace(tie_word_embeddings=False), hidden)


def soft_cross_entropy(logits: jax.Array, target_logits: jax.Array) -> jax.Array:
    """-sum softmax(target) * log_softmax(logits) over the last axis, float32."""
    p = jax.nn.softmax(target_logits.astype(jnp.float32), axis=-1)
    return -jnp.sum(p * jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1), axis=-1)


def masked_mean(x: jax.Array, mask: jax.Array) -> jax.Array:
    m = mask.astype(jnp.float32)
    return jnp.sum(x.astype(jnp.float32) * m) / jnp.maximum(jnp.sum(m), 1.0)


def smooth_l1(x: jax.Array) -> jax.Array:
    """Huber with beta 1 (torch's SmoothL1Loss default), elementwise."""
    a = jnp.abs(x)
    return jnp.where(a < 1.0, 0.5 * a * a, a - 0.5)


def feature_noise(key: jax.Array, shape, segment_ids: jax.Array, std: float) -> jax.Array:
    """EAGLE-1's augmentation: (U(0,1) - 0.5) * std * 512 / sequence length [B, T, D] (§1.1),
    the length of each token's own document in a packed row."""
    doc_len = jnp.sum(segment_ids[:, :, None] == segment_ids[:, None, :], axis=-1)
    scale = std * 512.0 / jnp.maximum(doc_len.astype(jnp.float32), 1.0)
    return (jax.random.uniform(key, shape) - 0.5) * scale[:, :, None]


def sampled_acceptance(logits: jax.Array, target_logits: jax.Array, temperature: float) -> jax.Array:
    """sum_v min(p, q) over the last axis, p and q the softmaxes at `temperature`, float32: the
    probability that a token drawn from q is accepted against p (1 - total variation)."""
    p = jax.nn.softmax(target_logits.astype(jnp.float32) / temperature, axis=-1)
    q = jax.nn.softmax(logits.astype(jnp.float32) / temperature, axis=-1)
    return jnp.sum(jnp.minimum(p, q), axis=-1)


def chunked_ce_and_argmax(hcfg: H.HeadConfig, head_params: dict, tparams: dict, h_out: jax.Array,
                          tgt_hidden: jax.Array, chunk: int, temperature: float = 1.0):
    """(soft CE [B, T], argmax of the head's logits [B, T], sampled acceptance at `temperature`
    [B, T]) computed `chunk` positions at a time, each chunk recomputed in the backward pass: the
    [B, T, vocab] float32 logits and soft targets (3 GB each at 32 x 768 x 32k) never exist whole,
    so memory does not grow with the vocabulary."""
    B, T, D = h_out.shape
    c = math.gcd(T, chunk)
    if hcfg.reduced_vocab:  # gather the target's draft-vocab columns once, not per chunk
        w = _target_lm_weight(tparams, hcfg.target)[:, head_params["d2t"]]
        target_head = lambda x: lm_head({"lm_head": w}, hcfg.target.replace(tie_word_embeddings=False), x)  # noqa: E731
    else:
        target_head = lambda x: lm_head(tparams, hcfg.target, x)  # noqa: E731

    @jax.checkpoint
    def block(xs):
        h, th = xs
        logits, target_logits = H.draft_logits(hcfg, head_params, tparams, h), target_head(th)
        return (soft_cross_entropy(logits, target_logits), jnp.argmax(logits, -1).astype(jnp.int32),
                sampled_acceptance(logits, target_logits, temperature))

    split = lambda x: x.reshape(B, T // c, c, *x.shape[2:]).swapaxes(0, 1)  # noqa: E731
    ce, pred, accept = jax.lax.map(block, (split(h_out), split(tgt_hidden)))
    join = lambda x: x.swapaxes(0, 1).reshape(B, T)  # noqa: E731
    return join(ce), join(pred), join(accept)


def step_loss(hcfg: H.HeadConfig, tc: TrainConfig, head_params: dict, tparams: dict, h_out: jax.Array,
              target: TargetOut, loss_mask: jax.Array, step: int, segment_ids: jax.Array):
    """(loss, top-1 accuracy vs the target's argmax, mean sampled acceptance at the configured
    temperature) of TTT step `step`: counted where the token predicted, x_{t+step+2}, is a response
    token of x_t's own document (the acceptance, as the CE, where the target's argmax is a draft token)."""
    same_doc = shift_left(segment_ids, step + 2, -1) == segment_ids
    counted = shift_left(loss_mask, step + 2, False) & same_doc
    tgt_hidden = shift_left(target.hidden, step + 1)
    tgt_top = shift_left(target.top, step + 1)
    ce, pred, accept = chunked_ce_and_argmax(hcfg, head_params, tparams, h_out, tgt_hidden, tc.logits_chunk,
                                             tc.acceptance_temperature)
    if hcfg.reduced_vocab:
        pred = head_params["d2t"][pred]
        ce_mask = counted & head_params["t2d"][tgt_top]
    else:
        ce_mask = counted
    acc = masked_mean(pred == tgt_top, counted)
    if hcfg.kind == "eagle1":
        reg = jnp.mean(smooth_l1(h_out.astype(jnp.float32) - tgt_hidden.astype(jnp.float32)), -1)
        loss = tc.regression_weight * masked_mean(reg, counted) + tc.ce_weight * masked_mean(ce, ce_mask)
    else:
        loss = masked_mean(ce, ce_mask)
    accept = masked_mean(accept, ce_mask)
    if tc.acceptance_weight:
        loss = loss + tc.acceptance_weight * (1.0 - accept)
    return loss, acc, accept


def ttt_loss(hcfg: H.HeadConfig, tc: TrainConfig, head_params: dict, tparams: dict, batch: dict,
             target: TargetOut, key: jax.Array):
    """sum_j decay^j L_j over tc.ttt_steps unrolled draft steps; returns (loss, metrics)."""
    tokens, loss_mask, segments = batch["tokens"], batch["loss_mask"], batch["segment_ids"]
    dtype = head_params["fc"].dtype
    embeds = H.embed_tokens(tparams, hcfg.target, tokens).astype(dtype)
    if hcfg.kind == "eagle1":
        feats = target.hidden.astype(dtype)
        if tc.feature_noise_std:
            noise = feature_noise(key, feats.shape, segments, tc.feature_noise_std)
            feats = feats + noise.astype(dtype)
    else:
        feats = H.fuse_captured(hcfg, head_params, target.captured)

    def one_step(j, head_params, feats, first, later):
        h, first, later = H.ttt_step(hcfg, head_params, shift_left(embeds, j + 1), feats, j, first, later, segments)
        loss, acc, accept = step_loss(hcfg, tc, head_params, tparams, h, target, loss_mask, j, segments)
        return h, first, later, loss, (acc, accept)

    if tc.remat:  # keep only each step's inputs; its logits are recomputed in the backward pass
        one_step = jax.checkpoint(one_step, static_argnums=(0,))
    total, metrics, first, later = 0.0, {}, None, None
    for j in range(tc.ttt_steps):
        feats, first, later, loss, (acc, accept) = one_step(j, head_params, feats, first, later)
        total = total + (tc.ttt_decay**j) * loss
        metrics[f"loss_{j}"] = loss
        metrics[f"acc_{j}"] = acc
        metrics[f"accept_{j}"] = accept
    metrics["loss"] = total
    return total, metrics
