"""EAGLE-2 context-aware dynamic draft trees with static shapes, verified in one target call.

Per round and per row (docs/methods.md §2.3), all inside `jit`:
  1. Level 1: the head's distribution after the last token gives the top_k first tokens, scored
     by log q. Each further level feeds the whole top_k frontier through the head in ONE batched
     call (tree attention over the committed cache plus the frontier's ancestors), expands every
     frontier node into its top_k children scored by cumulative log q, records all k^2 of them as
     candidates and keeps the global top_k as the next frontier.
  2. Reranking keeps the `num_nodes` best candidates (a tiny per-level penalty makes a child
     always rank below its parent, so the kept set is closed under parents); sorting the kept
     candidate indices puts parents before children.
  3. The tree is fixed-shape arrays: tokens [B, N+1] (node 0 = the last emitted token, the root),
     parent [B, N+1], depth [B, N+1], ancestor-or-self mask [B, N+1, N+1].
  4. The target runs once over the N+1 nodes with the ancestor mask at positions cursor + depth.
  5. Greedy: deepest node whose whole path matches the target's argmax (ties: lowest index).
     Sampling: EAGLE-2's rule for deterministic top-k children (q = 1), which accepts child y with
     probability p(y) and samples the residual otherwise: one target sample per node, the
     deepest path whose tokens equal their parents' samples (verify.tree). Exactly lossless.
  6. The accepted path's K/V move to contiguous slots (`model.commit`), and the head re-reads the
     path with the target's true features.

A dynamic policy can cut the tree per row (`Policy.cuts_trees`): its round limit caps the depth,
and its stop rule, applied to the best frontier node's distribution after each level, stops deeper
levels (a rule checked before drafting, AdaEDL, also drops the level it stopped at). A drafted EOS
ends its branch: nodes below it are not verified. A cut saves work, with static shapes throughout:
  * reranking keeps only nodes within their row's depth cap (a deeper candidate ranks below every
    kept one), so the kept nodes fill the front of the node order;
  * verification: the target reads the smallest of a few compiled block sizes
    (`TreeConfig.verify_sizes` below num_nodes, then num_nodes) that holds every row's last valid
    node, picked per round by `lax.switch`;
  * levels (`TreeConfig.skip_levels`; by default on TPU and CPU, off on GPUs): each level runs
    inside a `lax.cond` and is skipped once every row's depth cap is above it.
Every data-dependent branch costs: on GPUs XLA reads its predicate back to the host and waits for
it. On an H200 at batch 1 with SmolLM2-135M, the same 59-node trees took 270-294 µs more per round
(of ~1.55 ms) with the five level conds and the verify switch than without them, about 45 µs a
branch, while a level costs 74 µs and is rarely skipped by every row. So on GPUs levels are
skipped only where the user turns it on (a level costing several branches: big heads, large
batches); on TPUs, whose control flow runs on the device without a host round trip, by default. A policy
whose cuts cannot pay (static; `auto`, whose plan already sized the tree for this batch and card)
compiles none of this: its rounds are the static tree's program. Compiling a cutting tree with its
branches on the device instead (the chain engine's DEVICE_LOOPS, with level skipping) was timed on
an H200 and did not help: 0.85-0.87x the static tree, against 0.86-0.90x without (BENCHMARKS.md
at commit b3813a1, eleventh run).

Hybrid drafters (drafters.hybrid) may look up first (`TreeConfig.lookup_first`): one `lax.cond` a
round runs either the n-gram branch alone (a block of ngram + 1, no head levels) when every row's
match reached that n-gram order, or the whole hybrid tree. Both end in the same commit. The
branch costs one predicate read a round on GPUs; a lookup round saves the head's levels and most
of the verify block (docs/methods.md §2.8 has the measured gain).
"""

from __future__ import annotations

import dataclasses
import functools
import time

import jax
import jax.numpy as jnp
import numpy as np

from ... import model as M
from ...decode import GenerationResult, emit, is_eos
from ...heads import eagle as H
from ...kernels.top_k import top_k
from ...refill import run_queue, run_rows
from ..drafters.eagle import EagleDrafter
from ..drafters.hybrid import MAX_NGRAM_BRANCH, HybridDrafter
from ..policies import resolve_policy
from ..state import SpecState, accepted_emitted, cut_spec_at_budgets, outputs_of, record_call, result_from_device, round_features, take_row
from ...sampling import logprobs
from ..verify.sampled_tree import (SampledShape, Siblings, layout_of, sampled_shape, sibling_weights,
                                   verify_sampled_tree)
from ..verify.tree import Tree, path_of, verify_tree_greedy, verify_tree_sampling
from .chain import check_compatible, start_spec, start_spec_jit


SIBLING_RULES = ("auto", "top_k", "sampled")


