"""PEARL (engines/pearl.py): greedy identity to AR, one- vs two-device agreement on 2 and 8 fake
CPU devices (conftest sets 8), a chi-square test that sampled output follows the target, and both
cache cursors after one hand-checked decision."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

from jspec import model as M
from jspec.config import ModelConfig
from jspec.decode import pack_prompts
from jspec.generate import generate
from jspec.heads import draft_model as DM
from jspec.sampling import GREEDY, Sampling, probs
from jspec.speculative.engines.pearl import PearlState, decide, measure_gamma, pearl_generate, pearl_mesh

CFG = ModelConfig(
    arch="llama", vocab_size=48, hidden_size=32, intermediate_size=64, num_layers=4,
    num_heads=4, num_kv_heads=2, head_dim=8, eos_token_ids=(3,), max_position_embeddings=512,
)
MAX_NEW = 16


@pytest.fixture(scope="module")
def models():
    tparams = M.init_params(CFG, jax.random.PRNGKey(0), scale=0.35)
    dcfg, dparams = DM.init_from_target(tparams, CFG, (0, 3))  # a tied draft cut from the target
    return tparams, dcfg, dparams


def _prompts(batch=4, seed=0):
    rs = np.random.RandomState(seed)
    return [list(rs.randint(4, CFG.vocab_size, n)) for n in rs.randint(2, 14, batch)]  # ragged


def _pearl(models, prompts, gamma, sampling=GREEDY, mesh=None, seed=0):
    tparams, dcfg, dparams = models
    tokens, lens, cache_len = pack_prompts(CFG, prompts, MAX_NEW, 2 * gamma)
    return pearl_generate(tparams, CFG, dparams, dcfg, tokens, lens, jax.random.PRNGKey(seed), gamma=gamma,
                          max_new=MAX_NEW, cache_len=cache_len, sampling=sampling, mesh=mesh)


@pytest.mark.parametrize("gamma", [1, 3])
def test_greedy_identical_to_ar_one_device(models, gamma):
    prompts = _prompts()
    ar = generate(models[0], CFG, prompts, max_new_tokens=MAX_NEW)
    r = _pearl(models, prompts, gamma)
    np.testing.assert_array_equal(r.tokens, ar.tokens)
    np.testing.assert_array_equal(r.lengths, ar.lengths)
    assert (r.drafted == gamma * (r.target_calls - 1)).all()
    assert 0.0 <= r.rollback_rate <= 1.0


def test_two_devices_match_one_device_and_ar(models):
    prompts = _prompts()
    ar = generate(models[0], CFG, prompts, max_new_tokens=MAX_NEW)
    one = _pearl(models, prompts, 3)
    two = _pearl(models, prompts, 3, mesh=pearl_mesh(jax.devices()[:2]))
    np.testing.assert_array_equal(two.tokens, ar.tokens)
    for f in ("target_calls", "drafted", "accepted", "rolled_back"):
        np.testing.assert_array_equal(getattr(two, f), getattr(one, f))
    assert two.devices == 2
    # sampling: the same per-(row, position) randomness on both devices -> the same tokens
    s = Sampling(temperature=1.0)
    np.testing.assert_array_equal(_pearl(models, prompts, 3, s, pearl_mesh(jax.devices()[:2])).tokens,
                                  _pearl(models, prompts, 3, s).tokens)


def test_eight_devices_rows_split_over_pairs(models):
    if len(jax.devices()) < 8:
        pytest.skip("needs 8 (fake) devices")
    prompts = _prompts(batch=4, seed=1)
    ar = generate(models[0], CFG, prompts, max_new_tokens=MAX_NEW)
    mesh = pearl_mesh()  # data 4 x role 2
    assert mesh.devices.shape == (4, 2)
    r = _pearl(models, prompts, 2, mesh=mesh)
    np.testing.assert_array_equal(r.tokens, ar.tokens)
    np.testing.assert_array_equal(r.target_calls, _pearl(models, prompts, 2).target_calls)


def test_sampling_is_lossless_chi_square():
    """Joint law of the first three sampled tokens = the target's, over many independent rows."""
    cfg = CFG.replace(vocab_size=6, eos_token_ids=())
    tparams = M.init_params(cfg, jax.random.PRNGKey(4), scale=0.5)
    dcfg, dparams = DM.init_from_target(tparams, cfg, (1,))
    prompt = [2, 5, 1]
    n, new, s = 3000, 3, Sampling(temperature=1.0)
    # a 16-slot cache holds the 11 slots needed (3 prompt + 3 new + 2 * gamma + 1): the default plan
    # (a 128-slot cache, prompts padded to 32) makes every attention over the 3000 rows several times
    # larger for the same tokens
    tokens, lens, cache_len = pack_prompts(cfg, [prompt] * n, new, 4, cache_len=16)
    r = pearl_generate(tparams, cfg, dparams, dcfg, tokens, lens, jax.random.PRNGKey(7), gamma=2, max_new=new,
                       cache_len=cache_len, sampling=s)
    assert (r.accepted > 0).any() and (r.rolled_back > 0).any()  # both branches ran
    V = cfg.vocab_size
    observed = np.bincount(r.tokens[:, 0] * V * V + r.tokens[:, 1] * V + r.tokens[:, 2], minlength=V ** 3)
    # exact joint: p(a) p(b | a) p(c | a, b) from the target on every 2-token continuation
    seqs = np.array([prompt + [a, b] for a in range(V) for b in range(V)], np.int32)
    cache = M.init_cache(cfg, len(seqs), 8)
    p = np.asarray(probs(M.lm_head(tparams, cfg, M.forward(tparams, cfg, jnp.asarray(seqs), cache).hidden), s))
    L = len(prompt)
    pa = p[0, L - 1]
    joint = np.array([pa[a] * p[a * V + b, L, b] * p[a * V + b, L + 1, c]
                      for a in range(V) for b in range(V) for c in range(V)])
    expected = joint.astype(np.float64) * n  # float64: chisquare checks that observed and expected sums agree
    big = expected >= 5
    obs = np.append(observed[big], observed[~big].sum())
    exp = np.append(expected[big], expected[~big].sum())
    _, pval = stats.chisquare(obs, exp * obs.sum() / exp.sum())
    assert pval > 1e-3, pval


