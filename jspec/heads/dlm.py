"""A small masked-diffusion LM (DLM) built from the target's own layers, for DiffuSpec and SSD.

Adapted from an AR decoder the way Dream and DiffuLLaMA adapt theirs:

* **Layers**: `num_layers` of the target's decoder layers (copied at init, then trained), the
  target's final-norm shape; embeddings and LM head are the target's (tied, frozen, never
  shipped: they are read from the target checkpoint at load time).
* **Mask token**: an existing token id that never occurs in the training data (a spare special
  token of the target's vocabulary), so the tied embedding table needs no new row. Its embedding
  is fixed; the layers learn what it means.
* **Shifted prediction** (Dream): the output at position i predicts the token at i + 1, so the
  target's LM head is reused unchanged and the last committed token is the block's *anchor*.
* **Block-wise attention**: the committed prefix is causal (its K/V are cached once, as in AR
  decoding); the block being denoised is bidirectional and sees the whole prefix.

A drafting block holds `T` tokens `[anchor, y_1 .. y_{T-1}]` at positions `p .. p+T-1`
(`y_j` = MASK or an already-decided token); its outputs at slots `0 .. T-1` predict the tokens
at `p+1 .. p+T`. So one forward proposes `T` tokens, the last of which has no input slot.

Training (`jspec.train.dlm`) uses the block-diffusion two-stream layout (`two_stream_mask`): a
clean copy of the sequence (causal, what the cache will hold) and a noised copy cut into blocks,
each block seeing the clean tokens before its anchor and its own noised tokens. Every response
token gets a loss in one forward, and the attention pattern is exactly the one inference runs.

Everything here composes `jspec.model.forward`: block attention is its `new_mask` over the
pending slots, so the same code runs the einsum path, the fused Pallas kernel and the cache.
"""

from __future__ import annotations

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np

from .. import model as M
from ..checkpoint.files import save_safetensors
from ..config import ModelConfig

SAFETENSORS_FORMAT = "jspec-dlm-v1"


@dataclasses.dataclass(frozen=True)
class DLMConfig:
    """Static description of a DLM drafter (hashable: a jit static argument).

    target: the target's config (vocabulary, widths, rope); the DLM is `target` with
      `num_layers` layers. init_layers: which target layers the DLM starts from (default: the
      first half and the last half of `num_layers`, keeping the input and output ends of the
      residual stream). block_size: tokens per denoising block at inference (drafting proposes
      at most this many tokens per forward). train_block_sizes: block lengths mixed in training.
    """

    target: ModelConfig
    num_layers: int = 6
    mask_token_id: int = 0
    block_size: int = 32
    init_layers: tuple[int, ...] | None = None
    train_block_sizes: tuple[int, ...] = (8, 32)

    def __post_init__(self):
        if not 1 <= self.num_layers:
            raise ValueError(f"DLM num_layers must be >= 1, got {self.num_layers}")
        if not 0 <= self.mask_token_id < self.target.vocab_size:
            raise ValueError(f"mask_token_id {self.mask_token_id} outside the vocabulary [0, {self.target.vocab_size})")
        if self.block_size < 2:
            raise ValueError(f"block_size must be >= 2, got {self.block_size}")
        if self.init_layers is not None and len(self.init_layers) != self.num_layers:
            raise ValueError(f"init_layers has {len(self.init_layers)} entries for {self.num_layers} layers")

    @property
    def layer_ids(self) -> tuple[int, ...]:
        if self.init_layers is not None:
            return tuple(self.init_layers)
        L, n = self.target.num_layers, self.num_layers
        if n >= L:
            return tuple(range(L)) + tuple(range(L - 1, L - 1 - (n - L), -1))[: n - L]
        first = n // 2
        return tuple(range(first)) + tuple(range(L - (n - first), L))

    @property
    def model(self) -> ModelConfig:
        """The ModelConfig `model.forward` runs (the target's, with the DLM's layers)."""
        t = self.target
        sliding = tuple(t.sliding_layers[i] for i in self.layer_ids) if t.sliding_layers else ()
        return t.replace(num_layers=self.num_layers, sliding_layers=sliding)

    def to_json(self) -> dict:
        return {"num_layers": self.num_layers, "mask_token_id": self.mask_token_id, "block_size": self.block_size,
                "init_layers": list(self.layer_ids), "train_block_sizes": list(self.train_block_sizes),
                "target": self.target.to_dict()}

    @classmethod
    def from_json(cls, d: dict, target: ModelConfig | None = None) -> "DLMConfig":
        tgt = target if target is not None else ModelConfig.from_dict(d["target"])
        return cls(target=tgt, num_layers=int(d["num_layers"]), mask_token_id=int(d["mask_token_id"]),
                   block_size=int(d["block_size"]), init_layers=tuple(d["init_layers"]),
                   train_block_sizes=tuple(d.get("train_block_sizes", (8, 32))))