@dataclasses.dataclass(frozen=True)
class TreeConfig:
    """Static tree budget. EAGLE-2 defaults: top_k 10, depth 6, total_tokens 60 (59 draft nodes)."""

    top_k: int = 10
    depth: int = 6  # draft levels
    num_nodes: int = 59  # draft nodes kept (EAGLE's total_token - 1)
    # smaller verify blocks (draft nodes) compiled for rounds a dynamic policy cut; those below num_nodes are used
    verify_sizes: tuple[int, ...] = (15, 31)
    # hybrid drafters (drafters.hybrid): nodes of the n-gram branch beside the head's tree, up to
    # MAX_NGRAM_BRANCH, deeper than the head's levels if need be (`path_depth`)
    ngram: int = 0
    # [I] hybrid drafters: a round in which every row's n-gram match is at least this long (the
    # n-gram order, `NgramDrafter.propose_ordered`) verifies the n-gram branch alone and skips the
    # head's tree ("lookup first"); 0: never. One lax.cond a round picks the program (module doc).
    lookup_first: int = 0
    # cutting policies: run each level under a lax.cond, skipped once no row keeps it. None: where
    # branches are decided on the device (TPU, CPU) but not on GPUs, where XLA reads each predicate
    # back to the host (module doc: ~45 µs a branch on an H200, against 74 µs a level)
    skip_levels: bool | None = None
    # under sampling, how a node's children are drafted: "top_k" (EAGLE-2's deterministic children,
    # q = 1), "sampled" (drawn from the head's q without replacement on a static shape, verified by
    # recursive rejection: verify.sampled_tree), or "auto": sampled whenever the policy keeps trees
    # whole (sampled trees have no per-row cuts), top_k otherwise. Greedy decoding always drafts top_k.
    siblings: str = "auto"
    # [I] sampled trees: the marginal acceptance of a node's i-th sampled child, which the static
    # shape is chosen by (verify.sampled_tree.sampled_shape); None: SIBLING_WEIGHTS at the temperature
    sibling_weights: tuple[float, ...] | None = None

    @property
    def skips_levels(self) -> bool:
        """`skip_levels` resolved for the backend the program is traced for."""
        return jax.default_backend() != "gpu" if self.skip_levels is None else self.skip_levels

    def __post_init__(self):
        cands = self.top_k + (self.depth - 1) * self.top_k**2
        if not 1 <= self.num_nodes <= cands:
            raise ValueError(f"num_nodes must be in [1, {cands}] for top_k={self.top_k}, depth={self.depth}")
        if any(not isinstance(n, int) or n < 1 for n in self.verify_sizes):
            raise ValueError(f"verify_sizes must be positive node counts, got {self.verify_sizes}")
        if not 0 <= self.ngram <= MAX_NGRAM_BRANCH:
            raise ValueError(f"ngram (the n-gram branch's nodes) must be in [0, {MAX_NGRAM_BRANCH}], got {self.ngram}")
        if self.siblings not in SIBLING_RULES:
            raise ValueError(f"siblings={self.siblings!r}: choose from {', '.join(SIBLING_RULES)}")
        if self.lookup_first < 0:
            raise ValueError(f"lookup_first (the n-gram order that skips the head's tree) must be >= 0, got {self.lookup_first}")

    def sampled_siblings(self, sampling, policy) -> bool:
        """Whether this tree's children are sampled (`siblings`) under this sampling and policy."""
        if sampling.greedy or self.siblings == "top_k":
            return False
        if policy.cuts_trees:
            if self.siblings == "sampled":
                raise ValueError(f"policy {policy.name!r} cuts trees per row, which sampled siblings cannot take "
                                 "(a node's presence may not depend on its value): use siblings='top_k' or 'auto'")
            return False
        return True

    def sibling_shape(self, temperature: float) -> SampledShape:
        """The static shape of this tree's sampled form at this temperature."""
        return sampled_shape(self.num_nodes, self.depth, self.top_k, sibling_weights(temperature, self.sibling_weights))

    @property
    def total_nodes(self) -> int:
        """Draft nodes the target verifies at most: the head's kept nodes and the n-gram branch."""
        return self.num_nodes + self.ngram

    @property
    def path_depth(self) -> int:
        """The deepest draft node: the head's depth or a longer n-gram branch's. A round's verified
        path and its emitted tokens hold path_depth + 1 entries."""
        return max(self.depth, self.ngram)

    def block_sizes(self, prunes: bool) -> tuple[int, ...]:
        """Draft-node counts the verify block is compiled for, ascending, the full tree last:
        only the full tree unless a dynamic policy can cut it."""
        full = self.total_nodes
        return tuple(sorted({n for n in self.verify_sizes if n < full})) + (full,) if prunes else (full,)

    @property
    def max_nodes(self) -> int:
        """Candidates a tree of this top_k and depth records: the largest valid num_nodes."""
        return self.top_k + (self.depth - 1) * self.top_k**2

    @property
    def cache_slots(self) -> int:
        """Cache slots past the cursor one round may write, in the target's cache and the head's:
        the target's total_nodes + 1 tree tokens, and the head's re-read of the accepted path
        (path_depth + 1 pairs). Drafting the tree needs no head slots (the einsum path keeps the
        levels' K/V in a pending buffer; the fused kernel writes them past the cursor as scratch,
        drops what falls past the cache end and still attends to it), so nothing grows with
        (depth - 1) * top_k. `generate` reserves this many."""
        return max(self.total_nodes, self.path_depth) + 1


def _children(hcfg: H.HeadConfig, dparams, logits, k: int):
    """Top-k children of each node from the head's draft-vocab logits [.., Vd]: (log q [.., k],
    target ids [.., k]). The top-k runs in the draft vocabulary and only the chosen ids go through
    d2t (d2t is sorted, so ties break towards the lower target id, as over the scattered logits)."""
    if not hcfg.reduced_vocab or hcfg.draft_vocab < k:
        full = H.gather_target_vocab(logits, H.target_index(hcfg, dparams))
        return top_k(jax.nn.log_softmax(full, axis=-1), k)
    score, idx = top_k(logits, k)
    return score - jax.nn.logsumexp(logits, axis=-1, keepdims=True), dparams["d2t"][idx]


