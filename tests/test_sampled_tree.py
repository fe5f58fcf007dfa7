"""Sampled-sibling trees (jspec.speculative.verify.sampled_tree): the rule's exact law, the static
shape, and generation through the tree engine.

The law test enumerates every ordered draw of m children without replacement from q, takes each
child's acceptance probability from `sibling_acceptance` and the final residual from
`rrsw_residual`, and sums the emitted token's law: it must be p to float precision, for draft
vocabularies that cover the target's and for ones that do not (the mass outside, where q = 0).
A chi-square test of whole generations against the target's law, with mutants, is in
test_lossless_sampling.py.
"""

from __future__ import annotations

import itertools
import inspect
import textwrap

import jax.numpy as jnp
import numpy as np
import pytest

from jspec.generate import SpeculativeConfig, generate
from jspec.sampling import Sampling
from jspec.speculative.engines.tree import TreeConfig
from jspec.speculative.policies import make_policy
from jspec.speculative.verify import sampled_tree as S
from spec_tiny import CFG, _drafters, _prompts, make_target


def exact_law(p, q_draft, d2t, m, accept_fn=S.sibling_acceptance):
    """The emitted token's law [V] after trying m children drawn from q (over the draft vocab,
    whose ids are d2t) without replacement, by enumeration."""
    V, Vd = len(p), len(q_draft)
    pd, p_out = p[d2t], 1.0 - p[d2t].sum()
    q_full = np.zeros(V)
    q_full[d2t] = q_draft
    draws = list(itertools.permutations(range(Vd), m))
    weight = np.ones(len(draws))
    for i in range(m):
        before = np.array([q_draft[list(d[:i])].sum() for d in draws])
        weight *= np.array([q_draft[d[i]] for d in draws]) / (1.0 - before)
    idx = np.array(draws)  # [B, m] draft ids
    B = len(draws)
    one = lambda x: jnp.asarray(np.broadcast_to(x, (B, 1) + np.shape(x)), jnp.float32)  # noqa: E731
    a, t = accept_fn(one(pd), one(p_out), one(q_draft), jnp.asarray(pd[idx][:, None], jnp.float32),
                     jnp.asarray(q_draft[idx][:, None], jnp.float32), jnp.ones((B, 1, m), bool))
    a, t = np.asarray(a, np.float64)[:, 0], np.asarray(t, np.float64)[:, 0]
    drawn = np.zeros((B, V), bool)
    drawn[np.arange(B)[:, None], d2t[idx]] = True
    residual = np.asarray(S.rrsw_residual(jnp.asarray(np.broadcast_to(p, (B, V)), jnp.float32),
                                          jnp.asarray(np.broadcast_to(q_full, (B, V)), jnp.float32),
                                          jnp.asarray(t, jnp.float32), jnp.asarray(drawn)), np.float64)
    law = np.zeros(V)
    for b in range(B):
        reach = 1.0
        for i in range(m):
            law[d2t[idx[b, i]]] += weight[b] * reach * a[b, i]
            reach *= 1.0 - a[b, i]
        if reach > 1e-9:  # some child was certain to pass: no residual (then it may be all zero)
            law += weight[b] * reach * residual[b] / residual[b].sum()
    return law


@pytest.mark.parametrize("m", [1, 2, 3])
@pytest.mark.parametrize("reduced", [False, True])
def test_recursive_rejection_emits_the_target_law(m, reduced):
    rng = np.random.default_rng(m + 10 * reduced)
    V = 7
    d2t = np.array([0, 2, 3, 5, 6]) if reduced else np.arange(V)
    for _ in range(3):
        p = rng.dirichlet(np.full(V, 0.7))
        q = rng.dirichlet(np.full(len(d2t), 0.7))
        np.testing.assert_allclose(exact_law(p, q, d2t, m), p, atol=2e-6)


def _mutant(fn, old, new):
    src = textwrap.dedent(inspect.getsource(fn))
    assert src.count(old) == 1
    namespace = dict(fn.__globals__)
    exec(compile(src.replace(old, new), "<mutant>", "exec"), namespace)
    return namespace[fn.__name__]


