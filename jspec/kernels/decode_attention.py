"""Fused attention for short blocks (decode, chain and tree verify, EAGLE heads' draft steps and
tree levels): one kernel per layer.

At batch 1 a 135M decoder is launch-bound, so what a layer costs is mostly how many kernels it
launches. The portable path (`model.forward` with attention="xla") spends about ten of them on
attention alone: rope on q and k, two scatters into the cache, the per-layer cache slices, the
QK product, the masked softmax and the PV product. This Pallas (Triton) kernel does all of it in
one launch per layer:

  * reads q, k, v straight from the fused QKV projection [B, T, Hq + 2*Hkv, hd] and applies rope
    (rotate-half layout: the two halves are loaded separately, so no in-register shuffles);
  * attends over the committed cache slots [0, lengths[b]) of layer `layer` of the full stacked
    cache [L, B, S, Hkv, hd] (online softmax over key blocks), then over the T new tokens under
    their mask (causal, or a tree's ancestor mask [B, T, T]);
  * writes the new tokens' k, v into the cache at slots lengths[b] + t in place (the cache is
    aliased input -> output). The committed slots it reads and the new slots it writes never
    overlap, so programs need no ordering among themselves.

Grid: (batch, query head[, split]). Each program handles one query head for all T tokens; the G query
heads of a KV group re-read the same keys (from L2). The first head of each group writes the cache.
With `window` W, a row attends only to its last W committed slots [lengths[b] - W, lengths[b]) and
the new tokens (a draft head trained on sequences of W tokens; the loop starts at the window's
first key block, so a long context costs only the window).
With splits > 1 (`attention_splits`: long caches at small batch), each program takes one
slice of the row's committed keys (the last also the new tokens) and leaves an unnormalised partial
result; `combine_splits` merges them.
Rows are padded to at least 16 (the tensor-core tile), so T = 1 decode wastes 15 rows of a
[16, 64] tile, which costs nothing next to the launch.

Limits (the caller falls back to the einsum path otherwise): no sliding windows, no attention
logit soft-capping, T <= MAX_BLOCK, new_mask (if given) square [B, T, T], single device (a
pallas_call is not partitioned by GSPMD).
"""

from __future__ import annotations

import functools
import os

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

NEG_INF = -1e30
MAX_BLOCK = 64  # new tokens per call handled by the kernel; larger blocks (prefill) use einsum
BLOCK_K = 64  # committed keys per inner-loop step


