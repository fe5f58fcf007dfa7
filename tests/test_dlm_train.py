"""The target-adapted DLM: initialised as the target's first N layers, trained with the
masked-denoising objective, resumed after a kill, loaded as `dlm:PATH` and lossless as a drafter."""

import dataclasses
import json
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jspec import model as M
from jspec.decode import generate_ar_jit, pack_prompts
from jspec.heads import dlm as D
from jspec.sampling import GREEDY
from jspec.speculative.drafters.diffusion import PROXY_FILE, fit_trigram_proxy, save_proxy
from jspec.speculative.engines.chain import speculative_generate
from jspec.speculative.factory import build_drafter
from jspec.speculative.policies.adl import ADLPolicy
from jspec.train.dlm import DLMTrainConfig, train_dlm
from jspec.train.testing import numpy_params, tiny_target_config, write_patterned_shards

TARGET = tiny_target_config(num_layers=3)  # vocab 128, EOS 1, pad 0
MASK = 3  # a token id the data never holds
TC = DLMTrainConfig(num_layers=2, init_layers=(0, 1), block_size=8, train_block_sizes=(4, 8), batch_size=8, seq_len=32,
                    steps=8, lr=3e-3, warmup_steps=2, compute_dtype="float32", log_every=1, ckpt_every=2, eval_rows=8,
                    mask_token_id=MASK)


@pytest.fixture(scope="module")
def target():
    return numpy_params(M.init_params, TARGET, seed=0, scale=0.3)


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    """v2 shards: 4-token prompts + patterned responses (x <- 3x + c), a held-out split."""
    return write_patterned_shards(str(tmp_path_factory.mktemp("dlm_data")), TARGET.vocab_size, low=4, lengths=(8, 24))


@pytest.fixture(scope="module")
def straight(target, data_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("dlm_straight")
    summary = train_dlm(TARGET, target, data_dir, str(out), TC, progress=False)
    return out, summary


def _losses(out):
    return {r["step"]: r["loss"] for r in map(json.loads, open(out / "metrics.jsonl"))}


def test_prefix_init_is_the_target_cut_at_depth(target):
    """Before training, DLM layer i is target layer i and the final norm is the target's; at the
    target's full depth its causal prefill writes exactly the target's KV cache."""
    dcfg = D.DLMConfig(target=TARGET, num_layers=2, mask_token_id=MASK, block_size=8, init_layers=(0, 1))
    own = D.init_dlm(dcfg, target)
    for name, stacked in target["layers"].items():
        for i in range(2):
            np.testing.assert_array_equal(own["layers"][name][i], stacked[i])
    np.testing.assert_array_equal(own["final_norm"], target["final_norm"])

    full = D.DLMConfig(target=TARGET, num_layers=3, mask_token_id=MASK, block_size=8, init_layers=(0, 1, 2))
    toks = jnp.asarray([[5, 9, 17, 33, 65, 7]], jnp.int32)
    lens = jnp.asarray([6], jnp.int32)
    dcache = D.prefill(D.init_dlm(full, target), target, full, toks, lens, M.init_cache(full.model, 1, 16), kernels="xla")
    tcache = M.forward(target, TARGET, toks, M.init_cache(TARGET, 1, 16), kernels="xla").cache
    np.testing.assert_array_equal(dcache.k, tcache.k)
    np.testing.assert_array_equal(dcache.v, tcache.v)


def test_training_reduces_the_denoising_loss(straight):
    out, summary = straight
    losses = _losses(out)
    assert summary["steps"] == TC.steps and sorted(losses) == list(range(1, TC.steps + 1))
    assert np.mean([losses[7], losses[8]]) < np.mean([losses[1], losses[2]])
    dcfg, _ = D.load_dlm(str(out / "dlm.safetensors"), TARGET)
    assert dcfg.layer_ids == (0, 1) and dcfg.mask_token_id == MASK


def test_kill_and_resume_reproduces_the_run(straight, target, data_dir, tmp_path):
    """Killed after step 5 (last checkpoint: step 4), resumed: the same losses and weights."""
    ref_out, _ = straight
    killed = train_dlm(TARGET, target, data_dir, str(tmp_path), TC, progress=False, stop_at=5)
    assert killed == {"steps": 5} and not (tmp_path / "dlm.safetensors").exists()
    summary = train_dlm(TARGET, target, data_dir, str(tmp_path), TC, progress=False, resume=True)
    assert summary["steps"] == TC.steps
    ref, got = _losses(ref_out), _losses(tmp_path)  # the resumed run appends steps 5..8 again
    for s in range(5, TC.steps + 1):
        assert got[s] == pytest.approx(ref[s], abs=1e-6), s
    _, a = D.load_dlm(str(ref_out / "dlm.safetensors"))
    _, b = D.load_dlm(str(tmp_path / "dlm.safetensors"))
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        np.testing.assert_array_equal(x, y)


def test_init_dlm_trains_a_trained_dlm_on(straight, target, data_dir, tmp_path):
    """--init-dlm: training starts from the trained DLM's weights (its first loss is below the
    target-initialised run's first loss) and writes the same kind of file."""
    ref_out, _ = straight
    dcfg, own = D.load_dlm(str(ref_out / "dlm.safetensors"), TARGET)
    summary = train_dlm(TARGET, target, data_dir, str(tmp_path), dataclasses.replace(TC, steps=2), progress=False,
                        init_own=own)
    assert summary["steps"] == 2
    assert _losses(tmp_path)[1] < _losses(ref_out)[1]
    again, _ = D.load_dlm(str(tmp_path / "dlm.safetensors"), TARGET)
    assert again.layer_ids == dcfg.layer_ids and again.mask_token_id == dcfg.mask_token_id


def test_adapted_dlm_drafts_losslessly(straight, target, tmp_path):
    """`dlm:PATH` loads the trained file, without CPS, and with CPS once a proxy.npz lies beside it;
    DiffuSpec with CPS + ADL over it is greedy-identical to AR in float32."""
    out, _ = straight
    k, max_new = 6, 20
    prompts = [[7, 9, 11, 13, 9, 11], [20, 21, 22]]
    assert not build_drafter(f"dlm:{out}", TARGET, target, k_max=k)[0].cps
    shutil.copy(out / "dlm.safetensors", tmp_path / "dlm.safetensors")
    save_proxy(str(tmp_path / PROXY_FILE), fit_trigram_proxy([p + [9, 11, 1] for p in prompts], TARGET.vocab_size))
    drafter, dparams = build_drafter(f"dlm:{tmp_path}", TARGET, target, k_max=k)
    assert drafter.cps and set(dparams) == {"dlm", "proxy"}
    drafter = dataclasses.replace(drafter, m_max=4, beam=2, kernels="xla")
    tokens, lens, cache_len = pack_prompts(TARGET, prompts, max_new, extra=k)
    ar, n_ar, _ = generate_ar_jit(target, TARGET, jnp.asarray(tokens), jnp.asarray(lens), jax.random.PRNGKey(0),
                                  max_new=max_new, cache_len=cache_len, sampling=GREEDY)
    res = speculative_generate(target, TARGET, tokens, lens, jax.random.PRNGKey(0), drafter=drafter,
                               drafter_params=dparams, policy=ADLPolicy(k_max=k, k_min=2, delta=2), policy_params=None,
                               k_max=k, max_new=max_new, cache_len=cache_len, sampling=GREEDY, verify="lossless",
                               unroll=1)
    for b in range(len(prompts)):
        assert res.row(b) == np.asarray(ar)[b, : int(n_ar[b])].tolist()
    assert (res.drafted > 0).all()
