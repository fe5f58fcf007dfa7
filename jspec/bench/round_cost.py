"""Round-cost profile of speculative decoding: where a round's time goes, per method and batch size.

A speculative round is  draft (K steps, or D tree levels)  +  verify (one target forward over T
tokens)  +  commit (cache moves, the drafter re-reading what was accepted)  +  policy bookkeeping.
Each part is timed by itself inside `jit`, as `n` iterations of a `fori_loop` whose carry feeds the
next iteration (so nothing is hoisted), on a mid-generation cache:

  verify_us[T]     target forward of T tokens + LM head on all + argmax, cursor fixed; T = 1 is an
                   AR step's forward; "tree<N>" is an N-token block under a random tree mask
  draft_step_us    one autoregressive draft step, by difference: (draft loop at K - at 1) / (K - 1),
                   through the chain engine's own draft loop (its stop checks included)
  draft_first_us   the draft loop at K = 1 (begin + first choice)
  tree_level_us    one EAGLE-2 level, by difference: (tree build at depth D - at depth 1) / (D - 1)
  tree_build_us    the whole tree build at the method's TreeConfig
  commit_us        drafter.commit over the verified block (plus the target cache move for trees)
  dlm_forward_us   block drafters (DiffuSpec): the DLM's one cached call (drafter.denoise)
  choose_us        block drafters: the draft read off its logits (drafter.choose: CPS's lattice and
                   beam search, or the per-position argmax)
  policy_us        start_round + K observes + update of the method's policy
  round_us         one whole engine round (spec_round / tree_round) in a loop of real rounds

`profile_method` returns these as a dict of floats (µs) that the bench adds to its JSON rows;
`measure_batch_costs` / `ensure_costs` measure and cache (per card) the table the `auto` policy's
cost model reads: verify over T per batch, draft step, tree level and round overhead per batch.
A table records the `COST_TABLE_VERSION` it was measured under; `ensure_costs` measures a table of
another version anew, since jspec's own rounds got cheaper in between.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import json
import os
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jspec import model as M
from jspec.cards import card_key
from jspec.decode import decode_step, start_decode
from jspec.sampling import GREEDY
from jspec.speculative.engines import ssd as SSD
from jspec.speculative.engines.chain import draft_autoregressive, spec_round, start_spec
from jspec.speculative.engines.tree import TreeConfig, draft_tree, tree_round
from jspec.speculative.policies import resolve_policy
from jspec.speculative.policies.auto import (COST_TABLE_VERSION, REFERENCE_COSTS, cost_table_path, drafter_costs,
                                             cost_table_paths, row_value)

VERIFY_TS = (1, 2, 4, 8, 16, 32, 64)


def loop_times(body, consts, carry, n: int, reps: int = 3, tcfg=None) -> list[float]:
    """µs of one `body(consts, carry) -> carry` call in each of `reps` timed runs of n iterations in
    one jitted fori_loop (after an untimed compile + warm-up run). Weights and caches travel in
    `consts` (jit arguments, never baked-in constants). With `tcfg`, consts[0] holds the target
    weights and goes through model.loop_params before the loop, as in generation (per-layer
    buffers on the unrolled kernel path)."""

    def program(k, c):
        if tcfg is not None:
            k = (M.loop_params(k[0], tcfg), *k[1:])
        return jax.lax.fori_loop(0, n, lambda i, x: body(k, x), c)

    run = jax.jit(program)
    jax.block_until_ready(run(consts, carry))  # compile + warm up
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        jax.block_until_ready(run(consts, carry))
        ts.append(1e6 * (time.perf_counter() - t0) / n)
    return ts


def loop_us(body, consts, carry, n: int, reps: int = 3, tcfg=None) -> float:
    """Median of `loop_times`."""
    return float(np.median(loop_times(body, consts, carry, n, reps, tcfg)))


def relative_spread(times) -> float:
    """(max - min) / median of repeated timings: how far one timing may be off."""
    med = float(np.median(times))
    return float((max(times) - min(times)) / med) if med > 0 else 0.0


def filled_cache(tparams, tcfg, batch: int, cache_len: int, committed: int, seed: int = 1) -> M.KVCache:
    """A target cache holding `committed` random tokens (a mid-generation state)."""
    cache = M.init_cache(tcfg, batch, cache_len, tparams["embed"].dtype)
    toks = jax.random.randint(jax.random.PRNGKey(seed), (batch, committed), 0, tcfg.vocab_size)
    fill = jax.jit(lambda p, t, c: M.forward(p, tcfg, t, c).cache)
    return M.advance(fill(tparams, toks, cache), jnp.full((batch,), committed, jnp.int32))


def random_tree_mask(T: int, batch: int, seed: int = 0):
    """(ancestor-or-self mask [B, T, T], depth [T]) of a random tree: node i's parent is an earlier node."""
    rng = np.random.RandomState(seed)
    parent = [-1] + [int(rng.randint(max(0, i - 10), i)) for i in range(1, T)]  # EAGLE-like: wide, shallow
    anc = np.zeros((T, T), bool)
    for i in range(T):
        j = i
        while j >= 0:
            anc[i, j] = True
            j = parent[j]
    return jnp.asarray(np.broadcast_to(anc, (batch, T, T))), jnp.asarray(anc.sum(1) - 1, jnp.int32)