def _next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def _kernel(layer_ref, len_ref, qkv_ref, cos_ref, sin_ref, mask_ref, k_in, v_in, o_ref, k_out, v_out, *stats_refs,
            T, BT, G, Hq, Hkv, hd, scale, causal, drop_past_end, splits, dtype, window):
    del k_in, v_in  # aliased with k_out / v_out: read and write through the outputs
    b = pl.program_id(0)
    qh = pl.program_id(1)
    # splits > 1: which slice of the committed keys (partial results, combined outside); with one
    # split the program is the same as without this option
    sp = pl.program_id(2) if splits > 1 else None
    kvh = qh // G
    layer = layer_ref[0]
    S = k_out.shape[2]
    # committed slots of this row; a cursor past the cache end (a draft head's finished rows keep
    # advancing theirs) reads the whole cache, as the einsum paths' `slot < lengths` compare does
    n = jnp.minimum(len_ref[b], S)
    half = hd // 2
    t = jnp.arange(BT)
    t_ok = t < T
    rows = pl.ds(0, BT)
    lo, hi = pl.ds(0, half), pl.ds(half, half)
    # the model dtype: with splits the output is float32 partials, but q, k and v stay in the
    # model dtype (Triton's dot takes operands of one element type)
    dt = dtype

    def load(ref_at, mask):
        return plgpu.load(ref_at, mask=mask, other=0)

    def load_qkv(head, cols):  # [BT, cols] of one head of the QKV row
        return load(qkv_ref.at[b, rows, head, cols], t_ok[:, None])

    c = load(cos_ref.at[b, rows, :], t_ok[:, None])  # [BT, half] f32
    s = load(sin_ref.at[b, rows, :], t_ok[:, None])

    def rope(head):  # rotate-half rope of one head of the QKV row, rounded to the model dtype
        x1 = load_qkv(head, lo).astype(jnp.float32)
        x2 = load_qkv(head, hi).astype(jnp.float32)
        return (x1 * c - x2 * s).astype(dt), (x2 * c + x1 * s).astype(dt)

    q1, q2 = rope(qh)
    k1, k2 = rope(Hq + kvh)
    vn = load_qkv(Hq + Hkv + kvh, slice(None))  # [BT, hd]

    def dot(a, b, trans_b=False):  # f32 accumulation; float32 models get no tf32 rounding
        return lax.dot_general(a, b, (((1,), (1 if trans_b else 0,)), ((), ())), preferred_element_type=jnp.float32,
                               precision=lax.Precision.HIGHEST if dt == jnp.float32 else None)

    def scores(a1, a2, b1, b2):
        return (dot(a1, b1, trans_b=True) + dot(a2, b2, trans_b=True)) * scale  # [BT, keys] f32

    # committed slots [0, n): online softmax over blocks of BLOCK_K keys
    kk = jnp.arange(BLOCK_K)

    # a window keeps the last `window` committed slots [first_key, n), counted from the row's cursor
    # (past the cache end too, as the einsum paths count); earlier key blocks are skipped
    first_key = jnp.minimum(jnp.maximum(len_ref[b] - window, 0), n) if window else None

    def body(j, carry):
        acc, m, l = carry
        block = first + j if first is not None else j
        idx = block * BLOCK_K + kk
        ok = idx < n
        if first_key is not None:
            ok = ok & (idx >= first_key)
        kb = pl.ds(block * BLOCK_K, BLOCK_K)
        c1 = load(k_out.at[layer, b, kb, kvh, lo], ok[:, None]).astype(dt)
        c2 = load(k_out.at[layer, b, kb, kvh, hi], ok[:, None]).astype(dt)
        cv = load(v_out.at[layer, b, kb, kvh, :], ok[:, None]).astype(dt)
        sc = jnp.where(ok[None, :], scores(q1, q2, c1, c2), NEG_INF)
        m_new = jnp.maximum(m, jnp.max(sc, axis=1))
        corr = jnp.exp(m - m_new)
        p = jnp.exp(sc - m_new[:, None])
        l = l * corr + jnp.sum(p, axis=1)
        acc = acc * corr[:, None] + dot(p.astype(dt), cv)
        return acc, m_new, l

    acc = jnp.zeros((BT, hd), jnp.float32)
    m = jnp.full((BT,), NEG_INF, jnp.float32)
    l = jnp.zeros((BT,), jnp.float32)
    # split sp takes key blocks [sp * per, (sp + 1) * per) of the row's committed ones (`body` reads `first`)
    n_blocks = pl.cdiv(n, BLOCK_K)
    start = first_key // BLOCK_K if first_key is not None else 0  # the window's first key block
    if splits > 1:
        per = pl.cdiv(n_blocks - start, splits)
        first, n_steps = start + sp * per, jnp.clip(n_blocks - start - sp * per, 0, per)
    elif first_key is not None:
        first, n_steps = start, n_blocks - start
    else:
        first, n_steps = None, n_blocks
    acc, m, l = lax.fori_loop(0, n_steps, body, (acc, m, l))

    # the T new tokens (pending slots n .. n+T-1), under their mask
    if causal:
        vis = t[None, :] <= t[:, None]
    else:
        vis = load(mask_ref.at[b, rows, rows], t_ok[:, None] & t_ok[None, :]) != 0
    if drop_past_end:
        # a new token whose slot falls past the cache end is dropped, as the einsum path's scatter does
        vis = vis & (t_ok & (n + t < S))[None, :]
    else:
        # the new tokens are attended from registers; their cache write is only a side effect
        vis = vis & t_ok[None, :]
    if splits > 1:
        vis = vis & (sp == splits - 1)  # the new tokens belong to the last split's partial result
    sc = jnp.where(vis, scores(q1, q2, k1, k2), NEG_INF)
    m_new = jnp.maximum(m, jnp.max(sc, axis=1))
    corr = jnp.exp(m - m_new)
    p = jnp.exp(sc - m_new[:, None])
    if splits > 1:  # a split that saw no key at all has m_new = NEG_INF, where exp(sc - m_new) is 1
        p = jnp.where(vis, p, 0.0)
    l = l * corr + jnp.sum(p, axis=1)
    acc = acc * corr[:, None] + dot(p.astype(dt), vn)
    if splits == 1:
        out = acc / l[:, None]
        plgpu.store(o_ref.at[b, rows, qh, :], out.astype(o_ref.dtype), mask=t_ok[:, None])
    else:  # unnormalised: (acc, max, sum) per split, combined by `combine_splits`
        m_ref, l_ref = stats_refs
        plgpu.store(o_ref.at[b, sp, rows, qh, :], acc, mask=t_ok[:, None])
        plgpu.store(m_ref.at[b, sp, rows, qh], m_new, mask=t_ok)
        plgpu.store(l_ref.at[b, sp, rows, qh], l, mask=t_ok)

    # write the new tokens' k, v once per KV group (slots past the cache end are dropped)
    @pl.when((qh % G == 0) & (sp == 0) if splits > 1 else qh % G == 0)
    def _():
        w_ok = (t_ok & (n + t < S))[:, None]
        slots = pl.ds(n, BT)
        cd = k_out.dtype
        plgpu.store(k_out.at[layer, b, slots, kvh, lo], k1.astype(cd), mask=w_ok)
        plgpu.store(k_out.at[layer, b, slots, kvh, hi], k2.astype(cd), mask=w_ok)
        plgpu.store(v_out.at[layer, b, slots, kvh, :], vn.astype(v_out.dtype), mask=w_ok)


