"""EAGLE-3's reduced draft vocabulary: chosen by frequency, reported by coverage, and the draft
LM head initialised from the target's own output embeddings.

Coverage is measured on the target's greedy answers to the evaluation prompts, which the
distillation run writes as reference shards (eval-*.npz, never trained on): the share of answer
tokens inside the draft vocabulary, and the share of 6-token windows entirely inside it (a chain
of 6 drafts can only be fully accepted there; the issue's c^6 estimate assumes independence).
"""

from __future__ import annotations

import numpy as np

from ..heads import eagle as H
from . import shards as S

WINDOW = 6


def eval_answers(data_dir: str) -> dict[str, list[np.ndarray]]:
    """Greedy answers to the evaluation prompts by task (eval shards of a v2 dataset)."""
    meta = S.read_meta(data_dir)
    out: dict[str, list[np.ndarray]] = {}
    for s in S.shard_files(meta, "eval"):
        rows = S.load_rows(data_dir, s["file"])
        for r in range(len(rows["items"])):
            name = meta["sources"][int(rows["source"][r])].removeprefix("eval_")
            seq = S.row_tokens(rows, r)
            out.setdefault(name, []).append(seq[int(rows["prompt_lens"][r]) :].astype(np.int64))
    return out


def coverage(in_vocab: np.ndarray, answers: list[np.ndarray], window: int = WINDOW) -> dict:
    """Token coverage and full-window coverage of `answers` under the bool mask `in_vocab` [V]."""
    tokens = sum(len(a) for a in answers)
    hits = sum(int(in_vocab[a].sum()) for a in answers)
    windows = full = 0
    for a in answers:
        if len(a) >= window:
            inside = in_vocab[a].astype(np.int64)
            run = np.convolve(inside, np.ones(window, np.int64), mode="valid")
            windows += len(run)
            full += int((run == window).sum())
    c = hits / max(tokens, 1)
    return {"answers": len(answers), "tokens": tokens, "coverage": round(c, 4),
            f"coverage_pow{window}": round(c**window, 4),
            f"full_windows_{window}": round(full / max(windows, 1), 4)}


def coverage_report(data_dir: str, t2d: np.ndarray) -> dict:
    """Coverage of the draft vocabulary (t2d [V] bool) on each evaluation task's greedy answers."""
    return {task: coverage(np.asarray(t2d, bool), answers) for task, answers in sorted(eval_answers(data_dir).items())}


def coverage_by_size(data_dir: str, counts: np.ndarray, sizes=(8192, 16384, 24576, 32000, 49152)) -> dict:
    """Coverage on each evaluation task for draft vocabularies of several sizes (same counts)."""
    answers = eval_answers(data_dir)
    order = np.lexsort((np.arange(len(counts)), -np.asarray(counts)))
    out = {}
    for n in sizes:
        if n > len(counts):
            continue
        mask = np.zeros(len(counts), bool)
        mask[order[:n]] = True
        out[str(n)] = {task: coverage(mask, a)["coverage"] for task, a in sorted(answers.items())}
    return out


def target_lm_weight(target_params: dict, target_cfg) -> np.ndarray:
    """The target's output projection [D, V] (the embedding, transposed, when tied)."""
    if target_cfg.tie_word_embeddings or "lm_head" not in target_params:
        return np.asarray(target_params["embed"], np.float32).T
    return np.asarray(target_params["lm_head"], np.float32)


# Largest standard deviation of the logits a target-initialised LM head gives a random head output
# of unit RMS. SmolLM2-135M's own final norm and LM head give about 6 (kept as they are); Gemma-3-
# 270M's give 52 (final-norm weights up to 301), whose first training steps then see a cross-
# entropy near 180.
TARGET_INIT_MAX_LOGIT_STD = 8.0


def random_output_logit_std(final_norm: np.ndarray, lm_weight: np.ndarray) -> float:
    """Standard deviation of (h * final_norm) @ lm_weight over h ~ N(0, I), averaged over tokens:
    sqrt(mean_j sum_i final_norm_i^2 W_ij^2)."""
    return float(np.sqrt(np.mean(np.square(final_norm.astype(np.float64)) @ np.square(lm_weight.astype(np.float64)))))


def init_lm_head_from_target(hcfg: H.HeadConfig, head_params: dict, target_params: dict) -> dict:
    """EAGLE-3 head whose lm_head is the target's output rows of the draft vocabulary (through
    d2t) and whose final norm is the target's: a head output along the target's pre-norm hidden
    state then ranks tokens exactly as the target does over the draft vocabulary. The training
    starts from the target's own token geometry instead of noise.

    The final norm is scaled down where the target's would make a random head output's logits
    sharper than TARGET_INIT_MAX_LOGIT_STD: the ranking is unchanged, only the temperature."""
    if hcfg.kind != "eagle3":
        return head_params
    w = target_lm_weight(target_params, hcfg.target)
    ids = np.asarray(head_params["d2t"]) if hcfg.reduced_vocab else np.arange(hcfg.target.vocab_size)
    dtype = np.asarray(head_params["lm_head"]).dtype
    lm = w[:, ids]
    norm = np.asarray(target_params["final_norm"], np.float32)
    norm = norm * min(1.0, TARGET_INIT_MAX_LOGIT_STD / random_output_logit_std(norm, lm))
    return {**head_params, "lm_head": lm.astype(dtype), "final_norm": norm.astype(dtype)}