def _ancestors(parent: jax.Array, max_depth: int) -> jax.Array:
    """Ancestor-or-self mask [B, N, N] of a tree with depth <= max_depth (root = its own parent):
    the chain of parent hops is tiny [B, N, D+1] integer work; the mask is one compare."""
    hops = [jnp.broadcast_to(jnp.arange(parent.shape[1], dtype=parent.dtype), parent.shape)]
    for _ in range(max_depth):
        hops.append(jnp.take_along_axis(parent, hops[-1], axis=1))
    hops = jnp.stack(hops, -1)  # [B, N, D+1]
    return jnp.any(hops[:, :, :, None] == jnp.arange(parent.shape[1], dtype=parent.dtype)[None, None, None], axis=2)


def build_tree(drafter: EagleDrafter, dparams, tparams, tcfg, dstate, last, tc: TreeConfig, policy, pstate, limit):
    """Draft one EAGLE-2 tree per row. Returns (Tree, pstate); `draft_tree` also returns the
    drafter state whose head cache the levels wrote scratch slots of."""
    tree, pstate, _ = draft_tree(drafter, dparams, tparams, tcfg, dstate, last, tc, policy, pstate, limit)
    return tree, pstate


def draft_tree(drafter: EagleDrafter, dparams, tparams, tcfg, dstate, last, tc: TreeConfig, policy, pstate, limit):
    """Draft one EAGLE-2 tree per row. Returns (Tree, pstate, dstate).

    Each level is one `heads.eagle.head_tree_level` over the top_k frontier: it attends to the
    committed head cache, to the earlier levels' frontier nodes it descends from (a pending buffer
    under each node's ancestor mask) and to itself. The committed slots are only read; with the
    fused kernel a level also writes its block's K/V past the cursor (scratch), so the returned
    dstate carries that cache forward for the commit to overwrite in place (passing the old one on
    would make XLA copy the cache for the kernel). After verification the head re-reads the
    accepted path with exact features."""
    B = last.shape[0]
    k, D = tc.top_k, tc.depth
    hcfg = drafter.head
    cache, base = dstate.cache, dstate.cache.lengths
    # all levels run the same attention path; the last (largest) runs the D - 2 earlier frontiers
    # and its own as one fused block
    fused = H.fused_head_attention(hcfg, (D - 1) * k, drafter.kernels)
    prunes = policy.cuts_trees  # smaller verify blocks per round, and skippable levels where skip_levels asks
    # Policies see draft-vocab logits (entropies and top probabilities are the same as over the
    # target vocab); one that reads the drafted token's id (LDLP-DDD) gets target-vocab logits.
    index = H.target_index(hcfg, dparams) if policy.needs_in_round_state else None
    policy_logits = lambda lg: H.gather_target_vocab(lg, index) if index is not None else lg  # noqa: E731
    score, tok = _children(hcfg, dparams, dstate.logits, k)  # [B, k]
    pstate, stop = policy.observe(pstate, jnp.int32(0), policy_logits(dstate.logits), tok[:, 0])
    depth_cap = jnp.where(stop, 1, limit)  # levels this row may keep
    cand_tok, cand_score, cand_parent, cand_level = [tok], [score], [jnp.full((B, k), -1)], [jnp.ones((B, k), jnp.int32)]
    frontier = jnp.broadcast_to(jnp.arange(k), (B, k))  # candidate index of each frontier node
    f_tok, f_score = tok, score
    f_feat = jnp.broadcast_to(dstate.feature[:, None], (B, k, dstate.feature.shape[-1]))
    pending = None  # the earlier levels' frontier nodes, in the layout head_tree_level returns
    f_anc = jnp.zeros((B, k, 0), bool)  # which pending entries each frontier node sees (its ancestors)
    own = jnp.broadcast_to(jnp.eye(k, dtype=bool), (B, k, k))
    n_cand = k
    depth_cap = depth_cap.astype(jnp.int32)
    for level in range(2, D + 1):
        positions = jnp.broadcast_to(base[:, None] + (level - 2), (B, k))

        def run_level(ops, level=level, positions=positions):
            f_tok, f_feat, cache, pending, f_anc, pstate, depth_cap = ops
            h, logits, entries, cache = H.head_tree_level(hcfg, dparams, tparams, f_tok, f_feat, cache, positions,
                                                          pending, f_anc, fused=fused)
            c_score, c_tok = _children(hcfg, dparams, logits, k)  # [B, k, k]
            pstate, stop = policy.observe(pstate, jnp.int32(level - 1), policy_logits(logits[:, 0]), c_tok[:, 0, 0])
            # A rule checked before drafting (AdaEDL) stops without this level; the others keep it.
            kept = level - (stop & policy.stop_skips_token(pstate)).astype(jnp.int32)
            depth_cap = jnp.where(stop & (depth_cap >= level), kept, depth_cap).astype(jnp.int32)
            return h, c_score, c_tok, entries, cache, pstate, depth_cap

        ops = (f_tok, f_feat, cache, pending, f_anc, pstate, depth_cap)
        if prunes and tc.skips_levels:  # no row keeps this level: skip its head forward (its candidates are masked below)
            shapes = jax.eval_shape(run_level, ops)[:4]
            skip = lambda ops, shapes=shapes: (*jax.tree_util.tree_map(lambda x: jnp.zeros(x.shape, x.dtype), shapes),  # noqa: E731
                                               *ops[2:3], *ops[5:])
            h, c_score, c_tok, entries, cache, pstate, depth_cap = jax.lax.cond(jnp.any(depth_cap >= level), run_level, skip, ops)
        else:
            h, c_score, c_tok, entries, cache, pstate, depth_cap = run_level(ops)
        cum = (f_score[:, :, None] + c_score).reshape(B, k * k)
        parent_of = jnp.repeat(frontier, k, axis=1)  # [B, k*k]
        cand_tok.append(c_tok.reshape(B, k * k))
        cand_score.append(cum)
        cand_parent.append(parent_of)
        cand_level.append(jnp.full((B, k * k), level, jnp.int32))
        if level == D:
            break
        # next frontier: global top-k of the k^2 children; a child sees its parent's view plus the parent
        f_score, pick = top_k(cum, k)
        src = pick // k  # which frontier node is the parent
        f_tok = jnp.take_along_axis(c_tok.reshape(B, k * k), pick, axis=1)
        f_feat = jnp.take_along_axis(h, src[:, :, None], axis=1)
        f_anc = jnp.take_along_axis(jnp.concatenate([f_anc, own], axis=2), src[:, :, None], axis=1)
        pending = entries if pending is None else tuple(jnp.concatenate(ab, axis=1) for ab in zip(pending, entries))
        frontier = n_cand + pick
        n_cand += k * k

    tokens = jnp.concatenate(cand_tok, 1)
    level = jnp.concatenate(cand_level, 1)
    # Rank below every ancestor (scores are cumulative log-probs, so ties with a parent are possible);
    # a candidate below its row's depth cap ranks below every one within it (the kept valid nodes
    # are then a prefix of the node order, since candidates are numbered level by level)
    score = jnp.concatenate(cand_score, 1) - 1e-4 * level
    score = jnp.where(level <= depth_cap[:, None], score, -1e9 * level.astype(score.dtype))
    parent_cand = jnp.concatenate(cand_parent, 1)
    _, keep = top_k(score, tc.num_nodes)
    keep = jnp.sort(keep, axis=1)  # parents precede children
    node_tok = jnp.take_along_axis(tokens, keep, 1)
    node_level = jnp.take_along_axis(level, keep, 1)
    node_pc = jnp.take_along_axis(parent_cand, keep, 1)
    # parent candidate index -> node index (1-based; root = 0): its rank among the kept (one compare)
    pos = jnp.sum(keep[:, None, :] < node_pc[:, :, None], axis=-1)
    node_parent = jnp.where(node_pc < 0, 0, pos + 1)
    tree_tok = jnp.concatenate([last[:, None], node_tok], 1)
    parent = jnp.concatenate([jnp.zeros((B, 1), jnp.int32), node_parent.astype(jnp.int32)], 1)
    depth = jnp.concatenate([jnp.zeros((B, 1), jnp.int32), node_level], 1)
    ancestors = _ancestors(parent, D)
    valid = (depth <= depth_cap[:, None]) & ~below_eos(tcfg, tree_tok, ancestors)
    return Tree(tree_tok, parent, depth, ancestors, valid), pstate, dstate.replace(cache=cache)


