"""`jspec train-head`: self-distil data with the target, train an EAGLE head, export it.

    jspec train-head --target smollm2-135m --recipe training/smollm2-eagle3.json [--resume]

Meant for GPUs: on a host with only a CPU it trains on a dataset given with --data, and distils
one (hours there) only with --allow-cpu-distill.

Run directory (--out; default <user cache>/runs/<recipe>-<target>/, the user cache being
$JSPEC_CACHE or ~/.cache/jspec):
    recipe.json        the resolved recipe (after command-line overrides)
    data/              the distilled dataset (jspec.train.data format), built when missing
    checkpoints/       Orbax checkpoints (params, optimizer state, step = data position, RNG)
    metrics.jsonl      interval metrics (loss, per-TTT-step loss / top-1 accuracy, tokens/s)
    eagle/             the trained head in the EAGLE layout (config.json + model.safetensors)

Multi-host: launch one process per host with JAX_COORDINATOR_ADDRESS / JAX_NUM_PROCESSES /
JAX_PROCESS_ID set (or JSPEC_DISTRIBUTED=1 under SLURM / MPI / TPU); distil the data first with
one process (--distill-only), then every host streams its own shards.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import time
from pathlib import Path

from ..compile_cache import add_compile_cache_arg, use_compile_cache
from ..errors import UsageError
from ..user_cache import user_cache_dir

_T0 = time.perf_counter()  # the time budget counts from when the command started


def add_train_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser.add_argument("--target", required=True, help="target model preset or path (jspec.presets.resolve_model)")
    parser.add_argument("--recipe", required=True, help="recipe JSON, e.g. training/smollm2-eagle3.json")
    parser.add_argument("--out", default=None, help="run directory (default <user cache>/runs/<recipe>-<target>, the user "
                        "cache being $JSPEC_CACHE or ~/.cache/jspec)")
    parser.add_argument("--data", default=None, help="distilled dataset directory (default OUT/data, built there "
                        "if missing; a named one must exist unless --distill-only builds it)")
    parser.add_argument("--resume", action="store_true", help="continue from the latest checkpoint in OUT")
    parser.add_argument("--distill-only", action="store_true", help="build the dataset and stop")
    parser.add_argument("--allow-cpu-distill", action="store_true",
                        help="distil the recipe's prompts even on a host without a GPU (hours there; train-head is meant "
                             "for GPUs: distil with `jspec distill` on one and pass --data)")
    parser.add_argument("--export", default=None, help="EAGLE-format output directory (default OUT/eagle)")
    parser.add_argument("--init-head", default=None, metavar="DIR",
                        help="start from this exported head (its draft vocabulary and LM head kept), e.g. the "
                             "preset's shipped head, so training continues across sessions")
    parser.add_argument("--no-progress", action="store_true")
    add_compile_cache_arg(parser)
    over = parser.add_argument_group("recipe overrides")
    over.add_argument("--steps", type=int)
    over.add_argument("--batch-size", type=int)
    over.add_argument("--seq-len", type=int)
    over.add_argument("--lr", type=float)
    over.add_argument("--seed", type=int)
    over.add_argument("--num-prompts", type=int)
    over.add_argument("--fsdp", type=int)
    over.add_argument("--ckpt-every", type=int)
    over.add_argument("--log-every", type=int)
    over.add_argument("--stop-at", type=int, help="stop after this step as if killed (resume testing)")
    over.add_argument("--warmup-ratio", type=float)
    over.add_argument("--ckpt-every-s", type=float, help="also checkpoint every this many seconds")
    budget = parser.add_argument_group("time budget")
    budget.add_argument("--time-budget-s", type=float, default=None,
                        help="this process stops cleanly (checkpoint, no export) before this many seconds; "
                             "--resume continues")
    budget.add_argument("--export-when-stopped", action="store_true",
                        help="a run that stops before its last step (time budget, --stop-at) still exports its "
                             "head, to OUT/eagle-step<N> (the schedule has not ended: an intermediate head)")
    budget.add_argument("--fit-steps-to-budget", action="store_true",
                        help="on a fresh run, set the total steps (and the schedule's end) to what fits the "
                             "budget after measuring the step time (at most the recipe's steps); when "
                             "evaluations and checkpoints then cost more than the fit counted, the run is "
                             "shortened as it goes, so it still ends, and exports, within the budget")
    return parser


def _apply_overrides(recipe, args):
    from .config import Recipe

    pick = lambda **kw: {k: v for k, v in kw.items() if v is not None}  # noqa: E731
    buckets = None
    if args.seq_len is not None and recipe.train.length_buckets:  # the recipe's buckets, cut to end at --seq-len
        buckets = tuple(b for b in recipe.train.length_buckets if b < args.seq_len) + (args.seq_len,)
    train = dataclasses.replace(recipe.train, **pick(
        steps=args.steps, batch_size=args.batch_size, seq_len=args.seq_len, lr=args.lr, seed=args.seed,
        warmup_ratio=getattr(args, "warmup_ratio", None), length_buckets=buckets))
    data = dataclasses.replace(recipe.data, **pick(num_prompts=args.num_prompts))
    run = dataclasses.replace(recipe.run, **pick(fsdp=args.fsdp, ckpt_every=args.ckpt_every, log_every=args.log_every,
                                                 ckpt_every_s=getattr(args, "ckpt_every_s", None)))
    return Recipe(head=recipe.head, data=data, train=train, run=run, description=recipe.description)


def _head_config(recipe, target_cfg):
    from ..heads.eagle import HeadConfig, default_capture_layers

    h = recipe.head
    capture = ()
    if h.kind == "eagle3":
        capture = tuple(h.capture_layers) if h.capture_layers else default_capture_layers(target_cfg.num_layers)
    return HeadConfig(h.kind, target_cfg, capture, h.draft_vocab_size if h.kind == "eagle3" else 0, h.intermediate_size,
                      fc_norm=h.fc_norm, norm_output=h.norm_output)


def _has_checkpoint(out: str) -> bool:
    ckpt = os.path.join(out, "checkpoints")
    return os.path.isdir(ckpt) and any(name.isdigit() for name in os.listdir(ckpt))


def _warm_start(head_dir: str, recipe_hcfg, target_cfg):
    """(head config, float32 params) of an exported head, checked against the recipe's head."""
    from ..checkpoint.eagle_format import load_eagle_head

    if not os.path.isfile(os.path.join(head_dir, "config.json")):
        raise UsageError(f"--init-head {head_dir}: no exported head there (config.json + model.safetensors)")
    import jax.numpy as jnp

    hcfg, params = load_eagle_head(head_dir, target_cfg, dtype=jnp.float32)
    fields = ("kind", "capture_layers", "draft_vocab", "mlp_size", "fc_norm", "norm_output")
    want, got = (tuple(getattr(c, f) for f in fields) for c in (recipe_hcfg, hcfg))
    if got != want:
        raise UsageError(f"--init-head {head_dir}: (kind, capture layers, draft vocab, MLP width, fc_norm, norm_output) "
                         f"{got} differ from the recipe's {want}")
    return hcfg, params


