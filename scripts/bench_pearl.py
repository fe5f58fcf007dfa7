"""AR vs plain speculative decoding vs PEARL and PPSD (two devices, and one), greedy.

    python scripts/bench_pearl.py --model smollm2-135m-instruct --drafter model:DRAFT_DIR \
        --exit-head EXIT_DIR --methods ar,spec,pearl,ppsd --out OUT --time-budget-s 240

PPSD (engines/ppsd.py) drafts with the target's first E layers and the exit head of --exit-head (a
directory from scripts/train_draft_model.py --exit-layer E, or `cut` for the untrained head copied
from the target's last layer: a plumbing check); E comes from the directory unless --exit-layer.
`specbranch` (engines/specbranch.py) drafts with the same draft model and window γ as PEARL, plus
--branches heads a window and the --cut rule (confidence, none, or hrad with --hrad DIR from
scripts/train_hrad.py); its rows carry rollback_rate and branch_saves.
`spec_ee` is plain draft-then-verify with that same early-exit drafter (k = --ee-k drafts a round):
the ppsd rows' `speedup_vs_spec` is against it.

Per MT-Bench first turn (batch 1; all 80 unless --n-prompts or the budget cuts the list), every
method runs on the same prompt before the next prompt starts, so a budget cut leaves the same
prompts for all methods. Timings exclude compilation (each method first runs a warm-up prompt).
Plain speculative decoding drafts k = γ tokens per round with the same drafter, so
`speedup_vs_spec` isolates what PEARL's overlap adds. γ = round(t_target / t_draft) is measured
on the devices used unless --gamma is given.

Writes OUT/parallel_rows.json: one row per method (method, devices, dtype, kernels, prompts,
tokens, time_s, tok_per_s, speedup_vs_ar, speedup_vs_spec, mean_accepted_tokens = tokens per
target call, acceptance, rollback_rate, gamma, greedy_identity = share of prompts whose output
equals AR's in the same dtype) plus, with --fp32-prompts N, float32 rows on N prompts whose
greedy_identity must be 1.0. --drafter cut:N uses the target's layers without training (a
plumbing check; acceptance is low).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from jspec.errors import UsageError  # noqa: E402


def _args(argv):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--drafter", default=None, help="model:PATH (a draft-model dir) or cut:N (spec and pearl rows)")
    ap.add_argument("--exit-head", default=None, help="exit-head dir or `cut` (ppsd rows)")
    ap.add_argument("--exit-layer", type=int, default=0, help="0: the exit head's own, else L // 2")
    ap.add_argument("--ee-k", type=int, default=4, help="draft length of the spec_ee rows (default 4)")
    ap.add_argument("--branches", type=int, default=3, help="SpecBranch heads a window (default 3)")
    ap.add_argument("--cut", default=None, help="SpecBranch cut: none | confidence | hrad (default: hrad with --hrad, else confidence)")
    ap.add_argument("--threshold", type=float, default=0.3, help="SpecBranch confidence cut (default 0.3)")
    ap.add_argument("--hrad", default=None, help="H-RAD weights directory (scripts/train_hrad.py OUT/hrad)")
    ap.add_argument("--out", required=True)
    ap.add_argument("--methods", default="ar,spec,pearl",
                    help="of ar, spec, pearl (2 devices), pearl1 (1 device), specbranch, specbranch1, ppsd (2 devices), "
                         "ppsd1 (1 device), spec_ee")
    ap.add_argument("--n-prompts", type=int, default=80)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--gamma", type=int, default=0, help="0: measure")
    ap.add_argument("--time-budget-s", type=float, default=240.0)
    ap.add_argument("--fp32-prompts", type=int, default=4)
    ap.add_argument("--fp32-max-new-tokens", type=int, default=48)
    ap.add_argument("--kernels", default=None, help="JSPEC_KERNELS for every method (default: pallas on GPU)")
    ap.add_argument("--prompts-file", default=None, help="JSON list of token-id lists instead of MT-Bench (tests)")
    return ap.parse_args(argv)


def main(argv=None):
    args = _args(argv)
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    known = ("ar", "spec", "pearl", "pearl1", "specbranch", "specbranch1", "ppsd", "ppsd1", "spec_ee")
    bad = [m for m in methods if m not in known]
    if bad:
        raise UsageError(f"unknown methods {bad}; choose from {', '.join(known)}")
    cut = args.cut or ("hrad" if args.hrad else "confidence")
    if (cut == "hrad") != (args.hrad is not None):
        raise UsageError("--cut hrad and --hrad DIR go together")
    if args.drafter is None and {"spec", "pearl", "pearl1", "specbranch", "specbranch1"} & set(methods):
        raise UsageError("--drafter is needed for the spec and pearl rows")
    if args.exit_head is None and {"ppsd", "ppsd1", "spec_ee"} & set(methods):
        raise UsageError("--exit-head is needed for the ppsd rows (an exit-head dir, or `cut`)")
    import jax

    if args.kernels or jax.default_backend() == "gpu":
        os.environ["JSPEC_KERNELS"] = args.kernels or "pallas"
    import jax.numpy as jnp
    import numpy as np

    from jspec import model as M
    from jspec.cards import card_name
    from jspec.decode import bucket, plan_cache_len
    from jspec.decode import generate_ar_jit
    from jspec.speculative.engines.chain import speculative_generate
    from jspec.heads import draft_model as DM
    from jspec.presets import resolve_model
    from jspec.sampling import GREEDY
    from jspec.speculative.drafters.model import ModelDrafter
    from jspec.speculative.engines.pearl import measure_gamma, pearl_generate, pearl_mesh, place_on_mesh
    from jspec.speculative.factory import build_drafter
    from jspec.checkpoint.draft_format import exit_layer_of, load_draft_model
    from jspec.heads import exit_head as EH
    from jspec.speculative.engines.ppsd import ppsd_generate
    from jspec.speculative.drafters.early_exit import EarlyExitDrafter
    from jspec.speculative.engines.specbranch import SpecBranchConfig, specbranch_generate
    from jspec.heads.hrad import load_hrad

    t_start = time.perf_counter()
    deadline = t_start + args.time_budget_s
    os.makedirs(args.out, exist_ok=True)
    devices = jax.devices()
    two = len(devices) >= 2
    if {"pearl", "ppsd", "specbranch"} & set(methods) and not two:
        print("one device only: the two-device PEARL / SpecBranch / PPSD rows are skipped")
        methods = [m for m in methods if m not in ("pearl", "ppsd", "specbranch")]

    tcfg, tparams32, tok = resolve_model(args.model, dtype="float32", tokenizer=args.prompts_file is None)
    if args.prompts_file:
        with open(args.prompts_file) as fh:
            prompts = json.load(fh)[: args.n_prompts]
    else:
        from jspec.bench.prompts import encode_questions
        from jspec.presets import list_presets, load_preset
        from jspec.tasks import load_task

        chat = load_preset(args.model).chat if args.model in list_presets() else None
        prompts = encode_questions(tok, load_task("mt_bench")[: args.n_prompts], chat=chat)

    exit_layer = args.exit_layer or ((exit_layer_of(args.exit_head) if args.exit_head and args.exit_head != "cut" else None)
                                     or EH.default_exit_layer(tcfg.num_layers))

    def load_exit(tparams, dtype):
        if not args.exit_head:
            return None, None
        if args.exit_head == "cut":
            return EH.init_from_target(tparams, tcfg, exit_layer)
        return load_draft_model(args.exit_head, tcfg, tparams, dtype=dtype)

    def load(dtype):
        tparams = M.cast_params(tparams32, dtype)
        exits[jnp.dtype(dtype).name] = load_exit(tparams, dtype)
        if args.drafter is None:
            return tparams, None, None
        if args.drafter.startswith("cut:"):
            n = int(args.drafter[4:])
            dcfg, dparams = DM.init_from_target(tparams, tcfg, DM.default_layers_from(tcfg.num_layers, n))
            return tparams, ModelDrafter(dcfg), dparams
        drafter, dparams = build_drafter(args.drafter, tcfg, tparams, dtype=dtype)
        return tparams, drafter, dparams

    dtype = jnp.float32 if jax.default_backend() == "cpu" else jnp.bfloat16
    exits: dict = {}  # dtype name -> (exit cfg, exit params)
    tparams, drafter, dparams = load(dtype)
    dcfg = drafter.cfg if drafter is not None else None
    mesh = pearl_mesh(devices[:2]) if two else None
    W = bucket(max(len(p) for p in prompts))

    def pack(p, max_new, extra):
        cache_len = plan_cache_len(W, max_new, extra)
        tokens = np.full((1, W), tcfg.pad_token_id, np.int32)
        tokens[0, : len(p)] = p
        return tokens, np.asarray([len(p)], np.int32), cache_len

    gamma_info = {}
    if args.gamma or drafter is None:
        gamma = args.gamma or 1
    else:
        gamma, gamma_info = measure_gamma(tparams, tcfg, dparams, dcfg, batch=1, cache_len=plan_cache_len(W, args.max_new_tokens, 64),
                                          devices=devices[:2] if two else devices[:1])
    print(f"gamma {gamma} {gamma_info}", flush=True)
    extra = max(2 * gamma + 2, args.ee_k + 1)
    sb_cfg = SpecBranchConfig(branches=args.branches, gamma=gamma, cut=cut, threshold=args.threshold)
    hrads = {}  # dtype name -> H-RAD weights (float32; the engine casts)
    if args.hrad:
        hrads = {name: load_hrad(args.hrad, tcfg) for name in ("float32", "bfloat16", "float16")}

    def run(method, tparams, dparams, p, max_new):
        """(tokens list, target calls, drafted, accepted, rolled back, branch saves, seconds)."""
        tokens, lens, cache_len = pack(p, max_new, extra)
        key = jax.random.PRNGKey(0)
        t0 = time.perf_counter()
        # Every method gets the same padded prompt width W and cache length: one compile each.
        if method == "ar":
            out, n_out, steps = jax.device_get(generate_ar_jit(
                tparams, tcfg, jnp.asarray(tokens), jnp.asarray(lens), key, max_new=max_new, cache_len=cache_len,
                sampling=GREEDY))
            toks = np.asarray(out)[0, : int(n_out[0])].tolist()
            return toks, int(steps[0]), 0, 0, 0, 0, time.perf_counter() - t0
        elif method == "spec":
            r = speculative_generate(tparams, tcfg, tokens, lens, key, drafter=drafter, drafter_params=dparams,
                                     policy="static", policy_params=None, k_max=gamma, max_new=max_new,
                                     cache_len=cache_len, sampling=GREEDY, verify="lossless", unroll=None)
        elif method == "spec_ee":
            ecfg, eparams = exits[jnp.dtype(tparams["embed"].dtype).name]
            r = speculative_generate(tparams, tcfg, tokens, lens, key, drafter=EarlyExitDrafter(exit_layer, head=ecfg),
                                     drafter_params=eparams, policy="static", policy_params=None, k_max=args.ee_k,
                                     max_new=max_new, cache_len=cache_len, sampling=GREEDY, verify="lossless", unroll=None)
        elif method.startswith("specbranch"):
            if method == "specbranch":
                tparams, dparams = placed[id(tparams)]
            hp = hrads.get(jnp.dtype(tparams["embed"].dtype).name)
            r = specbranch_generate(tparams, tcfg, dparams, dcfg, tokens, lens, key, sb=sb_cfg, max_new=max_new,
                                    cache_len=cache_len, sampling=GREEDY, hrad_params=hp,
                                    mesh=mesh if method == "specbranch" else None, kernels=kernels_of.get(method))
        elif method.startswith("ppsd"):
            ecfg, eparams = exits[jnp.dtype(tparams["embed"].dtype).name]
            if method == "ppsd":
                tparams, eparams = placed_exit[id(tparams)]
            r = ppsd_generate(tparams, tcfg, eparams, ecfg, exit_layer, tokens, lens, key, max_new=max_new,
                              cache_len=cache_len, sampling=GREEDY, mesh=mesh if method == "ppsd" else None,
                              kernels=kernels_of.get(method))
        else:
            if method == "pearl":
                tparams, dparams = placed[id(tparams)]
            r = pearl_generate(tparams, tcfg, dparams, dcfg, tokens, lens, key, gamma=gamma, max_new=max_new,
                               cache_len=cache_len, sampling=GREEDY, mesh=mesh if method == "pearl" else None,
                               kernels=kernels_of.get(method))
        dt = time.perf_counter() - t0
        rolled = int(r.rolled_back[0]) if getattr(r, "rolled_back", None) is not None else 0
        saves = int(r.branch_saves[0]) if getattr(r, "branch_saves", None) is not None else 0
        return r.row(0), int(r.target_calls[0]), int(r.drafted[0]), int(r.accepted[0]), rolled, saves, dt

    placed_exit = {}  # the same for the target and the exit head (PPSD)
    placed = {}  # id(target params) -> both models replicated on the PEARL mesh, placed once
    kernels_of: dict[str, str] = {}  # PEARL falls back to the portable kernels if the fused ones fail

    def table(dt_name, tparams, dparams, prompt_list, max_new, budget_end):
        if mesh is not None and {"pearl", "specbranch"} & set(methods):
            placed[id(tparams)] = place_on_mesh(mesh, tparams, dparams)
        if mesh is not None and "ppsd" in methods:
            placed_exit[id(tparams)] = place_on_mesh(mesh, tparams, exits[jnp.dtype(tparams["embed"].dtype).name][1])
        acc = {m: {"tokens": 0, "time_s": 0.0, "calls": 0, "drafted": 0, "accepted": 0, "rolled": 0, "saves": 0, "same": 0,
                   "prompts": 0, "error": None} for m in methods}
        outs = {}
        for m in methods:  # warm-up / compile on the first prompt, untimed
            try:
                run(m, tparams, dparams, prompt_list[0], max_new)
            except Exception as e:  # noqa: BLE001 - reported in the row
                traceback.print_exc()
                acc[m]["error"] = f"{type(e).__name__}: {e}"[:500]
                if m.startswith(("pearl", "ppsd", "specbranch")) and kernels_of.get(m) != "xla":
                    kernels_of[m] = "xla"
                    try:
                        run(m, tparams, dparams, prompt_list[0], max_new)
                        acc[m]["error"] = None
                        print(f"{m}: fell back to kernels=xla", flush=True)
                    except Exception as e2:  # noqa: BLE001
                        acc[m]["error"] += f" | xla: {type(e2).__name__}: {e2}"[:300]
        for i, p in enumerate(prompt_list):
            if time.perf_counter() > budget_end:
                break
            for m in methods:
                if acc[m]["error"]:
                    continue
                toks, calls, drafted, accepted, rolled, saves, dt = run(m, tparams, dparams, p, max_new)
                acc[m]["saves"] += saves
                a = acc[m]
                a["tokens"] += len(toks); a["time_s"] += dt; a["calls"] += calls; a["drafted"] += drafted
                a["accepted"] += accepted; a["rolled"] += rolled; a["prompts"] += 1
                outs[(m, i)] = toks
                a["same"] += int(toks == outs.get(("ar", i), toks))
            print(f"[{dt_name}] prompt {i + 1}/{len(prompt_list)} " + " ".join(
                f"{m} {acc[m]['tokens'] / max(acc[m]['time_s'], 1e-9):.0f} tok/s" for m in methods if not acc[m]["error"]), flush=True)
        rows = []
        base = {m: acc[m]["time_s"] / max(acc[m]["tokens"], 1) for m in methods}  # s per token
        for m in methods:
            a = acc[m]
            spt = base[m]
            rows.append({
                "method": m.rstrip("1"), "variant": m,
                "devices": 2 if m in ("pearl", "ppsd", "specbranch") else 1, "dtype": dt_name,
                "kernels": kernels_of.get(m) or os.environ.get("JSPEC_KERNELS", "default"),
                "device": card_name(), "prompts": a["prompts"], "tokens": a["tokens"],
                "time_s": a["time_s"], "tok_per_s": a["tokens"] / max(a["time_s"], 1e-9),
                "speedup_vs_ar": (base["ar"] / spt) if "ar" in base and a["tokens"] else None,
                # PPSD's own drafter is the exit head, not the draft model of the spec row
                "speedup_vs_spec": ((base["spec_ee"] / spt) if "spec_ee" in base and a["tokens"] else None)
                if m.startswith("ppsd") else ((base["spec"] / spt) if "spec" in base and a["tokens"] else None),
                "mean_accepted_tokens": a["tokens"] / max(a["calls"], 1),
                "acceptance": a["accepted"] / max(a["drafted"], 1) if m != "ar" else None,
                "rollback_rate": a["rolled"] / max(a["drafted"], 1) if m.startswith(("pearl", "ppsd", "specbranch")) else None,
                "gamma": gamma if m in ("spec", "pearl", "pearl1", "specbranch", "specbranch1") else None,
                "branches": args.branches if m.startswith("specbranch") else None,
                "cut": cut if m.startswith("specbranch") else None,
                "branch_saves": a["saves"] if m.startswith("specbranch") else None,
                "k_max": gamma if m == "spec" else (args.ee_k if m == "spec_ee" else None),
                "exit_layer": exit_layer if m.startswith("ppsd") or m == "spec_ee" else None,
                "greedy_identity": a["same"] / max(a["prompts"], 1) if "ar" in methods else None,
                "max_new_tokens": max_new, "batch": 1, "error": a["error"],
            })
        return rows

    rows = []
    fp32_reserve = 90.0 if args.fp32_prompts and dtype != jnp.float32 else 0.0
    rows += table(jnp.dtype(dtype).name, tparams, dparams, prompts, args.max_new_tokens, deadline - fp32_reserve)
    if args.fp32_prompts and dtype != jnp.float32 and time.perf_counter() < deadline:
        t32, _, d32 = load(jnp.float32)
        # true float32 matmuls (GPUs default to TF32 for float32), as the identity check needs
        with jax.default_matmul_precision("highest"):
            rows += table("float32", t32, d32, prompts[: args.fp32_prompts], args.fp32_max_new_tokens, deadline)
    meta = {"model": args.model, "drafter": args.drafter, "exit_head": args.exit_head, "exit_layer": exit_layer,
            "gamma": gamma, "gamma_timing": gamma_info,
            "devices": [str(d) for d in devices], "wall_s": time.perf_counter() - t_start}
    with open(os.path.join(args.out, "parallel_rows.json"), "w") as fh:
        json.dump({"meta": meta, "rows": rows}, fh, indent=1)
    for r in rows:
        print(json.dumps({k: r[k] for k in ("variant", "dtype", "devices", "prompts", "tok_per_s", "speedup_vs_ar",
                                            "speedup_vs_spec", "mean_accepted_tokens", "rollback_rate", "greedy_identity", "error")}))


if __name__ == "__main__":
    from jspec.cli import report_user_errors

    raise SystemExit(report_user_errors(main, "bench_pearl.py"))
