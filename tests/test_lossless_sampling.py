"""Lossless speculative sampling, checked token by token against the target's exact law.

The bugs this file exists to catch leave the first draft position alone: the bonus token drawn
from the wrong position, the residual built with the first draft position's q, a rejected tree
sibling left in p at depth >= 2. So every emitted position is checked, with drafters that are
accepted often enough to reach every draft position and the bonus token.

Method. One jitted `generate` call samples N continuations of 7 tokens of one prompt (a batch of N
identical prompts; rows draw independent randomness). For row i and position n, the exact
conditional law p_in = p(. | prompt, x_i<n) comes from teacher forcing: one causal target forward
over the generated sequences, processed by the same temperature / top-p as the run. If the
verifier is lossless, x_in ~ p_in given everything emitted before it, so over any stratum chosen
from information known before token n, the token counts O = sum onehot(x_in) have mean
E = sum p_in and covariance C = sum (diag p_in - p_in p_in^T): the terms are martingale
differences, uncorrelated across positions and strata. Each stratum's (O-E)^T C^+ (O-E) is
asymptotically chi-square with rank(C) degrees of freedom and the strata's statistics add (tokens
expected fewer than 5 times are pooled into one category per stratum; a token with p_in = 0 is an
outright failure).

Strata: (round offset j, previous token x_i,n-1), pooled over the positions tested (each position
1..6 is also tested alone). j is how many tokens of the same target call precede token n, read
from the per-call token counts. Both are known before token n is drawn, and given them token n
still follows p_in: the round's later drafts are drawn after the accepted ones, from their
context. Splitting by offset separates the rules that act at each draft position, and by previous
token the contexts (the tiny target's next-token law depends mostly on the last token), so a
wrong distribution cannot hide in an average over contexts. With a draft length or tree depth of
at most K, j = K means that K drafts were accepted: the token is a bonus token, so the stratum
j = K tests bonus tokens alone.

Drafters differ from the target and are accepted at every position: a noised copy of the target
as a draft model (chain, static K = 3, top-p sampling), and a perturbed EAGLE-1 head built from
the target's own layer (chain with the max-confidence draft length, K <= 3; EAGLE-2 tree of depth
3 with the top-k children rule), and that head's tree with an n-gram branch beside it (the hybrid,
top-p 0.9), whose n-gram child often repeats a head child of the root. Both chains run twice: with
block verification (the default) and token by token (verify="token"). Block verification keeps
the LAST draft whose coin passes, so whether a draft is kept depends on the drafts after it; the
strata stay valid because, given the tokens before it and its offset, each emitted token still
follows p (the rule's per-position guarantee, which these tests check).

Mutation check: the verifier is monkeypatched with mutants made from its own source, one line
changed each (`MUTANTS`). The patched verifier serves each group of N rows with a different
variant inside the same jitted call, and group 0 with the shipped verifier untouched, so one
compile per engine covers the shipped verifier and its mutants. Tests assert that the shipped
rows pass everywhere and that every mutant's rows are rejected, overall and in the stratum its
bug lives in. Seeds are fixed, so the outcome is deterministic; the thresholds leave wide margins
(shipped p-values are far above PASS, mutant p-values are far below REJECT).

Both chain verifiers are also checked alone on one block with exact per-position laws, for sampled
drafts and for point-mass drafts (q = 1, the n-gram path, which the generation runs above do not
take), with the same mutants and one the generation runs cannot see (`test_chain_verifier_block_law`).

The expected laws come from `sampling.probs`, the function the engines use, so a wrong top-k or
top-p would move the run and its expectation together: `test_sampling_law_matches_numpy` checks
`probs` itself against an independent NumPy implementation.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

from jspec import model as M
from jspec.config import ModelConfig
from jspec.generate import SpeculativeConfig, generate
from jspec.heads import eagle as H
from jspec.sampling import Sampling, probs
from jspec.speculative.drafters.eagle import EagleDrafter
from jspec.speculative.drafters.hybrid import HybridDrafter
from jspec.speculative.drafters.model import ModelDrafter, restrict_vocab
from jspec.speculative.drafters.ngram import NgramDrafter
from jspec.speculative.engines import chain as chain_engine
from jspec.speculative.engines import tree as tree_engine
from jspec.speculative.engines.tree import TreeConfig
from jspec.speculative.verify import block as block_verify
from jspec.speculative.verify import chain as chain_verify
from jspec.speculative.verify import sampled_tree as sampled_verify
from jspec.speculative.verify import tree as tree_verify

CFG = ModelConfig(
    arch="llama", vocab_size=24, hidden_size=32, intermediate_size=64, num_layers=1,
    num_heads=4, num_kv_heads=2, head_dim=8, max_position_embeddings=64,
)
PROMPT = [5, 9, 2, 7, 11, 3, 14, 6, 19, 10, 4, 12]
MAX_NEW = 7  # position 0 comes from the prefill, 1..6 from speculative rounds
K = 3  # chain draft length and tree depth
TREE = TreeConfig(top_k=3, depth=K, num_nodes=10)
N = 2000  # rows per verifier variant
CACHE_LEN = 40  # the hybrid tree reserves its n-gram branch too
PASS = 1e-4  # the shipped verifier's p-values must exceed this
REJECT = 1e-8  # every mutant's p-value must fall below this
MIN_EXPECTED = 5.0
# Relative weight noise of both drafters: q is far enough from p that rejections at later draft
# positions are common (so is a wrong residual's effect), and drafts are still accepted often.
NOISE = 0.3


# ---------------------------------------------------------------------------------------------
# Target and drafters
# ---------------------------------------------------------------------------------------------


def eagle_copy_head(tparams, cfg: ModelConfig = CFG):
    """An EAGLE-1 head that is the target's own (single) layer: fc passes the token embedding
    through and ignores the feature. With unit-RMS embeddings and an input norm of 1 (the head
    has none), the head computes the target's pre-norm residual stream over the same tokens (it
    misses only the first prompt token), so it drafts well without training."""
    assert cfg.num_layers == 1
    D = cfg.hidden_size
    layer = tparams["layers"]
    hp = {
        "fc": jnp.concatenate([jnp.eye(D), jnp.zeros((D, D))], 0),
        "fc_bias": jnp.zeros((D,)),
        "layer": {k: layer[k][0] for k in ("wqkv", "wo", "mlp_norm", "w_gate_up", "w_down")},
    }
    return H.default_head_config("eagle1", cfg), hp


def make_target():
    """A 1-layer target with unit-RMS embeddings (its input norm is then the identity, as in the
    head) and weak layers (so the next token depends mostly, not only, on the last one). Its
    final norm weight is the head's typical residual RMS r and its LM head is divided by r: p is
    unchanged, and the head's un-normed output meets the LM head at the right scale."""
    p = M.init_params(CFG, jax.random.PRNGKey(0), scale=0.15)
    p["embed"] = p["embed"] / jnp.sqrt(jnp.mean(p["embed"] ** 2, -1, keepdims=True))
    p["lm_head"] = 0.5 * jax.random.normal(jax.random.PRNGKey(1), p["lm_head"].shape)
    hc, hp = eagle_copy_head(p)
    seq = jnp.asarray([PROMPT])
    out = M.forward(p, CFG, seq, M.init_cache(CFG, 1, CACHE_LEN))
    h, _, _ = H.head_forward(hc, hp, p, seq[:, 1:], out.hidden[:, :-1], H.init_head_cache(hc, 1, CACHE_LEN))
    r = jnp.sqrt(jnp.mean(h**2))
    p["final_norm"] = p["final_norm"] * r
    p["lm_head"] = p["lm_head"] / r
    return p


