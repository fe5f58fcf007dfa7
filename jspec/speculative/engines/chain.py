"""Speculative generation, jitted end to end: one `lax.while_loop` over rounds.

A round, per row of the batch:
  1. the policy sets this round's draft budget (`start_round`);
  2. the drafter proposes up to K = k_max tokens (autoregressive drafters: a bounded while_loop
     that exits as soon as every row's policy has stopped, or, under a policy that only sets
     limits, a loop of max(limit) steps); a drafted EOS ends the draft;
  3. the target runs once over the padded block [last_token, d_1 .. d_K] (static [B, K+1]);
  4. the verification rule keeps n <= (valid drafts) tokens and emits one more (correction or
     bonus); the target cache advances by n + 1 (a chain needs no K/V moves);
  5. drafter and policy state are updated from what was accepted.

Everything a round needs lives in `SpecState`, so the same `spec_round` serves the fully jitted
`speculative_generate` and chunked host loops.
"""

from __future__ import annotations

import functools
import os

import jax
import jax.numpy as jnp
from flax import struct

from ... import model as M
from ...config import ModelConfig
from ...decode import GenerationResult, emit, is_eos, prefill, stream_row0
from ...refill import cut_start, run_queue, run_rows
from ...sampling import Sampling, probs, sample
from ..drafters.base import DrafterError, drafter_loop_params
from ..policies import resolve_policy
from ..state import SpecState, accepted_emitted, cut_spec_at_budgets, outputs_of, record_call, result_from_device, round_features, take_row
from ..verify.block import verify_block
from ..verify.chain import verify_greedy, verify_sampling
from ..verify.consultant import LOSSLESS_RULES, ConsultantRule, resolve_verify, verify_consultant


@struct.dataclass
class Draft:
    tokens: jax.Array  # [B, K]
    valid: jax.Array  # [B, K]
    probs: jax.Array | None  # [B, K, V] processed draft distributions, or None (point mass)


def draft_autoregressive(drafter, dparams, tparams, tcfg, state, pstate, policy, limit, k_max, sampling, key, keep_probs):
    """Run an autoregressive drafter for up to k_max steps; per-row stop by limit, policy or EOS.

    A drafted EOS ends the row's draft (nothing is drafted after it). A policy stop at step i
    keeps token i, unless the policy checks before drafting (`stop_skips_token`, AdaEDL): then
    token i is dropped. Token 0 is always drafted."""
    B = state.last.shape[0]
    V = tcfg.vocab_size
    logits, carry, consts = drafter.begin(dparams, tparams, tcfg, state.dstate, state.cache, state.last)

    def choose(i, logits, pstate):
        tok = sample(jax.random.fold_in(key, i), logits, sampling)
        q = probs(logits, sampling) if keep_probs else None
        pstate, stop = policy.observe(pstate, i, logits, tok)
        return tok, q, pstate, stop

    tok, q, pstate, stop = choose(0, logits, pstate)
    tokens = jnp.zeros((B, k_max), jnp.int32).at[:, 0].set(tok)
    valid = jnp.zeros((B, k_max), bool).at[:, 0].set(True)
    qbuf = jnp.zeros((B, k_max, V), jnp.float32).at[:, 0].set(q) if keep_probs else None
    active = (limit > 1) & ~stop & ~is_eos(tcfg, tok)

    def cond(c):
        i, active = c[0], c[5]
        return (i < k_max) & jnp.any(active)

    def body(c):
        i, carry, tokens, valid, qbuf, active, prev, pstate = c
        logits, carry = drafter.step(dparams, tparams, tcfg, consts, carry, prev)
        tok, q, pstate, stop = choose(i, logits, pstate)
        drafted = active & ~(stop & policy.stop_skips_token(pstate))
        tokens = tokens.at[:, i].set(jnp.where(drafted, tok, 0))
        valid = valid.at[:, i].set(drafted)
        if keep_probs:
            qbuf = qbuf.at[:, i].set(q)
        active = drafted & (i + 1 < limit) & ~stop & ~is_eos(tcfg, tok)
        return i + 1, carry, tokens, valid, qbuf, active, tok, pstate

    init = (jnp.int32(1), carry, tokens, valid, qbuf, active, tok, pstate)
    fixed = policy.fixed_steps(k_max)
    if fixed is not None and not policy.stops_in_round:
        # the length is known when tracing (static K): no branch at all (a GPU branch is a device-to-host read)
        _, carry, tokens, valid, qbuf, _, _, pstate = jax.lax.fori_loop(1, fixed, lambda _, c: body(c), init)
    elif policy.stops_in_round:
        _, carry, tokens, valid, qbuf, _, _, pstate = jax.lax.while_loop(cond, body, init)
    else:
        # No rule ends a draft inside the round: it takes max(limit) steps, known before the first.
        # A branch per step count runs a loop whose trip count the compiler knows; a while_loop's
        # data-dependent predicate costs a device-to-host copy and a stall on GPUs every step
        # (~10 µs of a ~70 µs EAGLE step on an H200), the branch choice one per round.
        steps = jnp.max(jnp.where(active, limit, 1))
        runs = [functools.partial(jax.lax.fori_loop, 1, n, lambda _, c: body(c)) for n in range(1, k_max + 1)]
        _, carry, tokens, valid, qbuf, _, _, pstate = jax.lax.switch(jnp.clip(steps - 1, 0, k_max - 1), runs, init)
    dstate, tcache = drafter.finish(consts, carry)
    return Draft(tokens, valid, qbuf), dstate, tcache, pstate