def _sampled_children(hcfg: H.HeadConfig, dparams, logits, sampling, k: int, key):
    """k children of each node drawn from the head's q without replacement, in draw order (the
    k largest of log q plus Gumbel noise, over the draft vocab): (target ids [.., k], draft ids
    [.., k], drawable [.., k]: q > 0, processed log q [.., Vd])."""
    logq = logprobs(logits, sampling)
    score, idx = top_k(logq + jax.random.gumbel(key, logq.shape, logq.dtype), k)
    tok = dparams["d2t"][idx] if hcfg.reduced_vocab else idx
    return tok.astype(jnp.int32), idx, jnp.isfinite(score), logq


def draft_sampled_tree(drafter: EagleDrafter, dparams, tparams, tcfg, dstate, last, tc: TreeConfig, sampling, key):
    """Draft one sampled-sibling tree per row on `tc.sibling_shape()` (verify.sampled_tree): every
    expansion's children are the first of its draws from q. The head's levels run as in
    `draft_tree` (a top_k frontier per level, the pending buffer, the scratch cache). Returns
    (Tree, Siblings, dstate)."""
    B = last.shape[0]
    k, hcfg, shape = tc.top_k, drafter.head, tc.sibling_shape(sampling.temperature)
    fused = H.fused_head_attention(hcfg, (tc.depth - 1) * k, drafter.kernels)
    cache, base = dstate.cache, dstate.cache.lengths
    depth = np.asarray(shape.depth)
    keys = jax.random.split(key, int(depth.max()))
    tok, didx, drawable, logq = _sampled_children(hcfg, dparams, dstate.logits, sampling, k, keys[0])
    # the samples a level's nodes come from: [B, frontier, k] (level 1: the root's, one "frontier" node)
    c_tok, c_idx, c_ok = tok[:, None], didx[:, None], drawable[:, None]
    expansion_logq = [logq[:, None]]
    node_tok, node_idx, node_ok = [last[:, None]], [jnp.full((B, 1), -1, jnp.int32)], [jnp.ones((B, 1), bool)]
    h = jnp.broadcast_to(dstate.feature[:, None], (B, 1, dstate.feature.shape[-1]))  # the root's "level" output
    frontier_of = {0: 0}  # node -> its place in the frontier its children were drawn from
    pending, f_anc = None, jnp.zeros((B, 1, 0), bool)
    for level in range(1, int(depth.max()) + 1):
        nodes = [n for n in range(len(depth)) if depth[n] == level]
        src = np.array([frontier_of[shape.parent[n]] for n in nodes])
        rank = np.array([shape.rank[n] for n in nodes])
        node_tok.append(c_tok[:, src, rank])
        node_idx.append(c_idx[:, src, rank])
        node_ok.append(c_ok[:, src, rank])
        expanding = shape.level_expansions[level] if level < len(shape.level_expansions) else ()
        if not expanding:
            break
        at = np.array([nodes.index(n) for n in expanding])
        pad = np.concatenate([at, np.full(k - len(at), at[0])])  # a frontier of k (the padding's output is unused)
        frontier_of = {n: i for i, n in enumerate(expanding)}
        f_tok = node_tok[-1][:, pad]
        f_feat = h[:, src[pad]]
        f_anc = jnp.concatenate([f_anc, jnp.broadcast_to(jnp.eye(f_anc.shape[1], dtype=bool), (B,) + (f_anc.shape[1],) * 2)],
                                axis=2)[:, src[pad]] if level > 1 else jnp.zeros((B, k, 0), bool)
        positions = jnp.broadcast_to(base[:, None] + (level - 1), (B, k))
        h, logits, entries, cache = H.head_tree_level(hcfg, dparams, tparams, f_tok, f_feat, cache, positions, pending,
                                                      f_anc, fused=fused)
        pending = entries if pending is None else tuple(jnp.concatenate(ab, axis=1) for ab in zip(pending, entries))
        c_tok, c_idx, c_ok, logq = _sampled_children(hcfg, dparams, logits, sampling, k, keys[level])
        expansion_logq.append(logq[:, : len(expanding)])
    tokens = jnp.concatenate(node_tok, 1)
    parent = jnp.broadcast_to(jnp.asarray(shape.parent, jnp.int32), tokens.shape)
    ancestors = _ancestors(parent, tc.depth)
    drawn = jnp.concatenate(node_ok, 1)
    valid = ~jnp.any(ancestors & ~drawn[:, None, :], axis=-1) & ~below_eos(tcfg, tokens, ancestors)
    tree = Tree(tokens, parent, jnp.broadcast_to(jnp.asarray(depth, jnp.int32), tokens.shape), ancestors, valid)
    return tree, Siblings(jnp.concatenate(expansion_logq, 1), jnp.concatenate(node_idx, 1)), dstate.replace(cache=cache)