def _uses_chat(target: str, tokenizer) -> bool:
    """The preset's `chat` flag (what the benchmarks use), else whether a chat template exists."""
    from .. import presets

    if target in presets.list_presets():
        return presets.load_preset(target).chat
    return bool(getattr(tokenizer, "chat_template", None))


def _is_v2(data_dir: str) -> bool:
    from . import shards

    path = os.path.join(data_dir, shards.META_FILE)
    if not os.path.isfile(path):
        return False
    with open(path) as fh:
        return json.load(fh).get("format") == shards.FORMAT


def _has_dataset(data_dir: str) -> bool:
    from .data import META_FILE

    return os.path.exists(os.path.join(data_dir, META_FILE))


def _ensure_data(data_dir: str, recipe, cfg, params, tokenizer, progress: bool) -> None:
    import jax

    from ..model import cast_params
    from .data import distill_dataset, read_meta

    if _has_dataset(data_dir):
        meta = read_meta(data_dir)
        if "seq_len" not in meta:  # jspec-distill-v2 (jspec distill): rows are packed to the recipe's seq_len
            return
        if meta["seq_len"] != recipe.train.seq_len:
            raise UsageError(f"{data_dir} holds seq_len {meta['seq_len']}, the recipe asks {recipe.train.seq_len}")
        return
    if jax.process_count() > 1:
        raise UsageError(f"{data_dir} has no dataset: distil it first with one process (--distill-only)")
    gen_dtype = jax.numpy.float32 if jax.default_backend() == "cpu" else jax.numpy.bfloat16
    meta = distill_dataset(cast_params(params, gen_dtype), cfg, tokenizer, data_dir,
                           data_cfg=recipe.data, seq_len=recipe.train.seq_len, progress=progress)
    print(f"distilled {sum(s['rows'] for s in meta['shards'])} sequences into {data_dir}")


