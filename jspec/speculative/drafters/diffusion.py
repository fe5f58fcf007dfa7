"""DiffuSpec: a masked-diffusion LM drafts a block of tokens in one forward; causal-consistency
path search (CPS) picks a left-to-right path through its per-position candidates.

Round (docs/methods.md, DiffuSpec; arXiv 2510.02358):

1. One cached DLM call commits the last verified block to the DLM's prefix cache (causal) and
   denoises `[last, MASK x (T-1)]` bidirectionally: T per-position distributions q_i for the next
   T tokens (S = 1). With `steps` S > 1 the most confident positions are fixed and the block is
   re-run, S - 1 more times (the paper's refinement steps; costly, off by default).
2. CPS (`cps=True`): per position keep the smallest top set with cumulative mass >= tau, capped
   at M_max, EOS always kept; beam search of width B over this lattice. Each token's log weight
   is `lam * log q_i(x_i) + (1 - lam) * log P_proxy(x_i | x_{i-2}, x_{i-1})`, the proxy a 3-gram
   model of the distilled data (device-side sorted tables, stupid backoff). The paper scores a
   path by the sum of its log weights (`objective="logprob"`, `PAPER_CPS`); the library default
   scores it by its expected accepted length, sum_k prod_{i<=k} weight_i (`"expected"`). A path
   ends at EOS. Without CPS the draft is the per-position argmax.
3. The draft stops *before* the first EOS (the target then emits EOS itself if it agrees, so
   nothing is lost), and positions past the policy's limit or past the CPS path's end (a path
   stops short when the lattice ends at an EOS the path did not take) are invalid: the number of
   valid drafts is the EOS-aware generated length ADL reads (`policies/adl.py`).

Verification is the engine's chain rule. Greedy: lossless (identical to AR). Sampling: the paper
verifies with the left-to-right proxy q_i^{L2R} = the DLM's one-forward marginal at position i
(`sampling_q="l2r"`), which is **approximate**: CPS picks tokens by search, not by sampling q.
`sampling_q="point"` treats the (deterministic) CPS path as a point mass (q = 1, the EAGLE-2
convention), which is exactly lossless at a lower acceptance rate.

[I] reconstructions, marked in docs/methods.md: the lattice stops after the first position whose
tau-mass set contains EOS (the reproduction's "positions after the first position containing EOS
are not expanded"; `eos_stop=False` turns it off); the proxy's backoff (stupid backoff, alpha = 0.4, add-one unigrams); the
L2R proxy read as the one-forward marginals.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from ... import model as M
from ...config import ModelConfig
from ...heads import dlm as D
from ...kernels import cps_search
from ...kernels.top_k import top_k
from ...sampling import Sampling, probs
from ..state import take_row
from .base import DrafterError

PAPER_CPS = {"tau": 0.8, "m_max": 15, "beam": 3, "lam": 0.5, "objective": "logprob", "eos_stop": True}
# Library defaults for a small (135M-class) target: a 30-token block costs the DLM one forward,
# but a small DLM's marginals degrade fast with distance, so rounds verify fewer tokens; a
# narrower lattice keeps the beam search cheap next to a ~1 ms target call. The search scores
# paths by their expected accepted length with no EOS stop (a library extension: the paper's sum of
# log weights favours paths that end early at EOS). On held-out chit-chat prompts (CPU, fp32,
# dlm-4l round 2, a proxy of the prompt corpus) it drafted 2.28 accepted tokens per call against
# the paper's rule's 2.00 and the argmax's 2.18 on the 48 lambda was chosen on (0.7 over 0.5's
# 2.18 and 0.9's 2.27), and 2.08 against 1.86 and 2.04 on the next 48.
LIBRARY_CPS = {"tau": 0.8, "m_max": 6, "beam": 3, "lam": 0.7, "objective": "expected", "eos_stop": False}
CPS_SEARCHES = ("auto",) + cps_search.IMPLS  # "auto": the one-kernel search where the model's GPU kernels run


# ---------------------------------------------------------------------------------------------
# The 3-gram proxy: fitted on the host, looked up on the device
# ---------------------------------------------------------------------------------------------


_HASH_MULT = (0x9E3779B1, 0x85EBCA77, 0xC2B2AE3D)


def _bucket_of(cols, bits: int, xp):
    """Hash bucket in [0, 2**bits) of key columns (a tuple of int arrays): the same uint32
    arithmetic in numpy (xp=np, fitting) and on the device (xp=jnp, lookup)."""
    h = xp.zeros(cols[0].shape, xp.uint32)
    for c, mult in zip(cols, _HASH_MULT):
        h = (h ^ c.astype(xp.uint32)) * xp.uint32(mult)
        h = h ^ (h >> xp.uint32(15))
    return (h >> xp.uint32(32 - bits)).astype(xp.int32) if bits else xp.zeros(h.shape, xp.int32)


def _hashed_table(cols: list[np.ndarray], lp: np.ndarray, prefix: str) -> dict:
    """Key columns and log-probs grouped by hash bucket, with each bucket's start: a lookup reads
    one bucket (a fixed-width window of rows: `{prefix}_window`'s length, the fullest bucket's
    size) instead of binary-searching. At most one key per two buckets on average (4M random
    keys: 7 in the fullest bucket, 3 in the 99th percentile); a sentinel row past every real key
    keeps the table non-empty."""
    n = len(lp)
    bits = int(math.ceil(math.log2(max(n, 1)))) + 1
    bucket = _bucket_of(tuple(cols), bits, np)
    order = np.argsort(bucket, kind="stable")
    start = np.searchsorted(bucket[order], np.arange((1 << bits) + 1)).astype(np.int32)
    width = int(np.max(np.diff(start))) if n else 1
    big = np.int32(np.iinfo(np.int32).max)
    out = {f"{prefix}_{i}": np.append(c[order].astype(np.int32), big) for i, c in enumerate(cols)}
    out[f"{prefix}_lp"] = np.append(lp[order], np.float32(0.0))
    out[f"{prefix}_start"] = start
    out[f"{prefix}_window"] = np.zeros(max(width, 1), np.int8)
    return out


def fit_trigram_proxy(sequences, vocab_size: int, *, min_count: int = 1, max_entries: int = 4_000_000) -> dict:
    """Tables of a 3-gram model with stupid backoff from token sequences (host, numpy).

    Returns a pytree of arrays: (a, b, c) trigram keys with log P(c | a b) and (b, c) bigram keys
    with log P(c | b), each as int32 key columns grouped by hash bucket (`_hashed_table`: a
    device lookup is a few vectorised gathers, no search loop, no 64-bit keys), and dense add-one
    unigram log-probs [V]. Only the `max_entries` most frequent n-grams of each order are kept
    (ties by key order)."""
    V = int(vocab_size)
    uni = np.zeros(V, np.int64)
    tri_keys, bi_keys = [], []
    for s in sequences:
        s = np.asarray(s, np.int64)
        if s.size == 0:
            continue
        uni += np.bincount(s, minlength=V)[:V]
        if s.size >= 2:
            bi_keys.append(s[:-1] * V + s[1:])
        if s.size >= 3:
            tri_keys.append((s[:-2] * V + s[1:-1]) * V + s[2:])
    uni_lp = np.log((uni + 1.0) / (uni.sum() + V)).astype(np.float32)

    def table(keys):
        if not keys:
            return np.zeros((0,), np.int64), np.zeros((0,), np.float32)
        k, c = np.unique(np.concatenate(keys), return_counts=True)
        ctx = k // V  # context id: (a, b) for trigrams, b for bigrams
        ctx_u, ctx_inv = np.unique(ctx, return_inverse=True)
        ctx_tot = np.bincount(ctx_inv, weights=c)
        lp = np.log(c / ctx_tot[ctx_inv]).astype(np.float32)
        keep = c >= min_count
        if keep.sum() > max_entries:
            order = np.argsort(-c, kind="stable")[:max_entries]
            keep = np.zeros_like(keep)
            keep[order] = True
        return k[keep], lp[keep]

    tk, tlp = table(tri_keys)
    bk, blp = table(bi_keys)

    def cols(k, n):
        out = []
        for _ in range(n):
            out.append(k % V)
            k = k // V
        return out[::-1]

    return {"uni": uni_lp, **_hashed_table(cols(tk, 3), tlp, "tri"), **_hashed_table(cols(bk, 2), blp, "bi")}


def _hashed_lookup(proxy: dict, prefix: str, query: tuple):
    """(found, log-prob) of query keys (tuple of int32 arrays, same shape) in a `_hashed_table`:
    every query reads its bucket's window of rows in one gather per column."""
    start = proxy[f"{prefix}_start"]
    bits = int(round(math.log2(start.shape[0] - 1)))
    width = proxy[f"{prefix}_window"].shape[0]
    bucket = _bucket_of(query, bits, jnp)
    lo, hi = start[bucket], start[bucket + 1]
    idx = lo[..., None] + jnp.arange(width, dtype=jnp.int32)  # [..., width]
    hit = idx < hi[..., None]
    idx = jnp.minimum(idx, proxy[f"{prefix}_lp"].shape[0] - 1)
    for i, q in enumerate(query):
        hit = hit & (proxy[f"{prefix}_{i}"][idx] == q[..., None])
    return jnp.any(hit, axis=-1), jnp.sum(jnp.where(hit, proxy[f"{prefix}_lp"][idx], 0.0), axis=-1)