def verify_size_index(valid: jax.Array, sizes: tuple[int, ...]) -> jax.Array:
    """Index into `sizes` (ascending draft-node counts) of the smallest block that holds every
    row's last valid node. valid: [B, N+1] (node 0 the root)."""
    last = jnp.max(jnp.where(valid, jnp.arange(valid.shape[1]), 0))
    return jnp.minimum(jnp.searchsorted(jnp.asarray(sizes), last), len(sizes) - 1).astype(jnp.int32)


def first_nodes(tree: Tree, n: int) -> Tree:
    """The tree's first n nodes (root included): a closed subtree, since parents precede children."""
    return Tree(tree.tokens[:, :n], tree.parent[:, :n], tree.depth[:, :n], tree.ancestors[:, :n, :n], tree.valid[:, :n])


def verify_block(tparams, tcfg, capture, unroll, sampling, max_depth: int, tree: Tree, cache, key, sampled=None):
    """One target forward over a tree and its verification: (best node, n accepted, next token,
    path [B, max_depth+1], the forward's outputs along the path, the feature at the best node).
    `sampled`: (Siblings, SiblingLayout, d2t) of a sampled-sibling tree (verify.sampled_tree)."""
    positions = cache.lengths[:, None] + tree.depth
    vout = M.forward(tparams, tcfg, tree.tokens, cache, positions=positions, new_mask=tree.ancestors,
                     capture=capture, unroll=unroll)
    logits = M.lm_head(tparams, tcfg, vout.hidden)
    if sampling.greedy:
        best, n, nxt = verify_tree_greedy(tree, logits, max_depth)
    elif sampled is not None:
        best, n, nxt = verify_sampled_tree(key, tree, logits, sampling, max_depth, *sampled)
    else:
        best, n, nxt = verify_tree_sampling(key, tree, logits, sampling, max_depth)
    path = path_of(tree, best, max_depth)  # [B, D+1]
    return best, n, nxt, path, gather_out(vout, path), take_row(vout.hidden, best)


def verify_pruned(tparams, tcfg, capture, unroll, sampling, max_depth: int, tree: Tree, cache, key,
                  sizes: tuple[int, ...]):
    """`verify_block` over the first sizes[i] + 1 nodes, i the smallest block holding every valid
    node (`verify_size_index`): one compiled program per size, chosen per round."""
    run = functools.partial(verify_block, tparams, tcfg, capture, unroll, sampling, max_depth)
    if len(sizes) == 1:
        return run(tree, cache, key)
    branches = [lambda t, c, k, n=n: run(first_nodes(t, n + 1), c, k) for n in sizes]
    return jax.lax.switch(verify_size_index(tree.valid, sizes), branches, tree, cache, key)


def with_ngram_branch(tcfg, tree: Tree, tokens: jax.Array, valid: jax.Array, max_depth: int) -> Tree:
    """The head's tree with an n-gram continuation (tokens, valid [B, M]) as one more branch from
    the root, placed first (nodes 1..M, a chain) so that a pruned round's valid nodes still come
    first; the head's nodes follow, their parent indices shifted by M. max_depth: the deepest node
    of the result, max(the head tree's depth, M) (`TreeConfig.path_depth`)."""
    B, M = tokens.shape
    chain = jnp.broadcast_to(jnp.arange(M, dtype=jnp.int32), (B, M))  # node i's parent is i - 1 (the root for i = 1)
    head_parent = jnp.where(tree.parent[:, 1:] == 0, 0, tree.parent[:, 1:] + M).astype(jnp.int32)
    parent = jnp.concatenate([tree.parent[:, :1], chain, head_parent], 1)
    depth = jnp.concatenate([tree.depth[:, :1], jnp.broadcast_to(jnp.arange(1, M + 1, dtype=tree.depth.dtype), (B, M)),
                             tree.depth[:, 1:]], 1)
    tok = jnp.concatenate([tree.tokens[:, :1], tokens.astype(tree.tokens.dtype), tree.tokens[:, 1:]], 1)
    ancestors = _ancestors(parent, max_depth)
    prefix = jnp.cumprod(valid.astype(jnp.int32), axis=1).astype(bool)
    valid = jnp.concatenate([tree.valid[:, :1], prefix, tree.valid[:, 1:]], 1) & ~below_eos(tcfg, tok, ancestors)
    return Tree(tok, parent, depth, ancestors, valid)