# ---------------------------------------------------------------------------------------------
# Parameters
# ---------------------------------------------------------------------------------------------


def init_dlm(dcfg: DLMConfig, target_params: dict) -> dict:
    """The DLM's own (trainable, shipped) parameters: a copy of the chosen target layers and the
    final norm. Embeddings / LM head stay the target's (see `full_params`)."""
    idx = jnp.asarray(dcfg.layer_ids)
    layers = jax.tree.map(lambda a: jnp.array(a[idx]), target_params["layers"])
    return {"layers": layers, "final_norm": jnp.array(target_params["final_norm"])}


def full_params(own: dict, target_params: dict) -> dict:
    """Parameters `model.forward` / `model.lm_head` take: the DLM's layers + the target's tied
    embedding (and LM head if untied). Building the dict copies nothing."""
    p = {"layers": own["layers"], "final_norm": own["final_norm"], "embed": target_params["embed"]}
    if "lm_head" in target_params:
        p["lm_head"] = target_params["lm_head"]
    return p


def num_shipped_params(own: dict) -> int:
    return int(sum(np.prod(a.shape) for a in jax.tree.leaves(own)))


# ---------------------------------------------------------------------------------------------
# Attention masks
# ---------------------------------------------------------------------------------------------


def block_call_mask(n_pending: jax.Array, P: int, T: int) -> jax.Array:
    """new_mask [B, P+T, P+T] for one cached call: P pending tokens (the last verified block,
    causal, only the first n_pending[b] real) followed by a T-token bidirectional block that sees
    the real pending tokens and itself."""
    B = n_pending.shape[0]
    i = jnp.arange(P + T)
    q_pend, k_pend = (i < P)[:, None], (i < P)[None, :]  # [W, 1], [1, W]
    causal = (i[None, :] <= i[:, None]) & q_pend & k_pend  # pending -> pending
    real_k = k_pend[None] & (i[None, None, :] < n_pending[:, None, None])  # [B, 1, W]
    blk = (~q_pend)[None] & (real_k | ~k_pend[None])  # block -> real pending + whole block
    return jnp.broadcast_to(causal[None], (B, P + T, P + T)) | blk


