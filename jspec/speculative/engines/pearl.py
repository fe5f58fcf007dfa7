"""PEARL: the drafter drafts while the target verifies, on two devices (pre-verify / post-verify).

Liu et al., *PEARL: Parallel Speculative Decoding with Adaptive Draft Length*, ICLR 2025,
arXiv 2408.11850; rules from the authors' code (`smart-lty/ParallelSpeculativeDecoding`,
`src/engine.py::parallel_speculative_decoding`) and γ from nano-PEARL's `auto_set_gamma`.

One *step* = the drafter drafting γ tokens and, at the same time, one target forward over a
static block of γ tokens. Per row the state is: the verified text (the target cache holds all of
it but `last`), and `n_pend` ∈ {0, γ−1} pending drafts after `last` that the target has not
checked yet.

* pre-verify (n_pend = 0): the target reads [last] and gives p for the next position; the drafter
  drafts x_1..x_γ from `last`. x_1 is tested. Rejected: emit a residual sample, drop the drafts.
  Accepted: emit x_1, keep x_2..x_γ pending, switch to post-verify.
* post-verify (n_pend = γ−1): the target reads [last, x_2..x_γ] and gives p for x_2..x_γ and the
  next position; the drafter drafts y_1..y_γ after x_γ as if all were accepted. γ tests run:
  x_2..x_γ and y_1. All accepted: emit them, keep y_2..y_γ pending, stay. First rejection: emit
  the accepted prefix and a residual sample, drop the rest, back to pre-verify.

The test is the chain rule (verify/chain.py): accept x with probability min(1, p(x)/q(x)),
residual norm(max(0, p − q)) at the first rejection, argmax comparisons when greedy. A position is
tested exactly once and its randomness is `fold_in(key, row, slot)`, so both devices draw the
same numbers (PEARL seeds `seed + position` for the same reason) and the one- and two-device modes
emit the same tokens. There is no bonus token: the target block ends at the last pending draft.

Caches: the target cache cursor is the verified length minus one (`last` is not in it); the draft
cache cursor is that plus n_pend (the drafter has read `last` and every pending draft but the
newest, which is the `tail` it feeds next). A rollback is a cursor move.

Two devices: the whole generation is one jitted program under `shard_map` over a
("data", "role") mesh. Role 0 drafts, role 1 runs the target (`lax.cond` on `axis_index`); after
each step one `ppermute` swaps the two messages (drafted tokens + q, target argmax + p; tokens
only when greedy) and both devices take the identical decision (when sampling, the target
device's decision, sent over in a second small permute, so float rounding can never split them). Every
device runs the same collectives in the same order (GPUs deadlock otherwise): none sits inside the
role `cond`, and each exchange is one collective (`ppermute_packed`); the loop predicate is
reduced over the data groups (`still_running`). Rows are split over "data". Each
device carries both caches (the other role's stays untouched): simple, and small next to the
weights for the models jspec targets. One device: the same step runs both roles one after the
other (CPU tests, one-GPU users; no overlap then).
"""

from __future__ import annotations

import dataclasses
import functools
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from ... import model as M
from ...config import ModelConfig
from ...decode import GenerationResult, emit
from ...sampling import Sampling, probs, sample
from ..verify.chain import accepted_prefix

ROLE_AXIS = "role"
DATA_AXIS = "data"
DRAFT_ROLE, TARGET_ROLE = 0, 1


@dataclasses.dataclass
class ParallelResult(GenerationResult):
    """GenerationResult plus what parallel engines report."""

    rolled_back: np.ndarray | None = None  # [B] drafted tokens thrown away
    devices: int = 1
    gamma: int = 0
    branch_saves: np.ndarray | None = None  # SpecBranch: [B] windows kept by a head other than the first

    @property
    def rollback_rate(self) -> float:
        return float(self.rolled_back.sum() / max(self.drafted.sum(), 1))