def run_train(args: argparse.Namespace) -> None:
    """Entry point behind `jspec train-head` (returns None: the CLI's exit status is 0)."""
    result = train_from_args(args)
    if result is not None:
        print(f"trained {result.hcfg.kind} head to step {result.last_step}; last loss "
              f"{result.losses.get(result.last_step, float('nan')):.4f}")


def train_from_args(args: argparse.Namespace):
    """run_train's work; returns the TrainResult (None with --distill-only)."""
    from .step import maybe_initialize_distributed

    maybe_initialize_distributed()  # before any other JAX call
    use_compile_cache(getattr(args, "compile_cache", None))
    import jax

    from ..checkpoint.eagle_format import mib_limit, save_eagle_head
    from ..heads.eagle import MIN_ATTENTION_WINDOW
    from ..presets import resolve_model
    from .config import load_recipe, recipe_to_dict
    from .trainer import train

    recipe = _apply_overrides(load_recipe(args.recipe), args)
    out = run_dir(args)
    data_dir = args.data or os.path.join(out, "data")
    if args.data and not args.distill_only and not _has_dataset(args.data):
        # a named dataset that is not there is a mistake (a distillation that failed or went elsewhere),
        # not a request to distil the recipe's small prompt set and train on that
        raise UsageError(f"--data {args.data}: no dataset there (jspec distill writes one; leave --data out to "
                         f"distil the recipe's {recipe.data.num_prompts} prompts into OUT/data, or add --distill-only)")
    distils = not _has_dataset(data_dir)
    check_device_for(distils, recipe, allow_cpu_distill=getattr(args, "allow_cpu_distill", False))
    if not distils and not args.distill_only:
        check_batches(data_dir, recipe.train)  # before the target's weights load
    print(f"train-head: run directory {out}")
    first_host = jax.process_index() == 0
    progress = not args.no_progress
    v2_data = _is_v2(data_dir)  # distilled by `jspec distill`: no tokenizer needed here
    if v2_data:
        from .shards import check_loop_cut, read_meta

        try:
            check_loop_cut(read_meta(data_dir), recipe.train.loop_cut)
        except ValueError as e:
            raise UsageError(f"{data_dir}: {e}") from None
    cfg, params, tokenizer = resolve_model(args.target, tokenizer=False) if v2_data else resolve_model(args.target)
    if not v2_data and not _uses_chat(args.target, tokenizer):
        recipe = dataclasses.replace(recipe, data=dataclasses.replace(recipe.data, chat_template=False))
    os.makedirs(out, exist_ok=True)
    if first_host:
        with open(os.path.join(out, "recipe.json"), "w") as fh:
            json.dump(recipe_to_dict(recipe), fh, indent=2)
    _ensure_data(data_dir, recipe, cfg, params, tokenizer, progress)
    if args.distill_only:
        return None
    if distils:
        check_batches(data_dir, recipe.train)
    hcfg = _head_config(recipe, cfg)
    init_params = None
    if getattr(args, "init_head", None) and not (args.resume and _has_checkpoint(out)):
        hcfg, init_params = _warm_start(args.init_head, hcfg, cfg)
    budget = getattr(args, "time_budget_s", None)
    deadline = _T0 + budget if budget else None
    if first_host:
        _write_data_report(out, data_dir, recipe.train.seq_len, recipe.train.loop_cut, recipe.train.pack_documents)
    result = train(hcfg, recipe.train, params, data_dir, out, run=recipe.run, resume=args.resume,
                   stop_at=args.stop_at, progress=progress, deadline=deadline,
                   fit_to_deadline=getattr(args, "fit_steps_to_budget", False), lm_head_init=recipe.head.lm_head_init,
                   input_scale=recipe.head.input_scale,
                   head_params=init_params, warm_start=init_params is not None)
    if first_host and hcfg.reduced_vocab:
        _write_vocab_report(out, data_dir, cfg, result.head_params)
    export = export_dir(args, out, result)
    if first_host and export:
        # the head attends at most as far back as it was trained to (HeadConfig.attention_window)
        window = max(recipe.train.seq_len, hcfg.attention_window or 0, MIN_ATTENTION_WINDOW)
        save_eagle_head(export, dataclasses.replace(hcfg, attention_window=window), result.head_params,
                        dtype=recipe.run.export_dtype,
                        acceptance=estimated_acceptance(os.path.join(out, "holdout_metrics.jsonl"),
                                                        recipe.train.acceptance_temperature),
                        max_file_bytes=mib_limit(recipe.run.export_max_file_mb))
        print(f"exported {hcfg.kind} head to {export}")
    return result