def multi_block_call_mask(n_pending: jax.Array, P: int, T: int, N: int) -> jax.Array:
    """new_mask [B, P+N*T, P+N*T]: like block_call_mask with N independent copies of the block
    (the SSD verification nodes), each seeing the real pending tokens and only itself."""
    B = n_pending.shape[0]
    W = P + N * T
    i = jnp.arange(W)
    pend = i < P
    node = jnp.where(pend, -1, (i - P) // T)
    causal = (i[None, :] <= i[:, None]) & pend[:, None] & pend[None, :]
    same_node = (node[:, None] == node[None, :]) & ~pend[:, None]
    to_pending = ~pend[:, None] & pend[None, :]  # [W, W]
    real = i[None, :] < n_pending[:, None]  # [B, W]
    return (causal | same_node)[None] | (to_pending[None] & real[:, None, :])


def two_stream_mask(anchor: jax.Array, block_id: jax.Array) -> jax.Array:
    """Training mask [B, 2L, 2L] over [clean_0..clean_{L-1}, noisy_0..noisy_{L-1}].

    anchor [B, L]: position of the anchor of the block each noisy token belongs to;
    block_id [B, L]: the block's index. Clean tokens are causal among themselves; a noisy token
    sees the clean tokens before its anchor and the noisy tokens of its own block (exactly the
    cached-prefix + bidirectional-block pattern of inference)."""
    B, L = anchor.shape
    i = jnp.arange(L)
    cc = jnp.broadcast_to(i[None, :] <= i[:, None], (B, L, L))
    nc = i[None, None, :] < anchor[:, :, None]
    nn = block_id[:, :, None] == block_id[:, None, :]
    top = jnp.concatenate([cc, jnp.zeros((B, L, L), bool)], axis=2)
    bottom = jnp.concatenate([nc, nn], axis=2)
    return jnp.concatenate([top, bottom], axis=1)


# ---------------------------------------------------------------------------------------------
# Forward passes
# ---------------------------------------------------------------------------------------------


def prefill(own: dict, target_params: dict, dcfg: DLMConfig, tokens: jax.Array, lens: jax.Array,
            cache: M.KVCache, *, kernels: str | None = None) -> M.KVCache:
    """Cache the prompt causally; the cursor ends at lens (the first generated token is the
    first block's anchor, not cached yet)."""
    out = M.forward(full_params(own, target_params), dcfg.model, tokens, cache, kernels=kernels)
    return out.cache.replace(lengths=lens.astype(jnp.int32))


def block_logits(own: dict, target_params: dict, dcfg: DLMConfig, cache: M.KVCache, pending: jax.Array,
                 n_pending: jax.Array, block: jax.Array, *, kernels: str | None = None, n_logits: int | None = None):
    """One cached call: commit the first n_pending[b] of `pending` [B, P] causally (their K/V
    become prefix), and denoise `block` [B, T] bidirectionally right after them.

    Returns (logits [B, n_logits or T, V] float32: the LM head runs on the block's first n_logits
    slots only, cache with the cursor advanced by n_pending). The block's K/V land beyond the
    cursor and are never read again. P may be 0.
    """
    B, P = pending.shape
    T = block.shape[1]
    base = cache.lengths
    pos_p = base[:, None] + jnp.arange(P, dtype=jnp.int32)[None]
    pos_b = (base + n_pending)[:, None] + jnp.arange(T, dtype=jnp.int32)[None]
    tokens = jnp.concatenate([pending, block], axis=1)
    positions = jnp.concatenate([pos_p, pos_b], axis=1)
    mask = block_call_mask(n_pending, P, T)
    params = full_params(own, target_params)
    out = M.forward(params, dcfg.model, tokens, cache, positions=positions, new_mask=mask, kernels=kernels)
    logits = M.lm_head(params, dcfg.model, out.hidden[:, P : P + (T if n_logits is None else n_logits)])
    return logits, M.advance(out.cache, n_pending)


def nodes_logits(own: dict, target_params: dict, dcfg: DLMConfig, cache: M.KVCache, pending: jax.Array,
                 n_pending: jax.Array, nodes: jax.Array, *, kernels: str | None = None):
    """block_logits for N variants of the block at once (nodes [B, N, T]): one forward, the
    variants side by side along the token axis, each blind to the others (the prefix cache is
    shared, nothing is copied). Returns (logits [B, N, T, V], cache advanced by n_pending)."""
    B, P = pending.shape
    _, N, T = nodes.shape
    base = cache.lengths
    pos_p = base[:, None] + jnp.arange(P, dtype=jnp.int32)[None]
    pos_b = (base + n_pending)[:, None] + jnp.tile(jnp.arange(T, dtype=jnp.int32), N)[None]
    tokens = jnp.concatenate([pending, nodes.reshape(B, N * T)], axis=1)
    positions = jnp.concatenate([pos_p, pos_b], axis=1)
    mask = multi_block_call_mask(n_pending, P, T, N)
    params = full_params(own, target_params)
    out = M.forward(params, dcfg.model, tokens, cache, positions=positions, new_mask=mask, kernels=kernels)
    logits = M.lm_head(params, dcfg.model, out.hidden[:, P:]).reshape(B, N, T, -1)
    return logits, M.advance(out.cache, n_pending)


def uncached_block_logits(own: dict, target_params: dict, dcfg: DLMConfig, prefix: jax.Array, block: jax.Array):
    """Reference without a cache: run [prefix, block] in one call with the same attention
    pattern (prefix causal, block bidirectional over prefix + block). prefix [B, Lp] (all real),
    block [B, T] -> logits [B, T, V]."""
    B, Lp = prefix.shape
    T = block.shape[1]
    cache = M.init_cache(dcfg.model, B, Lp + T, own["final_norm"].dtype)
    mask = block_call_mask(jnp.full((B,), Lp, jnp.int32), Lp, T)
    params = full_params(own, target_params)
    out = M.forward(params, dcfg.model, jnp.concatenate([prefix, block], 1), cache, new_mask=mask, kernels="xla")
    return M.lm_head(params, dcfg.model, out.hidden[:, Lp:])


def two_stream_hidden(own: dict, target_params: dict, dcfg: DLMConfig, clean: jax.Array, noisy: jax.Array,
                      anchor: jax.Array, block_id: jax.Array) -> jax.Array:
    """Training forward: final-normed hidden states [B, L, D] of the noisy stream (see
    `two_stream_mask`); the clean stream plays the role of the KV cache."""
    B, L = clean.shape
    cache = M.init_cache(dcfg.model, B, 2 * L, own["final_norm"].dtype)
    pos = jnp.broadcast_to(jnp.arange(L, dtype=jnp.int32), (B, L))
    out = M.forward(full_params(own, target_params), dcfg.model, jnp.concatenate([clean, noisy], 1), cache,
                    positions=jnp.concatenate([pos, pos], 1), new_mask=two_stream_mask(anchor, block_id), kernels="xla")
    return out.hidden[:, L:]


# ---------------------------------------------------------------------------------------------
# Shipping: bf16 safetensors of the DLM's own weights (embeddings are the target's)
# ---------------------------------------------------------------------------------------------


def save_dlm(path: str, dcfg: DLMConfig, own: dict, dtype=jnp.bfloat16, extra_meta: dict | None = None) -> None:
    flat = {"final_norm": own["final_norm"], **{f"layers.{k}": v for k, v in own["layers"].items()}}
    flat = {k: np.asarray(jnp.asarray(v, dtype)) for k, v in flat.items()}
    meta = {"format": SAFETENSORS_FORMAT, "config": json.dumps(dcfg.to_json()), **(extra_meta or {})}
    save_safetensors(flat, path, metadata={k: str(v) for k, v in meta.items()})


def load_dlm(path: str, target_cfg: ModelConfig | None = None, dtype=jnp.float32) -> tuple[DLMConfig, dict]:
    """(DLMConfig, own params). target_cfg: the loaded target's config (checked against the
    one the DLM was trained for: vocabulary and widths must match)."""
    from safetensors import safe_open

    with safe_open(path, "flax") as fh:
        meta = fh.metadata() or {}
        if meta.get("format") != SAFETENSORS_FORMAT:
            raise ValueError(f"{path}: not a {SAFETENSORS_FORMAT} file (format {meta.get('format')!r})")
        tensors = {k: fh.get_tensor(k) for k in fh.keys()}
    saved = json.loads(meta["config"])
    dcfg = DLMConfig.from_json(saved)
    if target_cfg is not None:
        t = dcfg.target
        for f in ("vocab_size", "hidden_size", "num_heads", "num_kv_heads", "head_dim", "intermediate_size"):
            if getattr(t, f) != getattr(target_cfg, f):
                raise ValueError(f"{path}: DLM was trained for a target with {f}={getattr(t, f)}, "
                                 f"this target has {getattr(target_cfg, f)}")
        dcfg = DLMConfig.from_json(saved, target=target_cfg)
    own = {"final_norm": jnp.asarray(tensors["final_norm"], dtype),
           "layers": {k[len("layers."):]: jnp.asarray(v, dtype) for k, v in tensors.items() if k.startswith("layers.")}}
    return dcfg, own
