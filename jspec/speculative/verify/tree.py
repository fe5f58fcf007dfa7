"""Tree verification: the fixed-shape draft tree and the rules that pick its accepted path.

* `verify_tree_greedy`: the deepest node whose whole path matches the target's argmax (ties: the
  lowest node index). Output is identical to autoregressive greedy decoding.
* `verify_tree_sampling`: EAGLE-2's lossless rule for deterministic top-k children (q = 1): at
  each node try the children in order, accept child x with probability p(x), else zero p(x),
  renormalise and try the next; if all fail, sample the residual; a leaf emits a bonus sample.

Both return (best node [B], n accepted [B], next token [B]).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

from ...sampling import Sampling, logprobs
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


def verify_tree_greedy(tree: Tree, logits: jax.Array, max_depth: int):
    """Deepest node whose path equals the target's argmax. Returns (best node, n accepted, next token)."""
    tgt = jnp.argmax(logits, -1).astype(jnp.int32)  # [B, N+1]
    ok = (tree.tokens == jnp.take_along_axis(tgt, tree.parent, 1)) & tree.valid
    ok = ok.at[:, 0].set(True)
    acc = ok
    for _ in range(max_depth):
        acc = acc & jnp.take_along_axis(acc, tree.parent, 1)
    best = jnp.argmax(jnp.where(acc, tree.depth + 1, 0), axis=1).astype(jnp.int32)
    return best, take_row(tree.depth, best), take_row(tgt, best)


def verify_tree_sampling(key, tree: Tree, logits: jax.Array, sampling: Sampling, max_depth: int, top_k: int):
    """EAGLE-2's lossless rule for deterministic top-k children. Returns (best, n, next token)."""
    B, N1, V = logits.shape
    probs = jnp.exp(logprobs(logits, sampling))  # [B, N+1, V]
    node = jnp.zeros((B,), jnp.int32)
    moving = jnp.ones((B,), bool)
    p = probs[:, 0]
    idx = jnp.arange(N1)[None]
    for d in range(max_depth):
        children = (tree.parent == node[:, None]) & (idx > 0) & tree.valid  # [B, N+1]
        rank = jnp.cumsum(children, 1) - 1
        moved = jnp.zeros((B,), bool)
        for r in range(top_k):
            is_r = children & (rank == r)
            has = is_r.any(1) & moving & ~moved
            child = jnp.argmax(is_r, 1)
            x = take_row(tree.tokens, child)
            px = jnp.take_along_axis(p, x[:, None], 1)[:, 0] / jnp.maximum(p.sum(-1), 1e-30)
            key, sub = jax.random.split(key)
            take = has & (jax.random.uniform(sub, (B,)) < px)
            p = jnp.where((has & ~take)[:, None], p * (1 - jax.nn.one_hot(x, V, dtype=p.dtype)), p)
            node = jnp.where(take, child, node)
            moved = moved | take
        p = jnp.where(moved[:, None], take_row(probs, node), p)
        moving = moving & moved
    key, sub = jax.random.split(key)
    p = p / jnp.maximum(p.sum(-1, keepdims=True), 1e-30)
    nxt = jax.random.categorical(sub, jnp.log(p), axis=-1).astype(jnp.int32)
    return node, take_row(tree.depth, node), nxt
