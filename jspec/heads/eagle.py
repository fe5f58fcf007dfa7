"""EAGLE-1 and EAGLE-3 draft heads: one decoder layer on top of the frozen target's features.

Both heads read, at position t, a feature f_t of the target and the embedding of the token
x_{t+1} that follows it (callers pass tokens already shifted by one), and produce a hidden state
h_out from which the distribution of x_{t+2} is read. Later draft steps feed h_out back as the
feature. The embedding table (and, for EAGLE-1, the LM head) is the target's, frozen.

EAGLE-1 (docs/methods.md §2.1):  f = the target's final-normed hidden (what its LM head reads)
    x = W_fc [e; f] + b  ->  Llama layer with NO input norm  ->  h_out  ->  target lm_head(h_out)
    h_out is the predicted feature f̂_{t+1}; there is no final norm because f is already normed.
EAGLE-3 (§2.2):  f = W_fc [captured layer inputs low; mid; high]  (3D -> D, no bias)
    a = [RMSNorm(e); RMSNorm(f)] (2D) -> attention (q, k, v read 2D) ; residual carries f
    -> MLP -> h_out (pre-final-norm hidden, fed back at later steps)
    -> final RMSNorm -> own lm_head over a reduced draft vocabulary -> scattered to target ids.

Parameter layout (plain dict; linear weights are [in, out]):

    fc            [n*D, D]     n = 2 (EAGLE-1: [embedding; feature]) or 3 (EAGLE-3: fused layers)
    fc_bias       [D]          EAGLE-1 only (EAGLE-1's fc has a bias)
    layer/
      embed_norm  [D]          EAGLE-3: RMSNorm of the token embedding (EAGLE's input_layernorm)
      hidden_norm [D]          EAGLE-3: RMSNorm of the incoming feature
      wqkv        [A, q+2kv]   A = D (EAGLE-1) or 2D (EAGLE-3); q | k | v fused like the target
      wo          [q, D]
      mlp_norm    [D]          EAGLE's post_attention_layernorm
      w_gate_up   [D, 2F]
      w_down      [F, D]
    final_norm    [D]          EAGLE-3
    fc_norm       [3D]         EAGLE-3.1 (hcfg.fc_norm): RMSNorm weights of the three captured layers
    lm_head       [D, Vd]      EAGLE-3 (Vd = draft vocab, or the target vocab when not reduced)
    d2t           [Vd] int32   EAGLE-3 with a reduced vocab: the ABSOLUTE target id of each draft
                               id (the EAGLE file format stores offsets; eagle_format converts)
    t2d           [V]  bool    EAGLE-3 with a reduced vocab: which target ids are in the draft vocab
    fc_in_scale   [3D] float32 EAGLE-3, optional: a fixed multiplier of the captured layer inputs
                               before the fc (powers of two, one per captured layer), so a target
                               whose residual stream is huge (Gemma-3: token RMS in the hundreds)
                               trains like one whose is O(1). Exports fold it into fc (exact for
                               powers of two); a loaded head has none.

`d2t`, `t2d` and `fc_in_scale` are fixed leaves: training optimises only the other floating
leaves (`split_trainable`).

The head layer is Llama-style whatever the target family (SwiGLU, plain rope, head_dim**-0.5
scaling, no q/k norms, no sliding window), matching what SGLang and vLLM run for EAGLE heads. Its
attention geometry, rope and norm epsilon are the target's unless the HeadConfig states its own
(an imported head: the engines build the draft layer from the draft's config.json). The embedding includes the target's embed_scale (Gemma), i.e.
it is exactly what the target's first layer reads.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

from ..config import ModelConfig, rope_inv_freq
from ..kernels import decode_attention as fused_attn
from ..model import (
    KERNEL_IMPLS,
    NEG_INF,
    ForwardOut,
    KVCache,
    apply_rope,
    attention_mask,
    default_kernels,
    embed,
    fused_attention_supported,
    init_cache,
    lm_head,
    matmul,
    new_slots,
    rms_norm,
    rope_tables,
)

HEAD_KINDS = ("eagle1", "eagle3")
MIN_ATTENTION_WINDOW = fused_attn.MAX_BLOCK  # a drafted block (at most the kernel's) sees itself whole
FIXED_LEAVES = ("d2t", "t2d", "fc_in_scale")  # not trained (split_trainable)


@dataclass(frozen=True)
class HeadConfig:
    """Static description of a draft head (hashable: a static jit argument)."""

    kind: str  # "eagle1" | "eagle3"
    target: ModelConfig  # the target's config (hidden size, heads, rope, vocab)
    capture_layers: tuple[int, ...] = ()  # eagle3: target layer INPUT indices fused; () = (2, L//2, L-3)
    draft_vocab_size: int = 0  # eagle3: reduced vocab (0 = full target vocab)
    intermediate_size: int | None = None  # MLP width of the head layer (None = target's)
    # The head layer's own attention geometry, rope and norm epsilon, as its config.json states
    # them (SGLang and vLLM build the draft layer from the draft's config, not the target's);
    # None = the target's value, which is what a head trained by jspec uses.
    num_heads: int | None = None
    num_kv_heads: int | None = None
    head_dim: int | None = None
    rope_theta: float | None = None
    rope_scaling: tuple | None = None  # ("llama3", ...) / ("linear", f); used only with rope_theta set
    rms_norm_eps: float | None = None
    # EAGLE-3.1 (SpecForge `fc_norm`, vLLM `fc_norm` / `norm_output`): an RMSNorm on each captured
    # layer before the fc (params["fc_norm"] [3D]), and the post-final-norm hidden fed back at
    # later draft steps instead of the pre-norm one.
    fc_norm: bool = False
    norm_output: bool = False
    # Attend only to the last `attention_window` committed tokens (and the block being drafted):
    # the length the head was trained on (jspec's export writes its recipe's seq_len). Past it the
    # head meets query-key distances it never saw; on long documents a SmolLM2 head windowed at its
    # 768 accepted 1.94 tokens per call against 1.51 unwindowed (CPU, fp32) [I]. None: no window.
    attention_window: int | None = None

    def __post_init__(self):
        if self.kind not in HEAD_KINDS:
            raise ValueError(f"unknown head kind {self.kind!r}; supported: {', '.join(HEAD_KINDS)}")
        if self.kind == "eagle1" and self.draft_vocab_size:
            raise ValueError("eagle1 heads read the target's LM head: draft_vocab_size must be 0")
        L = self.target.num_layers
        if self.kind == "eagle3" and not self.capture_layers:  # () means EAGLE-3's default layers
            object.__setattr__(self, "capture_layers", default_capture_layers(L))
        if self.kind == "eagle3" and len(self.capture_layers) != 3:
            raise ValueError("eagle3 fuses exactly three captured layers (low, mid, high)")
        object.__setattr__(self, "capture_layers", tuple(int(i) for i in self.capture_layers))
        if any(not 0 <= i < L for i in self.capture_layers):
            raise ValueError(f"capture_layers {self.capture_layers} outside [0, {L})")
        if self.draft_vocab_size > self.target.vocab_size:
            raise ValueError("draft_vocab_size exceeds the target vocab")
        if self.kind == "eagle1" and (self.fc_norm or self.norm_output):
            raise ValueError("fc_norm / norm_output are EAGLE-3.1 options; an eagle1 head has neither")
        if self.rope_scaling is not None and self.rope_theta is None:
            raise ValueError("a head's own rope_scaling needs its own rope_theta")
        if self.attention_window is not None and self.attention_window < MIN_ATTENTION_WINDOW:
            raise ValueError(f"attention_window {self.attention_window}: at least {MIN_ATTENTION_WINDOW} tokens "
                             "(a drafted block attends to itself whole)")

    # ---- derived -------------------------------------------------------------------------------
    @property
    def hidden_size(self) -> int:
        return self.target.hidden_size

    @property
    def mlp_size(self) -> int:
        return self.intermediate_size or self.target.intermediate_size

    @property
    def fc_inputs(self) -> int:
        """How many D-wide vectors the fc reads."""
        return 2 if self.kind == "eagle1" else 3

    @property
    def attn_input_size(self) -> int:
        return self.hidden_size if self.kind == "eagle1" else 2 * self.hidden_size

    @property
    def reduced_vocab(self) -> bool:
        return self.kind == "eagle3" and 0 < self.draft_vocab_size < self.target.vocab_size

    @property
    def draft_vocab(self) -> int:
        """Width of the head's own logits (the target vocab for eagle1 / unreduced eagle3)."""
        return self.draft_vocab_size if self.reduced_vocab else self.target.vocab_size

    def replace(self, **kw) -> "HeadConfig":
        return dataclasses.replace(self, **kw)