def verify_us(tparams, tcfg, batch: int, Ts=VERIFY_TS, tree_nodes=(), *, cache_len=512, committed=192, n=30, capture=(),
              reps: int = 3, spread: dict | None = None, log=None) -> dict[str, float]:
    """µs of a verify forward per block size (the median of `reps` timed loops): {"1": .., "8": ..,
    "tree60": ..}; `spread`, when given, receives each size's `relative_spread`; `log`, when given,
    a line per size timed (progress)."""
    cache = filled_cache(tparams, tcfg, batch, cache_len, committed)
    out = {}
    sizes = [(t, False) for t in Ts] + [(t, True) for t in tree_nodes]
    for i, (T, tree) in enumerate(sizes, 1):
        mask, depth = random_tree_mask(T, batch) if tree else (None, jnp.arange(T, dtype=jnp.int32))
        pos = cache.lengths[:, None] + depth[None]

        def body(k, c, tree=tree):
            tp, cache, pos, mask = k
            toks, acc = c
            o = M.forward(tp, tcfg, toks, cache, positions=pos, new_mask=mask if tree else None, capture=capture)
            nxt = jnp.argmax(M.lm_head(tp, tcfg, o.hidden), -1).astype(jnp.int32)
            return nxt, acc + o.cache.k[0, :, 0, 0, 0].astype(jnp.float32)  # keep the cache write live

        consts = (tparams, cache, pos, mask if tree else jnp.zeros((), bool))
        times = loop_times(body, consts, (jnp.zeros((batch, T), jnp.int32), jnp.zeros((batch,), jnp.float32)), n, reps, tcfg=tcfg)
        out[f"tree{T}" if tree else str(T)] = float(np.median(times))
        if spread is not None:
            spread[f"tree{T}" if tree else str(T)] = relative_spread(times)
        if log is not None:
            log(f"round_cost:   verify {'a tree of ' if tree else ''}{T} token(s): {out[f'tree{T}' if tree else str(T)]:.0f} µs "
                f"({i}/{len(sizes)} block sizes)")
    return out


def _start(tparams, tcfg, drafter, dparams, policy, policy_params, k_max, batch, prompt_len, max_new, cache_len):
    toks = jax.random.randint(jax.random.PRNGKey(3), (batch, prompt_len), 0, tcfg.vocab_size)
    lens = jnp.full((batch,), prompt_len, jnp.int32)
    start = jax.jit(lambda tp, dp, pp, t, ln, key: start_spec(tp, tcfg, drafter, dp, policy, pp, k_max, max_new, cache_len,
                                                              GREEDY, 1, t, ln, key))
    return start(tparams, dparams, policy_params, toks, lens, jax.random.PRNGKey(0))


def draft_loop_us(tparams, tcfg, drafter, dparams, state, k_max: int, n: int) -> float:
    """µs of the chain engine's draft loop at a static K = k_max (begin, k_max choices, finish)."""
    policy = resolve_policy("static", k_max)
    limit = jnp.full(state.last.shape, k_max, jnp.int32)

    def body(k, st):
        tp, dp = k
        draft, dstate, _, pstate = draft_autoregressive(drafter, dp, tp, tcfg, st, st.pstate, policy, limit,
                                                        k_max, GREEDY, st.key, False)
        return st.replace(last=draft.tokens[:, -1], dstate=dstate, pstate=pstate)

    return loop_us(body, (tparams, dparams), state.replace(pstate=policy.init(state.last.shape[0], jax.random.PRNGKey(0))), n,
                   tcfg=tcfg)