def noised(tree, key, rel):
    """Every matrix plus Gaussian noise of `rel` times its own standard deviation."""
    leaves, treedef = jax.tree.flatten(tree)
    keys = jax.random.split(key, len(leaves))
    noisy = [x + rel * jnp.std(x) * jax.random.normal(k, x.shape) if x.ndim > 1 else x for x, k in zip(leaves, keys)]
    return jax.tree.unflatten(treedef, noisy)


@pytest.fixture(scope="module")
def target():
    return make_target()


# ---------------------------------------------------------------------------------------------
# Mutants of the verifiers, and a verifier that serves each group of rows with one variant
# ---------------------------------------------------------------------------------------------


def mutant(fn, old: str, new: str):
    """`fn` recompiled from its own source with the line fragment `old` replaced by `new`."""
    src = textwrap.dedent(inspect.getsource(fn))
    assert src.count(old) == 1, f"mutation site not found in {fn.__name__} (update MUTANTS): {old!r}"
    namespace = dict(fn.__globals__)
    exec(compile(src.replace(old, new), f"<mutant of {fn.__name__}>", "exec"), namespace)
    return namespace[fn.__name__]


# Each mutant: (the function it changes, the line fragment, its replacement); `PATCHED` says where
# the engines look each function up.
MUTANTS = {
    "chain": {  # token-by-token verification (verify="token")
        # (a) the bonus token (n = K) drawn from p at position K-1 instead of K
        "bonus_position": (
            "token_after",
            "p_n = jnp.take_along_axis(p, n[:, None, None], axis=1)[:, 0]",
            "p_n = jnp.take_along_axis(p, jnp.minimum(n, K - 1)[:, None, None], axis=1)[:, 0]",
        ),
        # (b) the residual max(0, p_n - q) always built with the first draft position's q
        "residual_first_q": (
            "token_after",
            "q_n = jnp.take_along_axis(draft_probs, jnp.minimum(n, K - 1)[:, None, None], axis=1)[:, 0]",
            "q_n = draft_probs[:, 0]",
        ),
    },
    "block": {  # block verification (verify="lossless", the default for sampled chains)
        # (a) the bonus token drawn from p at position K-1 instead of K
        "bonus_position": (
            "token_after",
            "p_n = jnp.take_along_axis(p, n[:, None, None], axis=1)[:, 0]",
            "p_n = jnp.take_along_axis(p, jnp.minimum(n, K - 1)[:, None, None], axis=1)[:, 0]",
        ),
        # (b) the weights a plain product of the ratios, capped at 1, not restarted at their running maximum
        "weights_uncapped": (
            "block_weights",
            "return jnp.exp(c - jnp.maximum(jax.lax.cummax(c, axis=c.ndim - 1), 0.0))",
            "return jnp.minimum(jnp.exp(c), 1.0)",
        ),
    },
    "tree": {  # deterministic (top-k) children
        # (a) a depth-K leaf's bonus token taken from its parent's sample (the leaf's own token)
        "bonus_position": (
            "verify_tree_sampling",
            "return best, n, take_row(target_tokens, best)",
            "return best, n, take_row(target_tokens, jnp.where(n == max_depth, take_row(tree.parent, best), best))",
        ),
        # (b) every node matched against the root's sample instead of its parent's own
        "root_sample": (
            "verify_tree_sampling",
            "target_tokens = sample(key, logits, sampling)",
            "target_tokens = jnp.broadcast_to(sample(key, logits[:, :1], sampling), tree.tokens.shape)",
        ),
    },
    "sampled": {  # sampled siblings, recursive rejection without replacement
        # (a) a leaf's bonus token taken from its parent's sample
        "bonus_position": (
            "verify_sampled_tree",
            "stop_logits = take_row(logits, best)",
            "stop_logits = take_row(logits, take_row(tree.parent, best))",
        ),
        # (b) the correction after rejected children drawn from p itself, not the residual
        "residual_without_q": (
            "rrsw_residual",
            "residual = jnp.maximum(p - t[:, None] * q, 0.0)",
            "residual = p",
        ),
        # (d) the residual's mass never updated after the first rejection
        "stale_mass": (
            "sibling_acceptance",
            "mass = jnp.where(ok, mass_next, mass)",
            "mass = mass",
        ),
    },
    "sampled-hybrid": {
        # (e) the head's children tested against p with the rejected n-gram child left in
        "ngram_kept": (
            "verify_sampled_tree",
            "p = p.at[:, 0].set(jnp.where(ok0[:, None], root, p[:, 0]))",
            "p = p",
        ),
    },
}
# Point-mass drafts (q = 1: n-grams), checked on the verifier alone (test_chain_verifier_block_law).
POINT_MASS_MUTANTS = {
    "bonus_position": MUTANTS["chain"]["bonus_position"],
    # (b) the residual (p_n without the rejected token) built with the first draft token
    "residual_first_token": (
        "token_after",
        "q_n = jax.nn.one_hot(tok_n, p.shape[-1], dtype=p.dtype)",
        "q_n = jax.nn.one_hot(draft_tokens[:, 0], p.shape[-1], dtype=p.dtype)",
    ),
}
# (c) the block rule's residual built as the token rule's, without the weight w_n: a subtle bug, which
# 2,000 generated rows cannot see (p = 0.14), checked on the verifier alone (40,000 blocks, p = 1e-29).
BLOCK_RESIDUAL_MUTANT = {
    "residual_unweighted": (
        "verify_block",
        "return n, token_after(k_resample, p, draft_tokens, draft_probs, n, rejected, w_n)",
        "return n, token_after(k_resample, p, draft_tokens, draft_probs, n, rejected)",
    ),
}
# With q = 1 the block rule's point-mass mutants are the token rule's (both rules emit through
# token_after): every ratio is p <= 1, so the weights are plain products and the residual's weight cancels.
# The stratum offsets where each bug acts (the mutant must be rejected there too).
BUG_OFFSETS = {"bonus_position": (K,), "residual_first_q": (1, 2), "residual_first_token": (1, 2), "root_sample": (1, 2),
               "residual_unweighted": (1, 2), "weights_uncapped": (1, 2, K),
               "residual_without_q": (0, 1, 2), "stale_mass": (0, 1, 2), "ngram_kept": (0, 1)}


