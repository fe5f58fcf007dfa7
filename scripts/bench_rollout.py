"""RL-rollout benchmark: many prompts sampled at T = 1 with continuous batching, and the target's
log-probs of the sampled tokens, speculative methods against AR in one process.

    python scripts/bench_rollout.py --model smollm2-135m-instruct --rows 64,128 \\
        --methods ar,spec:eagle3:auto,spec:eagle3:static:k=4 --out benchmarks/rollout/<card>.json
    python scripts/bench_rollout.py --tiny      # a random tiny model (CPU, seconds)

A rollout is what an RL step waits for: every prompt's completion (up to --max-new-tokens, ending
at EOS, so lengths are the model's own: long-tailed) with `rows` rows in flight (a finished row
takes the next prompt inside the jitted loop, jspec.refill), then the log-probs of the sampled
tokens under the target (jspec.scoring, one teacher-forced forward per --score-rows rows). Each
method runs once untimed (compiles) and --passes times timed; a row reports tokens per second of
the rollout with and without the scoring, each against AR's in the same process. `auto` plans for
the rows in flight and the sampling (policies.auto), and for the queue's tail: once no prompt
waits, the last rows move to a smaller batch planned afresh (generate's `tail_rows`; --tail-rows
sets it for every method, AR included). --ar-tail adds a row of AR with the same tail, so the part
of a speed-up that compaction alone gives is on the record. Prompts: the held-out chit-chat first
turns (jspec.tasks' `chitchat`), never a training set.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from jspec import model as M
from jspec.bench.prompts import encode_questions
from jspec.bench.protocol import parse_method_specs
from jspec.cards import card_key, card_name
from jspec.config import ModelConfig
from jspec.decode import pack_prompts
from jspec.errors import UsageError
from jspec.generate import SpeculativeConfig, default_tail_runs, generate
from jspec.presets import resolve_model
from jspec.sampling import Sampling
from jspec.scoring import completion_logprobs
from jspec.speculative.engines.tree import TreeConfig
from jspec.speculative.factory import build_drafter
from jspec.speculative.policies.auto import load_costs, mean_context, plan_for, tail_rows
from jspec.tasks import load_questions_file, load_task


def tiny_model():
    cfg = ModelConfig(arch="llama", vocab_size=48, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4,
                      num_kv_heads=2, head_dim=8, eos_token_ids=(3,), max_position_embeddings=512)
    return cfg, M.init_params(cfg, jax.random.PRNGKey(0), scale=0.35)


def tiny_prompts(n: int) -> list[list[int]]:
    rs = np.random.RandomState(0)
    return [list(rs.randint(4, 48, rs.randint(3, 12))) for _ in range(n)]


def speculative_config(spec, cfg, params, model_name, rows, prompts, max_new, sampling, tail=None):
    """The SpeculativeConfig of a spec method (None for ar), and its auto plan made for `rows` rows
    in flight, with the tail auto adds (`tail` None) or the tail given."""
    if spec.method == "ar":
        return None, ""
    kw = spec.generate_kwargs()
    drafter, dparams = build_drafter(kw["drafter"], cfg, params, model_name=model_name, k_max=kw["k_max"])
    tree = kw.get("tree")
    plan = ""
    if kw["policy"] == "auto":
        tc = (TreeConfig() if tree in (True, "auto") else tree) if spec.tree else None
        costs, context = load_costs(model_name), mean_context([len(p) for p in prompts], max_new)
        kw["policy"] = plan_for(drafter, costs, batch=rows, k_cap=kw["k_max"], tree=tc, context=context,
                                prompts=prompts, sampling=sampling)
        plan = kw["policy"].describe()
        if tail is None and default_tail_runs(cfg, prompts, rows, None, max_new, drafter, tc, kw["k_max"]):  # as generate adds it
            tail = tail_rows(drafter, costs, rows=rows, k_cap=kw["k_max"], tree=tc, context=context, prompts=prompts,
                             sampling=sampling)
        if tail:
            plan += f"; the last {tail} rows in a {tail}-row tail, planned afresh"
    fields = {k: v for k, v in kw.items() if k != "drafter" and v is not None}
    return SpeculativeConfig(drafter=drafter, drafter_params=dparams, **fields), plan


def score(params, cfg, prompts, tokens, lengths, score_rows: int, sampling) -> np.ndarray:
    """The target's log-probs of every completion's tokens, --score-rows rows per forward."""
    padded, lens, _ = pack_prompts(cfg, prompts, tokens.shape[1], 0)
    fn = jax.jit(lambda p, a, b, c, d: completion_logprobs(p, cfg, a, b, c, d, sampling))
    out = []
    for i in range(0, len(prompts), score_rows):
        sl = slice(i, i + score_rows)
        rows = [jnp.asarray(x[sl]) for x in (padded, lens, tokens, lengths)]
        if rows[0].shape[0] < score_rows:  # one compiled shape: pad the last chunk with its first row
            fill = score_rows - rows[0].shape[0]
            rows = [jnp.concatenate([r, jnp.repeat(r[:1], fill, 0)]) for r in rows]
        out.append(np.asarray(fn(params, *rows))[: len(prompts[sl])])
    return np.concatenate(out)


def rollout(params, cfg, prompts, rows, spec_cfg, max_new, sampling, seed, score_rows, tail=None):
    """(generation seconds, scoring seconds, GenerationResult) of one rollout."""
    t0 = time.perf_counter()
    res = generate(params, cfg, prompts, max_new_tokens=max_new, sampling=sampling, seed=seed, batch_size=rows,
                   speculative=spec_cfg, tail_rows=tail)
    t1 = time.perf_counter()
    lp = score(params, cfg, prompts, np.asarray(res.tokens), np.asarray(res.lengths), score_rows, sampling)
    assert np.isfinite(lp).all()  # a sampled token the target gives no mass would be a lossy bug
    return t1 - t0, time.perf_counter() - t1, res


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--tiny", action="store_true", help="a random tiny model and random prompts (CPU)")
    ap.add_argument("--methods", default="ar,spec:eagle3:auto", help="ar and spec:... methods (jspec bench's grammar)")
    ap.add_argument("--prompts", type=int, default=256)
    ap.add_argument("--questions", default=None,
                    help="a Spec-Bench questions .jsonl to take the prompts from instead (default: the chit-chat task)")
    ap.add_argument("--rows", default="64", help="comma list of rows in flight")
    ap.add_argument("--max-new-tokens", type=int, default=1024)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--passes", type=int, default=1, help="timed rollouts per method (each row keeps the median)")
    ap.add_argument("--score-rows", type=int, default=16, help="rows per scoring forward")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--tail-rows", type=int, default=None,
                    help="rows of the queue's tail for every method, AR included (0: none; default: auto's choice)")
    ap.add_argument("--ar-tail", action="store_true",
                    help="also time AR with the tail (--tail-rows, else a quarter of the rows): compaction alone")
    ap.add_argument("--out", default=None, help="JSON rows (default: benchmarks/rollout/<card>.json)")
    a = ap.parse_args(argv)
    try:
        row_counts = [int(r) for r in a.rows.split(",") if r.strip()]
    except ValueError:
        row_counts = []
    if not row_counts or min(row_counts) < 1 or a.prompts < 1 or a.passes < 1 or a.score_rows < 1 or a.temperature <= 0:
        raise UsageError("--rows takes positive counts; --prompts, --passes, --score-rows >= 1; --temperature > 0")
    if a.tail_rows is not None and not 0 <= a.tail_rows < min(row_counts):
        raise UsageError(f"--tail-rows {a.tail_rows}: 0 (none) up to fewer than the smallest --rows ({min(row_counts)})")
    specs = parse_method_specs(a.methods)
    if any(s.method not in ("ar", "spec") for s in specs):
        raise UsageError("--methods: ar and spec:... methods only (continuous batching)")
    specs = sorted(specs, key=lambda s: s.method != "ar")
    if specs[0].method != "ar":
        raise UsageError("--methods must include ar: every row is a ratio against it")
    sampling = Sampling(temperature=a.temperature)
    if a.tiny:
        cfg, params = tiny_model()
        prompts, model_name = tiny_prompts(a.prompts), None
    else:
        questions = (load_questions_file(a.questions) if a.questions else load_task("chitchat"))[: a.prompts]
        if len(questions) < a.prompts:
            raise UsageError(f"--prompts {a.prompts}: {a.questions or 'the chit-chat task'} holds {len(questions)}")
        cfg, params, tok = resolve_model(a.model)
        prompts, model_name = encode_questions(tok, questions), a.model
    out_path = Path(a.out or f"benchmarks/rollout/{card_key()}.json")
    rows_out: list[dict] = []
    for rows in row_counts:
        ar_gen = ar_all = None
        ar_tail = a.tail_rows if a.tail_rows is not None else rows // 4
        timed = [(spec, spec.name, a.tail_rows) for spec in specs]
        if a.ar_tail and ar_tail:
            timed.insert(1, (specs[0], "ar+tail", ar_tail))
        for spec, name, tail in timed:
            spec_cfg, plan = speculative_config(spec, cfg, params, model_name, rows, prompts, a.max_new_tokens, sampling,
                                                tail)
            if spec.method == "ar" and tail:
                plan = f"plain decoding; the last {tail} rows in a {tail}-row tail"
            compile_s = sum(rollout(params, cfg, prompts, rows, spec_cfg, a.max_new_tokens, sampling, a.seed,
                                    a.score_rows, tail)[:2])
            runs = [rollout(params, cfg, prompts, rows, spec_cfg, a.max_new_tokens, sampling, a.seed + 1 + i, a.score_rows,
                            tail) for i in range(a.passes)]
            # Each pass samples its own completions (seed + 1 + i), and a method's random draws differ
            # from AR's, so passes and methods generate different token counts (lengths end at EOS):
            # compare rates (tokens per second of each pass, median over passes), not wall times.
            pass_tokens = [int(np.sum(r[2].lengths)) for r in runs]
            gen_rate = float(np.median([n / r[0] for n, r in zip(pass_tokens, runs)]))
            all_rate = float(np.median([n / (r[0] + r[1]) for n, r in zip(pass_tokens, runs)]))
            gen_s = float(np.median([r[0] for r in runs]))
            score_s = float(np.median([r[1] for r in runs]))
            res = runs[0][2]
            tokens = pass_tokens[0]
            if name == "ar":
                ar_gen, ar_all = gen_rate, all_rate
            row = {
                "card": card_name(), "jax_version": jax.__version__, "target": "tiny" if a.tiny else a.model,
                "name": name, "auto_plan": plan or None, "rows_in_flight": rows, "n_prompts": len(prompts),
                "max_new_tokens": a.max_new_tokens, "temperature": a.temperature,
                "dtype": str(params["embed"].dtype), "tokens": tokens, "pass_tokens": pass_tokens,
                "length_p10_p50_p90": [int(x) for x in np.percentile(res.lengths, [10, 50, 90])],
                "ended_at_eos": float(np.mean(np.asarray(res.lengths) < a.max_new_tokens)),
                "generate_s": gen_s, "score_s": score_s, "compile_and_first_s": compile_s,
                "rollout_tokens_per_s": gen_rate, "with_scoring_tokens_per_s": all_rate,
                "speedup_vs_ar": gen_rate / ar_gen, "speedup_vs_ar_with_scoring": all_rate / ar_all,
                "tokens_per_call": tokens / max(int(np.sum(res.target_calls)), 1), "passes": a.passes,
                "reproduce": "python scripts/bench_rollout.py " + " ".join(sys.argv[1:] if argv is None else argv),
            }
            rows_out.append(row)
            print(f"rows {rows} {name}{' (' + plan + ')' if plan else ''}: {row['rollout_tokens_per_s']:.0f} tok/s, "
                  f"{row['speedup_vs_ar']:.2f}x AR ({row['speedup_vs_ar_with_scoring']:.2f}x with scoring), "
                  f"{row['tokens_per_call']:.2f} tokens/call, lengths {row['length_p10_p50_p90']}", flush=True)
            out_path.parent.mkdir(parents=True, exist_ok=True)
            out_path.write_text(json.dumps(rows_out, indent=1))  # after every method: a cut run keeps its rows
    return rows_out


if __name__ == "__main__":
    from jspec.cli import report_user_errors

    raise SystemExit(report_user_errors(main, "bench_rollout.py"))
