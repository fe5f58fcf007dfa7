"""Draft heads: shapes, vocab mapping, tree-mask == sequential cache, training-time test == chain."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jspec.heads import eagle as H
from jspec.model import advance, forward, init_cache, init_params
from jspec.train.testing import numpy_params, tiny_target_config

TARGET = tiny_target_config()
B, T = 2, 6


_forward = jax.jit(forward, static_argnames=("cfg", "capture"))
_features = jax.jit(H.head_features, static_argnums=0)
_head = jax.jit(H.head_forward, static_argnums=0)


@functools.lru_cache(maxsize=None)
def _setup(kind, draft_vocab=0):
    hcfg = H.default_head_config(kind, TARGET, draft_vocab)
    tparams = numpy_params(init_params, TARGET, seed=0, scale=0.1)
    hparams = numpy_params(H.init_head, hcfg, seed=1, scale=0.2)
    if hcfg.reduced_vocab:  # a non-trivial (non-prefix) draft vocab
        counts = np.random.default_rng(0).integers(0, 1000, TARGET.vocab_size)
        hparams = H.with_draft_vocab(hcfg, hparams, counts)
    tokens = jnp.asarray(np.random.default_rng(2).integers(0, TARGET.vocab_size, (B, T + 1)), jnp.int32)
    out = _forward(tparams, TARGET, tokens[:, :T], init_cache(TARGET, B, T), capture=hcfg.capture_layers)
    feats = _features(hcfg, hparams, out)
    return hcfg, tparams, hparams, tokens[:, 1:], feats


def _run_sequential(hcfg, hparams, tparams, tokens, feats, cache):
    """Feed pairs one at a time, committing each to the cache (plain autoregressive drafting)."""
    hs = []
    for t in range(tokens.shape[1]):
        h, _, cache = _head(hcfg, hparams, tparams, tokens[:, t : t + 1], feats[:, t : t + 1], cache)
        cache = advance(cache, jnp.ones((B,), jnp.int32))
        hs.append(h)
    return jnp.concatenate(hs, 1), cache


def _run3(hcfg, hparams, tparams, tokens, feats, cache, positions, mask):
    mask = jnp.broadcast_to(jnp.asarray(mask, bool), (B, 3, 3))
    positions = jnp.broadcast_to(jnp.asarray(positions, jnp.int32), (B, 3))
    return _head(hcfg, hparams, tparams, tokens, feats, cache, positions=positions, new_mask=mask)


CAUSAL3 = np.tril(np.ones((3, 3), bool))


@pytest.mark.parametrize("kind,draft_vocab", [("eagle1", 0), ("eagle3", 32)])
def test_shapes_block_and_tree_equal_sequential(kind, draft_vocab):
    hcfg, tparams, hparams, nxt, feats = _setup(kind, draft_vocab)
    h_seq, _ = _run_sequential(hcfg, hparams, tparams, nxt, feats, H.init_head_cache(hcfg, B, 16))

    # a causal block of 3 == the first 3 sequential steps
    cache = H.init_head_cache(hcfg, B, 16)
    h, logits, cache = _run3(hcfg, hparams, tparams, nxt[:, :3], feats[:, :3], cache, [0, 1, 2], CAUSAL3)
    assert h.shape == (B, 3, TARGET.hidden_size)
    assert logits.shape == (B, 3, TARGET.vocab_size) and logits.dtype == jnp.float32
    assert cache.k.shape == (1, B, 16, TARGET.num_kv_heads, TARGET.head_dim)
    assert bool(jnp.all(jnp.isfinite(logits)))
    np.testing.assert_allclose(h, h_seq[:, :3], atol=2e-5)
    if draft_vocab:
        t2d = np.asarray(hparams["t2d"])
        assert len(hparams["d2t"]) == draft_vocab and t2d.sum() == draft_vocab
        assert np.all(np.asarray(logits)[..., ~t2d] <= -1e29)
        assert np.all(t2d[np.asarray(jnp.argmax(logits, -1))])

    # a tree after the committed prefix: a (pos 3), b child of a (pos 4), c sibling of b (pos 4)
    pre = advance(cache, jnp.full((B,), 3, jnp.int32))
    tree = [[1, 0, 0], [1, 1, 0], [1, 0, 1]]
    h_tree, lg_tree, _ = _run3(hcfg, hparams, tparams, nxt[:, 3:6], feats[:, 3:6], pre, [3, 4, 4], tree)
    np.testing.assert_allclose(h_tree[:, :2], h_seq[:, 3:5], atol=2e-5)
    # c drafted as the chain a -> c
    idx = jnp.array([3, 5, 5])
    h_chain, lg_chain, _ = _run3(hcfg, hparams, tparams, nxt[:, idx], feats[:, idx], pre, [3, 4, 5], CAUSAL3)
    np.testing.assert_allclose(h_tree[:, 2], h_chain[:, 1], atol=2e-5)
    np.testing.assert_allclose(lg_tree[:, 2], lg_chain[:, 1], atol=1e-4)


def test_draft_vocab_from_counts_picks_most_frequent():
    counts = np.array([5, 0, 9, 9, 1, 7])
    d2t, t2d = H.draft_vocab_from_counts(counts, 3)
    assert d2t.tolist() == [2, 3, 5]
    assert t2d.tolist() == [False, False, True, True, False, True]


def test_training_time_test_matches_inference_chain():
    """TTT step j at position t == drafting j+1 tokens from prefix x_0..x_t with the cache."""
    hcfg, tparams, hparams, nxt, feats = _setup("eagle3", 32)
    steps = 3
    L = T - steps + 1  # positions whose teacher tokens x_{t+j+1} exist for every step

    @jax.jit
    def unroll(hparams, tparams, nxt, feats):
        f, first, later, out = feats[:, :L], None, None, []
        for j in range(steps):  # at step j, position t reads x_{t+j+1} = nxt[:, t + j]
            emb = H.embed_tokens(tparams, TARGET, nxt[:, j : j + L])
            f, first, later = H.ttt_step(hcfg, hparams, emb, f, j, first, later)
            out.append(f)
        return out

    ttt_h = unroll(hparams, tparams, nxt, feats)
    for t in (0, L - 1):
        h, cache = _run_sequential(hcfg, hparams, tparams, nxt[:, : t + 1], feats[:, : t + 1],
                                   H.init_head_cache(hcfg, B, 16))
        np.testing.assert_allclose(h[:, t], ttt_h[0][:, t], atol=2e-5)
        h = h[:, t : t + 1]
        for j in range(1, steps):
            h, cache = _run_sequential(hcfg, hparams, tparams, nxt[:, t + j : t + j + 1], h, cache)
            np.testing.assert_allclose(h[:, 0], ttt_h[j][:, t], atol=2e-5)