def by_row_group(variants, rows_per_group: int):
    """A verifier that runs every variant and returns variant g's result for rows
    [g * rows_per_group, (g + 1) * rows_per_group)."""

    def verify(*args, **kwargs):
        outs = [v(*args, **kwargs) for v in variants]
        group = jnp.arange(jax.tree.leaves(outs[0])[0].shape[0]) // rows_per_group

        def pick(*xs):
            y = xs[0]
            for g, x in enumerate(xs[1:], start=1):
                y = jnp.where((group == g).reshape((-1,) + (1,) * (x.ndim - 1)), x, y)
            return y

        return jax.tree.map(pick, *outs)

    return verify


# ---------------------------------------------------------------------------------------------
# The statistic
# ---------------------------------------------------------------------------------------------


@functools.partial(jax.jit, static_argnames="sampling")
def teacher_forced_probs(tparams, seqs, sampling):
    """[N, MAX_NEW, V]: p(. | prompt, x_<n) for every generated position n (seqs = prompt + x)."""
    B, T = seqs.shape
    out = M.forward(tparams, CFG, seqs, M.init_cache(CFG, B, T))
    return probs(M.lm_head(tparams, CFG, out.hidden[:, len(PROMPT) - 1 : -1]), sampling)


def round_offsets(step_tokens: np.ndarray, length: int) -> np.ndarray:
    """[rows, length]: how many tokens of the same target call precede each emitted position."""
    first = np.cumsum(step_tokens, 1) - step_tokens  # position of each call's first token
    rows, calls = np.nonzero((step_tokens > 0) & (first < length))
    starts = np.zeros((step_tokens.shape[0], length), bool)
    starts[rows, first[rows, calls]] = True
    pos = np.arange(length)
    return pos - np.maximum.accumulate(np.where(starts, pos, 0), axis=1)


