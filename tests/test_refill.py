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
