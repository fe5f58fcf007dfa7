"""top_k for drafting and sampling: the same values and ids as `jax.lax.top_k`, faster on GPUs.

XLA lowers `lax.top_k` on GPUs to one TopK kernel that scans each row serially: on an H200 it costs
about 20 µs a call even for short rows, and 145 µs for the top-10 of 10 rows of a 32k vocabulary,
which was 65% of an EAGLE-2 tree level. Here short rows are sorted (one stable sort of a few
hundred entries is a ~1.5 µs kernel) and long rows go through block maxima first: the k blocks
with the largest maxima hold the k largest entries (a block outside them has k blocks above its
max), so only k * BLOCK entries are sorted. Portable jnp: CPU and TPU run the same code.

Ties: the sort is stable on the id, so equal values come out lowest id first, as with lax.top_k.
In the blocked path a tie at the k-th value that straddles blocks may pick another of the tied
ids (a tree then drafts an equally scored sibling; nothing that decides outputs depends on it).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

BLOCK = 128  # block width of the two-pass path


def top_k_sorted(x: jax.Array, k: int) -> tuple[jax.Array, jax.Array]:
    """(values, int32 ids) of the k largest entries of the last axis, by one stable sort."""
    ids = jax.lax.broadcasted_iota(jnp.int32, x.shape, x.ndim - 1)
    neg, ids = jax.lax.sort((-x, ids), dimension=x.ndim - 1, is_stable=True, num_keys=1)
    return -neg[..., :k], ids[..., :k]


def top_k(x: jax.Array, k: int, block: int = BLOCK) -> tuple[jax.Array, jax.Array]:
    """(values, int32 ids) of the k largest entries of the last axis, largest first."""
    n = x.shape[-1]
    if not 1 <= k <= n:
        raise ValueError(f"top_k: k={k} must be in [1, {n}] (the length of the last axis)")
    if k > block or -(-n // block) < 2 * k:  # too few blocks for the two passes to pay
        return top_k_sorted(x, k)
    pad = (-n) % block
    if pad:
        x = jnp.concatenate([x, jnp.full(x.shape[:-1] + (pad,), -jnp.inf, x.dtype)], axis=-1)
    blocks = x.reshape(x.shape[:-1] + (-1, block))
    _, best = top_k_sorted(jnp.max(blocks, axis=-1), k)
    best = jnp.sort(best, axis=-1)  # candidates in id order, so ties prefer the lower id
    cand = jnp.take_along_axis(blocks, best[..., None], axis=-2).reshape(x.shape[:-1] + (k * block,))
    val, j = top_k_sorted(cand, k)
    return val, jnp.take_along_axis(best, j // block, axis=-1) * block + j % block