def chi2_pvalue(tokens, p, strata) -> tuple[float, int]:
    """(p-value, degrees of freedom) of the pooled test that tokens [S] ~ p [S, V], by strata [S]."""
    if (p[np.arange(len(tokens)), tokens] == 0).any():
        return 0.0, 0  # a token the target cannot emit
    stat, df = 0.0, 0
    for s in np.unique(strata):
        x, ps = tokens[strata == s], p[strata == s]
        expected = ps.sum(0)
        order = np.argsort(-expected)
        n_big = max(int((expected >= MIN_EXPECTED).sum()), 1)
        # categories: each well-populated token; the rest pooled into the smallest of them
        cat = np.empty(p.shape[1], int)
        cat[order[:n_big]] = np.arange(n_big)
        cat[order[n_big:]] = n_big - 1
        if n_big < 2:
            continue
        P = np.zeros((len(x), n_big))
        np.add.at(P.T, cat, ps.T)
        dev = (np.bincount(cat[x], minlength=n_big) - P.sum(0))[1:]  # drop the largest category
        cov = (np.diag(P.sum(0)) - P.T @ P)[1:, 1:]
        w, u = np.linalg.eigh(cov)
        keep = w > 1e-9 * w.max()
        stat += float((((u.T @ dev)[keep]) ** 2 / w[keep]).sum())
        df += int(keep.sum())
    return float(stats.chi2.sf(stat, df)) if df else 1.0, df


def group_pvalue(group, positions=None, offsets=None) -> tuple[float, int]:
    """The pooled test over the chosen positions and round offsets; strata (offset, previous token)."""
    tokens, p, j = group["tokens"], group["probs"], group["offsets"]
    n = np.broadcast_to(np.arange(MAX_NEW), tokens.shape)
    prev = np.concatenate([np.full((len(tokens), 1), PROMPT[-1]), tokens[:, :-1]], 1)
    sel = np.ones(tokens.shape, bool)
    if positions is not None:
        sel &= np.isin(n, positions)
    if offsets is not None:
        sel &= np.isin(j, offsets)
    return chi2_pvalue(tokens[sel], p[sel], (j * CFG.vocab_size + prev)[sel])