def after_first_eos(tcfg, tokens, valid):
    """[B, K] bool: positions after a row's first valid drafted EOS (the EOS itself stays)."""
    eos = (is_eos(tcfg, tokens) & valid).astype(jnp.int32)
    return (jnp.cumsum(eos, axis=1) - eos) > 0


def spec_round(tparams, tcfg, drafter, dparams, policy, k_max, max_new, sampling, verify, unroll, state: SpecState) -> SpecState:
    key, k_draft, k_verify = jax.random.split(state.key, 3)
    pstate, limit = policy.start_round(state.pstate, k_max, round_features(state, tparams))
    limit = jnp.clip(limit, 1, k_max)
    keep_probs = not sampling.greedy and not drafter.deterministic and verify in LOSSLESS_RULES
    if getattr(drafter, "block", False):  # one-forward block drafters (DiffuSpec): limit and EOS applied inside
        tokens, valid, q, dstate = drafter.draft_block(
            dparams, tparams, tcfg, state.dstate, state.last, limit, sampling, k_draft, keep_probs)
        draft, cache = Draft(tokens, valid, q), state.cache
    elif drafter.parallel:
        tokens, valid = drafter.propose(state.dstate, state.last, k_max)
        valid = valid & (jnp.arange(k_max)[None] < limit[:, None]) & ~after_first_eos(tcfg, tokens, valid)
        draft, dstate, cache = Draft(tokens, valid, None), state.dstate, state.cache
    else:
        draft, dstate, cache, pstate = draft_autoregressive(
            drafter, dparams, tparams, tcfg, state, pstate, policy, limit, k_max,
            sampling, k_draft, keep_probs,
        )

    block = jnp.concatenate([state.last[:, None], draft.tokens], axis=1)  # [B, K+1]
    vout = M.forward(tparams, tcfg, block, cache, capture=drafter.capture_layers, unroll=unroll)
    logits = M.lm_head(tparams, tcfg, vout.hidden)  # [B, K+1, V]
    running_nll = None
    if sampling.greedy and verify in LOSSLESS_RULES:
        n, nxt = verify_greedy(logits, draft.tokens, draft.valid)
    elif verify == "lossless":
        n, nxt = verify_block(k_verify, logits, draft.tokens, draft.valid, sampling, draft.probs)
    elif verify == "token":
        n, nxt = verify_sampling(k_verify, logits, draft.tokens, draft.valid, sampling, draft.probs)
    else:
        n, nxt, running_nll = verify_consultant(
            k_verify, logits, draft.tokens, draft.valid, sampling, resolve_verify(verify), state.consultant_nll)

    active = ~state.done
    emitted = jnp.concatenate([draft.tokens, nxt[:, None]], axis=1)
    emitted = jnp.where(jnp.arange(k_max + 1)[None] == n[:, None], nxt[:, None], emitted)
    out, n_out, done = emit(tcfg, state.out, state.n_out, state.done, emitted, n + 1, max_new)
    n_drafted = jnp.sum(draft.valid, axis=1).astype(jnp.int32)
    dstate = drafter.commit(dparams, tparams, tcfg, dstate, block, n, nxt, vout)
    pstate = policy.update(pstate, n_drafted, n, active)
    step = active.astype(jnp.int32)
    trace_drafted, trace_tokens = record_call(state, active, n_drafted, state.n_out, n_out)
    return SpecState(
        trace_drafted=trace_drafted, trace_tokens=trace_tokens,
        cache=M.advance(vout.cache, (n + 1) * step),
        dstate=dstate,
        pstate=pstate,
        out=out,
        n_out=n_out,
        last=jnp.where(active, nxt, state.last),
        feature=jnp.where(active[:, None], take_row(vout.hidden, n), state.feature),
        done=done,
        key=key,
        target_calls=state.target_calls + step,
        drafted=state.drafted + n_drafted * step,
        accepted=state.accepted + accepted_emitted(n, state.n_out, n_out) * step,
        consultant_nll=state.consultant_nll if running_nll is None else jnp.where(active, running_nll, state.consultant_nll),
    )