def split_attention() -> bool:
    """$JSPEC_SPLIT_ATTENTION (read when a program is traced): "1" (default) splits each row's
    committed keys over several programs per (row, head) where the cache is long
    (`attention_splits`); "0" keeps one program per (row, head). On an H100 (bf16, `longdoc`'s
    2-4k-token prompts) splitting made plain decoding 1.78x faster at batch 1 and 1.18x at batch 16.
    Short caches gain too, less: on an H200 at batch 1 (prompt 64, 384 slots) splitting made
    SmolLM2-135M's decoding 5% faster and its 60-node tree verify 7%; a decode step's attention
    took 8.0 -> 5.3 µs a layer at the Llama-3.2-1B shape and 10.1 -> 6.5 µs at Llama-3.1-8B."""
    value = os.environ.get("JSPEC_SPLIT_ATTENTION", "1")
    if value not in ("0", "1"):
        raise ValueError(f"JSPEC_SPLIT_ATTENTION={value!r}: expected 0 or 1")
    return value == "1"


SPLIT_MIN_SLOTS = 256  # [I] caches shorter than this keep one program per (row, head)
SPLIT_MIN_BLOCKS = 2  # [I] key blocks a split covers at least (of the cache's slots)
SPLIT_TARGET_PROGRAMS = 264  # [I] about two programs per SM of an H100 / H200 (132 SMs)
MAX_SPLITS = 16