# ---------------------------------------------------------------------------------------------
# One jitted sampling run per engine: the shipped verifier and its mutants side by side
# ---------------------------------------------------------------------------------------------


def _model_drafter(tparams, **fields) -> SpeculativeConfig:
    return SpeculativeConfig(drafter=ModelDrafter(CFG), drafter_params=noised(tparams, jax.random.PRNGKey(2), NOISE),
                             k_max=K, **fields)


def _model_drafter_vocab(tparams, **fields) -> SpeculativeConfig:
    """The draft model with a draft vocabulary (FR-Spec): every id outside it has q = 0."""
    ids = np.setdiff1d(np.arange(CFG.vocab_size), np.arange(5, CFG.vocab_size, 6))  # 40 of 48 ids
    dparams = restrict_vocab(noised(tparams, jax.random.PRNGKey(2), NOISE), CFG, ids)
    return SpeculativeConfig(drafter=ModelDrafter(CFG, draft_vocab=len(ids)), drafter_params=dparams, k_max=K, **fields)


def _eagle_drafter(tparams, noise=NOISE, **fields) -> SpeculativeConfig:
    hc, hp = eagle_copy_head(tparams)
    return SpeculativeConfig(drafter=EagleDrafter(hc), drafter_params=noised(hp, jax.random.PRNGKey(3), noise), **fields)


def _hybrid_drafter(tparams, tree, noise=NOISE) -> SpeculativeConfig:
    hc, hp = eagle_copy_head(tparams)
    drafter = HybridDrafter(EagleDrafter(hc), NgramDrafter(max_ngram=2))
    return SpeculativeConfig(drafter=drafter, drafter_params=noised(hp, jax.random.PRNGKey(3), noise), tree=tree)


# Sampled children are accepted far more often than top-k ones: a head further from the target
# leaves rejections (and the residuals after them) common at every rank.
SAMPLED_NOISE = 0.6


TOP_K_TREE = dataclasses.replace(TREE, siblings="top_k")
RUNS = {  # (drafter, sampling, mutant groups, jitted engine): static K for the model drafter and the trees, a
    # dynamic draft length for the EAGLE chain; chains verified token by token and as blocks (the default);
    # trees with deterministic (top-k) and sampled children, each also with an n-gram branch beside the
    # head's (the hybrid, top-p 0.9)
    "chain-model": (functools.partial(_model_drafter, verify="token"), Sampling(temperature=0.9, top_p=0.95),
                    ("chain",), "chain"),
    "chain-eagle": (functools.partial(_eagle_drafter, k_max=K, policy="confidence", verify="token"),
                    Sampling(temperature=1.0), ("chain",), "chain"),
    "block-model": (_model_drafter, Sampling(temperature=0.9, top_p=0.95), ("block",), "chain"),
    "block-model-vocab": (_model_drafter_vocab, Sampling(temperature=0.9, top_p=0.95), (), "chain"),
    "block-eagle": (functools.partial(_eagle_drafter, k_max=K, policy="confidence"), Sampling(temperature=1.0),
                    (), "chain"),  # a draft length the head's confidence sets; its mutants are block-model's
    "tree-eagle": (functools.partial(_eagle_drafter, tree=TOP_K_TREE), Sampling(temperature=1.0), ("tree",), "tree"),
    "tree-hybrid": (functools.partial(_hybrid_drafter, tree=TOP_K_TREE), Sampling(temperature=1.0, top_p=0.9),
                    (), "tree"),  # its mutants are tree-eagle's
    "sampled-eagle": (functools.partial(_eagle_drafter, tree=TREE, noise=SAMPLED_NOISE), Sampling(temperature=1.0), ("sampled",), "tree"),
    "sampled-hybrid": (functools.partial(_hybrid_drafter, tree=TREE, noise=SAMPLED_NOISE), Sampling(temperature=1.0, top_p=0.9),
                       ("sampled-hybrid",), "tree"),  # and sampled-eagle's
}
PATCHED = {  # the modules the engines look each mutated function up in, and the shipped function
    "verify_sampling": ((chain_engine,), chain_verify.verify_sampling),
    "verify_block": ((chain_engine,), block_verify.verify_block),
    "token_after": ((chain_verify, block_verify), chain_verify.token_after),  # both chain rules emit through it
    "block_weights": ((block_verify,), block_verify.block_weights),
    "verify_tree_sampling": ((tree_engine,), tree_verify.verify_tree_sampling),
    "verify_sampled_tree": ((tree_engine,), sampled_verify.verify_sampled_tree),
    "sibling_acceptance": ((sampled_verify,), sampled_verify.sibling_acceptance),
    "rrsw_residual": ((sampled_verify,), sampled_verify.rrsw_residual),
}
JITTED = {"chain": chain_engine.speculative_generate_jit, "tree": tree_engine.tree_generate_jit}


