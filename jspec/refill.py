"""Continuous batching inside one jit: a fixed number of rows in flight over a queue of prompts.

With a static batch, every row of a batch waits for the batch's slowest row: rows that hit EOS
early ride along doing nothing, and under speculation the row with the lowest acceptance sets
the number of rounds for all of them. On MT-Bench at batch 16 that idles about a sixth of AR's
steps and a third of an EAGLE chain's rounds. Here a finished row takes the next prompt instead:

    state = start(first `rows` prompts)
    while prompts are pending or a row is running:
        run steps until `refill` rows are done (or, with no prompt left, until all are)
        harvest the done rows' results into the [N, ...] result buffers
        start the next `refill` prompts (one batched prefill, at the narrowest power-of-two width
        that holds them) and scatter them into done rows

Generic over the engines: `start(tokens, lens, key) -> state` and `step(state) -> state` are the
engine's own functions (AR, chain, tree), `harvest(state)` picks the per-row results. The state
only needs a `done` field; every leaf that has a batch axis is a row's own (its axis is found by
tracing `start` at one and at two rows), the others (a policy's shared statistics, the random
key) stay with the running state when rows are refilled. A refill costs one prefill of `refill`
rows (at their own prompts' width, not the queue's longest) and a scatter of those rows' cache slots.

A queue may also stop early, for a compact tail (`stop_at_running`): once no prompt waits and at
most that many rows still run, the loop ends and those rows' partial results (tokens so far) are
returned at their prompts' places. The caller finishes them in a smaller batch (generate's
`tail_rows`): a step of 64 rows costs what 1.6 steps of 16 do, so the last stragglers need not pay
for the whole batch.

Outputs per prompt do not depend on which row served it or when: each row's computation reads
only its own cache (exact arithmetic; low-precision kernels may round differently at another
batch composition, as they do between batch sizes).
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp


MIN_WIDTH = 32  # the narrowest prompt width a refill's prefill runs at (decode's smallest prompt bucket)


def default_refill(rows: int) -> int:
    """Rows started per refill: a quarter of the rows in flight (a refill's prefill is batched, so
    waiting for a few finished rows costs less than refilling each one alone)."""
    return max(1, rows // 4)


def batch_axes(start: Callable, tokens, lens, key, one=None) -> Any:
    """Per state leaf: the axis that indexes rows, or None for a leaf shared by all rows. `one`:
    the state's shapes at one row when already traced."""
    one = jax.eval_shape(start, tokens[:1], lens[:1], key) if one is None else one
    two = jax.eval_shape(start, jnp.concatenate([tokens[:1]] * 2), jnp.concatenate([lens[:1]] * 2), key)

    def axis(a, b):
        diff = [i for i, (x, y) in enumerate(zip(a.shape, b.shape)) if x != y]
        if not diff:
            return None
        if len(diff) > 1 or a.shape[diff[0]] != 1 or b.shape[diff[0]] != 2:
            raise ValueError(f"a state leaf of shape {a.shape} at one row and {b.shape} at two has no single row axis")
        return diff[0]

    return jax.tree.map(axis, one, two)


def prefill_widths(start: Callable, tokens, lens, key, one=None) -> tuple[int, ...]:
    """Prompt widths a refill may prefill at: powers of two from MIN_WIDTH below the queue's padded
    width P, then P. A refill runs the narrowest that holds its prompts, so one long prompt in the
    queue does not make every refill pay its width. Only (P,) when the state's shapes depend on the
    width (nothing of jspec's does). `one`: the state's shapes at one row of full width, when
    already traced."""
    width = tokens.shape[1]
    widths = [w for w in (MIN_WIDTH << i for i in range(32)) if w < width] + [width]
    if len(widths) > 1:
        narrow = jax.eval_shape(start, tokens[:1, : widths[0]], lens[:1], key)
        full = jax.eval_shape(start, tokens[:1], lens[:1], key) if one is None else one
        same = jax.tree.structure(narrow) == jax.tree.structure(full) and all(
            a.shape == b.shape and a.dtype == b.dtype for a, b in zip(jax.tree.leaves(narrow), jax.tree.leaves(full)))
        if not same:
            return (width,)
    return tuple(widths)


def _start_at_width(start: Callable, widths: tuple[int, ...], tokens, lens, ok, key):
    """`start` on the narrowest of `widths` that holds these prompts (one branch per width)."""
    if len(widths) == 1:
        return start(tokens, lens, key)
    longest = jnp.max(jnp.where(ok, lens, 1))
    which = jnp.minimum(jnp.searchsorted(jnp.asarray(widths), longest), len(widths) - 1)
    branches = [lambda t, l, k, w=w: start(t[:, :w], l, k) for w in widths]
    return jax.lax.switch(which, branches, tokens, lens, key)


def _scatter_rows(axes, state, new, rows):
    """state with `rows` [R] of every per-row leaf replaced by `new`'s R rows."""
    def put(ax, x, y):
        if ax is None:
            return x
        return x.at[(slice(None),) * ax + (rows,)].set(y.astype(x.dtype))

    return jax.tree.map(put, axes, state, new, is_leaf=lambda a: a is None)


def running(state) -> jax.Array:
    return jnp.sum(~state.done)


