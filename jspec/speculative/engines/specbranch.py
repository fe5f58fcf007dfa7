"""SpecBranch: PEARL's parallel draft / verify plus speculative branches and hybrid draft lengths.

Shen, Shen, Kong, Liu, Lu, Wang, *SpecBranch: Speculative Decoding via Hybrid Drafting and
Rollback-Aware Branch Parallelism*, ICLR 2026, arXiv 2506.01979; early code `Sylvan820/Specbranch`
(`src/engine.py::branch_speculative_decoding`, `src/gamma_predictor.py`). The schedule below is
PEARL's (engines/pearl.py) with two changes [I: the paper's exact rules were not available]:

* **Branches.** Every window the drafter drafts B branches as a batch axis: from the same tail,
  B different first tokens (the *heads*: the draft's top-B when greedy, B i.i.d. samples of q
  when sampling), each continued for γ − 1 more tokens. The heads sit at the position the target
  tests right after the pending drafts, the one PEARL tests with a single token; here it is tested
  with the lossless multi-candidate rule of SpecInfer (recursive rejection): head j is accepted
  with probability min(1, p_j(x)/q(x)), on rejection p_{j+1} = norm(max(0, p_j − q)), and if all B
  are rejected the correction is a sample of p_{B+1}; greedy accepts the head equal to the
  target's argmax. A window survives unless every head is wrong. (The released code instead takes
  the head with the largest target probability and tests p/q once, which does not preserve the
  distribution.) The accepted branch's K/V is copied to the other branches' cache rows.
* **Hybrid length.** After head j is accepted, how much of its continuation stays pending (to be
  verified next step) is chosen by `cut`: "none" keeps all γ − 1 (PEARL's rule); "confidence"
  keeps the leading tokens drafted where the draft was confident (its untempered top probability
  max_v q(v) at that position is at least `threshold`), so the next window's heads branch at the
  first low-confidence point; "hrad" asks the H-RAD classifier (heads/hrad.py) on the target's
  features before the head and the head's embedding: class 0 keeps none, class 1 cuts by
  confidence, class 2 keeps all.

  The cut reads the draft's distribution at each position, never the drafted token: a token kept
  because of its own q(x) would be a sample of q restricted to likely tokens, and the next window's
  chain test (which divides by q) would no longer be lossless. For the same reason the redraw may
  reuse a cut token's key: the cut token is a plain sample of q, whatever the cut decided.

Tests per position use `fold_in(key, row, position)` streams (heads: one per branch), so the one-
and two-device modes emit the same tokens. Two devices: as PEARL, one `shard_map` program over a
("data", "role") mesh, one swap per step, and then the target device's decision (which head, how
many tokens accepted, the correction, the kept length) is sent over and used by both devices.
With B = 1 and cut "none" the engine is PEARL, token for token.

Reported: `rolled_back` = tokens of the selected windows that were drafted and then dropped
(rejected, behind a rejection, or cut) over `drafted` (γ per step, as PEARL counts); the B − 1
alternative branches are a hedge computed in the same batched forward and are not counted.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from ... import model as M
from ...config import ModelConfig
from ...decode import emit
from ...heads import hrad as HR
from ...kernels.top_k import top_k
from ...sampling import Sampling, probs
from ..verify.chain import accepted_prefix
from .pearl import (DATA_AXIS, DRAFT_ROLE, ROLE_AXIS, TARGET_ROLE, ParallelResult, _categorical, _row_keys, _uniform,
                    check_pearl, ppermute_packed, still_running)

CUTS = ("none", "confidence", "hrad")


@dataclasses.dataclass(frozen=True)
class SpecBranchConfig:
    """Static settings. Defaults: B = 3 and γ = 4 are the released code's CLI defaults; the
    confidence threshold is [I] (the code's placeholder cuts at q ≤ 0, i.e. never)."""

    branches: int = 3
    gamma: int = 4
    cut: str = "confidence"
    threshold: float = 0.3

    def __post_init__(self):
        if not 1 <= self.branches <= 16:
            raise ValueError(f"branches must be in [1, 16], got {self.branches}")
        if not 1 <= self.gamma <= 64:
            raise ValueError(f"gamma must be in [1, 64], got {self.gamma}")
        if self.cut not in CUTS:
            raise ValueError(f"cut {self.cut!r}: choose from {', '.join(CUTS)}")


@struct.dataclass
class BranchState:
    tcache: M.KVCache  # cursor: verified length - 1
    dcache: M.KVCache  # batch R * NB (branch b of row r at r * NB + b); cursor: tcache cursor + n_pend
    out: jax.Array
    n_out: jax.Array
    done: jax.Array
    last: jax.Array  # [R]
    pend: jax.Array  # [R, G-1]
    pend_q: jax.Array  # [R, G-1, V] ([R, G-1, 1] when greedy)
    n_pend: jax.Array  # [R] in [0, G-1]
    row_id: jax.Array
    target_calls: jax.Array
    drafted: jax.Array
    accepted: jax.Array
    rolled_back: jax.Array
    branch_saves: jax.Array  # [R] windows kept by a head other than the first


def _rep(x, nb):
    return jnp.repeat(x, nb, axis=0)


def _draft_role(dparams, dcfg, sampling, sb: SpecBranchConfig, key, kernels, s: BranchState):
    """B branches of γ tokens: (tokens [R, NB, G], q [R, NB, G, V] or None, conf [R, NB, G], dcache)."""
    R, NB, G = s.last.shape[0], sb.branches, sb.gamma
    tail = jnp.where(s.n_pend > 0, jnp.take_along_axis(s.pend, jnp.maximum(s.n_pend - 1, 0)[:, None], 1)[:, 0] if G > 1 else s.last, s.last)
    kd = jax.random.fold_in(key, 1)
    rows_b = _rep(s.row_id, NB) * NB + jnp.tile(jnp.arange(NB, dtype=jnp.int32), R)  # a stream per (row, branch)

    def fwd(cache, tok):
        out = M.forward(dparams, dcfg, tok[:, None], cache, kernels=kernels)
        return M.lm_head(dparams, dcfg, out.hidden[:, 0]), M.advance(out.cache, jnp.ones_like(cache.lengths))

    def confidence(logits):  # the draft's top probability at a position: its prefix decides, not its token
        return jnp.max(jax.nn.softmax(logits.astype(jnp.float32), -1), -1)

    def pick(logits, slot, tok_keys_rows):  # next token, its (sampling) distribution, confidence
        if sampling.greedy:
            return jnp.argmax(logits, -1).astype(jnp.int32), None, confidence(logits)
        q = probs(logits, sampling)
        nxt = _categorical(_row_keys(kd, tok_keys_rows, slot[:, None])[:, 0], jnp.log(q))
        return nxt, q, confidence(logits)

    # Heads: one forward of the tail (the same in every branch row), B different first tokens.
    logits, dcache = fwd(s.dcache, _rep(tail, NB))
    logits0 = logits.reshape(R, NB, -1)[:, 0]
    slot = s.dcache.lengths.reshape(R, NB)[:, 0] + 1  # the heads' position
    if sampling.greedy:
        heads = top_k(logits0, NB)[1].astype(jnp.int32)  # [R, NB] distinct
        q_head = None
    else:
        q_head = probs(logits0, sampling)
        keys = _row_keys(kd, rows_b, _rep(slot, NB)[:, None])[:, 0]
        heads = _categorical(keys, jnp.log(_rep(q_head, NB))).reshape(R, NB)
    conf_head = jnp.broadcast_to(confidence(logits0)[:, None], (R, NB))

    def one(carry, _):
        cache, tok = carry
        logits, cache = fwd(cache, tok)
        nxt, q, conf = pick(logits, cache.lengths, rows_b)  # the drafted token's position = new cursor
        return (cache, nxt), (nxt, q, conf)

    (dcache, _), (toks, qs, confs) = jax.lax.scan(one, (dcache, heads.reshape(-1)), None, length=G - 1)
    toks = jnp.concatenate([heads[..., None], toks.T.reshape(R, NB, G - 1)], -1)  # [R, NB, G]
    conf = jnp.concatenate([conf_head[..., None], confs.T.reshape(R, NB, G - 1)], -1)
    if sampling.greedy:
        return toks, None, conf, dcache
    rest = jnp.swapaxes(qs, 0, 1).reshape(R, NB, G - 1, -1)
    q_all = jnp.concatenate([jnp.broadcast_to(q_head[:, None, None], (R, NB, 1, q_head.shape[-1])), rest], 2)
    return toks, q_all, conf, dcache


def _target_role(tparams, tcfg, sampling, hp, kernels, s: BranchState):
    """One target forward over [last, pend]: (argmax [R, G], p [R, G, V] or None, H-RAD pre [R, G, H1], tcache)."""
    block = jnp.concatenate([s.last[:, None], s.pend], axis=1)
    cap = HR.feature_layers(tcfg) if hp is not None else ()
    out = M.forward(tparams, tcfg, block, s.tcache, capture=cap, kernels=kernels)
    logits = M.lm_head(tparams, tcfg, out.hidden)
    top = jnp.argmax(logits, -1).astype(jnp.int32)
    pre = (HR.pre_features(hp, HR.target_features(out.captured, out.hidden)) if hp is not None
           else jnp.zeros(block.shape + (1,), jnp.float32))
    return top, (None if sampling.greedy else probs(logits, sampling)), pre, out.cache


def confident_continuation(conf: jax.Array, threshold: float) -> jax.Array:
    """The confidence cut: [R] how many leading tokens of a branch's continuation (positions 1..G-1;
    position 0 is the head, which the target tests) were drafted where the draft was confident,
    max_v q(v) >= threshold at that position. conf [R, G]: that top probability at each position,
    a function of the position's prefix only (module doc), never of the token drafted there."""
    return jnp.sum(jnp.cumprod((conf[:, 1:] >= threshold).astype(jnp.int32), -1), -1).astype(jnp.int32)


def _decision(s: BranchState, toks, q_all, conf, t_top, p, pre, tparams, hp, sampling, sb: SpecBranchConfig, key):
    """(a = pending drafts accepted [R], hit [R] bool, j = accepted head [R], correction [R], keep [R])."""
    R, NB, G = toks.shape
    n_pend = s.n_pend
    k = jnp.arange(G - 1)[None]
    valid = k < n_pend[:, None]
    base = s.tcache.lengths
    heads = toks[:, :, 0]
    if sampling.greedy:
        a = accepted_prefix((s.pend == t_top[:, : G - 1]) & valid) if G > 1 else jnp.zeros_like(n_pend)
        top_at = jnp.take_along_axis(t_top, n_pend[:, None], 1)[:, 0]
        match = heads == top_at[:, None]
        hit, j = match.any(-1), jnp.argmax(match, -1).astype(jnp.int32)
        correction = jnp.take_along_axis(t_top, a[:, None], 1)[:, 0]  # a < n_pend: there; else at the heads
    else:
        a = jnp.zeros_like(n_pend)
        if G > 1:
            p_at = jnp.take_along_axis(p[:, : G - 1], s.pend[..., None], -1)[..., 0]
            q_at = jnp.take_along_axis(s.pend_q, s.pend[..., None], -1)[..., 0]
            u = _uniform(_row_keys(jax.random.fold_in(key, 2), s.row_id, base[:, None] + 1 + k))
            a = accepted_prefix((u * q_at < p_at) & valid)
        # recursive rejection over the heads at block index n_pend
        pos = base + 1 + n_pend
        p_cur = jnp.take_along_axis(p, n_pend[:, None, None], 1)[:, 0]
        q_head = q_all[:, 0, 0]
        hit, j = jnp.zeros((R,), bool), jnp.zeros((R,), jnp.int32)
        for b in range(NB):
            x = heads[:, b]
            # head 0 draws what PEARL draws at this position, so B = 1 is PEARL exactly
            u = _uniform(_row_keys(jax.random.fold_in(key, 2 if b == 0 else 3 + b), s.row_id, pos[:, None]))[:, 0]
            px = jnp.take_along_axis(p_cur, x[:, None], -1)[:, 0]
            qx = jnp.take_along_axis(q_head, x[:, None], -1)[:, 0]
            ok = ~hit & (u * qx < px)
            j = jnp.where(ok, b, j)
            res = jnp.maximum(p_cur - q_head, 0.0)
            mass = jnp.sum(res, -1, keepdims=True)
            p_next = jnp.where(mass > 0, res / jnp.where(mass > 0, mass, 1.0), p_cur)
            p_cur = jnp.where((hit | ok)[:, None], p_cur, p_next)
            hit = hit | ok
        # correction: the residual at the first rejected pending draft, else a sample of p_{B+1}
        ai = jnp.minimum(a, G - 2) if G > 1 else a
        p_a = jnp.take_along_axis(p, ai[:, None, None], 1)[:, 0]
        q_a = jnp.take_along_axis(s.pend_q, ai[:, None, None], 1)[:, 0] if G > 1 else jnp.zeros_like(p_a)
        res = jnp.maximum(p_a - q_a, 0.0)
        mass = jnp.sum(res, -1, keepdims=True)
        res = jnp.where(mass > 0, res / jnp.where(mass > 0, mass, 1.0), p_a)
        chain_rej = a < n_pend
        dist = jnp.where(chain_rej[:, None], res, p_cur)
        rkeys = _row_keys(jax.random.fold_in(key, 3), s.row_id, (base + 1 + a)[:, None])[:, 0]
        correction = _categorical(rkeys, jnp.log(dist))
    # how much of the accepted branch stays pending
    tok_j = jnp.take_along_axis(toks, j[:, None, None], 1)[:, 0]  # [R, G]
    conf_j = jnp.take_along_axis(conf, j[:, None, None], 1)[:, 0]
    by_conf = confident_continuation(conf_j, sb.threshold)
    if sb.cut == "none":
        keep = jnp.full_like(a, G - 1)
    elif sb.cut == "confidence":
        keep = by_conf
    else:
        pre_at = jnp.take_along_axis(pre, n_pend[:, None, None], 1)[:, 0]
        cls = jnp.argmax(HR.classify(hp, pre_at, tparams["embed"][tok_j[:, 0]]), -1)
        keep = jnp.where(cls == 0, 0, jnp.where(cls == 1, by_conf, G - 1)).astype(jnp.int32)
    return a, hit, j, correction, keep


def _apply(s: BranchState, toks, q_all, decision, sampling, sb: SpecBranchConfig, max_new: int, tcfg) -> BranchState:
    a, hit, j, correction, keep = decision
    R, NB, G = toks.shape
    n_pend = s.n_pend
    chain_rej = a < n_pend
    took = ~chain_rej & hit
    tok_j = jnp.take_along_axis(toks, j[:, None, None], 1)[:, 0]  # [R, G]
    k = jnp.arange(G)[None]
    pend_pad = jnp.concatenate([s.pend, jnp.zeros((R, 1), jnp.int32)], axis=1)
    nxt = jnp.where(took, tok_j[:, 0], correction)
    emitted = jnp.where(k < a[:, None], pend_pad, jnp.where(k == a[:, None], nxt[:, None], 0))
    n_emit = a + 1
    active = ~s.done
    out, n_out, done = emit(tcfg, s.out, s.n_out, s.done, emitted, n_emit, max_new)

    base = s.tcache.lengths
    new_base = base + n_emit
    new_n_pend = jnp.where(took, keep, 0).astype(jnp.int32)
    w = lambda new, old: jnp.where(active.reshape((-1,) + (1,) * (new.ndim - 1)), new, old)  # noqa: E731
    new_pend_q = s.pend_q if sampling.greedy else jnp.take_along_axis(q_all, j[:, None, None, None], 1)[:, 0, 1:]
    # every branch row of the draft cache gets the accepted branch's K/V of the kept pending slots
    dc = s.dcache
    slots = new_base[:, None] + jnp.arange(max(G - 1, 1), dtype=jnp.int32)[None]  # [R, G-1]
    src_b = jnp.arange(R) * NB + j
    dst_slots = _rep(slots, NB)

    def copy(x):  # x [L, R*NB, S, H, D]
        vals = x[:, src_b[:, None], slots]  # [L, R, G-1, H, D]
        return x.at[:, jnp.arange(R * NB)[:, None], dst_slots].set(_rep(vals.swapaxes(0, 1), NB).swapaxes(0, 1), mode="drop")

    dcache = dc.replace(k=copy(dc.k), v=copy(dc.v), lengths=_rep(w(new_base + new_n_pend, base + n_pend), NB))
    dropped = jnp.where(took, G - 1 - keep, n_pend - a + G)
    step = active.astype(jnp.int32)
    return BranchState(
        tcache=s.tcache.replace(lengths=w(new_base, base)), dcache=dcache, out=out, n_out=n_out, done=done,
        last=w(nxt, s.last), pend=w(tok_j[:, 1:], s.pend), pend_q=w(new_pend_q, s.pend_q),
        n_pend=w(new_n_pend, n_pend), row_id=s.row_id, target_calls=s.target_calls + step,
        drafted=s.drafted + G * step, accepted=s.accepted + (a + took.astype(jnp.int32)) * step,
        rolled_back=s.rolled_back + dropped * step, branch_saves=s.branch_saves + (took & (j > 0)).astype(jnp.int32) * step,
    )


def _run(tparams, dparams, hp, tokens, lens, key, row_id, *, tcfg, dcfg, sb, max_new, cache_len, sampling, kernels,
         two_device: bool):
    R = tokens.shape[0]
    NB, G = sb.branches, sb.gamma
    V = tcfg.vocab_size
    dtype = tparams["embed"].dtype
    role = jax.lax.axis_index(ROLE_AXIS) if two_device else None

    def target_prefill(_):
        cache = M.init_cache(tcfg, R, cache_len, dtype)
        out = M.forward(tparams, tcfg, tokens, cache, kernels=kernels, unroll=1)  # a prompt: scanned
        h = jnp.take_along_axis(out.hidden, (lens - 1)[:, None, None], axis=1)[:, 0]
        logits = M.lm_head(tparams, tcfg, h)
        if sampling.greedy:
            first = jnp.argmax(logits, -1).astype(jnp.int32)
        else:
            keys = _row_keys(jax.random.fold_in(key, 0), row_id, lens[:, None])[:, 0]
            first = _categorical(keys, jnp.log(probs(logits, sampling)))
        return first, out.cache.replace(lengths=lens.astype(jnp.int32))

    def draft_prefill(_):
        cache = M.init_cache(dcfg, R * NB, cache_len, dparams["embed"].dtype)
        out = M.forward(dparams, dcfg, _rep(tokens, NB), cache, kernels=kernels, unroll=1)
        return out.cache.replace(lengths=_rep(lens, NB).astype(jnp.int32))

    empty_t = M.init_cache(tcfg, R, cache_len, dtype).replace(lengths=lens.astype(jnp.int32))
    empty_d = M.init_cache(dcfg, R * NB, cache_len, dparams["embed"].dtype).replace(lengths=_rep(lens, NB).astype(jnp.int32))
    if two_device:
        first, tcache, dcache = jax.lax.cond(
            role == DRAFT_ROLE, lambda _: (jnp.zeros((R,), jnp.int32), empty_t, draft_prefill(None)),
            lambda _: (*target_prefill(None), empty_d), None)
        other = jax.lax.ppermute(first, ROLE_AXIS, [(0, 1), (1, 0)])
        first = jnp.where(role == DRAFT_ROLE, other, first)
    else:
        first, tcache = target_prefill(None)
        dcache = draft_prefill(None)

    out = jnp.full((R, max_new), -1, jnp.int32)
    zeros = jnp.zeros((R,), jnp.int32)
    out, n_out, done = emit(tcfg, out, zeros, jnp.zeros((R,), bool), first[:, None], jnp.ones_like(zeros), max_new)
    qV = 1 if sampling.greedy else V
    state = BranchState(
        tcache=tcache, dcache=dcache, out=out, n_out=n_out, done=done, last=first,
        pend=jnp.zeros((R, G - 1), jnp.int32), pend_q=jnp.zeros((R, G - 1, qV), jnp.float32), n_pend=zeros,
        row_id=row_id, target_calls=jnp.ones_like(zeros), drafted=zeros, accepted=zeros, rolled_back=zeros,
        branch_saves=zeros)
    H1 = 1 if hp is None else hp["b1"].shape[0]

    # per-layer weight buffers for the loop (model.loop_params), after the scanned prefills
    tparams, dparams = M.loop_params(tparams, tcfg, kernels=kernels), M.loop_params(dparams, dcfg, kernels=kernels)

    def body(s: BranchState) -> BranchState:
        if two_device:
            def as_draft(s):
                toks, q_all, conf, dcache = _draft_role(dparams, dcfg, sampling, sb, key, kernels, s)
                tz = (jnp.zeros((R, G), jnp.int32), None if sampling.greedy else jnp.zeros((R, G, V), jnp.float32),
                      jnp.zeros((R, G, H1), jnp.float32))
                return (toks, q_all, conf) + tz, s.tcache, dcache

            def as_target(s):
                top, p, pre, tcache = _target_role(tparams, tcfg, sampling, hp, kernels, s)
                dz = (jnp.zeros((R, NB, G), jnp.int32), None if sampling.greedy else jnp.zeros((R, NB, G, V), jnp.float32),
                      jnp.zeros((R, NB, G), jnp.float32))
                return dz + (top, p, pre), tcache, s.dcache

            mine, tcache, dcache = jax.lax.cond(role == DRAFT_ROLE, as_draft, as_target, s)
            other = ppermute_packed(mine, ROLE_AXIS, [(0, 1), (1, 0)])
            is_d = role == DRAFT_ROLE
            pick = lambda a, b, own: None if a is None else jnp.where(own, a, b)  # noqa: E731
            toks, q_all, conf = (pick(a, b, is_d) for a, b in zip(mine[:3], other[:3]))
            t_top, p, pre = (pick(a, b, ~is_d) for a, b in zip(mine[3:], other[3:]))
        else:
            toks, q_all, conf, dcache = _draft_role(dparams, dcfg, sampling, sb, key, kernels, s)
            t_top, p, pre, tcache = _target_role(tparams, tcfg, sampling, hp, kernels, s)
        s = s.replace(tcache=tcache, dcache=dcache)
        decision = _decision(s, toks, q_all, conf, t_top, p, pre, tparams, hp, sampling, sb, key)
        if two_device:
            # the target device's decision, for both: floating point can never split them
            sent = tuple(x.astype(jnp.int32) for x in decision)
            got = ppermute_packed(sent, ROLE_AXIS, [(TARGET_ROLE, DRAFT_ROLE)])
            a, hit, j, corr, keep = (jnp.where(role == TARGET_ROLE, mine_, got_) for mine_, got_ in zip(sent, got))
            decision = (a, hit.astype(bool), j, corr, keep)
        return _apply(s, toks, q_all, decision, sampling, sb, max_new, tcfg)

    s = jax.lax.while_loop(lambda s: still_running(s.done, two_device), body, state)
    return s.out, s.n_out, s.target_calls, s.drafted, s.accepted, s.rolled_back, s.branch_saves


_STATIC = ("tcfg", "dcfg", "sb", "max_new", "cache_len", "sampling", "kernels")


@functools.partial(jax.jit, static_argnames=_STATIC)
def specbranch_one_device_jit(tparams, dparams, hp, tokens, lens, key, *, tcfg, dcfg, sb, max_new, cache_len, sampling,
                              kernels):
    row_id = jnp.arange(tokens.shape[0], dtype=jnp.int32)
    return _run(tparams, dparams, hp, tokens, lens, key, row_id, tcfg=tcfg, dcfg=dcfg, sb=sb, max_new=max_new,
                cache_len=cache_len, sampling=sampling, kernels=kernels, two_device=False)


@functools.lru_cache(maxsize=None)
def _two_device_fn(mesh: Mesh, tcfg, dcfg, sb, max_new, cache_len, sampling, kernels):
    def body(tparams, dparams, hp, tokens, lens, key):
        b = tokens.shape[0]
        row_id = jax.lax.axis_index(DATA_AXIS) * b + jnp.arange(b, dtype=jnp.int32)
        return _run(tparams, dparams, hp, tokens, lens, key, row_id, tcfg=tcfg, dcfg=dcfg, sb=sb, max_new=max_new,
                    cache_len=cache_len, sampling=sampling, kernels=kernels, two_device=True)

    rows = P(DATA_AXIS)
    fn = jax.shard_map(body, mesh=mesh, in_specs=(P(), P(), P(), rows, rows, P()), out_specs=(rows,) * 7,
                       check_vma=False)
    return jax.jit(fn)


def specbranch_generate(tparams, tcfg, dparams, dcfg, tokens, lens, key, *, sb: SpecBranchConfig, max_new: int,
                        cache_len: int, sampling: Sampling, hrad_params=None, mesh: Mesh | None = None,
                        kernels: str | None = None) -> ParallelResult:
    """SpecBranch generation. mesh=None: one device; else a pearl_mesh. cache_len must hold prompt +
    max_new + 2 γ slots (decode.pack_prompts(extra=2 * gamma)). `hrad_params` (heads/hrad.py) is
    needed by cut="hrad". The result's `branch_saves` counts windows kept by a head other than the
    drafter's first choice."""
    check_pearl(tcfg, dcfg, sb.gamma)
    if (sb.cut == "hrad") != (hrad_params is not None):
        raise ValueError("cut='hrad' needs hrad_params (and only it uses them)")
    tokens, lens = jnp.asarray(tokens), jnp.asarray(lens)
    static = dict(tcfg=tcfg, dcfg=dcfg, sb=sb, max_new=max_new, cache_len=cache_len, sampling=sampling, kernels=kernels)
    if mesh is None:
        outs = specbranch_one_device_jit(tparams, dparams, hrad_params, tokens, lens, key, **static)
        devices = 1
    else:
        data = mesh.shape[DATA_AXIS]
        if tokens.shape[0] % data:
            raise ValueError(f"batch {tokens.shape[0]} does not divide over the mesh's {data} data groups")
        rep = NamedSharding(mesh, P())
        put = lambda x: None if x is None else jax.device_put(x, rep)  # noqa: E731
        rows = NamedSharding(mesh, P(DATA_AXIS))
        outs = _two_device_fn(mesh, **static)(put(tparams), put(dparams), put(hrad_params), jax.device_put(tokens, rows),
                                              jax.device_put(lens, rows), put(key))
        devices = mesh.devices.size
    out, n_out, calls, drafted, accepted, rolled, saves = (np.asarray(x) for x in jax.device_get(outs))
    return ParallelResult(out, n_out, calls, drafted, accepted, calls, rolled_back=rolled, devices=devices, gamma=sb.gamma,
                          branch_saves=saves)
