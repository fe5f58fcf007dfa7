"""What the speculative engines carry through their `lax.while_loop`: `SpecState`, the per-call
traces, the features a policy reads at the start of a round, and the conversion to a host-side
GenerationResult. Shared by every engine; imports nothing above `decode`."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from .. import model as M
from ..decode import GenerationResult, cut_at_budgets


@struct.dataclass
class SpecState:
    cache: M.KVCache
    dstate: Any
    pstate: Any
    out: jax.Array  # [B, max_new]
    n_out: jax.Array  # [B]
    last: jax.Array  # [B] last emitted token, not yet in the target cache
    feature: jax.Array  # [B, D] target feature at the last committed position (LDLP input)
    done: jax.Array  # [B]
    key: jax.Array
    target_calls: jax.Array  # [B] (prefill counts as one)
    drafted: jax.Array  # [B]
    accepted: jax.Array  # [B]
    trace_drafted: jax.Array  # [B, max_new + 1] draft tokens behind each target call (0 for the prefill)
    trace_tokens: jax.Array  # [B, max_new + 1] tokens each target call added (bonus included)
    consultant_nll: jax.Array | None = None  # [B] Consultant Decoding's running NLL (smoothed rule only)


def record_call(state: SpecState, active, n_drafted, n_out_before, n_out_after):
    """Per-call traces for the report's accepted-length histograms and draft-length plots."""
    b = jnp.arange(state.n_out.shape[0])
    i = jnp.where(active, state.target_calls, state.trace_drafted.shape[1])  # finished rows: dropped
    return (state.trace_drafted.at[b, i].set(n_drafted, mode="drop"),
            state.trace_tokens.at[b, i].set(n_out_after - n_out_before, mode="drop"))


def accepted_emitted(n_accepted, n_out_before, n_out_after):
    """Accepted drafts a round emitted: all n of them, unless the token budget or an EOS cut the
    round's block (the bonus token goes first, then the accepted drafts past the cut), so the
    statistics never count more accepted tokens than were emitted."""
    return jnp.minimum(n_accepted, n_out_after - n_out_before)


def cut_spec_at_budgets(before: SpecState | None, after: SpecState, budgets) -> SpecState:
    """`cut_at_budgets` for a round (or, `before` None, the start): a row whose round emitted past
    its budget keeps only the tokens up to it, and the round's accepted count and trace count only
    those. A round's block is its accepted drafts, then the bonus token: the cut drops the bonus
    first."""
    cut = cut_at_budgets(after, budgets)
    if before is None:
        return cut.replace(trace_tokens=cut.trace_tokens.at[:, 0].set(cut.n_out))
    kept = cut.n_out - before.n_out
    active = ~before.done
    b = jnp.arange(kept.shape[0])
    at = jnp.where(active, before.target_calls, cut.trace_tokens.shape[1])  # finished rows: dropped
    return cut.replace(accepted=before.accepted + jnp.minimum(after.accepted - before.accepted, kept),
                       trace_tokens=cut.trace_tokens.at[b, at].set(kept, mode="drop"))


def round_features(state: SpecState, tparams) -> dict:
    return {"target_feature": state.feature, "token_embedding": tparams["embed"][state.last]}


def result_from_device(outputs) -> GenerationResult:
    """GenerationResult from an engine's output tuple; an 8th entry, the final policy state, stays
    on device (it is passed back as ``policy_state`` by a caller that continues the session)."""
    policy_state = outputs[7] if len(outputs) > 7 else None
    out, n_out, calls, drafted, accepted, tr_d, tr_t = (np.asarray(x) for x in jax.device_get(tuple(outputs[:7])))
    return GenerationResult(out, n_out, calls, drafted, accepted, calls, draft_lengths=tr_d, step_tokens=tr_t,
                            policy_state=policy_state)


def take_row(x: jax.Array, idx: jax.Array) -> jax.Array:
    """x [B, T, ...], idx [B] -> x[b, idx[b]]."""
    return jnp.take_along_axis(x, idx.reshape((-1, 1) + (1,) * (x.ndim - 2)), axis=1)[:, 0]


def outputs_of(state: SpecState) -> tuple:
    """The per-row results an engine returns (`result_from_device` reads them in this order)."""
    return (state.out, state.n_out, state.target_calls, state.drafted, state.accepted, state.trace_drafted,
            state.trace_tokens)
