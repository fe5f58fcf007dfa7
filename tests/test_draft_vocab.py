"""A draft model's draft vocabulary (FR-Spec, ModelDrafter.draft_vocab): its LM head scores only
the target's most frequent answer tokens. Logits inside the set are the full head's, outside they
are NEG_INF; greedy output stays the target's; the exact acceptance walk (bench.acceptance) counts
the same target calls as the engine; the counts file, the spec grammar and the config reject what
cannot run. The sampled law is in test_lossless_sampling.py (block-model-vocab)."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jspec import model as M
from jspec.checkpoint.hf import hf_config_dict
from jspec.bench.acceptance import draft_model_chain_calls
from jspec.bench.protocol import MethodSpecError, check_method_spec, parse_method_spec
from jspec.generate import SpeculativeConfig, generate
from jspec.speculative.drafters.base import DrafterError
from jspec.heads.eagle import draft_vocab_from_counts
from jspec.speculative.drafters.model import ModelDrafter, restrict_vocab, step_fraction
from jspec.speculative.factory import TOKEN_COUNTS_FILE, build_drafter, check_drafter_spec, token_counts

from spec_tiny import CFG, _prompts, make_target

VOCAB = 30  # of CFG's 48


@pytest.fixture(scope="module")
def pair():
    tparams = make_target()
    dcfg = CFG.replace(num_layers=1)
    dparams = M.init_params(dcfg, jax.random.PRNGKey(1), scale=0.35)
    dparams["embed"] = tparams["embed"]
    counts = np.random.RandomState(0).randint(0, 1000, CFG.vocab_size)
    return tparams, dcfg, dparams, counts


def frequent_tokens(counts, n):
    return np.asarray(draft_vocab_from_counts(counts, n)[0])


def test_frequent_tokens_rank_by_count_then_id():  # the one ranking, EAGLE-3 heads' and draft models'
    counts = np.array([5, 9, 9, 0, 7, 9])
    assert frequent_tokens(counts, 3).tolist() == [1, 2, 5]
    assert frequent_tokens(counts, 4).tolist() == [1, 2, 4, 5]
    with pytest.raises(ValueError, match="choose 1..6"):
        frequent_tokens(counts, 7)


@pytest.mark.parametrize("tied", [True, False])
def test_logits_inside_the_vocabulary_are_the_full_heads(pair, tied):
    _, dcfg, dparams, counts = pair
    dcfg = dcfg.replace(tie_word_embeddings=tied)
    if not tied:
        dparams = {**dparams, "lm_head": jax.random.normal(jax.random.PRNGKey(4), (dcfg.hidden_size, dcfg.vocab_size))}
    ids = frequent_tokens(counts, VOCAB)
    small = restrict_vocab(dparams, dcfg, ids)
    assert small["draft_lm_head"].shape == (dcfg.hidden_size, VOCAB) and small["d2t"].tolist() == ids.tolist()
    h = jax.random.normal(jax.random.PRNGKey(5), (3, dcfg.hidden_size))
    full = np.asarray(ModelDrafter(dcfg).logits(dparams, h))
    got = np.asarray(ModelDrafter(dcfg, draft_vocab=VOCAB).logits(small, h))
    np.testing.assert_allclose(got[:, ids], full[:, ids], rtol=1e-5, atol=1e-5)
    outside = np.setdiff1d(np.arange(dcfg.vocab_size), ids)
    assert (got[:, outside] == M.NEG_INF).all()
    with pytest.raises(ValueError, match="token ids must lie in"):
        restrict_vocab(dparams, dcfg, [dcfg.vocab_size])


def test_greedy_output_is_the_targets_and_the_walk_counts_the_engines_calls(pair):
    tparams, dcfg, dparams, counts = pair
    small = restrict_vocab(dparams, dcfg, frequent_tokens(counts, VOCAB))
    drafter = ModelDrafter(dcfg, draft_vocab=VOCAB)
    prompts = _prompts(3)
    ar = generate(tparams, CFG, prompts, max_new_tokens=16)
    sp = generate(tparams, CFG, prompts, max_new_tokens=16,
                  speculative=SpeculativeConfig(drafter=drafter, drafter_params=small, k_max=4))
    answers = [ar.row(b) for b in range(len(prompts))]
    assert [sp.row(b) for b in range(len(prompts))] == answers
    for b, p in enumerate(prompts):  # the exact walk of scripts/acceptance_by_category.py, one row at a time
        one = generate(tparams, CFG, [p], max_new_tokens=16,
                       speculative=SpeculativeConfig(drafter=drafter, drafter_params=small, k_max=4))
        walk = draft_model_chain_calls(dcfg, small, [p], [answers[b]], [4], CFG.pad_token_id, multiple=32)
        assert walk[0][4] == int(one.target_calls[0])


def test_a_draft_vocabulary_costs_less_and_has_its_own_cost_entries(pair):
    _, dcfg, _, _ = pair
    assert step_fraction(dcfg, CFG, draft_vocab=VOCAB) < step_fraction(dcfg, CFG)
    assert ModelDrafter(dcfg, draft_vocab=VOCAB).cost_key != ModelDrafter(dcfg).cost_key


def test_counts_come_from_the_target_preset(pair, tmp_path, monkeypatch):
    _, _, _, counts = pair
    models = tmp_path / "models"
    (models / "tiny").mkdir(parents=True)
    (models / "tiny" / "preset.json").write_text(json.dumps({"name": "tiny", "source": {"type": "path", "path": "x.gguf"},
                                                             "drafters": {"model": "draft"}}))
    (models / "tiny" / "draft").mkdir()  # the shipped draft model: its header is all the checks read
    (models / "tiny" / "draft" / "config.json").write_text(json.dumps(hf_config_dict(pair[1])))
    monkeypatch.setenv("JSPEC_MODELS_DIR", str(models))
    with pytest.raises(DrafterError, match="ships no token_counts.npz: count them with scripts/token_counts.py"):
        token_counts("tiny", CFG)
    np.savez(models / "tiny" / TOKEN_COUNTS_FILE, counts=counts[:10])
    with pytest.raises(DrafterError, match="10 token counts for a vocabulary of 48"):
        token_counts("tiny", CFG)
    np.savez(models / "tiny" / TOKEN_COUNTS_FILE, counts=counts)
    assert (token_counts("tiny", CFG) == counts).all()
    check_drafter_spec("model", "tiny", cfg=CFG, draft_vocab=VOCAB)
    with pytest.raises(DrafterError, match="choose 1 to 48"):
        check_drafter_spec("model", "tiny", cfg=CFG, draft_vocab=49)
    for spec in ("ngram", "eagle3+ngram"):
        with pytest.raises(DrafterError, match="a draft vocabulary is for draft models"):
            build_drafter(spec, CFG, {}, model_name="tiny", draft_vocab=VOCAB)


def test_config_and_method_grammar_reject_what_cannot_run(pair):
    _, dcfg, dparams, _ = pair
    with pytest.raises(ValueError, match="not 'eagle3'"):
        SpeculativeConfig(drafter="eagle3", draft_vocab=8)
    with pytest.raises(ValueError, match="integer >= 1"):
        SpeculativeConfig(drafter="model", draft_vocab=-1)
    with pytest.raises(ValueError, match="drop tree / engine"):
        SpeculativeConfig(drafter="model", engine="pearl", draft_vocab=8)
    with pytest.raises(ValueError, match="built into a drafter object"):
        SpeculativeConfig(drafter=ModelDrafter(dcfg), drafter_params=dparams, draft_vocab=8)
    SpeculativeConfig(drafter=ModelDrafter(dcfg, draft_vocab=8), drafter_params=dparams)  # it carries its own
    spec = parse_method_spec("spec:model:static:k=4:vocab=32768")
    check_method_spec(spec)
    assert spec.draft_vocab == 32768 and spec.name.endswith("vocab=32768")
    assert parse_method_spec("spec:model:static:k=4").draft_vocab == 0
    for text, message in (("spec:ngram:static:vocab=8", "a draft model's chains"),
                          ("spec:model:static:vocab=0", "must be a positive integer")):
        with pytest.raises(MethodSpecError, match=message):
            check_method_spec(parse_method_spec(text))