@pytest.mark.parametrize("old, new", [
    # a later draw's q not renormalised for the earlier draws
    ("* (1.0 - drawn) / jnp.maximum(mass * qx[..., i], 1e-30)", "/ jnp.maximum(mass * qx[..., i], 1e-30)"),
    # the residual's scale t not moved past a rejected child
    ("t_next = t + mass / jnp.maximum(1.0 - drawn, 1e-30)", "t_next = t + 1.0"),
    # the residual's mass measured at the old scale t
    ("mass_next = jnp.maximum(_residual_mass(pd, p_out, q, t_next) - seen, 0.0)",
     "mass_next = jnp.maximum(_residual_mass(pd, p_out, q, t) - seen, 0.0)"),
])
def test_the_exact_law_rejects_a_wrong_rule(old, new):
    rng = np.random.default_rng(3)  # flat laws: no single token dominates every residual
    p, q = rng.dirichlet(np.full(6, 3.0)), rng.dirichlet(np.full(6, 3.0))
    bad = exact_law(p, q, np.arange(6), 4, _mutant(S.sibling_acceptance, old, new))
    assert not np.allclose(bad, p, atol=1e-5)  # the shipped rule is within 2e-6; a NaN (no residual left where one is needed) fails too


def test_the_shape_is_static_closed_and_within_its_budget():
    for n, depth, k in [(59, 6, 10), (31, 5, 8), (10, 3, 3), (7, 7, 1)]:
        shape = S.sampled_shape(n, depth, k)
        assert shape.num_nodes == min(n, depth) if k == 1 else shape.num_nodes == n
        assert max(shape.depth) <= depth
        assert all(shape.parent[c] < c and shape.depth[c] == shape.depth[shape.parent[c]] + 1
                   for c in range(1, len(shape.parent)))
        assert all(len(level) <= k for level in shape.level_expansions)
        assert shape.max_children <= k
        for e in shape.expansions:  # children numbered consecutively in sample order
            kids = shape.children(e)
            assert [shape.rank[c] for c in kids] == list(range(len(kids)))
            assert list(kids) == list(range(kids[0], kids[0] + len(kids)))
    deep = S.sampled_shape(59, 6, 10)
    assert deep.value > S.sampled_shape(15, 6, 10).value  # more nodes, more expected tokens


def test_layout_places_an_ngram_branch_first():
    shape = S.sampled_shape(10, 3, 3)
    layout = S.layout_of(shape, ngram=3)
    assert layout.ngram_child == 1 and layout.expansion_node[0] == 0
    assert layout.parent_expansion[:4] == (-1, -1, -1, -1)  # the root and the n-gram chain
    table = layout.child_table()
    assert sorted(c for c in table.ravel() if c >= 0) == list(range(4, 4 + shape.num_nodes))


def test_sampled_trees_run_where_the_policy_keeps_trees_whole():
    tree = TreeConfig(top_k=3, depth=3, num_nodes=10)
    assert tree.sampled_siblings(Sampling(temperature=1.0), make_policy("static"))
    assert not tree.sampled_siblings(Sampling(), make_policy("static"))
    assert not tree.sampled_siblings(Sampling(temperature=1.0), make_policy("svip"))
    with pytest.raises(ValueError, match="cuts trees"):
        TreeConfig(siblings="sampled").sampled_siblings(Sampling(temperature=1.0), make_policy("svip"))
    target = make_target()
    drafter, dparams = _drafters(target)["eagle3"]
    res = generate(target, CFG, _prompts(1, 2), max_new_tokens=12, sampling=Sampling(temperature=1.0), seed=1,
                   speculative=SpeculativeConfig(drafter=drafter, drafter_params=dparams, tree=tree))
    assert (res.lengths > 0).all() and (res.target_calls < res.lengths + 1).all()
    assert (res.accepted <= res.drafted).all()