BACKOFF_LOG_ALPHA = math.log(0.4)


def proxy_logprob(proxy: dict, a: jax.Array, b: jax.Array, c: jax.Array) -> jax.Array:
    """log P_proxy(c | a, b) with stupid backoff (alpha 0.4) to bigrams and add-one unigrams."""
    t_found, t_lp = _hashed_lookup(proxy, "tri", (a, b, c))
    b_found, b_lp = _hashed_lookup(proxy, "bi", (b, c))
    uni = proxy["uni"][c]
    return jnp.where(t_found, t_lp, jnp.where(b_found, BACKOFF_LOG_ALPHA + b_lp, 2 * BACKOFF_LOG_ALPHA + uni))


PROXY_FILE = "proxy.npz"  # a proxy beside a dlm.safetensors: build_drafter("dlm:...") drafts with CPS


def save_proxy(path: str, proxy: dict) -> None:
    np.savez(path, **{k: np.asarray(v) for k, v in proxy.items()})


def load_proxy(path: str) -> dict:
    with np.load(path) as z:
        return {k: jnp.asarray(z[k]) for k in z.files}


# ---------------------------------------------------------------------------------------------
# CPS: lattice and beam search (pure, static shapes)
# ---------------------------------------------------------------------------------------------


def cps_lattice(logits: jax.Array, eos_id: int, tau: float, m_max: int):
    """Per-position candidates from DLM logits (or log-probs) [B, K, V].

    Returns (tokens [B, K, C], logq [B, K, C], ok [B, K, C], eos_stop [B]) with C = m_max + 1:
    the smallest top set with cumulative mass >= tau (capped at m_max), plus an EOS slot that is
    always kept (a duplicate of an EOS already in the set is dropped). eos_stop: index of the first
    position whose tau-set contains EOS (K if none): later positions are not expanded. The
    log-probs are normalised on the C candidates only (logit - logsumexp): one top_k and two
    reductions over the vocabulary, nothing [B, K, V]-sized written."""
    B, K, V = logits.shape
    x = logits.astype(jnp.float32)
    lse = jax.nn.logsumexp(x, axis=-1, keepdims=True)
    top_x, top_tok = top_k(x, m_max)
    top_lp = top_x - lse
    p = jnp.exp(top_lp)
    keep = (jnp.cumsum(p, axis=-1) - p) < tau
    eos_in_set = jnp.any(keep & (top_tok == eos_id), axis=-1)  # [B, K]
    keep = keep & (top_tok != eos_id)
    eos_lp = x[..., eos_id][..., None] - lse
    tokens = jnp.concatenate([top_tok.astype(jnp.int32), jnp.full((B, K, 1), eos_id, jnp.int32)], axis=-1)
    logq = jnp.concatenate([top_lp, eos_lp], axis=-1)
    ok = jnp.concatenate([keep, jnp.ones((B, K, 1), bool)], axis=-1)
    eos_stop = jnp.where(jnp.any(eos_in_set, axis=1), jnp.argmax(eos_in_set, axis=1), K).astype(jnp.int32)
    return tokens, logq, ok, eos_stop