@struct.dataclass
class PearlState:
    tcache: M.KVCache  # cursor: verified length - 1
    dcache: M.KVCache  # cursor: tcache cursor + n_pend
    out: jax.Array  # [B, max_new]
    n_out: jax.Array  # [B]
    done: jax.Array  # [B]
    last: jax.Array  # [B] last verified token (not in the target cache)
    pend: jax.Array  # [B, G-1] pending drafts after `last`
    pend_q: jax.Array  # [B, G-1, V] their draft distributions ([B, G-1, 1] when greedy)
    n_pend: jax.Array  # [B] 0 (pre-verify) or G-1 (post-verify)
    row_id: jax.Array  # [B] global row index (randomness)
    target_calls: jax.Array  # [B]
    drafted: jax.Array  # [B]
    accepted: jax.Array  # [B]
    rolled_back: jax.Array  # [B]


def _row_keys(key, row_id, slots):
    """One key per (row, slot): slots [B, T] -> keys [B, T, 2]."""
    per_row = jax.vmap(lambda r: jax.random.fold_in(key, r))(row_id)
    return jax.vmap(lambda k, s: jax.vmap(lambda x: jax.random.fold_in(k, x))(s))(per_row, slots)


def _uniform(keys):
    return jax.vmap(jax.vmap(lambda k: jax.random.uniform(k)))(keys)


def _categorical(keys, logp):
    return jax.vmap(lambda k, l: jax.random.categorical(k, l))(keys, logp).astype(jnp.int32)


# ---------------------------------------------------------------------------------------------
# The two roles
# ---------------------------------------------------------------------------------------------


def _draft_role(dparams, dcfg, sampling, gamma, key, kernels, s: PearlState):
    """Draft γ tokens after the tail; returns (tokens [B, G], q [B, G, V] or None, dcache)."""
    B = s.last.shape[0]
    tail = jnp.where(s.n_pend > 0, jnp.take_along_axis(s.pend, jnp.maximum(s.n_pend - 1, 0)[:, None], 1)[:, 0] if gamma > 1 else s.last, s.last)
    kd = jax.random.fold_in(key, 1)

    def one(carry, _):
        cache, tok = carry
        out = M.forward(dparams, dcfg, tok[:, None], cache, kernels=kernels)
        logits = M.lm_head(dparams, dcfg, out.hidden[:, 0])
        slot = cache.lengths + 1  # the drafted token's position
        if sampling.greedy:
            nxt, q = jnp.argmax(logits, -1).astype(jnp.int32), None
        else:
            keys = _row_keys(kd, s.row_id, slot[:, None])[:, 0]
            q = probs(logits, sampling)
            nxt = _categorical(keys, jnp.log(q))
        return (M.advance(out.cache, jnp.ones((B,), jnp.int32)), nxt), (nxt, q)

    (dcache, _), (toks, qs) = jax.lax.scan(one, (s.dcache, tail), None, length=gamma)
    toks = toks.T  # [B, G]
    qs = None if qs is None else jnp.swapaxes(qs, 0, 1)
    return toks, qs, dcache


def _target_role(tparams, tcfg, sampling, kernels, s: PearlState):
    """One target forward over [last, pend]; returns (argmax [B, G], p [B, G, V] or None, tcache)."""
    block = jnp.concatenate([s.last[:, None], s.pend], axis=1)
    out = M.forward(tparams, tcfg, block, s.tcache, kernels=kernels)
    logits = M.lm_head(tparams, tcfg, out.hidden)
    top = jnp.argmax(logits, -1).astype(jnp.int32)
    return top, (None if sampling.greedy else probs(logits, sampling)), out.cache


# ---------------------------------------------------------------------------------------------
# The decision (identical on both devices)
# ---------------------------------------------------------------------------------------------


