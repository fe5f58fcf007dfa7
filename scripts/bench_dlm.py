"""Benchmark rows for the diffusion drafter: DiffuSpec against AR, SSD against stepwise decoding.

    python scripts/bench_dlm.py --target smollm2-135m-instruct --dlm DLM/dlm.safetensors \
        --data DATA_DIR --out RESULTS_DIR --time-budget-s 240

One process, one device, greedy. Every method is compiled once (prompts are padded to one
length) and warmed up on the first batch (untimed, `compile_s`). Per task, AR runs first; the
number of batches every method then runs is fitted to what is left of the time budget (after a
reserve for the compiles still to come) from AR's batch time, so all rows of a task cover the
same prompts (`n_prompts`; all of them when the budget allows).

Rows (RESULTS_DIR/dlm_bench.json, a list; bench-report fields plus extras; rewritten after each task's
rows, the fp32 row and each profile row, so a run cut short keeps what it finished):
  method "ar"         the target alone (the reference of speedup_vs_ar and greedy_identical_to_ar)
  method "diffuspec"  names diffuspec:cps:adl (the library's CPS: expected accepted length, lambda
                      0.7), diffuspec:cps-logprob:adl (the paper's path score and EOS stop, lambda
                      0.5), diffuspec:nocps:adl, diffuspec:cps:static (fixed k),
                      with --paper diffuspec:paper:adl (tau 0.8, M 15, B 3, lambda 0.5, k in
                      [20, 30]); mean_accepted_tokens = tokens per target call
  method "ssd"        the DLM alone: stepwise decoding (ssd:stepwise, the fast one-block program;
                      ssd:stepwise:N=.., the same rule through SSD's N-node forward) and SSD
                      (ssd:N=..): identical_to_stepwise (fraction of prompts equal to
                      ssd:stepwise:N=.., the bit-for-bit reference), identical_to_stepwise_1block
                      (equal to ssd:stepwise: bf16 rounding between programs), forwards_per_token,
                      speedup_vs_stepwise (against ssd:stepwise)
  an fp32 row         DiffuSpec greedy identity to fp32 AR on --fp32-prompts prompts
                      (matmul precision "highest")
  method "profile"    (--rows profile) the round's cost breakdown at --batch, each part timed by
                      itself in a jitted loop (jspec.bench.round_cost): per DiffuSpec variant
                      dlm_forward_us (the DLM's block call), choose_us (CPS lattice + beam, or the
                      argmax), verify_us (the target's forward over k_max + 1 tokens), round_us
                      (a whole round); for SSD stepwise_step_us, ssd_step_us (the N-node step) and
                      their ratio
The proxy 3-gram table is fitted on the training split of DATA_DIR at start (seconds).
--prompts-from-data N benchmarks N prompts of DATA_DIR's eval split instead of the tasks (for a
target without a tokenizer, e.g. the CPU smoke test).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))


def parse(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", required=True)
    ap.add_argument("--dlm", required=True, help="dlm.safetensors from scripts/train_dlm.py")
    ap.add_argument("--data", default=None,
                    help="distilled dataset (fits DiffuSpec's 3-gram proxy; needed unless --rows ssd)")
    ap.add_argument("--out", required=True)
    ap.add_argument("--tasks", default="mt_bench,humaneval")
    ap.add_argument("--prompts-from-data", type=int, default=0)
    ap.add_argument("--n-prompts", type=int, default=0, help="the first N prompts of each task (default: all)")
    ap.add_argument("--time-budget-s", type=float, default=240.0,
                    help="whole run incl. compiles: prompts per task are cut to fit (default 240)")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--k", type=int, default=16, help="library k_max (ADL upper bound, fixed-k rows)")
    ap.add_argument("--ssd-block", type=int, default=8)
    ap.add_argument("--ssd-nodes", type=int, default=4)
    ap.add_argument("--fp32-prompts", type=int, default=8)
    ap.add_argument("--dtype", default=None, help="default: the preset's (bfloat16 on GPU)")
    ap.add_argument("--lams", default=None,
                    help="CPS's lambda for the CPS + ADL rows, comma-separated: one row each (default: the library's, "
                         "LIBRARY_CPS); choose lambda on --prompts-from-data prompts, never on the benchmark tasks")
    ap.add_argument("--cps-search", default="auto", choices=("auto", "xla", "pallas"),
                    help="CPS's beam search: auto (the library default: the one-kernel search on a GPU), the portable "
                         "jnp ops, or the one-kernel GPU search (kernels/cps_search.py)")
    ap.add_argument("--save-proxy", default=None,
                    help="also write the fitted 3-gram proxy to this .npz (next to a dlm.safetensors, `jspec` "
                         "drafts with CPS: speculative/factory.py)")
    ap.add_argument("--paper", action="store_true", help="add the paper-settings DiffuSpec row (k in [20, 30])")
    ap.add_argument("--rows", default="diffuspec,ssd,fp32",
                    help="row groups: diffuspec (with AR), ssd (with stepwise), fp32 (greedy identity), profile "
                         "(round cost breakdown); split them over processes / GPUs to save wall time")
    args = ap.parse_args(argv)
    if args.batch < 1 or args.max_new_tokens < 1:
        ap.error("--batch and --max-new-tokens must be >= 1")
    args.rows = [r for r in args.rows.split(",") if r]
    try:
        args.lams = [float(x) for x in args.lams.split(",")] if args.lams else None
    except ValueError:
        ap.error(f"--lams {args.lams}: expected comma-separated numbers in [0, 1]")
    if args.lams is not None and not all(0.0 <= x <= 1.0 for x in args.lams):
        ap.error(f"--lams {','.join(map(str, args.lams))}: each lambda must be in [0, 1]")
    if not args.rows or set(args.rows) - {"diffuspec", "ssd", "fp32", "profile"}:
        ap.error(f"--rows {','.join(args.rows)}: choose from diffuspec, ssd, fp32, profile")
    if args.n_prompts < 0:
        ap.error(f"--n-prompts must be >= 0, got {args.n_prompts}")
    if not os.path.isfile(args.dlm):
        ap.error(f"--dlm {args.dlm}: no such file")
    needs_data = bool(set(args.rows) - {"ssd"}) or args.prompts_from_data
    if needs_data and not (args.data and os.path.isfile(os.path.join(args.data, "meta.json"))):
        ap.error(f"--data {args.data}: no meta.json (the distilled dataset is needed by --rows {','.join(args.rows)})")
    return args


def main(argv=None):
    args = parse(argv)
    import jax
    import jax.numpy as jnp
    import numpy as np

    from jspec import model as M
    from jspec.bench import round_cost as RC
    from jspec.cards import card_name
    from jspec.decode import bucket, generate_ar_jit, plan_cache_len
    from jspec.heads import dlm as D
    from jspec.presets import list_presets, load_preset, resolve_model
    from jspec.sampling import GREEDY
    from jspec.speculative.drafters.diffusion import LIBRARY_CPS, PAPER_CPS, DiffuSpecDrafter, fit_trigram_proxy, save_proxy
    from jspec.speculative.engines import ssd as SSD
    from jspec.speculative.engines.chain import check_compatible, speculative_generate_jit
    from jspec.speculative.policies import make_policy
    from jspec.speculative.policies.adl import ADLPolicy
    from jspec.train import shards as SH

    t0 = time.perf_counter()
    tcfg, tparams, tok = resolve_model(args.target, dtype=args.dtype, tokenizer=not args.prompts_from_data)
    dtype = tparams["embed"].dtype
    dcfg, own = D.load_dlm(args.dlm, tcfg, dtype=dtype)
    meta = SH.read_meta(args.data) if args.data else None
    seqs = []
    for s in SH.shard_files(meta, "train") if set(args.rows) - {"ssd"} else []:  # SSD needs no proxy
        rows = SH.load_rows(args.data, s["file"])
        seqs += [SH.row_tokens(rows, r) for r in range(len(rows["prompt_lens"]))]
    proxy = fit_trigram_proxy(seqs, tcfg.vocab_size) if seqs else None
    if proxy is not None and args.save_proxy:
        save_proxy(args.save_proxy, proxy)
    proxy = jax.tree.map(jnp.asarray, proxy) if proxy is not None else None
    print(f"loaded target, DLM ({dcfg.num_layers} layers) and a 3-gram proxy of {len(seqs)} rows "
          f"in {time.perf_counter() - t0:.1f}s", flush=True)

    # ---- prompts ----------------------------------------------------------------------------
    prompts: dict[str, list[list[int]]] = {}
    if args.prompts_from_data:
        rows = SH.load_rows(args.data, (SH.shard_files(meta, "eval") or SH.shard_files(meta, "all"))[0]["file"])
        prompts["data"] = [SH.row_tokens(rows, r)[: rows["prompt_lens"][r]].tolist()
                           for r in range(min(args.prompts_from_data, len(rows["prompt_lens"])))]
    else:
        from jspec.bench.prompts import encode_questions
        from jspec.tasks import load_task

        chat = load_preset(args.target).chat if args.target in list_presets() else None
        for name in [t for t in args.tasks.split(",") if t]:
            prompts[name] = encode_questions(tok, load_task(name), chat=chat)
    if args.n_prompts:
        prompts = {name: ps[: args.n_prompts] for name, ps in prompts.items()}
    P = bucket(max(len(p) for ps in prompts.values() for p in ps))
    k_paper = 30 if dcfg.block_size >= 30 and args.paper else 0
    k_lib = min(args.k, dcfg.block_size)
    extra = max(k_lib, k_paper) + 1
    cache_len = plan_cache_len(P, args.max_new_tokens, extra)
    ssd_cache = SSD.cache_len_for(P, args.max_new_tokens, args.ssd_block, args.ssd_nodes)
    SSD.check_ssd(dcfg, args.ssd_block, args.ssd_nodes)
    B = args.batch
    key = jax.random.PRNGKey(0)

    def packed(ps):
        n = len(ps)
        pad = (-n) % B
        ps = list(ps) + [ps[-1]] * pad
        tokens = np.full((len(ps), P), tcfg.pad_token_id, np.int32)
        for i, p in enumerate(ps):
            tokens[i, : len(p)] = p
        return tokens, np.asarray([len(p) for p in ps], np.int32), n

    # ---- methods: each returns per-row (tokens, target_calls / forwards, drafted, accepted) ----
    dparams = {"dlm": own, "proxy": proxy}

    def ar_fn(tp):
        def run(t, l):
            out, n, steps = generate_ar_jit(tp, tcfg, t, l, key, max_new=args.max_new_tokens, cache_len=cache_len, sampling=GREEDY)
            out, n, steps = jax.device_get((out, n, steps))
            return [(out[b, : n[b]].tolist(), int(steps[b]), 0, 0) for b in range(len(n))]
        return run

    def spec_fn(drafter, policy, k, tp, dp):
        check_compatible(drafter, policy, tcfg, k, "lossless")

        def run(t, l):
            o = speculative_generate_jit(tp, dp, None, t, l, key, tcfg=tcfg, drafter=drafter, policy=policy, k_max=k,
                                         max_new=args.max_new_tokens, cache_len=cache_len, sampling=GREEDY,
                                         verify="lossless", unroll=None)
            out, n, calls, drafted, acc = jax.device_get(o[:5])
            return [(out[b, : n[b]].tolist(), int(calls[b]), int(drafted[b]), int(acc[b])) for b in range(len(n))]
        return run

    def ssd_fn(n_nodes, stepwise=False):
        fn = SSD.stepwise_generate_jit if stepwise else SSD.ssd_generate_jit

        def run(t, l):
            out, n, fw = jax.device_get(fn(own, tparams, t, l, dcfg=dcfg, b=args.ssd_block, n_nodes=n_nodes,
                                           max_new=args.max_new_tokens, cache_len=ssd_cache))
            return [(out[b, : n[b]].tolist(), int(fw[b]), 0, 0) for b in range(len(n))]
        return run

    lib = dict(k_min=max(1, k_lib // 4), delta=max(1, k_lib // 4))
    cps_settings: dict[str, dict] = {}  # row name -> its CPS settings, read off the drafter

    def diffuspec(name, drafter_label, policy_label, drafter, policy, k):
        if drafter.cps:
            cps_settings[name] = {"cps_lam": drafter.lam, "cps_objective": drafter.objective,
                                  "cps_eos_stop": drafter.eos_stop, "cps_search": drafter.search_impl()}
        return ("diffuspec", name, drafter_label, policy_label, spec_fn(drafter, policy, k, tparams, dparams))

    adl = ADLPolicy(k_max=k_lib, **lib)
    methods = [] if "diffuspec" not in args.rows else [
        ("ar", "ar", None, None, ar_fn(tparams)),
        *[diffuspec("diffuspec:cps:adl" + ("" if lam == LIBRARY_CPS["lam"] else f":lam={lam:g}"), "diffuspec", "adl",
                    DiffuSpecDrafter(dcfg=dcfg, k_max=k_lib, lam=lam, cps_search=args.cps_search), adl, k_lib)
          for lam in (args.lams or [LIBRARY_CPS["lam"]])],
        # the paper's path score (sum of log weights, EOS stop, lambda 0.5) over the library's lattice
        diffuspec("diffuspec:cps-logprob:adl", "diffuspec", "adl",
                  DiffuSpecDrafter(dcfg=dcfg, k_max=k_lib, lam=PAPER_CPS["lam"], objective=PAPER_CPS["objective"],
                                   eos_stop=PAPER_CPS["eos_stop"], cps_search=args.cps_search), adl, k_lib),
        diffuspec("diffuspec:nocps:adl", "diffuspec-nocps", "adl", DiffuSpecDrafter(dcfg=dcfg, k_max=k_lib, cps=False),
                  adl, k_lib),
        diffuspec(f"diffuspec:cps:static:k={k_lib}", "diffuspec", "static",
                  DiffuSpecDrafter(dcfg=dcfg, k_max=k_lib, cps_search=args.cps_search),
                  make_policy("static", k_max=k_lib), k_lib),
    ]
    if k_paper and "diffuspec" in args.rows:
        methods.append(diffuspec("diffuspec:paper:adl", "diffuspec-paper", "adl-paper",
                                 DiffuSpecDrafter.paper(dcfg, k_max=k_paper), ADLPolicy.paper(k_max=k_paper), k_paper))
    if "ssd" in args.rows:
        same_shape = f"ssd:stepwise:N={args.ssd_nodes}"  # stepwise decoding through SSD's N-node forward
        methods += [("ssd", "ssd:stepwise", "dlm", "stepwise", ssd_fn(1, stepwise=True)),
                    ("ssd", same_shape, "dlm", "stepwise", ssd_fn(args.ssd_nodes, stepwise=True)),
                    ("ssd", f"ssd:N={args.ssd_nodes}", "dlm", f"ssd-N{args.ssd_nodes}", ssd_fn(args.ssd_nodes))]
    fp32 = args.fp32_prompts if "fp32" in args.rows else 0

    compiled: dict[str, float] = {}
    card = card_name()
    stamp = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    all_rows = []
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "dlm_bench.json")

    def save():  # after every group of rows: a run cut short keeps what it measured
        with open(path, "w") as fh:
            json.dump(all_rows, fh, indent=1)
    deadline = t0 + args.time_budget_s
    n_compiles = len(methods) + (2 if fp32 else 0)

    for ti, (task, ps) in enumerate(prompts.items() if methods else []):
        tokens, lens, n_real = packed(ps)
        n_batches_all = len(tokens) // B
        results: dict[str, dict] = {}
        n_batches = n_batches_all
        for mi, (method, name, drafter, policy, fn) in enumerate(methods):
            if name not in compiled:
                tc = time.perf_counter()
                fn(jnp.asarray(tokens[:B]), jnp.asarray(lens[:B]))
                compiled[name] = time.perf_counter() - tc
            outs, secs = [], []
            bi = 0
            while bi < n_batches:  # n_batches is fitted after AR's first batch
                t, l = jnp.asarray(tokens[bi * B : (bi + 1) * B]), jnp.asarray(lens[bi * B : (bi + 1) * B])
                ts = time.perf_counter()
                rows = fn(t, l)
                secs.append(time.perf_counter() - ts)
                outs.append(rows[: max(0, min(B, n_real - bi * B))])
                if mi == 0 and bi == 0:  # fit every method into the task's share, from the first one's batch time
                    c_est = max(1.5 * compiled[name], 10.0)  # a speculative program compiles slower than AR
                    reserve = c_est * (n_compiles - len(compiled))
                    share = (deadline - time.perf_counter() - reserve) / (len(prompts) - ti)
                    n_batches = max(1, min(n_batches_all, int(share / (secs[0] * len(methods) * 1.3))))
                bi += 1
            flat = [r for o in outs for r in o]
            rates = [sum(len(r[0]) for r in o) / s for o, s in zip(outs, secs) if o]
            results[name] = {"rows": flat, "tps": float(np.mean(rates)), "secs": float(sum(secs))}
            print(f"{task} {name}: {len(flat)} prompts, {results[name]['tps']:.0f} tok/s, compile {compiled[name]:.1f}s", flush=True)

        ar = results.get("ar")
        step = results.get("ssd:stepwise")
        for method, name, drafter, policy, _ in methods:
            r = results[name]
            rows = r["rows"]
            new = sum(len(x[0]) for x in rows)
            calls = sum(x[1] for x in rows)
            drafted = sum(x[2] for x in rows)
            acc = sum(x[3] for x in rows)
            row = {
                "card": card, "jax_version": jax.__version__, "target": args.target, "method": method, "name": name,
                "drafter": drafter, "policy": policy, "tree": False, "dtype": str(jnp.dtype(dtype)), "batch": B,
                "task": task, "n_prompts": len(rows), "max_new_tokens": args.max_new_tokens, "tokens_per_s": r["tps"],
                "speedup_vs_ar": r["tps"] / ar["tps"] if method != "ssd" else None,
                "mean_accepted_tokens": new / max(calls, 1) if method != "ssd" else None,
                "acceptance_rate": acc / drafted if drafted else None,
                "draft_tokens_per_round": drafted / max(calls, 1) if method == "diffuspec" else None,
                "greedy_identical_to_ar": (float(np.mean([a[0] == b[0] for a, b in zip(rows, ar["rows"])]))
                                           if method != "ssd" else None),
                "mean_new_tokens": new / max(len(rows), 1), "peak_mem_bytes": None, "compile_s": compiled[name],
                "timestamp": stamp, "timed_s": r["secs"],
                "settings": {"k_max": k_paper if "paper" in name else k_lib, "ssd_block": args.ssd_block,
                             "ssd_nodes": args.ssd_nodes, "dlm_layers": dcfg.num_layers, "dlm_block": dcfg.block_size,
                             **cps_settings.get(name, {})},
            }
            if method == "ssd":
                same = lambda ref: float(np.mean([a[0] == b[0] for a, b in zip(rows, ref["rows"])]))  # noqa: E731
                row["forwards_per_token"] = calls / max(new, 1)
                # the bit-for-bit reference is stepwise decoding with SSD's shapes (engines/ssd.py);
                # identity to the one-block program measures bf16 rounding between two programs
                row["identical_to_stepwise"] = same(results[same_shape])
                row["identical_to_stepwise_1block"] = same(step)
                row["speedup_vs_stepwise"] = r["tps"] / step["tps"]
            all_rows.append(row)
        save()

    # ---- fp32 greedy identity of DiffuSpec ------------------------------------------------------
    if fp32:
        ps = [p for task_ps in prompts.values() for p in task_ps][:fp32]
        tokens, lens, n_real = packed(ps)
        tp32 = M.cast_params(tparams, jnp.float32)
        dp32 = {"dlm": M.cast_params(own, jnp.float32), "proxy": proxy}
        with jax.default_matmul_precision("highest"):
            ar32 = ar_fn(tp32)
            ds32 = spec_fn(DiffuSpecDrafter(dcfg=dcfg, k_max=k_lib, cps_search=args.cps_search), adl, k_lib, tp32, dp32)
            a, d = [], []
            for bi in range(len(tokens) // B):
                t, l = jnp.asarray(tokens[bi * B : (bi + 1) * B]), jnp.asarray(lens[bi * B : (bi + 1) * B])
                a += ar32(t, l)
                d += ds32(t, l)
        a, d = a[:n_real], d[:n_real]
        all_rows.append({
            "card": card, "jax_version": jax.__version__, "target": args.target, "method": "diffuspec",
            "name": "diffuspec:cps:adl:fp32-identity", "drafter": "diffuspec", "policy": "adl", "tree": False,
            "dtype": "float32", "batch": B, "task": "+".join(prompts), "n_prompts": n_real,
            "max_new_tokens": args.max_new_tokens, "tokens_per_s": None, "speedup_vs_ar": None,
            "mean_accepted_tokens": sum(len(x[0]) for x in d) / max(sum(x[1] for x in d), 1),
            "acceptance_rate": None, "draft_tokens_per_round": None,
            "greedy_identical_to_ar": float(np.mean([x[0] == y[0] for x, y in zip(d, a)])),
            "peak_mem_bytes": None, "compile_s": None, "timestamp": stamp,
        })
        save()

    # ---- the round's cost breakdown ---------------------------------------------------------
    if "profile" in args.rows:
        prof_rows = [("diffuspec:cps:adl", DiffuSpecDrafter(dcfg=dcfg, k_max=k_lib, cps_search=args.cps_search), adl),
                     ("diffuspec:nocps:adl", DiffuSpecDrafter(dcfg=dcfg, k_max=k_lib, cps=False), adl)]
        for name, drafter, policy in prof_rows if proxy is not None else prof_rows[1:]:
            prof = RC.profile_method(tparams, tcfg, drafter, dparams, batch=B, policy=policy, k_max=k_lib, prompt_len=P,
                                     max_new=args.max_new_tokens, verify_ts=(1, k_lib + 1))
            all_rows.append({"card": card, "jax_version": jax.__version__, "target": args.target, "method": "profile",
                             "name": name, "dtype": str(jnp.dtype(dtype)), "batch": B, "timestamp": stamp,
                             "settings": {"k_max": k_lib, "dlm_layers": dcfg.num_layers}, **prof})
            save()
            print(f"profile {name} b={B}: DLM forward {prof['dlm_forward_us']:.0f} µs, choose {prof['choose_us']:.0f} µs, "
                  f"verify[{k_lib + 1}] {prof['verify_us'][str(k_lib + 1)]:.0f} µs (AR step {prof['verify_us']['1']:.0f}), "
                  f"round {prof['round_us']:.0f} µs", flush=True)
        prof = RC.ssd_forward_us(own, tparams, dcfg, batch=B, b=args.ssd_block, n_nodes=args.ssd_nodes, prompt_len=P)
        all_rows.append({"card": card, "jax_version": jax.__version__, "target": args.target, "method": "profile",
                         "name": f"ssd:N={args.ssd_nodes}", "dtype": str(jnp.dtype(dtype)), "batch": B, "timestamp": stamp,
                         "settings": {"ssd_block": args.ssd_block, "ssd_nodes": args.ssd_nodes,
                                      "dlm_layers": dcfg.num_layers}, **prof})
        print(f"profile ssd b={B}: one-block step {prof['stepwise_step_us']:.0f} µs, {args.ssd_nodes}-node step "
              f"{prof['ssd_step_us']:.0f} µs (x{prof['ssd_over_stepwise']:.2f})", flush=True)

    save()
    for r in all_rows:
        if r["method"] == "profile":
            continue
        extra_s = ""
        if r["method"] == "ssd":
            extra_s = (f" identical {r['identical_to_stepwise']:.2f} fwd/tok {r['forwards_per_token']:.3f} "
                       f"x{r['speedup_vs_stepwise']:.2f} vs stepwise")
        sp = f" x{r['speedup_vs_ar']:.2f} vs AR" if r.get("speedup_vs_ar") else ""
        mat = f" MAT {r['mean_accepted_tokens']:.2f}" if r.get("mean_accepted_tokens") else ""
        ident = f" =AR {r['greedy_identical_to_ar']:.2f}" if r.get("greedy_identical_to_ar") is not None else ""
        print(f"{r['task']:10s} {r['name']:30s} {r['dtype']:8s} n={r['n_prompts']}{mat}{sp}{ident}{extra_s}")
    print(f"wrote {path} ({time.perf_counter() - t0:.0f}s in all)")
    return all_rows


if __name__ == "__main__":
    from jspec.cli import report_user_errors

    raise SystemExit(report_user_errors(main, "bench_dlm.py"))
