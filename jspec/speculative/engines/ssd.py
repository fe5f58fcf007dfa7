"""SSD: self-speculative decoding of a masked-diffusion LM, identical to its stepwise decoding.

Stepwise decoding (the reference, `stepwise_generate_jit`): semi-autoregressive blocks of b
target positions after an anchor (the last committed token). Each forward over the block
`[anchor, y_1 .. y_{b-1}]` gives one distribution per target position (shifted prediction);
the rule fills exactly one position: the still-masked position with the highest confidence
(max probability; ties -> the leftmost) gets its argmax token. After b forwards the block is
complete, is emitted, and its tokens become prefix (cached causally by the next forward, fused
into it); its last token is the next anchor.

SSD (`ssd_generate_jit`; arXiv 2510.04147, mechanics [I] reconstructed, docs/methods.md): the same
DLM drafts for itself. From the latest forward it takes the N - 1 next (position, token) choices
in the rule's order (most confident masked positions, argmax tokens): d_1 .. d_{N-1}. One forward
evaluates the hierarchical verification chain: node j = the current block with d_1..d_j filled
(j = 0..N-1), all nodes side by side in one call (`heads.dlm.nodes_logits`, each node blind to
the others, the prefix cache shared). Node j's stepwise choice c_j is what stepwise decoding would
do in that state; d_{j+1} is accepted iff c_j == d_{j+1} (same position and token) and every
earlier draft was accepted. With m accepted, the forward commits d_1..d_m and c_m: m + 1 tokens,
each exactly the stepwise choice, so the output is identical to stepwise decoding. The next drafts
come from node m's distributions (no extra forward). At least one token per forward; the first
forward of a block has no drafts yet.

Both loops are batched (rows advance independently) and report forwards per row, so
forwards/token of stepwise decoding is 1 and SSD's is below 1.

Bit-for-bit identity in bf16. In exact arithmetic SSD equals stepwise decoding whatever kernels
run it. In bf16 it equals a stepwise decoding computed with the same shapes: the N-node forward
has more rows than a one-block forward, XLA and cuBLAS pick other GEMM tilings for it, and the
rounding of a near-tied argmax can differ. `stepwise_generate_jit(..., n_nodes=N)` is stepwise
decoding run through SSD's own N-node forward (node 0 holds the state, no drafts): the reference
SSD is checked against bit for bit. With n_nodes=1 (the default) it is the fast one-block program,
the baseline of SSD's speedup.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import struct

from ... import model as M
from ...decode import emit
from ...heads import dlm as D
from ...kernels.top_k import top_k


@struct.dataclass
class SSDState:
    cache: M.KVCache
    pending: jax.Array  # [B, b] the last completed block's input slots (anchor + b-1 tokens)
    n_pending: jax.Array  # [B] b right after a block completes, else 0
    block: jax.Array  # [B, b] target tokens of the current block (valid where filled)
    filled: jax.Array  # [B, b] bool
    anchor: jax.Array  # [B] token before the block (position p)
    dpos: jax.Array  # [B, N-1] drafted target positions, in the rule's order
    dtok: jax.Array  # [B, N-1]
    dvalid: jax.Array  # [B, N-1]
    out: jax.Array  # [B, max_new]
    n_out: jax.Array
    done: jax.Array
    forwards: jax.Array  # [B] DLM forwards that worked on the row (prefill not counted)


def block_inputs(dcfg: D.DLMConfig, anchor, block, filled):
    """Input slots [.., b] of a block state: anchor, then target j at slot j + 1 (MASK if empty);
    the last target has no slot."""
    ins = jnp.where(filled[..., :-1], block[..., :-1], dcfg.mask_token_id)
    return jnp.concatenate([jnp.broadcast_to(anchor[..., None], ins.shape[:-1] + (1,)), ins], axis=-1)


def block_stats(logits):
    """What the rule reads off block logits [.., b, V]: (confidence [.., b], argmax token [.., b]).
    The confidence is the top token's log-probability, -log sum exp(x - max x): bit for bit the max
    of log_softmax(x) (whose top entry is exactly 0 - that log). Reductions over the logits only,
    computed once per forward: no log-probabilities are materialised, and the drafts read the
    same [.., b] arrays instead of the logits again."""
    x = logits.astype(jnp.float32)
    top = jnp.max(x, axis=-1, keepdims=True)
    conf = -jnp.log(jnp.sum(jnp.exp(x - top), axis=-1))
    return conf, jnp.argmax(x, axis=-1).astype(jnp.int32)


def stepwise_choice(conf, tok, filled):
    """The rule: (position [..], token [..]) from block_stats (conf, tok) [.., b]: the most
    confident still-masked position (ties -> the leftmost) and its argmax token."""
    pos = jnp.argmax(jnp.where(filled, -jnp.inf, conf), axis=-1).astype(jnp.int32)
    return pos, jnp.take_along_axis(tok, pos[..., None], axis=-1)[..., 0]


def next_drafts(conf, tok, filled, n_drafts: int):
    """The rule's next n_drafts choices read off one forward's block_stats: masked positions by
    decreasing confidence, argmax tokens. (positions, tokens, valid) [.., n_drafts]. At most
    (masked - 1) are valid: the node after the last accepted draft must still have a position to
    choose."""
    # top_k on confidence; ties -> lower index first, like argmax in stepwise_choice
    val, pos = top_k(jnp.where(filled, -jnp.inf, conf), n_drafts)
    room = jnp.sum(~filled, axis=-1, keepdims=True) - 1
    return (pos.astype(jnp.int32), jnp.take_along_axis(tok, pos, axis=-1),
            (val > -jnp.inf) & (jnp.arange(n_drafts) < room))


def start(own, tparams, dcfg: D.DLMConfig, tokens, lens, *, b: int, n_nodes: int, max_new: int,
          cache_len: int, kernels=None) -> SSDState:
    """Cache the prompt but its last token, which anchors the first block."""
    B = tokens.shape[0]
    cache = M.init_cache(dcfg.model, B, cache_len, own["final_norm"].dtype)
    cache = D.prefill(own, tparams, dcfg, tokens, lens - 1, cache, kernels=kernels)
    first = jnp.take_along_axis(tokens, (lens - 1)[:, None], axis=1)[:, 0]
    out = jnp.full((B, max_new), -1, jnp.int32)
    zeros = jnp.zeros((B,), jnp.int32)
    n_out, done = zeros, jnp.zeros((B,), bool)
    nd = max(n_nodes - 1, 1)
    return SSDState(
        cache=cache, pending=jnp.zeros((B, b), jnp.int32), n_pending=zeros,
        block=jnp.zeros((B, b), jnp.int32), filled=jnp.zeros((B, b), bool), anchor=first,
        dpos=jnp.zeros((B, nd), jnp.int32), dtok=jnp.zeros((B, nd), jnp.int32), dvalid=jnp.zeros((B, nd), bool),
        out=out, n_out=n_out, done=done, forwards=zeros,
    )


def finish_block(dcfg, state: SSDState, block, filled, max_new):
    """Rows whose block is complete: emit it, queue it for the prefix cache, move the anchor."""
    b = block.shape[1]
    complete = jnp.all(filled, axis=1) & ~state.done
    out, n_out, done = emit(dcfg.target, state.out, state.n_out, state.done, block,
                            jnp.where(complete, b, 0), max_new)
    ins = block_inputs(dcfg, state.anchor, block, filled)
    return state.replace(
        out=out, n_out=n_out, done=done,
        pending=jnp.where(complete[:, None], ins, state.pending),
        n_pending=jnp.where(complete, b, 0),
        anchor=jnp.where(complete, block[:, -1], state.anchor),
        block=jnp.where(complete[:, None], 0, block),
        filled=jnp.where(complete[:, None], False, filled),
    ), complete


def stepwise_step(own, tparams, dcfg, max_new, kernels, state: SSDState) -> SSDState:
    """One forward, one token per unfinished row."""
    ins = block_inputs(dcfg, state.anchor, state.block, state.filled)
    logits, cache = D.block_logits(own, tparams, dcfg, state.cache, state.pending, state.n_pending, ins, kernels=kernels)
    pos, tok = stepwise_choice(*block_stats(logits), state.filled)
    active = ~state.done
    hit = (jnp.arange(ins.shape[1])[None] == pos[:, None]) & active[:, None]
    block = jnp.where(hit, tok[:, None], state.block)
    filled = state.filled | hit
    state = state.replace(cache=cache, forwards=state.forwards + active.astype(jnp.int32))
    state, _ = finish_block(dcfg, state, block, filled, max_new)
    return state


def ssd_step(own, tparams, dcfg, max_new, kernels, n_nodes: int, state: SSDState, drafts: bool = True) -> SSDState:
    """One forward over N verification nodes; commits the accepted drafts + one verified choice.
    drafts=False never drafts: every node holds the current state and one token is committed,
    which is stepwise decoding computed with SSD's shapes."""
    B, b = state.block.shape
    N = n_nodes
    nd = state.dpos.shape[1]
    r = jnp.arange(b)
    # node j: drafts d_1..d_j applied (only valid drafts; invalid ones fill nothing)
    hit = (state.dpos[:, :, None] == r[None, None]) & state.dvalid[:, :, None]  # [B, nd, b]
    upto = jnp.cumsum(hit.astype(jnp.int32), axis=1) > 0  # filled by d_1..d_{i+1}
    node_extra = jnp.concatenate([jnp.zeros((B, 1, b), bool), upto[:, : N - 1]], axis=1)  # [B, N, b]
    dtok_at = jnp.sum(jnp.where(hit, state.dtok[:, :, None], 0), axis=1)  # token drafted at each position
    node_filled = state.filled[:, None] | node_extra
    node_block = jnp.where(node_extra, dtok_at[:, None], state.block[:, None])
    ins = block_inputs(dcfg, state.anchor[:, None], node_block, node_filled)  # [B, N, b]
    logits, cache = D.nodes_logits(own, tparams, dcfg, state.cache, state.pending, state.n_pending, ins, kernels=kernels)
    conf, argmax_tok = block_stats(logits)  # [B, N, b]
    pos, tok = stepwise_choice(conf, argmax_tok, node_filled)  # [B, N]: the rule's choice at every node
    # d_{j+1} accepted iff node j chooses it, and all earlier drafts were accepted
    match = (pos[:, : N - 1] == state.dpos[:, : N - 1]) & (tok[:, : N - 1] == state.dtok[:, : N - 1]) & state.dvalid[:, : N - 1]
    m = jnp.sum(jnp.cumprod(match.astype(jnp.int32), axis=1), axis=1).astype(jnp.int32) if N > 1 else jnp.zeros((B,), jnp.int32)
    take = lambda x: jnp.take_along_axis(x, m.reshape((B, 1) + (1,) * (x.ndim - 2)), axis=1)[:, 0]  # noqa: E731
    active = ~state.done
    acc_filled, acc_block = take(node_filled), take(node_block)
    c_pos, c_tok = take(pos), take(tok)
    hit_c = (r[None] == c_pos[:, None]) & active[:, None]
    block = jnp.where(active[:, None], jnp.where(hit_c, c_tok[:, None], acc_block), state.block)
    filled = jnp.where(active[:, None], acc_filled | hit_c, state.filled)
    # the next drafts: node m's distributions, with c_m's position now filled
    dpos, dtok, dvalid = next_drafts(take(conf), take(argmax_tok), filled, nd)
    state = state.replace(cache=cache, forwards=state.forwards + active.astype(jnp.int32))
    state, complete = finish_block(dcfg, state, block, filled, max_new)
    dvalid = dvalid & ~complete[:, None] & (N > 1) & drafts  # a new block starts without drafts
    return state.replace(dpos=dpos, dtok=dtok, dvalid=dvalid)


