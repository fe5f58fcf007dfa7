"""Sampled-sibling trees: children drawn from the head's distribution, verified by recursive rejection.

Under sampling, EAGLE-2's deterministic children (the head's top-k, q = 1) are accepted with
probability p(child): at T = 1 the top child of SmolLM2-135M's EAGLE-3 head carries 0.30 of the
target's mass and the top ten 0.62 (level 1, teacher-forced, training-side chit-chat), while one
child *sampled* from the head's q is accepted with probability 1 - TV(p, q) = 0.55, and ten
sampled without replacement, under recursive rejection, 0.83 (`jspec.bench` has no such row;
these are the offline measurements behind the default weights below).

The rule (Jeon et al.'s recursive rejection sampling without replacement, RRSw). A node's m
children x_1..x_m are drawn from q without replacement (Gumbel-top-k of log q: the k largest
perturbed scores, in order, are sequential draws). Child i is accepted with probability
min(1, p_i(x_i) / q_i(x_i)), where q_i is q without the earlier draws, renormalised, and p_i the
residual left by the earlier rejections, p_{i+1} = norm(max(p_i - q_i, 0)); if all m fail, the
token is drawn from p_{m+1}. Each step is plain speculative sampling against the draw's actual
law, so the emitted token follows p exactly. With q_i's renormalisation folded in, every residual
is one function of a scalar: p_i(y) is proportional to max(p(y) - t_i q(y), 0) on the tokens not
yet drawn (0 on those drawn), with t_1 = 0 and t_{i+1} = t_i + Z_i / (1 - Q_{i-1}), Z_i the
residual's mass and Q_{i-1} the drawn tokens' q mass. Each Z_i is one pass over the vocabulary.
Every node's children see only their own node's p and q, so all nodes' acceptance probabilities
are computed at once, one pass per sibling rank (`sibling_acceptance`); the walk is then integer
work, as in the greedy rule, and one residual sample at the node where it stops.

Lossless only if no sampled node's presence depends on its own value or its subtree's: the
shape is static (`sampled_shape`: the same tree every round, from fixed per-rank acceptance
weights), each node's children are the first m of its sample order, and a node's value never
decides which nodes exist. A drafted EOS still ends its branch (its children are drawn, not
tested). A hybrid's n-gram child at the root (deterministic, q = 1) is tried first: accepted with
probability p(x0); otherwise the head's children run the rule on p without x0.
"""

from __future__ import annotations

import dataclasses
import heapq
from functools import lru_cache
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from ...sampling import Sampling, probs, sample
from ..state import take_row
from .tree import Tree

# [I] Marginal acceptance of a node's i-th sampled child (sample order), the weights the static
# shape is chosen by, per temperature: level-1 RRSw on SmolLM2-135M-Instruct's EAGLE-3 head v8,
# teacher-forced over its own answers (at that temperature) to 24 training-side chit-chat prompts,
# about 2,000 positions each. Cumulative acceptance with 1, 2, 4 and 10 children: 0.66, 0.74, 0.82,
# 0.90 at T = 0.7 (the head's top-k children: 0.53, 0.66, 0.76, 0.86) and 0.55, 0.66, 0.75, 0.83 at
# T = 1 (top-k: 0.30, 0.41, 0.50, 0.62). The shape depends on the ratios more than on the level;
# `TreeConfig.sibling_weights` replaces them.
SIBLING_WEIGHTS = {
    0.7: (0.66, 0.084, 0.045, 0.037, 0.016, 0.014, 0.012, 0.012, 0.011, 0.01),
    1.0: (0.55, 0.11, 0.05, 0.04, 0.025, 0.02, 0.015, 0.012, 0.01, 0.008),
}


def sibling_weights(temperature: float, override: tuple[float, ...] | None = None) -> tuple[float, ...]:
    """The weights a sampled tree's shape is chosen by at this temperature: `override` if given,
    else SIBLING_WEIGHTS' nearest temperature."""
    if override:
        return tuple(override)
    return SIBLING_WEIGHTS[min(SIBLING_WEIGHTS, key=lambda t: abs(t - temperature))]


def shape_value(shape: "SampledShape", weights: Sequence[float]) -> float:
    """Expected accepted draft tokens of `shape` when a node's i-th child passes with probability
    weights[i] given its parent (ranks independent): the sum over nodes of their path's product."""
    reach = [1.0] * len(shape.parent)
    for n in range(1, len(shape.parent)):
        reach[n] = reach[shape.parent[n]] * min(1.0, float(weights[min(shape.rank[n], len(weights) - 1)]))
    return float(sum(reach[1:]))