def decide(s: PearlState, d_tok, d_q, t_top, p, sampling: Sampling, gamma: int, key, max_new: int, tcfg: ModelConfig,
           broadcast=None) -> PearlState:
    """The step's decision and the state update. `broadcast(a, correction)`, when given, replaces
    the decision by the target device's (two devices, sampling)."""
    B, G = d_tok.shape
    k = jnp.arange(G)[None]
    n_pend = s.n_pend
    pend_pad = jnp.concatenate([s.pend, jnp.zeros((B, 1), jnp.int32)], axis=1)  # [B, G]
    cand = jnp.where(k < n_pend[:, None], pend_pad, jnp.where(k == n_pend[:, None], d_tok[:, :1], 0))
    valid = k <= n_pend[:, None]
    base = s.tcache.lengths
    if sampling.greedy:
        a = accepted_prefix((cand == t_top) & valid)
        correction = jnp.take_along_axis(t_top, jnp.minimum(a, G - 1)[:, None], 1)[:, 0]
    else:
        V = p.shape[-1]
        pq_pad = jnp.concatenate([s.pend_q, jnp.zeros((B, 1, V), p.dtype)], axis=1)
        q_cand = jnp.where((k < n_pend[:, None])[..., None], pq_pad, d_q[:, :1])  # [B, G, V]
        p_at = jnp.take_along_axis(p, cand[..., None], -1)[..., 0]
        q_at = jnp.take_along_axis(q_cand, cand[..., None], -1)[..., 0]
        slots = base[:, None] + 1 + k  # position of each candidate
        u = _uniform(_row_keys(jax.random.fold_in(key, 2), s.row_id, slots))
        a = accepted_prefix((u * q_at < p_at) & valid)
        ai = jnp.minimum(a, G - 1)
        p_a = jnp.take_along_axis(p, ai[:, None, None], 1)[:, 0]
        q_a = jnp.take_along_axis(q_cand, ai[:, None, None], 1)[:, 0]
        res = jnp.maximum(p_a - q_a, 0.0)
        mass = jnp.sum(res, -1, keepdims=True)
        res = jnp.where(mass > 0, res / jnp.where(mass > 0, mass, 1.0), p_a)
        rkeys = _row_keys(jax.random.fold_in(key, 3), s.row_id, (base + 1 + ai)[:, None])[:, 0]
        correction = _categorical(rkeys, jnp.log(res))
    if broadcast is not None:
        a, correction = broadcast(a, correction)
    all_acc = a == n_pend + 1
    rejected = ~all_acc
    emitted = jnp.where(rejected[:, None] & (k == a[:, None]), correction[:, None], cand)
    n_emit = a + rejected.astype(jnp.int32)
    active = ~s.done
    out, n_out, done = emit(tcfg, s.out, s.n_out, s.done, emitted, n_emit, max_new)

    new_last = jnp.where(rejected, correction, d_tok[:, 0])
    new_n_pend = jnp.where(all_acc, G - 1, 0).astype(jnp.int32)
    new_base = base + n_emit
    w = lambda new, old: jnp.where(active.reshape((-1,) + (1,) * (new.ndim - 1)), new, old)  # noqa: E731
    new_pend_q = s.pend_q if sampling.greedy else d_q[:, 1:]
    thrown = jnp.where(rejected, n_pend - a + G, 0)
    step = active.astype(jnp.int32)
    return PearlState(
        tcache=s.tcache.replace(lengths=w(new_base, base)),
        dcache=s.dcache.replace(lengths=w(new_base + new_n_pend, s.dcache.lengths)),
        out=out, n_out=n_out, done=done,
        last=w(new_last, s.last), pend=w(d_tok[:, 1:], s.pend), pend_q=w(new_pend_q, s.pend_q),
        n_pend=w(new_n_pend, n_pend), row_id=s.row_id,
        target_calls=s.target_calls + step, drafted=s.drafted + G * step,
        accepted=s.accepted + a * step, rolled_back=s.rolled_back + thrown * step,
    )


# ---------------------------------------------------------------------------------------------
# Generation: prefill + while_loop, on one device or under shard_map
# ---------------------------------------------------------------------------------------------