def cut_start(state, budgets=None, cut: Callable | None = None):
    """A started batch with its rows cut at their token budgets (`run_queue`'s `cut`; None: as is)."""
    return state if budgets is None else cut(None, state, budgets)


def run_rows(step: Callable, state, *, stop_at_running: int = 0, max_steps: int | None = None, budgets=None,
             cut: Callable | None = None):
    """`step` a started batch until at most `stop_at_running` rows run (at most `max_steps` steps
    when given), each row stopped at its budget when `budgets` are given (`run_queue`). The loop of
    one batch of every prompt, whether it runs in the program that started it or in its own."""
    if budgets is not None:
        row_step = step
        step = lambda s: cut(s, row_step(s), budgets)  # noqa: E731

    def cond(c):
        i, s = c
        more = running(s) > stop_at_running
        return more if max_steps is None else more & (i < max_steps)

    return jax.lax.while_loop(cond, lambda c: (c[0] + 1, step(c[1])), (jnp.int32(0), state))[1]


def run_queue(start: Callable, step: Callable, harvest: Callable, tokens, lens, key, *, rows: int | None = None,
              refill: int | None = None, start_first: Callable | None = None, stop_at_running: int = 0,
              budgets=None, cut: Callable | None = None):
    """Serve every prompt of tokens [N, P] / lens [N] with `rows` rows in flight; `rows` None (or
    at least N): every prompt in one batch, stepped until all are done, with no queue machinery.

    `refill` rows are started together (None: `default_refill(rows)`). `start_first` (default
    `start`) starts the first batch, e.g. with a policy state carried over from an earlier call.
    `stop_at_running`: stop once no prompt waits and at most this many rows run; their partial
    results are returned (0: run every prompt to its end). Returns (results, state): `harvest`'s
    pytree with a leading axis of N (prompt order) and the final state (for what is shared across
    rows, e.g. a policy's learned statistics). `budgets` [N] (one batch only, e.g. a tail's rows):
    row b stops once it holds budgets[b] new tokens, by the engine's `cut(before, after, budgets)`,
    which cuts a state's rows after a step (or a start, `before` None) at their budgets, marks them
    done there and counts only the kept tokens in their statistics. Must run under jit."""
    n = tokens.shape[0]
    if rows is None or rows >= n:
        state = cut_start((start_first or start)(tokens, lens, key), budgets, cut)
        state = run_rows(step, state, stop_at_running=stop_at_running, budgets=budgets, cut=cut)
        return harvest(state), state
    if budgets is not None:
        raise ValueError("token budgets apply to one batch of every prompt, not to a queue")
    refill = max(1, min(default_refill(rows) if refill is None else refill, rows))
    one = jax.eval_shape(start, tokens[:1], lens[:1], key)
    axes = batch_axes(start, tokens, lens, key, one)
    widths = prefill_widths(start, tokens, lens, key, one)

    def prompts(first, count):
        idx = first + jnp.arange(count)
        take = jnp.clip(idx, 0, n - 1)
        return tokens[take], lens[take], idx < n, idx

    t0, l0, ok0, idx0 = prompts(0, rows)
    state = (start_first or start)(t0, l0, key)
    state = state.replace(done=state.done | ~ok0)
    row_prompt = jnp.where(ok0, idx0, -1)
    sample_out = harvest(state)
    results = jax.tree.map(lambda x: jnp.zeros((n,) + x.shape[1:], x.dtype), sample_out)

    def collect(state, row_prompt, results, everything=False):
        """Write finished rows' results (`everything`: every row's, finished or not) at their
        prompts' places; those rows become free (-1)."""
        finished = (state.done | everything) & (row_prompt >= 0)
        dst = jnp.where(finished, row_prompt, n)  # n: out of range, dropped
        results = jax.tree.map(lambda r, x: r.at[dst].set(x, mode="drop"), results, harvest(state))
        return jnp.where(finished, -1, row_prompt), results

    def serve(c):
        state, row_prompt, nxt, results, k = c

        def cond(s):
            waiting = (jnp.sum(s.done) < refill) | (nxt >= n)
            return (running(s) > jnp.where(nxt >= n, stop_at_running, 0)) & waiting

        state = jax.lax.while_loop(cond, step, state)
        row_prompt, results = collect(state, row_prompt, results)

        def start_more(args):
            state, row_prompt = args
            free = jnp.argsort(~state.done, stable=True)[:refill]  # done rows first
            t, l, ok, idx = prompts(nxt, refill)
            new = _start_at_width(start, widths, t, l, ok, jax.random.fold_in(key, k))
            state = _scatter_rows(axes, state, new, free)
            state = state.replace(done=state.done.at[free].set(state.done[free] | ~ok))
            return state, row_prompt.at[free].set(jnp.where(ok, idx, -1))

        state, row_prompt = jax.lax.cond(nxt < n, start_more, lambda a: a, (state, row_prompt))
        return state, row_prompt, jnp.minimum(nxt + refill, n), results, k + 1

    def pending(c):
        state, _, nxt, _, _ = c
        return (nxt < n) | (running(state) > stop_at_running)

    init = (state, row_prompt, jnp.int32(min(rows, n)), results, jnp.int32(1))
    state, row_prompt, _, results, _ = jax.lax.while_loop(pending, serve, init)
    # rows done before any step ran, and with stop_at_running the rows still running (partial)
    _, results = collect(state, row_prompt, results, everything=True)
    return results, state
