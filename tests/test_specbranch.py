"""SpecBranch (engines/specbranch.py) and H-RAD (heads/hrad.py): greedy identity to AR with ragged
batches, B = 1 equals PEARL, one vs 2 vs 8 fake CPU devices, and a chi-square test that the
multi-head recursive rejection keeps sampled output exactly the target's."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

from jspec import model as M
from jspec.config import ModelConfig
from jspec.decode import pack_prompts
from jspec.generate import SpeculativeConfig, generate
from jspec.heads import draft_model as DM
from jspec.heads import hrad as HR
from jspec.sampling import GREEDY, Sampling, probs
from jspec.speculative.engines.pearl import pearl_generate, pearl_mesh
from jspec.speculative.drafters.model import ModelDrafter
from jspec.speculative.engines.specbranch import (BranchState, SpecBranchConfig, _decision, _draft_role,
                                                  confident_continuation, specbranch_generate)

CFG = ModelConfig(
    arch="llama", vocab_size=48, hidden_size=32, intermediate_size=64, num_layers=4,
    num_heads=4, num_kv_heads=2, head_dim=8, eos_token_ids=(3,), max_position_embeddings=512,
)
MAX_NEW = 16


@pytest.fixture(scope="module")
def models():
    tparams = M.init_params(CFG, jax.random.PRNGKey(0), scale=0.35)
    dcfg, dparams = DM.init_from_target(tparams, CFG, (0, 3))
    return tparams, dcfg, dparams


def _prompts(batch=4, seed=0):
    rs = np.random.RandomState(seed)
    return [list(rs.randint(4, CFG.vocab_size, n)) for n in rs.randint(2, 14, batch)]  # ragged


def _sb(models, prompts, sb, sampling=GREEDY, mesh=None, seed=0, hp=None):
    tparams, dcfg, dparams = models
    tokens, lens, cache_len = pack_prompts(CFG, prompts, MAX_NEW, 2 * sb.gamma)
    return specbranch_generate(tparams, CFG, dparams, dcfg, tokens, lens, jax.random.PRNGKey(seed), sb=sb,
                               max_new=MAX_NEW, cache_len=cache_len, sampling=sampling, mesh=mesh, hrad_params=hp)


def test_greedy_identical_to_ar_and_branches_save_windows(models):
    prompts = _prompts()
    ar = generate(models[0], CFG, prompts, max_new_tokens=MAX_NEW)
    r = _sb(models, prompts, SpecBranchConfig(branches=3, gamma=3, cut="confidence", threshold=0.3))
    np.testing.assert_array_equal(r.tokens, ar.tokens)
    np.testing.assert_array_equal(r.lengths, ar.lengths)
    assert r.branch_saves.sum() > 0  # some windows survived on a second or third head
    assert 0.0 <= r.rollback_rate <= 1.0


def test_one_branch_is_pearl(models):
    prompts = _prompts(seed=1)
    sb = SpecBranchConfig(branches=1, gamma=3, cut="none")
    tparams, dcfg, dparams = models
    tokens, lens, cache_len = pack_prompts(CFG, prompts, MAX_NEW, 6)
    for s in (Sampling(temperature=1.0),):  # greedy B = 1 is covered by the identity to AR
        a = _sb(models, prompts, sb, s)
        b = pearl_generate(tparams, CFG, dparams, dcfg, tokens, lens, jax.random.PRNGKey(0), gamma=3, max_new=MAX_NEW,
                           cache_len=cache_len, sampling=s)
        np.testing.assert_array_equal(a.tokens, b.tokens)
        for f in ("target_calls", "drafted", "accepted", "rolled_back"):
            np.testing.assert_array_equal(getattr(a, f), getattr(b, f))


def test_two_and_eight_devices_match_one_device(models):
    prompts = _prompts(seed=2)
    sb = SpecBranchConfig(branches=3, gamma=3, cut="confidence")
    ar = generate(models[0], CFG, prompts, max_new_tokens=MAX_NEW)
    one = _sb(models, prompts, sb)
    tparams, dcfg, dparams = models  # through the host API: SpeculativeConfig(engine=SpecBranchConfig), mesh="role=2"
    two = generate(tparams, CFG, prompts, max_new_tokens=MAX_NEW, mesh="role=2",
                   speculative=SpeculativeConfig(engine=sb, drafter=ModelDrafter(dcfg), drafter_params=dparams))
    np.testing.assert_array_equal(two.tokens, ar.tokens)
    for f in ("target_calls", "drafted", "accepted", "rolled_back", "branch_saves"):
        np.testing.assert_array_equal(getattr(two, f), getattr(one, f))
    if len(jax.devices()) >= 8:  # 4 pairs, with H-RAD cuts: any classifier keeps the output exact
        hp = HR.init_hrad(jax.random.PRNGKey(1), CFG)
        eight = _sb(models, prompts, SpecBranchConfig(branches=2, gamma=3, cut="hrad"), mesh=pearl_mesh(), hp=hp)
        np.testing.assert_array_equal(eight.tokens, ar.tokens)


def test_sampling_is_lossless_chi_square():
    """Joint law of the first three sampled tokens = the target's, with 6 i.i.d. heads a window and
    the confidence cut; on two devices (the target's decisions broadcast), the same tokens as on one.

    Sized to catch a cut that reads the drafted token's own q(x) instead of its position's
    distribution (the kept token is then a sample of q restricted to likely tokens): that rule
    gives p = 1e-14 here (the shipped rule p = 0.75); at B = 3 and 3,000 rows its bias was invisible.
    One jitted call draws all rows (each row its own stream)."""
    cfg = CFG.replace(vocab_size=6, eos_token_ids=())
    tparams = M.init_params(cfg, jax.random.PRNGKey(4), scale=0.5)
    dcfg, dparams = DM.init_from_target(tparams, cfg, (0,))
    prompt = [2, 5, 1]
    n, new, s = 20_000, 3, Sampling(temperature=1.0)
    sb = SpecBranchConfig(branches=6, gamma=2, cut="confidence", threshold=0.5)
    tokens, lens, cache_len = pack_prompts(cfg, [prompt] * n, new, 4, cache_len=16)  # small cache: see test_pearl
    r = specbranch_generate(tparams, cfg, dparams, dcfg, tokens, lens, jax.random.PRNGKey(7), sb=sb, max_new=new,
                            cache_len=cache_len, sampling=s)
    two = specbranch_generate(tparams, cfg, dparams, dcfg, tokens[:32], lens[:32], jax.random.PRNGKey(7), sb=sb,
                              max_new=new, cache_len=cache_len, sampling=s, mesh=pearl_mesh(jax.devices()[:2]))
    np.testing.assert_array_equal(two.tokens, r.tokens[:32])  # per-row streams: a sub-batch draws the same
    # both cut outcomes and wins by later heads are common
    assert (r.branch_saves > 0).mean() > 0.1 and (r.rolled_back > 0).mean() > 0.1
    V = cfg.vocab_size
    observed = np.bincount(r.tokens[:, 0] * V * V + r.tokens[:, 1] * V + r.tokens[:, 2], minlength=V ** 3)
    seqs = np.array([prompt + [a, b] for a in range(V) for b in range(V)], np.int32)
    p = np.asarray(probs(M.lm_head(tparams, cfg, M.forward(tparams, cfg, jnp.asarray(seqs), M.init_cache(cfg, len(seqs), 8)).hidden), s))
    L = len(prompt)
    joint = np.array([p[0, L - 1, a] * p[a * V + b, L, b] * p[a * V + b, L + 1, c]
                      for a in range(V) for b in range(V) for c in range(V)])
    expected = joint.astype(np.float64) * n  # float64: chisquare checks that observed and expected sums agree
    big = expected >= 5
    obs = np.append(observed[big], observed[~big].sum())
    exp = np.append(expected[big], expected[~big].sum())
    _, pval = stats.chisquare(obs, exp * obs.sum() / exp.sum())
    assert pval > 1e-3, pval


def test_the_confidence_cut_counts_the_leading_confident_continuation_positions():
    """The window's decision keeps, of the accepted head's branch, the leading continuation
    positions (1..G-1; 0 is the head, which the target tests) whose top probability is >= the
    threshold: the head's own confidence never counts, the first position below the threshold
    ends the count, a confidence equal to it is confident, and the other branch is not read."""
    hand = [([0.1, 0.9, 0.9, 0.2], 2),  # a timid head: still 2 kept
            ([0.9, 0.2, 0.9, 0.9], 0),  # the first continuation position timid: none
            ([0.3, 0.3, 0.3, 0.3], 3),  # at the threshold: all 3
            ([0.9, 0.9, 0.9, 0.29], 2),  # the last one just below: 2
            ([0.2, 0.9, 0.1, 0.9], 1)]  # a confident position after a timid one: 1
    assert np.asarray(confident_continuation(jnp.asarray([c for c, _ in hand]), 0.3)).tolist() == [k for _, k in hand]
    R, NB, G = len(hand), 2, 4
    j = np.asarray([1, 0, 1, 0, 1])  # the head the target accepts in each row
    conf = np.full((R, NB, G), 0.95, np.float32)  # the other branch: confident everywhere
    conf[np.arange(R), j] = [c for c, _ in hand]
    toks = np.zeros((R, NB, G), np.int32)
    toks[:, :, 0] = [10, 11]
    t_top = np.zeros((R, G), np.int32)
    t_top[:, 0] = toks[np.arange(R), j, 0]  # nothing pending: the heads are tested at block index 0
    zeros = jnp.zeros((R,), jnp.int32)
    s = BranchState(tcache=M.KVCache(k=None, v=None, lengths=zeros + 9), dcache=None, out=None, n_out=zeros,
                    done=zeros > 0, last=zeros, pend=jnp.zeros((R, G - 1), jnp.int32), pend_q=None, n_pend=zeros,
                    row_id=jnp.arange(R, dtype=jnp.int32), target_calls=zeros, drafted=zeros, accepted=zeros,
                    rolled_back=zeros, branch_saves=zeros)
    sb = SpecBranchConfig(branches=NB, gamma=G, cut="confidence", threshold=0.3)
    _, hit, head, _, keep = _decision(s, jnp.asarray(toks), None, jnp.asarray(conf), jnp.asarray(t_top), None, None, None,
                                      None, GREEDY, sb, jax.random.PRNGKey(0))
    assert np.asarray(hit).all() and np.asarray(head).tolist() == j.tolist()
    assert np.asarray(keep).tolist() == [k for _, k in hand]


@pytest.mark.parametrize("sampling", [GREEDY, Sampling(temperature=1.0)], ids=["greedy", "sampling"])
def test_a_branchs_confidence_is_read_where_each_token_was_drafted(models, sampling):
    """The confidence the cut reads at branch position g is the top probability of the draft's
    distribution that token g was drafted from (after the tail and tokens 0..g-1 of its branch),
    recomputed here by one teacher-forced forward of each branch: not the one before or after."""
    tparams, dcfg, dparams = models
    sb = SpecBranchConfig(branches=2, gamma=4, cut="confidence")
    prompts = _prompts(batch=2, seed=5)
    tokens, lens, cache_len = pack_prompts(CFG, prompts, MAX_NEW, 2 * sb.gamma)
    R, NB, G = len(prompts), sb.branches, sb.gamma
    last = jnp.asarray([7, 11], jnp.int32)

    @jax.jit
    def draft(dparams, tokens, lens):
        cache = M.init_cache(dcfg, R * NB, cache_len, dparams["embed"].dtype)
        out = M.forward(dparams, dcfg, jnp.repeat(tokens, NB, 0), cache, unroll=1)
        zeros = jnp.zeros((R,), jnp.int32)
        s = BranchState(tcache=None, dcache=out.cache.replace(lengths=jnp.repeat(lens, NB).astype(jnp.int32)), out=None,
                        n_out=zeros, done=zeros > 0, last=last, pend=jnp.zeros((R, G - 1), jnp.int32), pend_q=None,
                        n_pend=zeros, row_id=jnp.arange(R, dtype=jnp.int32), target_calls=zeros, drafted=zeros,
                        accepted=zeros, rolled_back=zeros, branch_saves=zeros)
        toks, _, conf, _ = _draft_role(dparams, dcfg, sampling, sb, jax.random.PRNGKey(2), None, s)
        return toks, conf

    toks, conf = (np.asarray(x) for x in draft(dparams, jnp.asarray(tokens), jnp.asarray(lens)))
    # every branch after its prompt and tail, padded at the end (causal: padding changes no earlier logits)
    seqs = [list(p) + [int(last[r])] + toks[r, b, : G - 1].tolist() for r, p in enumerate(prompts) for b in range(NB)]
    width = max(map(len, seqs))
    padded = jnp.asarray([q + [0] * (width - len(q)) for q in seqs], jnp.int32)
    top = jax.jit(lambda p, x: jnp.max(jax.nn.softmax(M.lm_head(p, dcfg, M.forward(
        p, dcfg, x, M.init_cache(dcfg, x.shape[0], width), unroll=1).hidden).astype(jnp.float32), -1), -1))(dparams, padded)
    for r, prompt in enumerate(prompts):
        for b in range(NB):  # token g is drafted from the distribution at the tail's position + g
            want = np.asarray(top[r * NB + b, len(prompt) : len(prompt) + G])
            np.testing.assert_allclose(conf[r, b], want, rtol=1e-4, atol=1e-5, err_msg=f"row {r}, branch {b}")
    assert len(np.unique(np.round(conf, 4))) > G  # the positions' confidences differ: a shift would show


def test_hrad_class_one_cuts_as_the_confidence_rule(models):
    """H-RAD's class 1 is the confidence cut, token for token when sampling (so it is as lossless)."""
    tparams, dcfg, dparams = models
    hp = HR.init_hrad(jax.random.PRNGKey(1), CFG)
    hp = {**hp, "w3": jnp.zeros_like(hp["w3"]), "b3": jnp.array([0.0, 1.0, 0.0], hp["b3"].dtype)}  # always class 1
    prompts, s = _prompts(batch=8, seed=3), Sampling(temperature=1.0)
    conf = _sb(models, prompts, SpecBranchConfig(branches=3, gamma=3, cut="confidence", threshold=0.3), s)
    hrad = _sb(models, prompts, SpecBranchConfig(branches=3, gamma=3, cut="hrad", threshold=0.3), s, hp=hp)
    np.testing.assert_array_equal(hrad.tokens, conf.tokens)
    np.testing.assert_array_equal(hrad.rolled_back, conf.rolled_back)
    assert (conf.rolled_back > 0).any()


def test_config_and_hrad_checks(models, tmp_path):
    with pytest.raises(ValueError, match="branches"):
        SpecBranchConfig(branches=0)
    with pytest.raises(ValueError, match="cut"):
        SpecBranchConfig(cut="max")
    with pytest.raises(ValueError, match="hrad_params"):
        _sb(models, [[5, 6]], SpecBranchConfig(cut="hrad"))
    hp = HR.init_hrad(jax.random.PRNGKey(0), CFG)
    HR.save_hrad(str(tmp_path), hp, CFG)
    back = HR.load_hrad(str(tmp_path), CFG)
    for k in hp:
        np.testing.assert_array_equal(np.asarray(back[k]), np.asarray(hp[k]))
    with pytest.raises(ValueError, match="another target"):
        HR.load_hrad(str(tmp_path), CFG.replace(hidden_size=64))
    assert HR.label_of(jnp.array([0, 1, 6, 7, 30])).tolist() == [0, 1, 1, 2, 2]


def test_hrad_training_writes_a_classifier(tmp_path):
    """A few steps of the H-RAD trainer on teacher-forced labels: the loss falls, the files load."""
    from jspec.train.hrad import HradTrainConfig, train_hrad
    from jspec.train.shards import RowWriter
    from jspec.train.testing import numpy_params, tiny_target_config

    tcfg = tiny_target_config(num_layers=3)
    tparams = numpy_params(M.init_params, tcfg, seed=0, scale=0.3)
    dcfg, dparams = DM.init_from_target(tparams, tcfg, (0, 2))
    d = str(tmp_path / "data")
    w = RowWriter(d, vocab_size=tcfg.vocab_size, pad_id=0, eos_token_ids=(1,), sources=["t"], rows_per_shard=8,
                  holdout_every=4)
    rng = np.random.default_rng(0)
    for i in range(24):
        w.add(rng.integers(2, 128, 4), np.asarray(list(rng.integers(2, 128, 12)) + [1]), item=i, source=0,
              temperature=0.0, ended=True)
    w.flush()
    hc = HradTrainConfig(batch_size=8, seq_len=24, steps=12, lr=3e-3, compute_dtype="float32", log_every=4, eval_rows=8)
    summary = train_hrad(tcfg, tparams, dcfg, dparams, d, str(tmp_path / "out"), hc, progress=False)
    assert summary["steps"] == 12 and summary["held_out"]["positions"] > 0
    assert 0.0 <= summary["held_out"]["accuracy"] <= 1.0
    hp = HR.load_hrad(str(tmp_path / "out" / "hrad"), tcfg)
    assert hp["w_f"].shape == (HR.feature_size(tcfg), 256)


def test_bench_method_spec_runs_specbranch_on_device_pairs(models):
    """`specbranch:model:...:gamma=3` through the bench harness's JspecMethod: rows carry the
    rollback count, and the harness's rollback_rate reads them."""
    from jspec.bench.methods import JspecMethod
    from jspec.bench.metrics import TimedBatch, rollback_rate
    from jspec.bench.protocol import parse_method_spec

    tparams, dcfg, dparams = models
    prompts = _prompts(seed=2)
    spec = parse_method_spec("specbranch:model:unused:gamma=3:pairs=1")
    m = JspecMethod(tparams, CFG, spec, dtype="float32", batch=4, max_new_tokens=MAX_NEW,
                    generate_kwargs={"drafter": ModelDrafter(dcfg), "drafter_params": dparams})
    assert m.devices == 2 and m.mesh == "data=1,role=2"
    rows = m.run(prompts)
    ar = generate(tparams, CFG, prompts, max_new_tokens=MAX_NEW)
    assert [r.new_tokens for r in rows] == [ar.row(b) for b in range(len(prompts))]
    rate = rollback_rate([TimedBatch(rows=rows, seconds=1.0)])
    assert rate is not None and 0.0 <= rate <= 1.0