def start_spec(tparams, tcfg, drafter, dparams, policy, policy_params, k_max, max_new, cache_len, sampling, unroll, tokens, lens, key,
               *, policy_state=None, verify="lossless") -> SpecState:
    """Prefill and the state before the first round. ``policy_state``: a state returned by an
    earlier call (e.g. TapOut's bandit, carried across requests by a serving loop); None: a fresh
    ``policy.init``."""
    B = tokens.shape[0]
    cache = M.init_cache(tcfg, B, cache_len, tparams["embed"].dtype)
    logits, cache, pout = prefill(tparams, tcfg, tokens, lens, cache, capture=drafter.capture_layers, unroll=unroll)
    key, k_first, k_policy = jax.random.split(key, 3)
    first = sample(k_first, logits, sampling)
    dstate = drafter.init(dparams, tparams, tcfg, tokens, lens, first, pout, cache_len)
    if policy_state is not None:
        pstate = policy_state
    else:
        pstate = policy.init(B, k_policy) if policy_params is None else policy.init(B, k_policy, policy_params)
    rule = resolve_verify(verify)
    running = isinstance(rule, ConsultantRule) and rule.running
    out = jnp.full((B, max_new), -1, jnp.int32)
    zeros = jnp.zeros((B,), jnp.int32)
    out, n_out, done = emit(tcfg, out, zeros, jnp.zeros((B,), bool), first[:, None], jnp.ones_like(zeros), max_new)
    return SpecState(
        cache=cache, dstate=dstate, pstate=pstate, out=out, n_out=n_out, last=first,
        feature=take_row(pout.hidden, lens - 1), done=done, key=key,
        target_calls=jnp.ones_like(zeros), drafted=zeros, accepted=zeros,
        trace_drafted=jnp.zeros((B, max_new + 1), jnp.int32),
        trace_tokens=jnp.zeros((B, max_new + 1), jnp.int32).at[:, 0].set(n_out),
        consultant_nll=jnp.zeros((B,), jnp.float32) if running else None,
    )


_STATIC = ("tcfg", "drafter", "policy", "k_max", "max_new", "cache_len", "sampling", "verify", "unroll")

# A rule that may stop a draft mid-round runs the draft loop as a while_loop whose predicate depends
# on the drafts. On a GPU, XLA reads such a predicate on the host after every step (about 7 µs of a
# ~46 µs draft step on an H200) unless the loop runs from a command buffer on the device: so those
# generations compile with loops and branches in command buffers. Other programs keep XLA's
# default: on an H200 (head v7, all 80 MT-Bench questions) these options made static K = 6 4.5%
# slower, and the confidence chain went from 2.27-2.28x AR to 2.35x, SVIP from 2.20-2.24x to
# 2.30x (BENCHMARKS.md at commit b3813a1, tenth run).
DEVICE_LOOPS = {"xla_gpu_enable_command_buffer": "FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CONDITIONAL,WHILE"}
DEVICE_LOOP_MODES = ("auto", "off", "all")