@pytest.fixture(scope="module", params=list(RUNS))
def run(request, target):
    """{variant name: {"tokens", "probs", "offsets"}} for one engine/drafter, from one jitted call."""
    speculative, sampling, groups, engine = RUNS[request.param]
    jitted = JITTED[engine]
    sites = {m: site for group in groups for m, site in MUTANTS[group].items()}
    names = ["shipped"] + list(sites)
    with pytest.MonkeyPatch.context() as mp:
        # every function a mutant changes serves row group g with mutant g's version (the shipped one elsewhere)
        for fn in {site[0] for site in sites.values()}:
            modules, shipped = PATCHED[fn]
            variants = [shipped] + [mutant(shipped, *sites[m][1:]) if sites[m][0] == fn else shipped for m in names[1:]]
            for module in modules:
                mp.setattr(module, fn, by_row_group(variants, N))
        jitted.clear_cache()  # trace the patched verifiers, and leave no patched program behind
        try:
            res = generate(target, CFG, [PROMPT] * (N * len(names)), max_new_tokens=MAX_NEW, sampling=sampling,
                           seed=4, cache_len=CACHE_LEN, speculative=speculative(target))
        finally:
            jitted.clear_cache()
    assert (res.lengths == MAX_NEW).all()  # the target has no EOS
    seqs = np.concatenate([np.tile(PROMPT, (len(res.tokens), 1)), res.tokens], 1)
    p = np.asarray(teacher_forced_probs(target, jnp.asarray(seqs, jnp.int32), sampling))
    offsets = round_offsets(res.step_tokens, MAX_NEW)
    rows = lambda g: slice(g * N, (g + 1) * N)  # noqa: E731
    return request.param, {
        m: {"tokens": res.tokens[rows(g)], "probs": p[rows(g)], "offsets": offsets[rows(g)]}
        for g, m in enumerate(names)
    }


def test_every_position_follows_the_target_law(run):
    name, groups = run
    shipped = groups["shipped"]
    # Real acceptance: every draft position, and the bonus token, is reached often.
    reached = np.bincount(shipped["offsets"].ravel(), minlength=K + 1) / N
    assert (reached[1:] > 0.2).all(), (name, reached)
    for n in range(MAX_NEW):
        pval, df = group_pvalue(shipped, positions=[n])
        assert pval > PASS, f"{name}: position {n} departs from the target's law (p = {pval:.2e}, df {df})"
    pval, df = group_pvalue(shipped)
    assert pval > PASS, f"{name}: all positions (p = {pval:.2e}, df {df})"


def test_bonus_tokens_alone_follow_the_target_law(run):
    name, groups = run
    shipped = groups["shipped"]
    assert (shipped["offsets"] == K).sum() > 0.2 * N
    pval, df = group_pvalue(shipped, offsets=[K])
    assert pval > PASS, f"{name}: bonus tokens depart from the target's law (p = {pval:.2e}, df {df})"


def test_every_mutant_is_rejected(run):
    name, groups = run
    for m, group in groups.items():
        if m == "shipped":
            continue
        pval, _ = group_pvalue(group)
        assert pval < REJECT, f"{name}: mutant {m} passes the all-positions test (p = {pval:.2e})"
        pval, _ = group_pvalue(group, offsets=BUG_OFFSETS[m])
        assert pval < REJECT, f"{name}: mutant {m} passes at offsets {BUG_OFFSETS[m]} (p = {pval:.2e})"


# ---------------------------------------------------------------------------------------------
# The chain verifier alone: one block, exact per-position laws, both kinds of q
# ---------------------------------------------------------------------------------------------


