"""The target decoder: pure functions over a parameter pytree, layers stacked and run under `scan`.

Parameter layout (a plain dict; every per-layer array has a leading layer axis L):

    embed        [V, D]
    lm_head      [D, V]          absent when cfg.tie_word_embeddings (embed.T is used)
    final_norm   [D]
    layers/
      attn_norm      [L, D]
      wqkv           [L, D, Hq*hd + 2*Hkv*hd]   q, k, v projections fused (q | k | v)
      bqkv           [L, Hq*hd + 2*Hkv*hd]      only when cfg.attention_bias (Qwen2)
      q_norm, k_norm [L, hd]                    only when cfg.qk_norm (Qwen3, Gemma3)
      wo             [L, Hq*hd, D]
      post_attn_norm [L, D]                     only when cfg.sandwich_norm (Gemma3)
      mlp_norm       [L, D]
      w_gate_up      [L, D, 2F]                 gate | up fused
      w_down         [L, F, D]
      post_mlp_norm  [L, D]                     only when cfg.sandwich_norm (Gemma3)

Every norm weight is stored as the multiplier actually applied (Gemma's `1 + w` is folded in when
loading), so one RMSNorm serves all families. Q/K rows are in Hugging Face order (rotate-half rope).

Fusing q/k/v and gate/up halves the number of matmul launches per layer; at batch 1 a 135M model
is launch-bound, not bandwidth-bound, so kernel count is what decode speed is made of. On a single
GPU, blocks of up to 64 new tokens (decode, chain and tree verify) also replace the ~10 kernels of
rope, cache scatters, per-layer cache slices and einsum attention with one Pallas kernel
(jspec/kernels/decode_attention.py) that updates the stacked cache in place: 22 -> 12 kernels a
layer for SmolLM2-135M (plus the scan counter), 1.22 -> 1.04 ms a decode step at batch 1 on an H200.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import os
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from .config import ModelConfig, rope_inv_freq
from .kernels import decode_attention as fused_attn
from .kernels import matvec as MV
from .sharding import TP_AXIS, in_tensor_parallel

NEG_INF = -1e30  # finite, so fully-masked rows never produce NaN

# How `forward` runs a layer (all compute the same function; "xla" is the reference):
#   "xla"     portable einsum attention + XLA matmuls (CPU, TPU, GSPMD-partitioned programs, prefill, every family);
#   "pallas"  one fused Pallas/Triton kernel per layer for rope + cache write + attention, for blocks
#             of up to fused_attn.MAX_BLOCK tokens (decode, chain and tree verify), and the
#             bandwidth-bound matvec kernel (kernels/matvec.py) for every projection and the LM head
#             of up to matvec.MAX_ROWS rows whose shape its tuning table (or rule) gives it; it reads
#             stacked weights in place by layer index. Calls or families it doesn't cover fall
#             back to "xla";
#   "cudnn"   cuDNN flash attention (jax.nn.dot_product_attention) inside the "xla" layer.
# Off GPU the Pallas kernels run in interpret mode (slow; what the CPU tests check them with).
KERNEL_IMPLS = ("xla", "pallas", "cudnn")


_PER_DEVICE_PROGRAM = contextvars.ContextVar("jspec_per_device_program", default=False)


@contextlib.contextmanager
def per_device_program(on: bool = True):
    """Within this context, programs traced are known to run whole on each device (one device, or a
    fully manual shard_map such as data parallelism), so default_kernels() may pick the GPU kernels
    on a host with several GPUs. jspec.generate enters it for every mesh without a model axis."""
    token = _PER_DEVICE_PROGRAM.set(bool(on))
    try:
        yield
    finally:
        _PER_DEVICE_PROGRAM.reset(token)


def default_kernels() -> str:
    """$JSPEC_KERNELS if set, else "pallas" on GPU for a program that runs whole on each device
    (a single-GPU host, or inside `per_device_program`), else "xla".

    A pallas_call is not partitioned by GSPMD, so a program that may be partitioned (several local
    devices, no per_device_program context) keeps the portable path.
    """
    env = os.environ.get("JSPEC_KERNELS")
    if env:
        if env not in KERNEL_IMPLS:
            raise ValueError(f"JSPEC_KERNELS={env!r}: expected one of {', '.join(KERNEL_IMPLS)}")
        return env
    if jax.default_backend() != "gpu":
        return "xla"
    return "pallas" if _PER_DEVICE_PROGRAM.get() or jax.local_device_count() == 1 else "xla"


def fused_attention_supported(cfg: ModelConfig, T: int, new_mask: jax.Array | None) -> bool:
    """Whether the fused attention kernel handles this call (else the einsum path runs)."""
    return (
        not cfg.has_sliding
        and not cfg.attn_logit_softcap
        and cfg.head_dim >= 32
        and cfg.head_dim & (cfg.head_dim - 1) == 0  # Triton tiles are powers of two (rope halves too)
        and T <= fused_attn.MAX_BLOCK
        and (new_mask is None or new_mask.shape[-1] == T)
    )


def matmul(x: jax.Array, w: jax.Array, *, transposed: bool = False, out_dtype=None, kernels: str | None = None):
    """x [..., K] @ w [K, N] (or @ w.T for w [N, K] when `transposed`) in out_dtype (default x's).

    Products of few rows go to the matvec kernel when `kernels` (default `default_kernels()`) is
    "pallas" and its block choice (kernels/matvec.py's pick_blocks) serves the shape; everything
    else is XLA's dot. The kernel differentiates through XLA's dots."""
    rows = int(np.prod(x.shape[:-1]))
    N = w.shape[-2] if transposed else w.shape[-1]
    blocks = None
    if (kernels or default_kernels()) == "pallas":
        blocks = MV.pick_blocks(rows, x.shape[-1], N, transposed=transposed, dtype=w.dtype)
    if blocks is not None:
        return MV.matvec(x, w, transposed=transposed, blocks=blocks, out_dtype=out_dtype,
                         interpret=jax.default_backend() != "gpu")
    w = w.T if transposed else w
    return x @ w if out_dtype is None else jnp.dot(x, w, preferred_element_type=out_dtype)


@struct.dataclass
class KVCache:
    """Static, preallocated KV cache with a per-row cursor.

    Slots [0, lengths[b]) of row b hold committed tokens whose position equals their slot index.
    A forward pass writes its T new tokens at slots lengths[b] + t without moving the cursor;
    `commit` (or `advance`) decides what becomes part of the prefix.
    """

    k: jax.Array  # [L, B, S, Hkv, hd]
    v: jax.Array  # [L, B, S, Hkv, hd]
    lengths: jax.Array  # [B] int32

    @property
    def max_len(self) -> int:
        return self.k.shape[2]

    @property
    def batch(self) -> int:
        return self.k.shape[1]


def init_cache(cfg: ModelConfig, batch: int, max_len: int, dtype=jnp.float32, num_layers=None) -> KVCache:
    n = cfg.num_layers if num_layers is None else num_layers
    shape = (n, batch, max_len, cfg.num_kv_heads, cfg.head_dim)
    return KVCache(
        k=jnp.zeros(shape, dtype), v=jnp.zeros(shape, dtype), lengths=jnp.zeros((batch,), jnp.int32)
    )


def advance(cache: KVCache, n: jax.Array) -> KVCache:
    """Accept the first n[b] freshly written slots of each row (a chain: no K/V moves)."""
    return cache.replace(lengths=cache.lengths + n.astype(jnp.int32))


def commit(cache: KVCache, accepted: jax.Array, n: jax.Array) -> KVCache:
    """Keep a subset of the slots written by the last forward, contiguously.

    accepted: [B, A] indices (relative to each row's cursor) of the slots to keep, in order;
    n: [B] how many of them are valid. Slot lengths[b] + accepted[b, i] moves to lengths[b] + i,
    then the cursor advances by n. Static shapes: rows keep their A entries whatever n is; entries
    past n land beyond the new cursor and are ignored.
    """
    B, A = accepted.shape
    src = cache.lengths[:, None] + accepted  # [B, A]
    dst = cache.lengths[:, None] + jnp.arange(A, dtype=jnp.int32)[None]
    b = jnp.arange(B)[:, None]

    def move(x):  # x [L, B, S, H, D]
        vals = x[:, b, src]  # [L, B, A, H, D]
        return x.at[:, b, dst].set(vals, mode="drop")

    return KVCache(k=move(cache.k), v=move(cache.v), lengths=cache.lengths + n.astype(jnp.int32))


# ---------------------------------------------------------------------------------------------
# Building blocks
# ---------------------------------------------------------------------------------------------


def embed(params: dict, cfg: ModelConfig, tokens: jax.Array) -> jax.Array:
    """Input embeddings of `tokens`, embed_scale included (Gemma scales them by sqrt(D))."""
    x = params["embed"][tokens]
    if cfg.embed_scale != 1.0:
        x = x * jnp.asarray(cfg.embed_scale, x.dtype)
    return x


def rms_norm(x: jax.Array, w: jax.Array, eps: float) -> jax.Array:
    xf = x.astype(jnp.float32)
    xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return (xf * w.astype(jnp.float32)).astype(x.dtype)


def rope_tables(inv_freq: jax.Array, positions: jax.Array) -> tuple[jax.Array, jax.Array]:
    """cos, sin of shape [B, T, hd] (rotate-half layout) for integer positions [B, T]."""
    ang = positions.astype(jnp.float32)[..., None] * inv_freq  # [B, T, hd/2]
    ang = jnp.concatenate([ang, ang], axis=-1)
    return jnp.cos(ang), jnp.sin(ang)


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """x [B, T, H, hd]; cos/sin [B, T, hd]."""
    half = x.shape[-1] // 2
    xf = x.astype(jnp.float32)
    rot = jnp.concatenate([-xf[..., half:], xf[..., :half]], axis=-1)
    return (xf * cos[:, :, None] + rot * sin[:, :, None]).astype(x.dtype)


def _activation(cfg: ModelConfig, x: jax.Array) -> jax.Array:
    """The gated MLP's activation (cfg.mlp_activation): "silu" (SwiGLU) or "gelu_tanh" (GeGLU)."""
    if cfg.mlp_activation == "gelu_tanh":
        return jax.nn.gelu(x, approximate=True)
    if cfg.mlp_activation == "silu":
        return jax.nn.silu(x)
    raise ValueError(f"mlp activation {cfg.mlp_activation!r}: expected silu or gelu_tanh")


def attention_mask(
    cache: KVCache, positions: jax.Array, new_mask: jax.Array | None
) -> tuple[jax.Array, jax.Array]:
    """Visibility [B, T, S] of every cache slot for each new token, and each slot's position [B, S].

    Committed slots (< cursor) are visible to every new token. The P slots after the cursor are
    "pending": new_mask [B, T, P] says which of them new token t sees (causal when None, an
    ancestor mask for trees). The T new tokens occupy the last T pending slots (`new_slots`), so a
    tree can be drafted level by level (P grows by a level each call, P == T otherwise).
    """
    B, T = positions.shape
    P = T if new_mask is None else new_mask.shape[-1]
    S = cache.max_len
    j = jnp.arange(S, dtype=jnp.int32)[None, :]  # [1, S]
    rel = j - cache.lengths[:, None]  # [B, S]: index into the pending region
    in_new = (rel >= 0) & (rel < P)
    rel_c = jnp.clip(rel, 0, P - 1)
    if new_mask is None:
        new_vis = rel_c[:, None, :] <= jnp.arange(T)[None, :, None]  # causal [B, T, S]
    else:
        new_vis = jnp.take_along_axis(new_mask, jnp.broadcast_to(rel_c[:, None, :], (B, T, S)), axis=2)
    committed = rel < 0
    visible = committed[:, None, :] | (in_new[:, None, :] & new_vis)
    # Slot positions matter only for sliding windows; pending slots before the current block
    # (level-by-level tree drafting, heads without sliding windows) use their slot index.
    cur = rel - (P - T)
    key_pos = jnp.where(committed | (cur < 0), j, jnp.take_along_axis(positions, jnp.clip(cur, 0, T - 1), axis=1))
    return visible, key_pos


def new_slots(cache: KVCache, T: int, new_mask: jax.Array | None = None) -> jax.Array:
    """Cache slots [B, T] the T new tokens are written to: the tail of the pending region."""
    P = T if new_mask is None else new_mask.shape[-1]
    return cache.lengths[:, None] + (P - T) + jnp.arange(T, dtype=jnp.int32)[None]


class ForwardOut(NamedTuple):
    hidden: jax.Array  # [B, T, D] after the final norm: what the LM head reads (EAGLE-1 feature);
    # the raw residual stream when forward(final_norm=False)
    captured: tuple  # inputs of the requested layers, each [B, T, D] (EAGLE-3 features)
    cache: KVCache


def forward(
    params: dict,
    cfg: ModelConfig,
    tokens: jax.Array,
    cache: KVCache,
    *,
    positions: jax.Array | None = None,
    new_mask: jax.Array | None = None,
    capture: tuple[int, ...] = (),
    layer_range: tuple[int, int] | None = None,
    unroll: int | bool | None = None,
    kernels: str | None = None,
    hidden_in: jax.Array | None = None,
    final_norm: bool = True,
    layer_sliding: jax.Array | None = None,
) -> ForwardOut:
    """Run T new tokens per row against the cache.

    tokens [B, T] int; positions [B, T] (default lengths[b] + t); new_mask [B, T, T] bool says
    which of the new tokens each new token attends to (default: causal). K/V of the new tokens
    are written at slots lengths[b] + t; the cursor does not move. `capture` lists layer indices
    whose *input* hidden state is returned (EAGLE-3 fuses layers 2, L//2, L-3). `layer_range`
    runs only layers [a, b) (early-exit drafting shares the target's cache for those layers).
    `kernels` picks the implementation (KERNEL_IMPLS; default `default_kernels()`); all of them
    compute the same function. `unroll` is the layer scan's unroll; None (auto) unrolls every layer
    on the fused-attention path (blocks of at most 64 tokens on a GPU: the loop's per-layer
    overhead is a few percent of a launch-bound decode or verify step) and scans one layer at a
    time on the portable path. Prompt forwards pass 1 (decode.prefill does): they run once per
    generation, and unrolling them only lengthens the compile.

    Pipelines (PPSD's two stages, an exit head behind layer E) feed one layer range's output into
    the next: `hidden_in` [B, T, D] replaces the token embeddings as the input of layer `lo`
    (tokens may then be None), and `final_norm=False` returns the raw residual stream after layer
    `hi - 1` instead of the final-normed hidden state, so running (0, E) then (E, L) this way
    computes exactly what one full forward computes. `layer_sliding` [hi - lo] bool, when given,
    replaces cfg.sliding_layers[lo:hi] as the per-layer sliding-window flags (it may be traced: a
    PPSD stage picks its layers per device); cfg must then have sliding layers.
    """
    if hidden_in is not None:
        B, T = hidden_in.shape[:2]
    else:
        B, T = tokens.shape
    if cfg.fixed_block and hidden_in is None and new_mask is None and T <= cfg.fixed_block:
        return _forward_fixed_block(params, cfg, tokens, cache, positions=positions, capture=capture,
                                    layer_range=layer_range, final_norm=final_norm, layer_sliding=layer_sliding)
    dtype = params["embed"].dtype
    if positions is None:
        positions = cache.lengths[:, None] + jnp.arange(T, dtype=jnp.int32)[None]
    lo, hi = layer_range if layer_range is not None else (0, cfg.num_layers)

    x = hidden_in.astype(dtype) if hidden_in is not None else embed(params, cfg, tokens)

    visible, key_pos = attention_mask(cache, positions, new_mask)
    cos_g, sin_g = rope_tables(jnp.asarray(rope_inv_freq(cfg, cfg.rope_theta)), positions)
    if cfg.has_sliding:
        local_theta = cfg.rope_local_theta or cfg.rope_theta
        # Gemma applies the configured rope scaling to global layers only.
        cos_l, sin_l = rope_tables(
            jnp.asarray(rope_inv_freq(cfg, local_theta, scaled=cfg.arch != "gemma3")), positions
        )
        in_window = (positions[:, :, None] - key_pos[:, None, :]) < cfg.sliding_window
        sliding = jnp.asarray(np.array(cfg.sliding_layers[lo:hi], dtype=bool)) if layer_sliding is None else layer_sliding
    else:
        sliding = jnp.zeros((hi - lo,), bool)

    b_idx = jnp.arange(B)[:, None]
    slots = new_slots(cache, T, new_mask)  # [B, T]
    G = cfg.num_heads // cfg.num_kv_heads
    hd = cfg.head_dim
    impl = kernels or default_kernels()
    if impl not in KERNEL_IMPLS:
        raise ValueError(f"kernels={impl!r}: expected one of {', '.join(KERNEL_IMPLS)}")
    per_layer = isinstance(params["layers"], (tuple, list))  # loop_params' layout
    if per_layer and not (impl == "pallas" and unroll in (None, True) and fused_attention_supported(cfg, T, new_mask)):
        params = {**params, "layers": stack_layers(params["layers"])}  # a path that scans: one stacked copy
        per_layer = False
    if per_layer:
        layer_params = params["layers"][lo:hi]
    elif (lo, hi) != (0, cfg.num_layers):
        layer_params = jax.tree.map(lambda a: a[lo:hi], params["layers"])
    else:
        layer_params = params["layers"]
    def dot(x, p, name):  # the portable product; `mm` below may replace it by the matvec kernel
        return x @ p[name]

    def project_qkv(h, p, mm=dot):  # [B, T, q_size + 2 * kv_size], before rope
        qkv = mm(rms_norm(h, p["attn_norm"], cfg.rms_norm_eps), p, "wqkv")
        return qkv + p["bqkv"] if cfg.attention_bias else qkv

    def row_parallel(y):  # tensor parallelism: this device's share of wo / w_down -> the full product
        return jax.lax.psum(y, TP_AXIS) if cfg.tensor_parallel_shards > 1 else y

    def mlp(m, p, mm=dot):  # the gated MLP: gate | up, act(gate) * up, down
        gu = mm(m, p, "w_gate_up")
        F = gu.shape[-1] // 2
        return mm(_activation(cfg, gu[..., :F]) * gu[..., F:], p, "w_down")

    def attn_out_and_mlp(h, o, p, mm=dot):  # o [B, T, q_size] -> next hidden state
        o = row_parallel(mm(o, p, "wo"))
        if cfg.sandwich_norm:
            o = rms_norm(o, p["post_attn_norm"], cfg.rms_norm_eps)
        h = h + o
        m = row_parallel(mlp(rms_norm(h, p["mlp_norm"], cfg.rms_norm_eps), p, mm))
        if cfg.sandwich_norm:
            m = rms_norm(m, p["post_mlp_norm"], cfg.rms_norm_eps)
        return h + m

    if impl == "pallas" and fused_attention_supported(cfg, T, new_mask):
        # The whole stacked cache rides in the scan carry and the kernel updates it in place: no
        # per-layer cache slices, no scatters, no stacking of per-layer outputs.
        half = hd // 2
        cos_h, sin_h = cos_g[..., :half], sin_g[..., :half]  # rotate-half tables repeat the halves
        interpret = jax.default_backend() != "gpu"
        rows = B * T
        W = params["layers"]
        big = ("wqkv", "wo", "w_gate_up", "w_down")
        # Products the matvec kernel takes (by shape); it indexes stacked weights by layer itself,
        # so the scan then carries only the small per-layer leaves and XLA slices no big weight.
        shapes = {n: (W[0] if per_layer else W)[n].shape[-2:] for n in big}
        blocks = {n: MV.pick_blocks(rows, *shapes[n], transposed=False, dtype=dtype, in_place=not per_layer)
                  for n in big}
        in_place = {n for n in big if blocks[n] is not None and not per_layer}

        def layer_mm(li):
            def mm(x, p, name):
                if blocks[name] is None:
                    return x @ p[name]
                w = W[name] if name in in_place else p[name]
                return MV.matvec(x, w, layer=li if name in in_place else None, blocks=blocks[name],
                                 interpret=interpret)
            return mm

        def attend(qkv, kc, vc, li):  # qkv [B, T, q_size + 2 * kv_size]
            x = qkv.reshape(B, T, cfg.num_heads + 2 * cfg.num_kv_heads, hd)
            o, kc, vc = fused_attn.fused_block_attention(
                x, cos_h, sin_h, kc, vc, li, cache.lengths, new_mask, num_heads=cfg.num_heads,
                num_kv_heads=cfg.num_kv_heads, scale=cfg.attn_scale, interpret=interpret)
            return o.reshape(B, T, cfg.q_size), kc, vc

        def qk_normed(qkv, p):
            q = rms_norm(qkv[..., : cfg.q_size].reshape(B, T, cfg.num_heads, hd), p["q_norm"], cfg.rms_norm_eps)
            k = rms_norm(qkv[..., cfg.q_size : cfg.q_size + cfg.kv_size].reshape(B, T, cfg.num_kv_heads, hd),
                         p["k_norm"], cfg.rms_norm_eps)
            return jnp.concatenate([q.reshape(B, T, -1), k.reshape(B, T, -1), qkv[..., cfg.q_size + cfg.kv_size :]], -1)

        def fused_layer(carry, xs):
            h, kc, vc = carry
            p, li = xs
            mm = layer_mm(li)
            qkv = project_qkv(h, p, mm)
            if cfg.qk_norm:
                qkv = qk_normed(qkv, p)
            o, kc, vc = attend(qkv, kc, vc, li)
            h_next = attn_out_and_mlp(h, o, p, mm)
            return (h_next, kc, vc), (h if capture else None)

        if per_layer:  # unrolled over each layer's own buffers: no weight slices to copy
            carry, h_ins = (x, cache.k, cache.v), []
            for li, p in zip(range(lo, hi), layer_params):
                carry, h_in = fused_layer(carry, (p, jnp.int32(li)))
                h_ins.append(h_in)
            x, k_all, v_all = carry
        else:
            layer_ids = jnp.arange(lo, hi, dtype=jnp.int32)
            scanned = {n: a for n, a in layer_params.items() if n not in in_place}
            (x, k_all, v_all), h_ins = jax.lax.scan(fused_layer, (x, cache.k, cache.v), (scanned, layer_ids),
                                                     unroll=True if unroll is None else unroll)
        hidden = rms_norm(x, params["final_norm"], cfg.rms_norm_eps) if final_norm else x
        captured = tuple(h_ins[i - lo] for i in capture) if capture else ()
        return ForwardOut(hidden, captured, cache.replace(k=k_all, v=v_all))

    if impl == "cudnn":
        if cfg.attn_logit_softcap:
            raise ValueError("attention='cudnn' does not support attention logit soft-capping")
        bias_g = jnp.where(visible, 0.0, NEG_INF).astype(dtype)[:, None]  # [B, 1, T, S]
        if cfg.has_sliding:
            bias_l = jnp.where(visible & in_window, 0.0, NEG_INF).astype(dtype)[:, None]

    def layer(carry, xs):
        # The stacked cache rides in the carry and each layer writes only its new slots (a scatter
        # XLA does in place): scanning over per-layer cache slices instead would emit a whole new
        # cache per forward (a zero-filled output plus every layer's slice rewritten), several
        # times the attention's own cache reads on a long context.
        h, k_all, v_all = carry
        p, li, is_sliding = xs
        h_in = h
        qkv = project_qkv(h, p)
        q = qkv[..., : cfg.q_size].reshape(B, T, cfg.num_heads, hd)
        k = qkv[..., cfg.q_size : cfg.q_size + cfg.kv_size].reshape(B, T, cfg.num_kv_heads, hd)
        v = qkv[..., cfg.q_size + cfg.kv_size :].reshape(B, T, cfg.num_kv_heads, hd)
        if cfg.qk_norm:
            q = rms_norm(q, p["q_norm"], cfg.rms_norm_eps)
            k = rms_norm(k, p["k_norm"], cfg.rms_norm_eps)
        if cfg.has_sliding:
            cos = jnp.where(is_sliding, cos_l, cos_g)
            sin = jnp.where(is_sliding, sin_l, sin_g)
            mask = visible & (in_window | ~is_sliding)
        else:
            cos, sin, mask = cos_g, sin_g, visible
        q = apply_rope(q, cos, sin)
        k = apply_rope(k, cos, sin)
        # One scatter per layer for the whole batch: rows write at their own cursors.
        k_all = k_all.at[li, b_idx, slots].set(k.astype(k_all.dtype), mode="drop")
        v_all = v_all.at[li, b_idx, slots].set(v.astype(v_all.dtype), mode="drop")
        kc = k_all[li].astype(dtype)  # [B, S, Hkv, hd]
        vc = v_all[li].astype(dtype)
        if impl == "cudnn":
            bias = jnp.where(is_sliding, bias_l, bias_g) if cfg.has_sliding else bias_g
            o = jax.nn.dot_product_attention(q, kc, vc, bias=bias, scale=cfg.attn_scale, implementation="cudnn")
            o = o.reshape(B, T, cfg.q_size)
        else:
            qg = q.reshape(B, T, cfg.num_kv_heads, G, hd)
            s = jnp.einsum("bthgd,bshd->bhgts", qg, kc, preferred_element_type=jnp.float32)
            s = s * cfg.attn_scale
            if cfg.attn_logit_softcap:
                s = jnp.tanh(s / cfg.attn_logit_softcap) * cfg.attn_logit_softcap
            s = jnp.where(mask[:, None, None], s, NEG_INF)
            w = jax.nn.softmax(s, axis=-1).astype(dtype)
            o = jnp.einsum("bhgts,bshd->bthgd", w, vc).reshape(B, T, cfg.q_size)
        return (attn_out_and_mlp(h, o, p), k_all, v_all), (h_in if capture else None)

    layer_ids = jnp.arange(lo, hi, dtype=jnp.int32)
    (x, k_all, v_all), h_ins = jax.lax.scan(layer, (x, cache.k, cache.v), (layer_params, layer_ids, sliding),
                                            unroll=1 if unroll is None else unroll)
    hidden = rms_norm(x, params["final_norm"], cfg.rms_norm_eps) if final_norm else x
    captured = tuple(h_ins[i - lo] for i in capture) if capture else ()
    return ForwardOut(hidden, captured, cache.replace(k=k_all, v=v_all))


def _forward_fixed_block(params, cfg: ModelConfig, tokens, cache: KVCache, *, positions, capture, layer_range,
                         final_norm, layer_sliding) -> ForwardOut:
    """`forward` of T <= cfg.fixed_block causal tokens as a block of exactly fixed_block (cfg's
    comment). Why the same shape gives the same bits: a matrix product's per-row arithmetic (its
    blocking, its order of summation) is chosen by the product's shape, never by the other rows'
    values, and the portable attention writes the new keys first and then reduces over the whole
    cache, each key at its own slot, so a token's scores sum in one order whether it came alone (a
    decode step) or behind the round's last token (a verify block). The padding tokens sit after
    the real ones (causal: no real token sees them); their keys land in slots past the block,
    which no query reads before a real token overwrites them, or past the cache, where the write
    is dropped."""
    B, T = tokens.shape
    pad = cfg.fixed_block - T
    if pad:
        tokens = jnp.pad(tokens, ((0, 0), (0, pad)), constant_values=cfg.pad_token_id)
        if positions is not None:
            positions = jnp.concatenate([positions, positions[:, -1:] + 1 + jnp.arange(pad, dtype=positions.dtype)[None]], 1)
    out = forward(params, cfg.replace(fixed_block=0), tokens, cache, positions=positions, capture=capture,
                  layer_range=layer_range, kernels="xla", final_norm=final_norm, layer_sliding=layer_sliding)
    return ForwardOut(out.hidden[:, :T], tuple(c[:, :T] for c in out.captured), out.cache)


# Weights of at most this many bytes get per-layer copies in loop_params [I]: the copies double
# the layers' memory for the whole generation, which matters little for the launch-bound small
# models that the unrolled path serves and too much for large ones.
LOOP_PARAMS_MAX_BYTES = 2 << 30


def stack_layers(layers) -> dict:
    """Per-layer weight dicts (loop_params' layout) -> the stacked [L, ...] layout."""
    return jax.tree.map(lambda *a: jnp.stack(a), *layers)


def loop_params(params: dict, cfg: ModelConfig, *, unroll=None, kernels: str | None = None) -> dict:
    """The target weights a decode/verify loop body should close over.

    Inside a loop, the unrolled fused path takes layer i's weights as a slice of the stacked
    [L, ...] arrays, and XLA copies those slices for its GEMM kernels on every call: about 250 µs
    of a 60-node tree verify's 1.27 ms on an H200 (SmolLM2-135M). Called inside the jitted
    generation before its loop, this makes one copy per layer per generation instead, as a tuple
    of per-layer dicts that `forward` reads directly. Other paths (portable einsums, an explicit
    unroll, large weights) get `params` unchanged; `forward` restacks the tuple if a call ever
    needs the scan (a prompt, a block over 64 tokens).
    """
    impl = "xla" if cfg.fixed_block else kernels or default_kernels()  # fixed blocks run the portable scan
    layers = params["layers"]
    if impl != "pallas" or unroll is not None or isinstance(layers, (tuple, list)):
        return params
    if sum(a.size * a.dtype.itemsize for a in jax.tree.leaves(layers)) > LOOP_PARAMS_MAX_BYTES:
        return params
    return {**params, "layers": tuple(jax.tree.map(lambda a: a[i], layers) for i in range(cfg.num_layers))}


def lm_head(params: dict, cfg: ModelConfig, hidden: jax.Array, *, kernels: str | None = None) -> jax.Array:
    """Logits in float32 from final-normed hidden states [..., D] (`kernels` as in `forward`).
    Under tensor parallelism (inside sharding.tensor_parallel_map) an untied LM head holds one
    device's slice of the vocabulary; the slices' logits are gathered. Elsewhere a weight of
    other columns (a reduced draft vocabulary's) gives logits over just those. With
    cfg.fixed_block, hidden states [B, D] (a decode step's) or [B, T <= fixed_block, D] (a
    verify block's) are padded to [B, fixed_block, D] first, so both multiply the same shape."""
    if cfg.fixed_block and hidden.ndim in (2, 3) and (hidden.ndim == 2 or hidden.shape[1] <= cfg.fixed_block):
        block = hidden[:, None] if hidden.ndim == 2 else hidden
        block = jnp.pad(block, ((0, 0), (0, cfg.fixed_block - block.shape[1]), (0, 0)))
        logits = lm_head(params, cfg.replace(fixed_block=0), block, kernels="xla")
        return logits[:, 0] if hidden.ndim == 2 else logits[:, : hidden.shape[1]]
    tied = cfg.tie_word_embeddings or "lm_head" not in params
    w = params["embed"] if tied else params["lm_head"]  # [V, D] read transposed, or [D, V]
    logits = matmul(hidden, w, transposed=tied, out_dtype=jnp.float32, kernels=kernels)
    if logits.shape[-1] != cfg.vocab_size and in_tensor_parallel():  # this device's slice of the vocabulary
        logits = jax.lax.all_gather(logits, TP_AXIS, axis=logits.ndim - 1, tiled=True)
    if cfg.final_logit_softcap:
        logits = jnp.tanh(logits / cfg.final_logit_softcap) * cfg.final_logit_softcap
    return logits


def init_params(cfg: ModelConfig, key: jax.Array, dtype=jnp.float32, scale: float = 0.02) -> dict:
    """Random parameters in jspec's layout (tests and freshly initialised draft models)."""
    L, D, F, V, hd = cfg.num_layers, cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size, cfg.head_dim
    qkv = cfg.q_size + 2 * cfg.kv_size
    ks = iter(jax.random.split(key, 8))

    def rnd(shape):
        return (scale * jax.random.normal(next(ks), shape, jnp.float32)).astype(dtype)

    layers = {
        "attn_norm": jnp.ones((L, D), dtype),
        "wqkv": rnd((L, D, qkv)),
        "wo": rnd((L, cfg.q_size, D)),
        "mlp_norm": jnp.ones((L, D), dtype),
        "w_gate_up": rnd((L, D, 2 * F)),
        "w_down": rnd((L, F, D)),
    }
    if cfg.attention_bias:
        layers["bqkv"] = jnp.zeros((L, qkv), dtype)
    if cfg.qk_norm:
        layers["q_norm"] = jnp.ones((L, hd), dtype)
        layers["k_norm"] = jnp.ones((L, hd), dtype)
    if cfg.sandwich_norm:
        layers["post_attn_norm"] = jnp.ones((L, D), dtype)
        layers["post_mlp_norm"] = jnp.ones((L, D), dtype)
    params = {"embed": rnd((V, D)), "final_norm": jnp.ones((D,), dtype), "layers": layers}
    if not cfg.tie_word_embeddings:
        params["lm_head"] = rnd((D, V))
    return params


def cast_params(params: dict, dtype) -> dict:
    return jax.tree.map(lambda a: a.astype(dtype) if jnp.issubdtype(a.dtype, jnp.floating) else a, params)