_STATIC = ("dcfg", "b", "n_nodes", "max_new", "cache_len", "kernels")


def cache_len_for(prompt_len: int, max_new: int, b: int, n_nodes: int) -> int:
    need = prompt_len + max_new + b + b * (n_nodes + 1) + 1
    return -(-need // 128) * 128


@functools.partial(jax.jit, static_argnames=_STATIC)
def stepwise_generate_jit(own, tparams, tokens, lens, *, dcfg, b, n_nodes=1, max_new, cache_len, kernels=None):
    """Stepwise decoding: (out [B, max_new], n_out [B], forwards [B]). n_nodes > 1 computes it
    with SSD's N-node forward (the bit-for-bit reference of SSD with n_nodes nodes, see above)."""
    state = start(own, tparams, dcfg, tokens, lens, b=b, n_nodes=n_nodes, max_new=max_new, cache_len=cache_len, kernels=kernels)
    if n_nodes == 1:
        body = functools.partial(stepwise_step, own, tparams, dcfg, max_new, kernels)
    else:
        body = functools.partial(ssd_step, own, tparams, dcfg, max_new, kernels, n_nodes, drafts=False)
    state = jax.lax.while_loop(lambda s: ~jnp.all(s.done), body, state)
    return state.out, state.n_out, state.forwards


@functools.partial(jax.jit, static_argnames=_STATIC)
def ssd_generate_jit(own, tparams, tokens, lens, *, dcfg, b, n_nodes, max_new, cache_len, kernels=None):
    """SSD with n_nodes verification nodes: (out [B, max_new], n_out [B], forwards [B])."""
    state = start(own, tparams, dcfg, tokens, lens, b=b, n_nodes=n_nodes, max_new=max_new, cache_len=cache_len, kernels=kernels)
    body = functools.partial(ssd_step, own, tparams, dcfg, max_new, kernels, n_nodes)
    state = jax.lax.while_loop(lambda s: ~jnp.all(s.done), body, state)
    return state.out, state.n_out, state.forwards


def check_ssd(dcfg: D.DLMConfig, b: int, n_nodes: int) -> None:
    if not 2 <= b <= dcfg.block_size:
        raise ValueError(f"SSD block length {b} must be in [2, the DLM block size {dcfg.block_size}]")
    if not 1 <= n_nodes <= b:
        raise ValueError(f"SSD nodes {n_nodes} must be in [1, block length {b}]")