def chain_block_tokens(variants, point_mass: bool, rows: int = 40_000, q_share: float = 0.5):
    """(target laws P [K+1, V], per variant: emitted tokens [rows, K+1], -1 where none was emitted).

    One verified block per row with fixed target laws p_0..p_K (a target whose next-token law
    depends only on the position) and drafts either fixed (q = 1) or drawn from fixed q_0..q_K-1
    (each q_i a mix of p_i and a random law, `q_share` the random law's weight).
    Token i is d_i+1 if i < n, the verifier's next token if i = n, nothing if i > n; given that
    tokens 0..i-1 were emitted (n >= i), token i must follow p_i (i = K: bonus tokens alone).
    All variants run in one jitted call, `rows` rows each (`by_row_group`)."""
    V, B = 6, rows * len(variants)
    rs = np.random.RandomState(0)
    likely = np.arange(K)  # distinct tokens, each likely at its position: the q = 1 drafts
    P = rs.dirichlet(np.ones(V), K + 1)
    P[:K] = 0.6 * np.eye(V)[likely] + 0.4 * P[:K]
    Q = (1 - q_share) * P[:K] + q_share * rs.dirichlet(np.ones(V), K)
    k_draft, k_verify = jax.random.split(jax.random.PRNGKey(1))
    if point_mass:
        drafts = jnp.broadcast_to(jnp.asarray(likely, jnp.int32), (B, K))
        q = None
    else:
        drafts = jax.random.categorical(k_draft, jnp.log(jnp.asarray(Q, jnp.float32)), shape=(B, K))
        q = jnp.broadcast_to(jnp.asarray(Q, jnp.float32), (B, K, V))
    logits = jnp.broadcast_to(jnp.log(jnp.asarray(P, jnp.float32)), (B, K + 1, V))
    verify = jax.jit(by_row_group(variants, rows), static_argnums=4)
    n, nxt = verify(k_verify, logits, drafts, jnp.ones((B, K), bool), Sampling(temperature=1.0), q)
    n, nxt, drafts = (np.asarray(x) for x in (n, nxt, drafts))
    i = np.arange(K + 1)[None]
    tokens = np.where(i < n[:, None], np.pad(drafts, ((0, 0), (0, 1))), np.where(i == n[:, None], nxt[:, None], -1))
    return P, [tokens[g * rows : (g + 1) * rows] for g in range(len(variants))]


def block_pvalue(P, tokens, positions) -> float:
    stat, df = 0.0, 0
    for i in positions:
        x = tokens[:, i][tokens[:, i] >= 0]
        observed = np.bincount(x, minlength=P.shape[1])
        stat += float(stats.chisquare(observed, P[i] * len(x)).statistic)
        df += P.shape[1] - 1
    return float(stats.chi2.sf(stat, df))


# (verifier, mutants with sampled q, mutants with q = 1, q's share not taken from p). The block rule's
# weight w only matters where q is far from p: an unweighted residual passes 0.5 (p = 0.2) and fails
# an independent q (p = 1e-29).
CHAIN_RULES = {"token": (chain_verify.verify_sampling, MUTANTS["chain"], POINT_MASS_MUTANTS, 0.5),
               "block": (block_verify.verify_block, MUTANTS["block"] | BLOCK_RESIDUAL_MUTANT, POINT_MASS_MUTANTS, 1.0)}


def with_mutant(shipped, site):
    """`shipped` with the mutation `site` (function name, old, new) planted in it or in a function it calls."""
    fn, old, new = site
    if fn == shipped.__name__:
        return mutant(shipped, old, new)
    _, callee = PATCHED[fn]
    namespace = dict(shipped.__globals__, **{fn: mutant(callee, old, new)})
    return type(shipped)(shipped.__code__, namespace, shipped.__name__, shipped.__defaults__, shipped.__closure__)


@pytest.mark.parametrize("rule", list(CHAIN_RULES))
@pytest.mark.parametrize("point_mass", [False, True], ids=["sampled-q", "q=1"])
def test_chain_verifier_block_law(rule, point_mass):
    shipped, sampled_mutants, point_mass_mutants, q_share = CHAIN_RULES[rule]
    mutants = point_mass_mutants if point_mass else sampled_mutants
    P, groups = chain_block_tokens([shipped] + [with_mutant(shipped, mutants[m]) for m in mutants], point_mass,
                                   q_share=q_share)
    tokens = groups[0]
    assert ((tokens >= 0).sum(0) > 5000).all()  # every position, the bonus included, is reached
    for i in range(K + 1):
        pval = block_pvalue(P, tokens, [i])
        assert pval > PASS, f"position {i} departs from p_{i} (p = {pval:.2e})"
    for m, tokens in zip(mutants, groups[1:]):
        pval = block_pvalue(P, tokens, BUG_OFFSETS[m])
        assert pval < REJECT, f"mutant {m} passes at positions {BUG_OFFSETS[m]} (p = {pval:.2e})"


# ---------------------------------------------------------------------------------------------
# The sampling law itself, against an independent implementation
# ---------------------------------------------------------------------------------------------


