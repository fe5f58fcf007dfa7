"""N-gram prompt lookup: a model-free, parallel drafter that runs on device, and its rule replayed
on the host over a call's prompts (`replay_lookup`: how well the prompts predict themselves, from
which the `auto` plan estimates the call's acceptance)."""

from __future__ import annotations

import dataclasses
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from ..state import take_row


@struct.dataclass
class NgramState:
    history: jax.Array  # [B, H] prompt + emitted tokens
    length: jax.Array  # [B] valid entries in history


@dataclasses.dataclass(frozen=True)
class NgramDrafter:
    """Prompt lookup: find the latest earlier occurrence of the last n tokens (n = max..min) and
    propose the tokens that followed it. Deterministic, so q is a point mass (q = 1)."""

    max_ngram: int = 3
    min_ngram: int = 1
    name = "ngram"
    parallel = True
    deterministic = True
    capture_layers = ()

    def init(self, dparams, tparams, tcfg, prompt, lens, first_token, prefill_out, cache_len):
        B = prompt.shape[0]
        hist = jnp.zeros((B, cache_len), jnp.int32).at[:, : prompt.shape[1]].set(prompt)
        hist = hist.at[jnp.arange(B), lens].set(first_token)
        return NgramState(history=hist, length=lens + 1)

    def propose(self, dstate: NgramState, last_token, k: int):
        tokens, valid, _ = self.propose_ordered(dstate, k)
        return tokens, valid

    def propose_ordered(self, dstate: NgramState, k: int):
        """`propose`, plus the order of the match each row's proposal follows: [B] int32, the n of
        the n-gram found (min_ngram..max_ngram), 0 where none was. A longer match is a far better
        bet: on SmolLM2's answers to training-side prompts, rounds after a 3-gram match accepted
        5.35 of 8 drafts, the others 0.45 (engines.tree's `lookup_first` reads it)."""
        hist, L = dstate.history, dstate.length
        B, H = hist.shape
        j = jnp.arange(H)[None]  # candidate end index of an earlier match
        found = jnp.zeros((B,), bool)
        start = jnp.zeros((B,), jnp.int32)
        order = jnp.zeros((B,), jnp.int32)
        for n in range(self.max_ngram, self.min_ngram - 1, -1):
            match = (j >= n - 1) & (j < L[:, None] - 1)
            for m in range(n):
                tail = take_row(hist[:, :, None], L - 1 - m)[:, 0]  # [B]
                cand = jnp.take_along_axis(hist, jnp.clip(j - m, 0, H - 1), axis=1)
                match &= cand == tail[:, None]
            last_match = jnp.max(jnp.where(match, j, -1), axis=1)
            use = ~found & (last_match >= 0) & (L > n)
            start = jnp.where(use, last_match + 1, start)
            order = jnp.where(use, n, order)
            found = found | use
        idx = start[:, None] + jnp.arange(k)[None]
        tokens = jnp.take_along_axis(hist, jnp.clip(idx, 0, H - 1), axis=1)
        valid = found[:, None] & (idx < L[:, None])
        return tokens, valid, order

    def commit(self, dparams, tparams, tcfg, dstate: NgramState, block_tokens, n_accepted, next_token, verify_out):
        B, T = block_tokens.shape
        emitted = jnp.concatenate([block_tokens[:, 1:], next_token[:, None]], axis=1)  # [B, K+1]
        t = jnp.arange(T)[None]
        emitted = jnp.where(t == n_accepted[:, None], next_token[:, None], emitted)
        dst = jnp.where(t <= n_accepted[:, None], dstate.length[:, None] + t, dstate.history.shape[1])
        hist = dstate.history.at[jnp.arange(B)[:, None], dst].set(emitted, mode="drop")
        return NgramState(history=hist, length=jnp.minimum(dstate.length + n_accepted + 1, hist.shape[1]))


