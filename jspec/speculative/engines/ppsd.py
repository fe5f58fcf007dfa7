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

Two devices: one jitted program under `shard_map` over PEARL's ("data", "role") mesh, role 0
running stage 1 and role 1 stage 2. The two stages are given the same shape, S layers each
(`stage_depth`; the shorter is padded with all-zero identity layers), so both devices run *the same
instructions* on their own weights and cache: no `lax.cond` on the role, which XLA on a GPU
executes by reading the branch index back to the host every tick. Stage 2 *takes the decision
itself*: it holds p, and the draft and q arrived with the previous exchange. After each tick one
collective permute of one packed buffer swaps (trunk output, new draft, q) from role 0 for
(accept bit, correction) from role 1, so the decision is computed once and broadcast, never
recomputed on the other device: the two devices cannot diverge even if their floating point
differed. Every device runs the prefill over the whole target (the replicated weights), then
keeps only its stage's S layers of weights and cache for the ticks. One device: both stages run
one after the other each tick, through the same stage function (tests, one-GPU users; slower than
AR there, since nothing overlaps).
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
from .pearl import (DATA_AXIS, ROLE_AXIS, ParallelResult, _categorical, _row_keys, _uniform, pearl_mesh, ppermute_packed,
                    still_running)

STAGE1_ROLE, STAGE2_ROLE = 0, 1
ppsd_mesh = pearl_mesh  # the same ("data", "role") pairs


@struct.dataclass
class PpsdState:
    caches: tuple  # per stage this device runs (both on one device, its own on two): KVCache [S, B, ...]
    base: jax.Array  # [B] positions < base are in every stage's cache
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


# ---------------------------------------------------------------------------------------------
# The two stages as one layer stack each: same shapes, so one program runs either
# ---------------------------------------------------------------------------------------------


def stage_depth(tcfg: ModelConfig, exit_layer: int) -> int:
    """Layers per stage, S: stage 1 holds layers [0, E) and the exit layer (an identity layer when
    there is no trained head, so its local layer E always reads the trunk output), stage 2 layers
    [E, L); the shorter one is padded with identity layers."""
    return max(exit_layer + 1, tcfg.num_layers - exit_layer)


def _identity_layer(layer: dict) -> dict:
    """All-zero weights: the norms feeding attention and the MLP output 0, so both branches add
    exactly 0 to the residual stream (and the K/V it writes are never read as anything else)."""
    return jax.tree.map(jnp.zeros_like, layer)


def _layer(layers: dict, i: int) -> dict:
    return jax.tree.map(lambda a: a[i], layers)


def stage_layers(tparams: dict, tcfg: ModelConfig, eparams: dict | None, exit_layer: int) -> tuple[list, list]:
    """(stage 1, stage 2) as lists of S per-layer weight dicts."""
    S = stage_depth(tcfg, exit_layer)
    trunk = [_layer(tparams["layers"], i) for i in range(tcfg.num_layers)]
    pad = _identity_layer(trunk[0])
    s1 = trunk[:exit_layer] + ([_layer(eparams["layers"], 0)] if eparams is not None else [])
    s2 = trunk[exit_layer:]
    return s1 + [pad] * (S - len(s1)), s2 + [pad] * (S - len(s2))


def stage_sliding(tcfg: ModelConfig, exit_layer: int) -> tuple[tuple[bool, ...], tuple[bool, ...]]:
    """Per-layer sliding-window flags of the two stages (the exit layer takes the flag of the layer
    it sits behind, as heads/exit_head.exit_config does; pads are full-attention)."""
    S = stage_depth(tcfg, exit_layer)
    flags = tuple(tcfg.sliding_layers) if tcfg.has_sliding else (False,) * tcfg.num_layers
    s1 = flags[:exit_layer] + (flags[exit_layer - 1],)
    s2 = flags[exit_layer:]
    return s1 + (False,) * (S - len(s1)), s2 + (False,) * (S - len(s2))


def _pick(role, a, b):
    """a on role 0, b on role 1 (role: a Python int on one device, the traced axis index on two)."""
    if isinstance(role, int):
        return a if role == STAGE1_ROLE else b
    return jax.tree.map(lambda x, y: jnp.where(role == STAGE1_ROLE, x, y), a, b)