@dataclasses.dataclass(frozen=True)
class SampledShape:
    """A static tree of N + 1 nodes (node 0: the root), numbered level by level, a node's
    children consecutive in sample order. `expansions` are the nodes whose children the head
    drafts (the root first, then each level's, at most top_k a level); `level_expansions[l]`
    those of level l (l = 0: the root), in node order."""

    parent: tuple[int, ...]
    depth: tuple[int, ...]
    rank: tuple[int, ...]  # a node's place in its parent's sample order (root: 0)
    level_expansions: tuple[tuple[int, ...], ...]
    value: float  # expected accepted draft tokens under the weights (independent ranks)

    @property
    def num_nodes(self) -> int:
        return len(self.parent) - 1

    @property
    def expansions(self) -> tuple[int, ...]:
        return tuple(n for level in self.level_expansions for n in level)

    def children(self, node: int) -> tuple[int, ...]:
        return tuple(c for c in range(1, len(self.parent)) if self.parent[c] == node)

    @property
    def max_children(self) -> int:
        return max(len(self.children(e)) for e in self.expansions)


@lru_cache(maxsize=64)
def sampled_shape(num_nodes: int, depth: int, top_k: int, weights: tuple[float, ...] = SIBLING_WEIGHTS[1.0]) -> SampledShape:
    """The N-node tree of at most `depth` levels that maximises the expected accepted length
    when a node's i-th child is accepted with probability weights[i] given its parent: best-first
    over (parent, rank) slots, a node's value being its path's product of weights. At most top_k
    children per node (len(weights) caps it too) and top_k nodes with children per level (a
    level's head forward runs over a top_k frontier)."""
    if num_nodes < 1 or depth < 1 or top_k < 1:
        raise ValueError(f"a sampled tree needs num_nodes, depth, top_k >= 1, got {num_nodes}, {depth}, {top_k}")
    if not weights or any(not 0.0 < w <= 1.0 for w in weights):
        raise ValueError(f"sibling weights must lie in (0, 1], got {weights}")
    max_rank = min(top_k, len(weights))
    nodes = [(-1, 0, 0, 1.0)]  # (parent, rank, level, value); the root
    expanded = {0: {0}}  # level -> nodes with children
    heap = [(-weights[0], 0, 0)]  # (-value, parent node, rank)
    while heap and len(nodes) <= num_nodes:
        neg, parent, rank = heapq.heappop(heap)
        level = nodes[parent][2] + 1
        if rank == 0 and parent not in expanded.setdefault(level - 1, set()):
            if len(expanded[level - 1]) >= top_k:
                continue  # this level's frontier is full: the parent stays a leaf
            expanded[level - 1].add(parent)
        nodes.append((parent, rank, level, -neg))
        me = len(nodes) - 1
        if rank + 1 < max_rank:
            heapq.heappush(heap, (neg / weights[rank] * weights[rank + 1], parent, rank + 1))
        if level < depth:
            heapq.heappush(heap, (neg * weights[0], me, 0))
    # number level by level; within a level by the parent's new number, then rank
    order = sorted(range(1, len(nodes)), key=lambda i: (nodes[i][2], 0, nodes[i][1]))
    new = {0: 0}
    for level in range(1, depth + 1):
        at = sorted((i for i in order if nodes[i][2] == level), key=lambda i: (new[nodes[i][0]], nodes[i][1]))
        for i in at:
            new[i] = len(new)
    inv = sorted(new, key=new.get)
    parent = tuple(0 if i == 0 else new[nodes[i][0]] for i in inv)
    depth_of = tuple(nodes[i][2] for i in inv)
    rank = tuple(nodes[i][1] for i in inv)
    has_children = set(parent[1:])
    levels = tuple(tuple(n for n in range(len(inv)) if depth_of[n] == lv and n in has_children)
                   for lv in range(max(depth_of)))
    return SampledShape(parent, depth_of, rank, levels, float(sum(v for *_, v in nodes[1:])))


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Siblings:
    """What verification needs of a sampled tree besides the Tree: the head's processed draft
    log-probabilities at each expansion, [B, E, Vd], and each node's index in the draft vocab
    ([B, N+1]; -1 for a deterministic node: the root, an n-gram node)."""

    logq: jax.Array
    draft_index: jax.Array


@dataclasses.dataclass(frozen=True)
class SiblingLayout:
    """Static node bookkeeping of a sampled tree, in the verified tree's numbering (a hybrid's
    n-gram branch shifts the head's nodes): `expansion_node[e]`, and per node its parent's
    expansion (-1: a deterministic child). Hashable: part of the traced program."""

    expansion_node: tuple[int, ...]
    parent_expansion: tuple[int, ...]
    ngram_child: int  # the root's deterministic n-gram child (node 1 of a hybrid), 0 if none

    @property
    def chain_nodes(self) -> int:
        """The deterministic nodes after the root: a hybrid's n-gram chain, nodes 1..M (node i's
        parent is i - 1), whose tests need their parents' target samples."""
        return sum(1 for e in self.parent_expansion[1:] if e < 0)

    def child_table(self) -> np.ndarray:
        """[E, C] node index of each expansion's i-th sampled child (-1 past its last)."""
        kids = [[c for c, e in enumerate(self.parent_expansion) if e == ex] for ex in range(len(self.expansion_node))]
        width = max(1, max(map(len, kids)))
        return np.array([k + [-1] * (width - len(k)) for k in kids], np.int32)

    def node_expansion(self) -> np.ndarray:
        """[N+1] each node's own expansion index (-1: it has no sampled children)."""
        out = np.full(len(self.parent_expansion), -1, np.int32)
        out[list(self.expansion_node)] = np.arange(len(self.expansion_node))
        return out


