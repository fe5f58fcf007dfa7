"""Tied draft model: cut from the target, KL-distilled, saved without embeddings, loaded as
`--drafter model:PATH`, lossless as a speculative drafter."""

import json
import os

import jax
import numpy as np
import pytest

from jspec.checkpoint.draft_format import load_draft_model, save_draft_model
from jspec.generate import SpeculativeConfig, generate
from jspec.heads import draft_model as DM
from jspec.model import init_params
from jspec.speculative.factory import build_drafter
from jspec.train.draft_model import DraftTrainConfig, train_draft_model
from jspec.train.testing import numpy_params, tiny_target_config, write_patterned_shards

TARGET = tiny_target_config(num_layers=3)  # vocab 128, EOS 1


@pytest.fixture(scope="module")
def target():
    return numpy_params(init_params, TARGET, seed=0, scale=0.3)


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    """v2 shards: 4-token prompts + patterned responses (x <- 3x + c), a holdout split."""
    return write_patterned_shards(str(tmp_path_factory.mktemp("dm_data")), TARGET.vocab_size)


def test_default_layers_keep_both_ends():
    assert DM.default_layers_from(30, 4) == (0, 10, 19, 29)
    assert DM.default_layers_from(30, 1) == (29,)
    with pytest.raises(ValueError, match="draft layers"):
        DM.default_layers_from(4, 5)


def test_train_export_load_and_draft(target, data_dir, tmp_path):
    tc = DraftTrainConfig(num_layers=1, batch_size=8, seq_len=32, steps=24, lr=1e-2, warmup_steps=2,
                          compute_dtype="float32", logits_chunk=8, log_every=8)
    summary = train_draft_model(TARGET, target, data_dir, str(tmp_path), tc, progress=False)
    rows = [json.loads(x) for x in open(tmp_path / "metrics.jsonl")]
    assert rows[-1]["kl"] < rows[0]["kl"]
    assert summary["held_out"]["kl"] < summary["held_out_init"]["kl"]
    files = os.listdir(tmp_path / "draft")
    assert "config.json" in files and any(f.endswith(".safetensors") for f in files)

    dcfg, dparams = load_draft_model(str(tmp_path / "draft"), TARGET, target)
    assert dcfg.num_layers == 1 and dparams["embed"] is target["embed"]  # tied, not stored
    drafter, dp = build_drafter(f"model:{tmp_path / 'draft'}", TARGET, target)
    prompts = [[5, 6, 7], [8, 9, 10, 11, 12, 13]]
    ar = generate(target, TARGET, prompts, max_new_tokens=12)
    sd = generate(target, TARGET, prompts, max_new_tokens=12,
                  speculative=SpeculativeConfig(drafter=drafter, drafter_params=dp, k_max=3))
    np.testing.assert_array_equal(sd.tokens, ar.tokens)


def test_save_splits_files_and_checks_target(target, tmp_path):
    dcfg, dparams = DM.init_from_target(target, TARGET, (0, 2))
    nbytes = save_draft_model(str(tmp_path), dcfg, dparams, TARGET, (0, 2), dtype="float32", max_file_bytes=40_000)
    assert len([f for f in os.listdir(tmp_path) if f.endswith(".safetensors")]) > 1
    assert nbytes < sum(np.asarray(v).nbytes for v in jax.tree.leaves(dparams))  # no embeddings
    dcfg2, loaded = load_draft_model(str(tmp_path), TARGET, target)
    assert dcfg2 == dcfg
    for a, b in zip(jax.tree.leaves(DM.split_trainable(loaded)), jax.tree.leaves(DM.split_trainable(dparams))):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    with pytest.raises(ValueError, match="another target"):
        load_draft_model(str(tmp_path), TARGET.replace(vocab_size=64), target)