def tree_config(setting) -> TreeConfig | None:
    """The TreeConfig a tree setting (SpeculativeConfig.tree) names: None (chains), a TreeConfig as
    given, True or "auto" EAGLE-2's default tree (autotune's largest candidate, which sizes the cache)."""
    if setting is True or setting == "auto":
        return TreeConfig()
    return setting


def tree_for(drafter, tree: TreeConfig) -> TreeConfig:
    """The tree a drafter drafts: a hybrid's n-gram branch defaults to the tree's depth."""
    hybrid = isinstance(drafter, HybridDrafter)
    if (tree.ngram or tree.lookup_first) and not hybrid:
        raise ValueError(f"TreeConfig.ngram={tree.ngram}, lookup_first={tree.lookup_first} draft an n-gram branch: "
                         "use a hybrid drafter (eagle3+ngram)")
    if hybrid and tree.lookup_first > drafter.ngram.max_ngram:
        raise ValueError(f"lookup_first={tree.lookup_first} is above the n-gram drafter's longest match "
                         f"(max_ngram={drafter.ngram.max_ngram}): no round would skip the head's tree")
    return dataclasses.replace(tree, ngram=tree.depth) if hybrid and tree.ngram == 0 else tree


def below_eos(tcfg, tokens, ancestors):
    """[B, N+1] bool: nodes with a drafted EOS among their strict ancestors (a drafted EOS ends its
    branch; the root is the last emitted token, never a draft)."""
    eos = is_eos(tcfg, tokens).at[:, 0].set(False)
    strict = ancestors & ~jnp.eye(tokens.shape[1], dtype=bool)
    return jnp.any(strict & eos[:, None, :], axis=-1)


def gather_out(out: M.ForwardOut, path: jax.Array) -> M.ForwardOut:
    take = lambda x: jnp.take_along_axis(x, path[:, :, None], axis=1)
    return M.ForwardOut(take(out.hidden), tuple(take(c) for c in out.captured), out.cache)


def root_tree(last: jax.Array) -> Tree:
    """A tree of the root alone (the last emitted token), to hang an n-gram branch from."""
    B = last.shape[0]
    zeros = jnp.zeros((B, 1), jnp.int32)
    return Tree(last[:, None], zeros, zeros, jnp.ones((B, 1, 1), bool), jnp.ones((B, 1), bool))


def verified(tparams, tcfg, capture, unroll, sampling, max_depth: int, tree: Tree, cache, key,
             sizes: tuple[int, ...], sampled=None):
    """`verify_pruned`, and what the round keeps of the tree: (n accepted, next token, path, path
    tokens, the forward's outputs along the path, feature at the best node, chain-equivalent draft
    length, valid draft nodes)."""
    if sampled is not None:  # one static shape: no pruned blocks
        _, n, nxt, path, path_out, feature = verify_block(tparams, tcfg, capture, unroll, sampling, max_depth, tree, cache,
                                                          key, sampled)
    else:
        _, n, nxt, path, path_out, feature = verify_pruned(tparams, tcfg, capture, unroll, sampling, max_depth,
                                                           tree, cache, key, sizes)
    path_tok = jnp.take_along_axis(tree.tokens, path, 1)
    n_drafted = jnp.max(jnp.where(tree.valid, tree.depth, 0), axis=1)
    n_nodes = jnp.sum(tree.valid[:, 1:], 1).astype(jnp.int32)
    return n, nxt, path, path_tok, path_out, feature, n_drafted, n_nodes


def looks_up_first(order: jax.Array, done: jax.Array, lookup_first: int) -> jax.Array:
    """Whether a hybrid round verifies the n-gram branch alone (`TreeConfig.lookup_first`): every
    row still running matched an n-gram of at least `lookup_first` tokens (order [B], the match's
    n, `NgramDrafter.propose_ordered`); a finished row holds no round back. One row short of the
    order, and the whole batch runs the head's tree."""
    return jnp.all((order >= lookup_first) | done)