def still_running(done, two_device: bool):
    """The generation loop's predicate: some row is not done. On a mesh it is reduced over the data
    groups, so all groups run the same number of steps (a group whose rows are done idles: its
    updates are masked by `done`) and hence the same collectives in the same order, which GPU
    collectives require (a device that leaves the loop while its partner waits in the step's
    ppermute hangs both).

    The two roles of a pair need no reduction: each engine computes its decision once (the target
    device's, or from exchanged integer tokens only) and both devices apply it through the same
    integer update, so `done` is bit-identical on both roles by construction. That saves a scalar
    all-reduce between the two devices on every step (none at all on one pair: a data axis of
    size 1)."""
    running = ~jnp.all(done)
    if two_device:
        running = jax.lax.pmax(running.astype(jnp.int32), DATA_AXIS) > 0
    return running


def ppermute_packed(tree, axis, perm):
    """`jax.lax.ppermute` of a pytree as one int32 buffer: one collective per exchange (a tuple
    lowers to one collective permute per leaf, each a separate NCCL launch and wait). Bit-exact:
    floats travel as their float32 bits, integers and bools as int32 values (None leaves stay)."""
    leaves, treedef = jax.tree.flatten(tree)
    if not leaves:
        return tree
    words = []
    for x in leaves:
        w = jax.lax.bitcast_convert_type(x.astype(jnp.float32), jnp.int32) if jnp.issubdtype(x.dtype, jnp.floating) \
            else x.astype(jnp.int32)
        words.append(w.reshape(-1))
    buf = jax.lax.ppermute(jnp.concatenate(words), axis, perm)
    out, at = [], 0
    for x, w in zip(leaves, words):
        part = buf[at : at + w.size].reshape(x.shape)
        at += w.size
        if jnp.issubdtype(x.dtype, jnp.floating):
            part = jax.lax.bitcast_convert_type(part, jnp.float32)
        out.append(part.astype(x.dtype))
    return jax.tree.unflatten(treedef, out)