def test_decide_moves_both_cursors_by_what_was_kept():
    """One greedy decision, γ = 3, by hand: after it the target cache holds the verified text but
    the new `last` (cursor + tokens emitted) and the draft cache that plus the pending drafts kept.
    Rows: post-verify with a rejection at the 2nd pending draft; pre-verify accepted; post-verify
    all accepted; pre-verify rejected. A draft cursor off after a rejection keeps the output exact
    (only acceptance drops), so only this catches it."""
    G, B = 3, 4
    base = jnp.array([5, 6, 7, 8], jnp.int32)
    n_pend = jnp.array([2, 0, 2, 0], jnp.int32)
    cache = M.init_cache(CFG, B, 16)
    s = PearlState(
        tcache=cache.replace(lengths=base), dcache=cache.replace(lengths=base + n_pend),
        out=jnp.full((B, 8), -1, jnp.int32), n_out=jnp.ones((B,), jnp.int32), done=jnp.zeros((B,), bool),
        last=jnp.array([9, 9, 9, 9], jnp.int32), pend=jnp.array([[10, 11], [0, 0], [12, 13], [0, 0]], jnp.int32),
        pend_q=jnp.zeros((B, G - 1, 1), jnp.float32), n_pend=n_pend, row_id=jnp.arange(B, dtype=jnp.int32),
        target_calls=jnp.ones((B,), jnp.int32), drafted=jnp.zeros((B,), jnp.int32),
        accepted=jnp.zeros((B,), jnp.int32), rolled_back=jnp.zeros((B,), jnp.int32))
    d_tok = jnp.array([[20, 21, 22], [30, 31, 32], [40, 41, 42], [50, 51, 52]], jnp.int32)
    t_top = jnp.array([[10, 44, 5], [30, 5, 5], [12, 13, 40], [7, 5, 5]], jnp.int32)
    r = decide(s, d_tok, None, t_top, None, GREEDY, G, jax.random.PRNGKey(0), 8, CFG)
    n_emit = np.array([2, 1, 3, 1])  # accepted prefix + correction / accepted drafts
    kept = np.array([0, 2, 2, 0])  # a window fully accepted keeps its last γ - 1 drafts pending
    np.testing.assert_array_equal(r.tcache.lengths, np.asarray(base) + n_emit)
    np.testing.assert_array_equal(r.n_pend, kept)
    np.testing.assert_array_equal(r.dcache.lengths, np.asarray(base) + n_emit + kept)
    np.testing.assert_array_equal(r.last, [44, 30, 40, 7])
    np.testing.assert_array_equal(r.out[:, 1:4], [[10, 44, -1], [30, -1, -1], [12, 13, 40], [7, -1, -1]])


def test_measure_gamma_is_a_small_integer(models):
    tparams, dcfg, dparams = models
    gamma, info = measure_gamma(tparams, CFG, dparams, dcfg, batch=1, cache_len=64, reps=2)
    assert 1 <= gamma <= 16 and info["t_target_s"] > 0 and info["t_draft_s"] > 0


def test_rejects_bad_gamma_and_vocab(models):
    tparams, dcfg, dparams = models
    tokens, lens, cache_len = pack_prompts(CFG, [[5, 6]], 4, 8)
    with pytest.raises(ValueError, match="gamma"):
        pearl_generate(tparams, CFG, dparams, dcfg, tokens, lens, jax.random.PRNGKey(0), gamma=0, max_new=4,
                       cache_len=cache_len, sampling=GREEDY)
    with pytest.raises(ValueError, match="vocabulary"):
        pearl_generate(tparams, CFG, dparams, dcfg.replace(vocab_size=40), tokens, lens, jax.random.PRNGKey(0),
                       gamma=2, max_new=4, cache_len=cache_len, sampling=GREEDY)