def tree_round(tparams, tcfg, drafter, dparams, policy, tc: TreeConfig, max_new, sampling, unroll, state: SpecState) -> SpecState:
    D, P = tc.depth, tc.path_depth  # the head's levels; the deepest node (a hybrid's n-gram branch may reach past D)
    key, k_verify = jax.random.split(state.key)
    pstate0, limit = policy.start_round(state.pstate, D, round_features(state, tparams))
    # a policy that does not cut trees keeps them whole: masking nodes the round drafts and
    # verifies anyway would only lose tokens
    limit = jnp.clip(limit, 1, D) if policy.cuts_trees else jnp.full_like(limit, D)
    hybrid = isinstance(drafter, HybridDrafter)
    head_drafter, head_state = (drafter.eagle, state.dstate.eagle) if hybrid else (drafter, state.dstate)
    verify = functools.partial(verified, tparams, tcfg, drafter.capture_layers, unroll, sampling, P)
    sampled = tc.sampled_siblings(sampling, policy)
    if hybrid and tc.ngram:
        ngram_tok, ngram_valid, order = drafter.ngram.propose_ordered(state.dstate.ngram, tc.ngram)

    def head_round(head_state, pstate):
        if sampled:
            return sampled_round(head_state, pstate)
        tree, pstate, head_state = draft_tree(head_drafter, dparams, tparams, tcfg, head_state, state.last, tc, policy,
                                              pstate, limit)
        if hybrid and tc.ngram:
            tree = with_ngram_branch(tcfg, tree, ngram_tok, ngram_valid, P)
        return head_state, pstate, verify(tree, state.cache, k_verify, tc.block_sizes(policy.cuts_trees))

    def sampled_round(head_state, pstate):
        k_tree, k_check = jax.random.split(k_verify)
        tree, sib, head_state = draft_sampled_tree(head_drafter, dparams, tparams, tcfg, head_state, state.last, tc,
                                                   sampling, k_tree)
        m = tc.ngram if hybrid else 0
        if m:
            tree = with_ngram_branch(tcfg, tree, ngram_tok, ngram_valid, P)
            sib = Siblings(sib.logq, jnp.concatenate([sib.draft_index[:, :1], jnp.full((tree.tokens.shape[0], m), -1,
                                                                                       jnp.int32), sib.draft_index[:, 1:]], 1))
        d2t = dparams["d2t"] if head_drafter.head.reduced_vocab else None
        return head_state, pstate, verify(tree, state.cache, k_check, (tc.total_nodes,),
                                          sampled=(sib, layout_of(tc.sibling_shape(sampling.temperature), m), d2t))

    def lookup_round(head_state, pstate):
        # the n-gram branch alone: a chain of tc.ngram nodes, and no head work this round
        tree = with_ngram_branch(tcfg, root_tree(state.last), ngram_tok, ngram_valid, P)
        return head_state, pstate, verify(tree, state.cache, k_verify, (tc.ngram,))

    lookup = None
    if hybrid and tc.ngram and tc.lookup_first:
        lookup = looks_up_first(order, state.done, tc.lookup_first)
        head_state, pstate, parts = jax.lax.cond(lookup, lookup_round, head_round, head_state, pstate0)
    else:
        head_state, pstate, parts = head_round(head_state, pstate0)
    n, nxt, path, path_tok, path_out, feature, n_drafted, n_nodes = parts
    dstate = state.dstate.replace(eagle=head_state) if hybrid else head_state

    active = ~state.done
    emitted = jnp.concatenate([path_tok[:, 1:], nxt[:, None]], axis=1)
    emitted = jnp.where(jnp.arange(P + 1)[None] == n[:, None], nxt[:, None], emitted)
    out, n_out, done = emit(tcfg, state.out, state.n_out, state.done, emitted, n + 1, max_new)
    step = active.astype(jnp.int32)
    cache = M.commit(path_out.cache, path, (n + 1) * step)
    dstate = drafter.commit(dparams, tparams, tcfg, dstate, path_tok, n, nxt, path_out)
    # the policy budgets the head's D levels: an n-gram branch past them counts as D drafted (and
    # accepted); a lookup round drafted nothing of the head's, so its policy state stays as it was
    pstate = policy.update(pstate, jnp.minimum(n_drafted, D), jnp.minimum(n, D), active)
    if lookup is not None:
        pstate = jax.tree_util.tree_map(lambda old, new: jnp.where(lookup, old, new), state.pstate, pstate)
    trace_drafted, trace_tokens = record_call(state, active, n_nodes, state.n_out, n_out)
    return SpecState(
        trace_drafted=trace_drafted, trace_tokens=trace_tokens,
        cache=cache, dstate=dstate, pstate=pstate, out=out, n_out=n_out,
        last=jnp.where(active, nxt, state.last),
        feature=jnp.where(active[:, None], feature, state.feature),
        done=done, key=key, target_calls=state.target_calls + step,
        drafted=state.drafted + n_nodes * step,
        accepted=state.accepted + accepted_emitted(n, state.n_out, n_out) * step,
    )


_STATIC = ("tcfg", "drafter", "policy", "tree", "max_new", "cache_len", "sampling", "unroll")


@functools.partial(jax.jit, static_argnames=_STATIC + ("with_policy_state", "rows", "refill", "stop_at_running"))
def tree_generate_jit(tparams, dparams, policy_params, tokens, lens, key, policy_state=None, budgets=None, *, tcfg, drafter, policy, tree, max_new, cache_len, sampling, unroll, with_policy_state=False, rows=None, refill=None, stop_at_running=0):
    """As chain.speculative_generate_jit, with a tree per round."""
    def start(t, l, k, policy_state=None):
        return start_spec(tparams, tcfg, drafter, dparams, policy, policy_params, tree.depth, max_new, cache_len, sampling, unroll,
                          t, l, k, policy_state=policy_state)

    loop = M.loop_params(tparams, tcfg, unroll=unroll)  # per-layer weight buffers for the rounds
    body = functools.partial(tree_round, loop, tcfg, drafter, dparams, policy, tree, max_new, sampling, unroll)
    outputs, state = run_queue(start, body, outputs_of, tokens, lens, key, rows=rows, refill=refill,
                               start_first=functools.partial(start, policy_state=policy_state),
                               stop_at_running=stop_at_running, budgets=budgets, cut=cut_spec_at_budgets)
    return outputs + (state.pstate,) if with_policy_state else outputs


