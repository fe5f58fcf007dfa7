"""`auto`: batch-aware draft budgets from a measured cost model, so speculation is never planned
slower than plain decoding.

A round that drafts k tokens costs   c(k) = first + (k - 1) * step + verify(T, B) + overhead
(`first`: the draft loop at k = 1, its first token included, as the cost table measures it; a tree
of D levels likewise costs first + (D - 1) levels, its first level coming from the head's stored
logits; an EAGLE head's rounds are charged HEAD_EXTRA_FORWARDS more, below)
and, with per-token acceptance a, yields   tau(k) = 1 + a + ... + a^k = (1 - a^(k+1)) / (1 - a)
tokens. Plain decoding yields 1 token per verify(1, B). The expected gain of a budget is
    gain(k) = tau(k) * verify(1, B) / c(k).

Two decisions use it:

* Host side, once per generate call (`plan`): the static budget. Chains: K = argmax_k gain(k)
  with verify at T = K + 1 (the engine verifies a padded [B, K+1] block). Trees (EAGLE-2's
  total_tokens tuning, on the measured cost of this card and batch): over EAGLE's candidate sizes
  N in (15, 23, 31, 47, 59) and depths D <= the configured depth, the gain of D tree levels and a
  verify of N + 1 tokens, where a wider tree accepts more per level (`tree_acceptance`; EAGLE
  credits larger trees with fixed weights instead). Hybrid trees (drafters.hybrid) also pick the
  n-gram branch's length M in 0, 2, .., MAX_NGRAM_BRANCH, whatever D (a branch longer than the
  head's tree pays on text that copies its prompt): a verify of N + M + 1 tokens plus the
  branch's own round cost (`HYBRID_BRANCH_US`) and the tokens of the longer accepted path
  (`hybrid_tokens`); and beside the trees, either half alone as a chain (`AutoPlan.drafter`
  "ngram" or "head"), so a hybrid is never planned below lookup or, by more than the tolerance,
  below the head's chain. At batch 1 a hybrid whose head's trees beat lookup's weak rounds looks
  up first (`AutoPlan.lookup_first`, engines.tree: rounds after a full n-gram match verify the
  branch alone, the others the tree). If no budget's gain reaches
  `min_gain` (1.05 by default: a margin for the model's error), `plan` returns "ar": the call runs
  plain decoding.
  Stragglers: a batch runs until its slowest row is done, and rows differ in acceptance, so at
  batch B the plan uses the acceptance of a slow row, a - s * z(B), where z(B) is the expected
  maximum of B standard normals (0 at B = 1, about 2 at B = 32) and s the drafter's spread of
  per-row acceptance (`ROW_SPREAD`). [I] Both spreads are fits to jspec's H200 MT-Bench rows at
  batch 8-32. EAGLE heads, 0.04: the smallest spread under which no plan that ran below AR is
  chosen (without it the plan drafted EAGLE-2 trees at batch 32, 0.96x AR), and every plan that
  ran above AR is kept. n-gram lookup, 0.2: its acceptance depends on how much a prompt repeats
  itself (at batch 1, 76% of its rounds add one token and 6.5% add eight), so in 16 rows one
  nearly never drafts right. Measured: 1.06x and 0.97x at K = 2 (batch 16, 32; seventh run), and
  0.99x at K = 1 at batch 16 under a freshly measured table (eighth run), which takes a - 0.21
  z(16); at batch 8, K = 2 ran at 1.23x. The seventh run's EAGLE rows imply 0.03-0.08.
  `plan(..., row_spread=)` overrides it.
  Near-ties go to the smaller budget: among budgets within `PLAN_TOLERANCE` (3%) of the best
  gain, the plan takes the one with the fewest draft tokens (then the shallowest). The optimum is
  flat (on the H200 at batch 1, 15- and 59-node trees give the same tokens per ms within 2%), and
  two measurements of the same card's table differ by up to 8% in single entries, so an argmax
  alone flipped between 5/31 and 6/59 trees, and K = 2 and 3 chains, from one table to the next.
  [I] One exception: a chain at batch 1 takes the largest near-tie K. There K is only a cap,
  under which the row's own estimate picks each round's length (`round_limit` below), and no
  other row pays for its padded block. The smaller cap planned K = 3 on both cards' tables, and
  `auto` chains ran 2-6% behind static K = 6 (H200, MT-Bench 80).
* Device side, per round and per row, chains only (`round_limit`): with the verify cost of the static block,
  the draft length k in [1, K] that maximises tau(k) / c(k) under the row's own
  acceptance estimate: the geometric fit successes / trials over discounted per-row sums (a round
  that accepts n of its drafts adds n successes and n + 1 trials, or n trials when every draft was
  accepted). A mean of each round's own ratio n / (n + 1) would be biased low: at a true
  acceptance of 0.65 and K = 6 it averages 0.44. Rows whose drafts are rejected draft less: at
  worst one token per round.

The cost table (verify_us[B][T], draft_step_us[B], tree_level_us[B]) is measured once per card by
`jspec.bench.round_cost.card_costs` (models/<preset>/round_cost_<card>.json, committed; batch sizes a
run needs and the committed table lacks are measured into the user cache); the engine-agnostic part of this module takes it as a plain dict. Without a
table for this card, `REFERENCE_COSTS` (SmolLM2-135M, bf16, an H200) is used.
The acceptance prior is the drafter's own when it carries one (an EAGLE head's measured
acceptance, `EagleDrafter.acceptance`), else the table's measured one, else `ACCEPTANCE_PRIOR`.

n-gram lookup's acceptance depends on the text far more than a head's (tokens per call of K = 6
chains on the H200: 1.95 on MT-Bench, 3.05 on longdoc, where the answer copies the prompt), so for
it (and a hybrid's n-gram branch) `plan_for` estimates the acceptance from the call's own prompts
(`ngram_acceptance`, [I], `NgramEstimate`): the drafter's rule replayed over each prompt
(drafters.ngram.replay_lookup) measures how well the prompts predict themselves, and the prior's
miss rate is scaled by how much more or less than the MT-Bench prompts (on which the prior was fit)
they do. `plan_for(..., ngram_estimate=None)`, or no prompts, plans on the prior alone.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from statistics import NormalDist
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from ...cards import card_key
from ...user_cache import user_cache_dir

from ..drafters.hybrid import MAX_NGRAM_BRANCH
from ..drafters.ngram import replay_lookup
from ..verify.sampled_tree import sampled_shape, sibling_weights
from .base import Policy, clip_limit, count_rounds

TREE_SIZES = (15, 23, 31, 47, 59)  # EAGLE's total_tokens candidates, minus the root
# Bumped whenever a change to jspec moves round costs enough to change plans; a table of another
# version is measured anew (bench.round_cost) and never planned on. 2: per-layer weight buffers in
# the generation loops (AR 25% faster at batch 16), chain drafts under limit-only policies as loops
# of known length, tree children by the ranked top-k.
COST_TABLE_VERSION = 2
PLAN_TOLERANCE = 0.03  # budgets this close to the best gain count as ties; the smallest wins (module doc)
# [I] fit to the shipped EAGLE-3 head v4 on an H200 (bf16, MT-Bench 80, batch 1, one process): the 59-node
# depth-6 tree accepted 4.03 tokens per call where the K = 6 chain took 2.66 (a = 0.625 -> a_tree = 0.805).
# The earlier 0.176 came from a weaker head (2.6 against 1.8) and planned 15-node trees that accepted
# 2.6 tokens a call where the 59-node tree, at 1.12x the verify cost, accepted 4.0.
TREE_WIDTH_EXPONENT = 0.29


def tokens_with_branch(tree_reach, ngram_alpha: float, ngram: int) -> float:
    """Expected tokens of a round whose head tree reaches depth j with probability tree_reach[j-1]
    beside an n-gram branch of `ngram` nodes at per-token acceptance ngram_alpha: 1 + sum_j
    P(either reaches depth j), the two taken as independent (see `hybrid_tokens`)."""
    tree_reach = np.asarray(tree_reach, np.float64)
    j = np.arange(1, max(len(tree_reach), ngram) + 1)
    tree = np.where(j <= len(tree_reach), np.pad(tree_reach, (0, len(j) - len(tree_reach))), 0.0)
    ngram_reach = np.where(j <= ngram, float(ngram_alpha) ** j, 0.0)
    return float(1.0 + np.sum(1.0 - (1.0 - tree) * (1.0 - ngram_reach)))


def sampled_tree_reach(nodes: int, depth: int, top_k: int, alpha: float, temperature: float,
                       weights=None) -> np.ndarray:
    """P(a sampled-sibling tree's accepted path reaches depth j), j = 1..depth: its static shape
    (verify.sampled_tree) with the shape's weights rescaled so a first child passes with `alpha`."""
    w = sibling_weights(temperature, weights)
    shape = sampled_shape(nodes, depth, top_k, w)
    scaled = [min(1.0, x * alpha / w[0]) for x in w]
    reach = [1.0] * len(shape.parent)
    by_depth = np.zeros(depth)
    for n in range(1, len(shape.parent)):
        reach[n] = reach[shape.parent[n]] * scaled[min(shape.rank[n], len(scaled) - 1)]
        by_depth[shape.depth[n] - 1] += reach[n]
    return np.minimum(by_depth, 1.0)


def hybrid_tokens(tree_alpha: float, depth: int, ngram_alpha: float, ngram: int) -> float:
    """Expected tokens of a round over a head tree of `depth` levels with per-level acceptance
    tree_alpha and an n-gram branch of `ngram` nodes, which may be the longer (drafters.hybrid):
    the longer of the two accepted paths plus the bonus, 1 + sum_j P(either reaches depth j) for
    j up to max(depth, ngram), with the two branches taken as independent ([I] a model: both do
    better on easy text, so it is optimistic where they overlap)."""
    j = np.arange(1, max(depth, ngram) + 1)
    tree_reach = np.where(j <= depth, float(tree_alpha) ** j, 0.0)
    ngram_reach = np.where(j <= ngram, float(ngram_alpha) ** j, 0.0)
    return float(1.0 + np.sum(1.0 - (1.0 - tree_reach) * (1.0 - ngram_reach)))


def tree_acceptance(alpha, nodes: int, depth: int):
    """Per-level acceptance of a tree of `nodes` nodes over `depth` levels, from the chain's alpha:
    the miss rate shrinks with the tree's width, 1 - a_tree = (1 - a) * (depth / nodes) ** TREE_WIDTH_EXPONENT
    ([I] a one-parameter fit; a chain, nodes == depth, keeps a)."""
    return 1.0 - (1.0 - alpha) * (depth / max(nodes, depth)) ** TREE_WIDTH_EXPONENT

# Per-token acceptance priors (a), until a row's own estimate takes over: geometric fits of jspec's
# H200 MT-Bench rows (shipped EAGLE-3 head: 1.82 tokens per round at K=6 -> a ~ 0.45; n-gram
# lookup: ~1.7 tokens per round from ~3.4 drafts -> a ~ 0.4). A table's "acceptance" overrides them.
ACCEPTANCE_PRIOR = {"eagle": 0.45, "ngram": 0.4}
DEFAULT_PRIOR = 0.4
# [I] spread of per-row acceptance by drafter (module doc: stragglers); other drafters get the default
ROW_SPREAD = {"eagle": 0.04, "ngram": 0.2}
DEFAULT_ROW_SPREAD = 0.04


# [I] Sampling: a drafter's per-token acceptance at temperature T over its greedy one, for drafters
# whose files record none at T. EAGLE heads: SmolLM2-135M's head v8, level-1 acceptance on its own
# answers to training-side chit-chat (sampled drafts, 1 - TV: 0.66 at T = 0.7, 0.55 at T = 1) against
# its greedy chain's 0.71 (MT-Bench) scaled to the same level-1 measure; n-gram lookup (deterministic
# drafts, accepted with the target's p of the drafted token): a guess from the head's top-1 child,
# which falls from 0.53 (T = 0.7) to 0.30 (T = 1) on the same positions.
TEMPERATURE_RATIO = {"eagle": ((0.0, 1.0), (0.7, 0.88), (1.0, 0.74)), "ngram": ((0.0, 1.0), (0.7, 0.8), (1.0, 0.6))}
# µs sampling adds to a round beyond what the greedy cost table prices (processing the target's
# logits and drawing from them; sampled trees: the recursive rejection's passes over the tree's
# expansions), by batch size: SmolLM2-135M on an H200, T = 1 (scripts/measure_card_costs.py
# --sampled 1.0), used where a card's table has no "sampled_us" of its own. The sampled tree's
# passes grow with the batch (a tree's expansions times the vocabulary, per row).
SAMPLED_US = {"ar": {"1": 4.8, "16": 11.1, "64": 29.0}, "chain": {"1": 49.5, "16": 127.1, "64": 324.8},
              "tree": {"1": 118.9, "16": 907.8, "64": 3235.6}}


def acceptance_at(alpha0: float, temperature: float, drafter_name: str, measured=None) -> float:
    """A drafter's per-token acceptance when sampling at `temperature`, from its greedy one:
    `measured` ((T, alpha), ...) when the drafter's files record it, else TEMPERATURE_RATIO."""
    if temperature <= 0.0:
        return float(alpha0)
    if measured:
        pts = dict(measured)
        pts.setdefault(0.0, float(alpha0))
        return _interp({str(t): a for t, a in pts.items()}, temperature)
    ratio = dict(TEMPERATURE_RATIO.get(drafter_name, TEMPERATURE_RATIO["eagle"]))
    return float(alpha0) * _interp({str(t): r for t, r in ratio.items()}, min(temperature, max(ratio)))


def acceptance_prior(costs: dict, drafter_name: str) -> float:
    """The per-token acceptance a drafter is planned with before anything else is known: the cost
    table's measured one, else `ACCEPTANCE_PRIOR` (else DEFAULT_PRIOR)."""
    return float(costs.get("acceptance", {}).get(drafter_name, ACCEPTANCE_PRIOR.get(drafter_name, DEFAULT_PRIOR)))


@dataclasses.dataclass(frozen=True)
class NgramEstimate:
    """[I] The call's n-gram acceptance from its prompts (`ngram_acceptance`).

    s: the prompts' self-lookup acceptance, the geometric fit (accepted drafts / trials) of the
    n-gram drafter's rounds replayed over them, drafting `draft` tokens a round
    (drafters.ngram.replay_lookup). A prompt predicts its own continuation far worse than the
    answer is predicted (the answer also repeats itself and quotes its prompt), so s is not the
    acceptance itself; it says how much the prompts repeat themselves against the prompts the
    prior was measured on: the estimate scales the prior's miss rate,
        1 - a_hat = (1 - prior) * ((1 - s) / (1 - reference)) ** gain,
    and is shrunk toward the prior by the rounds R replayed, a = prior + R / (R + prior_rounds) *
    (a_hat - prior), then clipped to [low, high].

    reference 0.062: s of the 80 MT-Bench prompts under SmolLM2-135M-Instruct's chat template
    (drafting 6), the prompts behind ACCEPTANCE_PRIOR["ngram"] (another tokenizer or chat template
    gives another value). gain 2: fit to the n-gram `auto` chains' tokens per call on the H200 (batch 1):
    HumanEval (s 0.206, 2.29 tokens per call) and longdoc (s 0.289, 3.05) imply 2.0 and 2.5
    against the prior of 0.4. prior_rounds 64: a one-prompt call of MT-Bench length (about 60
    rounds) moves halfway from the prior."""

    draft: int = 6
    reference: float = 0.062
    gain: float = 2.0
    prior_rounds: float = 64.0
    low: float = 0.05
    high: float = 0.9


NGRAM_ESTIMATE = NgramEstimate()


def ngram_acceptance(prompts, prior: float, estimate: NgramEstimate = NGRAM_ESTIMATE, *, max_ngram: int = 3,
                     min_ngram: int = 1) -> float:
    """The n-gram drafter's per-token acceptance for a call on these prompts (token-id sequences),
    from how well they predict themselves under its lookup rule (`NgramEstimate`)."""
    accepted, trials, rounds = replay_lookup(prompts, estimate.draft, max_ngram, min_ngram).sum(0)
    if rounds == 0:
        return float(np.clip(prior, estimate.low, estimate.high))
    s = accepted / max(trials, 1.0)
    miss = (1.0 - prior) * ((1.0 - s) / (1.0 - estimate.reference)) ** estimate.gain
    weight = rounds / (rounds + estimate.prior_rounds)
    return float(np.clip(prior + weight * ((1.0 - miss) - prior), estimate.low, estimate.high))


def expected_max_normal(n: int) -> float:
    """E[max of n standard normals] (Blom's approximation; exact 0 for n = 1)."""
    if n <= 1:
        return 0.0
    return float(NormalDist().inv_cdf((n - 0.375) / (n + 0.25)))


def straggler_acceptance(alpha: float, batch: int, row_spread: float = DEFAULT_ROW_SPREAD) -> float:
    """The per-token acceptance of a batch's slow row, which sets the batch's pace (module doc)."""
    return float(np.clip(alpha - row_spread * expected_max_normal(batch), 0.0, 0.99))

# Measured on an H200 (bf16, SmolLM2-135M shape, batch x block size; µs). Used only when this card
# has no cached table; `plan` rescales it by the ratio of AR steps when one is known.
REFERENCE_COSTS = {
    "card": "reference_H200",
    "verify_us": {
        "1": {"1": 986, "2": 1118, "4": 1113, "8": 1071, "16": 1079, "32": 1182, "64": 1300, "tree16": 1098, "tree32": 1225, "tree60": 1426},
        "8": {"1": 1126, "2": 1125, "4": 1212, "8": 1265, "16": 1429, "tree16": 1457, "tree32": 1588, "tree60": 1875},
        "16": {"1": 1178, "2": 1261, "4": 1316, "8": 1473, "16": 1576, "32": 1750, "64": 1992, "tree16": 1607, "tree32": 1789, "tree60": 2022},
        "32": {"1": 1388, "2": 1445, "4": 1593, "8": 1697, "16": 1830, "tree16": 1871, "tree32": 2220, "tree60": 2967},
    },
    "draft_step_us": {"1": 75, "16": 77},
    "draft_first_us": {"1": 39, "16": 56},
    "tree_level_us": {"1": 124, "16": 180},
    # whole round minus (draft + verify): commit, emit, bookkeeping (chain, tree)
    "round_overhead_us": {"1": 40, "16": 330},
    "tree_overhead_us": {"1": 150, "16": 185},
}


def expected_tokens(alpha, k):
    """tau(k) = sum_{i=0..k} alpha^i (accepted drafts + the bonus token), elementwise."""
    alpha = jnp.clip(alpha, 0.0, 0.999)
    return (1.0 - alpha ** (k + 1)) / (1.0 - alpha)


def alpha_for_chain_tokens(tokens: float, k: int = 6) -> float:
    """The per-token acceptance a with expected_tokens(a, k) = 1 + a + ... + a^k = `tokens` (a
    measured K = k chain's tokens per target call), by bisection, within [0, 0.999]."""
    if not 1.0 <= tokens <= k + 1:
        raise ValueError(f"tokens per call {tokens} must lie in [1, {k + 1}] for a chain of {k}")
    lo, hi = 0.0, 0.999
    for _ in range(40):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if float(expected_tokens(mid, k)) < tokens else (lo, mid)
    return lo


def alpha_from_ttt_accuracy(accuracy, k: int = 6) -> float:
    """[I] A freshly trained EAGLE head's acceptance, before any timed run: its held-out top-1 at
    training-time-test steps 0, 1, ... (the draft at depth j + 1) read as the chance that draft
    j + 1 is accepted once the earlier ones were, so a K = k chain accepts
        1 + sum_{j < k} prod_{i <= j} accuracy[i]
    tokens per call (the last step's accuracy repeats past the list), fitted as
    `alpha_for_chain_tokens`. Errors of one answer cluster, so the product under-counts long runs,
    while held-out rows sampled at T > 0 are harder than greedy answers: on SmolLM2's heads it gives
    2.70 tokens per call for v5 (measured 2.79 on MT-Bench: alpha 0.647 against 0.661) and 2.95 for
    v4, whose held-out rows were partly greedy (measured 2.71: 0.685 against 0.648). The generic
    prior a head without either would get is ACCEPTANCE_PRIOR["eagle"] = 0.45."""
    acc = [min(max(float(a), 0.0), 1.0) for a in accuracy]
    if not acc:
        raise ValueError("no training-time-test accuracies to estimate the acceptance from")
    tokens, run = 1.0, 1.0
    for j in range(k):
        run *= acc[min(j, len(acc) - 1)]
        tokens += run
    return alpha_for_chain_tokens(tokens, k)


def _interp(table: dict, x: float) -> float:
    """Piecewise-linear interpolation of {str(x): y} (linear extrapolation from the end points)."""
    pts = sorted((float(k), float(v)) for k, v in table.items())
    xs, ys = np.array([p[0] for p in pts]), np.array([p[1] for p in pts])
    if len(xs) == 1:
        return float(ys[0])
    if x <= xs[0]:
        i = 0
    elif x >= xs[-1]:
        i = len(xs) - 2
    else:
        return float(np.interp(x, xs, ys))
    return float(ys[i] + (ys[i + 1] - ys[i]) * (x - xs[i]) / (xs[i + 1] - xs[i]))


class CostModel:
    """Round costs at one batch size from a card's table (see the module doc).

    `context`: the mean number of tokens a row's attention reads during the call (prompt plus half
    the new tokens). A table measured at two context lengths carries `context_us[B]`: µs per 1,000
    more context tokens, for verify blocks ("1", "16", "tree60", ...), a draft step ("draft") and a
    tree level ("tree_level"), over the base tables' context (`context_base`). At long contexts attention
    dominates a verify forward, and a block of up to 16 tokens reads the context once, as one token
    does: drafting pays more than a short-context table says. Without `context_us` (or without a
    context) the costs are the table's own."""

    # the parts of a table that are a drafter's own: an EAGLE head's at the table's top level,
    # another drafter's (a draft model, an early exit) under drafters[its cost_key] (`drafter_costs`)
    DRAFTER_PARTS = ("draft_step_us", "draft_first_us", "round_overhead_us", "tree_level_us", "tree_overhead_us")

    def __init__(self, costs: dict, batch: int, context: float | None = None, drafter_key: str | None = None,
                 step_fraction: float | None = None):
        if drafter_key is not None:
            own = drafter_costs(costs, drafter_key)
            if "draft_step_us" not in own and step_fraction:  # not measured yet: a share of the AR step [I]
                step = {b: step_fraction * float(row_value(row, "1")) for b, row in costs["verify_us"].items()}
                own = {"draft_step_us": step, "draft_first_us": step, **own}
            costs = {**costs, **own}
        self.costs, self.batch = costs, batch
        per_k = costs.get("context_us") if context is not None else None
        self.extra_k = max(float(context) - float(costs.get("context_base", 0)), 0.0) / 1000.0 if per_k else 0.0

    def _over_batch(self, per_batch: dict, key=None) -> float:
        vals = {b: (row if key is None else row_value(row, key)) for b, row in per_batch.items()}
        vals = {b: v for b, v in vals.items() if v is not None}
        return _interp(vals, self.batch)

    def _context(self, key: str) -> float:
        """µs the round's `key` part ("draft", or a verify block) costs over the table at this context."""
        if not self.extra_k:
            return 0.0
        per_batch = self.costs["context_us"]
        if key in ("draft", "tree_level"):
            vals = {b: row.get(key, row.get("draft")) for b, row in per_batch.items()}
            vals = {b: v for b, v in vals.items() if v is not None}
            return max(_interp(vals, self.batch), 0.0) * self.extra_k if vals else 0.0
        rows = {b: {k: v for k, v in row.items() if k not in ("draft", "tree_level")} for b, row in per_batch.items()}
        return max(self._over_batch(rows, key), 0.0) * self.extra_k

    def verify(self, T: int, tree: bool = False) -> float:
        key = f"tree{T}" if tree else str(T)
        return self._over_batch(self.costs["verify_us"], key) + self._context(key)

    def ar_step(self) -> float:
        return self.verify(1)

    def draft_step(self) -> float:
        return self._over_batch(self.costs.get("draft_step_us") or {"1": 0.0}) + self._context("draft")

    def draft_first(self) -> float:
        return self._over_batch(self.costs.get("draft_first_us") or {"1": 0.0}) + self._context("draft")

    def tree_level(self) -> float:
        return self._over_batch(self.costs.get("tree_level_us") or self.costs.get("draft_step_us") or {"1": 0.0}) \
            + self._context("tree_level")

    def overhead(self, tree: bool = False) -> float:
        return max(self._over_batch(self.costs.get("tree_overhead_us" if tree else "round_overhead_us") or {"1": 0.0}), 0.0)

    def sampled(self, kind: str) -> float:
        """µs sampling adds to an AR step ("ar"), a chain round ("chain") or a sampled tree's round
        ("tree") at this batch (the table's `sampled_us`, else SAMPLED_US). Beyond the batches the
        table measured, its nearest measurement grows as SAMPLED_US's does: a line through two
        small batches, run out to 64 rows, prices a round by the slope of launch-bound kernels
        (an H100 table measured at 1 and 16 rows put a chain's sampling at 403 µs at 64 rows,
        SAMPLED_US's shape 345 µs, and flipped the 64-row plan to plain decoding)."""
        reference = SAMPLED_US[kind]
        measured = {float(b): float(v) for b, v in ((self.costs.get("sampled_us") or {}).get(kind) or {}).items()}
        if not measured:
            return max(_interp(reference, self.batch), 0.0)
        low, high = min(measured), max(measured)
        if low <= self.batch <= high:
            return max(_interp(measured, self.batch), 0.0)
        edge = high if self.batch > high else low
        growth = _interp(reference, self.batch) / max(_interp(reference, edge), 1e-9)
        return max(measured[edge] * growth, 0.0)

    def hybrid_branch(self) -> float:
        """What a round with an n-gram branch costs beyond its verify block (`HYBRID_BRANCH_US`)."""
        return max(self._over_batch(self.costs.get("hybrid_branch_us") or {"1": HYBRID_BRANCH_US}), 0.0)


def drafter_costs(costs: dict, drafter_key: str | None) -> dict:
    """The drafter-specific parts of a cost table (CostModel.DRAFTER_PARTS) for the drafter whose
    `cost_key` is `drafter_key`: the table's drafters[key] section, empty when the table has none
    (a drafter with no cost_key, an EAGLE head, reads the top level)."""
    if drafter_key is None:
        return {}
    return dict((costs.get("drafters") or {}).get(drafter_key) or {})


SUSPECT_RATIO = 1.25  # [I] a verify entry this far above a larger block's is a bad timing
# [I] µs a hybrid round with an n-gram branch costs beyond the verify block the table prices: the
# branch's lookup over the row's history, both drafters' commits, the root's extra child. Measured
# against the table's model on an H100 at batch 1 (fifth run, hybrid 31 + 4 nodes against the
# `auto` tree's 15): 83 µs a round on HumanEval, 120 on `longdoc` (whose long contexts the table
# does not price either). Unpriced, the plan drafted the branch where it lost 2-5%. A table's
# `hybrid_branch_us[B]` replaces it.
HYBRID_BRANCH_US = 80.0


def row_value(row: dict, key: str) -> float | None:
    """verify_us[B][key]; a missing chain T or tree size is interpolated over the row's sizes.

    A verify block of two or more tokens that costs over SUSPECT_RATIO times a larger block of the
    same kind is taken as a bad timing (e.g. of a GPU another process was using) and costs what
    that larger block does: one such entry cannot make every chain past it look dear and the plan
    collapse to one token. Smaller inversions are real on both cards measured (at batch 1 a 4-token
    block costs about 7% more than an 8-token one) and stay. T = 1 is plain decoding's own step and
    is taken as measured."""
    tree = key.startswith("tree")
    pts = {k[4:] if tree else k: float(v) for k, v in row.items() if k.startswith("tree") == tree}
    if not pts and tree:  # no tree sizes measured: a chain block of the same size
        pts = {k: float(v) for k, v in row.items() if not k.startswith("tree")}
    if not pts:
        return None
    size = float(key[4:] if tree else key)
    value = float(row[key]) if key in row else _interp(pts, size)
    larger = [v for k, v in pts.items() if float(k) >= max(size, 2)]
    if size < 2 or not larger or value <= SUSPECT_RATIO * min(larger):
        return value
    return min(larger)


@dataclasses.dataclass(frozen=True)
class AutoPlan:
    mode: str  # "ar" | "chain" | "tree"
    k_max: int  # chain K or tree depth
    num_nodes: int  # tree nodes (0 for chains)
    gain: float  # expected speed-up over plain decoding at the prior acceptance
    policy: "AutoPolicy | None"
    ngram: int = 0  # hybrid trees: nodes of the n-gram branch
    drafter: str = ""  # a hybrid drafter run as a chain of one half: "ngram" (lookup alone) or "head"
    lookup_first: int = 0  # hybrid trees: engines.tree.TreeConfig.lookup_first (0: every round drafts the head's tree)
    # a chain that runs the drafter's calibrated stop rule (a Policy) instead of `policy`'s per-round
    # lengths, up to k_max drafts (factory.with_calibrated_stop_rule); `stop_rule_name` says which
    stop_rule: Any = None
    stop_rule_name: str = ""

    def describe(self) -> str:
        """What the plan runs, in one line (`jspec generate`'s report, bench rows' `auto_plan`)."""
        if self.mode == "ar":
            return "plain decoding"
        if self.mode == "chain" and self.stop_rule is not None:
            return f"chain K <= {self.k_max}, {self.stop_rule_name}"
        if self.mode == "chain":
            alone = {"ngram": ", the n-gram half alone", "head": ", the head alone"}.get(self.drafter, "")
            return f"chain K = {self.k_max}{alone}"
        text = f"tree depth {self.k_max}, {self.num_nodes} nodes"
        text += f" + a {self.ngram}-node n-gram branch" if self.ngram else ""
        return text + (f", lookup first after {self.lookup_first}-gram matches" if self.lookup_first else "")


# [I] Tokens per call of n-gram rounds whose match is shorter than the drafter's longest n-gram:
# the n-gram rule (8 drafts a round) replayed on the CPU over SmolLM2-135M-Instruct's greedy answers
# to 28 training-side prompts (chitchat's training split, the corpus's documentation, code and
# translation sources): 1.45 (chit-chat 1.30, documentation summaries 2.01); after a full-length
# match 6.35, in 26% of rounds. A lookup-first hybrid gives those weak rounds the head's tree.
WEAK_LOOKUP_TOKENS = 1.45


def plan(costs: dict, *, batch: int, drafter_name: str, parallel: bool, k_cap: int = 8, tree: bool = False,
         tree_top_k: int = 10, tree_depth: int = 6, alpha: float | None = None, min_gain: float = 1.05,
         row_spread: float | None = None, hybrid: bool = False, ngram_alpha: float | None = None,
         context: float | None = None, lookup_first: int = 0, temperature: float = 0.0,
         alpha_by_temperature=None, drafter_key: str | None = None, step_fraction: float | None = None) -> AutoPlan:
    """The static budget for one generate call (module doc). `parallel` drafters (n-gram) cost
    nothing per draft step. alpha: the drafter's mean per-token acceptance (None: the table's or
    the prior, `acceptance_prior`); the plan uses a slow row's (`straggler_acceptance`, with the
    drafter's `ROW_SPREAD` unless row_spread is given). hybrid: a head tree with an n-gram branch
    beside it (drafters.hybrid): the plan also picks the branch's length, 0 to MAX_NGRAM_BRANCH in
    steps of 2 whatever the depth, by `hybrid_tokens` at the n-gram drafter's acceptance,
    ngram_alpha (None: its prior), lowered for a slow row by n-gram lookup's ROW_SPREAD. context:
    the call's mean attended context in tokens (`CostModel`), None: the table's own.
    lookup_first: the n-gram order (the drafter's max_ngram) at which a hybrid round may verify
    its n-gram branch alone (engines.tree); 0: never. [I] At batch 1 (a round skips the head only
    when every row matched, which a batch nearly never does) the plan runs lookup first whenever
    the best hybrid tree with a full n-gram branch beats lookup's weak rounds
    (`WEAK_LOOKUP_TOKENS` per chain round): its rounds after a full match are lookup's, the others
    that tree's, so it is planned above both lookup alone and the tree alone. Its gain is reported
    as the larger of theirs (the model has no share of matched rounds).
    temperature > 0: the call samples. Acceptances are the drafter's at that temperature
    (`acceptance_at`, from alpha_by_temperature when the drafter records it), rounds and AR steps
    cost what sampling adds (`CostModel.sampled`), trees are sampled-sibling trees
    (verify.sampled_tree: their static shape's reach, `sampled_tree_reach`), and no round looks
    up first. drafter_key: a drafter whose draft costs are its own (a draft model's `cost_key`,
    `CostModel`), planned with the table's drafters[key] section, or, until one is measured, a
    draft step of step_fraction times the AR step."""
    cm = CostModel(costs, batch, context, drafter_key, step_fraction)
    sampled = temperature > 0.0
    a = alpha if alpha is not None else acceptance_prior(costs, drafter_name)
    a = acceptance_at(a, temperature, drafter_name, alpha_by_temperature)
    if sampled:
        lookup_first = 0
    if row_spread is None:
        row_spread = ROW_SPREAD.get(drafter_name, DEFAULT_ROW_SPREAD)
    a_mean, a = a, straggler_acceptance(a, batch, row_spread)
    ar = cm.ar_step() + (cm.sampled("ar") if sampled else 0.0)
    step = 0.0 if parallel else cm.draft_step()
    draft_start = 0.0 if parallel else cm.draft_first()
    chain_extra = cm.sampled("chain") if sampled else 0.0
    # an EAGLE head's rounds keep the forward HEAD_EXTRA_FORWARDS adds (a drafter with its own costs, a draft model's, does not)
    head_extra = HEAD_EXTRA_FORWARDS if drafter_key is None else 0.0
    first = (draft_start + cm.overhead(tree) + ((cm.sampled("tree") if tree else chain_extra) if sampled else 0.0)
             + head_extra * (cm.tree_level() if tree else step))
    chain_first = draft_start + cm.overhead(False) + chain_extra + head_extra * step
    candidates = []  # (gain, draft tokens, depth or K, plan)
    a_ngram = a_ngram_mean = 0.0
    if hybrid:
        a_ngram_mean = acceptance_at(ngram_alpha if ngram_alpha is not None else acceptance_prior(costs, "ngram"),
                                     temperature, "ngram")
        a_ngram = straggler_acceptance(a_ngram_mean, batch, ROW_SPREAD["ngram"])
    # a chain's round terms per drafter ("": this drafter; "ngram" / "head": a hybrid's n-gram half
    # or head alone): (mean acceptance, a slow row's, fixed µs per round, µs per draft step)
    chain_terms = {"": (a_mean, a, first if not tree else chain_first, step),
                   "ngram": (a_ngram_mean, a_ngram, cm.overhead(False) + chain_extra, 0.0),
                   "head": (a_mean, a, chain_first, step)}

    def add_chains(drafter: str, into: list | None = None, longest: int = k_cap) -> None:
        _, a_slow, first_us, step_us = chain_terms[drafter]
        for k in range(1, longest + 1):
            gain = float(expected_tokens(a_slow, k)) * ar / (first_us + (k - 1) * step_us + cm.verify(k + 1))
            (candidates if into is None else into).append((gain, k, k, AutoPlan("chain", k, 0, gain, None, drafter=drafter)))

    def tree_gain(depth: int, n: int, ngram_alpha: float, m: int) -> float:
        """A tree of `depth` levels and n head nodes with an m-node n-gram branch accepted at ngram_alpha."""
        if sampled:
            tau = tokens_with_branch(sampled_tree_reach(n, depth, tree_top_k, a, temperature), ngram_alpha, m)
        else:
            tau = hybrid_tokens(float(tree_acceptance(a, n, depth)), depth, ngram_alpha, m)
        branch = cm.hybrid_branch() if m else 0.0
        return tau * ar / (first + (depth - 1) * cm.tree_level() + cm.verify(n + m + 1, tree=True) + branch)

    if tree:
        for depth in range(2, tree_depth + 1):
            for n in TREE_SIZES:
                if n > tree_top_k + (depth - 1) * tree_top_k**2:
                    continue
                for m in (range(0, MAX_NGRAM_BRANCH + 1, 2) if hybrid else (0,)):
                    gain = tree_gain(depth, n, a_ngram, m)
                    candidates.append((gain, n + m, depth, AutoPlan("tree", depth, n, gain, None, ngram=m)))
        if hybrid:  # its n-gram half alone: a hybrid that may draft none of the head's tree is never below lookup
            add_chains("ngram")
        # and the head alone as a chain (a hybrid's head, or the head asked for a tree), which leads at batch 8
        # and more (a tree's verify grows with the batch, a chain's far less) and when sampling at high
        # temperatures; asked for as a tree, the plan takes it only where it beats every tree (and lookup) by
        # more than the tolerance, not on a near-tie; the tree's depth caps its K
        head_chains = []
        add_chains("head" if hybrid else "", head_chains, min(k_cap, tree_depth))
        best_head = max(head_chains, key=lambda c: c[0])
        if not candidates or best_head[0] > max(c[0] for c in candidates) * (1 + PLAN_TOLERANCE):
            candidates = head_chains
    else:
        add_chains("")
    top = max((c[0] for c in candidates), default=1.0)
    first_tree = None
    if tree and hybrid and lookup_first and batch == 1:
        m = MAX_NGRAM_BRANCH
        weak_alpha = alpha_for_chain_tokens(WEAK_LOOKUP_TOKENS, m)
        weak_lookup = WEAK_LOOKUP_TOKENS * ar / (cm.overhead(False) + cm.verify(m + 1))
        full = [c for c in candidates if c[3].mode == "tree" and c[3].ngram == m]
        # the trees' gain in a round after a short match, whose n-gram branch is weak too
        if full and max(tree_gain(c[3].k_max, c[3].num_nodes, weak_alpha, m) for c in full) > weak_lookup:
            first_tree = dataclasses.replace(max(full, key=lambda c: c[0])[3], gain=top, lookup_first=lookup_first)
    if top < max(min_gain, 1.0):
        return AutoPlan("ar", 0, 0, top, None)
    near = [c for c in candidates if c[0] >= max(top * (1 - PLAN_TOLERANCE), min_gain)]
    best = first_tree or min(near, key=lambda c: (c[1], c[2]))[3]
    # a lone row's chain K is only a cap: each round the row's own estimate picks k <= K
    # (`round_limit`), so a longer cap serves its easy stretches and costs the hard ones nothing
    # more; in a batch, every row pays the padded block of the longest (module doc)
    if best.mode == "chain" and batch == 1:
        best = max((c for c in near if c[3].drafter == best.drafter), key=lambda c: (c[1], c[2]))[3]
    if best.mode == "tree":
        unit, verify_at = cm.tree_level(), cm.verify(best.num_nodes + best.ngram + 1, tree=True)
    else:
        a_mean, _, first, unit = chain_terms[best.drafter]
        verify_at = cm.verify(best.k_max + 1)
    # rows start from the mean acceptance; each row's own estimate takes over from there. The policy
    # is part of the compiled program (a static argument), so its numbers are kept coarse: an
    # acceptance estimated from each call's prompts (n-gram lookup) or costs read at each call's
    # context would otherwise compile a new program per call in a loop over prompt batches.
    policy = AutoPolicy(k_max=best.k_max, alpha0=coarse_acceptance(a_mean), step_us=coarse_us(unit),
                        first_us=coarse_us(first), verify_us=coarse_us(verify_at))
    return dataclasses.replace(best, policy=policy)


ACCEPTANCE_STEP = 0.05  # [I] the grid of a plan's acceptance prior (it counts as 4 of a row's trials)


def coarse_acceptance(alpha: float) -> float:
    """`alpha` on the ACCEPTANCE_STEP grid, inside (0, 1)."""
    on_grid = round(round(float(alpha) / ACCEPTANCE_STEP) * ACCEPTANCE_STEP, 6)
    return float(min(max(on_grid, ACCEPTANCE_STEP), 1.0 - ACCEPTANCE_STEP / 2))


def coarse_us(us: float) -> float:
    """A cost in µs to two significant digits (its measurement is good to a few percent)."""
    us = float(us)
    return float(f"{us:.2g}") if us > 0 else 0.0


@struct.dataclass
class AutoState:
    successes: jax.Array  # [B] float32 discounted accepted drafts (plus the prior's pseudo-count)
    trials: jax.Array  # [B] float32 discounted Bernoulli trials behind them
    rounds: jax.Array  # [B] int32

    @property
    def alpha(self) -> jax.Array:
        """[B] per-token acceptance estimate: the geometric fit of the discounted sums."""
        return self.successes / jnp.maximum(self.trials, 1e-6)


def acceptance_sums(successes, trials, n_drafted, n_accepted, discount: float):
    """One round of the per-row geometric fit: accepted drafts are successes, and a rejected draft
    (n_accepted < n_drafted) is one more trial; older rounds weigh `discount` per round."""
    acc = n_accepted.astype(jnp.float32)
    rejected = (n_accepted < n_drafted).astype(jnp.float32)
    return discount * successes + acc, discount * trials + acc + rejected


@dataclasses.dataclass(frozen=True)
class AutoPolicy(Policy):
    """Per-row draft length (or tree depth) maximising expected tokens per µs (module doc).

    step_us: one draft step / tree level; first_us: the draft's fixed start with its first token;
    verify_us: the static verify block's forward. alpha0: acceptance prior, worth `prior_trials` trials; discount: weight
    of a round one round older in the per-row sums (0.95: about the last 20 rounds count). Built
    by `plan` from a card's cost table; `make_policy("auto", k_max=K)` gives the reference costs
    at batch 1."""

    name = "auto"
    # On trees the plan already sized the tree for this batch and card; per-row cuts of it were
    # measured to cost more (the branches, engines.tree) than they saved, so its trees stay whole.
    cuts_trees = False

    alpha0: float = 0.6
    discount: float = 0.95
    prior_trials: float = 4.0
    step_us: float = 75.0
    first_us: float = 40.0
    verify_us: float = 1070.0

    def init(self, batch, key):
        del key
        return AutoState(successes=jnp.full((batch,), self.alpha0 * self.prior_trials, jnp.float32),
                         trials=jnp.full((batch,), self.prior_trials, jnp.float32), rounds=jnp.zeros((batch,), jnp.int32))

    def round_limit(self, state, k_max, features=None):
        self._check_k_max(k_max)
        k = jnp.arange(1, k_max + 1, dtype=jnp.float32)  # [K]
        rate = expected_tokens(state.alpha[:, None], k[None]) / (self.first_us + (k - 1) * self.step_us + self.verify_us)
        return clip_limit(jnp.argmax(rate, axis=1) + 1, k_max)

    def update(self, state, n_drafted, n_accepted, active):
        s, t = acceptance_sums(state.successes, state.trials, n_drafted, n_accepted, self.discount)
        return AutoState(successes=jnp.where(active, s, state.successes), trials=jnp.where(active, t, state.trials),
                         rounds=count_rounds(state.rounds, active))


# ---- the per-card cost table and the host-side budget --------------------------------------------


def cost_table_path(preset: str | None = None, models_dir: str = "models", *, committed: bool = True) -> Path:
    """Where this card's cost table lives: models/<preset>/round_cost_<card>.json (the project's
    committed tables, written by scripts/measure_card_costs.py) when `committed` and that preset
    directory exists, else the user cache ($JSPEC_CACHE, default ~/.cache/jspec), where tables
    measured on the fly by a user's run go, so a run never writes into the repository."""
    name = f"round_cost_{card_key()}.json"
    if committed and preset and (Path(models_dir) / preset).is_dir():
        return Path(models_dir) / preset / name
    return user_cache_dir() / (f"{preset}_{name}" if preset else name)


def cost_table_paths(preset: str | None = None, models_dir: str = "models") -> list[Path]:
    """The places a cost table is read from, first hit wins: committed, then the user cache."""
    paths = [cost_table_path(preset, models_dir), cost_table_path(preset, models_dir, committed=False),
             cost_table_path(None)]
    return list(dict.fromkeys(paths))


def load_costs(preset: str | None = None, models_dir: str = "models") -> dict:
    """This card's cached cost table of the current COST_TABLE_VERSION, or REFERENCE_COSTS when
    none has been measured (a table of an older jspec would plan on rounds that no longer cost that)."""
    for path in cost_table_paths(preset, models_dir):
        try:
            costs = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if costs.get("version") == COST_TABLE_VERSION:
            return costs
    return REFERENCE_COSTS


def plan_for(drafter, costs: dict, *, batch: int, k_cap: int, tree, context: float | None = None, prompts=None,
             ngram_estimate: NgramEstimate | None = NGRAM_ESTIMATE, sampling=None) -> AutoPlan:
    """`plan` for a drafter object: its own measured acceptance (an EAGLE head's config) as the
    prior, a hybrid planned as its head's tree plus the n-gram branch. `tree`: None (chains), or
    the tree setting (a TreeConfig, whose top_k and depth bound the search; True or "auto": EAGLE-2's
    defaults). `context`: the call's mean attended context (`mean_context`). `prompts`: the call's
    prompts (token ids), from which n-gram lookup's acceptance (the n-gram drafter's, a hybrid's
    branch's) is estimated by `ngram_acceptance` with `ngram_estimate`; None for either: its
    prior. `sampling`: the call's Sampling (None: greedy). `generate`, `jspec generate` and `jspec
    bench` plan through factory.auto_plan, which adds a drafter's calibrated stop rule to this plan."""
    hybrid = drafter.name == "hybrid"
    lookup = drafter.ngram if hybrid else (drafter if drafter.name == "ngram" else None)  # the n-gram drafter
    estimated = None
    if lookup is not None and prompts is not None and ngram_estimate is not None:
        estimated = ngram_acceptance(prompts, acceptance_prior(costs, "ngram"), ngram_estimate,
                                     max_ngram=lookup.max_ngram, min_ngram=lookup.min_ngram)
    return plan(costs, batch=batch, drafter_name="eagle" if hybrid else drafter.name, parallel=drafter.parallel,
                k_cap=k_cap, tree=tree is not None,
                alpha=estimated if drafter.name == "ngram" else getattr(drafter, "acceptance", None),
                tree_top_k=getattr(tree, "top_k", 10), tree_depth=getattr(tree, "depth", 6), hybrid=hybrid,
                ngram_alpha=estimated if hybrid else None, context=context,
                lookup_first=lookup.max_ngram if hybrid else 0,
                temperature=0.0 if sampling is None else float(sampling.temperature),
                alpha_by_temperature=getattr(drafter, "acceptance_by_temperature", None),
                drafter_key=getattr(drafter, "cost_key", None), step_fraction=getattr(drafter, "step_fraction", None))


# [I] Draft forwards an EAGLE head's round is charged beyond what the cost table measured. A chain of
# k drafts costs the table's first + (k - 1) steps and a tree of D levels first + (D - 1) levels (the
# head's first token or level comes from its stored logits), but until 2026-12-05 the plan charged k
# steps and D levels besides `first`, and the constants fit to measured rows since (ROW_SPREAD,
# HYBRID_BRANCH_US, WEAK_LOOKUP_TOKENS, the tie band's picks) were fit under that accounting: dropped
# for heads alone, the committed tables' plans move (H200 batch 1: 15-node trees of depth 4, not 5;
# a hybrid's n-gram branch dropped where it had paid). So heads keep one forward more until those are
# re-fit on a GPU; a draft model, whose step is a whole model's forward (a quarter of a Qwen2.5-Coder
# 0.5B round), is charged what the table measured: with the extra forward `auto` planned plain
# decoding for a pair that runs 1.12-1.38x at static K = 4.
HEAD_EXTRA_FORWARDS = 1.0


# [I] A queue's tail moves to a batch of rows // TAIL_FRACTION rows when the plan expects a token
# there to cost at most 1 / TAIL_MIN_GAIN of one in the full batch. The margin covers what the
# model leaves out: the tail's prefill of every row's prompt and tokens so far, and its compile.
TAIL_FRACTION = 4
TAIL_MIN_GAIN = 1.25


def tail_rows(drafter, costs: dict, *, rows: int, k_cap: int, tree, context: float | None = None, prompts=None,
              sampling=None) -> int:
    """Rows of the compact tail in which `generate` finishes a queue's last running rows (0: none).

    With `rows` rows in flight, once no prompt waits the batch drains: its last rows run alone in
    a program sized for all of them (an H200 step of SmolLM2-135M costs 1.44 ms at 64 rows, 0.92 ms
    at 16), and with fewer rows speculation plans larger budgets (`plan`'s stragglers). So the
    rows still running when at most rows // TAIL_FRACTION remain are re-prefilled (prompt and
    tokens so far) into a batch of that many rows, planned afresh, when the plans expect a token
    there to cost TAIL_MIN_GAIN times less: per token, a plan costs verify(1, B) / gain."""
    tail = rows // TAIL_FRACTION
    if tail < 1:
        return 0
    def per_token(batch):
        p = plan_for(drafter, costs, batch=batch, k_cap=k_cap, tree=tree, context=context, prompts=prompts,
                     sampling=sampling)
        return CostModel(costs, batch, context).ar_step() / max(p.gain if p.mode != "ar" else 1.0, 1.0)
    return tail if per_token(rows) >= TAIL_MIN_GAIN * per_token(tail) else 0


def mean_context(prompt_lens, max_new: int) -> float:
    """Tokens a row's attention reads on average over a call: its prompt and half its new tokens."""
    return float(np.mean(np.asarray(prompt_lens, np.float64))) + max_new / 2.0


def auto_budget(p: AutoPlan, drafter, k_max: int, tree):
    """(drafter, policy, k_max, tree) that run the plan `p` (factory.auto_plan makes it): the
    drafter is None when plain decoding is expected to be faster. `tree` is None (chains) or the
    caller's tree config, whose depth and num_nodes the plan replaces."""
    if p.mode == "ar":
        return None, None, k_max, None
    if p.mode == "tree":
        return drafter, p.policy, k_max, dataclasses.replace(tree, depth=p.k_max, num_nodes=p.num_nodes, ngram=p.ngram,
                                                             lookup_first=p.lookup_first)
    half = {"ngram": "ngram", "head": "eagle"}.get(p.drafter)  # a hybrid's half that runs alone
    return (getattr(drafter, half) if half else drafter), p.policy if p.stop_rule is None else p.stop_rule, p.k_max, None