def tree_build_us(tparams, tcfg, drafter, dparams, state, tc: TreeConfig, n: int) -> float:
    policy = resolve_policy("static", tc.depth)
    limit = jnp.full(state.last.shape, tc.depth, jnp.int32)
    pstate = policy.init(state.last.shape[0], jax.random.PRNGKey(0))

    # the drafter state rides in the carry, as in the engine's round loop: a fused head kernel writes
    # its scratch slots in place instead of into a copy of a loop constant
    def body(k, c):
        tp, dp = k
        last, acc, dstate = c
        tree, _, dstate = draft_tree(drafter, dp, tp, tcfg, dstate, last, tc, policy, pstate, limit)
        return tree.tokens[:, -1], acc + jnp.sum(tree.ancestors, (1, 2)), dstate

    return loop_us(body, (tparams, dparams), (state.last, jnp.zeros(state.last.shape, jnp.int32), state.dstate), n, tcfg=tcfg)


def profile_method(tparams, tcfg, drafter, dparams, *, batch: int, policy="static", k_max: int = 6, tree: TreeConfig | None = None,
                   prompt_len: int = 128, max_new: int = 256, n: int = 20, verify_ts=VERIFY_TS,
                   policy_params=None, bookkeeping: bool = True) -> dict[str, Any]:
    """Round-cost profile of one speculative method at one batch size (µs; see the module doc).
    policy_params: the weights of a learned policy (LDLP's predictor). verify_ts=None skips the
    verify timings and bookkeeping=False policy_us and commit_us: the cost table measures verify
    by itself and reads none of the rest, and every timing is one more compile."""
    depth = tree.depth if tree is not None else k_max
    extra = tree.num_nodes + 1 if tree is not None else k_max + 1
    max_new = max_new + (n + 1) * extra  # room for the timed rounds' progress
    cache_len = prompt_len + max_new + extra + 8
    pol = resolve_policy(policy, depth)
    state = _start(tparams, tcfg, drafter, dparams, pol, policy_params, depth, batch, prompt_len, max_new, cache_len)
    capture = getattr(drafter, "capture_layers", ())
    nodes = (tree.num_nodes + 1,) if tree is not None else ()
    prof: dict[str, Any] = {"batch": batch}
    if verify_ts is not None:
        prof["verify_us"] = verify_us(tparams, tcfg, batch, verify_ts, nodes, cache_len=cache_len, committed=prompt_len, n=n,
                                      capture=capture)
    if getattr(drafter, "block", False):
        prof.update(block_draft_us(tparams, tcfg, drafter, dparams, state, n))
    if not drafter.parallel:
        if tree is None:
            t1 = draft_loop_us(tparams, tcfg, drafter, dparams, state, 1, n)
            tk = draft_loop_us(tparams, tcfg, drafter, dparams, state, k_max, n) if k_max > 1 else t1
            prof["draft_first_us"] = t1
            prof["draft_step_us"] = (tk - t1) / max(k_max - 1, 1)
        else:
            one = TreeConfig(tree.top_k, 1, tree.top_k)
            deep = TreeConfig(tree.top_k, tree.depth, tree.top_k)
            t1 = tree_build_us(tparams, tcfg, drafter, dparams, state, one, n)
            td = tree_build_us(tparams, tcfg, drafter, dparams, state, deep, n)
            prof["tree_level_us"] = (td - t1) / max(tree.depth - 1, 1)
            prof["draft_step_us"] = prof["tree_level_us"]
            prof["tree_build_us"] = tree_build_us(tparams, tcfg, drafter, dparams, state, tree, n)
    if bookkeeping:
        prof["policy_us"] = policy_us(pol, batch, depth, tcfg.vocab_size, n)
    if tree is None:
        body = lambda k, st: spec_round(k[0], tcfg, drafter, k[1], pol, k_max, max_new, GREEDY, "lossless", None, st)  # noqa: E731
    else:
        body = lambda k, st: tree_round(k[0], tcfg, drafter, k[1], pol, tree, max_new, GREEDY, None, st)  # noqa: E731
    prof["round_us"] = loop_us(body, (tparams, dparams), state, n, tcfg=tcfg)  # the engines' unroll and weights
    if bookkeeping:
        prof["commit_us"] = commit_us(tparams, tcfg, drafter, dparams, state, extra, n)
    return prof


