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


@pytest.fixture(scope="module")
def weights():
    return numpy_params(M.init_params, CFG, seed=0, scale=0.35), numpy_params(H.init_head, HCFG, seed=1, scale=0.3)


def _cache(lengths):
    """A head cache holding random K/V; rows' cursors differ (one past the end, as a finished row's)."""
    B = len(lengths)
    rs = np.random.RandomState(2)
    cache = H.init_head_cache(HCFG, B, S)
    k, v = (jnp.asarray(rs.normal(size=cache.k.shape), jnp.float32) for _ in range(2))
    return cache.replace(k=k, v=v, lengths=jnp.asarray(lengths, jnp.int32))


def _close(a, b):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=2e-5, rtol=2e-5)


def test_chain_step_fused_equals_einsum(weights, monkeypatch):
    tparams, hparams = weights
    cache = _cache([7, 1, S - 1, S + 3])
    B = cache.batch
    rs = np.random.RandomState(3)
    tok = jnp.asarray(rs.randint(0, CFG.vocab_size, (B, 1)), jnp.int32)
    feat = jnp.asarray(rs.normal(size=(B, 1, CFG.hidden_size)), jnp.float32)
    step = jax.jit(lambda *a: [H.head_chain_step(HCFG, *a, kernels=impl) for impl in ("xla", "pallas")])
    ref, out = step(hparams, tparams, tok, feat, cache)
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


def test_tree_levels_fused_equal_einsum(weights):
    """Three levels of a top-3 tree, batch 2: each level's h_out and logits agree; frontier nodes
    descend from random earlier nodes, so ancestor masks differ per node and row. Row 1's later
    levels run past the cache end: their scratch writes are dropped, the nodes still attended."""
    tparams, hparams = weights
    cache = _cache([5, S - 4])
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
                h, lg, entries, c = H.head_tree_level(HCFG, hparams, tparams, toks[lvl], feat, c, pos, pending, anc,
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
        _close(h0, h1)
        _close(l0, l1)
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


def test_reread_fused_equals_einsum(weights):
    """The commit's re-read of a round's accepted pairs (causal, T tokens at the cursor) through the
    kernel writes the same K/V and returns the same outputs as the einsum path; row 2's block runs
    past the cache end, where both drop the writes."""
    tparams, hparams = weights
    cache = _cache([3, 11, S - 2])
    B, T = cache.batch, 4
    rs = np.random.RandomState(5)
    tok = jnp.asarray(rs.randint(0, CFG.vocab_size, (B, T)), jnp.int32)
    feat = jnp.asarray(rs.normal(size=(B, T, CFG.hidden_size)), jnp.float32)
    run = jax.jit(lambda *a: [H.head_forward(HCFG, *a, kernels=impl) for impl in ("xla", "pallas")])
    ref, out = run(hparams, tparams, tok, feat, cache)
    rows = np.array([0, 1])  # row 2's tokens past the end differ by design (dropped, not attended)
    _close(ref[0][rows], out[0][rows])
    _close(ref[1][rows], out[1][rows])
    _close(ref[0][2, :2], out[0][2, :2])  # its tokens inside the cache agree
    _close(ref[2].k, out[2].k)
    _close(ref[2].v, out[2].v)