def cps_beam_search(tokens, logq, ok, limit, prev2, prev1, proxy_fn, *, beam: int, lam: float, eos_id: int,
                    objective: str = "logprob", impl: str = "xla"):
    """Left-to-right beam search over a lattice (tokens / logq / ok [B, K, C]).

    Expands positions < limit[b]; a beam that takes EOS is finished and carried unchanged. Path
    score (`objective`, kernels/cps_search.py) over the tokens' log weights lam * logq + (1 - lam) *
    proxy_fn(x_{i-2}, x_{i-1}, x_i), the context starting from (prev2, prev1). Returns (path [B, K] int32, length [B] int32, score [B]):
    the best final beam (ties: the earlier-found beam).

    Every proxy score a path could need is looked up once, before the search, for every
    (candidate at i-2, candidate at i-1, candidate at i) triple ([B, K, C, C, C], one vectorised
    lookup); the search itself (kernels/cps_search.py, `impl` "pallas" or "xla") only gathers."""
    B, K, C = tokens.shape
    # lattice extended by the two context tokens as positions -2 and -1 (one candidate each, index 0)
    ctx = lambda t: jnp.broadcast_to(t.astype(jnp.int32)[:, None, None], (B, 1, C))  # noqa: E731
    ext = jnp.concatenate([ctx(prev2), ctx(prev1), tokens.astype(jnp.int32)], axis=1)  # [B, K+2, C]
    a = ext[:, :K, :, None, None]
    b = ext[:, 1 : K + 1, None, :, None]
    c = ext[:, 2:, None, None, :]
    shape = (B, K, C, C, C)
    table = proxy_fn(jnp.broadcast_to(a, shape), jnp.broadcast_to(b, shape), jnp.broadcast_to(c, shape))
    return cps_search.search(tokens, logq, ok, table, limit, beam=beam, lam=lam, eos_id=eos_id, objective=objective,
                             impl=impl)


