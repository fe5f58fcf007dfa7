"""One batch runs as two programs, a prefill per prompt width and a decode loop per cache length
(issue: prompt buckets that share the decode program): prompts of different buckets reuse the
loop's compiled program, with the outputs of the whole-generation program (the queue's)."""

import jax
import numpy as np
import pytest

import jspec.generate as G
from jspec.decode import decode_loop_jit, plan_cache_len, shared_cache_len, start_decode_jit
from jspec.generate import SpeculativeConfig, generate
from jspec.speculative.engines.chain import spec_loop_jit, start_spec_jit
from jspec.speculative.drafters.model import ModelDrafter
from jspec.speculative.engines.tree import TreeConfig, tree_loop_jit
import spec_tiny

CFG, MAX_NEW = spec_tiny.CFG, spec_tiny.MAX_NEW


@pytest.fixture(scope="module")
def target():
    return spec_tiny.make_target()


def two_widths():
    """Three prompts of at most 32 tokens, and three of which one has 40 (the 64 bucket)."""
    short = spec_tiny._prompts(3, batch=3)
    long = spec_tiny._prompts(4, batch=3)
    long[0] = (long[0] * 8)[:40]
    return short, long


def test_the_shared_cache_length_rounds_the_plan_up_by_at_most_a_quarter():
    assert [shared_cache_len(p, 1024, 60) for p in (32, 64, 128, 256)] == [1280, 1280, 1280, 1536]
    assert [shared_cache_len(p, 256, 60) for p in (32, 64, 128, 256, 512)] == [384, 384, 512, 640, 896]
    assert shared_cache_len(32, 20) == 128
    for need in range(1, 20000, 7):  # never short, never more than 25% (and 127 slots) over the plan
        plan = plan_cache_len(need, 0)
        assert plan <= shared_cache_len(need, 0) <= max(1.25 * plan, plan + 127)


@pytest.mark.parametrize("method", ["ar", "chain", "tree"])
def test_prompt_buckets_share_the_loop_program(target, method, monkeypatch):
    loop = {"ar": decode_loop_jit, "chain": spec_loop_jit, "tree": tree_loop_jit}[method]
    start = start_decode_jit if method == "ar" else start_spec_jit
    spec = None
    if method != "ar":
        d, dp = spec_tiny._drafters(target)["eagle3"]
        tree = TreeConfig(top_k=3, depth=3, num_nodes=8) if method == "tree" else None
        spec = SpeculativeConfig(drafter=d, drafter_params=dp, policy="static", k_max=spec_tiny.K, tree=tree)
    # as on a GPU, where attention reads each row's committed slots only: the cache is rounded up
    monkeypatch.setattr(G, "_attention_reads_committed_slots", lambda *a: True)
    short, long = two_widths()
    start.clear_cache(), loop.clear_cache()  # another test in this process may have compiled one of them
    results = [generate(target, CFG, ps, max_new_tokens=MAX_NEW, speculative=spec) for ps in (short, long)]
    assert start._cache_size() == 2  # a prefill per prompt width
    assert loop._cache_size() == 1  # one loop for both
    for ps, res in zip((short, long), results):  # the queue's whole-generation program gives the same tokens
        queued = generate(target, CFG, ps + ps[:1], max_new_tokens=MAX_NEW, speculative=spec, batch_size=2)
        for i in range(len(ps)):
            assert res.row(i) == queued.row(i), (method, i)
        np.testing.assert_array_equal(res.lengths, queued.lengths[: len(ps)])


def test_the_cache_is_rounded_up_only_where_attention_reads_committed_slots(monkeypatch):
    """On a CPU or TPU attention reads the whole cache, so a longer one costs time: no rounding up.
    The GPU kernel reads each row's committed slots, for configs it serves (no sliding window), in
    blocks up to its MAX_BLOCK tokens, and for a draft model's config too."""
    import jspec.model as M

    assert jax.default_backend() == "cpu" and not G._attention_reads_committed_slots(CFG)
    monkeypatch.setattr(M, "default_kernels", lambda: "pallas")
    assert G._attention_reads_committed_slots(CFG.replace(head_dim=32))
    assert not G._attention_reads_committed_slots(CFG.replace(head_dim=32), block=66)  # verify by einsum
    wide = CFG.replace(head_dim=32)
    assert G._attention_reads_committed_slots(wide, block=7, drafter=ModelDrafter(wide))
    assert not G._attention_reads_committed_slots(wide, block=7, drafter=ModelDrafter(CFG.replace(head_dim=24)))
    assert not G._attention_reads_committed_slots(CFG.replace(head_dim=32, sliding_window=16,
                                                              sliding_layers=(True,) * CFG.num_layers))


@pytest.mark.parametrize("prompts,match", [([5, 6, 7], "flat list of ids"), ([], "no prompts given")])
def test_bad_prompts_fail_in_one_line_before_the_cache_is_sized(target, prompts, match, monkeypatch):
    """Where the cache is rounded up (a GPU), prompts are measured before packing: they are checked first."""
    from jspec.decode import PromptError

    monkeypatch.setattr(G, "_attention_reads_committed_slots", lambda *a: True)
    with pytest.raises(PromptError, match=match):
        generate(target, CFG, prompts, max_new_tokens=4)


