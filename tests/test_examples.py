"""The examples under examples/ run on CPU with tiny models (8 fake devices for the sharded ones)."""

import importlib.util
import os

import jax
import numpy as np
import pytest

from jspec import model as M
from jspec.generate import generate

EXAMPLES = os.path.join(os.path.dirname(__file__), "..", "examples")


def _load(name):
    spec = importlib.util.spec_from_file_location(f"example_{name}", os.path.join(EXAMPLES, f"{name}.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize("rows", [None, 2])
def test_rl_rollout_samples_and_scores_in_one_program(rows):
    ex = _load("rl_rollout")
    res = ex.main(["--tiny", "--max-new-tokens", "8"] + ([] if rows is None else ["--rows", str(rows)]))
    lengths, lp = res["lengths"], res["logprobs"]
    assert (lengths >= 1).all() and (lp <= 0).all()
    assert (lp[np.arange(lp.shape[1])[None] >= lengths[:, None]] == 0).all()
    # the in-program log-probs equal a plain forward over row 0's prompt + completion
    cfg, params, _ = ex.tiny_model()
    prompt = [5, 6, 7, 5, 6, 7]
    completion = res["tokens"][0, : lengths[0]].tolist()
    seq = np.asarray([prompt + completion], np.int32)
    hidden = M.forward(params, cfg, seq, M.init_cache(cfg, 1, seq.shape[1])).hidden
    ref = jax.nn.log_softmax(M.lm_head(params, cfg, hidden[0]), -1)[len(prompt) - 1 : -1]
    np.testing.assert_allclose(lp[0, : lengths[0]], np.take_along_axis(np.asarray(ref), np.asarray(completion)[:, None], 1)[:, 0],
                               rtol=1e-4, atol=1e-4)


@pytest.mark.skipif(len(jax.devices()) < 8, reason="needs 8 (fake) devices")
def test_eval_exact_match_on_a_sharded_batch(tmp_path):
    ex = _load("eval_exact_match")
    cfg, params, _ = ex.tiny_model()
    prompts = [[5 + i, 6 + i, 7 + i] for i in range(8)]  # 2 rows per device on data=4
    ar = generate(params, cfg, prompts, max_new_tokens=10)
    refs = np.full((8, 10), -1, np.int32)
    for i in range(8):
        row = ar.row(i) if i % 2 == 0 else ar.row(i)[:-1] + [(ar.row(i)[-1] + 1) % cfg.vocab_size]  # odd rows: wrong
        refs[i, : len(row)] = row
    np.save(tmp_path / "refs.npy", refs)
    res = ex.main(["--tiny", "--data", "4", "--max-new-tokens", "10", "--drafter", "ngram",
                   "--references", str(tmp_path / "refs.npy")])
    assert res["matches"] == 4 and res["per_row"].tolist() == [True, False] * 4


@pytest.mark.skipif(len(jax.devices()) < 8, reason="needs 8 (fake) devices")
def test_train_head_single_host_path(tmp_path):
    ex = _load("train_head_multihost")
    res = ex.main(["--tiny", "--out", str(tmp_path), "--fsdp", "2", "--steps", "8", "--batch", "8",
                   "--seq-len", "16", "--lr", "1e-2", "--draft-vocab", "48"])
    assert res.last_step == 8 and np.isfinite(res.losses[8])
    assert res.losses[8] < res.losses[1]
    assert os.path.exists(tmp_path / "metrics.jsonl")