def numpy_sampling_law(logits: np.ndarray, temperature: float, top_k: int, top_p: float) -> np.ndarray:
    """Temperature; then the top_k largest logits (ties with the k-th kept); then the smallest set of
    most likely tokens whose mass reaches top_p (the token that crosses it kept); renormalised."""
    x = logits.astype(np.float64) / temperature
    if top_k:
        kth = np.sort(x, axis=-1)[..., -top_k][..., None]
        x = np.where(x >= kth, x, -np.inf)
    p = np.exp(x - x.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    if top_p < 1.0:
        order = np.argsort(-p, axis=-1, kind="stable")
        sorted_p = np.take_along_axis(p, order, -1)
        keep = np.zeros(p.shape, bool)
        np.put_along_axis(keep, order, np.cumsum(sorted_p, -1) - sorted_p < top_p, -1)
        p = np.where(keep, p, 0.0)
        p /= p.sum(-1, keepdims=True)
    return p


@pytest.mark.parametrize("top_k,top_p", [(0, 1.0), (1, 1.0), (3, 1.0), (CFG.vocab_size, 1.0), (0, 0.5), (0, 0.9),
                                         (0, 0.95), (5, 0.8), (2, 0.3)])
def test_sampling_law_matches_numpy(top_k, top_p):
    logits = 2.0 * np.random.default_rng(top_k * 100 + int(top_p * 100)).standard_normal((256, CFG.vocab_size))
    for temperature in (0.7, 1.0, 1.5):
        want = numpy_sampling_law(logits, temperature, top_k, top_p)
        got = np.asarray(probs(jnp.asarray(logits, jnp.float32), Sampling(temperature, top_k, top_p)))
        np.testing.assert_array_equal(got > 0, want > 0)  # the same kept set, token for token
        np.testing.assert_allclose(got, want, atol=2e-6)
    if top_p < 1.0:  # the nucleus is a real cut here: some rows keep fewer tokens than top-k alone
        assert ((want > 0).sum(-1) < (top_k or CFG.vocab_size)).any()


# ---------------------------------------------------------------------------------------------
# A compact tail (generate(tail_rows=...)): rows re-prefilled mid-answer keep the target's law
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["block-eagle", "sampled-eagle"])
def test_rows_finished_in_a_tail_follow_the_target_law(target, name, monkeypatch):
    """Half the rows of one batch move to a tail when half are done: each moved row is re-prefilled
    with its prompt and tokens so far, and its tokens from then on (the tail's prefill token first)
    must follow p(. | prompt, x_<n). Which rows move depends on their earlier tokens, so only the
    tokens drawn after the move are tested on the moved rows alone; every row's every token is
    tested too."""
    import jspec.generate as G

    moved = []
    unfinished = G._unfinished_rows
    monkeypatch.setattr(G, "_unfinished_rows", lambda c, res, m: moved.append((unfinished(c, res, m), res.lengths.copy()))
                        or moved[-1][0])
    speculative, sampling, _, _ = RUNS[name]
    res = generate(target, CFG, [PROMPT] * N, max_new_tokens=MAX_NEW, sampling=sampling, seed=6, cache_len=CACHE_LEN,
                   speculative=speculative(target), tail_rows=N // 2)
    assert (res.lengths == MAX_NEW).all() and len(moved) == 1
    rows, at_move = np.asarray(moved[0][0]), moved[0][1]
    assert len(rows) > N // 4, len(rows)  # a real tail: many rows re-prefilled mid-answer
    seqs = np.concatenate([np.tile(PROMPT, (N, 1)), res.tokens], 1)
    p = np.asarray(teacher_forced_probs(target, jnp.asarray(seqs, jnp.int32), sampling))
    group = {"tokens": res.tokens, "probs": p, "offsets": round_offsets(res.step_tokens, MAX_NEW)}
    for n in range(MAX_NEW):
        pval, df = group_pvalue(group, positions=[n])
        assert pval > PASS, f"{name}: position {n} departs from the target's law (p = {pval:.2e}, df {df})"
    after = np.arange(MAX_NEW)[None] >= at_move[rows, None]  # [moved rows, positions]: drawn in the tail
    assert after.sum() > N // 4
    prev = np.concatenate([np.full((len(rows), 1), PROMPT[-1]), res.tokens[rows, :-1]], 1)
    strata = group["offsets"][rows] * CFG.vocab_size + prev
    pval, df = chi2_pvalue(res.tokens[rows][after], p[rows][after], strata[after])
    assert pval > PASS, f"{name}: tokens drawn in the tail depart from the target's law (p = {pval:.2e}, df {df})"