def _speculative_generate(tparams, dparams, policy_params, tokens, lens, key, policy_state=None, budgets=None, *, tcfg, drafter, policy, k_max, max_new, cache_len, sampling, verify, unroll, with_policy_state=False, rows=None, refill=None, stop_at_running=0):
    """The whole generation in one jit. Returns the result arrays (`result_from_device`), plus the
    final policy state when ``with_policy_state`` (to pass back as ``policy_state``). ``rows``:
    that many rows in flight over the prompts (continuous batching, jspec.refill), ``refill`` rows
    started at a time; None: every prompt in one batch. ``stop_at_running`` and ``budgets``: a
    queue that stops for a compact tail and the tail's per-row token budgets (decode.generate_ar_jit)."""
    def start(t, l, k, policy_state=None):
        return start_spec(tparams, tcfg, drafter, dparams, policy, policy_params, k_max, max_new, cache_len, sampling, unroll,
                          t, l, k, policy_state=policy_state, verify=verify)

    loop = M.loop_params(tparams, tcfg, unroll=unroll)  # per-layer weight buffers for the rounds
    body = functools.partial(spec_round, loop, tcfg, drafter, drafter_loop_params(drafter, dparams), policy, k_max, max_new,
                             sampling, verify, unroll)
    outputs, state = run_queue(start, body, outputs_of, tokens, lens, key, rows=rows, refill=refill,
                               start_first=functools.partial(start, policy_state=policy_state),
                               stop_at_running=stop_at_running, budgets=budgets, cut=cut_spec_at_budgets)
    return outputs + (state.pstate,) if with_policy_state else outputs


_JIT_ARGS = dict(static_argnames=_STATIC + ("with_policy_state", "rows", "refill", "stop_at_running"))
speculative_generate_jit = jax.jit(_speculative_generate, **_JIT_ARGS)
_speculative_generate_device_loops_jit = jax.jit(_speculative_generate, compiler_options=DEVICE_LOOPS, **_JIT_ARGS)


def generation_program(policy):
    """The jitted whole generation for this policy: with DEVICE_LOOPS on a GPU where its rule may
    stop a draft mid-round ($JSPEC_DEVICE_LOOPS: "auto", the default; "off": never; "all": every
    chain policy), else the default compilation."""
    mode = device_loops_mode()
    on = jax.default_backend() == "gpu" and (mode == "all" or (mode == "auto" and policy.stops_in_round))
    return _speculative_generate_device_loops_jit if on else speculative_generate_jit


def device_loops_mode() -> str:
    mode = os.environ.get("JSPEC_DEVICE_LOOPS", "auto")
    if mode not in DEVICE_LOOP_MODES:
        raise ValueError(f"JSPEC_DEVICE_LOOPS={mode!r}: expected one of {', '.join(DEVICE_LOOP_MODES)}")
    return mode


def check_compatible(drafter, policy, tcfg: ModelConfig, k_max: int, verify):
    resolve_verify(verify)  # raises on an unknown rule
    if k_max < 1:
        raise ValueError(f"k_max must be >= 1, got {k_max}")
    if hasattr(drafter, "check"):
        drafter.check(tcfg)
    if getattr(drafter, "block", False) and drafter.k_max != k_max:
        raise DrafterError(
            f"the {drafter.name!r} drafter drafts blocks of k_max={drafter.k_max} tokens but the engine's k_max is "
            f"{k_max}: build it with the same k_max (dataclasses.replace(drafter, k_max={k_max}))"
        )
    if drafter.parallel and getattr(policy, "needs_draft_logits", False):
        raise DrafterError(
            f"policy {policy.name!r} reads draft distributions, which the {drafter.name!r} drafter does not have; "
            "use static, heuristic or adl"
        )


