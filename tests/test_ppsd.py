"""PPSD (engines/ppsd.py), the exit head (heads/exit_head.py) and the model's pipeline hook
(forward(hidden_in=, final_norm=False)): split forward == full forward, greedy identity to AR with
ragged batches on one, 2 and 8 fake CPU devices, a chi-square test that sampling is lossless, and
exit-head training lowers the KL."""

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

from jspec import model as M
from jspec.checkpoint.draft_format import exit_layer_of, load_draft_model
from jspec.config import ModelConfig
from jspec.decode import pack_prompts
from jspec.generate import SpeculativeConfig, generate
from jspec.heads import exit_head as EH
from jspec.sampling import GREEDY, Sampling, probs
from jspec.speculative.engines.ppsd import ppsd_generate, ppsd_mesh
from jspec.speculative.factory import build_drafter

CFG = ModelConfig(
    arch="llama", vocab_size=48, hidden_size=32, intermediate_size=64, num_layers=4,
    num_heads=4, num_kv_heads=2, head_dim=8, eos_token_ids=(3,), max_position_embeddings=512,
)
MAX_NEW = 16
E = 2


@pytest.fixture(scope="module")
def models():
    tparams = M.init_params(CFG, jax.random.PRNGKey(0), scale=0.35)
    ecfg, eparams = EH.init_from_target(tparams, CFG, E)
    return tparams, ecfg, eparams


def _prompts(batch=4, seed=0):
    rs = np.random.RandomState(seed)
    return [list(rs.randint(4, CFG.vocab_size, n)) for n in rs.randint(2, 14, batch)]  # ragged


def _ppsd(models, prompts, sampling=GREEDY, mesh=None, seed=0, cfg=CFG, max_new=MAX_NEW, cache_len=None):
    tparams, ecfg, eparams = models
    tokens, lens, cache_len = pack_prompts(cfg, prompts, max_new, 1, cache_len=cache_len)
    return ppsd_generate(tparams, cfg, eparams, ecfg, E, tokens, lens, jax.random.PRNGKey(seed), max_new=max_new,
                         cache_len=cache_len, sampling=sampling, mesh=mesh)


