"""AdaEAGLE's Learnable Draft Length Predictor (LDLP): a tiny MLP that predicts, before drafting,
how many tokens the drafter should propose this round.

Source: Zhang et al., "AdaEAGLE" (arXiv 2412.18910), read in full (docs/methods.md §3.7):

* inputs: a token embedding ``e`` and the target's last hidden state ``f`` after its final norm;
  jspec fixes the alignment to the one a round can see before drafting (EAGLE's draft-head input
  pair, used identically by the engine and by the training data of jspec.train.ldlp): the target
  has read x_0..x_t, verification has just emitted x_{t+1} (the correction or bonus token, not yet
  read by the target); ``f = f_t`` is the final-normed hidden state at position t (the one whose
  distribution gave x_{t+1}) and ``e`` is the raw embedding row ``embed[x_{t+1}]`` (no embed
  scale). The paper's "the last validated token and its hidden state" cannot both be read at the
  start of a round: x_{t+1} has no target hidden state until the next verification;
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

Params are a plain dict of float32 arrays, carried in a policy state (``LDLPPolicy``) and saved
with the EAGLE head they were trained for, in its ``jspec/`` subfolder (``save_ldlp`` /
``load_ldlp``: ldlp.safetensors + ldlp.json; written by ``jspec train-ldlp``): SGLang and vLLM
read every *.safetensors in the head folder itself, and vLLM fails on the predictor's names.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import struct

from ...checkpoint.files import save_safetensors
from .base import Features, Policy, clip_limit, draft_log_probs, full_limit, never_stop

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

    emb: ``[..., d]`` raw embedding row of the round's first token x_{t+1}; feat: ``[..., d]``
    final-normed target hidden state at position t, whose distribution gave x_{t+1} (module doc).
    Returns ``[...]`` float32. Rounding and clipping to a usable draft length is the caller's job
    (see ``LDLPPolicy``).
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
    # one compiled program for the three random draws (eagerly, each draw compiles on its own)
    init = jax.jit(init_ldlp, static_argnums=0, static_argnames=("hidden", "num_layers"))
    params = init(emb.shape[-1], init_key, hidden=hidden, num_layers=num_layers)
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


# ------------------------------------------------------------------------------------------------
# The policy: AdaEAGLE (LDLP length before drafting) and AdaEAGLE-DDD
# ------------------------------------------------------------------------------------------------


@struct.dataclass
class LDLPState:
    params: Any  # LDLP weights, shared by all rows (no batch dim)
    predicted_len: jax.Array  # [B] int32: this round's LDLP length (DDD mode)
    cum_logprob: jax.Array  # [B] float32: this round's draft log-prob so far (DDD mode)
    rounds: jax.Array  # [B] int32


def length_from_prediction(prediction: jax.Array, k_max: int) -> jax.Array:
    """``clip(round(prediction), 1, k_max)``; a non-finite prediction drafts k_max.

    The paper allows a length of 0 (skip drafting); jspec always drafts at least one token, since
    the engine's round is built around one draft + verify step.
    """
    safe = jnp.where(jnp.isfinite(prediction), prediction, k_max)
    return clip_limit(jnp.round(jnp.clip(safe, 0, k_max)), k_max)


@dataclasses.dataclass(frozen=True)
class LDLPPolicy(Policy):
    """AdaEAGLE: draft ``clip(round(LDLP(e, f)), 1, k_max)`` tokens, predicted before drafting
    from ``features["token_embedding"]`` = ``embed[x_{t+1}]`` (the token verification just emitted)
    and ``features["target_feature"]`` = the final-normed target feature ``f_t`` of the last
    position the target read (module doc: the alignment jspec.train.ldlp trains on).

    Predictor weights are data, not configuration, so they live in the state (shared by all rows,
    without a batch dim): ``policy.init(batch, key, params=trained)``. Without ``params``, init
    draws random (untrained) weights of width ``d_model``, which is only useful for smoke tests.

    ``ddd=True``: AdaEAGLE-DDD (docs/methods.md §3.7): keep drafting past the LDLP length while
    the draft sequence's cumulative log-prob is >= ``ddd_threshold`` (-0.6, the paper's value);
    stop only when both ``step + 1 >= predicted length`` and ``cum_logprob < ddd_threshold``. So
    the longer of the two lengths is drafted, up to k_max. This needs in-round state: use
    ``start_round`` / ``observe`` (``observe`` adds log q(draft_token), or the top log-prob when
    no token is given, i.e. greedy drafting as in the paper); the plain calls raise.
    """

    name = "ldlp"

    ddd: bool = False
    ddd_threshold: float = -0.6
    length_offset: float = 0.0  # added to the prediction before rounding (fit by `jspec calibrate`; 0: the paper)
    d_model: int | None = None
    hidden: int = DEFAULT_HIDDEN
    num_layers: int = DEFAULT_NUM_LAYERS

    @property
    def needs_draft_logits(self) -> bool:  # type: ignore[override]
        return self.ddd

    @property
    def needs_in_round_state(self) -> bool:  # type: ignore[override]
        return self.ddd

    @property
    def stops_in_round(self) -> bool:  # type: ignore[override]
        return self.ddd  # without DDD the predicted length is the round's limit, set before drafting

    def init(self, batch, key, params=None):
        if params is None:
            if self.d_model is None:
                raise ValueError(
                    "ldlp needs predictor weights: init(batch, key, params=...) "
                    "(or set d_model for random, untrained weights)"
                )
            params = init_ldlp(
                self.d_model, key, hidden=self.hidden, num_layers=self.num_layers
            )
        return LDLPState(
            params=jax.tree_util.tree_map(jnp.asarray, params),
            predicted_len=jnp.ones((batch,), jnp.int32),
            cum_logprob=jnp.zeros((batch,), jnp.float32),
            rounds=jnp.zeros((batch,), jnp.int32),
        )

    def _predicted_length(self, state: LDLPState, k_max: int, features: Features) -> jax.Array:
        if not features or "token_embedding" not in features or "target_feature" not in features:
            raise ValueError("ldlp needs features['token_embedding'] and features['target_feature']")
        prediction = ldlp_apply(
            state.params, features["token_embedding"], features["target_feature"]
        )
        return length_from_prediction(prediction + self.length_offset, k_max)

    def _plain_calls_unsupported(self) -> None:
        if self.ddd:
            raise ValueError(
                "ldlp with ddd=True keeps in-round state: call start_round(...) and observe(...) "
                "instead of round_limit(...) and stop(...)"
            )

    def round_limit(self, state, k_max, features=None):
        self._plain_calls_unsupported()
        self._check_k_max(k_max)
        return self._predicted_length(state, k_max, features)

    def stop(self, state, step, draft_logits):
        self._plain_calls_unsupported()
        return never_stop(draft_logits)

    def start_round(self, state, k_max, features=None):
        if not self.ddd:
            return super().start_round(state, k_max, features)
        self._check_k_max(k_max)
        predicted = self._predicted_length(state, k_max, features)
        state = state.replace(
            predicted_len=predicted, cum_logprob=jnp.zeros_like(state.cum_logprob)
        )
        return state, full_limit(predicted.shape[0], k_max)

    def observe(self, state, step, draft_logits, draft_token=None):
        if not self.ddd:
            return super().observe(state, step, draft_logits, draft_token)
        log_probs = draft_log_probs(draft_logits)
        if draft_token is None:
            token_logprob = jnp.max(log_probs, axis=-1)
        else:
            token_logprob = jnp.take_along_axis(
                log_probs, draft_token[:, None].astype(jnp.int32), axis=-1
            )[:, 0]
        cum_logprob = state.cum_logprob + token_logprob
        reached_length = step + 1 >= state.predicted_len
        stop = reached_length & (cum_logprob < self.ddd_threshold)
        return state.replace(cum_logprob=cum_logprob), stop


# ------------------------------------------------------------------------------------------------
# Weights on disk (beside the EAGLE head they were trained for)
# ------------------------------------------------------------------------------------------------

WEIGHTS_FILE = "ldlp.safetensors"
CONFIG_FILE = "ldlp.json"


def save_ldlp(directory: str, params: dict, config: dict) -> None:
    """Write predictor weights (float32 safetensors) and a JSON config (d_model, hidden,
    num_layers, k_max, under_weight, alignment, metrics...)."""
    import json
    import os

    import numpy as np

    os.makedirs(directory, exist_ok=True)
    save_safetensors({k: np.asarray(v, np.float32) for k, v in params.items()}, os.path.join(directory, WEIGHTS_FILE))
    with open(os.path.join(directory, CONFIG_FILE), "w") as fh:
        json.dump(config, fh, indent=1)


def load_ldlp(directory: str) -> tuple[dict, dict]:
    """(params, config) saved by ``save_ldlp``; raises FileNotFoundError naming the file."""
    import json
    import os

    from safetensors.numpy import load_file

    path = os.path.join(directory, WEIGHTS_FILE)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"no LDLP predictor weights at {path} (train them with `jspec train-ldlp`)")
    with open(os.path.join(directory, CONFIG_FILE)) as fh:
        config = json.load(fh)
    params = {k: jnp.asarray(v) for k, v in load_file(path).items()}
    return params, config