def latest_earlier_match(tokens: np.ndarray, row: np.ndarray, offset: np.ndarray, max_ngram: int,
                         min_ngram: int) -> np.ndarray:
    """For each position t of rows packed end to end (tokens, row id and offset within the row,
    [N] each): the end index of the latest earlier occurrence, within the same row, of the n tokens
    ending at t, for the largest n in max_ngram..min_ngram that has one (`NgramDrafter.propose`'s
    rule over the history tokens[..t]); -1 where none has.

    The n-grams get dense ids level by level: an n-gram is its (n-1)-gram's id and its last token,
    so each level is one stable sort of one integer key, whose neighbours in sorted order are the
    same n-gram's occurrences in position order."""
    N = tokens.shape[0]
    match = np.full(N, -1, np.int64)
    vocab = int(tokens.max(initial=0)) + 1
    ids = row.astype(np.int64)  # dense id of the (n-1)-gram ending at each position (n = 1: the row)
    for n in range(1, max_ngram + 1):
        at = np.nonzero(offset >= n - 1)[0]  # positions with n tokens of their row behind them
        key = (ids[at - 1] if n > 1 else ids[at]) * vocab + tokens[at]
        order = np.argsort(key, kind="stable")  # stable: equal keys stay in position order
        ranked = key[order]
        repeat = np.zeros(at.shape[0], bool)  # an earlier occurrence precedes it in sorted order
        repeat[1:] = ranked[1:] == ranked[:-1]
        if n >= min_ngram:  # a longer n-gram's match overrides a shorter one's, as the drafter tries it first
            later = at[order[repeat]]
            match[later] = at[order[np.nonzero(repeat)[0] - 1]]
        ids[at[order]] = np.cumsum(~repeat)
    return match


def replay_lookup(prompts: Sequence[Sequence[int]], draft: int, max_ngram: int = 3, min_ngram: int = 1) -> np.ndarray:
    """[I] The n-gram drafter's rounds replayed over each prompt as if it were being generated: from
    the prompt's first token, a round looks up the history so far (`latest_earlier_match`),
    proposes up to `draft` tokens that followed the match (only those already in the history, as
    the drafter does), keeps the prefix that equals the prompt's next tokens (n), and moves on by
    n + 1 tokens; the replay stops `draft` tokens before the prompt's end. A round with no match
    keeps nothing.

    Returns [B, 3] float64 per prompt: accepted drafts, trials and rounds, the trials those of the
    geometric fit of a round that drafts `draft` tokens (policies.auto.acceptance_sums): n + 1,
    or n when all were kept. Host numpy: the accepted prefix at every position at once, then the
    walk from the first token by pointer doubling (log2 of the longest prompt steps)."""
    lens = np.asarray([len(p) for p in prompts], np.int64)
    N = int(lens.sum())
    if N == 0:
        return np.zeros((len(lens), 3))
    tokens = np.concatenate([np.asarray(p, np.int64).reshape(-1) for p in prompts])
    starts = np.cumsum(lens) - lens
    row = np.repeat(np.arange(len(lens)), lens)
    offset = np.arange(N) - starts[row]
    end = (starts + lens)[row]
    match = latest_earlier_match(tokens, row, offset, max_ngram, min_ngram)
    t = np.arange(N)
    live = (t + draft < end) & (match >= 0)  # positions the replay can score with a match
    at, src = t[live], match[live] + 1
    room = at - src  # proposal i is in the history when i <= room
    kept = np.ones(at.shape[0], bool)
    count = np.zeros(at.shape[0], np.int32)
    for i in range(draft):  # the accepted prefix: proposals in the history that equal the next tokens
        kept &= (i <= room) & (tokens[np.minimum(src + i, N - 1)] == tokens[at + 1 + i])
        count += kept
    accepted = np.zeros(N + 1, np.int32)  # entry N: past every prompt's end, where every walk ends
    accepted[at] = count
    scored = np.append(t + draft < end, False)
    counts = [accepted * scored, (accepted + (accepted < draft)) * scored, scored.astype(np.int32)]
    nxt = np.where(scored, np.arange(N + 1) + accepted + 1, N)
    for _ in range(int(lens.max()).bit_length()):  # after j steps, counts[.][t]: the 2^j rounds from t
        counts = [c + c[nxt] for c in counts]
        nxt = nxt[nxt]
    return np.stack([c[starts] for c in counts], 1).astype(np.float64)