def run_dir(args: argparse.Namespace) -> str:
    """--out, else <user cache>/runs/<recipe>-<target>: never a runs/ folder in whatever directory
    the command happened to start in."""
    return args.out or str(user_cache_dir() / "runs" / f"{Path(args.recipe).stem}-{Path(args.target).name}")


def check_device_for(distils: bool, recipe, *, allow_cpu_distill: bool) -> None:
    """train-head is meant for GPUs: on a host without one, distilling the recipe's prompts (the
    target answering each) takes hours, so it runs only when asked (--allow-cpu-distill); training
    on a dataset already there runs, with a note."""
    import jax

    if jax.default_backend() != "cpu":
        return
    if distils and not allow_cpu_distill:
        raise UsageError(f"train-head is meant for GPUs, and this host has none: distilling the recipe's "
                         f"{recipe.data.num_prompts} prompts on the CPU takes hours. Pass --data DIR (a dataset from "
                         "`jspec distill` on a GPU host), or --allow-cpu-distill to distil here anyway")
    print("train-head: no GPU on this host; training runs on the CPU (meant for GPUs: slow)")


def check_batches(data_dir: str, train_cfg) -> None:
    """The dataset fills a batch on every device and process (the loader the trainer reads with);
    one line naming the fix otherwise."""
    import jax

    from .trainer import training_loader

    if train_cfg.batch_size % jax.device_count():
        raise UsageError(f"--batch-size {train_cfg.batch_size} does not split over this host's {jax.device_count()} "
                         f"devices: use a multiple of {jax.device_count()}")
    try:
        training_loader(data_dir, train_cfg)
    except ValueError as e:
        raise UsageError(f"{e}: lower --batch-size (the recipe's {train_cfg.batch_size}) or distil more rows") from None