def _run(tparams, dparams, tokens, lens, key, row_id, *, tcfg, dcfg, gamma, max_new, cache_len, sampling,
         kernels, two_device: bool):
    B = tokens.shape[0]
    V = tcfg.vocab_size
    dtype = tparams["embed"].dtype
    role = jax.lax.axis_index(ROLE_AXIS) if two_device else None

    def target_prefill(_):
        cache = M.init_cache(tcfg, B, cache_len, dtype)
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
        cache = M.init_cache(dcfg, B, cache_len, dparams["embed"].dtype)
        out = M.forward(dparams, dcfg, tokens, cache, kernels=kernels, unroll=1)
        return out.cache.replace(lengths=lens.astype(jnp.int32))

    # The other role's cache stays empty on each device, but its cursor is tracked everywhere:
    # the decision reads both cursors.
    empty_t = M.init_cache(tcfg, B, cache_len, dtype).replace(lengths=lens.astype(jnp.int32))
    empty_d = M.init_cache(dcfg, B, cache_len, dparams["embed"].dtype).replace(lengths=lens.astype(jnp.int32))
    if two_device:
        first, tcache, dcache = jax.lax.cond(
            role == DRAFT_ROLE,
            lambda _: (jnp.zeros((B,), jnp.int32), empty_t, draft_prefill(None)),
            lambda _: (*target_prefill(None), empty_d),
            None,
        )
        other = jax.lax.ppermute(first, ROLE_AXIS, [(0, 1), (1, 0)])
        first = jnp.where(role == DRAFT_ROLE, other, first)
    else:
        first, tcache = target_prefill(None)
        dcache = draft_prefill(None)

    out = jnp.full((B, max_new), -1, jnp.int32)
    zeros = jnp.zeros((B,), jnp.int32)
    out, n_out, done = emit(tcfg, out, zeros, jnp.zeros((B,), bool), first[:, None], jnp.ones_like(zeros), max_new)
    qV = 1 if sampling.greedy else V
    state = PearlState(
        tcache=tcache, dcache=dcache, out=out, n_out=n_out, done=done, last=first,
        pend=jnp.zeros((B, gamma - 1), jnp.int32), pend_q=jnp.zeros((B, gamma - 1, qV), jnp.float32),
        n_pend=zeros, row_id=row_id, target_calls=jnp.ones_like(zeros), drafted=zeros, accepted=zeros,
        rolled_back=zeros,
    )

    # The loop reads per-layer weight buffers (model.loop_params), made once here after the scanned
    # prefills, as the chain and tree engines do.
    tparams, dparams = M.loop_params(tparams, tcfg, kernels=kernels), M.loop_params(dparams, dcfg, kernels=kernels)

    def body(s: PearlState) -> PearlState:
        if two_device:
            def as_draft(s):
                toks, q, dcache = _draft_role(dparams, dcfg, sampling, gamma, key, kernels, s)
                return toks, q, s.tcache, dcache

            def as_target(s):
                top, p, tcache = _target_role(tparams, tcfg, sampling, kernels, s)
                return top, p, tcache, s.dcache

            mine_tok, mine_p, tcache, dcache = jax.lax.cond(role == DRAFT_ROLE, as_draft, as_target, s)
            msg = (mine_tok, mine_p) if not sampling.greedy else (mine_tok,)
            other = ppermute_packed(msg, ROLE_AXIS, [(0, 1), (1, 0)])
            other_tok, other_p = (other[0], other[1]) if not sampling.greedy else (other[0], None)
            is_d = role == DRAFT_ROLE
            d_tok = jnp.where(is_d, mine_tok, other_tok)
            t_top = jnp.where(is_d, other_tok, mine_tok)
            d_q = None if sampling.greedy else jnp.where(is_d, mine_p, other_p)
            p = None if sampling.greedy else jnp.where(is_d, other_p, mine_p)
        else:
            d_tok, d_q, dcache = _draft_role(dparams, dcfg, sampling, gamma, key, kernels, s)
            t_top, p, tcache = _target_role(tparams, tcfg, sampling, kernels, s)
        s = s.replace(tcache=tcache, dcache=dcache)
        broadcast = None
        if two_device and not sampling.greedy:
            # Both devices hold bit-identical inputs, but a sampled decision goes through floating
            # point (ratios, residual, categorical): the target device's result is sent over so the
            # two devices cannot diverge (greedy decisions compare exchanged integers only).
            def broadcast(a, corr):
                got = ppermute_packed((a, corr), ROLE_AXIS, [(TARGET_ROLE, DRAFT_ROLE)])
                keep = role == TARGET_ROLE
                return jnp.where(keep, a, got[0]), jnp.where(keep, corr, got[1])
        return decide(s, d_tok, d_q, t_top, p, sampling, gamma, key, max_new, tcfg, broadcast)

    s = jax.lax.while_loop(lambda s: still_running(s.done, two_device), body, state)
    return s.out, s.n_out, s.target_calls, s.drafted, s.accepted, s.rolled_back


_STATIC = ("tcfg", "dcfg", "gamma", "max_new", "cache_len", "sampling", "kernels")


@functools.partial(jax.jit, static_argnames=_STATIC)
def pearl_one_device_jit(tparams, dparams, tokens, lens, key, *, tcfg, dcfg, gamma, max_new, cache_len, sampling, kernels):
    row_id = jnp.arange(tokens.shape[0], dtype=jnp.int32)
    return _run(tparams, dparams, tokens, lens, key, row_id, tcfg=tcfg, dcfg=dcfg, gamma=gamma, max_new=max_new,
                cache_len=cache_len, sampling=sampling, kernels=kernels, two_device=False)


