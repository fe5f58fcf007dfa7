"""Continuous batching (jspec.refill, generate(batch_size=...)): fewer rows in flight than prompts
gives every prompt the output it gets in one batch (AR, chain, tree, hybrid tree, a learning
policy), the per-row statistics follow their prompts, and bad settings fail with one line."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jspec.errors import UsageError
from jspec.generate import SpeculativeConfig, generate
from jspec.refill import batch_axes, run_queue
from jspec.sampling import Sampling
from jspec.speculative.engines.tree import TreeConfig
import spec_tiny

CFG, MAX_NEW = spec_tiny.CFG, spec_tiny.MAX_NEW


@pytest.fixture(scope="module")
def target():
    return spec_tiny.make_target()


def prompts(n=7, seed=3):
    return spec_tiny._prompts(seed, batch=n)


def assert_same_rows(a, b, n):
    for i in range(n):
        assert a.row(i) == b.row(i), i
    np.testing.assert_array_equal(a.lengths, b.lengths)


def test_ar_queue_equals_one_batch(target):
    ps = prompts()
    whole = generate(target, CFG, ps, max_new_tokens=MAX_NEW)
    for rows, refill in ((2, 1), (3, None), (4, 4)):
        queued = generate(target, CFG, ps, max_new_tokens=MAX_NEW, batch_size=rows, refill=refill)
        assert_same_rows(queued, whole, len(ps))
        np.testing.assert_array_equal(queued.target_calls, whole.target_calls)  # steps follow the prompt


@pytest.mark.parametrize("drafter,tree,policy", [
    ("eagle3", None, "static"),
    ("eagle3", None, "tapout"),  # a policy with shared (bandit) and per-row state
    ("ngram", None, "adl"),
    ("eagle3", TreeConfig(top_k=3, depth=3, num_nodes=8), "static"),
])
def test_speculative_queue_equals_one_batch(target, drafter, tree, policy):
    d, dp = spec_tiny._drafters(target)[drafter]
    spec = SpeculativeConfig(drafter=d, drafter_params=dp, policy=policy,
                             k_max=spec_tiny.K, tree=tree)
    ps = prompts()
    ar = generate(target, CFG, ps, max_new_tokens=MAX_NEW)
    queued = generate(target, CFG, ps, max_new_tokens=MAX_NEW, speculative=spec, batch_size=3, refill=1)
    assert_same_rows(queued, ar, len(ps))
    assert (queued.accepted <= queued.drafted).all()
    assert (queued.step_tokens.sum(1) == queued.lengths).all()  # each prompt's own per-call trace
    if policy == "static":  # same rounds per prompt as in one batch (static drafting has no shared state)
        whole = generate(target, CFG, ps, max_new_tokens=MAX_NEW, speculative=spec)
        np.testing.assert_array_equal(queued.target_calls, whole.target_calls)


def test_rows_done_at_the_first_token_and_more_rows_than_prompts(target):
    ps = prompts(5)
    whole = generate(target, CFG, ps, max_new_tokens=1)
    assert_same_rows(generate(target, CFG, ps, max_new_tokens=1, batch_size=2), whole, 5)
    # batch_size >= prompts is the one-batch program
    assert_same_rows(generate(target, CFG, ps, max_new_tokens=MAX_NEW, batch_size=8),
                     generate(target, CFG, ps, max_new_tokens=MAX_NEW), 5)


def test_refills_prefill_at_their_own_width_with_one_long_prompt_in_the_queue(target):
    """One 70-token prompt pads the queue to 128 columns; refills of short prompts prefill at 32."""
    from jspec.decode import pack_prompts, start_decode
    from jspec.refill import prefill_widths
    from jspec.sampling import GREEDY

    ps = prompts(6)
    ps[1] = (ps[1] * 10)[:70]
    whole = generate(target, CFG, ps, max_new_tokens=MAX_NEW)
    assert_same_rows(generate(target, CFG, ps, max_new_tokens=MAX_NEW, batch_size=2, refill=1), whole, len(ps))
    d, dp = spec_tiny._drafters(target)["eagle3"]
    spec = SpeculativeConfig(drafter=d, drafter_params=dp, policy="static", k_max=spec_tiny.K)
    assert_same_rows(generate(target, CFG, ps, max_new_tokens=MAX_NEW, speculative=spec, batch_size=2, refill=1), whole, len(ps))
    tokens, lens, cache_len = pack_prompts(CFG, ps, MAX_NEW)
    start = lambda t, l, k: start_decode(target, CFG, t, l, k, max_new=MAX_NEW, cache_len=cache_len, sampling=GREEDY)  # noqa: E731
    assert prefill_widths(start, jnp.asarray(tokens), jnp.asarray(lens), jax.random.PRNGKey(0)) == (32, 64, 128)


def test_batch_axes_and_shared_leaves():
    def start(t, l, k):
        return {"cache": jnp.zeros((2, t.shape[0], 4)), "rows": l, "shared": jnp.zeros(3), "key": k}

    axes = batch_axes(start, jnp.zeros((4, 5), jnp.int32), jnp.ones(4, jnp.int32), jax.random.PRNGKey(0))
    assert axes == {"cache": 1, "rows": 0, "shared": None, "key": None}


def test_run_queue_serves_every_prompt_once():
    """A counter 'model': row r finishes after lens[r] steps; results land at their prompts."""
    from flax import struct

    @struct.dataclass
    class S:
        left: jax.Array
        out: jax.Array
        done: jax.Array

    def start(t, l, k):
        return S(left=l, out=t[:, 0], done=l <= 0)

    def step(s):
        left = s.left - (~s.done)
        return S(left=left, out=s.out, done=left <= 0)

    n = 11
    tokens = jnp.arange(n)[:, None] * 10
    lens = jnp.asarray([3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 0], jnp.int32)
    results, _ = jax.jit(lambda t, l: run_queue(start, step, lambda s: (s.out, s.left), t, l, jax.random.PRNGKey(0),
                                                rows=3, refill=2))(tokens, lens)
    np.testing.assert_array_equal(results[0], np.arange(n) * 10)
    np.testing.assert_array_equal(results[1], np.zeros(n))


@pytest.mark.parametrize("kw,match", [
    (dict(batch_size=0), "batch_size must be a positive integer, got 0"),
    (dict(batch_size=2, refill=3), "refill 3 is more than the batch_size 2"),
    (dict(refill=1), "refill applies to continuous batching"),
    (dict(batch_size=2, speculative=SpeculativeConfig(drafter="ngram", engine="pearl")), "not engine='pearl'"),
])
def test_bad_settings_fail_in_one_line(target, kw, match):
    with pytest.raises(UsageError, match=match):
        generate(target, CFG, prompts(4), max_new_tokens=4, **kw)


# --- the compact tail (generate(tail_rows=...)) -------------------------------------------------


def test_ar_rows_stop_at_their_budgets(target):
    """One batch with per-row token budgets: each row is its budget-free output cut there."""
    from jspec.decode import generate_ar_jit, pack_prompts
    from jspec.sampling import GREEDY

    ps = prompts(5)
    whole = generate(target, CFG, ps, max_new_tokens=MAX_NEW)
    tokens, lens, cache_len = pack_prompts(CFG, ps, MAX_NEW)
    budgets = np.asarray([0, 1, 5, MAX_NEW, 7], np.int32)
    out, n_out, steps = jax.device_get(generate_ar_jit(
        target, CFG, jnp.asarray(tokens), jnp.asarray(lens), jax.random.PRNGKey(0), jnp.asarray(budgets),
        max_new=MAX_NEW, cache_len=cache_len, sampling=GREEDY))
    for i, b in enumerate(budgets):
        n = min(int(whole.lengths[i]), int(b))
        assert int(n_out[i]) == n and out[i, :n].tolist() == whole.row(i)[:n], i
        assert (out[i, n:] == -1).all()


@pytest.mark.parametrize("rows,tail", [(3, 1), (3, 2), (None, 2), (np.int64(3), np.int64(1))])  # counts from arrays too
def test_a_tail_gives_every_prompt_its_one_batch_output_ar(target, rows, tail):
    ps = prompts(8)
    whole = generate(target, CFG, ps, max_new_tokens=MAX_NEW)
    tailed = generate(target, CFG, ps, max_new_tokens=MAX_NEW, batch_size=rows, tail_rows=tail)
    assert_same_rows(tailed, whole, len(ps))
    np.testing.assert_array_equal(tailed.target_calls, whole.target_calls)  # AR: a call per token, the tail's prefill too


@pytest.mark.parametrize("drafter,tree", [
    ("eagle3", None),
    ("eagle3", TreeConfig(top_k=3, depth=3, num_nodes=8)),
])
def test_a_speculative_tail_gives_every_prompt_its_ar_output(target, drafter, tree, monkeypatch):
    import jspec.generate as G

    moved = []
    unfinished = G._unfinished_rows
    monkeypatch.setattr(G, "_unfinished_rows", lambda *a: moved.append(unfinished(*a)) or moved[-1])
    d, dp = spec_tiny._drafters(target)[drafter]
    spec = SpeculativeConfig(drafter=d, drafter_params=dp, policy="static", k_max=spec_tiny.K, tree=tree)
    ps = prompts(9, seed=5)
    ar = generate(target, CFG, ps, max_new_tokens=MAX_NEW)
    queued = generate(target, CFG, ps, max_new_tokens=MAX_NEW, speculative=spec, batch_size=4, refill=1)
    tailed = generate(target, CFG, ps, max_new_tokens=MAX_NEW, speculative=spec, batch_size=4, refill=1, tail_rows=2)
    assert_same_rows(tailed, ar, len(ps))
    assert (tailed.accepted <= tailed.drafted).all()
    assert (tailed.step_tokens.sum(1) == tailed.lengths).all()  # the tail's calls appended to the row's trace
    assert (tailed.draft_lengths.sum(1) == tailed.drafted).all()
    assert len(moved) == 1 and 1 <= len(moved[0]) <= 2  # rows the tail finished
    others = [i for i in range(len(ps)) if i not in moved[0]]
    np.testing.assert_array_equal(tailed.target_calls[others], queued.target_calls[others])
    assert (tailed.target_calls[moved[0]] >= 2).all()  # the tail's prefill is a call of the row's


def test_a_round_cut_at_its_budget_counts_only_the_kept_tokens():
    from jspec.speculative.state import SpecState, cut_spec_at_budgets

    B, W = 2, 8

    def state(n_out, accepted, calls, done):
        return SpecState(cache=None, dstate=None, pstate=None, out=jnp.arange(B * W).reshape(B, W),
                         n_out=jnp.asarray(n_out), last=jnp.zeros(B, jnp.int32), feature=jnp.zeros((B, 1)),
                         done=jnp.asarray(done), key=None, target_calls=jnp.asarray(calls),
                         drafted=jnp.zeros(B, jnp.int32), accepted=jnp.asarray(accepted),
                         trace_drafted=jnp.zeros((B, W + 1), jnp.int32), trace_tokens=jnp.ones((B, W + 1), jnp.int32))

    before = state([2, 3], [1, 0], [2, 3], [False, False])
    after = state([7, 5], [4, 1], [3, 4], [False, False])  # row 0: 4 accepted + bonus; row 1: 1 + bonus
    cut = cut_spec_at_budgets(before, after, jnp.asarray([4, 8]))
    assert cut.n_out.tolist() == [4, 5] and cut.done.tolist() == [True, False]
    assert cut.accepted.tolist() == [1 + 2, 1]  # row 0 kept 2 of its 4 accepted drafts, the bonus dropped
    assert int(cut.trace_tokens[0, 2]) == 2 and int(cut.trace_tokens[1, 3]) == 2
    assert (cut.out[0, 4:] == -1).all() and cut.out[1, :5].tolist() == list(range(8, 13))


def test_auto_finishes_a_queue_in_a_tail_when_the_cost_table_says_it_pays():
    from jspec.speculative.drafters.eagle import EagleDrafter
    from jspec.speculative.policies.auto import load_costs, tail_rows
    from jspec.sampling import Sampling

    target = spec_tiny.make_target()
    d, _ = spec_tiny._drafters(target)["eagle3"]
    costs = load_costs("smollm2-135m-instruct", models_dir="models")
    assert isinstance(d, EagleDrafter)
    for temperature in (0.0, 1.0):
        s = Sampling(temperature=temperature)
        assert tail_rows(d, costs, rows=64, k_cap=6, tree=None, context=400, sampling=s) == 16
        assert tail_rows(d, costs, rows=128, k_cap=6, tree=None, context=400, sampling=s) == 32
    assert tail_rows(d, costs, rows=3, k_cap=6, tree=None, context=400) == 0  # no smaller batch to move to


def test_generate_runs_autos_tail_by_default_with_continuous_batching(target, monkeypatch):
    import jspec.generate as G

    seen = []
    monkeypatch.setattr(G, "auto_tail_rows", lambda *a, **kw: seen.append(kw["rows"]) or 2)
    spy = G._finish_in_tail
    monkeypatch.setattr(G, "_finish_in_tail", lambda *a, **kw: seen.append(kw["tail"]) or spy(*a, **kw))
    d, dp = spec_tiny._drafters(target)["eagle3"]
    ps = prompts(9, seed=5)
    res = generate(target, CFG, ps, max_new_tokens=MAX_NEW, batch_size=4,
                   speculative=SpeculativeConfig(drafter=d, drafter_params=dp, policy="auto", k_max=spec_tiny.K))
    assert seen == [4, 2]
    assert_same_rows(res, generate(target, CFG, ps, max_new_tokens=MAX_NEW), len(ps))
    seen.clear()
    generate(target, CFG, ps, max_new_tokens=MAX_NEW, batch_size=4, tail_rows=0,
             speculative=SpeculativeConfig(drafter=d, drafter_params=dp, policy="auto", k_max=spec_tiny.K))
    assert seen == []


@pytest.mark.parametrize("kw,match", [
    (dict(batch_size=3, tail_rows=3), "tail_rows 3 must be fewer than the 3 rows in flight"),
    (dict(tail_rows=-1), "tail_rows must be a non-negative integer, got -1"),
    (dict(batch_size=3, tail_rows=1, mesh="data=1"), "tail_rows runs on one device"),
    (dict(tail_rows=1, max_new_tokens=250), "plus 0 speculative slots exceeds the model's 512 positions"),
])
def test_bad_tail_settings_fail_in_one_line(target, kw, match):
    kw = {"max_new_tokens": 4, **kw}
    with pytest.raises(UsageError, match=match):
        generate(target, CFG, prompts(4), **kw)


def test_the_tail_samples_from_a_stream_no_refill_uses(target, monkeypatch):
    """The queue starts refill k with fold_in(key, k), k = 1, 2, ...: a tail keyed fold_in(key, 1)
    would give its first tokens the first refill's noise (rows correlated, though each row's own
    law still passes a chi-square). The tail's key is none of the queue's."""
    import jspec.generate as G

    keys = {}
    spy_queue, spy_tail = G.generate_ar_jit, G._finish_in_tail

    def queue(*a, **kw):
        keys["queue"] = a[4]  # (params, cfg, tokens, lens, key, ...)
        return spy_queue(*a, **kw)

    def tail(*a, **kw):
        keys["tail"] = kw["key"]
        return spy_tail(*a, **kw)

    monkeypatch.setattr(G, "generate_ar_jit", queue)
    monkeypatch.setattr(G, "_finish_in_tail", tail)
    generate(target, CFG, prompts(8), max_new_tokens=MAX_NEW, batch_size=3, tail_rows=1,
             sampling=Sampling(temperature=1.0))
    refills = [np.asarray(jax.random.fold_in(keys["queue"], k)) for k in range(8)]
    assert not any((np.asarray(keys["tail"]) == r).all() for r in refills + [np.asarray(keys["queue"])])


def test_a_tail_runs_by_default_only_where_generate_can_add_it():
    """`jspec bench --queue` with `auto` records the tail generate adds by itself: none on a mesh,
    without a real queue, or where the longest prompt leaves no room in the positions."""
    from jspec.generate import default_tail_runs

    ps = prompts(8)
    assert default_tail_runs(CFG, ps, 4, None, MAX_NEW)
    assert not default_tail_runs(CFG, ps, 4, "data=2", MAX_NEW)
    assert not default_tail_runs(CFG, ps, 8, None, MAX_NEW)  # every prompt in flight at once: no queue
    assert not default_tail_runs(CFG, ps, 4, None, CFG.max_position_embeddings // 2)