@functools.partial(jax.jit, static_argnames=("tcfg", "drafter", "policy", "tree", "max_new", "sampling", "unroll",
                                             "n_rounds", "stop_at_running"), donate_argnames=("state",))
def tree_loop_jit(tparams, dparams, state, budgets=None, *, tcfg, drafter, policy, tree, max_new, sampling, unroll, n_rounds=None, stop_at_running=0):
    """As chain.spec_loop_jit, with a tree per round: its state comes from chain.start_spec_jit at
    k_max = tree.depth, and its shapes are the state's, so prompt widths share it."""
    body = functools.partial(tree_round, M.loop_params(tparams, tcfg, unroll=unroll), tcfg, drafter, dparams, policy,
                             tree, max_new, sampling, unroll)
    return run_rows(body, state, stop_at_running=stop_at_running, max_steps=n_rounds, budgets=budgets,
                    cut=cut_spec_at_budgets)


def tree_generate(tparams, tcfg, tokens, lens, key, *, drafter, drafter_params, policy, policy_params, tree: TreeConfig, max_new, cache_len, sampling, unroll, policy_state=None, rows=None, refill=None, stop_at_running=0, budgets=None) -> GenerationResult:
    """Tree speculative generation: one batch as a prefill program and a rounds program (as
    chain.speculative_generate), a queue whole in `tree_generate_jit`."""
    if not isinstance(drafter, (EagleDrafter, HybridDrafter)):
        raise ValueError(f"tree drafting needs an EAGLE head drafter (or eagle3+ngram), got {getattr(drafter, 'name', drafter)!r}")
    policy = resolve_policy(policy, tree.depth)
    check_compatible(drafter, policy, tcfg, tree.depth, "lossless")
    budgets = None if budgets is None else jnp.asarray(budgets, jnp.int32)
    static = dict(tcfg=tcfg, drafter=drafter, policy=policy, max_new=max_new, sampling=sampling, unroll=unroll)
    if rows is None:
        state = start_spec_jit(tparams, drafter_params, policy_params, jnp.asarray(tokens), jnp.asarray(lens), key,
                               policy_state, budgets, k_max=tree.depth, cache_len=cache_len, verify="lossless", **static)
        state = tree_loop_jit(tparams, drafter_params, state, budgets, tree=tree, stop_at_running=stop_at_running, **static)
        return result_from_device(outputs_of(state) + (state.pstate,))
    return result_from_device(tree_generate_jit(
        tparams, drafter_params, policy_params, jnp.asarray(tokens), jnp.asarray(lens), key, policy_state, budgets,
        tree=tree, cache_len=cache_len, with_policy_state=True, rows=rows, refill=refill,
        stop_at_running=stop_at_running, **static))


# EAGLE's `total_token = -1` mode (ea_model.py): total tokens {40, 48, 50, 56, 60} = draft nodes + root.
EAGLE_NODE_CANDIDATES = (39, 47, 49, 55, 59)
EAGLE_NODE_WEIGHTS = (1.0, 1.05, 1.07, 1.1, 1.13)


def autotune_num_nodes(tparams, tcfg, batch: int, cache_len: int, candidates=EAGLE_NODE_CANDIDATES, weights=EAGLE_NODE_WEIGHTS, reps: int = 5) -> int:
    """EAGLE's device-specific tree budget: time a target forward over each candidate block size
    (nodes + root) at this batch size, divide by the candidate's weight (EAGLE's 1, 1.05, 1.07,
    1.1, 1.13: larger trees are credited for accepting more), and keep the cheapest. The default
    candidates are EAGLE's (39, 47, 49, 55, 59 nodes)."""
    if len(candidates) != len(weights) or not candidates:
        raise ValueError(f"autotune needs one weight per candidate, got {candidates} and {weights}")
    cache = M.init_cache(tcfg, batch, cache_len, tparams["embed"].dtype)
    cache = cache.replace(lengths=jnp.full((batch,), cache_len // 2, jnp.int32))
    fwd = jax.jit(lambda p, t, c: M.lm_head(p, tcfg, M.forward(p, tcfg, t, c).hidden))
    costs = []
    for n, w in zip(candidates, weights):
        toks = jnp.zeros((batch, n + 1), jnp.int32)
        jax.block_until_ready(fwd(tparams, toks, cache))
        t0 = time.perf_counter()
        for _ in range(reps):
            jax.block_until_ready(fwd(tparams, toks, cache))
        costs.append((time.perf_counter() - t0) / reps / w)
    return int(candidates[int(np.argmin(costs))])


_AUTOTUNED: dict = {}


def autotuned_tree(tparams, tcfg, batch: int, cache_len: int, top_k: int = 10, depth: int = 6, **autotune_kw) -> TreeConfig:
    """A TreeConfig whose num_nodes `autotune_num_nodes` picks on this device for this batch size
    and cache (EAGLE's candidates, clipped to what a top_k x depth tree can hold). Timed once per
    (model config, batch, cache length, tree shape, backend) per process."""
    largest = TreeConfig(top_k, depth, 1).max_nodes
    cands, weights = zip(*[(min(n, largest), w) for n, w in zip(autotune_kw.pop("candidates", EAGLE_NODE_CANDIDATES),
                                                                  autotune_kw.pop("weights", EAGLE_NODE_WEIGHTS))])
    key = (tcfg, batch, cache_len, top_k, depth, cands, weights, jax.default_backend())
    if key not in _AUTOTUNED:
        _AUTOTUNED[key] = autotune_num_nodes(tparams, tcfg, batch, cache_len, cands, weights, **autotune_kw)
    return TreeConfig(top_k, depth, _AUTOTUNED[key])
