"""EAGLE training losses (train/losses.py) pinned on a hand-built batch against a NumPy reference
written from the index convention in the module's docstring: at TTT step j the row at position t
is scored against the target's feature f_{t+j+1} and argmax top_{t+j+1}, and counts where
x_{t+j+2} is a response token. Checked: label alignment (tgt_hidden, tgt_top, the loss mask), the
presence and weight of each term (EAGLE-1's feature regression and soft CE; EAGLE-3's soft CE over
the draft vocabulary, masked where the target's argmax is outside it; the acceptance term
1 - sum min(p_tau, q_tau) where the CE counts), and the TTT decay."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jspec.heads import eagle as H
from jspec.model import init_params, lm_head
from jspec.train import losses as L
from jspec.train.config import TrainConfig
from jspec.train.testing import numpy_params, tiny_target_config

TARGET = tiny_target_config()
B, T = 2, 10
DRAFT_VOCAB = 48
# prompt (0), response (1), padding (0): the mask's shift by j + 2 decides which rows count
LOSS_MASK = np.array([[0, 0, 0, 1, 1, 1, 1, 1, 1, 0], [0, 0, 1, 1, 1, 1, 0, 1, 1, 1]], bool)


def _heads():
    return {"eagle1": H.default_head_config("eagle1", TARGET),
            "eagle3": H.default_head_config("eagle3", TARGET, draft_vocab_size=DRAFT_VOCAB)}


@functools.lru_cache(maxsize=None)
def _params():
    tparams = numpy_params(init_params, TARGET, seed=0, scale=0.3)
    heads = {k: numpy_params(H.init_head, hc, seed=1, scale=0.05) for k, hc in _heads().items()}
    return tparams, heads


def _softmax(x):
    e = np.exp(x - x.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def _log_softmax(x):
    m = x.max(-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(-1, keepdims=True))


def _hand_batch(kind: str, step: int, rng):
    """(h_out, TargetOut, loss_mask): random features; the target's argmax at t + step + 1 is the
    head's own argmax at t (mapped to target ids) except at two counted positions where it is a
    token outside the draft vocabulary, so accuracy is neither 0 nor 1 and EAGLE-3's CE mask bites."""
    hcfg = _heads()[kind]
    tparams, heads = _params()
    D = TARGET.hidden_size
    hidden = rng.normal(0.0, 1.0, (B, T, D)).astype(np.float32)
    h_out = rng.normal(0.0, 1.0, (B, T, D)).astype(np.float32)
    head_pred = np.asarray(jnp.argmax(H.draft_logits(hcfg, heads[kind], tparams, jnp.asarray(h_out)), -1))
    if hcfg.reduced_vocab:
        head_pred = np.asarray(heads[kind]["d2t"])[head_pred]
    top = rng.integers(DRAFT_VOCAB, TARGET.vocab_size, (B, T))  # outside the draft vocabulary
    s = step + 1
    top[:, s:] = head_pred[:, : T - s]
    top[0, s + 3] = top[1, s + 2] = TARGET.vocab_size - 1  # two misses (outside the draft vocab)
    target = L.TargetOut(jnp.asarray(hidden), (), jnp.asarray(top, jnp.int32))
    return jnp.asarray(h_out), target, jnp.asarray(LOSS_MASK)