def estimated_acceptance(holdout_path: str, temperature: float = 1.0) -> dict | None:
    """The head's acceptance as its export records it ("jspec": {"acceptance"}), which `auto` plans
    with until a timed run replaces it with a measured fit: from the last held-out evaluation's
    per-step top-1 (`alpha_from_ttt_accuracy`, [I]), and at `temperature` (the recipe's
    acceptance_temperature) from its per-step sampled acceptance accept_j, read the same way
    ("by_temperature", which sampled plans use: policies.auto.acceptance_at). None without one."""
    from ..speculative.policies.auto import alpha_from_ttt_accuracy

    try:
        with open(holdout_path) as fh:
            last = json.loads([ln for ln in fh if ln.strip()][-1])
    except (OSError, IndexError, ValueError):
        return None
    acc = [last[f"acc_{j}"] for j in range(64) if f"acc_{j}" in last]
    if not acc:
        return None
    record = {"alpha": round(alpha_from_ttt_accuracy(acc), 3),
              "from": f"estimated from the held-out top-1 at step {last.get('step')} (training-time-test steps "
                      f"0..{len(acc) - 1}), not timed: replace with a measured K = 6 chain's fit"}
    accept = [last[f"accept_{j}"] for j in range(64) if f"accept_{j}" in last]
    if accept:
        record["by_temperature"] = {f"{temperature:g}": round(alpha_from_ttt_accuracy(accept), 3)}
        record["from"] += f"; at T = {temperature:g} from its held-out sampled acceptance, likewise"
    return record


def export_dir(args: argparse.Namespace, out: str, result) -> str | None:
    """Where the trained head goes: --export (default OUT/eagle) when the run is complete; with
    --export-when-stopped, an unfinished run's head goes to OUT/eagle-step<N>, never to the
    finished head's place; otherwise nothing is exported."""
    if result.finished:
        return args.export or os.path.join(out, "eagle")
    if getattr(args, "export_when_stopped", False):
        return os.path.join(out, f"eagle-step{result.last_step}")
    return None


def _write_data_report(out: str, data_dir: str, seq_len: int, loop_cut, packed: bool) -> None:
    """data_report.json: the dataset's rows and tokens by split and source, and what packing to
    seq_len cuts, loops included (v2 datasets)."""
    from . import shards

    meta = shards.read_meta(data_dir)
    if meta.get("format") != shards.FORMAT:
        return
    report = {"summary": shards.dataset_summary(data_dir), "packing": shards.length_stats(data_dir, seq_len, loop_cut=loop_cut)}
    with open(os.path.join(out, "data_report.json"), "w") as fh:
        json.dump(report, fh, indent=1)
    p = report["packing"]
    padding = (f"packed into about {p['packed_rows']:,} rows, padding {p['packed_padding_share']:.1%} of a batch"
               if packed else f"padding {p['padding_share']:.0%} of a batch")
    print(f"data: {p['rows']:,} training rows; {p['loop_cut_rows']:,} responses cut where they loop "
          f"({p['loop_cut_tokens']:,} tokens); {p['truncated_rows']:,} longer than seq_len {seq_len} are cut "
          f"({p['truncated_tokens']:,} tokens), {padding}")


def _write_vocab_report(out: str, data_dir: str, cfg, head_params: dict) -> None:
    """vocab_coverage.json: the draft vocabulary's coverage of the target's greedy answers to the
    evaluation prompts (when the dataset holds reference answers), also for other vocab sizes."""
    from . import shards, vocab
    from .data import token_counts

    meta = shards.read_meta(data_dir)
    if meta.get("format") != shards.FORMAT or not meta.get("eval_shards"):
        return
    counts = token_counts(data_dir, cfg.vocab_size)
    report = {"draft_vocab_size": int(len(head_params["d2t"])),
              "coverage": vocab.coverage_report(data_dir, head_params["t2d"]),
              "coverage_by_size": vocab.coverage_by_size(data_dir, counts)}
    with open(os.path.join(out, "vocab_coverage.json"), "w") as fh:
        json.dump(report, fh, indent=1)
    print("draft vocab coverage of greedy eval answers: " + ", ".join(
        f"{k} {v['coverage']:.3f} (6 in a row {v['full_windows_6']:.3f})" for k, v in report["coverage"].items()))


def main(argv: list[str] | None = None):
    parser = add_train_args(argparse.ArgumentParser(prog="jspec train-head", description=__doc__,
                                                    formatter_class=argparse.RawDescriptionHelpFormatter))
    return run_train(parser.parse_args(argv))


if __name__ == "__main__":
    main()