def _loop_program(body, n: int, tcfg=None):
    """The jitted n-iteration fori_loop of `loop_times`."""
    def program(k, c):
        if tcfg is not None:
            k = (M.loop_params(k[0], tcfg), *k[1:])
        return jax.lax.fori_loop(0, n, lambda i, x: body(k, x), c)

    return jax.jit(program)


def _time_compiled(run, consts, carry, n: int, reps: int) -> float:
    """Median µs per iteration of a compiled loop (after one warm-up run)."""
    jax.block_until_ready(run(consts, carry))
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        jax.block_until_ready(run(consts, carry))
        ts.append(1e6 * (time.perf_counter() - t0) / n)
    return float(np.median(ts))


def sampled_us(tparams, tcfg, drafter, dparams, *, batch: int, sampling, k_max: int = 6, tree: TreeConfig | None = None,
               prompt_len: int = 128, n: int = 20, reps: int = 3, workers: int = 6) -> dict[str, float]:
    """µs sampling adds at this batch to an AR step ("ar"), a chain round of static K ("chain") and a
    tree round ("tree": the sampled-sibling tree against the greedy tree of the same TreeConfig), each
    the difference of the same loop under `sampling` and greedy (`policies.auto.CostModel.sampled`).
    The six loops compile at once (`workers` threads), then run one after another."""
    tree = tree or TreeConfig()
    max_new = 256 + (n + 1) * (tree.num_nodes + 1)
    cache_len = prompt_len + max_new + tree.num_nodes + 8
    toks = jax.random.randint(jax.random.PRNGKey(3), (batch, prompt_len), 0, tcfg.vocab_size)
    lens = jnp.full((batch,), prompt_len, jnp.int32)
    loops = {}  # (kind, greedy or sampled) -> (program, consts, carry)
    for name, setting in (("greedy", GREEDY), ("sampled", sampling)):
        state = jax.jit(lambda tp, t, ln, key, s=setting: start_decode(tp, tcfg, t, ln, key, max_new=max_new,
                                                                       cache_len=cache_len, sampling=s))(
            tparams, toks, lens, jax.random.PRNGKey(0))
        body = lambda k, st, s=setting: decode_step(k, tcfg, s, max_new, st)  # noqa: E731
        loops[("ar", name)] = (_loop_program(body, n), tparams, state)
    for kind in ("chain", "tree"):
        depth = tree.depth if kind == "tree" else k_max
        pol = resolve_policy("static", depth)
        state = _start(tparams, tcfg, drafter, dparams, pol, None, depth, batch, prompt_len, max_new, cache_len)
        for name, setting in (("greedy", GREEDY), ("sampled", sampling)):
            if kind == "chain":
                body = lambda k, st, s=setting, p=pol: spec_round(k[0], tcfg, drafter, k[1], p, k_max, max_new, s,  # noqa: E731
                                                                  "lossless", None, st)
            else:
                body = lambda k, st, s=setting, p=pol: tree_round(k[0], tcfg, drafter, k[1], p, tree, max_new, s, None, st)  # noqa: E731
            loops[(kind, name)] = (_loop_program(body, n, tcfg), (tparams, dparams), state)
    with ThreadPoolExecutor(max_workers=workers) as pool:
        compiled = dict(zip(loops, pool.map(lambda v: v[0].lower(v[1], v[2]).compile(), loops.values())))
    times = {key: _time_compiled(compiled[key], *loops[key][1:], n, reps) for key in loops}
    return {kind: times[(kind, "sampled")] - times[(kind, "greedy")] for kind in ("ar", "chain", "tree")}