@functools.lru_cache(maxsize=None)
def _two_device_fn(mesh: Mesh, tcfg, dcfg, gamma, max_new, cache_len, sampling, kernels):
    def body(tparams, dparams, tokens, lens, key):
        b = tokens.shape[0]
        row_id = jax.lax.axis_index(DATA_AXIS) * b + jnp.arange(b, dtype=jnp.int32)
        outs = _run(tparams, dparams, tokens, lens, key, row_id, tcfg=tcfg, dcfg=dcfg, gamma=gamma, max_new=max_new,
                    cache_len=cache_len, sampling=sampling, kernels=kernels, two_device=True)
        return outs

    rows = P(DATA_AXIS)
    fn = jax.shard_map(body, mesh=mesh, in_specs=(P(), P(), rows, rows, P()), out_specs=(rows,) * 6, check_vma=False)
    return jax.jit(fn)


def pearl_mesh(devices=None, data: int | None = None) -> Mesh:
    """A ("data", "role") mesh: pairs of devices, role 0 drafts, role 1 verifies."""
    devices = list(jax.devices() if devices is None else devices)
    if len(devices) < 2:
        raise ValueError(f"two-device PEARL needs at least 2 devices, found {len(devices)}")
    data = data or len(devices) // 2
    return Mesh(np.asarray(devices[: 2 * data]).reshape(data, 2), (DATA_AXIS, ROLE_AXIS))


def parse_role_mesh(mesh, devices=None) -> Mesh | None:
    """A parallel engine's mesh from what a caller passed: None (one device), a ("data", "role")
    Mesh, or a spec string "role=2" / "data=N,role=2" (the first 2 N devices, paired). Raises
    ValueError naming the problem."""
    if mesh is None or isinstance(mesh, Mesh):
        if mesh is not None and (tuple(mesh.axis_names) != (DATA_AXIS, ROLE_AXIS) or mesh.shape[ROLE_AXIS] != 2):
            raise ValueError(f"parallel engines need a ({DATA_AXIS!r}, {ROLE_AXIS!r}) mesh with 2 roles, got axes "
                             f"{dict(mesh.shape)}: use pearl_mesh() or the spec 'data=N,role=2'")
        return mesh
    sizes = {DATA_AXIS: 1, ROLE_AXIS: 2}
    for part in str(mesh).replace(" ", "").split(","):
        name, eq, value = part.partition("=")
        if name not in sizes or not eq or not value.isdigit() or int(value) < 1:
            raise ValueError(f"mesh spec {mesh!r}: parallel engines take role=2 and optionally data=N (N >= 1)")
        sizes[name] = int(value)
    if sizes[ROLE_AXIS] != 2:
        raise ValueError(f"mesh spec {mesh!r}: parallel engines have exactly 2 roles (drafter, target), got role={sizes[ROLE_AXIS]}")
    devices = list(jax.devices() if devices is None else devices)
    if 2 * sizes[DATA_AXIS] > len(devices):
        raise ValueError(f"mesh {mesh!r} needs {2 * sizes[DATA_AXIS]} devices, have {len(devices)}")
    return pearl_mesh(devices, sizes[DATA_AXIS])


def place_on_mesh(mesh: Mesh, tparams, dparams):
    """Both models on every device of the mesh (a no-op for arrays already placed there: place
    once, outside a timing loop)."""
    rep = NamedSharding(mesh, P())
    return jax.device_put(tparams, rep), jax.device_put(dparams, rep)


def check_pearl(tcfg: ModelConfig, dcfg: ModelConfig, gamma: int):
    if dcfg.vocab_size != tcfg.vocab_size:
        raise ValueError(f"draft vocabulary ({dcfg.vocab_size}) differs from the target's ({tcfg.vocab_size})")
    if not 1 <= gamma <= 64:
        raise ValueError(f"gamma must be in [1, 64], got {gamma}")