def test_split_forward_equals_full_forward(models):
    tparams = models[0]
    tokens = jnp.asarray(np.random.RandomState(1).randint(0, CFG.vocab_size, (2, 7)), jnp.int32)
    cache = M.init_cache(CFG, 2, 16)
    full = M.forward(tparams, CFG, tokens, cache, capture=(E,))
    a = M.forward(tparams, CFG, tokens, cache, layer_range=(0, E), final_norm=False)
    np.testing.assert_allclose(a.hidden, full.captured[0], rtol=1e-6, atol=1e-6)
    b = M.forward(tparams, CFG, None, a.cache, hidden_in=a.hidden, layer_range=(E, CFG.num_layers))
    np.testing.assert_allclose(b.hidden, full.hidden, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(b.cache.k, full.cache.k, rtol=1e-5, atol=1e-5)


def test_greedy_identical_to_ar_one_device(models):
    prompts = _prompts()
    ar = generate(models[0], CFG, prompts, max_new_tokens=MAX_NEW)
    r = _ppsd(models, prompts)
    np.testing.assert_array_equal(r.tokens, ar.tokens)
    np.testing.assert_array_equal(r.lengths, ar.lengths)
    # every tested draft is one tick; every rejection costs one bubble tick more
    assert (r.drafted >= r.accepted).all() and (r.drafted > 0).all()
    assert 0.0 <= r.rollback_rate <= 1.0


def test_two_and_eight_devices_match_one_device_and_ar(models):
    prompts = _prompts(seed=2)
    ar = generate(models[0], CFG, prompts, max_new_tokens=MAX_NEW)
    one = _ppsd(models, prompts)
    two = _ppsd(models, prompts, mesh=ppsd_mesh(jax.devices()[:2]))
    np.testing.assert_array_equal(two.tokens, ar.tokens)
    for f in ("target_calls", "drafted", "accepted", "rolled_back"):
        np.testing.assert_array_equal(getattr(two, f), getattr(one, f))
    assert two.devices == 2
    if len(jax.devices()) >= 8:
        mesh = ppsd_mesh()  # data 4 x role 2
        assert mesh.devices.shape == (4, 2)
        eight = _ppsd(models, prompts, mesh=mesh)
        np.testing.assert_array_equal(eight.tokens, ar.tokens)
        np.testing.assert_array_equal(eight.target_calls, one.target_calls)


@pytest.mark.parametrize("exit_layer", [2, 4])
def test_sliding_window_target_on_two_devices(exit_layer):
    """A Gemma-3-like target (sliding and global layers, sandwich norms, scaled embeddings): the two
    stages then differ in their layer pattern (each device's flags are picked by its role), and
    with E = 4 of 6 stage 2 is padded with an identity layer; greedy output is still AR's."""
    cfg = ModelConfig(arch="gemma3", vocab_size=48, hidden_size=32, intermediate_size=64, num_layers=6, num_heads=4,
                      num_kv_heads=2, head_dim=8, eos_token_ids=(3,), max_position_embeddings=512, sliding_window=4,
                      sliding_layers=(True, True, False, True, True, False), qk_norm=True, sandwich_norm=True,
                      embed_scale=32 ** 0.5, rope_local_theta=10000.0)
    tparams = M.init_params(cfg, jax.random.PRNGKey(1), scale=0.35)
    ecfg, eparams = EH.init_from_target(tparams, cfg, exit_layer)
    prompts = _prompts(seed=3)
    ar = generate(tparams, cfg, prompts, max_new_tokens=MAX_NEW)
    tokens, lens, cache_len = pack_prompts(cfg, prompts, MAX_NEW, 1)
    two = ppsd_generate(tparams, cfg, eparams, ecfg, exit_layer, tokens, lens, jax.random.PRNGKey(0), max_new=MAX_NEW,
                        cache_len=cache_len, sampling=GREEDY, mesh=ppsd_mesh(jax.devices()[:2]))
    np.testing.assert_array_equal(two.tokens, ar.tokens)
    assert two.accepted.sum() > 0


def test_sampling_is_lossless_chi_square():
    """Joint law of the first three sampled tokens = the target's, over many independent rows; on two
    devices (stage 2 decides and broadcasts), the same tokens as on one."""
    cfg = CFG.replace(vocab_size=6, eos_token_ids=())
    tparams = M.init_params(cfg, jax.random.PRNGKey(4), scale=0.5)
    ecfg, eparams = EH.init_from_target(tparams, cfg, E)
    prompt = [2, 5, 1]
    n, new, s = 3000, 3, Sampling(temperature=1.0)
    # a 16-slot cache holds the 8 slots needed (3 prompt + 3 new + 2): the default plan (a 128-slot
    # cache, prompts padded to 32) makes every attention over the 3000 rows several times larger
    r = _ppsd((tparams, ecfg, eparams), [prompt] * n, s, seed=7, cfg=cfg, max_new=new, cache_len=16)
    two = _ppsd((tparams, ecfg, eparams), [prompt] * 32, s, seed=7, cfg=cfg, max_new=new, cache_len=16,
                mesh=ppsd_mesh(jax.devices()[:2]))
    np.testing.assert_array_equal(two.tokens, r.tokens[:32])  # per-row streams: a sub-batch draws the same
    assert (r.accepted > 0).any() and (r.rolled_back > 0).any()  # both branches ran
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


def test_rejects_bad_exit_layer(models):
    tparams, ecfg, eparams = models
    tokens, lens, cache_len = pack_prompts(CFG, [[5, 6]], 4, 1)
    for bad in (0, CFG.num_layers):
        with pytest.raises(ValueError, match="exit layer"):
            ppsd_generate(tparams, CFG, eparams, ecfg, bad, tokens, lens, jax.random.PRNGKey(0), max_new=4,
                          cache_len=cache_len, sampling=GREEDY)


def test_exit_head_training_lowers_kl(tmp_path):
    """Self-distillation (the draft-model trainer with exit_layer=E) lowers the held-out KL; the
    export is a tied draft-model directory that records E."""
    from jspec.train.draft_model import DraftTrainConfig, train_draft_model
    from jspec.train.testing import numpy_params, tiny_target_config, write_patterned_shards

    tcfg = tiny_target_config(num_layers=3)
    tparams = numpy_params(M.init_params, tcfg, seed=0, scale=0.3)
    d = write_patterned_shards(str(tmp_path / "data"), tcfg.vocab_size, rows=32)
    tc = DraftTrainConfig(batch_size=8, seq_len=32, steps=20, lr=1e-2, warmup_steps=2, compute_dtype="float32",
                          logits_chunk=8, log_every=10, exit_layer=1)
    out = tmp_path / "out"
    summary = train_draft_model(tcfg, tparams, d, str(out), tc, progress=False)
    assert summary["exit_layer"] == 1 and summary["layers_from"] == [2]
    assert summary["held_out"]["kl"] < summary["held_out_init"]["kl"]
    assert exit_layer_of(str(out / "draft")) == 1
    ecfg, eparams = load_draft_model(str(out / "draft"), tcfg, tparams)
    assert ecfg.num_layers == 1
    # the head drafts for plain speculative decoding (early-exit:PATH) and for PPSD through generate()
    prompts = [[5, 6, 7], [8, 9, 10, 11]]
    ar = generate(tparams, tcfg, prompts, max_new_tokens=8)
    spec = f"early-exit:{out / 'draft'}"
    drafter, hp = build_drafter(spec, tcfg, tparams)
    assert drafter.exit_layer == 1 and drafter.head == ecfg
    chain = generate(tparams, tcfg, prompts, max_new_tokens=8,
                     speculative=SpeculativeConfig(drafter=drafter, drafter_params=hp, k_max=3))
    np.testing.assert_array_equal(chain.tokens, ar.tokens)
    assert chain.drafted.sum() > 0


def test_generate_dispatches_parallel_engines(models):
    """SpeculativeConfig(engine=...) with a device-pair mesh and a batch that does not divide the pairs."""
    from jspec.heads import draft_model as DM
    from jspec.speculative.drafters.early_exit import EarlyExitDrafter
    from jspec.speculative.drafters.model import ModelDrafter

    tparams, ecfg, eparams = models
    prompts = _prompts(batch=3, seed=3)
    ar = generate(tparams, CFG, prompts, max_new_tokens=MAX_NEW)
    r = generate(tparams, CFG, prompts, max_new_tokens=MAX_NEW,
                 speculative=SpeculativeConfig(engine="ppsd", drafter=EarlyExitDrafter(E, head=ecfg), drafter_params=eparams), mesh="data=2,role=2")
    np.testing.assert_array_equal(r.tokens, ar.tokens)
    assert r.devices == 4 and r.tokens.shape[0] == 3
    dcfg, dparams = DM.init_from_target(tparams, CFG, (0, 3))
    r = generate(tparams, CFG, prompts, max_new_tokens=MAX_NEW,
                 speculative=SpeculativeConfig(engine="pearl", drafter=ModelDrafter(dcfg), drafter_params=dparams, gamma=2), mesh="role=2")
    np.testing.assert_array_equal(r.tokens, ar.tokens)
    assert r.gamma == 2 and 0 <= r.rollback_rate <= 1
    with pytest.raises(ValueError, match="draft model"):
        generate(tparams, CFG, prompts,
                 speculative=SpeculativeConfig(engine="pearl", drafter=EarlyExitDrafter(E), gamma=2))
    with pytest.raises(ValueError, match="role"):
        generate(tparams, CFG, prompts,
                 speculative=SpeculativeConfig(engine="ppsd", drafter=EarlyExitDrafter(E)), mesh="model=2")


@pytest.mark.parametrize("argv, message", [
    (["--engine", "pearl", "--drafter", "ngram"], "--engine pearl needs --drafter model[:PATH]"),
    (["--engine", "ppsd", "--drafter", "model:x"], "--engine ppsd needs --drafter early-exit:PATH"),
    (["--engine", "pearl", "--drafter", "model:x", "--k-max", "4"], "has its own schedule: drop --k-max"),
    (["--engine", "ppsd", "--drafter", "early-exit:2", "--gamma", "3"], "ppsd drafts one token a tick"),
    (["--engine", "pearl", "--drafter", "model:x", "--branches", "2"], "apply only to --engine specbranch"),
    (["--engine", "pearl", "--drafter", "model:x", "--mesh", "model=2"], "parallel engines take role=2"),
    (["--gamma", "3"], "--gamma applies only to --engine"),
])
def test_cli_engine_errors_are_one_line_before_the_model_loads(monkeypatch, capsys, argv, message):
    from jspec import cli

    def refuse(*args, **kwargs):
        raise AssertionError("the model must not load")

    monkeypatch.setattr(cli, "resolve_model", refuse)
    rc = cli.main(["generate", *argv, "hello"])
    err = capsys.readouterr().err
    assert rc == 2 and err.startswith("jspec: error: ") and err.count("\n") == 1, err
    assert message in err, err