def block_draft_us(tparams, tcfg, drafter, dparams, state, n: int) -> dict[str, float]:
    """A block drafter's two parts, each timed alone on the state `state` reached:
    {"dlm_forward_us": drafter.denoise (the DLM's cached call, its LM head included),
     "choose_us": drafter.choose on that call's logits (CPS lattice + beam, or the argmax), and with
     CPS's one-kernel search (kernels/cps_search.py) "choose_portable_us": the same with the
     portable search}."""
    last = state.last
    limit = jnp.full(last.shape, drafter.k_max, jnp.int32)

    def forward(k, c):
        tp, dp = k
        dstate, last = c
        logits, _, _, dstate = drafter.denoise(dp, tp, dstate, last)
        return dstate, jnp.argmax(logits[:, 0], axis=-1).astype(jnp.int32)

    out = {"dlm_forward_us": loop_us(forward, (tparams, dparams), (state.dstate, last), n, tcfg=tcfg)}
    logits, fixed, fixed_tok, _ = jax.jit(lambda tp, dp, ds, t: drafter.denoise(dp, tp, ds, t))(
        tparams, dparams, state.dstate, last)
    logits = logits[:, : drafter.k_max]

    def choose_with(d):
        def choose(k, c):
            dp, fixed, fixed_tok = k
            logits, prev = c
            path, _ = d.choose(dp, tcfg, logits, fixed, fixed_tok, prev, last, limit)
            # the next call's logits depend on this one's path (never in fact changed: paths are >= 0),
            # so nothing is hoisted out of the loop; the carried buffer is updated in place
            logits = logits.at[:, 0, 0].set(jnp.where(path[:, 0] < 0, 0.0, logits[:, 0, 0]))
            return logits, path[:, 0]
        return choose

    consts = (dparams, fixed[:, : drafter.k_max], fixed_tok[:, : drafter.k_max])
    out["choose_us"] = loop_us(choose_with(drafter), consts, (logits, state.dstate.prev), n)
    if getattr(drafter, "cps", False) and drafter.cps_search == "pallas":  # beside it, the portable search
        portable = choose_with(dataclasses.replace(drafter, cps_search="xla"))
        out["choose_portable_us"] = loop_us(portable, consts, (logits, state.dstate.prev), n)
    return out


def ssd_forward_us(own, tparams, dcfg, *, batch: int, b: int, n_nodes: int, prompt_len: int = 128,
                   n: int = 20) -> dict[str, float]:
    """SSD's forward against stepwise decoding's, each a whole step (forward, the rule, the
    block's bookkeeping) on a mid-generation state: {"stepwise_step_us", "ssd_step_us" (n_nodes
    nodes), "ssd_over_stepwise"}."""
    toks = jax.random.randint(jax.random.PRNGKey(3), (batch, prompt_len), 0, dcfg.target.vocab_size)
    lens = jnp.full((batch,), prompt_len, jnp.int32)
    max_new = 4 * (n + 1) * b  # the timed steps never finish a row
    cache_len = SSD.cache_len_for(prompt_len, max_new, b, n_nodes)

    def started(nodes):
        return jax.jit(lambda o, tp, t, ln: SSD.start(o, tp, dcfg, t, ln, b=b, n_nodes=nodes, max_new=max_new,
                                                      cache_len=cache_len))(own, tparams, toks, lens)

    def one_block(k, st):
        return SSD.stepwise_step(k[0], k[1], dcfg, max_new, None, st)

    def nodes(k, st):
        return SSD.ssd_step(k[0], k[1], dcfg, max_new, None, n_nodes, st)

    step = loop_us(one_block, (own, tparams), started(1), n)
    ssd = loop_us(nodes, (own, tparams), started(n_nodes), n)
    return {"stepwise_step_us": step, "ssd_step_us": ssd, "ssd_over_stepwise": ssd / step}