# ---------------------------------------------------------------------------------------------
# One stage on one tick, and the message it sends
# ---------------------------------------------------------------------------------------------
#
# A message is (h [B, D], draft [B], accept [B], correction [B], q or p [B, qV]). Stage 1 fills h,
# draft and q; stage 2 accept and correction; each also computes the other's fields (the same
# program runs on both devices), which the receiver ignores. It travels as one buffer
# (pearl.ppermute_packed): one collective permute a tick.


def _stage(params, scfg, tcfg, sliding, exit_layer, sampling, key, kernels, role, cache, s: PpsdState):
    """Run this role's stage on its one token per row; returns (message, cache).

    Stage 1 reads the embedding of `draft` (or of `tok` on a bubble tick) at position base +
    has_mid and drafts the next token from the exit head; stage 2 reads h_mid at position base and
    tests `draft` with the full model's distribution (the chain rule of verify/chain.py)."""
    is1 = role == STAGE1_ROLE
    cur = s.base + jnp.where(is1, s.has_mid, False).astype(jnp.int32)
    tok_in = jnp.where(s.has_mid, s.draft, s.tok)
    x = jnp.where(is1, M.embed(params, tcfg, tok_in[:, None]), s.h_mid[:, None].astype(params["embed"].dtype))
    out = M.forward(params, scfg, None, cache.replace(lengths=cur), hidden_in=x, capture=(exit_layer,), kernels=kernels,
                    layer_sliding=sliding)
    logits = M.lm_head(params, tcfg, out.hidden[:, 0])
    h = out.captured[0][:, 0]
    if sampling.greedy:
        top = jnp.argmax(logits, -1).astype(jnp.int32)
        return (h, top, s.draft == top, top, jnp.zeros((top.shape[0], 1), jnp.float32)), out.cache
    dist = probs(logits, sampling)  # q on stage 1, p on stage 2
    draft = _categorical(_row_keys(jax.random.fold_in(key, 1), s.row_id, (cur + 1)[:, None])[:, 0], jnp.log(dist))
    pos = (s.base + 1)[:, None]  # the position stage 2 tests
    p_at = jnp.take_along_axis(dist, s.draft[:, None], -1)[:, 0]
    q_at = jnp.take_along_axis(s.q, s.draft[:, None], -1)[:, 0]
    accept = _uniform(_row_keys(jax.random.fold_in(key, 2), s.row_id, pos))[:, 0] * q_at < p_at
    res = jnp.maximum(dist - s.q, 0.0)
    mass = jnp.sum(res, -1, keepdims=True)
    res = jnp.where(mass > 0, res / jnp.where(mass > 0, mass, 1.0), dist)
    corr = _categorical(_row_keys(jax.random.fold_in(key, 3), s.row_id, pos)[:, 0], jnp.log(res))
    return (h, draft, accept, corr, dist), out.cache


def _advance(s: PpsdState, caches, accept, corr, h1, d1, q1, max_new: int, tcfg: ModelConfig) -> PpsdState:
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
    step = active.astype(jnp.int32)
    return PpsdState(
        caches=caches, base=w(s.base + steady.astype(jnp.int32), s.base),
        out=out, n_out=n_out, done=done,
        tok=w(jnp.where(steady, emitted, s.tok), s.tok), has_mid=w(has_mid, s.has_mid),
        h_mid=w(h1.astype(s.h_mid.dtype), s.h_mid), draft=w(d1, s.draft), q=w(q1, s.q), row_id=s.row_id,
        ticks=s.ticks + step, drafted=s.drafted + (steady & active).astype(jnp.int32),
        accepted=s.accepted + (ok & active).astype(jnp.int32), bubbles=s.bubbles + (~steady & active).astype(jnp.int32),
    )