def attention_splits(batch: int, num_heads: int, slots: int) -> int:
    """Programs per (row, query head) over the committed keys. One program walks a row's whole
    context: at batch 1 a 9-head model keeps 9 SMs busy, so a 4k-token context costs ~64
    sequential key blocks per layer, and even a few hundred slots leave each program a chain of
    dependent block loads. Caches of SPLIT_MIN_SLOTS or more at small batch split the keys so that
    about SPLIT_TARGET_PROGRAMS programs run, each over at least SPLIT_MIN_BLOCKS key blocks of the
    cache; the partial results are combined in one small fusion (`combine_splits`)."""
    if not split_attention() or slots < SPLIT_MIN_SLOTS or batch * num_heads >= SPLIT_TARGET_PROGRAMS:
        return 1
    return max(1, min(MAX_SPLITS, -(-SPLIT_TARGET_PROGRAMS // (batch * num_heads)),
                      slots // (SPLIT_MIN_BLOCKS * BLOCK_K)))


def combine_splits(acc, m, l, dtype):
    """Per-split (acc [B, P, T, Hq, hd], running max m and sum l [B, P, T, Hq]) -> the softmax
    average over all of them [B, T, Hq, hd]. A split that saw no key has l = 0 and weighs 0."""
    top = jnp.max(m, axis=1, keepdims=True)
    w = jnp.exp(m - top)
    return (jnp.sum(acc * w[..., None], axis=1) / jnp.sum(l * w, axis=1)[..., None]).astype(dtype)


def fused_block_attention(qkv, cos, sin, k_cache, v_cache, layer, lengths, new_mask, *, num_heads, num_kv_heads,
                          scale, interpret=False, num_warps=4, drop_past_end=True, splits=None, window=None):
    """Attention of T new tokens over a stacked cache, writing their K/V; one kernel.

    qkv [B, T, Hq + 2*Hkv, hd] (before rope); cos, sin [B, T, hd//2] float32; k_cache, v_cache
    [L, B, S, Hkv, hd]; layer: int32 scalar (which layer of the cache); lengths [B] committed
    slots; new_mask [B, T, T] (nonzero = visible) or None for causal.
    Returns (out [B, T, Hq, hd], k_cache, v_cache) with slots lengths[b] + t of `layer` written.
    Writes to slots past the cache end are dropped; `drop_past_end` says whether those tokens are
    also hidden from the block (model.forward: the einsum path reads keys back from the cache) or
    still attended (draft heads, whose einsum path attends to the new tokens' own K/V).
    splits: programs per (row, head) over the committed keys (None: `attention_splits`).
    window: attend only to the last `window` committed slots of each row (None: all of them).
    """
    B, T, H3, hd = qkv.shape
    assert H3 == num_heads + 2 * num_kv_heads and T <= MAX_BLOCK, (qkv.shape, num_heads, num_kv_heads)
    dtype = jnp.dtype(qkv.dtype)
    BT = max(16, _next_pow2(T))
    causal = new_mask is None
    mask = jnp.zeros((1, 1, 1), jnp.int32) if causal else new_mask.astype(jnp.int32)
    splits = attention_splits(B, num_heads, k_cache.shape[2]) if splits is None else splits
    shape = dict(T=T, BT=BT, G=num_heads // num_kv_heads, Hq=num_heads, Hkv=num_kv_heads, hd=hd, scale=float(scale),
                 causal=causal, drop_past_end=drop_past_end, splits=splits, dtype=dtype, window=int(window or 0))
    layer = jnp.reshape(jnp.asarray(layer, jnp.int32), (1,))
    out, k_cache, v_cache, *split_stats = _kernel_call(layer, lengths.astype(jnp.int32), qkv, cos, sin, mask, k_cache,
                                                       v_cache, shape=tuple(shape.items()), num_warps=num_warps,
                                                       interpret=interpret)
    if splits > 1:
        out = combine_splits(out, *split_stats, dtype)
    return out, k_cache, v_cache


@functools.partial(jax.jit, static_argnames=("shape", "num_warps", "interpret"))
def _kernel_call(layer, lengths, qkv, cos, sin, mask, k_cache, v_cache, *, shape, num_warps, interpret):
    """The kernel's launch as a program of its own: every layer of a forward launches it with the
    same shapes, and JAX traces and lowers such a call once per program instead of once per layer
    (the Triton lowering of each launch was most of a program's lowering); XLA inlines it."""
    kw = dict(shape)
    B, T, _, hd = qkv.shape
    Hq, splits, dtype = kw["Hq"], kw["splits"], kw["dtype"]
    if splits == 1:
        outs = (jax.ShapeDtypeStruct((B, T, Hq, hd), dtype),)
    else:
        outs = (jax.ShapeDtypeStruct((B, splits, T, Hq, hd), jnp.float32),)
    caches = (jax.ShapeDtypeStruct(k_cache.shape, k_cache.dtype), jax.ShapeDtypeStruct(v_cache.shape, v_cache.dtype))
    stats = (jax.ShapeDtypeStruct((B, splits, T, Hq), jnp.float32),) * 2 if splits > 1 else ()
    return pl.pallas_call(
        functools.partial(_kernel, **kw),
        grid=(B, Hq, splits) if splits > 1 else (B, Hq),
        out_shape=(*outs, *caches, *stats),
        input_output_aliases={6: 1, 7: 2},
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=2),
        interpret=interpret,
        name="jspec_block_attention",
    )(layer, lengths, qkv, cos, sin, mask, k_cache, v_cache)
