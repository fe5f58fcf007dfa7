"""Accepted tokens per target call of an EAGLE head's or a draft model's greedy chains, by task and
category, on any device (the CPU included), from one teacher-forced pass per answer instead of a
timed run.

    python scripts/acceptance_by_category.py --model smollm2-135m-instruct \
        --tasks mt_bench,humaneval,chitchat --n-prompts 0 --k 1,2,4,6,8 --out results.json
    python scripts/acceptance_by_category.py --model qwen2.5-coder-1.5b-instruct \
        --drafter model:qwen2.5-coder-0.5b-instruct --tasks humaneval --n-prompts 24 --k 1,2,4,6,8 --out pair.json

Why it is exact: `jspec.bench.acceptance` (labels from one teacher-forced pass, then a walk that
replays the chain engine; tests/test_acceptance.py checks the target calls against the engine).
`--check N` also runs the real chain engine on N prompts here and compares.

The target's answers come from jspec AR (greedy, --max-new-tokens), batched. Trees are not
covered; use `jspec bench` for trees.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time

import jax
import jax.numpy as jnp

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from jspec.bench.acceptance import chain_calls, draft_model_chain_calls  # noqa: E402
from jspec.cards import card_name  # noqa: E402
from jspec.bench.prompts import encode_questions  # noqa: E402
from jspec.generate import SpeculativeConfig, generate  # noqa: E402
from jspec.presets import list_presets, load_preset, resolve_model  # noqa: E402
from jspec.errors import UsageError  # noqa: E402
from jspec.speculative.drafters.model import ModelDrafter  # noqa: E402
from jspec.speculative.factory import build_drafter, with_draft_vocab  # noqa: E402
from jspec.tasks import load_task  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--drafter", default="eagle3", help="eagle3[:PATH], eagle[:PATH] (default: the shipped head) or model:NAME|PATH")
    ap.add_argument("--tasks", default="mt_bench,humaneval")
    ap.add_argument("--n-prompts", type=int, default=0, help="first N prompts per task (0: all)")
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--k", default="1,2,4,6,8", help="chain lengths to report")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--check", type=int, default=2, help="prompts to run through the real chain engine (K = max --k)")
    ap.add_argument("--draft-vocab", default="0",
                    help="draft models: comma list of draft vocabularies to walk side by side (0: the whole "
                         "vocabulary; N: the target's N most frequent answer tokens, --draft-vocab of jspec generate)")
    ap.add_argument("--out", required=True)
    a = ap.parse_args(argv)
    ks = sorted(int(k) for k in a.k.split(","))
    cfg, params, tok = resolve_model(a.model, dtype=jnp.dtype(a.dtype))
    drafter, dparams = build_drafter(a.drafter, cfg, params, model_name=a.model)
    vocabs = [int(v) for v in a.draft_vocab.split(",") if v.strip()]
    if vocabs != [0] and not isinstance(drafter, ModelDrafter):
        raise UsageError("--draft-vocab walks a draft model's chains (--drafter model:...)")
    first = dataclasses.replace(drafter, draft_vocab=vocabs[0]) if isinstance(drafter, ModelDrafter) else drafter
    variants = {v: with_draft_vocab(dparams, drafter.cfg, a.model, cfg, v) if v else dparams for v in vocabs}
    chat = load_preset(a.model).chat if a.model in list_presets() else None
    k_max = max(ks)
    report = {"model": a.model, "drafter": a.drafter, "draft_vocab": vocabs[0], "dtype": a.dtype, "max_new_tokens": a.max_new_tokens,
              "device": card_name(), "k": ks, "tasks": {}}
    t0 = time.perf_counter()
    for task in [t for t in a.tasks.split(",") if t]:
        questions = load_task(task, a.n_prompts or None)
        prompts = encode_questions(tok, questions, chat=chat)
        by_cat: dict[str, dict] = {}
        by_vocab: dict[int, dict] = {}
        checks = []
        for s in range(0, len(prompts), a.batch):
            batch = prompts[s : s + a.batch]
            ar = generate(params, cfg, batch, max_new_tokens=a.max_new_tokens)
            answers = [ar.row(i) for i in range(len(batch))]
            if isinstance(drafter, ModelDrafter):
                per_vocab = {v: draft_model_chain_calls(drafter.cfg, dp, batch, answers, ks, cfg.pad_token_id)
                             for v, dp in variants.items()}
                calls = per_vocab[vocabs[0]]
                for v, c in per_vocab.items():
                    tot = by_vocab.setdefault(v, {"tokens": 0, **{f"calls_k{k}": 0 for k in ks}})
                    tot["tokens"] += sum(len(x) for x in answers)
                    for k in ks:
                        tot[f"calls_k{k}"] += sum(row[k] for row in c)
            else:
                calls = chain_calls(drafter.head, dparams, params, batch, answers, ks, cfg.pad_token_id)
            for i, (p, answer) in enumerate(zip(batch, answers)):
                q = questions[s + i]
                cat = by_cat.setdefault(q.category, {"prompts": 0, "tokens": 0, **{f"calls_k{k}": 0 for k in ks}})
                cat["prompts"] += 1
                cat["tokens"] += len(answer)
                for k in ks:
                    cat[f"calls_k{k}"] += calls[i][k]
                if len(checks) < a.check:
                    checks.append((p, calls[i][k_max], answer))
            print(f"{task}: {min(s + a.batch, len(prompts))}/{len(prompts)} ({time.perf_counter() - t0:.0f}s)", flush=True)
        total = {"prompts": 0, "tokens": 0, **{f"calls_k{k}": 0 for k in ks}}
        for cat in by_cat.values():
            for key in total:
                total[key] += cat[key]
        for row in [*by_cat.values(), total]:
            for k in ks:
                row[f"tokens_per_call_k{k}"] = round(row["tokens"] / max(row[f"calls_k{k}"], 1), 3)
        engine = []
        for p, calls_w, ref in checks:
            sp = generate(params, cfg, [p], max_new_tokens=a.max_new_tokens,
                          speculative=SpeculativeConfig(drafter=first, drafter_params=variants[vocabs[0]], k_max=k_max))
            engine.append({"walk_calls": calls_w, "engine_calls": int(sp.target_calls[0]), "tokens": len(ref),
                           "identical_output": sp.row(0) == ref})
        report["tasks"][task] = {"all": total, "by_category": by_cat, "engine_check": engine}
        if len(vocabs) > 1:
            for row in by_vocab.values():
                for k in ks:
                    row[f"tokens_per_call_k{k}"] = round(row["tokens"] / max(row[f"calls_k{k}"], 1), 3)
            report["tasks"][task]["by_draft_vocab"] = {str(v): row for v, row in by_vocab.items()}
            print(json.dumps({task: {v: {k: row[f"tokens_per_call_k{k}"] for k in ks} for v, row in by_vocab.items()}}),
                  flush=True)
        print(json.dumps({task: {k: total[f"tokens_per_call_k{k}"] for k in ks}, "check": engine}), flush=True)
    with open(a.out, "w") as fh:
        json.dump(report, fh, indent=1)
    print(f"wrote {a.out} ({time.perf_counter() - t0:.0f}s)")
    return 0


if __name__ == "__main__":
    from jspec.cli import report_user_errors

    raise SystemExit(report_user_errors(main, "acceptance_by_category.py"))