def speculative_generate(tparams, tcfg, tokens, lens, key, *, drafter, drafter_params, policy, policy_params, k_max, max_new, cache_len, sampling: Sampling, verify, unroll, policy_state=None, rows=None, refill=None, stop_at_running=0, budgets=None) -> GenerationResult:
    """Chain speculative generation; the result carries the final policy state (`policy_state`).
    One batch runs as two programs, the prefill (`start_spec_jit`, per prompt width) and the
    rounds (`spec_loop_jit`, per cache length), so prompt buckets share the larger one; a queue
    (`rows`) runs whole in `speculative_generate_jit`, whose refills prefill inside the loop."""
    policy = resolve_policy(policy, k_max)
    verify = resolve_verify(verify)
    check_compatible(drafter, policy, tcfg, k_max, verify)
    budgets = None if budgets is None else jnp.asarray(budgets, jnp.int32)
    static = dict(tcfg=tcfg, drafter=drafter, policy=policy, k_max=k_max, max_new=max_new, sampling=sampling,
                  verify=verify, unroll=unroll)
    if rows is None:  # one batch: a prefill per prompt width, then one loop program per cache length
        state = start_spec_jit(tparams, drafter_params, policy_params, jnp.asarray(tokens), jnp.asarray(lens), key,
                               policy_state, budgets, cache_len=cache_len, **static)
        state = loop_program(policy)(tparams, drafter_params, state, budgets, stop_at_running=stop_at_running, **static)
        return result_from_device(outputs_of(state) + (state.pstate,))
    return result_from_device(generation_program(policy)(
        tparams, drafter_params, policy_params, jnp.asarray(tokens), jnp.asarray(lens), key, policy_state, budgets,
        cache_len=cache_len, with_policy_state=True, rows=rows, refill=refill, stop_at_running=stop_at_running,
        **static))


@functools.partial(jax.jit, static_argnames=_STATIC)
def start_spec_jit(tparams, dparams, policy_params, tokens, lens, key, policy_state=None, budgets=None, *, tcfg, drafter, policy, k_max, max_new, cache_len, sampling, verify, unroll):
    """The prefill of `spec_loop_jit`'s state (one program per prompt width, small beside the loop's)."""
    state = start_spec(tparams, tcfg, drafter, dparams, policy, policy_params, k_max, max_new, cache_len, sampling, unroll,
                       tokens, lens, key, policy_state=policy_state, verify=verify)
    return cut_start(state, budgets, cut_spec_at_budgets)


def _spec_loop(tparams, dparams, state, budgets=None, *, tcfg, drafter, policy, k_max, max_new, sampling, verify, unroll, n_rounds=None, stop_at_running=0):
    """Rounds on a started state (donated) until at most `stop_at_running` rows run, or `n_rounds`
    rounds (streaming). Its shapes are the state's, not the prompt's: prompts of every width
    whose caches have the same length share it."""
    body = functools.partial(spec_round, M.loop_params(tparams, tcfg, unroll=unroll), tcfg, drafter,
                             drafter_loop_params(drafter, dparams), policy, k_max, max_new, sampling, verify, unroll)
    return run_rows(body, state, stop_at_running=stop_at_running, max_steps=n_rounds, budgets=budgets,
                    cut=cut_spec_at_budgets)


_LOOP_ARGS = dict(static_argnames=("tcfg", "drafter", "policy", "k_max", "max_new", "sampling", "verify", "unroll",
                                   "n_rounds", "stop_at_running"), donate_argnames=("state",))
spec_loop_jit = jax.jit(_spec_loop, **_LOOP_ARGS)
_spec_loop_device_loops_jit = jax.jit(_spec_loop, compiler_options=DEVICE_LOOPS, **_LOOP_ARGS)


def loop_program(policy):
    """`spec_loop_jit`, with DEVICE_LOOPS where `generation_program` uses them."""
    return _spec_loop_device_loops_jit if generation_program(policy) is _speculative_generate_device_loops_jit \
        else spec_loop_jit


def speculative_stream(tparams, tcfg, tokens, lens, key, *, drafter, drafter_params, policy, policy_params=None, k_max, max_new, cache_len, sampling, verify="lossless", unroll=None, rounds_per_chunk=4):
    """Yield (new tokens, SpecState) for row 0 every `rounds_per_chunk` jitted rounds."""
    policy = resolve_policy(policy, k_max)
    verify = resolve_verify(verify)
    check_compatible(drafter, policy, tcfg, k_max, verify)
    static = dict(tcfg=tcfg, drafter=drafter, policy=policy, k_max=k_max, max_new=max_new, sampling=sampling,
                  verify=verify, unroll=unroll)
    state = start_spec_jit(tparams, drafter_params, policy_params, jnp.asarray(tokens), jnp.asarray(lens), key,
                           cache_len=cache_len, **static)
    advance = lambda st: loop_program(policy)(tparams, drafter_params, st, n_rounds=rounds_per_chunk, **static)  # noqa: E731
    yield from stream_row0(state, advance)
