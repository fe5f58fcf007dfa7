"""PPSD: early-exit self-speculation run as a two-stage pipeline, verify-while-draft per token.

Li, Liu, Shi, Shao, Zhang, Li, *Pipeline Parallelism is All You Need for Optimized Early-Exit
Based Self-Speculative Decoding*, 2025, arXiv 2509.19368. No code was released; the mechanics
below are a reconstruction [I] of the abstract's "verify-while-draft" pipeline.

The target's layers are cut at E: stage 1 = layers [0, E) plus the exit head (heads/exit_head.py),
stage 2 = layers [E, L) plus the final norm and LM head. One *tick* runs both stages once, at
the same time on two devices:

* stage 1 reads one token per row at position t + 1 (normally the exit head's draft for t + 1),
  writes its K/V in layers [0, E) and in the head's own one-layer cache, and drafts t + 2;
* stage 2 reads the trunk output of position t (computed by stage 1 one tick earlier), writes
  layers [E, L) and gives the full model's p for t + 1, which tests the draft for t + 1.

Accepted: the draft is emitted and stage 1's work on it is exactly the next tick's stage-2 input
(the pipeline advances one token a tick). Rejected: the correction is emitted, stage 1's work on
the draft is dropped (its cache slots are rewritten next tick) and the next tick is a *bubble*:
stage 1 runs the correction while stage 2 has nothing to do. So each accepted token costs one
tick and each rejection one more; a tick costs max(stage 1, stage 2) on two devices.

Per row the state is `base` (positions < base are in every layer's cache), `tok` (the verified
token at base), and when `has_mid` the trunk output `h_mid` of `tok` plus the head's draft for
base + 1 with its distribution `q`. Stage 1's cursor is base + has_mid, stage 2's is base.

The test is the chain rule (verify/chain.py): greedy accepts iff the draft is the full model's
argmax (so output = AR greedy); sampling accepts with probability min(1, p/q) and otherwise
emits a sample of norm(max(0, p − q)), lossless. Each position is tested once with randomness
`fold_in(key, row, position)`, so the one- and two-device modes emit the same tokens.

Two devices: one jitted program under `shard_map` over PEARL's ("data", "role") mesh; role 0 runs
stage 1, role 1 stage 2 (`lax.cond` on `axis_index`). Stage 2 *takes the decision itself*: it
holds p, and the draft and q arrived with the previous exchange. After each tick one collective
permute swaps (trunk output, new draft, q) from role 0 for (accept bit, correction) from role 1,
so the decision is computed once and broadcast, never recomputed on the other device: the two
devices cannot diverge even if their floating point differed. Each device carries the whole
target cache (it touches only its stage's layers) [I: simple; small next to the weights for the
models jspec runs]. One device: both stages run one after the other each tick (tests, one-GPU
users; slower than AR there, since nothing overlaps).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from ... import model as M
from ...config import ModelConfig
from ...decode import emit
from ...heads import exit_head as EH
from ...sampling import Sampling, probs
from .pearl import DATA_AXIS, ROLE_AXIS, ParallelResult, _categorical, _row_keys, _uniform, pearl_mesh, still_running

STAGE1_ROLE, STAGE2_ROLE = 0, 1
ppsd_mesh = pearl_mesh  # the same ("data", "role") pairs


@struct.dataclass
class PpsdState:
    cache: M.KVCache  # the target's; lengths = base (positions < base are in every layer)
    ecache: M.KVCache  # the exit head's one layer; written at stage 1's cursor
    out: jax.Array  # [B, max_new]
    n_out: jax.Array  # [B]
    done: jax.Array  # [B]
    tok: jax.Array  # [B] verified token at position base
    has_mid: jax.Array  # [B] bool: h_mid / draft / q describe `tok` (else a bubble tick runs it)
    h_mid: jax.Array  # [B, D] trunk output (raw residual after layer E-1) of `tok`
    draft: jax.Array  # [B] exit-head draft for position base + 1
    q: jax.Array  # [B, V] its distribution ([B, 1] when greedy)
    row_id: jax.Array  # [B] global row index (randomness)
    ticks: jax.Array  # [B] ticks while the row was active (the prefill counts as one)
    drafted: jax.Array  # [B] drafts tested
    accepted: jax.Array  # [B]
    bubbles: jax.Array  # [B] ticks in which stage 2 had nothing to do for the row


def _stage1(tparams, tcfg, eparams, ecfg, exit_layer, sampling, key, kernels, s: PpsdState):
    """Trunk + exit head on one token per row; returns (h [B, D], draft [B], q, cache, ecache)."""
    cur = s.cache.lengths + s.has_mid.astype(jnp.int32)
    inp = jnp.where(s.has_mid, s.draft, s.tok)
    trunk = EH.trunk_hidden(tparams, tcfg, inp[:, None], s.cache.replace(lengths=cur), exit_layer, kernels=kernels)
    if ecfg is None:  # no trained head: the target's own final norm and LM head
        logits, ecache = M.lm_head(tparams, tcfg, M.rms_norm(trunk.hidden[:, 0], tparams["final_norm"], tcfg.rms_norm_eps)), s.ecache
    else:
        logits, ecache = EH.head_logits(eparams, ecfg, trunk.hidden, s.ecache.replace(lengths=cur), kernels=kernels)
        logits = logits[:, 0]
    if sampling.greedy:
        draft, q = jnp.argmax(logits, -1).astype(jnp.int32), jnp.zeros((logits.shape[0], 1), jnp.float32)
    else:
        q = probs(logits, sampling)
        keys = _row_keys(jax.random.fold_in(key, 1), s.row_id, (cur + 1)[:, None])[:, 0]
        draft = _categorical(keys, jnp.log(q))
    return trunk.hidden[:, 0], draft, q, trunk.cache, ecache


def _stage2(tparams, tcfg, exit_layer, sampling, key, kernels, s: PpsdState):
    """Layers [E, L) on h_mid at position base, then the test of the draft for base + 1.
    Returns (accept [B] bool, correction [B], cache)."""
    out = M.forward(tparams, tcfg, None, s.cache, hidden_in=s.h_mid[:, None].astype(tparams["embed"].dtype),
                    layer_range=(exit_layer, tcfg.num_layers), kernels=kernels)
    logits = M.lm_head(tparams, tcfg, out.hidden[:, 0])
    if sampling.greedy:
        top = jnp.argmax(logits, -1).astype(jnp.int32)
        return s.draft == top, top, out.cache
    pos = (s.cache.lengths + 1)[:, None]  # the tested position
    p = probs(logits, sampling)
    p_at = jnp.take_along_axis(p, s.draft[:, None], -1)[:, 0]
    q_at = jnp.take_along_axis(s.q, s.draft[:, None], -1)[:, 0]
    u = _uniform(_row_keys(jax.random.fold_in(key, 2), s.row_id, pos))[:, 0]
    accept = u * q_at < p_at
    res = jnp.maximum(p - s.q, 0.0)
    mass = jnp.sum(res, -1, keepdims=True)
    res = jnp.where(mass > 0, res / jnp.where(mass > 0, mass, 1.0), p)
    corr = _categorical(_row_keys(jax.random.fold_in(key, 3), s.row_id, pos)[:, 0], jnp.log(res))
    return accept, corr, out.cache


def _advance(s: PpsdState, accept, corr, h1, d1, q1, max_new: int, tcfg: ModelConfig) -> PpsdState:
    """The same pure update on every device, from stage 2's decision and stage 1's outputs."""
    active = ~s.done
    steady = s.has_mid
    ok = steady & accept
    emitted = jnp.where(accept, s.draft, corr)
    out, n_out, done = emit(tcfg, s.out, s.n_out, s.done, emitted[:, None], steady.astype(jnp.int32), max_new)
    # steady + accepted: stage 1's work is the next input; steady + rejected: bubble next;
    # bubble: stage 1 ran `tok`, the pipeline is full again.
    has_mid = ok | ~steady
    w = lambda new, old: jnp.where(active.reshape((-1,) + (1,) * (new.ndim - 1)), new, old)  # noqa: E731
    base = s.cache.lengths
    step = active.astype(jnp.int32)
    return PpsdState(
        cache=s.cache.replace(lengths=w(base + steady.astype(jnp.int32), base)), ecache=s.ecache,
        out=out, n_out=n_out, done=done,
        tok=w(jnp.where(steady, emitted, s.tok), s.tok), has_mid=w(has_mid, s.has_mid),
        h_mid=w(h1.astype(s.h_mid.dtype), s.h_mid), draft=w(d1, s.draft), q=w(q1, s.q), row_id=s.row_id,
        ticks=s.ticks + step, drafted=s.drafted + (steady & active).astype(jnp.int32),
        accepted=s.accepted + (ok & active).astype(jnp.int32), bubbles=s.bubbles + (~steady & active).astype(jnp.int32),
    )


def _run(tparams, eparams, tokens, lens, key, row_id, *, tcfg, ecfg, exit_layer, max_new, cache_len, sampling,
         kernels, two_device: bool):
    B = tokens.shape[0]
    dtype = tparams["embed"].dtype
    role = jax.lax.axis_index(ROLE_AXIS) if two_device else None

    # Prefill (both devices run it: each needs the prompt in its stage's layers; the first token
    # is role 1's, sent over, like every decision).
    cache = M.init_cache(tcfg, B, cache_len, dtype)
    full = M.forward(tparams, tcfg, tokens, cache, capture=(exit_layer,), kernels=kernels, unroll=1)  # a prompt
    if ecfg is None:
        ecache = M.init_cache(tcfg, B, 1, dtype, num_layers=1)  # unused
    else:
        _, ecache = EH.head_logits(eparams, ecfg, full.captured[0], M.init_cache(ecfg, B, cache_len, eparams["embed"].dtype),
                                   kernels=kernels)
    h = jnp.take_along_axis(full.hidden, (lens - 1)[:, None, None], axis=1)[:, 0]
    logits = M.lm_head(tparams, tcfg, h)
    if sampling.greedy:
        first = jnp.argmax(logits, -1).astype(jnp.int32)
    else:
        keys = _row_keys(jax.random.fold_in(key, 0), row_id, lens[:, None])[:, 0]
        first = _categorical(keys, jnp.log(probs(logits, sampling)))
    if two_device:
        other = jax.lax.ppermute(first, ROLE_AXIS, [(0, 1), (1, 0)])
        first = jnp.where(role == STAGE1_ROLE, other, first)

    out = jnp.full((B, max_new), -1, jnp.int32)
    zeros = jnp.zeros((B,), jnp.int32)
    out, n_out, done = emit(tcfg, out, zeros, jnp.zeros((B,), bool), first[:, None], jnp.ones_like(zeros), max_new)
    qV = 1 if sampling.greedy else tcfg.vocab_size
    state = PpsdState(
        cache=full.cache.replace(lengths=lens.astype(jnp.int32)), ecache=ecache, out=out, n_out=n_out, done=done,
        tok=first, has_mid=jnp.zeros((B,), bool), h_mid=jnp.zeros((B, tcfg.hidden_size), dtype), draft=zeros,
        q=jnp.zeros((B, qV), jnp.float32), row_id=row_id, ticks=jnp.ones_like(zeros), drafted=zeros, accepted=zeros,
        bubbles=zeros,
    )
    tparams = M.loop_params(tparams, tcfg, kernels=kernels)  # per-layer weight buffers for the ticks, after the prefill
    stage1 = functools.partial(_stage1, tparams, tcfg, eparams, ecfg, exit_layer, sampling, key, kernels)
    stage2 = functools.partial(_stage2, tparams, tcfg, exit_layer, sampling, key, kernels)

    def body(s: PpsdState) -> PpsdState:
        base = s.cache.lengths
        if two_device:
            def as_stage1(s):
                h1, d1, q1, cache, ecache = stage1(s)
                return (h1, d1, q1, zeros, zeros), cache, ecache

            def as_stage2(s):
                accept, corr, cache = stage2(s)
                return (s.h_mid, zeros, jnp.zeros_like(s.q), accept.astype(jnp.int32), corr), cache, s.ecache

            mine, cache, ecache = jax.lax.cond(role == STAGE1_ROLE, as_stage1, as_stage2, s)
            # One swap: role 0 sends its stage-1 outputs, role 1 its decision.
            other = jax.lax.ppermute(mine, ROLE_AXIS, [(0, 1), (1, 0)])
            is1 = role == STAGE1_ROLE
            h1, d1, q1 = (jnp.where(is1, a, b) for a, b in zip(mine[:3], other[:3]))
            accept, corr = (jnp.where(is1, b, a) for a, b in zip(mine[3:], other[3:]))
            accept = accept.astype(bool)
        else:
            h1, d1, q1, cache, ecache = stage1(s)
            accept, corr, cache = stage2(s.replace(cache=cache.replace(lengths=base)))
        s = s.replace(cache=cache.replace(lengths=base), ecache=ecache)
        return _advance(s, accept, corr, h1, d1, q1, max_new, tcfg)

    s = jax.lax.while_loop(lambda s: still_running(s.done, two_device), body, state)
    return s.out, s.n_out, s.ticks, s.drafted, s.accepted, s.bubbles


_STATIC = ("tcfg", "ecfg", "exit_layer", "max_new", "cache_len", "sampling", "kernels")


@functools.partial(jax.jit, static_argnames=_STATIC)
def ppsd_one_device_jit(tparams, eparams, tokens, lens, key, *, tcfg, ecfg, exit_layer, max_new, cache_len, sampling,
                        kernels):
    row_id = jnp.arange(tokens.shape[0], dtype=jnp.int32)
    return _run(tparams, eparams, tokens, lens, key, row_id, tcfg=tcfg, ecfg=ecfg, exit_layer=exit_layer,
                max_new=max_new, cache_len=cache_len, sampling=sampling, kernels=kernels, two_device=False)


@functools.lru_cache(maxsize=None)
def _two_device_fn(mesh: Mesh, tcfg, ecfg, exit_layer, max_new, cache_len, sampling, kernels):
    def body(tparams, eparams, tokens, lens, key):
        b = tokens.shape[0]
        row_id = jax.lax.axis_index(DATA_AXIS) * b + jnp.arange(b, dtype=jnp.int32)
        return _run(tparams, eparams, tokens, lens, key, row_id, tcfg=tcfg, ecfg=ecfg, exit_layer=exit_layer,
                    max_new=max_new, cache_len=cache_len, sampling=sampling, kernels=kernels, two_device=True)

    rows = P(DATA_AXIS)
    fn = jax.shard_map(body, mesh=mesh, in_specs=(P(), P(), rows, rows, P()), out_specs=(rows,) * 6, check_vma=False)
    return jax.jit(fn)


def check_ppsd(tcfg: ModelConfig, ecfg: ModelConfig | None, exit_layer: int) -> None:
    EH.check_exit_layer(tcfg, exit_layer)
    if ecfg is not None and (ecfg.num_layers != 1 or ecfg.vocab_size != tcfg.vocab_size or ecfg.hidden_size != tcfg.hidden_size):
        raise ValueError(f"the exit head must be one layer of the target's shape (got {ecfg.num_layers} layers, "
                         f"hidden {ecfg.hidden_size} vs {tcfg.hidden_size}, vocab {ecfg.vocab_size} vs {tcfg.vocab_size})")


def ppsd_generate(tparams, tcfg, eparams, ecfg, exit_layer: int, tokens, lens, key, *, max_new: int, cache_len: int,
                  sampling: Sampling, mesh: Mesh | None = None, kernels: str | None = None) -> ParallelResult:
    """PPSD generation. mesh=None: one device; else a ppsd_mesh (the batch must divide its data axis).
    ecfg / eparams: the exit head, or None to draft with the target's own final norm and LM head
    (untrained early exit: low acceptance).
    cache_len must hold prompt + max_new + 2 slots (decode.pack_prompts(extra=1)). In the result,
    `target_calls` counts ticks and `rolled_back` the rejected drafts (each cost a bubble tick)."""
    check_ppsd(tcfg, ecfg, exit_layer)
    tokens, lens = jnp.asarray(tokens), jnp.asarray(lens)
    static = dict(tcfg=tcfg, ecfg=ecfg, exit_layer=exit_layer, max_new=max_new, cache_len=cache_len, sampling=sampling,
                  kernels=kernels)
    if mesh is None:
        outs = ppsd_one_device_jit(tparams, eparams, tokens, lens, key, **static)
        devices = 1
    else:
        data = mesh.shape[DATA_AXIS]
        if tokens.shape[0] % data:
            raise ValueError(f"batch {tokens.shape[0]} does not divide over the mesh's {data} data groups")
        rep = NamedSharding(mesh, P())
        tparams = jax.device_put(tparams, rep)
        eparams = None if eparams is None else jax.device_put(eparams, rep)
        rows = NamedSharding(mesh, P(DATA_AXIS))
        outs = _two_device_fn(mesh, **static)(tparams, eparams, jax.device_put(tokens, rows), jax.device_put(lens, rows),
                                              jax.device_put(key, rep))
        devices = mesh.devices.size
    out, n_out, ticks, drafted, accepted, bubbles = (np.asarray(x) for x in jax.device_get(outs))
    return ParallelResult(out, n_out, ticks, drafted, accepted, ticks, rolled_back=drafted - accepted, devices=devices,
                          gamma=1)
