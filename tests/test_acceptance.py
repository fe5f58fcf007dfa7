"""The offline chain-acceptance walk (jspec.bench.acceptance) counts exactly the chain engine's
target calls, for several K, from one teacher-forced pass."""

import jax
import pytest

from jspec import model as M
from jspec.bench.acceptance import chain_calls, draft_model_chain_calls, walk
from jspec.generate import SpeculativeConfig, generate
from test_spec import CFG, _drafters, _prompts


def test_walk_counts_rounds():
    labels = [0, 3, 0, 0, 5, 5, 5, 5, 5, 5]
    assert walk(labels, 1, 10, 0) == (9, 9)  # AR: one token per call
    tokens, calls = walk(labels, 1, 10, 8)
    assert tokens == 9 and calls < 9


@pytest.mark.parametrize("kind,ks", [("eagle3", (3,)), ("model", (2, 4))])
def test_walk_matches_the_chain_engine(kind, ks):
    target = M.init_params(CFG, jax.random.PRNGKey(0), scale=0.35)
    drafter, dparams = _drafters(target)[kind]
    prompts = _prompts(5, batch=4)
    ar = generate(target, CFG, prompts, max_new_tokens=24)
    answers = [ar.row(b) for b in range(len(prompts))]
    if kind == "model":  # an independent draft model: its argmax on the true prefix
        counted = draft_model_chain_calls(drafter.cfg, dparams, prompts, answers, list(ks), pad_id=0, multiple=8)
    else:
        counted = chain_calls(drafter.head, dparams, target, prompts, answers, list(ks), pad_id=0, multiple=8)
    if kind == "model":  # the tiny draft model agrees with the target often enough to be checked on accepted runs
        assert any(c[max(ks)] < len(a) for c, a in zip(counted, answers))
    for k in ks:
        sp = generate(target, CFG, prompts, max_new_tokens=24,
                      speculative=SpeculativeConfig(drafter=drafter, drafter_params=dparams, k_max=k))
        assert [sp.row(b) for b in range(len(prompts))] == answers
        assert [c[k] for c in counted] == [int(n) for n in sp.target_calls], k