def _run(tparams, eparams, tokens, lens, key, row_id, *, tcfg, ecfg, exit_layer, max_new, cache_len, sampling,
         kernels, two_device: bool):
    B = tokens.shape[0]
    D = tcfg.hidden_size
    dtype = tparams["embed"].dtype
    role = jax.lax.axis_index(ROLE_AXIS) if two_device else None

    # Prefill: every device runs the whole prompt through the whole target (each needs the prompt
    # in its stage's layers) and the exit head; the first token is role 1's, sent over, like every
    # decision.
    full = M.forward(tparams, tcfg, tokens, M.init_cache(tcfg, B, cache_len, dtype), capture=(exit_layer,),
                     kernels=kernels, unroll=1)  # a prompt: scanned
    ecache = None
    if ecfg is not None:
        ecache = M.forward(eparams, ecfg, None, M.init_cache(ecfg, B, cache_len, dtype), hidden_in=full.captured[0],
                           kernels=kernels, unroll=1).cache
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

    # The stages' weights, caches and final norms; on two devices each keeps only its own.
    S = stage_depth(tcfg, exit_layer)
    L1, L2 = stage_layers(tparams, tcfg, eparams if ecfg is not None else None, exit_layer)

    def stage_caches(a, exit_a):
        """A target cache array [L, ...] (+ the exit head's [1, ...]) -> the two stages' [S, ...]."""
        def padded(parts):
            return jnp.concatenate(parts + [jnp.zeros((S - sum(p.shape[0] for p in parts),) + a.shape[1:], a.dtype)])
        return padded([a[:exit_layer]] + ([] if exit_a is None else [exit_a.astype(a.dtype)])), padded([a[exit_layer:]])

    k1, k2 = stage_caches(full.cache.k, None if ecache is None else ecache.k)
    v1, v2 = stage_caches(full.cache.v, None if ecache is None else ecache.v)
    norm1 = eparams["final_norm"] if ecfg is not None else tparams["final_norm"]
    sl1, sl2 = stage_sliding(tcfg, exit_layer)
    scfg = tcfg.replace(num_layers=S, sliding_layers=tuple(a or b for a, b in zip(sl1, sl2)) if tcfg.has_sliding else ())
    lengths = lens.astype(jnp.int32)
    stages = []  # (role, params, cache, sliding)
    for r, layers, k, v, norm, sl in ((STAGE1_ROLE, L1, k1, v1, norm1, sl1), (STAGE2_ROLE, L2, k2, v2, tparams["final_norm"], sl2)):
        params = {k_: a for k_, a in tparams.items() if k_ not in ("layers", "final_norm")}
        params.update(layers=M.stack_layers(layers), final_norm=norm)
        stages.append([r, params, M.KVCache(k=k, v=v, lengths=lengths), jnp.asarray(np.array(sl, bool))])
    if two_device:  # this device's stage, chosen by its role (no branch: both run the same program)
        (_, p1, c1, s1), (_, p2, c2, s2) = stages
        stages = [[role, _pick(role, p1, p2), _pick(role, c1, c2), _pick(role, s1, s2)]]
    sliding = [st[3] if tcfg.has_sliding else None for st in stages]
    for st in stages:  # per-layer weight buffers for the ticks, after the prefill
        st[1] = M.loop_params(st[1], scfg, kernels=kernels)

    out = jnp.full((B, max_new), -1, jnp.int32)
    zeros = jnp.zeros((B,), jnp.int32)
    out, n_out, done = emit(tcfg, out, zeros, jnp.zeros((B,), bool), first[:, None], jnp.ones_like(zeros), max_new)
    qV = 1 if sampling.greedy else tcfg.vocab_size
    state = PpsdState(
        caches=tuple(st[2] for st in stages), base=lengths, out=out, n_out=n_out, done=done,
        tok=first, has_mid=jnp.zeros((B,), bool), h_mid=jnp.zeros((B, D), dtype), draft=zeros,
        q=jnp.zeros((B, qV), jnp.float32), row_id=row_id, ticks=jnp.ones_like(zeros), drafted=zeros, accepted=zeros,
        bubbles=zeros,
    )

    def body(s: PpsdState) -> PpsdState:
        msgs, caches = [], []
        for (r, params, _, _), sl, cache in zip(stages, sliding, s.caches):
            msg, cache = _stage(params, scfg, tcfg, sl, exit_layer, sampling, key, kernels, r, cache, s)
            msgs.append(msg)
            caches.append(cache)
        if two_device:  # one swap: role 0 sends its draft, role 1 its decision
            mine = msgs[0]
            other = ppermute_packed(mine, ROLE_AXIS, [(0, 1), (1, 0)])
            msgs = [_pick(role, mine, other), _pick(role, other, mine)]
        h1, d1, _, _, q1 = msgs[0]
        _, _, accept, corr, _ = msgs[1]
        return _advance(s, tuple(caches), accept, corr, h1, d1, q1, max_new, tcfg)

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