def _reference(kind: str, tc: TrainConfig, h_out, target, loss_mask, step: int):
    """(regression term, CE term, accuracy, sampled acceptance at tc.acceptance_temperature) by
    explicit indexing, per the module's convention."""
    hcfg = _heads()[kind]
    tparams, heads = _params()
    hp = heads[kind]
    h_out, hidden, top, mask = (np.asarray(x) for x in (h_out, target.hidden, target.top, loss_mask))
    draft = np.asarray(H.draft_logits(hcfg, hp, tparams, jnp.asarray(h_out)), np.float64)
    full_target = np.asarray(lm_head(tparams, TARGET, jnp.asarray(hidden)), np.float64)  # [B, T, V]
    d2t = np.asarray(hp["d2t"]) if hcfg.reduced_vocab else np.arange(TARGET.vocab_size)
    regs, ces, hits, accepts = [], [], [], []
    tau = tc.acceptance_temperature
    for b in range(B):
        for t in range(T):
            src, lab = t + step + 1, t + step + 2  # feature / argmax source, the token whose mask counts
            if lab >= T or not mask[b, lab]:
                continue
            diff = np.abs(h_out[b, t].astype(np.float64) - hidden[b, src])
            regs.append(np.mean(np.where(diff < 1.0, 0.5 * diff**2, diff - 0.5)))
            if top[b, src] in d2t:  # EAGLE-3: the target's argmax must be a draft token
                ces.append(-np.sum(_softmax(full_target[b, src][d2t]) * _log_softmax(draft[b, t])))
                accepts.append(np.sum(np.minimum(_softmax(full_target[b, src][d2t] / tau), _softmax(draft[b, t] / tau))))
            hits.append(d2t[np.argmax(draft[b, t])] == top[b, src])
    return float(np.mean(regs)), float(np.mean(ces)), float(np.mean(hits)), float(np.mean(accepts))


@pytest.mark.parametrize("kind", ["eagle1", "eagle3"])
@pytest.mark.parametrize("step", [0, 1])
@pytest.mark.parametrize("acceptance_weight", [0.0, 0.5])
def test_step_loss_matches_the_reference(kind, step, acceptance_weight):
    tc = TrainConfig(kind=kind, ttt_steps=2, seq_len=T, regression_weight=2.0, ce_weight=0.25,
                     compute_dtype="float32", logits_chunk=T, acceptance_weight=acceptance_weight,
                     acceptance_temperature=0.7)
    h_out, target, mask = _hand_batch(kind, step, np.random.default_rng(10 * step + len(kind)))
    tparams, heads = _params()
    fn = jax.jit(L.step_loss, static_argnums=(0, 1, 7))
    one_document = jnp.ones(mask.shape, jnp.int32)  # segment ids: every row a single conversation
    loss, acc, accept = (float(x) for x in fn(_heads()[kind], tc, heads[kind], tparams, h_out, target, mask, step,
                                              one_document))
    reg, ce, ref_acc, ref_accept = _reference(kind, tc, h_out, target, mask, step)
    assert 0.0 < ref_acc < 1.0 and reg > 0.05 and ce > 0.05  # every term and the accuracy are informative
    assert 0.02 < ref_accept < 0.98
    np.testing.assert_allclose(acc, ref_acc, rtol=1e-6)
    np.testing.assert_allclose(accept, ref_accept, rtol=2e-5)
    extra = acceptance_weight * (1.0 - ref_accept)
    if kind == "eagle1":  # both terms, at their configured weights
        np.testing.assert_allclose(loss, 2.0 * reg + 0.25 * ce + extra, rtol=2e-5)
    else:  # soft CE alone, over the draft vocabulary
        np.testing.assert_allclose(loss, ce + extra, rtol=2e-5)


def test_ttt_loss_weighs_step_j_by_decay_to_the_j():
    hcfg = _heads()["eagle3"]
    tparams, heads = _params()
    tc = TrainConfig(kind="eagle3", ttt_steps=3, ttt_decay=0.5, seq_len=T, compute_dtype="float32", logits_chunk=T,
                     remat=False)
    rng = np.random.default_rng(3)
    tokens = jnp.asarray(rng.integers(2, TARGET.vocab_size, (B, T)), jnp.int32)
    batch = {"tokens": tokens, "loss_mask": jnp.asarray(LOSS_MASK), "lengths": jnp.full((B,), T),
             "segment_ids": jnp.ones((B, T), jnp.int32)}

    @jax.jit
    def run(hp, tparams, batch):
        target = L.target_outputs(hcfg, tc, tparams, batch["tokens"])
        return L.ttt_loss(hcfg, tc, hp, tparams, batch, target, jax.random.PRNGKey(0))[1]

    m = {k: float(v) for k, v in run(heads["eagle3"], tparams, batch).items()}
    assert all(m[f"loss_{j}"] > 0.1 for j in range(3))
    np.testing.assert_allclose(m["loss"], m["loss_0"] + 0.5 * m["loss_1"] + 0.25 * m["loss_2"], rtol=1e-6)
