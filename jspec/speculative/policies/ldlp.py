"""AdaEAGLE's Learnable Draft Length Predictor (LDLP): a tiny MLP that predicts, before drafting,
how many tokens the drafter should propose this round.

Source: Zhang et al., "AdaEAGLE" (arXiv 2412.18910), read in full (docs/OPEN-POINTS.md section 3):

* inputs: the embedding ``e`` of the last accepted token and the target's last hidden state ``f``
  at that token, taken after the target's final norm;
* a three-layer MLP with residual connections, then a linear map to one real number;
* training label: with the target's own greedy continuation as reference, the drafter drafts
  ``k_max`` tokens from each position; the label is the length of the longest common prefix
  (``label_from_drafts``);
* loss: L1 with under-prediction weighted by ``lambda > 1`` (one target pass costs about 20
  drafter passes, so drafting too little is the costlier mistake).

What the paper leaves open, chosen here; each is an argument with a default.
[I] reconstruction, source: AdaEAGLE section 3 gives only "3-layer MLP + residual":
  * ``e`` and ``f`` are each RMS-normalised without parameters, then concatenated. Embedding scales
    differ a lot across model families (Gemma multiplies embeddings by sqrt(d)); normalising
    keeps one learning rate usable everywhere.
  * A linear input projection ``2d -> hidden`` is followed by ``num_layers=3`` residual blocks
    ``h <- h + silu(W h + b)`` and a linear head ``hidden -> 1``. ``hidden`` defaults to 256.
  * ``DEFAULT_UNDER_WEIGHT = 3.0`` is lambda (the paper does not give its value).
  * ``train_ldlp`` uses AdamW with a cosine-decayed learning rate (the paper uses cosine, lr 5e-5,
    batch 128, 5 epochs on 68k ShareGPT dialogues). The output bias starts at the
    ``lambda / (1 + lambda)`` quantile of the labels, which is the constant that minimises the
    asymmetric L1 loss, so training starts from the best constant predictor.

Params are a plain dict of float32 arrays, so they can be saved with any checkpointer and carried
in a policy state (``jspec.spec.policies.LDLPPolicy``).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import optax

DEFAULT_HIDDEN = 256
DEFAULT_NUM_LAYERS = 3
DEFAULT_UNDER_WEIGHT = 3.0  # [I] lambda of the asymmetric L1 loss; the paper only says lambda > 1
_RMS_EPS = 1e-6


def init_ldlp(
    d_model: int,
    key: jax.Array,
    hidden: int = DEFAULT_HIDDEN,
    num_layers: int = DEFAULT_NUM_LAYERS,
) -> dict:
    """Random LDLP params for a target of width ``d_model``.

    Layout: ``w_in [2d, hidden]``, ``b_in [hidden]``, ``w_res [L, hidden, hidden]``,
    ``b_res [L, hidden]``, ``w_out [hidden]``, ``b_out []``.
    """
    k_in, k_res, k_out = jax.random.split(key, 3)
    d_in = 2 * d_model
    # Residual branches start small so the network starts close to its input projection and
    # the scale of h stays about the same as blocks are added.
    res_scale = 1.0 / (hidden**0.5 * num_layers)
    return {
        "w_in": jax.random.normal(k_in, (d_in, hidden), jnp.float32) / d_in**0.5,
        "b_in": jnp.zeros((hidden,), jnp.float32),
        "w_res": jax.random.normal(k_res, (num_layers, hidden, hidden), jnp.float32) * res_scale,
        "b_res": jnp.zeros((num_layers, hidden), jnp.float32),
        "w_out": jax.random.normal(k_out, (hidden,), jnp.float32) / hidden**0.5,
        "b_out": jnp.zeros((), jnp.float32),
    }


def _rms_normalize(x: jax.Array) -> jax.Array:
    return x * jax.lax.rsqrt(jnp.mean(jnp.square(x), axis=-1, keepdims=True) + _RMS_EPS)


def ldlp_apply(params: dict, emb: jax.Array, feat: jax.Array) -> jax.Array:
    """Predicted draft length (a real number) for each row.

    emb: ``[..., d]`` embedding of the last accepted token; feat: ``[..., d]`` final-normed target
    hidden state at that token. Returns ``[...]`` float32. Rounding and clipping to a usable draft
    length is the caller's job (see ``LDLPPolicy``).
    """
    x = jnp.concatenate(
        [_rms_normalize(emb.astype(jnp.float32)), _rms_normalize(feat.astype(jnp.float32))], axis=-1
    )
    h = x @ params["w_in"] + params["b_in"]
    for layer in range(params["w_res"].shape[0]):
        h = h + jax.nn.silu(h @ params["w_res"][layer] + params["b_res"][layer])
    return h @ params["w_out"] + params["b_out"]


def asymmetric_l1(
    pred: jax.Array, label: jax.Array, under_weight: float = DEFAULT_UNDER_WEIGHT
) -> jax.Array:
    """Mean of ``under_weight * (label - pred)`` where pred < label, else ``pred - label``."""
    diff = pred - label.astype(pred.dtype)
    return jnp.mean(jnp.where(diff < 0, -under_weight * diff, diff))


def ldlp_loss(
    params: dict,
    emb: jax.Array,
    feat: jax.Array,
    labels: jax.Array,
    under_weight: float = DEFAULT_UNDER_WEIGHT,
) -> jax.Array:
    return asymmetric_l1(ldlp_apply(params, emb, feat), labels, under_weight)


def label_from_drafts(draft_tokens: jax.Array, target_tokens: jax.Array) -> jax.Array:
    """Training label: length of the longest common prefix of drafts and the target's tokens.

    draft_tokens ``[..., K]``: the drafter's greedy continuation from a position;
    target_tokens ``[..., T]``: the target's own continuation from the same position (broadcast
    against the drafts). Only the first ``min(K, T)`` positions are compared. Returns int32 ``[...]``.
    """
    n = min(draft_tokens.shape[-1], target_tokens.shape[-1])
    same = draft_tokens[..., :n] == target_tokens[..., :n]
    return jnp.sum(jnp.cumprod(same.astype(jnp.int32), axis=-1), axis=-1).astype(jnp.int32)


def train_ldlp(
    emb: jax.Array,
    feat: jax.Array,
    labels: jax.Array,
    steps: int,
    lr: float,
    key: jax.Array,
    *,
    hidden: int = DEFAULT_HIDDEN,
    num_layers: int = DEFAULT_NUM_LAYERS,
    under_weight: float = DEFAULT_UNDER_WEIGHT,
    batch_size: int = 128,
    weight_decay: float = 0.0,
) -> dict:
    """Fit LDLP params on ``(emb [N, d], feat [N, d], labels [N])`` with AdamW and a cosine
    learning-rate decay over ``steps`` minibatch steps (minibatches drawn with replacement;
    ``batch_size >= N`` uses the full set every step). Returns the trained params.
    """
    emb = jnp.asarray(emb, jnp.float32)
    feat = jnp.asarray(feat, jnp.float32)
    labels = jnp.asarray(labels, jnp.float32)
    init_key, data_key = jax.random.split(key)
    params = init_ldlp(emb.shape[-1], init_key, hidden=hidden, num_layers=num_layers)
    # Start from the best constant predictor: the under_weight/(1+under_weight) quantile of the labels.
    params["b_out"] = jnp.quantile(labels, under_weight / (1.0 + under_weight)).astype(jnp.float32)
    batch = min(batch_size, labels.shape[0])
    return _fit(
        params, emb, feat, labels, data_key, float(lr), float(weight_decay), int(steps), batch,
        float(under_weight),
    )


@functools.partial(
    jax.jit, static_argnames=("lr", "weight_decay", "steps", "batch", "under_weight")
)
def _fit(params, emb, feat, labels, key, lr, weight_decay, steps, batch, under_weight):
    optimizer = optax.chain(
        optax.clip_by_global_norm(1.0),
        optax.adamw(optax.cosine_decay_schedule(lr, max(steps, 1)), weight_decay=weight_decay),
    )
    full_batch = batch >= labels.shape[0]

    def step(carry, step_key):
        params, opt_state = carry
        if full_batch:
            e, f, y = emb, feat, labels
        else:
            idx = jax.random.randint(step_key, (batch,), 0, labels.shape[0])
            e, f, y = emb[idx], feat[idx], labels[idx]
        grads = jax.grad(ldlp_loss)(params, e, f, y, under_weight)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return (optax.apply_updates(params, updates), opt_state), None

    (params, _), _ = jax.lax.scan(
        step, (params, optimizer.init(params)), jax.random.split(key, steps)
    )
    return params
