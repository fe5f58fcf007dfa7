"""Spec-Bench metrics, computed from timed batches of RowResults.

Definitions (Spec-Bench, Xia et al. 2024, extended to batches):

* tokens_per_s: the mean, over timed ``run`` calls, of (new tokens of the real prompts in the call)
  / (wall seconds of the call). At batch 1 this is exactly Spec-Bench's mean over prompts of
  new tokens / seconds. At batch B it is each batch's throughput averaged over batches: a padded
  last batch counts only its real prompts' tokens but its full wall time.
* speedup_vs_ar: tokens_per_s / tokens_per_s of autoregressive decoding at the same batch size and
  dtype, measured in the same process.
* mean_accepted_tokens: tokens added per target forward pass, bonus token included, taken over all
  decode steps of all prompts = total new tokens / total target calls (1.00 for AR).
* acceptance_rate: accepted draft tokens / drafted tokens (None when nothing was drafted).
* draft_tokens_per_round: drafted tokens / target calls.
* greedy_identical_to_ar: the fraction of prompts whose output equals AR's output.
"""

from __future__ import annotations

import collections
import dataclasses
from typing import Sequence

from jspec.bench.protocol import RowResult


@dataclasses.dataclass
class TimedBatch:
    seconds: float
    rows: list[RowResult]  # the real prompts only; padding rows are dropped before this point


def tokens_per_s(batches: Sequence[TimedBatch]) -> float:
    if not batches:
        raise ValueError("no timed batches")
    rates = []
    for b in batches:
        if b.seconds <= 0:
            raise ValueError(f"non-positive wall time {b.seconds}")
        rates.append(sum(len(r.new_tokens) for r in b.rows) / b.seconds)
    return sum(rates) / len(rates)


def _all_rows(batches: Sequence[TimedBatch]) -> list[RowResult]:
    return [r for b in batches for r in b.rows]


def mean_accepted_tokens(batches: Sequence[TimedBatch]) -> float | None:
    rows = _all_rows(batches)
    calls = sum(r.target_calls for r in rows)
    return sum(len(r.new_tokens) for r in rows) / calls if calls else None


def acceptance_rate(batches: Sequence[TimedBatch]) -> float | None:
    rows = _all_rows(batches)
    drafted = sum(r.drafted for r in rows)
    return sum(r.accepted for r in rows) / drafted if drafted else None


def rollback_rate(batches: Sequence[TimedBatch]) -> float | None:
    """Drafted tokens thrown away / drafted (parallel engines report it; None for the others)."""
    rows = _all_rows(batches)
    if any(r.rolled_back is None for r in rows):
        return None
    drafted = sum(r.drafted for r in rows)
    return sum(r.rolled_back for r in rows) / drafted if drafted else None


def draft_tokens_per_round(batches: Sequence[TimedBatch]) -> float | None:
    rows = _all_rows(batches)
    calls = sum(r.target_calls for r in rows)
    return sum(r.drafted for r in rows) / calls if calls else None


def speedup(method_tokens_per_s: float, baseline_tokens_per_s: float | None) -> float | None:
    if not baseline_tokens_per_s:
        return None
    return method_tokens_per_s / baseline_tokens_per_s


def greedy_identical_fraction(outputs: Sequence[Sequence[int]], reference: Sequence[Sequence[int]]) -> float:
    if len(outputs) != len(reference):
        raise ValueError(f"{len(outputs)} outputs vs {len(reference)} reference outputs")
    if not outputs:
        raise ValueError("no outputs to compare")
    same = sum(list(a) == list(b) for a, b in zip(outputs, reference))
    return same / len(outputs)


def accepted_length_histogram(batches: Sequence[TimedBatch]) -> dict[int, int] | None:
    """How many target calls added 1, 2, ... tokens; None when the method gives no per-step trace."""
    traces = [r.step_tokens for r in _all_rows(batches)]
    if not traces or any(t is None for t in traces):
        return None
    return dict(sorted(collections.Counter(n for t in traces for n in t).items()))
