"""The law check of sampled benchmark rows: a method's emitted tokens against AR's, position by position.

Sampled outputs cannot be compared with AR's token for token. A lossless method's samples follow
the target's law, as AR's do, so for every new-token position j the two sets of samples (of the
same prompt, independent seeds) come from one distribution. Per prompt and position, a two-sample
chi-square test of homogeneity on the token counts (tokens seen fewer than `MIN_COUNT` times in
both samples together pooled into one category; AR and the method at their own seeds); the
prompts' statistics add (independent samples). A row reports each position's p-value and the
smallest, Bonferroni-corrected over the positions. This tests the marginal law of each position,
which a lossy rule moves (a wrong residual, a biased sibling rule: tests/test_lossless_sampling.py
checks the conditional law, exactly, on a tiny model); it is a check at real scale, not a proof.
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np
from jax.scipy.special import gammaincc

MIN_COUNT = 10  # tokens seen fewer times (both samples together) share one category


def law_samples(method, prompts: Sequence[Sequence[int]], rows: int, tokens: int, *, seed: int) -> np.ndarray:
    """[len(prompts), rows, tokens] new tokens (-1 past a row's end): `rows` samples of each prompt
    in one call of `method` (a bench method whose `run` generates for a list of prompts)."""
    method.seed = seed
    out = np.full((len(prompts), rows, tokens), -1, np.int64)
    for i, prompt in enumerate(prompts):
        for r, row in enumerate(method.run([list(prompt)] * rows)):
            got = list(row.new_tokens)[:tokens]
            out[i, r, : len(got)] = got
    return out


def homogeneity(a: np.ndarray, b: np.ndarray) -> tuple[float, int]:
    """(chi-square statistic, degrees of freedom) that token samples a and b share one law."""
    tokens, inverse = np.unique(np.concatenate([a, b]), return_inverse=True)
    counts = np.zeros((2, len(tokens)))
    np.add.at(counts, (np.r_[np.zeros(len(a), int), np.ones(len(b), int)], inverse), 1)
    big = counts.sum(0) >= MIN_COUNT
    table = np.concatenate([counts[:, big], counts[:, ~big].sum(1, keepdims=True)], 1)
    table = table[:, table.sum(0) > 0]
    if table.shape[1] < 2 or (table.sum(1) == 0).any():
        return 0.0, 0
    expected = table.sum(1, keepdims=True) * table.sum(0, keepdims=True) / table.sum()
    return float(((table - expected) ** 2 / expected).sum()), table.shape[1] - 1


def chi2_sf(stat: float, df: int) -> float:
    """P(chi-square with df degrees of freedom > stat)."""
    return 1.0 if df == 0 else float(gammaincc(df / 2.0, stat / 2.0))


def position_pvalues(samples: np.ndarray, reference: np.ndarray) -> list[float]:
    """Per new-token position, the homogeneity p-value of samples against reference, both [P, R, T]."""
    out = []
    for j in range(samples.shape[2]):
        stat, df = 0.0, 0
        for a, b in zip(samples[:, :, j], reference[:, :, j]):
            s, d = homogeneity(a[a >= 0], b[b >= 0])
            stat, df = stat + s, df + d
        out.append(chi2_sf(stat, df))
    return out


def law_row(ctx, spec, dtype: str, sampling, task: str, samples: np.ndarray, reference: np.ndarray,
            tokens: int) -> dict[str, Any]:
    """A bench row of the law check: the method's samples against AR's."""
    pvalues = position_pvalues(samples, reference)
    return {
        "card": ctx.card, "jax_version": ctx.jax_version, "target": ctx.target, "method": spec.method, "name": spec.name,
        "drafter": spec.drafter, "policy": spec.policy, "tree": bool(spec.tree), "dtype": dtype, "batch": samples.shape[1],
        "task": f"{task}:law", "n_prompts": samples.shape[0], "max_new_tokens": tokens,
        "temperature": sampling.temperature, "top_p": sampling.top_p, "top_k": sampling.top_k,
        "law_samples": samples.shape[1], "law_pvalues": pvalues,
        "law_pvalue_min": min(1.0, min(pvalues) * len(pvalues)),  # Bonferroni over the positions
        "tokens_per_s": None, "speedup_vs_ar": None, "mean_accepted_tokens": None, "acceptance_rate": None,
        "draft_tokens_per_round": None, "greedy_identical_to_ar": None, "peak_mem_bytes": None, "compile_s": None,
        "reproduce": ctx.reproduce, "timestamp": ctx.timestamp,
    }