def default_capture_layers(num_layers: int) -> tuple[int, int, int]:
    """EAGLE-3's (2, L//2, L-3), clamped into range so tiny test models work too."""
    clamp = lambda i: min(max(i, 0), num_layers - 1)  # noqa: E731
    return (clamp(2), clamp(num_layers // 2), clamp(num_layers - 3))


def default_head_config(kind: str, target_cfg: ModelConfig, draft_vocab_size: int = 0) -> HeadConfig:
    if kind == "eagle3":
        return HeadConfig(
            kind, target_cfg, default_capture_layers(target_cfg.num_layers), draft_vocab_size
        )
    return HeadConfig(kind, target_cfg)


def head_layer_config(hcfg: HeadConfig) -> ModelConfig:
    """The target's config reduced to the head's one Llama-style layer (attention geometry, rope)."""
    t = hcfg.target
    own = lambda v, default: default if v is None else v  # noqa: E731
    own_rope = hcfg.rope_theta is not None  # a head's own theta comes with its own scaling (or none)
    return ModelConfig(
        arch="llama",
        vocab_size=t.vocab_size,
        hidden_size=t.hidden_size,
        intermediate_size=hcfg.mlp_size,
        num_layers=1,
        num_heads=own(hcfg.num_heads, t.num_heads),
        num_kv_heads=own(hcfg.num_kv_heads, t.num_kv_heads),
        head_dim=own(hcfg.head_dim, t.head_dim),
        rms_norm_eps=own(hcfg.rms_norm_eps, t.rms_norm_eps),
        rope_theta=hcfg.rope_theta if own_rope else t.rope_theta,
        rope_scaling=hcfg.rope_scaling if own_rope else t.rope_scaling,
        max_position_embeddings=t.max_position_embeddings,
    )


# ---------------------------------------------------------------------------------------------
# Parameters and cache
# ---------------------------------------------------------------------------------------------


def init_head(hcfg: HeadConfig, key: jax.Array, dtype=jnp.float32, scale: float = 0.02) -> dict:
    """Random head parameters. A reduced EAGLE-3 vocab starts as target ids [0, Vd) until
    `with_draft_vocab` installs a frequency-chosen one."""
    lc = head_layer_config(hcfg)
    D, F, A = hcfg.hidden_size, hcfg.mlp_size, hcfg.attn_input_size
    qkv = lc.q_size + 2 * lc.kv_size
    ks = iter(jax.random.split(key, 8))

    def rnd(shape, std=scale):
        return (std * jax.random.normal(next(ks), shape, jnp.float32)).astype(dtype)

    n_in = hcfg.fc_inputs * D
    layer = {
        "wqkv": rnd((A, qkv)),
        "wo": rnd((lc.q_size, D)),
        "mlp_norm": jnp.ones((D,), dtype),
        "w_gate_up": rnd((D, 2 * F)),
        "w_down": rnd((F, D)),
    }
    # fc maps n unit-scale vectors to one: fan-in scaling keeps the fused feature O(1).
    params = {"fc": rnd((n_in, D), n_in**-0.5), "layer": layer}
    if hcfg.kind == "eagle1":
        params["fc_bias"] = jnp.zeros((D,), dtype)
        return params
    layer["embed_norm"] = jnp.ones((D,), dtype)
    layer["hidden_norm"] = jnp.ones((D,), dtype)
    params["final_norm"] = jnp.ones((D,), dtype)
    if hcfg.fc_norm:
        params["fc_norm"] = jnp.ones((n_in,), dtype)
    params["lm_head"] = rnd((D, hcfg.draft_vocab))
    if hcfg.reduced_vocab:
        params["d2t"], params["t2d"] = draft_vocab_maps(
            np.arange(hcfg.draft_vocab_size), hcfg.target.vocab_size
        )
    return params


def draft_vocab_maps(draft_ids, target_vocab: int) -> tuple[jax.Array, jax.Array]:
    """(d2t [Vd] absolute target ids, sorted; t2d [V] bool membership) for a set of target ids."""
    ids = np.sort(np.asarray(draft_ids, dtype=np.int64))
    t2d = np.zeros((target_vocab,), bool)
    t2d[ids] = True
    return jnp.asarray(ids, jnp.int32), jnp.asarray(t2d)


def draft_vocab_from_counts(counts, draft_vocab_size: int) -> tuple[jax.Array, jax.Array]:
    """The `draft_vocab_size` most frequent target tokens (ties -> lower id), as (d2t, t2d)."""
    counts = np.asarray(counts)
    if not 1 <= draft_vocab_size <= len(counts):
        raise ValueError(f"draft vocabulary of {draft_vocab_size} tokens: choose 1..{len(counts)} (the target's vocabulary)")
    order = np.lexsort((np.arange(len(counts)), -counts))  # by count desc, then id asc
    return draft_vocab_maps(order[:draft_vocab_size], len(counts))


def with_draft_vocab(hcfg: HeadConfig, head_params: dict, counts) -> dict:
    """Install a frequency-chosen draft vocabulary (no-op unless the head has a reduced vocab)."""
    if not hcfg.reduced_vocab:
        return head_params
    d2t, t2d = draft_vocab_from_counts(counts, hcfg.draft_vocab_size)
    return {**head_params, "d2t": d2t, "t2d": t2d}


def split_trainable(head_params: dict) -> tuple[dict, dict]:
    """(floating leaves to optimise, the fixed leaves: FIXED_LEAVES it has)."""
    fixed = {k: head_params[k] for k in FIXED_LEAVES if k in head_params}
    return {k: v for k, v in head_params.items() if k not in fixed}, fixed


def init_head_cache(hcfg: HeadConfig, batch: int, max_len: int, dtype=jnp.float32) -> KVCache:
    """A one-layer KV cache in model.KVCache's layout ([1, B, S, Hkv, hd])."""
    return init_cache(head_layer_config(hcfg), batch, max_len, dtype, num_layers=1)


# ---------------------------------------------------------------------------------------------
# Building blocks (shared by inference and training-time test)
# ---------------------------------------------------------------------------------------------


def embed_tokens(target_params: dict, target_cfg: ModelConfig, tokens: jax.Array) -> jax.Array:
    """The target's (frozen) input embedding, embed_scale included."""
    return embed(target_params, target_cfg, tokens)


def head_features(hcfg: HeadConfig, head_params: dict, target_out: ForwardOut) -> jax.Array:
    """[B, T, D] features the head reads at its first draft step, from one target forward
    (run with capture=hcfg.capture_layers for EAGLE-3)."""
    if hcfg.kind == "eagle1":
        return target_out.hidden
    if len(target_out.captured) != 3:
        raise ValueError("eagle3 needs the target forward run with capture=hcfg.capture_layers")
    return fuse_captured(hcfg, head_params, target_out.captured)


def fuse_captured(hcfg: HeadConfig, head_params: dict, captured) -> jax.Array:
    """EAGLE-3's fc over the concatenated (low, mid, high) layer inputs: 3D -> D (times the
    fixed fc_in_scale first, when the head has one; each layer RMS-normed first for an
    EAGLE-3.1 head with fc_norm)."""
    w = head_params["fc"]
    if hcfg.fc_norm:
        D, eps = hcfg.hidden_size, head_eps(hcfg)
        g = head_params["fc_norm"]
        captured = [rms_norm(c.astype(w.dtype), g[i * D : (i + 1) * D], eps) for i, c in enumerate(captured)]
    x = jnp.concatenate([c.astype(w.dtype) for c in captured], axis=-1)
    if "fc_in_scale" in head_params:  # powers of two: the product is exact in any float format
        x = x * head_params["fc_in_scale"].astype(w.dtype)
    return x @ w


def head_eps(hcfg: HeadConfig) -> float:
    """The RMSNorm epsilon of the head's norms (its config's, else the target's)."""
    return hcfg.target.rms_norm_eps if hcfg.rms_norm_eps is None else hcfg.rms_norm_eps


def capture_scales(rms_per_layer) -> np.ndarray:
    """fc_in_scale values [n] for captured layers whose typical token RMS is `rms_per_layer`: the
    power of two nearest 1 / rms, so each layer reaches the fc at RMS within a factor sqrt(2) of
    one (what init_head's fan-in scaling of fc assumes)."""
    rms = np.maximum(np.asarray(rms_per_layer, np.float64), 1e-30)
    return np.exp2(-np.round(np.log2(rms))).astype(np.float32)


def with_capture_scales(hcfg: HeadConfig, head_params: dict, scales) -> dict:
    """Install fc_in_scale from one scale per captured layer (EAGLE-3 only)."""
    if hcfg.kind != "eagle3":
        raise ValueError("fc_in_scale applies to EAGLE-3 heads (EAGLE-1 reads the normed final hidden)")
    scales = np.asarray(scales, np.float32)
    if scales.shape != (len(hcfg.capture_layers),):
        raise ValueError(f"need one scale per captured layer ({len(hcfg.capture_layers)}), got {scales.shape}")
    return {**head_params, "fc_in_scale": jnp.asarray(np.repeat(scales, hcfg.hidden_size))}


def fold_capture_scales(head_params: dict) -> dict:
    """The same head without fc_in_scale: fc's input rows multiplied by it (what the EAGLE file
    format can hold; exact when the scales are powers of two)."""
    if "fc_in_scale" not in head_params:
        return head_params
    out = {k: v for k, v in head_params.items() if k != "fc_in_scale"}
    fc = np.asarray(head_params["fc"])
    out["fc"] = (fc.astype(np.float32) * np.asarray(head_params["fc_in_scale"], np.float32)[:, None]).astype(fc.dtype)
    return out


def _attention_input(hcfg: HeadConfig, head_params: dict, embeds, feats):
    """(attention input [.., A], residual stream [.., D]) of the head layer."""
    p = head_params["layer"]
    eps = head_eps(hcfg)
    feats = feats.astype(embeds.dtype)
    if hcfg.kind == "eagle1":
        x = jnp.concatenate([embeds, feats], axis=-1) @ head_params["fc"] + head_params["fc_bias"]
        return x, x  # EAGLE-1 skips the input norm of its (only) layer
    a = jnp.concatenate([rms_norm(embeds, p["embed_norm"], eps), rms_norm(feats, p["hidden_norm"], eps)], -1)
    return a, feats


def _pair_inputs(hcfg: HeadConfig, head_params: dict, target_params: dict, tokens, feats):
    """_attention_input of (feature, next-token) pairs given as token ids (the target's embedding)."""
    embeds = embed_tokens(target_params, hcfg.target, tokens).astype(head_params["fc"].dtype)
    return _attention_input(hcfg, head_params, embeds, feats)


def _project_qkv(lcfg: ModelConfig, p: dict, attn_in, positions):
    """Roped q [B,T,Hq,hd], k and v [B,T,Hkv,hd] for tokens at `positions` [B, T]."""
    B, T = positions.shape
    hd = lcfg.head_dim
    qkv = attn_in @ p["wqkv"]
    q = qkv[..., : lcfg.q_size].reshape(B, T, lcfg.num_heads, hd)
    k = qkv[..., lcfg.q_size : lcfg.q_size + lcfg.kv_size].reshape(B, T, lcfg.num_kv_heads, hd)
    v = qkv[..., lcfg.q_size + lcfg.kv_size :].reshape(B, T, lcfg.num_kv_heads, hd)
    cos, sin = rope_tables(jnp.asarray(rope_inv_freq(lcfg, lcfg.rope_theta)), positions)
    return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v


def fused_head_attention(hcfg: HeadConfig, T: int, kernels: str | None = None) -> bool:
    """Whether a draft call over blocks of up to T tokens runs the head's attention through the
    fused kernel (jspec.kernels.decode_attention), by model.forward's rule: `kernels` (default
    `model.default_kernels()`: "pallas" on a single GPU) is "pallas" and the
    kernel covers the head layer's geometry at this block size. Else the einsum path runs."""
    impl = kernels or default_kernels()
    if impl not in KERNEL_IMPLS:
        raise ValueError(f"kernels={impl!r}: expected one of {', '.join(KERNEL_IMPLS)}")
    return impl == "pallas" and fused_attention_supported(head_layer_config(hcfg), T, None)


def _fused_attention(lcfg: ModelConfig, qkv, positions, cache: KVCache, new_mask, drop_past_end: bool = False,
                     window: int | None = None):
    """One kernel for rope, the cache write and attention: qkv [B, T, q+2kv] (before rope) of T
    tokens at `positions` [B, T] attend to the committed slots [0, lengths) and to each other under
    new_mask [B, T, T] (None: causal). Their K/V land at slots lengths[b] + t, in place.
    Returns (attention output [B, T, Hq*hd], cache)."""
    B, T = positions.shape
    hd, half = lcfg.head_dim, lcfg.head_dim // 2
    cos, sin = rope_tables(jnp.asarray(rope_inv_freq(lcfg, lcfg.rope_theta)), positions)
    o, k, v = fused_attn.fused_block_attention(
        qkv.reshape(B, T, lcfg.num_heads + 2 * lcfg.num_kv_heads, hd),
        cos[..., :half], sin[..., :half],  # rotate-half tables repeat their halves
        cache.k, cache.v, 0, cache.lengths, new_mask,
        num_heads=lcfg.num_heads, num_kv_heads=lcfg.num_kv_heads, scale=lcfg.attn_scale,
        interpret=jax.default_backend() != "gpu",
        # the drafting einsum paths attend to the new tokens' own K/V, so a write past the cache
        # end (a finished row's cursor, a tree's scratch slots) must not hide them there;
        # head_forward's einsum path reads them back from the cache and so drops them
        drop_past_end=drop_past_end, window=window,
    )
    return o.reshape(B, T, lcfg.q_size), cache.replace(k=k, v=v)


def committed_visible(hcfg: HeadConfig, cache: KVCache) -> jax.Array:
    """[B, S]: the committed slots the head attends to, the last `attention_window` of them (all
    without a window). The fused kernel counts the same slots (its `window`)."""
    slot = jnp.arange(cache.max_len, dtype=jnp.int32)[None]
    lengths = cache.lengths[:, None]
    committed = slot < lengths
    if hcfg.attention_window is None:
        return committed
    return committed & (slot >= lengths - hcfg.attention_window)


def window_mask(hcfg: HeadConfig, cache: KVCache, positions, key_pos):
    """[B, T, S] (or True without a window): which cache slots `attention_window` leaves to the T
    new tokens at `positions`: the committed ones of `committed_visible`, and among the new tokens
    those less than the window before each (a prompt longer than the window)."""
    W = hcfg.attention_window
    if W is None:
        return jnp.ones((), bool)
    committed = (jnp.arange(cache.max_len, dtype=jnp.int32)[None] < cache.lengths[:, None])[:, None, :]
    near = key_pos[:, None, :] > positions[:, :, None] - W
    return jnp.where(committed, committed_visible(hcfg, cache)[:, None, :], near)


def _attend(lcfg: ModelConfig, q, blocks):
    """Softmax attention over several key blocks jointly; returns [B, T, Hq*hd].

    Each block is (keys, values, visible, diagonal). A full block has keys [B, S, Hkv, hd] seen
    by every query under `visible` (broadcastable to [B, Hkv, G, T, S]); a diagonal block has
    keys [B, T, J, Hkv, hd] of which query t sees only its own position's J entries (EAGLE-3's
    training-time-test cache).
    """
    B, T = q.shape[:2]
    G = lcfg.num_heads // lcfg.num_kv_heads
    qg = q.reshape(B, T, lcfg.num_kv_heads, G, lcfg.head_dim)
    scores = []
    for k, _, visible, diagonal in blocks:
        spec = "bthgd,btjhd->bhgtj" if diagonal else "bthgd,bshd->bhgts"
        s = jnp.einsum(spec, qg, k, preferred_element_type=jnp.float32) * lcfg.attn_scale
        scores.append(jnp.where(visible, s, NEG_INF))
    w = jax.nn.softmax(jnp.concatenate(scores, axis=-1), axis=-1).astype(q.dtype)
    out, start = 0.0, 0
    for s, (_, v, _, diagonal) in zip(scores, blocks):
        wi = w[..., start : start + s.shape[-1]]
        start += s.shape[-1]
        spec = "bhgtj,btjhd->bthgd" if diagonal else "bhgts,bshd->bthgd"
        out = out + jnp.einsum(spec, wi, v)
    return out.reshape(B, T, lcfg.q_size)


def _finish_layer(hcfg: HeadConfig, head_params: dict, attn_out, residual, mm=jnp.matmul):
    """The layer's output h_out: the hidden fed back at the next draft step (EAGLE-3.1's
    norm_output: after the final norm, which draft_logits then does not repeat). `mm` is
    `model.matmul` on the (never differentiated) fused draft paths, so their products go to the
    matvec kernel where it serves."""
    p = head_params["layer"]
    h = residual + mm(attn_out, p["wo"])
    m = rms_norm(h, p["mlp_norm"], head_eps(hcfg))
    gu = mm(m, p["w_gate_up"])
    F = gu.shape[-1] // 2
    h = h + mm(jax.nn.silu(gu[..., :F]) * gu[..., F:], p["w_down"])
    return rms_norm(h, head_params["final_norm"], head_eps(hcfg)) if hcfg.norm_output else h


# ---------------------------------------------------------------------------------------------
# Logits
# ---------------------------------------------------------------------------------------------


def draft_logits(hcfg: HeadConfig, head_params: dict, target_params: dict, h_out, kernels: str = "xla") -> jax.Array:
    """float32 logits over the head's own vocabulary [.., draft_vocab] (the target's for eagle1);
    `kernels` as in `model.matmul` (the portable dot unless a fused draft path asks)."""
    if hcfg.kind == "eagle1":
        return lm_head(target_params, hcfg.target, h_out, kernels=kernels)
    x = h_out if hcfg.norm_output else rms_norm(h_out, head_params["final_norm"], head_eps(hcfg))
    return matmul(x, head_params["lm_head"], out_dtype=jnp.float32, kernels=kernels)


def to_target_vocab(hcfg: HeadConfig, head_params: dict, logits) -> jax.Array:
    """Scatter draft-vocab logits to target ids; ids outside the draft vocab get NEG_INF (finite)."""
    if not hcfg.reduced_vocab:
        return logits
    full = jnp.full(logits.shape[:-1] + (hcfg.target.vocab_size,), NEG_INF, logits.dtype)
    return full.at[..., head_params["d2t"]].set(logits)


def head_logits(hcfg: HeadConfig, head_params: dict, target_params: dict, h_out) -> jax.Array:
    """float32 logits over the TARGET vocabulary [.., V]."""
    return to_target_vocab(hcfg, head_params, draft_logits(hcfg, head_params, target_params, h_out))


# ---------------------------------------------------------------------------------------------
# Inference forward
# ---------------------------------------------------------------------------------------------


def head_forward(
    hcfg: HeadConfig,
    head_params: dict,
    target_params: dict,
    tokens: jax.Array,
    feats: jax.Array,
    cache: KVCache,
    *,
    positions: jax.Array | None = None,
    new_mask: jax.Array | None = None,
    kernels: str | None = None,
) -> tuple[jax.Array, jax.Array, KVCache]:
    """Run T new (feature, next-token) pairs per row against the head's cache.

    tokens [B, T]: x_{t+1} for each feature f_t (already shifted by one); feats [B, T, D].
    positions default to cache.lengths[b] + t; new_mask [B, T, T] as in model.forward (causal by
    default, an ancestor mask for trees). K/V are written at slots lengths[b] + t; the cursor does
    not move. Returns (h_out [B, T, D], logits [B, T, V_target] float32, cache), where h_out is
    the tensor to feed back as `feats` at the next draft step: EAGLE-1's predicted feature,
    EAGLE-3's pre-final-norm hidden.

    A causal block of at most the kernel's block size at the default positions (the re-read of a
    round's accepted pairs) runs its attention through the fused kernel when `kernels` (see
    fused_head_attention) selects it; prompts and tree masks take the einsum path.
    """
    lcfg = head_layer_config(hcfg)
    B, T = tokens.shape
    p = head_params["layer"]
    attn_in, residual = _pair_inputs(hcfg, head_params, target_params, tokens, feats)
    if positions is None and new_mask is None and fused_head_attention(hcfg, T, kernels):
        positions = cache.lengths[:, None] + jnp.arange(T, dtype=jnp.int32)[None]
        o, cache = _fused_attention(lcfg, attn_in @ p["wqkv"], positions, cache, None, drop_past_end=True,
                                    window=hcfg.attention_window)
        h_out = _finish_layer(hcfg, head_params, o, residual)
        return h_out, head_logits(hcfg, head_params, target_params, h_out), cache
    if positions is None:
        positions = cache.lengths[:, None] + jnp.arange(T, dtype=jnp.int32)[None]
    q, k, v = _project_qkv(lcfg, p, attn_in, positions)

    visible, key_pos = attention_mask(cache, positions, new_mask)
    visible = visible & window_mask(hcfg, cache, positions, key_pos)
    slots = new_slots(cache, T, new_mask)
    b_idx = jnp.arange(B)[:, None]
    k_all = cache.k.at[0, b_idx, slots].set(k.astype(cache.k.dtype), mode="drop")
    v_all = cache.v.at[0, b_idx, slots].set(v.astype(cache.v.dtype), mode="drop")
    block = (k_all[0].astype(q.dtype), v_all[0].astype(q.dtype), visible[:, None, None], False)
    o = _attend(lcfg, q, [block])
    h_out = _finish_layer(hcfg, head_params, o, residual)
    logits = head_logits(hcfg, head_params, target_params, h_out)
    return h_out, logits, cache.replace(k=k_all, v=v_all)


def head_step(
    hcfg: HeadConfig,
    head_params: dict,
    target_params: dict,
    tokens: jax.Array,
    feats: jax.Array,
    cache: KVCache,
    positions: jax.Array,
    pending: tuple | None = None,
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """The drafting forward: T new pairs per row that attend to the committed cache, to a short
    pending buffer of earlier draft K/V, and to themselves; nothing is written.

    Cheaper than `head_forward` on the hot path: the committed block is masked by a plain slot <
    cache.lengths compare (no per-token gather over the whole cache), each new pair sees only
    itself among the new ones (a diagonal block: chain steps are T=1, a tree frontier's nodes are
    siblings), and the logits stay in the head's own vocabulary (callers top-k there and map the
    chosen ids through d2t). The caller keeps the returned K/V (`head_chain_step` writes them into
    the cache, `head_tree_level` appends them to its pending buffer). This is the portable (einsum)
    path of those two; on a single GPU they run the fused attention kernel instead.

    tokens [B, T], feats [B, T, D], positions [B, T]; pending = (k, v [B, P, Hkv, hd], visible
    [B, T, P] bool) or None. Returns (h_out [B, T, D], draft-vocab logits [B, T, Vd] float32
    (the target's vocab for eagle1 / unreduced heads), k, v [B, T, Hkv, hd]).
    """
    lcfg = head_layer_config(hcfg)
    p = head_params["layer"]
    attn_in, residual = _pair_inputs(hcfg, head_params, target_params, tokens, feats)
    q, k, v = _project_qkv(lcfg, p, attn_in, positions)
    committed = committed_visible(hcfg, cache)[:, None, None, None]
    blocks = [(cache.k[0].astype(q.dtype), cache.v[0].astype(q.dtype), committed, False)]
    if pending is not None and pending[0].shape[1]:
        pk, pv, pvis = pending
        blocks.append((pk.astype(q.dtype), pv.astype(q.dtype), pvis[:, None, None], False))
    blocks.append((k[:, :, None], v[:, :, None], jnp.ones((), bool), True))  # each pair sees itself
    o = _attend(lcfg, q, blocks)
    h_out = _finish_layer(hcfg, head_params, o, residual)
    return h_out, draft_logits(hcfg, head_params, target_params, h_out), k, v


def head_chain_step(
    hcfg: HeadConfig,
    head_params: dict,
    target_params: dict,
    tokens: jax.Array,
    feats: jax.Array,
    cache: KVCache,
    *,
    kernels: str | None = None,
) -> tuple[jax.Array, jax.Array, KVCache]:
    """One chain draft step: one pair per row at position cache.lengths[b] attends to the committed
    cache and to itself, and its K/V are written at slot lengths[b] (the cursor does not move; the
    drafter bumps it). tokens [B, 1], feats [B, 1, D].

    On a single GPU (`fused_head_attention`) rope, the cache write and the attention are one fused
    kernel launch instead of about ten (the step is launch-bound at small batch); elsewhere
    `head_step`'s einsums and a scatter. Returns (h_out [B, 1, D], draft-vocab logits [B, 1, Vd]
    float32, cache).
    """
    B, T = tokens.shape
    if T != 1:
        raise ValueError(f"a chain step drafts one pair per row, got {T}")  # head_step: siblings, not causal
    positions = cache.lengths[:, None]
    if not fused_head_attention(hcfg, T, kernels):
        h, logits, k, v = head_step(hcfg, head_params, target_params, tokens, feats, cache, positions)
        b = jnp.arange(B)[:, None]
        cache = cache.replace(
            k=cache.k.at[0, b, positions].set(k.astype(cache.k.dtype), mode="drop"),
            v=cache.v.at[0, b, positions].set(v.astype(cache.v.dtype), mode="drop"),
        )
        return h, logits, cache
    p = head_params["layer"]
    attn_in, residual = _pair_inputs(hcfg, head_params, target_params, tokens, feats)
    mm = functools.partial(matmul, kernels="pallas")
    o, cache = _fused_attention(head_layer_config(hcfg), mm(attn_in, p["wqkv"]), positions, cache, None,
                                window=hcfg.attention_window)
    h_out = _finish_layer(hcfg, head_params, o, residual, mm)
    return h_out, draft_logits(hcfg, head_params, target_params, h_out, kernels="pallas"), cache


def head_tree_level(
    hcfg: HeadConfig,
    head_params: dict,
    target_params: dict,
    tokens: jax.Array,
    feats: jax.Array,
    cache: KVCache,
    positions: jax.Array,
    pending: tuple | None,
    visible: jax.Array,
    *,
    fused: bool,
) -> tuple[jax.Array, jax.Array, tuple, KVCache]:
    """One level of a draft tree: T frontier nodes per row (siblings: none sees another) attend to
    the committed cache, to the P pending nodes of earlier levels that `visible` [B, T, P] marks
    (their ancestors), and to themselves. tokens [B, T], feats [B, T, D], positions [B, T].

    `pending` is what earlier levels returned as `entries`, concatenated along axis 1 (None before
    the first level); its layout depends on `fused`, which must stay the same for a whole tree
    (`fused_head_attention(hcfg, largest block)`):
      * einsum path: the nodes' roped K/V; `head_step` attends to them as a separate key block and
        the cache is untouched;
      * fused kernel: the nodes' pre-rope QKV rows and positions. The kernel masks only among the
        tokens it is given, so every node so far runs as its block, P + T <= MAX_BLOCK tokens
        under an ancestor mask: each pending node sees only itself (its output is discarded) and
        the frontier sees its ancestors and itself. The kernel re-writes the K/V of all P + T nodes
        at slots lengths[b] + i: scratch past the cursor, which nothing reads while drafting and
        the head's re-read of the accepted path overwrites. One launch instead of about ten.

    Returns (h_out [B, T, D], draft-vocab logits [B, T, Vd] float32, entries, cache).
    """
    if not fused:
        if pending is not None:
            pending = (*pending, visible)
        h, logits, k, v = head_step(hcfg, head_params, target_params, tokens, feats, cache, positions, pending)
        return h, logits, (k, v), cache
    lcfg = head_layer_config(hcfg)
    B, T = tokens.shape
    p = head_params["layer"]
    attn_in, residual = _pair_inputs(hcfg, head_params, target_params, tokens, feats)
    mm = functools.partial(matmul, kernels="pallas")
    qkv = mm(attn_in, p["wqkv"])
    entries = (qkv, positions)
    own = jnp.broadcast_to(jnp.eye(T, dtype=bool), (B, T, T))
    if pending is None:
        all_qkv, all_pos, mask = qkv, positions, own
    else:
        pend_qkv, pend_pos = pending
        P = pend_qkv.shape[1]
        all_qkv = jnp.concatenate([pend_qkv, qkv], axis=1)
        all_pos = jnp.concatenate([pend_pos, positions], axis=1)
        pend_rows = jnp.broadcast_to(jnp.eye(P, P + T, dtype=bool), (B, P, P + T))
        mask = jnp.concatenate([pend_rows, jnp.concatenate([visible, own], axis=2)], axis=1)
    if all_qkv.shape[1] > fused_attn.MAX_BLOCK:
        raise ValueError(f"a fused tree level runs {all_qkv.shape[1]} nodes; the kernel takes {fused_attn.MAX_BLOCK}")
    o, cache = _fused_attention(lcfg, all_qkv, all_pos, cache, mask, window=hcfg.attention_window)
    h_out = _finish_layer(hcfg, head_params, o[:, -T:], residual, mm)
    return h_out, draft_logits(hcfg, head_params, target_params, h_out, kernels="pallas"), entries, cache


def target_index(hcfg: HeadConfig, head_params: dict) -> jax.Array | None:
    """[V] int32: each target id's index in the draft vocab, -1 outside it (None when unreduced).
    One scatter of d2t (a cumsum over V lowers to a log-depth chain of kernels on GPUs)."""
    if not hcfg.reduced_vocab:
        return None
    d2t = head_params["d2t"]
    return jnp.full((hcfg.target.vocab_size,), -1, jnp.int32).at[d2t].set(jnp.arange(d2t.shape[0], dtype=jnp.int32))


def gather_target_vocab(logits: jax.Array, index: jax.Array | None) -> jax.Array:
    """Draft-vocab logits [.., Vd] -> target-vocab logits [.., V] by one gather (ids outside the
    draft vocab get NEG_INF); the same values as `to_target_vocab`, without a full-size scatter."""
    if index is None:
        return logits
    # an element-wise gather along the last axis (fuses with its consumer, e.g. the argmax)
    idx = jnp.broadcast_to(jnp.maximum(index, 0), logits.shape[:-1] + index.shape)
    return jnp.where(index >= 0, jnp.take_along_axis(logits, idx, axis=-1), NEG_INF)


# ---------------------------------------------------------------------------------------------
# Training-time test (EAGLE-3 §1.3): one unrolled draft step over a whole sequence
# ---------------------------------------------------------------------------------------------


def document_positions(segment_ids: jax.Array) -> jax.Array:
    """[B, T] int32 position of each token within its document: a packed row holds several
    documents (segment_ids [B, T]: equal ids on one contiguous document), each counted from 0."""
    T = segment_ids.shape[1]
    t = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32)[None], segment_ids.shape)
    starts = jnp.concatenate([jnp.ones_like(segment_ids[:, :1], bool), segment_ids[:, 1:] != segment_ids[:, :-1]], 1)
    return t - jax.lax.cummax(jnp.where(starts, t, 0), axis=1)


def document_mask(segment_ids: jax.Array) -> jax.Array:
    """[B, T, T] bool: token t sees token s <= t of its own document only (causal within each
    document of a packed row, nothing across a document boundary)."""
    T = segment_ids.shape[1]
    same = segment_ids[:, :, None] == segment_ids[:, None, :]
    return same & jnp.tril(jnp.ones((T, T), bool))[None]


def ttt_step(
    hcfg: HeadConfig,
    head_params: dict,
    embeds: jax.Array,
    feats: jax.Array,
    step: int,
    first_kv: tuple | None,
    later_kv: tuple | None,
    segment_ids: jax.Array | None = None,
) -> tuple[jax.Array, tuple, tuple]:
    """Draft step `step` for every position of a sequence at once.

    At step j the row at position t holds the j-th drafted continuation of prefix x_0..x_t: its
    input is (previous step's h_out at t, embedding of x_{t+j+1}) and its rope position is t + j,
    as at inference. It attends to step-0 keys at positions <= t (causal) and to the keys of
    steps 1..j at the same position t only (EAGLE-3's diagonal cache) — exactly what a chain
    drafted from position t sees at inference.

    embeds, feats [B, T, D]; first_kv = (k, v) of step 0 [B, T, Hkv, hd] (None at step 0);
    later_kv = (k, v) of steps 1..j-1 stacked [B, T, j-1, Hkv, hd] (None when empty).
    segment_ids [B, T] (packed rows, None = one document per row): "position t" and "causal"
    then count within t's document (`document_positions`, `document_mask`), so no row attends
    across a document boundary.
    Returns (h_out [B, T, D], first_kv, later_kv) with this step's K/V added.
    """
    lcfg = head_layer_config(hcfg)
    B, T = embeds.shape[:2]
    p = head_params["layer"]
    if segment_ids is None:
        positions = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32)[None] + step, (B, T))
        causal = jnp.tril(jnp.ones((T, T), bool))[None, None, None]
    else:
        positions = document_positions(segment_ids) + step
        causal = document_mask(segment_ids)[:, None, None]
    attn_in, residual = _attention_input(hcfg, head_params, embeds, feats)
    q, k, v = _project_qkv(lcfg, p, attn_in, positions)
    if first_kv is None:
        first_kv = (k, v)
    else:
        k, v = k[:, :, None], v[:, :, None]
        later_kv = (k, v) if later_kv is None else tuple(
            jnp.concatenate([a, b], axis=2) for a, b in zip(later_kv, (k, v))
        )
    blocks = [(*first_kv, causal, False)]
    if later_kv is not None:
        blocks.append((*later_kv, jnp.ones((), bool), True))
    o = _attend(lcfg, q, blocks)
    return _finish_layer(hcfg, head_params, o, residual), first_kv, later_kv