def pearl_generate(tparams, tcfg, dparams, dcfg, tokens, lens, key, *, gamma: int, max_new: int, cache_len: int,
                   sampling: Sampling, mesh: Mesh | None = None, kernels: str | None = None) -> ParallelResult:
    """PEARL generation. mesh=None: one device; else a pearl_mesh (the batch must divide its data axis).
    cache_len must hold prompt + max_new + 2 γ slots (decode.pack_prompts(extra=2 * gamma))."""
    check_pearl(tcfg, dcfg, gamma)
    tokens, lens = jnp.asarray(tokens), jnp.asarray(lens)
    static = dict(tcfg=tcfg, dcfg=dcfg, gamma=gamma, max_new=max_new, cache_len=cache_len, sampling=sampling, kernels=kernels)
    if mesh is None:
        outs = pearl_one_device_jit(tparams, dparams, tokens, lens, key, **static)
        devices = 1
    else:
        data = mesh.shape[DATA_AXIS]
        if tokens.shape[0] % data:
            raise ValueError(f"batch {tokens.shape[0]} does not divide over the mesh's {data} data groups")
        tparams, dparams = place_on_mesh(mesh, tparams, dparams)
        rows = NamedSharding(mesh, P(DATA_AXIS))
        outs = _two_device_fn(mesh, **static)(tparams, dparams, jax.device_put(tokens, rows), jax.device_put(lens, rows),
                                              jax.device_put(key, NamedSharding(mesh, P())))
        devices = mesh.devices.size
    out, n_out, calls, drafted, accepted, rolled = (np.asarray(x) for x in jax.device_get(outs))
    return ParallelResult(out, n_out, calls, drafted, accepted, calls, rolled_back=rolled, devices=devices, gamma=gamma)


# ---------------------------------------------------------------------------------------------
# γ = round(t_target / t_draft), measured (nano-PEARL's auto_set_gamma)
# ---------------------------------------------------------------------------------------------


def measure_gamma(tparams, tcfg, dparams, dcfg, *, batch: int = 1, cache_len: int = 1024, block: int = 4,
                  reps: int = 16, gamma_max: int = 16, kernels: str | None = None, devices=None) -> tuple[int, dict]:
    """(γ, timings): the target's time for one [batch, block] forward over its time for one draft
    step (a [batch, 1] forward + LM head), each timed as `reps` calls inside one jitted loop on
    its own device (role devices when two are given). nano-PEARL measures per card and batch size."""
    devices = list(devices) if devices is not None else jax.devices()[:1]
    dev_d, dev_t = devices[0], devices[-1]

    def timed(params, cfg, T, device):
        params = jax.device_put(params, device)
        cache = jax.device_put(M.init_cache(cfg, batch, cache_len, params["embed"].dtype).replace(
            lengths=jnp.full((batch,), cache_len // 2, jnp.int32)), device)

        @jax.jit
        def loop(params, cache):
            params = M.loop_params(params, cfg, kernels=kernels)  # as the generation loop reads them

            def one(i, c):
                cache, acc = c
                tok = jnp.full((batch, T), i % cfg.vocab_size, jnp.int32)
                out = M.forward(params, cfg, tok, cache, kernels=kernels)
                logits = M.lm_head(params, cfg, out.hidden[:, -1])
                return out.cache, acc + jnp.argmax(logits, -1).sum()
            return jax.lax.fori_loop(0, reps, one, (cache, jnp.int32(0)))[1]

        jax.block_until_ready(loop(params, cache))
        best = np.inf
        for _ in range(3):
            t0 = time.perf_counter()
            jax.block_until_ready(loop(params, cache))
            best = min(best, (time.perf_counter() - t0) / reps)
        return best

    t_draft = timed(dparams, dcfg, 1, dev_d)
    t_target = timed(tparams, tcfg, block, dev_t)
    gamma = int(np.clip(round(t_target / max(t_draft, 1e-9)), 1, gamma_max))
    return gamma, {"t_target_s": t_target, "t_draft_s": t_draft, "batch": batch, "block": block}
