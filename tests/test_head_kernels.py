"""EAGLE heads' draft steps through the fused attention kernel compute what the einsum path computes.

A chain step (one pair per row) and a tree level (the frontier attends to its pending ancestors)
run the head's attention as one Pallas kernel when `kernels` is "pallas"; on CPU it runs in
interpret mode in float32, so both paths agree to float32 rounding. End to end, greedy generation
with the kernel drafts what it drafts with the einsums: the same tokens, and the same draft
lengths round by round under a confidence stop (which reads every draft step's distribution).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jspec import model as M
from jspec.config import ModelConfig
from jspec.generate import SpeculativeConfig, generate
from jspec.heads import eagle as H
from jspec.speculative.drafters.eagle import EagleDrafter
from jspec.speculative.engines.tree import TreeConfig
from jspec.speculative.policies import make_policy
from jspec.train.testing import numpy_params

# head_dim 32 (the kernel's smallest), GQA 2:1, a reduced draft vocabulary
CFG = ModelConfig(arch="llama", vocab_size=64, hidden_size=64, intermediate_size=96, num_layers=3, num_heads=2,
                  num_kv_heads=1, head_dim=32, eos_token_ids=(3,), max_position_embeddings=256)
HCFG = H.HeadConfig(kind="eagle3", target=CFG, capture_layers=(0, 1, 2), draft_vocab_size=40)
S = 24
# a head that attends to its last 64 committed tokens, over a cache long enough for it to matter
WINDOWED = (HCFG.__class__(**{**HCFG.__dict__, "attention_window": 64}), 200)


def _setting(windowed):
    return WINDOWED if windowed else (HCFG, S)


@pytest.fixture(scope="module")
def weights():
    return numpy_params(M.init_params, CFG, seed=0, scale=0.35), numpy_params(H.init_head, HCFG, seed=1, scale=0.3)


def _cache(lengths, slots=S):
    """A head cache holding random K/V; rows' cursors differ (one past the end, as a finished row's)."""
    B = len(lengths)
    rs = np.random.RandomState(2)
    cache = H.init_head_cache(HCFG, B, slots)
    k, v = (jnp.asarray(rs.normal(size=cache.k.shape), jnp.float32) for _ in range(2))
    return cache.replace(k=k, v=v, lengths=jnp.asarray(lengths, jnp.int32))


def _close(a, b, atol=2e-5):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=atol, rtol=2e-5)


@pytest.mark.parametrize("windowed", [False, True], ids=["full", "window"])
def test_chain_step_fused_equals_einsum(weights, monkeypatch, windowed):
    tparams, hparams = weights
    hcfg, slots = _setting(windowed)
    cache = _cache([7, 1, slots - 1, slots + 3], slots)
    B = cache.batch
    rs = np.random.RandomState(3)
    tok = jnp.asarray(rs.randint(0, CFG.vocab_size, (B, 1)), jnp.int32)
    feat = jnp.asarray(rs.normal(size=(B, 1, CFG.hidden_size)), jnp.float32)
    step = jax.jit(lambda *a: [H.head_chain_step(hcfg, *a, kernels=impl) for impl in ("xla", "pallas")])
    ref, out = step(hparams, tparams, tok, feat, cache)
    if windowed:  # the window changed what the long rows saw, and nothing for the short ones
        full = H.head_chain_step(HCFG, hparams, tparams, tok, feat, cache, kernels="xla")
        _close(full[0][:2], ref[0][:2])
        assert not np.allclose(full[0][2], ref[0][2], atol=1e-3)
    for a, b in zip(ref[:2], out[:2]):  # h_out, logits
        _close(a, b)
    _close(ref[2].k, out[2].k)  # the K/V written at each row's cursor (the finished row's dropped)
    _close(ref[2].v, out[2].v)
    assert not np.allclose(ref[2].k, cache.k)  # the step did write
    # the choice follows model.forward's: JSPEC_KERNELS, else the kernel only on a single GPU
    monkeypatch.setenv("JSPEC_KERNELS", "pallas")
    assert H.fused_head_attention(HCFG, 1) and not H.fused_head_attention(HCFG, 65)
    monkeypatch.setenv("JSPEC_KERNELS", "xla")
    assert not H.fused_head_attention(HCFG, 1)
    monkeypatch.delenv("JSPEC_KERNELS")
    assert H.fused_head_attention(HCFG, 1) == (M.default_kernels() == "pallas")
    assert not H.fused_head_attention(H.HeadConfig("eagle1", CFG.replace(head_dim=16, hidden_size=32)), 1, "pallas")


@pytest.mark.parametrize("windowed", [False, True], ids=["full", "window"])
def test_tree_levels_fused_equal_einsum(weights, windowed):
    """Three levels of a top-3 tree, batch 2: each level's h_out and logits agree; frontier nodes
    descend from random earlier nodes, so ancestor masks differ per node and row. Row 1's later
    levels run past the cache end: their scratch writes are dropped, the nodes still attended."""
    tparams, hparams = weights
    hcfg, slots = _setting(windowed)
    cache = _cache([5, slots - 4], slots)
    B, k, levels = 2, 3, 3
    rs = np.random.RandomState(0)
    toks = jnp.asarray(rs.randint(0, CFG.vocab_size, (levels, B, k)), jnp.int32)
    feat0 = jnp.asarray(rs.normal(size=(B, k, CFG.hidden_size)), jnp.float32)
    srcs = jnp.asarray(rs.randint(0, k, (levels, B, k)))  # each next frontier node's parent
    own = jnp.broadcast_to(jnp.eye(k, dtype=bool), (B, k, k))

    @jax.jit
    def run(hparams, tparams, cache):
        outs = {}
        for fused in (False, True):
            c, feat, pending, anc, hs = cache, feat0, None, jnp.zeros((B, k, 0), bool), []
            for lvl in range(levels):
                pos = jnp.broadcast_to(c.lengths[:, None] + lvl, (B, k))
                h, lg, entries, c = H.head_tree_level(hcfg, hparams, tparams, toks[lvl], feat, c, pos, pending, anc,
                                                      fused=fused)
                hs.append((h, lg))
                feat = jnp.take_along_axis(h, srcs[lvl][:, :, None], axis=1)
                anc = jnp.take_along_axis(jnp.concatenate([anc, own], 2), srcs[lvl][:, :, None], axis=1)
                pending = entries if pending is None else tuple(jnp.concatenate(ab, 1) for ab in zip(pending, entries))
            outs[fused] = (hs, c)
        return outs

    outs = run(hparams, tparams, cache)
    (ref, ref_cache), (got, got_cache) = outs[False], outs[True]
    for (h0, l0), (h1, l1) in zip(ref, got):
        _close(h0, h1, atol=1e-4)  # float32 rounding: the window's sums run over other blocks
        _close(l0, l1, atol=1e-4)
    # the committed slots are only read; the fused levels' scratch lies past the cursor
    for b, n in enumerate(np.asarray(cache.lengths)):
        _close(got_cache.k[:, b, :n], cache.k[:, b, :n])
        _close(ref_cache.k[:, b], cache.k[:, b])


@pytest.mark.parametrize("tree", [None, TreeConfig(top_k=3, depth=3, num_nodes=6)], ids=["chain", "tree"])
def test_generation_same_drafts_with_pallas(weights, tree):
    """The head forced onto the kernel (what JSPEC_KERNELS=pallas or a single GPU picks, see above;
    the target's own kernel path is test_kernels.py's) against the einsum head, one program each."""
    tparams, hparams = weights
    prompts = [[5, 9, 11, 5, 9], [7, 8, 9, 10, 11, 12, 13, 7, 8], [20]]
    # a random head is rarely accepted; a confidence stop makes every round's draft length depend
    # on the head's distributions, so a difference between the paths would show
    policy = make_policy("confidence", k_max=3, threshold=0.3)
    ref, got = (generate(tparams, CFG, prompts, max_new_tokens=12,
                         speculative=SpeculativeConfig(drafter=EagleDrafter(HCFG, kernels=impl), drafter_params=hparams, k_max=3, tree=tree, policy=policy)) for impl in ("xla", "pallas"))
    for b in range(len(prompts)):
        assert got.row(b) == ref.row(b)
    np.testing.assert_array_equal(got.draft_lengths, ref.draft_lengths)
    np.testing.assert_array_equal(got.accepted, ref.accepted)
    assert len(set(ref.draft_lengths[:, 1:].ravel().tolist()) - {0}) > 1  # the stop did vary


@pytest.mark.parametrize("windowed", [False, True], ids=["full", "window"])
def test_reread_fused_equals_einsum(weights, windowed):
    """The commit's re-read of a round's accepted pairs (causal, T tokens at the cursor) through the
    kernel writes the same K/V and returns the same outputs as the einsum path; row 2's block runs
    past the cache end, where both drop the writes."""
    tparams, hparams = weights
    hcfg, slots = _setting(windowed)
    cache = _cache([3, 11, slots - 2], slots)
    B, T = cache.batch, 4
    rs = np.random.RandomState(5)
    tok = jnp.asarray(rs.randint(0, CFG.vocab_size, (B, T)), jnp.int32)
    feat = jnp.asarray(rs.normal(size=(B, T, CFG.hidden_size)), jnp.float32)
    run = jax.jit(lambda *a: [H.head_forward(hcfg, *a, kernels=impl) for impl in ("xla", "pallas")])
    ref, out = run(hparams, tparams, tok, feat, cache)
    rows = np.array([0, 1])  # row 2's tokens past the end differ by design (dropped, not attended)
    _close(ref[0][rows], out[0][rows])
    _close(ref[1][rows], out[1][rows])
    _close(ref[0][2, :2], out[0][2, :2])  # its tokens inside the cache agree
    _close(ref[2].k, out[2].k)
    _close(ref[2].v, out[2].v)


@pytest.mark.parametrize("tree", [None, TreeConfig(top_k=3, depth=3, num_nodes=6)], ids=["chain", "tree"])
def test_windowed_head_on_a_long_prompt(weights, tree):
    """A prompt past the head's window: the kernel and the einsum head draft the same, the output
    is still the target's own (greedy), and the window changes the drafts (it is in force)."""
    tparams, hparams = weights
    hcfg = WINDOWED[0]
    rs = np.random.RandomState(7)
    prompts = [rs.randint(4, CFG.vocab_size, 150).tolist(), [7, 8, 9]]
    policy = make_policy("confidence", k_max=3, threshold=0.3)
    run = lambda h, impl: generate(tparams, CFG, prompts, max_new_tokens=12, speculative=SpeculativeConfig(  # noqa: E731
        drafter=EagleDrafter(h, kernels=impl), drafter_params=hparams, k_max=3, tree=tree, policy=policy))
    ref, got, full = run(hcfg, "xla"), run(hcfg, "pallas"), run(HCFG, "xla")
    ar = generate(tparams, CFG, prompts, max_new_tokens=12)
    for b in range(len(prompts)):
        assert got.row(b) == ref.row(b) == ar.row(b) == full.row(b)
    np.testing.assert_array_equal(got.draft_lengths, ref.draft_lengths)
    np.testing.assert_array_equal(got.accepted, ref.accepted)
    assert not np.array_equal(ref.draft_lengths[0], full.draft_lengths[0])


def test_attention_window_round_trips_and_is_checked(tmp_path, weights):
    from jspec.checkpoint.eagle_format import load_eagle_head, save_eagle_head

    _, hparams = weights
    save_eagle_head(str(tmp_path / "h"), WINDOWED[0], hparams)
    hcfg, _ = load_eagle_head(str(tmp_path / "h"), CFG)
    assert hcfg.attention_window == 64
    with pytest.raises(ValueError, match="attention_window 16: at least 64"):
        HCFG.__class__(**{**HCFG.__dict__, "attention_window": 16})
