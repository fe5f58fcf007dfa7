"""Invariant generation (generate(invariant=True), ModelConfig.fixed_block): decode steps and chain
verify blocks run as blocks of one shape, so greedy speculative output equals AR's bit for bit in
bfloat16, where one-token and many-token forwards otherwise round apart."""

import jax.numpy as jnp
import numpy as np
import pytest

from jspec import model as M
from jspec.cli import main
from jspec.errors import UsageError
from jspec.generate import INVARIANT_BLOCK, SpeculativeConfig, check_fixed_block, generate
from jspec.presets import resolve_model
from jspec.tokenizer import apply_chat

PRESET = "smollm2-135m-instruct"
QUESTIONS = (
    "Give me three tips for better sleep.",
    "Write a short poem about the ocean.",
    "Explain what a hash table is.",
    "Write a Python function that reverses a string.",
)


@pytest.fixture(scope="module")
def bf16_target():
    return resolve_model(PRESET, dtype=jnp.bfloat16)


def _logits_alone_and_in_a_block(params, cfg, tokens, prompt_len=24):
    """The target's logits for tokens[0..4], fed one by one (decode steps) and as one block (a
    verify), after the same prompt: ([5, V], [5, V]) float32."""
    rng = np.random.RandomState(0)
    cache = M.init_cache(cfg, 1, 128, jnp.bfloat16)
    out = M.forward(params, cfg, jnp.asarray(rng.randint(100, 5000, (1, prompt_len))), cache)
    cache = out.cache.replace(lengths=jnp.array([prompt_len], jnp.int32))
    alone, c = [], cache
    for t in tokens:
        o = M.forward(params, cfg, jnp.asarray([[t]]), c)
        alone.append(np.asarray(M.lm_head(params, cfg, o.hidden[:, 0])[0], np.float32))
        c = M.advance(o.cache, jnp.array([1], jnp.int32))
    o = M.forward(params, cfg, jnp.asarray([tokens]), cache)
    return np.stack(alone), np.asarray(M.lm_head(params, cfg, o.hidden)[0], np.float32)


@pytest.mark.slow
def test_fixed_blocks_give_decode_and_verify_the_same_bits(bf16_target):
    cfg, params, _ = bf16_target
    tokens = [812, 4402, 97, 1530, 2203]
    alone, block = _logits_alone_and_in_a_block(params, cfg, tokens)
    assert np.abs(alone - block).max() > 0  # the premise: in bf16 the two shapes round apart
    alone, block = _logits_alone_and_in_a_block(params, cfg.replace(fixed_block=INVARIANT_BLOCK), tokens)
    np.testing.assert_array_equal(alone, block)


@pytest.mark.slow
def test_invariant_greedy_chains_equal_ar_in_bf16(bf16_target):
    """With continuous batching (2 rows in flight over 4 prompts) and a dynamic stop rule (SVIP),
    whose drafts vary in length round by round: every output is AR's, token for token."""
    cfg, params, tok = bf16_target
    prompts = [apply_chat(tok, q) for q in QUESTIONS]
    ar = generate(params, cfg, prompts, max_new_tokens=40, invariant=True, batch_size=2)
    sp = generate(params, cfg, prompts, max_new_tokens=40, invariant=True, batch_size=2,
                  speculative=SpeculativeConfig(drafter="eagle3", k_max=6, policy="svip"))
    assert [sp.row(i) for i in range(len(prompts))] == [ar.row(i) for i in range(len(prompts))]
    assert (sp.lengths / sp.target_calls).mean() > 1.5  # it did speculate


def test_invariant_checks_are_one_line_and_early():
    tree = SpeculativeConfig(drafter="eagle3", tree=True)
    with pytest.raises(UsageError, match="not trees"):
        check_fixed_block(INVARIANT_BLOCK, tree, None, None)
    with pytest.raises(UsageError, match="at most k_max 15 drafts, got k_max 16"):
        check_fixed_block(INVARIANT_BLOCK, SpeculativeConfig(drafter="ngram", k_max=16), None, None)
    with pytest.raises(UsageError, match="tail_rows 2"):
        check_fixed_block(INVARIANT_BLOCK, None, None, 2)
    with pytest.raises(UsageError, match="one device"):
        check_fixed_block(INVARIANT_BLOCK, None, "data=2", None)
    check_fixed_block(INVARIANT_BLOCK, SpeculativeConfig(drafter="ngram", k_max=15), None, 0)


def test_cli_refuses_an_invariant_tree_before_loading(capsys):
    rc = main(["generate", "--model", "no-such-model", "--invariant", "--drafter", "eagle3", "--tree", "Hi"])
    assert rc != 0
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "invariant generation covers AR and speculative chains, not trees" in err[0]


def test_fixed_block_is_not_saved_with_the_model():
    cfg = M.ModelConfig(arch="llama", vocab_size=64, hidden_size=16, intermediate_size=32, num_layers=1,
                        num_heads=2, num_kv_heads=1, head_dim=8)
    assert "fixed_block" not in cfg.replace(fixed_block=16).to_dict()
    assert cfg.replace(fixed_block=16) != cfg  # a program of its own


def test_bench_invariant_rows_and_early_refusal(tmp_path, monkeypatch):
    """`jspec bench --invariant` on a tiny bf16 model: its rows say fixed_block and reproduce with
    the flag, its chain equals AR; a tree method is refused before the model loads."""
    import argparse

    import jax

    from jspec.bench import cli
    from jspec.bench.report import group_tables
    from test_bench import CharTokenizer

    cfg = M.ModelConfig(arch="llama", vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=1,
                        num_heads=2, num_kv_heads=1, head_dim=16, max_position_embeddings=128, eos_token_ids=(3,))
    params = M.init_params(cfg, jax.random.PRNGKey(0), dtype=jnp.bfloat16, scale=0.35)
    loads = []
    monkeypatch.setattr(cli, "resolve_model", lambda name: loads.append(name) or (cfg, params, CharTokenizer()))
    monkeypatch.chdir(tmp_path)
    args = ["--model", "tiny", "--tasks", "mt_bench", "--n-prompts", "3", "--max-new-tokens", "8", "--batch", "1",
            "--dtype", "bfloat16", "--no-plots", "--min-timed-s", "0", "--invariant"]
    rows = cli.run_bench(cli.add_bench_args(argparse.ArgumentParser()).parse_args(args + ["--methods", "ar,spec:ngram:static"]))
    assert [r["fixed_block"] for r in rows] == [INVARIANT_BLOCK] * 2
    assert rows[1]["greedy_identical_to_ar"] == 1.0 and "--invariant" in rows[0]["reproduce"]
    plain = {k: v for k, v in rows[0].items() if k != "fixed_block"} | {"timestamp": rows[0]["timestamp"] + "z"}
    table = group_tables([rows[0], plain])  # a later plain AR row does not replace the invariant one
    assert table.count("| `ar` (invariant) |") == 1 and table.count("| `ar` |") == 1
    loads.clear()
    with pytest.raises(UsageError, match="--invariant runs jspec's ar and chain methods on one device, not spec:eagle3:static:tree"):
        cli.run_bench(cli.add_bench_args(argparse.ArgumentParser()).parse_args(args + ["--methods", "ar,spec:eagle3:static:tree"]))
    assert not loads
