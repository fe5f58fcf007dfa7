"""`jspec calibrate`: fit draft-length policies' constants to an EAGLE head or a draft model on this card.

    jspec calibrate --drafter eagle3 --policy svip,adaedl,confidence,tapout,ldlp
    jspec calibrate --model qwen2.5-coder-1.5b-instruct --drafter model --k-max 8

records rounds of a static K = --k-max chain on training-side prompts (chitchat's training split,
`jspec.tasks.training_prompts`; never an evaluation set), replays them through each policy's rules
over a grid of its constants, keeps the constants with the most tokens per µs at --batch on this
card (the draft step and the rest of a round timed here on static chains, the verify sizes from
the card's cost table; `--round-cost table` for the table alone), and writes them to the user
cache ($JSPEC_CACHE/calibration/<head fingerprint>.json, one entry per card; `--out-dir HEAD` for
the file a head ships, <HEAD>/jspec/calibration.json), where a policy spec without a suffix finds
them (`svip`; `svip:paper` keeps the paper's). A draft model's fits hold for one target, so they
are kept per target: <fingerprint>-<target>.json in the cache, calibration-<target>.json in the
draft model's folder (its preset's folder for `--drafter model` on a preset that names one). The method is in
jspec.speculative.policies.calibration.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import numpy as np

from jspec import presets
from jspec.bench.cli import preset_name
from jspec.bench.prompts import encode_questions
from jspec.bench.round_cost import ensure_costs
from jspec.speculative.policies.auto import load_costs
from jspec.cards import card_key
from jspec.compile_cache import add_compile_cache_arg, use_compile_cache
from jspec.errors import UsageError
from jspec.generate import SpeculativeConfig, generate
from jspec.sampling import Sampling
from jspec.speculative.drafters.base import DrafterError
from jspec.speculative.drafters.eagle import EagleDrafter
from jspec.speculative.drafters.model import ModelDrafter
from jspec.speculative.factory import (build_drafter, calibration_home, check_drafter_spec, check_shipped_drafter,
                                      find_ldlp_weights)
from jspec.speculative.policies import make_policy
from jspec.speculative.policies.calibration import (CALIBRATED_POLICIES, Records, RecordingPolicy, RoundCost, calibration_path,
                                                    fit_all, head_fingerprint, recorded_acceptance, save_calibration,
                                                    user_calibration_path)
from jspec.speculative.policies.ldlp import load_ldlp
from jspec.tasks import Question, TaskDataError, load_questions_file, training_prompts

STATIC_REFERENCE = 6  # the static chain the bars compare against
TIMED_LENGTHS = 2  # static chains drafting this many and k_max tokens are timed for the round's cost
TIMED_PROMPTS = 16  # prompts each timed program generates for (after one warm-up batch that compiles it)
ROUND_COSTS = ("timed", "table")


def add_calibrate_args(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    p.add_argument("--model", default="smollm2-135m-instruct", help="preset name or checkpoint path")
    p.add_argument("--drafter", default="eagle3", help="an EAGLE head: eagle3[:PATH] or eagle[:PATH], or a draft model: "
                   "model[:PATH] (default: the preset's)")
    p.add_argument("--policy", default=None,
                   help=f"comma list of policies to fit (default: all of {', '.join(CALIBRATED_POLICIES)}; ldlp only "
                        "when the head ships its predictor weights)")
    p.add_argument("--k-max", type=int, default=8, help="the chain's maximum draft length the constants are fit for")
    p.add_argument("--batch", type=int, default=1, help="batch size of the cost model the fit optimises for")
    p.add_argument("--record-batch", type=int, default=16, help="rows per generate call while recording")
    p.add_argument("--n-prompts", type=int, default=None,
                   help="prompts to record rounds on (default: 128 chitchat training prompts, or all of --prompt-file)")
    p.add_argument("--prompt-file", default=None, metavar="JSONL",
                   help="calibrate on your own workload instead of chitchat's training split: questions in the "
                        "format `jspec bench --questions` takes (one JSON object a line with `question_id` and `turns`; "
                        "the first turn is the prompt). Never an evaluation set you report on")
    p.add_argument("--round-cost", choices=ROUND_COSTS, default="timed",
                   help="timed (default): time plain decoding and static chains drafting 2 and --k-max tokens on "
                        "these prompts, and replay on the draft step and round cost they show; table: the card's "
                        "cost table alone (its parts timed one by one)")
    p.add_argument("--temperatures", default="", metavar="T,...",
                   help="also record sampled chains at these temperatures (> 0) and keep the drafter's per-token "
                        "acceptance at each, which `auto` plans sampled calls with (default: none; the fits stay greedy)")
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--seed", type=int, default=0, help="which training prompts")
    p.add_argument("--out-dir", default=None, metavar="HEAD_DIR",
                   help="write HEAD_DIR/jspec/calibration.json, the fits a head directory ships (a draft model's: "
                        "calibration-<target>.json), instead of the user cache ($JSPEC_CACHE or ~/.cache/jspec, "
                        "calibration/<fingerprint>.json), where policies using this drafter find them")
    p.add_argument("--models-dir", default=None, help="the repository's models/ folder, whose committed cost tables are "
                   "read (default: jspec's own)")
    add_compile_cache_arg(p)
    return p


def check_calibrate_args(a) -> list[str]:
    """Every check that needs no model; returns the policy names."""
    for flag, value in (("--k-max", a.k_max), ("--batch", a.batch), ("--record-batch", a.record_batch),
                        ("--n-prompts", a.n_prompts), ("--max-new-tokens", a.max_new_tokens)):
        if value is not None and value < 1:
            raise UsageError(f"{flag} must be >= 1, got {value}")
    if a.k_max < 2:
        raise UsageError(f"--k-max {a.k_max}: a policy can only choose a draft length when k_max >= 2")
    sampling_temperatures(a.temperatures)
    if check_drafter_spec(a.drafter) not in (EagleDrafter, ModelDrafter):
        raise UsageError(f"--drafter {a.drafter!r}: calibration fits policies to an EAGLE head (eagle3[:PATH], eagle[:PATH]) "
                         "or a draft model (model[:PATH])")
    if a.policy is not None:
        names = [n.strip() for n in a.policy.split(",") if n.strip()]
        bad = [n for n in names if n not in CALIBRATED_POLICIES]
        if not names or bad:
            raise UsageError(f"--policy {a.policy!r}: calibrate fits {', '.join(CALIBRATED_POLICIES)}")
    check_shipped_drafter(a.drafter, a.model)  # the flags passed: the drafter the model ships, if named bare
    return default_policies(a.drafter, a.model) if a.policy is None else names


def sampling_temperatures(text: str) -> list[float]:
    """--temperatures as floats, each > 0 (UsageError naming the bad one)."""
    out = []
    for part in (x.strip() for x in (text or "").split(",")):
        if not part:
            continue
        try:
            t = float(part)
        except ValueError:
            t = float("nan")
        if not t > 0:
            raise UsageError(f"--temperatures: {part!r} is not a temperature above 0 (greedy rounds are always recorded)")
        out.append(t)
    return out


def default_policies(drafter: str, model: str) -> list[str]:
    """Every calibrated policy, ldlp only where the head ships predictor weights: a freshly trained
    head has none until `jspec train-ldlp` runs, and its other fits should not wait for that (a
    draft model has none: LDLP reads an EAGLE head's features)."""
    try:
        find_ldlp_weights(drafter, model)
        return list(CALIBRATED_POLICIES)
    except DrafterError:
        what = "a draft model" if check_drafter_spec(drafter) is ModelDrafter else "this head"
        print(f"calibrate: {what} has no LDLP predictor (jspec train-ldlp writes one for an EAGLE head), so ldlp is not fit")
        return [n for n in CALIBRATED_POLICIES if n != "ldlp"]


def calibration_prompts(a) -> tuple[list[str], str]:
    """The prompt texts to record rounds on and a note saying where they came from: --prompt-file's
    first turns (all of them, or the first --n-prompts), else chitchat's training split."""
    if a.prompt_file is None:
        n = a.n_prompts or 128
        return training_prompts(n, seed=a.seed), f"chitchat training split (jspec.tasks.training_prompts): {n} prompts, seed {a.seed}"
    try:
        questions = load_questions_file(a.prompt_file)
    except TaskDataError as e:
        raise UsageError(f"--prompt-file: {e}") from None
    n = a.n_prompts or len(questions)
    if not questions or n > len(questions):
        raise UsageError(f"--n-prompts {n}: {a.prompt_file} holds {len(questions)} questions")
    return [q.turns[0] for q in questions[:n]], f"{Path(a.prompt_file).name}: the first {n} of {len(questions)} questions"


def calibration_file(out_dir: str | None, head: Path, target: str | None = None) -> Path:
    """Where the fits go: --out-dir's jspec/calibration.json (a draft model's: calibration-<target>.json),
    else the user cache's file for this drafter (never the shipped file beside a repository's head
    unless --out-dir names that head). Raises UsageError for a drafter whose weights cannot be
    fingerprinted without --out-dir."""
    path = calibration_path(out_dir, target) if out_dir else user_calibration_path(head, target)
    if path is None:
        raise UsageError(f"--drafter: the weights at {head} cannot be fingerprinted for the user cache (no *.safetensors, "
                         "*.bin or preset.json there): pass --out-dir DIR to write the fits there")
    return path


def record_rounds(params, cfg, drafter, dparams, prompts: list[list[int]], *, k_max: int, batch: int, max_new: int,
                  ldlp_params=None, log=None, sampling: Sampling | None = None) -> Records:
    """Generate with `RecordingPolicy` (a static chain of k_max) and collect the recorded rounds;
    `log`: a progress line per batch, or None; `sampling`: sampled chains (None: greedy)."""
    spec = SpeculativeConfig(drafter=drafter, drafter_params=dparams, k_max=k_max,
                             policy=RecordingPolicy(k_max=k_max, max_rounds=max_new), policy_params=ldlp_params)
    parts = []
    for i in range(0, len(prompts), batch):
        res = generate(params, cfg, prompts[i : i + batch], max_new_tokens=max_new, speculative=spec, sampling=sampling,
                       seed=i)
        parts.append(Records.from_state(res.policy_state))
        if log is not None:
            log(f"calibrate:   recorded {min(i + batch, len(prompts))}/{len(prompts)} prompts")
    return Records.concat(parts)


def time_rounds(params, cfg, drafter, dparams, prompts: list[list[int]], *, k_max: int, batch: int,
                max_new: int, log=None) -> tuple[dict[int, float], float]:
    """µs a round of static chains drafting TIMED_LENGTHS and k_max tokens of a k_max block, and µs a
    token of plain decoding, each program compiled on the first `batch` prompts and then timed over
    the next TIMED_PROMPTS (all of them when there are fewer). A round's time is its generate call's
    wall time over its rounds (the prefill counts as one, as in `rounds`). `log`: a progress line
    per program timed, or None."""
    warm, timed = prompts[:batch], prompts[batch : batch + TIMED_PROMPTS] or prompts[:batch]

    def per_round(spec) -> float:
        generate(params, cfg, warm, max_new_tokens=max_new, speculative=spec)  # compiles
        seconds, rounds = 0.0, 0
        for i in range(0, len(timed), batch):
            t0 = time.perf_counter()
            res = generate(params, cfg, timed[i : i + batch], max_new_tokens=max_new, speculative=spec)
            seconds += time.perf_counter() - t0
            rounds += int(np.max(res.rounds))
        us = 1e6 * seconds / max(rounds, 1)
        if log is not None:
            log(f"calibrate:   {'plain decoding' if spec is None else f'static chain drafting {spec.policy.k}'}: "
                f"{us:.0f} µs a {'token' if spec is None else 'round'}")
        return us

    chains = {L: per_round(SpeculativeConfig(drafter=drafter, drafter_params=dparams, k_max=k_max,
                                             policy=make_policy("static", k=L)))
              for L in sorted({min(TIMED_LENGTHS, k_max - 1), k_max})}  # two lengths even at k_max 2
    return chains, per_round(None)


def round_cost(costs: dict, batch: int, k_max: int, timed: tuple[dict[int, float], float] | None,
               drafter_key: str | None = None, step_fraction: float | None = None) -> tuple[RoundCost, dict]:
    """The replay's RoundCost and what the entry records of it: timed on this card when `timed`
    (time_rounds) gives a positive draft step, else the cost table's (the drafter's own draft
    costs: its `cost_key`; a draft model the table has not measured: `step_fraction` of the AR step)."""
    table = RoundCost.from_table(costs, batch, k_max, drafter_key, step_fraction)
    note = {"source": f"cost table {costs.get('card', 'reference')}", "table_step_us": table.step_us}
    if timed is not None and costs.get("card") != card_key():  # another card's table: its shape, this card's scale
        table = table.scaled(timed[1] / table.ar_us)
        note["source"] += " scaled to the AR step timed here"
    if timed is not None:
        chains, ar_us = timed
        try:
            cost = RoundCost.timed(table, k_max, chains, ar_us)
            return cost, {**note, "source": "timed here (static chains and plain decoding)", "step_us": cost.step_us,
                          "fixed_us": cost.fixed_us, "chain_round_us": {str(k): v for k, v in chains.items()},
                          "ar_us": ar_us}
        except ValueError as e:
            note["source"] += f" ({e}: timing too noisy, the table replays)"
    return table, {**note, "step_us": table.step_us, "fixed_us": table.fixed_us}


def calibration_costs(a, params, cfg, drafter, dparams) -> dict:
    """The cost table the replay reads. --round-cost table: this card's, measured now when none is
    committed or cached (announced: minutes on a CPU, then cached). timed: this card's when one is
    there, else the reference card's, scaled to the AR step timed here: with timed rounds the
    table gives only the verify shape of the static K < --k-max baselines (a fit at --k-max
    verifies the timed block), not worth measuring a whole table for."""
    models_dir = a.models_dir or str(presets.models_dir())
    if a.round_cost == "table":
        return ensure_costs(params, cfg, drafter, dparams, batch=a.batch, preset=preset_name(a.model), models_dir=models_dir)
    return load_costs(preset_name(a.model), models_dir)


def calibrate(params, cfg, drafter, dparams, prompts, names, *, costs: dict, k_max: int, batch: int, record_batch: int,
              max_new: int, ldlp_params=None, timed: tuple[dict[int, float], float] | None = None, log=None,
              temperatures: tuple[float, ...] = ()) -> dict:
    """Record, then fit every named policy: the calibration entry of one card (save_calibration).
    `temperatures`: sampled chains recorded as well, for the per-token acceptance at each."""
    records = record_rounds(params, cfg, drafter, dparams, prompts, k_max=k_max, batch=record_batch, max_new=max_new,
                            ldlp_params=ldlp_params, log=log)
    acceptance = {"alpha": round(recorded_acceptance(records), 4), "temperature": 0.0}
    for t in temperatures:
        sampled = record_rounds(params, cfg, drafter, dparams, prompts, k_max=k_max, batch=record_batch, max_new=max_new,
                                ldlp_params=ldlp_params, log=log, sampling=Sampling(temperature=t))
        acceptance.setdefault("by_temperature", {})[f"{t:g}"] = round(recorded_acceptance(sampled), 4)
    cost, cost_note = round_cost(costs, batch, k_max, timed, getattr(drafter, "cost_key", None),
                                 getattr(drafter, "step_fraction", None))
    fits = fit_all(names, records, k_max, cost)
    return {"k_max": k_max, "batch": batch, "rounds": records.n_rounds, "max_new_tokens": max_new,
            "cost_table": costs.get("card", "reference"), "round_cost": cost_note,
            "acceptance": acceptance, **fits}


def report_lines(entry: dict) -> list[str]:
    """One line per policy: its constants (paper -> calibrated) and the replayed rates."""
    static = entry["static"].get(str(STATIC_REFERENCE))
    lines = [f"{entry['rounds']} rounds recorded at K = {entry['k_max']}; costs at batch {entry['batch']} (verify shape: the {entry['cost_table']} table)"]
    if entry.get("acceptance"):
        sampled = "".join(f", {a:.3f} at T = {t}" for t, a in entry["acceptance"].get("by_temperature", {}).items())
        lines.append(f"  per-token acceptance (what `auto` plans with): {entry['acceptance']['alpha']:.3f} greedy{sampled}")
    rc = entry.get("round_cost")
    if rc:
        lines.append(f"  round cost: {rc['source']}: draft step {rc['step_us']:.0f} µs (the table's {rc['table_step_us']:.0f}), "
                     f"the rest of a round {rc['fixed_us']:.0f} µs besides the verify")
    for k, s in sorted(entry["static"].items(), key=lambda kv: int(kv[0])):
        lines.append(f"  static K={k}: {s['tokens_per_round']:.2f} tokens/round, {s['speedup_vs_ar']:.2f}x AR")
    oracle = entry.get("oracle")
    if oracle:
        vs = f", {oracle['speedup_vs_ar'] / static['speedup_vs_ar']:.3f}x static K={STATIC_REFERENCE}" if static else ""
        lines.append(f"  oracle stop (drafts exactly what is accepted): drafted {oracle['drafted_per_round']:.2f}, "
                     f"{oracle['speedup_vs_ar']:.2f}x AR{vs}: the ceiling of any stop rule here")
    for name, fit in entry["policies"].items():
        for which in ("paper", "calibrated"):
            s = fit[which]
            vs = f", {s['speedup_vs_ar'] / static['speedup_vs_ar']:.3f}x static K={STATIC_REFERENCE}" if static else ""
            lines.append(f"  {name} {which:10s}: drafted {s['drafted_per_round']:.2f}, {s['tokens_per_round']:.2f} tokens/round, "
                         f"{s['round_us']:.0f} µs/round, {s['speedup_vs_ar']:.2f}x AR{vs}")
        lines.append(f"  {name} constants: {fit['constants']}")
    return lines


def progress(line: str) -> None:
    print(line, flush=True)


def run_calibrate(a) -> int:
    names = check_calibrate_args(a)
    use_compile_cache(a.compile_cache)
    texts, source = calibration_prompts(a)  # before the model loads: a bad file or count fails fast
    head, target = calibration_home(a.drafter, a.model)
    out_file = calibration_file(a.out_dir, head, target) if head is not None else None  # an unusable one fails fast
    cfg, params, tokenizer = presets.resolve_model(a.model)
    drafter, dparams = build_drafter(a.drafter, cfg, params, model_name=a.model)  # no head or draft model (head None): its error
    ldlp_params = load_ldlp(str(find_ldlp_weights(a.drafter, a.model)))[0] if "ldlp" in names else None
    prompts = encode_questions(tokenizer, [Question(i, "train", [t]) for i, t in enumerate(texts)])
    timed = None
    if a.round_cost == "timed":
        print(f"calibrate: timing plain decoding and static chains drafting {min(TIMED_LENGTHS, a.k_max - 1)} and "
              f"{a.k_max} tokens on {min(len(prompts), a.batch + TIMED_PROMPTS)} prompts (the round cost the fit replays)")
        timed = time_rounds(params, cfg, drafter, dparams, prompts, k_max=a.k_max, batch=a.batch, max_new=a.max_new_tokens,
                            log=progress)
    costs = calibration_costs(a, params, cfg, drafter, dparams)
    print(f"calibrate: recording static K = {a.k_max} chains on {len(prompts)} prompts, then fitting {', '.join(names)}")
    entry = calibrate(params, cfg, drafter, dparams, prompts, names, costs=costs, k_max=a.k_max, batch=a.batch,
                      record_batch=a.record_batch, max_new=a.max_new_tokens, ldlp_params=ldlp_params, timed=timed,
                      log=progress, temperatures=tuple(sampling_temperatures(a.temperatures)))
    entry["prompts"] = source
    fingerprint = head_fingerprint(head)  # the weights recorded, whichever file is written
    for fit in entry["policies"].values():
        fit["head"] = fingerprint
    if target is not None:
        entry["target"] = target
    path = save_calibration(out_file, card_key(), entry)
    print("\n".join(report_lines(entry)))
    print(f"calibration: {path}")
    print("(replayed rounds, not timed runs of the fitted rules: time them on your own prompts with `jspec bench "
          "--tasks '' --questions FILE`; with the cost table's parts, MT-Bench's timed gains ran 5-15% below the "
          "replayed ones)")
    return 0