# ---------------------------------------------------------------------------------------------
# The drafter
# ---------------------------------------------------------------------------------------------


@struct.dataclass
class DiffuSpecState:
    cache: M.KVCache  # DLM prefix cache; cursor = position of the round's anchor (`last`)
    pending: jax.Array  # [B, K+1] last verified block, committed at the start of the next call
    n_pending: jax.Array  # [B] how many of them were accepted (0 after the prefill)
    prev: jax.Array  # [B] the token before `last` (3-gram context)


def _first_true(x: jax.Array) -> jax.Array:
    """Index of the first True along the last axis (its size if none)."""
    n = x.shape[-1]
    return jnp.where(jnp.any(x, axis=-1), jnp.argmax(x, axis=-1), n).astype(jnp.int32)


@dataclasses.dataclass(frozen=True)
class DiffuSpecDrafter:
    """DiffuSpec (one-forward DLM block drafts + CPS); dparams = {"dlm": own DLM weights,
    "proxy": fit_trigram_proxy(...) tables}. The engine's k_max is the longest draft (<= the
    DLM's block size); pair it with the `adl` policy (``ADLPolicy.paper()`` for k in [20, 30]).

    tau / m_max / beam / lam: CPS (``PAPER_CPS``; ``LIBRARY_CPS`` for a small target).
    steps: denoising forwards per round (paper S = 1). sampling_q: "l2r" (paper, approximate) or
    "point" (q = 1 on the CPS path: exactly lossless). kernels: model.forward implementation.
    cps_search: CPS's beam search, "auto" (the one-kernel search where the model's GPU kernels
    run, else the portable one), "xla" (portable jnp) or "pallas" (one GPU kernel,
    kernels/cps_search.py: its docstring says what it costs and saves).
    objective: how CPS scores a path (kernels/cps_search.py): "logprob", the sum of its tokens'
    log weights (the paper's), or "expected", its expected accepted length (library extension).
    eos_stop [I]: the lattice ends after the first position whose tau-set holds EOS (the
    reproduction's rule); False expands every position up to the policy's limit, EOS staying a
    candidate that ends a path wherever it is taken. Path scores are sums of log-probabilities,
    so without the stop a path that ends early at EOS tends to outscore longer ones (the rule
    guards against that; "expected" needs no guard: a token never lowers a path's score)."""

    dcfg: D.DLMConfig
    k_max: int
    cps: bool = True
    tau: float = LIBRARY_CPS["tau"]
    m_max: int = LIBRARY_CPS["m_max"]
    beam: int = LIBRARY_CPS["beam"]
    lam: float = LIBRARY_CPS["lam"]
    steps: int = 1
    sampling_q: str = "l2r"
    kernels: str | None = None
    cps_search: str = "auto"
    objective: str = LIBRARY_CPS["objective"]
    eos_stop: bool = LIBRARY_CPS["eos_stop"]

    name = "diffuspec"
    parallel = True  # proposes a whole block at once: per-token stop policies do not apply
    block = True  # drafts through `draft_block` (one call per round, with weights)
    capture_layers = ()

    @classmethod
    def paper(cls, dcfg: D.DLMConfig, k_max: int = 30, **kw) -> "DiffuSpecDrafter":
        return cls(dcfg=dcfg, k_max=k_max, **{**PAPER_CPS, **kw})

    @property
    def deterministic(self) -> bool:
        return self.sampling_q == "point"

    def check(self, tcfg: ModelConfig):
        t = self.dcfg.target
        if (t.vocab_size, t.hidden_size) != (tcfg.vocab_size, tcfg.hidden_size):
            raise DrafterError(f"DLM was built for vocab {t.vocab_size} / hidden {t.hidden_size}, the target has "
                               f"{tcfg.vocab_size} / {tcfg.hidden_size}: it must share the target's embeddings")
        if not 1 <= self.k_max <= self.dcfg.block_size:
            raise DrafterError(f"diffuspec k_max {self.k_max} must be in [1, the DLM block size {self.dcfg.block_size}]")
        if self.steps < 1:
            raise DrafterError(f"diffuspec steps must be >= 1, got {self.steps}")
        if self.objective not in cps_search.OBJECTIVES:
            raise DrafterError(f"diffuspec objective {self.objective!r}: choose {' or '.join(cps_search.OBJECTIVES)}")
        if self.cps_search not in CPS_SEARCHES:
            raise DrafterError(f"diffuspec cps_search {self.cps_search!r}: choose {', '.join(CPS_SEARCHES[:-1])} or "
                               f"{CPS_SEARCHES[-1]}")
        if self.sampling_q not in ("l2r", "point"):
            raise DrafterError(f"diffuspec sampling_q {self.sampling_q!r}: choose l2r or point")
        if self.cps and not tcfg.eos_token_ids:
            raise DrafterError("CPS needs an EOS token id in the target config")
        if self.beam < 1 or self.m_max < 1 or not 0.0 < self.tau <= 1.0 or not 0.0 <= self.lam <= 1.0:
            raise DrafterError(f"CPS settings out of range: beam {self.beam} >= 1, m_max {self.m_max} >= 1, "
                               f"tau {self.tau} in (0, 1], lam {self.lam} in [0, 1]")

    def cache_slots(self, cache_len: int) -> int:
        return -(-(cache_len + self.k_max + 1 + self.dcfg.block_size) // 128) * 128

    def init(self, dparams, tparams, tcfg, prompt, lens, first_token, prefill_out, cache_len):
        B = prompt.shape[0]
        own = dparams["dlm"]
        cache = M.init_cache(self.dcfg.model, B, self.cache_slots(cache_len), own["final_norm"].dtype)
        cache = D.prefill(own, tparams, self.dcfg, prompt, lens, cache, kernels=self.kernels)
        return DiffuSpecState(cache=cache, pending=jnp.zeros((B, self.k_max + 1), jnp.int32),
                              n_pending=jnp.zeros((B,), jnp.int32),
                              prev=take_row(prompt[:, :, None], lens - 1)[:, 0])

    def denoise(self, dparams, tparams, dstate: DiffuSpecState, last):
        """The DLM's distributions for the next tokens: (logits [B, T', V], fixed [B, T'] bool,
        fixed tokens [B, T'], state with the pending block committed); T' = k_max with one step
        (the block is still the DLM's T tokens, as trained), T with refinement steps."""
        own, T = dparams["dlm"], self.dcfg.block_size
        B = last.shape[0]
        block = jnp.full((B, T), self.dcfg.mask_token_id, jnp.int32).at[:, 0].set(last)
        # without refinement only the first k_max slots are drafted: the LM head runs on those alone
        logits, cache = D.block_logits(own, tparams, self.dcfg, dstate.cache, dstate.pending, dstate.n_pending,
                                       block, kernels=self.kernels, n_logits=self.k_max if self.steps == 1 else None)
        fixed = jnp.zeros(logits.shape[:2], bool)
        fixed_tok = jnp.zeros(logits.shape[:2], jnp.int32)
        if self.steps > 1:
            per_step = -(-T // self.steps)
            empty = jnp.zeros((B, 0), jnp.int32)

            def refine(_, c):
                logits, fixed, fixed_tok, block = c
                lp = jax.nn.log_softmax(logits, axis=-1)
                conf = jnp.where(fixed, -jnp.inf, jnp.max(lp, axis=-1))
                _, pick = top_k(conf, per_step)  # [B, per_step] targets to fix now
                new = jnp.zeros((B, T), bool).at[jnp.arange(B)[:, None], pick].set(True) & ~fixed
                tok = jnp.argmax(logits, axis=-1).astype(jnp.int32)
                fixed_tok = jnp.where(new, tok, fixed_tok)
                fixed = fixed | new
                # target j sits in input slot j + 1 (the last target has no slot)
                shifted = jnp.concatenate([block[:, :1], jnp.where(fixed[:, :-1], fixed_tok[:, :-1], block[:, 1:])], 1)
                new_logits, _ = D.block_logits(own, tparams, self.dcfg, cache, empty, jnp.zeros((B,), jnp.int32),
                                               shifted, kernels=self.kernels)
                return new_logits, fixed, fixed_tok, shifted

            logits, fixed, fixed_tok, _ = jax.lax.fori_loop(0, self.steps - 1, refine, (logits, fixed, fixed_tok, block))
        return logits, fixed, fixed_tok, dstate.replace(cache=cache, n_pending=jnp.zeros_like(dstate.n_pending))

    def choose(self, dparams, tcfg, logits, fixed, fixed_tok, prev, last, limit):
        """The draft read off the DLM's logits [B, K, V]: CPS's best path (or the per-position
        argmax without CPS) and its length (path [B, K], length [B])."""
        K = logits.shape[1]
        x = logits.astype(jnp.float32)
        if self.steps > 1:  # a fixed (refined) position has a single candidate: its token
            onehot = jax.nn.one_hot(fixed_tok, x.shape[-1], dtype=bool)
            x = jnp.where(fixed[..., None], jnp.where(onehot, 0.0, -jnp.inf), x)
        if not self.cps:
            return jnp.argmax(x, axis=-1).astype(jnp.int32), jnp.full(x.shape[:1], K, jnp.int32)
        eos = tcfg.eos_token_ids[0]
        cand, lq, ok, eos_stop = cps_lattice(x, eos, self.tau, self.m_max)
        proxy = dparams["proxy"]
        fn = lambda a, b, c: proxy_logprob(proxy, a, b, c)  # noqa: E731
        expand = jnp.minimum(limit, eos_stop + 1) if self.eos_stop else limit
        path, path_len, _ = cps_beam_search(cand, lq, ok, expand, prev, last, fn, beam=self.beam, lam=self.lam,
                                            eos_id=eos, objective=self.objective, impl=self.search_impl())
        return path, path_len

    def search_impl(self) -> str:
        """CPS's search as traced now: "auto" follows the model's kernels (the GPU kernel where
        they are the Pallas ones: one GPU, or a program that runs whole on each device)."""
        if self.cps_search != "auto":
            return self.cps_search
        return "pallas" if (self.kernels or M.default_kernels()) == "pallas" else "xla"

    def draft_block(self, dparams, tparams, tcfg, dstate: DiffuSpecState, last, limit, sampling: Sampling, key, keep_probs):
        """(tokens [B, K], valid [B, K], q [B, K, V] or None, state) for this round."""
        del key
        K = self.k_max
        prev = dstate.prev
        logits, fixed, fixed_tok, dstate = self.denoise(dparams, tparams, dstate, last)
        logits, fixed, fixed_tok = logits[:, :K], fixed[:, :K], fixed_tok[:, :K]
        path, path_len = self.choose(dparams, tcfg, logits, fixed, fixed_tok, prev, last, limit)
        # drafting stops before the first EOS, at the policy's limit, and where the path ends: a beam
        # that stops short (its lattice ended at an EOS it did not take) leaves padding ids behind it
        is_eos = jnp.isin(path, jnp.asarray(tcfg.eos_token_ids or (-1,), jnp.int32))
        n = jnp.minimum(jnp.minimum(_first_true(is_eos), limit), path_len)
        valid = jnp.arange(K)[None] < n[:, None]
        tokens = jnp.where(valid, path, 0)
        q = None
        if keep_probs and self.sampling_q == "l2r":
            q = probs(logits, sampling)
        return tokens, valid, q, dstate

    def commit(self, dparams, tparams, tcfg, dstate: DiffuSpecState, block_tokens, n_accepted, next_token, verify_out):
        return dstate.replace(pending=block_tokens.astype(jnp.int32), n_pending=n_accepted + 1,
                              prev=take_row(block_tokens[:, :, None], n_accepted)[:, 0])