def layout_of(shape: SampledShape, ngram: int = 0) -> SiblingLayout:
    """The layout of `shape` with an n-gram chain of `ngram` nodes placed first (nodes 1..ngram)."""
    shift = lambda n: 0 if n == 0 else n + ngram  # noqa: E731
    exp = tuple(shift(n) for n in shape.expansions)
    index = {n: e for e, n in enumerate(exp)}
    head_parent = [-1] * (ngram + 1) + [index[shift(shape.parent[n])] for n in range(1, len(shape.parent))]
    return SiblingLayout(exp, tuple(head_parent), 1 if ngram else 0)


def _residual_mass(pd, p_out, q, t):
    """sum_y max(p(y) - t q(y), 0) over the vocabulary: the draft vocab's part and the target mass
    outside it (where q = 0). pd, q [B, E, Vd]; p_out, t [B, E]."""
    return jnp.sum(jnp.maximum(pd - t[..., None] * q, 0.0), axis=-1) + p_out


def sibling_acceptance(pd, p_out, q, px, qx, valid):
    """Per expansion and sibling rank, RRSw's acceptance probability of the i-th child given the
    earlier ones were rejected, and the residual's scale t after the last valid child.

    pd [B, E, Vd]: the target's p at each expansion over the draft vocab, p_out [B, E] its mass
    outside; q [B, E, Vd] the head's q; px, qx [B, E, C]: p and q at each child's token; valid
    [B, E, C] (a prefix per expansion). Returns (a [B, E, C], t [B, E])."""
    B, E, C = px.shape
    t = jnp.zeros((B, E), jnp.float32)
    drawn = jnp.zeros((B, E), jnp.float32)  # q mass of the children drawn so far
    mass = jnp.ones((B, E), jnp.float32)  # Z: the current residual's mass
    accept = []
    for i in range(C):
        ok = valid[..., i]
        a = jnp.maximum(px[..., i] - t * qx[..., i], 0.0) * (1.0 - drawn) / jnp.maximum(mass * qx[..., i], 1e-30)
        accept.append(jnp.where(ok, jnp.minimum(a, 1.0), 0.0))
        t_next = t + mass / jnp.maximum(1.0 - drawn, 1e-30)
        drawn_next = drawn + qx[..., i]
        if i + 1 < C:  # the next child's residual: one pass over the vocabulary
            seen = jnp.sum(jnp.maximum(px[..., : i + 1] - t_next[..., None] * qx[..., : i + 1], 0.0), axis=-1)
            mass_next = jnp.maximum(_residual_mass(pd, p_out, q, t_next) - seen, 0.0)
            mass = jnp.where(ok, mass_next, mass)
        t, drawn = jnp.where(ok, t_next, t), jnp.where(ok, drawn_next, drawn)
    return jnp.stack(accept, -1), t


def rrsw_residual(p, q, t, drawn):
    """The unnormalised law of the token after every child failed: max(p - t q, 0), zero on the
    drawn tokens (in exact arithmetic already zero there). p, q [B, V]; t [B]; drawn [B, V]."""
    residual = jnp.maximum(p - t[:, None] * q, 0.0)
    return jnp.where(drawn, 0.0, residual)