def policy_us(policy, batch: int, k_max: int, vocab: int, n: int) -> float:
    """start_round + k_max observes + update of a policy on random draft logits."""
    logits = jax.random.normal(jax.random.PRNGKey(5), (batch, vocab), jnp.float32)
    feats = None

    def body(k, c):
        ps, i = c
        ps, limit = policy.start_round(ps, k_max, feats)
        for s in range(k_max):
            ps, _ = policy.observe(ps, jnp.int32(s), logits + i.astype(jnp.float32) * 1e-6, jnp.zeros((batch,), jnp.int32))
        ps = policy.update(ps, limit, limit // 2, jnp.ones((batch,), bool))
        return ps, i + 1

    try:
        return loop_us(body, (), (policy.init(batch, jax.random.PRNGKey(0)), jnp.int32(0)), n)
    except (TypeError, ValueError):  # policies that need round features (LDLP) are timed inside round_us only
        return float("nan")


def commit_us(tparams, tcfg, drafter, dparams, state, T: int, n: int) -> float:
    """drafter.commit over a verified block of T tokens (the EAGLE re-read, n-gram bookkeeping)."""
    block = jnp.zeros((state.last.shape[0], T), jnp.int32)
    vout = jax.jit(lambda p, t, c: M.forward(p, tcfg, t, c, capture=getattr(drafter, "capture_layers", ())))(tparams, block, state.cache)
    n_acc = jnp.zeros_like(state.last)

    def body(k, ds):
        tp, dp, vo = k
        return drafter.commit(dp, tp, tcfg, ds, block, n_acc, state.last, vo)

    return loop_us(body, (tparams, dparams, vout), state.dstate, n, tcfg=tcfg)


# ---- the auto policy's per-card cost table ------------------------------------------------------------


TABLE_TS = (1, 2, 4, 8, 16)  # chain verify blocks a cost table times (tokens)
TABLE_TREE_NODES = (16, 24, 32, 48, 60)  # tree verify blocks (nodes)


def measure_batch_costs(costs: dict, tparams, tcfg, drafter=None, dparams=None, *, batch: int, k_max: int = 6,
                        tree: TreeConfig | None = None, Ts=TABLE_TS, tree_nodes=TABLE_TREE_NODES, n: int = 20,
                        reps: int = 3, log=None) -> dict:
    """Add one batch size to a cost table (policies.auto's format): verify_us[B][T], and with an
    autoregressive drafter draft_step_us / draft_first_us / round_overhead_us[B] (chain) and
    tree_level_us / tree_overhead_us[B] (when `tree` is given). Each verify timing is the median of
    `reps` timed loops; spread[B] records the largest relative spread among them. `log`: progress
    lines (each part as it is timed), or None. A drafter with a `cost_key` (a draft model, an early
    exit) has its draft parts written to drafters[cost_key], beside an EAGLE head's at the top level,
    so one card's table serves both without one's draft costs planning the other."""
    b = str(batch)
    costs["version"] = COST_TABLE_VERSION
    costs.setdefault("card", card_key())
    costs.setdefault("dtype", str(tparams["embed"].dtype))
    spreads: dict[str, float] = {}
    v = costs.setdefault("verify_us", {})[b] = verify_us(tparams, tcfg, batch, Ts, tree_nodes if tree is not None else (), n=n,
                                                         reps=reps, spread=spreads, log=log)
    costs.setdefault("spread", {})[b] = max(spreads.values())
    costs.setdefault("source", {})[b] = f"measured, median of {reps}"
    if drafter is None or drafter.parallel:
        return costs
    own = drafter_section(costs, drafter)
    prof = profile_method(tparams, tcfg, drafter, dparams, batch=batch, k_max=k_max, n=n, verify_ts=None, bookkeeping=False)
    if log is not None:
        log(f"round_cost:   draft step {prof['draft_step_us']:.0f} µs, chain round {prof['round_us']:.0f} µs")
    own.setdefault("draft_step_us", {})[b] = prof["draft_step_us"]
    own.setdefault("draft_first_us", {})[b] = prof["draft_first_us"]
    loop = prof["draft_first_us"] + (k_max - 1) * prof["draft_step_us"]
    own.setdefault("round_overhead_us", {})[b] = max(prof["round_us"] - loop - row_value(v, str(k_max + 1)), 0.0)
    if tree is not None:
        tp = profile_method(tparams, tcfg, drafter, dparams, batch=batch, tree=tree, n=n, verify_ts=None, bookkeeping=False)
        if log is not None:
            log(f"round_cost:   tree level {tp['tree_level_us']:.0f} µs, tree round {tp['round_us']:.0f} µs")
        own.setdefault("tree_level_us", {})[b] = tp["tree_level_us"]
        own.setdefault("tree_overhead_us", {})[b] = max(tp["round_us"] - tp["tree_build_us"] - row_value(v, f"tree{tree.num_nodes + 1}"), 0.0)
    return costs


def drafter_section(costs: dict, drafter) -> dict:
    """The part of a cost table that holds `drafter`'s own costs: the top level for an EAGLE head
    (a drafter without a `cost_key`), else drafters[cost_key] (created when missing)."""
    key = getattr(drafter, "cost_key", None)
    return costs if key is None else costs.setdefault("drafters", {}).setdefault(key, {})


CONTEXT_BASE = 192  # committed tokens behind the verify timings (verify_us's default); the draft timings' are 128


def measure_context_costs(costs: dict, tparams, tcfg, drafter, dparams, *, batch: int, context: int = 2048,
                          Ts=(1, 4, 8, 16), tree: TreeConfig | None = None, n: int = 20, reps: int = 3,
                          max_new: int = 256) -> dict:
    """Add context_us[B] to a cost table: µs per 1,000 more tokens of context, for verify blocks
    (chain sizes `Ts`, and the tree's block when `tree` is given), a chain draft step ("draft") and
    a tree level ("tree_level"), each the slope between a short and a `context`-token cache timed in
    this process (policies.auto.CostModel reads it for calls with long prompts)."""
    if context <= CONTEXT_BASE:
        raise ValueError(f"context {context}: expected more than the base tables' {CONTEXT_BASE} tokens")
    b = str(batch)
    nodes = (tree.num_nodes + 1,) if tree is not None else ()
    span = (context - CONTEXT_BASE) / 1000.0
    cache_len = context + 128
    short = verify_us(tparams, tcfg, batch, Ts, nodes, cache_len=cache_len, committed=CONTEXT_BASE, n=n, reps=reps)
    long = verify_us(tparams, tcfg, batch, Ts, nodes, cache_len=cache_len, committed=context, n=n, reps=reps)
    row = {k: max(long[k] - short[k], 0.0) / span for k in short}
    if drafter is not None and not drafter.parallel:
        parts = [("draft", "draft_step_us", dict(k_max=4))] + ([("tree_level", "tree_level_us", dict(tree=tree))] if tree else [])
        for key, measured, kw in parts:
            at = lambda prompt_len, kw=kw, measured=measured: profile_method(  # noqa: E731
                tparams, tcfg, drafter, dparams, batch=batch, prompt_len=prompt_len, max_new=max_new, n=n,
                verify_ts=None, bookkeeping=False, **kw)[measured]
            row[key] = max(at(context) - at(128), 0.0) / ((context - 128) / 1000.0)
    costs.setdefault("context_us", {})[b] = row
    costs["context_base"] = CONTEXT_BASE
    return costs


# On-the-fly measurements (a card or batch with no committed table): more repeats, and a table
# whose timings disagree by more than MAX_SPREAD is not trusted: the batch's costs are taken from
# the nearest trusted table, scaled by the measured AR step (`scaled_from_nearest`).
ROBUST_REPS = 7
MAX_SPREAD = 0.1


def scaled_from_nearest(costs: dict, batch: int, ar_us: float) -> tuple[dict, str]:
    """Every per-batch entry of a table for `batch`, from the nearest trusted batch of `costs`
    (this card's table; REFERENCE_COSTS when it has none), scaled by ar_us / that batch's AR step.
    Returns ({key: entry}, a note saying where it came from)."""
    spread = costs.get("spread", {})
    trusted = [int(k) for k in costs.get("verify_us", {}) if int(k) != batch and spread.get(k, 0.0) <= MAX_SPREAD]
    source = costs if trusted else REFERENCE_COSTS
    pool = trusted or [int(k) for k in REFERENCE_COSTS["verify_us"]]
    near = str(min(pool, key=lambda k: (abs(np.log(k / batch)), k)))
    scale = ar_us / float(source["verify_us"][near]["1"])
    out = {}
    for key, per_batch in source.items():
        if isinstance(per_batch, dict) and near in per_batch and key.endswith("_us"):
            entry = per_batch[near]
            out[key] = {k: float(x) * scale for k, x in entry.items()} if isinstance(entry, dict) else float(entry) * scale
    return out, f"scaled from {source.get('card', 'this card')} batch {near} by the measured AR step"


def ensure_costs(tparams, tcfg, drafter, dparams, *, batch: int, preset: str | None, models_dir: str = "models",
                 tree: bool = True) -> dict:
    """This card's cost table with `batch` measured (measured now and cached when missing: each
    timing the median of ROBUST_REPS loops, and a noisy measurement replaced by the nearest trusted
    table scaled to this card's AR step, so one bad timing cannot plan plain decoding)."""
    def covers(costs):
        key = getattr(drafter, "cost_key", None)
        own = costs if key is None else drafter_costs(costs, key)  # a draft model's own section, never a head's
        return costs.get("version") == COST_TABLE_VERSION and str(batch) in costs.get("verify_us", {}) and (
            drafter is None or drafter.parallel or str(batch) in own.get("draft_step_us", {}))

    tables = [load_card_costs(p) or {} for p in cost_table_paths(preset, models_dir)[:2]]  # committed, cached
    costs = next((t for t in tables if covers(t)), None)
    if costs is None:  # measured now into the user's cache (a run never writes into the repository)
        path = cost_table_path(preset, models_dir, committed=False)
        costs = next((t for t in reversed(tables) if t.get("version") == COST_TABLE_VERSION), {})
        costs = copy.deepcopy(costs)  # the committed table is only read
        parts = f"the target's verify forward at {len(TABLE_TS)} block sizes" + (
            f" and {len(TABLE_TREE_NODES)} tree sizes" if tree else "")
        parts += "" if drafter is None or drafter.parallel else ", a draft step and a round" + (" and a tree" if tree else "")
        print(f"round_cost: no cost table of batch {batch} for {card_key()} yet (the `auto` policy's cost model), so "
              f"measuring one, once per card: {parts}, {ROBUST_REPS} timed loops each (minutes on a CPU) -> {path}",
              flush=True)
        b = str(batch)
        measure_batch_costs(costs, tparams, tcfg, drafter, dparams, batch=batch, tree=TreeConfig() if tree else None,
                            reps=ROBUST_REPS, log=lambda line: print(line, flush=True))
        if costs.get("spread", {}).get(b, 0.0) > MAX_SPREAD:
            entries, note = scaled_from_nearest(costs, batch, costs["verify_us"][b]["1"])
            for key, entry in entries.items():
                costs.setdefault(key, {})[b] = entry
            costs.setdefault("source", {})[b] = f"{note} (own timings spread {costs['spread'][b]:.0%} > {MAX_SPREAD:.0%})"
            print(f"round_cost: batch {batch} timings spread {costs['spread'][b]:.0%}: {note}")
        save_card_costs(costs, path)
    return costs


def attach_profile(rows: list[dict], method, batch: int, prof: dict) -> None:
    """Add a method's (a MethodSpec or a bench method) round-cost profile to its JSON rows
    (top-level draft_step_us, verify_us, round_us; the whole profile under round_cost)."""
    for row in rows:
        same = all(row.get(k) == getattr(method, k) for k in ("method", "drafter", "policy", "tree"))
        if same and row.get("batch") == batch:
            row["round_cost"] = prof
            for key in ("draft_step_us", "verify_us", "round_us", "commit_us", "policy_us", "tree_level_us",
                        "dlm_forward_us", "choose_us"):
                if key in prof:
                    row[key] = prof[key]


def plot_round_cost(rows: list[dict], path: Path) -> Path | None:
    """Verify cost against block size T per batch (lines), with each method's draft step marked."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in rows if isinstance(r.get("verify_us"), dict)]
    if not rows:
        return None
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(11, 4))
    seen = set()
    for r in sorted(rows, key=lambda r: r["batch"]):
        if r["batch"] in seen:
            continue
        seen.add(r["batch"])
        pts = sorted((int(k), v) for k, v in r["verify_us"].items() if k.isdigit())
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=f"batch {r['batch']}")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("verify block size T (tokens)")
    ax.set_ylabel("µs per target forward")
    ax.set_title("verify(T, batch)")
    ax.legend()
    labels = [f"{r['method']} b{r['batch']}" for r in rows if "draft_step_us" in r]
    vals = [r["draft_step_us"] for r in rows if "draft_step_us" in r]
    bx.barh(labels, vals)
    bx.set_xlabel("µs per draft step (chain) / tree level")
    bx.set_title("draft cost")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def save_card_costs(costs: dict, path: Path) -> Path:
    """Write the table, merged per batch into what is on disk (bench processes on several GPUs of
    one host each measure their own batch sizes); a table on disk of another version is replaced."""
    merged = load_card_costs(path) or {}
    if merged.get("version") != costs.get("version"):
        merged = {}
    for key, value in costs.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = {**merged[key], **value}
        else:
            merged[key] = value
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps(merged, indent=1, sort_keys=True))
    tmp.replace(path)
    return path


def load_card_costs(path: Path) -> dict | None:
    try:
        return json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return None