@pytest.mark.parametrize("method", ["ar", "chain", "tree"])
def test_sampled_split_generation_draws_what_the_whole_program_draws(target, method):
    """Split into a prefill and a loop, one batch samples exactly the tokens of the whole-generation
    program given the same key (the prefill consumes what the whole program's start consumed, the
    loop carries the state's key on): the split is a refactoring, not a new law."""
    from jspec.decode import generate_ar_jit, pack_prompts
    from jspec.speculative.engines.chain import speculative_generate, speculative_generate_jit
    from jspec.speculative.engines.tree import tree_generate, tree_generate_jit
    from jspec.speculative.policies import resolve_policy
    from jspec.speculative.state import result_from_device
    from jspec.sampling import Sampling

    sampling, key = Sampling(temperature=1.0), jax.random.PRNGKey(11)
    ps = spec_tiny._prompts(6, batch=3)
    if method == "ar":
        tokens, lens, cache_len = pack_prompts(CFG, ps, MAX_NEW)
        out, n_out, _ = jax.device_get(generate_ar_jit(target, CFG, tokens, lens, key, max_new=MAX_NEW,
                                                       cache_len=cache_len, sampling=sampling))
        state = start_decode_jit(target, CFG, tokens, lens, key, max_new=MAX_NEW, cache_len=cache_len, sampling=sampling)
        state = decode_loop_jit(target, CFG, state, max_new=MAX_NEW, sampling=sampling)
        np.testing.assert_array_equal(np.asarray(state.out), out)
        np.testing.assert_array_equal(np.asarray(state.n_out), n_out)
        return
    d, dp = spec_tiny._drafters(target)["eagle3"]
    tree = TreeConfig(top_k=3, depth=3, num_nodes=8) if method == "tree" else None
    extra = tree.cache_slots if tree is not None else spec_tiny.K + 1
    tokens, lens, cache_len = pack_prompts(CFG, ps, MAX_NEW, extra)
    policy = resolve_policy("static", tree.depth if tree is not None else spec_tiny.K)
    common = dict(tcfg=CFG, drafter=d, policy=policy, max_new=MAX_NEW, cache_len=cache_len, sampling=sampling, unroll=None)
    if tree is None:
        split = speculative_generate(target, CFG, tokens, lens, key, drafter_params=dp, policy_params=None,
                                     k_max=spec_tiny.K, verify="lossless", **{k: v for k, v in common.items() if k != "tcfg"})
        whole = result_from_device(speculative_generate_jit(target, dp, None, tokens, lens, key, None, None,
                                                            k_max=spec_tiny.K, verify="lossless", with_policy_state=True,
                                                            **common))
    else:
        split = tree_generate(target, CFG, tokens, lens, key, drafter_params=dp, policy_params=None, tree=tree,
                              **{k: v for k, v in common.items() if k != "tcfg"})
        whole = result_from_device(tree_generate_jit(target, dp, None, tokens, lens, key, None, None, tree=tree,
                                                     with_policy_state=True, **common))
    for i in range(len(ps)):
        assert split.row(i) == whole.row(i), (method, i)
    np.testing.assert_array_equal(split.target_calls, whole.target_calls)


def test_streams_yield_the_batch_output(target):
    """generate_stream and speculative_stream run the same prefill and loop programs a chunk at a
    time: concatenated, their tokens are generate()'s (greedy)."""
    from jspec.decode import pack_prompts
    from jspec.generate import generate_stream
    from jspec.sampling import GREEDY
    from jspec.speculative.engines.chain import speculative_stream

    prompt = spec_tiny._prompts(7, batch=1)[0]
    want = generate(target, CFG, [prompt], max_new_tokens=MAX_NEW).row(0)
    assert [t for chunk in generate_stream(target, CFG, prompt, max_new_tokens=MAX_NEW, chunk=3) for t in chunk] == want
    d, dp = spec_tiny._drafters(target)["eagle3"]
    tokens, lens, cache_len = pack_prompts(CFG, [prompt], MAX_NEW, spec_tiny.K + 1)
    chunks = speculative_stream(target, CFG, tokens, lens, jax.random.PRNGKey(0), drafter=d, drafter_params=dp,
                                policy="static", k_max=spec_tiny.K, max_new=MAX_NEW, cache_len=cache_len,
                                sampling=GREEDY, rounds_per_chunk=2)
    assert [t for chunk, _ in chunks for t in chunk] == want


def test_a_streamed_prompt_rounds_its_cache_as_a_batch_does(target, monkeypatch):
    """The CLI streams prompts one at a time: each is packed with the cache `generate` would give a
    batch of it (shared_cache_len where attention reads committed slots only), so nearby prompt
    buckets share a decode loop; elsewhere the plain plan. The stream's tokens stay the batch's."""
    from jspec.generate import generate_stream, pack_stream_prompt

    prompt = spec_tiny._prompts(7, batch=1)[0]
    plan = plan_cache_len(32, MAX_NEW)
    assert pack_stream_prompt(CFG, prompt, MAX_NEW)[2] == plan
    monkeypatch.setattr(G, "_attention_reads_committed_slots", lambda *a: True)
    monkeypatch.setattr(G, "shared_cache_len", lambda width, new, extra=0: plan_cache_len(width, new, extra) + 128)
    assert pack_stream_prompt(CFG, prompt, MAX_NEW)[2] == plan + 128
    want = generate(target, CFG, [prompt], max_new_tokens=MAX_NEW).row(0)
    assert [t for chunk in generate_stream(target, CFG, prompt, max_new_tokens=MAX_NEW, chunk=3) for t in chunk] == want