def verify_sampled_tree(key, tree: Tree, logits: jax.Array, sampling: Sampling, max_depth: int, sib: Siblings,
                        layout: SiblingLayout, d2t: jax.Array | None):
    """RRSw over a sampled tree (module doc). logits [B, N+1, V] of the target at every node;
    d2t [Vd] the draft vocab's target ids (None: the head drafts the whole vocabulary). Returns
    (best node [B], n accepted [B], next token [B])."""
    B, N1, V = logits.shape
    k_accept, k_chain, k_residual, k_stop = jax.random.split(key, 4)
    # The target's law is needed only where children were drawn (the expansions), its samples only
    # at the root and a hybrid's n-gram nodes (what their deterministic children are tested
    # against) and where the walk stops, not at every node: a full-vocabulary softmax and sample
    # over all 60 nodes of a 59-node tree were most of this function's time (3-6x on a CPU).
    M = layout.chain_nodes
    exp_node = jnp.asarray(layout.expansion_node)
    p = probs(logits[:, exp_node], sampling)  # [B, E, V]
    chain_sample = sample(k_chain, logits[:, : M + 1], sampling)  # [B, M + 1]: the root's and the n-gram nodes'
    if layout.ngram_child:  # the root's n-gram child is tried first: the head's children see p without it
        x0, ok0 = tree.tokens[:, layout.ngram_child], tree.valid[:, layout.ngram_child]
        p_x0 = jnp.take_along_axis(p[:, 0], x0[:, None], 1)[:, 0]
        root = jnp.where(jax.nn.one_hot(x0, V, dtype=bool), 0.0, p[:, 0]) / jnp.maximum(1.0 - p_x0, 1e-30)[:, None]
        p = p.at[:, 0].set(jnp.where(ok0[:, None], root, p[:, 0]))
    pd = p if d2t is None else p[..., d2t]  # [B, E, Vd]
    p_out = jnp.maximum(1.0 - jnp.sum(pd, -1), 0.0) if d2t is not None else jnp.zeros(pd.shape[:2], pd.dtype)
    q = jnp.exp(sib.logq)
    table = jnp.asarray(layout.child_table())  # [E, C]
    child = jnp.maximum(table, 0)
    cvalid = (table >= 0)[None] & tree.valid[:, child]  # [B, E, C]
    cidx = jnp.maximum(sib.draft_index[:, child], 0)  # [B, E, C]
    px = jnp.take_along_axis(pd, cidx, -1)
    qx = jnp.take_along_axis(q, cidx, -1)
    accept, t_end = sibling_acceptance(pd, p_out, q, px, qx, cvalid)
    # each node's acceptance: sampled children from the table, deterministic ones by their parent's sample
    a_node = jnp.zeros((B, N1), jnp.float32).at[:, child.reshape(-1)].max(
        jnp.where(cvalid, accept, 0.0).reshape(B, -1))
    sampled = jnp.asarray(np.array(layout.parent_expansion) >= 0)
    u = jax.random.uniform(k_accept, (B, N1))
    det_ok = jnp.zeros((B, N1), bool).at[:, 1 : M + 1].set(tree.tokens[:, 1 : M + 1] == chain_sample[:, :M])
    ok = (jnp.where(sampled[None], u < a_node, det_ok) & tree.valid).at[:, 0].set(False)  # the root: nobody's sibling
    # a node is chosen when it passes and no earlier sibling did (children are tried in node order)
    idx = jnp.arange(N1)
    earlier = (tree.parent[:, :, None] == tree.parent[:, None, :]) & (idx[None, None, :] < idx[None, :, None])
    chosen = ok & ~jnp.any(earlier & ok[:, None, :], axis=-1)
    acc = chosen.at[:, 0].set(True)
    for _ in range(max_depth):
        acc = acc & jnp.take_along_axis(acc, tree.parent, 1)
    best = jnp.argmax(jnp.where(acc, tree.depth + 1, 0), axis=1).astype(jnp.int32)
    n = take_row(tree.depth, best)
    # where the walk stops: an expansion whose sampled children all failed draws from its residual
    e_best = jnp.asarray(layout.node_expansion())[best]  # [B]
    has_kids = jnp.take_along_axis(jnp.any(cvalid, -1), jnp.maximum(e_best, 0)[:, None], 1)[:, 0] & (e_best >= 0)
    eb = jnp.maximum(e_best, 0)
    p_b = jnp.take_along_axis(p, eb[:, None, None], 1)[:, 0]  # [B, V]
    q_b = jnp.take_along_axis(q, eb[:, None, None], 1)[:, 0]  # [B, Vd]
    q_full = q_b if d2t is None else jnp.zeros((B, V), q_b.dtype).at[:, d2t].set(q_b)
    t_b = jnp.take_along_axis(t_end, eb[:, None], 1)[:, 0]
    kids = jnp.take_along_axis(tree.tokens[:, child], eb[:, None, None], 1)[:, 0]  # [B, C]
    kid_ok = jnp.take_along_axis(cvalid, eb[:, None, None], 1)[:, 0]
    residual = rrsw_residual(p_b, q_full, t_b, jnp.any(jax.nn.one_hot(kids, V, dtype=bool) & kid_ok[..., None], axis=1))
    usable = has_kids & (jnp.sum(residual, -1) > 0)
    from_residual = jax.random.categorical(k_residual, jnp.log(jnp.where(usable[:, None], residual, 1.0)), axis=-1)
    # otherwise the stopping node's own sample: an n-gram node's is the one its child failed against
    stop_logits = take_row(logits, best)
    own = jnp.where(best <= M, take_row(chain_sample, jnp.minimum(best, M)), sample(k_stop, stop_logits, sampling))
    nxt = jnp.where(usable, from_residual, own).astype(jnp.int32)
    return best, n, nxt
