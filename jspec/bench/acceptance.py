"""Exact accepted tokens per target call of greedy EAGLE chains, without running the engine.

For a greedy chain, the drafts of a round are a pure function of the committed prefix, and the
round accepts the longest prefix of drafts equal to the target's greedy continuation.
`jspec.train.ldlp.label_positions` computes, for every position t of the target's own greedy
answer, that accepted length label[t], with the training-time-test unroll that attends exactly as
the engine's draft steps do (committed K/V from the target's true features, the round's earlier
drafts on the diagonal, rope at t + j). `walk` then replays the engine: the prefill emits the
first answer token, and a round after token x_c emits min(label[c - 1], K) + 1 tokens. The target
calls it counts equal the chain engine's (tests/test_acceptance.py), for every K from one pass.

An independent draft model is simpler still (`draft_model_chain_calls`): a draft that can be
accepted follows drafts equal to the target's tokens, so it is the draft model's argmax on the
answer's true prefix, and one teacher-forced pass of the draft model gives every label.

Trees are not covered (their acceptance depends on the whole candidate set). A position average
of the labels, as `jspec train-ldlp` reports, overestimates tokens per call: a long accepted run
holds many positions but a single round start.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from ..config import ModelConfig
from ..heads import eagle as H
from ..model import forward, init_cache
from ..train.losses import chunked_argmax_logits
from ..train.ldlp import label_positions


def walk(labels: np.ndarray, start: int, end: int, k: int) -> tuple[int, int]:
    """(tokens, target calls) of greedy chains of at most k drafts over answer positions
    [start, end) of a row whose per-position accepted lengths are `labels`."""
    tokens, calls, c = 1, 1, start
    while c + 1 < end:
        step = min(int(labels[c - 1]), k, end - 2 - c) + 1  # never past the answer's end
        tokens, calls, c = tokens + step, calls + 1, c + step
    return tokens, calls


def chain_calls(hcfg: H.HeadConfig, head_params: dict, target_params: dict, prompts: list[list[int]],
                answers: list[list[int]], ks: list[int], pad_id: int, multiple: int = 128) -> list[dict[int, int]]:
    """Target calls of greedy chains with each K in `ks`, per row, for the target's own greedy
    `answers` to `prompts` (one batched teacher-forced pass)."""
    k_max = max(ks)
    rows = [list(p) + list(a) for p, a in zip(prompts, answers)]
    T = max(len(r) for r in rows) + k_max + 2
    T += (-T) % multiple
    tokens = np.full((len(rows), T), pad_id, np.int32)
    mask = np.zeros((len(rows), T), bool)
    for i, (p, r) in enumerate(zip(prompts, rows)):
        tokens[i, : len(r)] = r
        mask[i, len(p) : len(r)] = True
    _, _, labels, _ = label_positions(hcfg, head_params, target_params, jnp.asarray(tokens), jnp.asarray(mask),
                                      k_max=k_max, logits_chunk=min(128, multiple))
    labels = np.asarray(labels)
    return [{k: walk(labels[i], len(p), len(r), k)[1] for k in ks} for i, (p, r) in enumerate(zip(prompts, rows))]


@functools.partial(jax.jit, static_argnames=("dcfg",))
def _draft_argmax(dcfg: ModelConfig, dparams: dict, tokens: jax.Array) -> jax.Array:
    """The draft model's argmax after every position of `tokens` [B, T] (teacher-forced)."""
    B, T = tokens.shape
    out = forward(dparams, dcfg, tokens, init_cache(dcfg, B, T, dparams["embed"].dtype))
    if "d2t" in dparams:  # a draft vocabulary (drafters.model.restrict_vocab): the argmax over its ids
        idx = jnp.argmax(jnp.dot(out.hidden, dparams["draft_lm_head"], preferred_element_type=jnp.float32), axis=-1)
        return dparams["d2t"][idx]  # d2t is sorted: ties go to the lower id, as over the full logits
    return chunked_argmax_logits(dparams, dcfg, out.hidden, 64)


def draft_model_chain_calls(dcfg: ModelConfig, dparams: dict, prompts: list[list[int]], answers: list[list[int]],
                            ks: list[int], pad_id: int, multiple: int = 256) -> list[dict[int, int]]:
    """Target calls of greedy chains of an independent draft model with each K in `ks`, per row,
    for the target's own greedy `answers` (one teacher-forced pass of the draft model per row; the
    label after answer position j is the run of positions from j + 1 where its argmax on the true
    prefix is the answer's token)."""
    out = []
    for p, a in zip(prompts, answers):
        row = list(p) + list(a)
        T = len(row) + (-len(row)) % multiple
        tokens = np.full((1, T), pad_id, np.int32)
        tokens[0, : len(row)] = row
        top = np.asarray(_draft_argmax(dcfg, dparams, jnp.asarray(tokens)))[0]
        match = [int(top[len(p) + j - 1]) == a[j] for j in range(1, len(a))] + [False]
        labels = np.zeros(len(row), np.int32)  # labels[c - 1]: accepted drafts in the round after row[c]
        run = 0
        for j in range(len(a) - 1, -1, -1):  # match[j]: answer token j + 1 drafted correctly
            run = run + 1 if match[j] else 0
            labels[len(p) + j - 1] = run
        out.append({k: walk(labels, len(p), len(row), k)[1] for k in ks})
    return out
