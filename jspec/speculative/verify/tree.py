"""Tree verification: the fixed-shape draft tree and the rules that pick its accepted path.

* `verify_tree_greedy`: the deepest node whose whole path matches the target's argmax (ties: the
  lowest node index). Output is identical to autoregressive greedy decoding.
* `verify_tree_sampling`: EAGLE-2's lossless rule for deterministic children (q = 1: top-k
  children, n-gram branches), in one parallel step. The sequential rule tries a node's children
  in order, accepts child x with probability p(x) (of p with the rejected children removed and
  renormalised), and samples the residual when all fail: child y is accepted with probability
  p(y) and the residual is p restricted to the other tokens. One sample x ~ p per node has the
  same law: x equal to a child's token accepts that child, any other x is the residual's sample
  (the correction token), and at a leaf x is the bonus. So every node draws its target sample at
  once, and the accepted path is the deepest whose tokens equal their parents' samples, as in the
  greedy rule. A token two siblings share counts for the first of them only (the sequential rule
  removes it with the first rejection; choosing the deeper duplicate would favour drafted tokens).
  The sequential loop cost D x top_k dependent full-vocabulary steps a round (about a third of a
  135M round on an H200); this is one sampling pass over the tree's logits.

Both return (best node [B], n accepted [B], next token [B]).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

from ...sampling import Sampling, sample
from ..state import take_row


@struct.dataclass
class Tree:
    tokens: jax.Array  # [B, N+1]
    parent: jax.Array  # [B, N+1] (root: 0)
    depth: jax.Array  # [B, N+1] (root: 0)
    ancestors: jax.Array  # [B, N+1, N+1] bool, ancestor-or-self
    valid: jax.Array  # [B, N+1] bool (root: True)


def ancestor_mask(parent: jax.Array, max_depth: int) -> jax.Array:
    """Ancestor-or-self mask [B, N, N] from parent indices [B, N] (root is its own parent)."""
    N = parent.shape[1]
    anc = jnp.broadcast_to(jnp.eye(N, dtype=bool), parent.shape + (N,))
    hop = parent
    for _ in range(max_depth):  # add the ancestor `hop` levels up
        anc = anc | jax.nn.one_hot(hop, N, dtype=bool)
        hop = jnp.take_along_axis(parent, hop, axis=1)
    return anc


def path_of(tree: Tree, node: jax.Array, max_depth: int) -> jax.Array:
    """Node indices [B, max_depth+1] along the root->node path, by depth (padded with the node)."""
    on_path = jnp.take_along_axis(tree.ancestors, node[:, None, None], axis=1)[:, 0]  # [B, N+1]
    d = jnp.arange(max_depth + 1)
    hit = on_path[:, None, :] & (tree.depth[:, None, :] == d[None, :, None])  # [B, D+1, N+1]
    return jnp.where(hit.any(-1), jnp.argmax(hit, -1), node[:, None]).astype(jnp.int32)


def first_of_siblings(tree: Tree) -> jax.Array:
    """[B, N+1] bool: nodes no earlier valid sibling shares a token with (the root: True)."""
    idx = jnp.arange(tree.tokens.shape[1])
    # [B, node, earlier sibling]; the root is its own parent, not a sibling of its children
    same = ((tree.parent[:, :, None] == tree.parent[:, None, :]) & (tree.tokens[:, :, None] == tree.tokens[:, None, :])
            & tree.valid[:, None, :] & (idx[None, None, :] < idx[None, :, None]) & (idx > 0)[None, None, :])
    return ~jnp.any(same, axis=-1) | (idx == 0)[None]


def accepted_path(tree: Tree, target_tokens: jax.Array, max_depth: int, ok: jax.Array | None = None):
    """The deepest node whose path's tokens equal the target's token at each parent (ties: the
    lowest node index): (best node, n accepted, the target's token there). `ok` further restricts
    which nodes may match."""
    match = (tree.tokens == jnp.take_along_axis(target_tokens, tree.parent, 1)) & tree.valid
    acc = (match if ok is None else match & ok).at[:, 0].set(True)
    for _ in range(max_depth):
        acc = acc & jnp.take_along_axis(acc, tree.parent, 1)
    best = jnp.argmax(jnp.where(acc, tree.depth + 1, 0), axis=1).astype(jnp.int32)
    return best, take_row(tree.depth, best), take_row(target_tokens, best)


def verify_tree_greedy(tree: Tree, logits: jax.Array, max_depth: int):
    """Deepest node whose path equals the target's argmax. Returns (best node, n accepted, next token)."""
    return accepted_path(tree, jnp.argmax(logits, -1).astype(jnp.int32), max_depth)


def verify_tree_sampling(key, tree: Tree, logits: jax.Array, sampling: Sampling, max_depth: int):
    """EAGLE-2's lossless rule for deterministic children, one target sample per node (module doc).
    Returns (best, n, next token)."""
    target_tokens = sample(key, logits, sampling)  # [B, N+1]: independent per node
    best, n, _ = accepted_path(tree, target_tokens, max_depth, first_of_siblings(tree))
    return best, n, take_row(target_tokens, best)  # the correction, or a leaf's bonus
