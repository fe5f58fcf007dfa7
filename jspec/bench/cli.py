"""`jspec bench`: run methods over tasks on one model; print the table and write the rows, the table
and plots to a results folder (--out), or, for the project's own results (--commit-rows), to
models/<preset>/bench/ with BENCHMARKS.md regenerated."""

from __future__ import annotations

import argparse
import shlex
import time
from pathlib import Path
from typing import Any

from jspec import presets
from jspec.bench.harness import RunContext, TimingBarrier, batches_of, benchmark_group
from jspec.bench.methods import HFGenerateMethod, JspecMethod, canonical_dtype, load_hf_model
from jspec.bench.prompts import encode_questions
from jspec.bench.protocol import ENGINE_KEYS, METHOD_GRAMMAR, PARALLEL_METHODS, MethodSpec, parse_method_specs
from jspec.bench.law import law_row, law_samples
from jspec.bench.report import bench_dir, group_tables, write_benchmarks_md, write_rows
from jspec.compile_cache import add_compile_cache_arg, use_compile_cache
from jspec.decode import check_fits_context
from jspec.generate import INVARIANT_BLOCK
from jspec.heads.hrad import load_hrad
from jspec.kernels.decode_attention import split_attention
from jspec.model import cast_params
from jspec.sharding import axis_size, check_tensor_parallel, parse_mesh
from jspec.speculative.factory import (auto_plan, build_drafter, calibration_home, check_shipped_drafter, find_ldlp_weights,
                                      resolve_policy_spec)
from jspec.speculative.policies import POLICY_NAMES, is_auto
from jspec.speculative.policies.calibration import CALIBRATED_POLICIES, head_fingerprint
from jspec.speculative.policies.ldlp import load_ldlp
from jspec.speculative.drafters.eagle import EagleDrafter
from jspec.speculative.drafters.hybrid import HybridDrafter
from jspec.generate import default_tail_runs
from jspec.speculative.engines.tree import TreeConfig
from jspec.speculative.policies.auto import AutoPlan, mean_context, tail_rows
from jspec.bench.round_cost import VERIFY_TS, attach_profile, ensure_costs, plot_round_cost, profile_method
from jspec.errors import UsageError
from jspec.sampling import GREEDY, Sampling
from jspec.tasks import TASK_NAMES, Question, load_questions_file, load_task


def _int_list(text: str) -> list[int]:
    return [int(t) for t in text.split(",") if t.strip()]


def _str_list(text: str) -> list[str]:
    return [t.strip() for t in text.split(",") if t.strip()]


def add_bench_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.epilog = METHOD_GRAMMAR.format(policies=", ".join(POLICY_NAMES))
    parser.add_argument("--model", required=True, help="preset name or checkpoint path (jspec.presets.resolve_model)")
    parser.add_argument("--tasks", default="mt_bench", help="comma list of mt_bench, humaneval, chitchat, longdoc ('' for none)")
    parser.add_argument("--questions", help="extra Spec-Bench questions .jsonl; its task name is the file stem")
    parser.add_argument("--n-prompts", type=int, default=None, help="first N questions of each task (default all)")
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--batch", default="1", help="comma list of batch sizes, e.g. 1,16")
    parser.add_argument("--queue", action="store_true",
                        help="continuous batching: --batch rows in flight over all of a task's prompts, a finished row "
                             "taking the next prompt (generate(batch_size=...)), instead of consecutive batches whose "
                             "rows wait for the batch's slowest; jspec's AR, chain and tree methods")
    parser.add_argument("--refill", type=int, default=None,
                        help="--queue: rows started together when rows finish (default a quarter of --batch)")
    parser.add_argument("--min-timed-s", type=float, default=5.0,
                        help="repeat a method's timed pass over the prompts until this many seconds are timed "
                             "(at most 5 passes; each batch keeps its median time): a pass at batch 32 takes about "
                             "a second, where noise is a few percent")
    parser.add_argument("--dtype", default=None, help="comma list; default bfloat16 on accelerators, float32 on CPU")
    parser.add_argument("--methods", default="ar,hf",
                        help="comma list of ar, hf, hf_pld, spec:DRAFTER[:ARG]:POLICY[:OPTION]... (grammar below)")
    parser.add_argument("--k-max", type=int, default=None, help="spec methods' k_max unless a method sets k=N (default 8)")
    parser.add_argument("--prompt-lookup-num-tokens", type=int, default=10, help="hf_pld draft length")
    parser.add_argument("--hf-checkpoint", help="checkpoint dir or .gguf file for the HF peer (default: from --model)")
    parser.add_argument("--no-chat-template", action="store_true", help="feed raw text even to chat models")
    parser.add_argument("--out", default=None, metavar="DIR",
                        help="results folder: rows.json, table.md and plots/ (default ./jspec-results/<date-time>); "
                             "the table is also printed")
    parser.add_argument("--commit-rows", default=None, metavar="NAME",
                        help="for the project's own results: write the rows to <models-dir>/<preset>/bench/NAME.json "
                             "and the plots beside them, and regenerate --benchmarks-md from every such file "
                             "(instead of --out)")
    parser.add_argument("--models-dir", default="models",
                        help="--commit-rows: the repository's models/ folder, whose <preset>/bench/*.json hold the "
                             "committed rows")
    parser.add_argument("--benchmarks-md", default="BENCHMARKS.md",
                        help="--commit-rows: the markdown file whose tables (below its marker line) are rebuilt "
                             "from every committed row")
    parser.add_argument("--no-plots", action="store_true")
    parser.add_argument("--timing-barrier", default=None, metavar="DIR:N",
                        help="N bench processes on one host (one per GPU) start each group's timed passes together, "
                             "after all have compiled: compiling in one process slows another's timing")
    parser.add_argument("--round-cost", default="", help="comma list of batch sizes at which to add a round-cost profile "
                        "(draft_step_us, verify_us, round_us, ...) to the spec rows (jspec.bench.round_cost)")
    parser.add_argument("--mesh", default=None,
                        help="jspec methods run on several devices: data=N (rows split), model=N (tensor parallel) or both")
    parser.add_argument("--temperature", default="0",
                        help="comma list of sampling temperatures, e.g. 0,0.7,1 (0: greedy); each is a group of its own. "
                             "transformers' methods run greedy only")
    parser.add_argument("--top-p", default="1", help="comma list of top-p values of the sampled groups (1: off)")
    parser.add_argument("--top-k", default="0", help="comma list of top-k values of the sampled groups (0: off)")
    parser.add_argument("--seed", type=int, default=0,
                        help="sampled groups: each batch draws with this seed plus a hash of its prompts (every method "
                             "alike, every run alike)")
    parser.add_argument("--law-check", type=int, default=0, metavar="ROWS",
                        help="sampled groups: also test each method's emitted tokens against AR's law: the first "
                             "--law-tokens new tokens of the first --law-prompts prompts, ROWS samples each, a two-sample "
                             "chi-square per position (a row per method, task '<task>:law')")
    parser.add_argument("--law-prompts", type=int, default=4, help="--law-check: prompts per task (default 4)")
    parser.add_argument("--law-tokens", type=int, default=8, help="--law-check: new tokens per sample (default 8)")
    parser.add_argument("--compile-workers", type=int, default=1,
                        help="methods of a group compiled at once, in threads (XLA compiles with the GIL released); "
                             "rows record it, since their compile seconds then overlap")
    parser.add_argument("--unroll", type=_unroll_arg, default="auto",
                        help="jspec AR and spec methods: layers per step of the layer scan (generate's unroll): "
                             "auto (every layer unrolled on the GPU kernels' decode/verify path, scanned "
                             "elsewhere) or a number; recorded in each row")
    parser.add_argument("--invariant", action="store_true",
                        help="jspec AR and chain methods: every decode step and verify block runs as one block shape "
                             "(generate's invariant), so greedy rows equal AR's bit for bit in bf16 too (`greedy =` "
                             "1.00); slower. Recorded in each row as fixed_block")
    add_compile_cache_arg(parser)
    return parser


def _unroll_arg(text: str):
    """--unroll: "auto" or a positive layer count."""
    if text == "auto":
        return text
    try:
        n = int(text)
    except ValueError:
        n = 0
    if n < 1:
        raise argparse.ArgumentTypeError(f"--unroll {text!r}: expected auto or a positive number of layers")
    return n


def _unroll_value(arg):
    """generate()'s unroll for the --unroll argument (None = auto)."""
    return None if arg == "auto" else arg


# ---- inputs ------------------------------------------------------------------------------------


def preset_name(model: str) -> str:
    """Directory name under models/ for results: the preset, or a checkpoint path's name."""
    path = Path(model)
    return path.stem if path.suffix == ".gguf" else path.name if path.exists() else model


def load_questions(args: argparse.Namespace) -> dict[str, list[Question]]:
    unknown = [name for name in _str_list(args.tasks) if name not in TASK_NAMES]
    if unknown:
        raise UsageError(f"--tasks: unknown task {unknown[0]!r}; known tasks: {', '.join(TASK_NAMES)}")
    questions = {name: load_task(name, args.n_prompts) for name in _str_list(args.tasks)}
    if args.questions:
        if not Path(args.questions).is_file():
            raise UsageError(f"--questions {args.questions}: no such file")
        qs = load_questions_file(args.questions)
        questions[Path(args.questions).stem] = qs if args.n_prompts is None else qs[: args.n_prompts]
    if not questions:
        raise UsageError("no prompts: give --tasks and/or --questions")
    empty = [name for name, qs in questions.items() if not qs]
    if empty:
        raise UsageError(f"task {empty[0]!r} has no questions")
    return questions


def check_bench_args(args: argparse.Namespace) -> tuple[list[int], list[str]]:
    """The numbers and names of the command line, checked before anything loads: (batch sizes, dtypes)."""
    if args.n_prompts is not None and args.n_prompts < 1:
        raise UsageError(f"--n-prompts must be >= 1, got {args.n_prompts}")
    if args.max_new_tokens < 1:
        raise UsageError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    if args.k_max is not None and args.k_max < 1:
        raise UsageError(f"--k-max must be >= 1, got {args.k_max}")
    if args.min_timed_s < 0:
        raise UsageError(f"--min-timed-s must be >= 0, got {args.min_timed_s}")
    batches = _batch_sizes("--batch", args.batch)
    if args.round_cost:
        _batch_sizes("--round-cost", args.round_cost)
    try:
        dtypes = [canonical_dtype(d) for d in _str_list(args.dtype or default_dtype_name())]
    except ValueError as e:
        raise UsageError(f"--dtype: {e}") from None
    if args.commit_rows and args.out:
        raise UsageError("--out (a results folder of yours) and --commit-rows (the project's rows) exclude each other")
    refill = getattr(args, "refill", None)
    if refill is not None and not getattr(args, "queue", False):
        raise UsageError("--refill applies to --queue (continuous batching)")
    if refill is not None and not 1 <= refill <= min(batches):
        raise UsageError(f"--refill {refill}: expected 1 to the smallest --batch ({min(batches)})")
    for flag, value, low in (("--law-check", getattr(args, "law_check", 0), 0), ("--law-prompts", getattr(args, "law_prompts", 4), 1),
                             ("--law-tokens", getattr(args, "law_tokens", 8), 1),
                             ("--compile-workers", getattr(args, "compile_workers", 1), 1)):
        if value < low:
            raise UsageError(f"{flag} must be >= {low}, got {value}")
    return batches, dtypes


def samplings(args: argparse.Namespace) -> list[Sampling]:
    """The sampling settings of the run, one group each: every temperature x top-p x top-k, a
    temperature of 0 (greedy) once, whatever the others."""
    def values(flag, text, cast):
        try:
            return [cast(t) for t in _str_list(text)]
        except ValueError:
            raise UsageError(f"{flag} {text!r}: expected a comma list of numbers") from None

    temps = values("--temperature", getattr(args, "temperature", "0"), float)
    top_ps = values("--top-p", getattr(args, "top_p", "1"), float)
    top_ks = values("--top-k", getattr(args, "top_k", "0"), int)
    if not temps or not top_ps or not top_ks:
        raise UsageError("--temperature, --top-p and --top-k each need at least one value")
    out = []
    for t in temps:
        for p in ([1.0] if t == 0 else top_ps):
            for k in ([0] if t == 0 else top_ks):
                try:
                    setting = Sampling(temperature=t, top_p=p, top_k=k)
                except ValueError as e:
                    raise UsageError(f"--temperature/--top-p/--top-k: {e}") from None
                if setting not in out:
                    out.append(setting)
    return out


def _batch_sizes(flag: str, text: str) -> list[int]:
    try:
        values = _int_list(text)
    except ValueError:
        values = []
    if not values or any(v < 1 for v in values):
        raise UsageError(f"{flag} {text!r}: expected a comma list of batch sizes >= 1, e.g. 1,16")
    return values


def results_dir(args: argparse.Namespace) -> Path:
    """Where a run's rows, table and plots go: --out, else ./jspec-results/<date-time>."""
    if args.out:
        return Path(args.out)
    return Path("jspec-results") / time.strftime("%Y%m%d-%H%M%S")


def default_dtype_name() -> str:
    import jax

    return "float32" if jax.default_backend() == "cpu" else "bfloat16"


def resolve_model(name_or_path: str):
    return presets.resolve_model(name_or_path)


def resolve_config(name_or_path: str):
    return presets.resolve_config(name_or_path)


def hf_checkpoint(args: argparse.Namespace) -> tuple[str, str | None]:
    """(directory, gguf file name or None) for transformers' from_pretrained."""
    source = args.hf_checkpoint or args.model
    path = Path(source)
    if path.is_file() and path.suffix == ".gguf":
        return str(path.parent), path.name
    if path.is_dir():
        return str(path), None
    return presets.hf_checkpoint(source)


def reproduce_command(args: argparse.Namespace, dtypes: list[str]) -> str:
    parts = ["jspec", "bench", "--model", args.model, "--tasks", args.tasks]
    if args.questions:
        parts += ["--questions", args.questions]
    if args.n_prompts is not None:
        parts += ["--n-prompts", str(args.n_prompts)]
    parts += ["--max-new-tokens", str(args.max_new_tokens), "--batch", args.batch, "--dtype", ",".join(dtypes),
              "--methods", args.methods]
    parts += ["--commit-rows", args.commit_rows] if args.commit_rows else []
    parts += ["--queue"] if getattr(args, "queue", False) else []
    parts += ["--invariant"] if getattr(args, "invariant", False) else []
    parts += ["--refill", str(args.refill)] if getattr(args, "refill", None) is not None else []
    if args.k_max is not None:
        parts += ["--k-max", str(args.k_max)]
    if args.min_timed_s != 5.0:
        parts += ["--min-timed-s", str(args.min_timed_s)]
    if args.no_chat_template:
        parts.append("--no-chat-template")
    if getattr(args, "mesh", None):
        parts += ["--mesh", args.mesh]
    if getattr(args, "unroll", "auto") != "auto":
        parts += ["--unroll", str(args.unroll)]
    for flag, attr, default in (("--temperature", "temperature", "0"), ("--top-p", "top_p", "1"), ("--top-k", "top_k", "0"),
                                ("--seed", "seed", 0), ("--law-check", "law_check", 0), ("--law-prompts", "law_prompts", 4),
                                ("--law-tokens", "law_tokens", 8)):
        value = getattr(args, attr, default)
        if value != default:
            parts += [flag, str(value)]
    return shlex.join(parts)


# ---- methods -----------------------------------------------------------------------------------


class MethodFactory:
    """Builds each method at one batch size and dtype, casting params / loading the HF model once
    per dtype."""

    def __init__(self, args: argparse.Namespace, cfg: Any, params: Any, tokenizer: Any):
        self.args, self.cfg, self.params, self.tokenizer = args, cfg, params, tokenizer
        self._cast: dict[str, Any] = {}
        self.mesh = parse_mesh(getattr(args, "mesh", None))
        self._hf: dict[str, Any] = {}

    def jax_params(self, dtype: str) -> Any:
        if dtype not in self._cast:
            import jax.numpy as jnp

            self._cast = {dtype: cast_params(self.params, jnp.dtype(dtype))}  # keep one copy on device
        return self._cast[dtype]

    def hf_model(self, dtype: str) -> Any:
        if dtype not in self._hf:
            directory, gguf_file = hf_checkpoint(self.args)
            self._hf = {dtype: load_hf_model(directory, dtype=dtype, gguf_file=gguf_file)}
        return self._hf[dtype]

    def check(self, specs: list[MethodSpec]) -> None:
        """What needs the model, checked for every method before any runs: each drafter builds
        for this target (head files, exit layer, vocabulary), LDLP weights exist."""
        for spec in specs:
            if spec.method in PARALLEL_METHODS:
                build_drafter(spec.drafter, self.cfg, self.params, model_name=self.args.model)
                if "hrad" in spec.option_dict:
                    load_hrad(spec.option_dict["hrad"], self.cfg)
            if spec.method == "spec":
                build_drafter(spec.drafter, self.cfg, self.params, model_name=self.args.model, k_max=self.spec_k_max(spec),
                              draft_vocab=spec.draft_vocab)
                if spec.policy == "ldlp":
                    find_ldlp_weights(spec.drafter, self.args.model)
                constants = self.calibrated_policy(spec)  # :calibrated without a fit fails here, before any method runs
                if constants is not None:  # which constants it runs: never a silent choice
                    print(f"{spec.name}: {constants[2]}")

    def spec_k_max(self, spec: MethodSpec) -> int:
        """A chain method's k_max (its k=, else --k-max, else 8): block drafters (dlm) are built for it."""
        return spec.generate_kwargs(default_k_max=self.args.k_max or 8)["k_max"]

    def supports(self, spec: MethodSpec, batch: int, sampling: Sampling = GREEDY) -> bool:
        if spec.method == "hf":  # transformers' peers run greedy
            return sampling.greedy and not (spec.drafter == "prompt_lookup" and batch != 1)
        return True

    def auto_plan(self, spec: MethodSpec, params: Any, drafter: Any, dparams: Any, batch: int, context: float | None = None,
                  prompts: list[list[int]] | None = None, sampling: Sampling = GREEDY, queue: bool = False):
        """(the plan, the rows of its queue's tail: 0 without one) a user's generate(policy="auto")
        makes, from this card's cost table: the head's own measured acceptance as the prior, and
        with continuous batching the tail `auto` finishes the queue in (policies.auto.tail_rows)."""
        hybrid = isinstance(drafter, HybridDrafter)
        head = drafter.eagle if hybrid else drafter  # a hybrid's costs are its head's (the n-gram branch costs verify only)
        costs = ensure_costs(params, self.cfg, head, dparams, batch=batch, preset=preset_name(self.args.model),
                             models_dir=self.args.models_dir, tree=isinstance(head, EagleDrafter))
        kw = dict(k_cap=self.args.k_max or 8, tree=TreeConfig() if spec.tree else None, context=context, prompts=prompts,
                  sampling=sampling)
        plan = auto_plan(drafter, spec.drafter, self.args.model, costs, batch=batch, **kw)
        return plan, (tail_rows(drafter, costs, rows=batch, **kw) if queue else 0)

    def law_method(self, spec: MethodSpec, dtype: str, sampling: Sampling, tokens: int):
        """The method as --law-check runs it: the configuration it runs at batch 1 (an `auto` plan
        for one row), called on many copies of one prompt, `tokens` new tokens each."""
        return self.build(spec, dtype, 1, sampling=sampling, max_new_tokens=tokens)

    def build(self, spec: MethodSpec, dtype: str, batch: int, context: float | None = None,
              prompts: list[list[int]] | None = None, sampling: Sampling = GREEDY, max_new_tokens: int | None = None):
        """The method at this batch and dtype; `context`: the task's mean attended context, and
        `prompts` its prompts (token ids; n-gram lookup's acceptance), for `auto` plans."""
        a = self.args
        if spec.method == "hf":
            pad = getattr(self.tokenizer, "pad_token_id", None)
            return HFGenerateMethod(
                self.hf_model(dtype), eos_token_ids=self.cfg.eos_token_ids,
                pad_token_id=self.cfg.pad_token_id if pad is None else pad, dtype=dtype, batch=batch,
                max_new_tokens=a.max_new_tokens,
                prompt_lookup_num_tokens=a.prompt_lookup_num_tokens if spec.drafter == "prompt_lookup" else None,
            )
        extra = {"k_max": a.k_max} if spec.method == "spec" and a.k_max is not None else {}
        extra["mesh"] = self.mesh
        if spec.method in ("ar", "spec"):
            extra["unroll"] = _unroll_value(getattr(a, "unroll", "auto"))
        if spec.method in PARALLEL_METHODS:  # drafter built once, not per call; device pairs from the spec
            params = self.jax_params(dtype)
            extra["drafter"], extra["drafter_params"] = build_drafter(spec.drafter, self.cfg, params, model_name=self.args.model)
            if "hrad" in spec.option_dict:
                extra["policy_params"] = load_hrad(spec.option_dict["hrad"], self.cfg)
        if spec.method == "spec":
            params = self.jax_params(dtype)
            extra["drafter"], extra["drafter_params"] = build_drafter(spec.drafter, self.cfg, params, model_name=self.args.model,
                                                                      k_max=self.spec_k_max(spec),
                                                                      draft_vocab=spec.draft_vocab)
            if spec.policy == "ldlp":  # the predictor shipped in the EAGLE head's jspec/ folder
                extra["policy_params"] = load_ldlp(str(find_ldlp_weights(spec.drafter, self.args.model)))[0]
            if is_auto(spec.policy):  # the budget from this card's measured round costs (cached per card)
                extra["policy"], tail = self.auto_plan(spec, params, extra["drafter"], extra["drafter_params"], batch,
                                                       context, prompts, sampling, queue=getattr(a, "queue", False))
                if getattr(a, "queue", False):  # the tail as planned here, so the row says what ran,
                    # and none where generate would add none (a mesh, no real queue, no room in the positions)
                    runs = prompts is not None and default_tail_runs(
                        self.cfg, prompts, batch, self.mesh, max_new_tokens or a.max_new_tokens, extra["drafter"],
                        bool(spec.tree), self.spec_k_max(spec) or 8)
                    extra["tail_rows"] = tail if runs else 0
            constants = self.calibrated_policy(spec)
            if constants is not None and constants[0] is not None:
                extra["policy"] = constants[0]
        method = JspecMethod(self.jax_params(dtype), self.cfg, spec, dtype=dtype, batch=batch,
                             max_new_tokens=max_new_tokens or a.max_new_tokens, generate_kwargs=extra,
                             queue=getattr(a, "queue", False),
                             refill=getattr(a, "refill", None), sampling=sampling, seed=getattr(a, "seed", 0))
        if spec.drafter and spec.method != "hf":  # which weights drafted: a head's folder under one path changes as it trains
            home, _ = calibration_home(spec.drafter, self.args.model)
            method.drafter_weights = head_fingerprint(home) if home is not None else None
        if spec.method == "spec" and spec.policy in CALIBRATED_POLICIES:
            method.policy_constants = constants[1] if constants is not None else spec.option_dict.get("constants", "paper")
        if isinstance(extra.get("policy"), AutoPlan):
            method.auto_plan = extra["policy"].describe()
            if extra.get("tail_rows"):
                method.auto_plan += f"; the last {extra['tail_rows']} rows in a {extra['tail_rows']}-row tail, planned afresh"
        return method

    def calibrated_policy(self, spec: MethodSpec):
        """(policy, "calibrated" | "paper", which constants in one line) for a spec method of a
        calibrated policy without explicit fields: the head's calibration for this card, unless the
        spec asks for :paper; the policy is None when nothing is calibrated (the paper's constants,
        built as usual). None for any other method."""
        if spec.method != "spec" or spec.policy not in CALIBRATED_POLICIES:
            return None
        if any(k not in ENGINE_KEYS for k in spec.option_dict):
            return None  # fields given on the command line are the constants
        kw = spec.generate_kwargs(default_k_max=self.args.k_max or 8)
        tree = kw.get("tree")
        k = (TreeConfig().depth if tree in (True, "auto") else tree.depth) if spec.tree else kw["k_max"]
        which = spec.option_dict.get("constants")
        policy, note = resolve_policy_spec(spec.policy + (f":{which}" if which else ""), spec.drafter, self.args.model, k)
        if isinstance(policy, str):
            return None, "paper", note
        return policy, which or "calibrated", note


# ---- run ---------------------------------------------------------------------------------------


def _total_batches(prompts: dict[str, list], specs, batches, dtypes, factory, settings=(GREEDY,)) -> int:
    return sum(
        len(batches_of(p, b)) * sum(factory.supports(s, b, st) for s in specs)
        for p in prompts.values() for b in batches for _ in dtypes for st in settings
    )


def parse_timing_barrier(value: str | None) -> TimingBarrier | None:
    """--timing-barrier DIR:N -> the barrier (None when not given)."""
    if value is None:
        return None
    directory, _, parties = value.rpartition(":")
    if not directory or not parties.isdigit() or int(parties) < 1:
        raise UsageError(f"--timing-barrier {value!r}: expected DIR:N with N >= 1 processes")
    return TimingBarrier(directory, int(parties))


def run_bench(args: argparse.Namespace) -> list[dict[str, Any]]:
    from tqdm import tqdm

    batches, dtypes = check_bench_args(args)
    settings = samplings(args)
    specs = parse_method_specs(args.methods)  # every method checked before the model loads
    if getattr(args, "queue", False):
        other = [s.name for s in specs if s.method not in ("ar", "spec")]
        if other:
            raise UsageError(f"--queue (continuous batching) runs jspec's ar and spec methods, not {', '.join(other)}")
    if getattr(args, "invariant", False):
        other = [s.name for s in specs if s.method not in ("ar", "spec") or s.tree]
        if other or args.mesh:
            raise UsageError(f"--invariant runs jspec's ar and chain methods on one device, not "
                             f"{', '.join(other) or '--mesh ' + args.mesh}")
    for spec in specs:  # the flags passed: a drafter named without PATH against what the model ships
        if spec.drafter:
            check_shipped_drafter(spec.drafter, args.model)
    questions = load_questions(args)
    try:
        mesh = parse_mesh(args.mesh)  # a bad --mesh fails here, before the model loads
    except ValueError as e:
        raise UsageError(str(e)) from None
    if axis_size(mesh, "model") > 1:  # ... and one that does not split this model's heads (read from its header)
        tp_cfg = resolve_config(args.model)
        try:
            check_tensor_parallel(tp_cfg, axis_size(mesh, "model"))
        except ValueError as e:
            raise UsageError(f"--mesh: {e}") from None

    barrier = parse_timing_barrier(args.timing_barrier)
    use_compile_cache(getattr(args, "compile_cache", None))
    cfg, params, tokenizer = resolve_model(args.model)
    if getattr(args, "invariant", False):
        cfg = cfg.replace(fixed_block=INVARIANT_BLOCK)
    chat = False if args.no_chat_template else None
    prompts = {task: encode_questions(tokenizer, qs, chat=chat) for task, qs in questions.items()}
    longest = max((len(p) for task_prompts in prompts.values() for p in task_prompts), default=0)
    check_fits_context(cfg, longest, args.max_new_tokens)  # before any method compiles
    factory = MethodFactory(args, cfg, params, tokenizer)
    factory.check(specs)  # ... and against the model, before any method runs
    ctx = RunContext(target=preset_name(args.model), max_new_tokens=args.max_new_tokens,
                     reproduce=reproduce_command(args, dtypes))
    print(f"bench {ctx.target} on {ctx.card} (JAX {ctx.jax_version}): {len(specs)} methods, tasks {list(prompts)}")

    if args.commit_rows:
        out_dir, rows_file = bench_dir(args.models_dir, ctx.target), f"{args.commit_rows}.json"
    else:
        out_dir, rows_file = results_dir(args), "rows.json"
    rows: list[dict[str, Any]] = []
    total = _total_batches(prompts, specs, batches, dtypes, factory, settings)
    with tqdm(total=total, unit="batch") as progress:
        for dtype in dtypes:  # outermost: one param copy / HF model per dtype at a time
            for sampling in settings:
                for task, task_prompts in prompts.items():
                    for batch in batches:
                        rows += run_group(args, ctx, factory, specs, dtype, sampling, task, task_prompts, batch, barrier,
                                          progress)
                        write_rows(out_dir / rows_file, rows)  # after every group: a killed run keeps its rows
                    if not sampling.greedy and getattr(args, "law_check", 0):
                        rows += law_rows(args, ctx, factory, specs, dtype, sampling, task, task_prompts, progress)
                        write_rows(out_dir / rows_file, rows)

    print(group_tables(rows))
    print(f"rows: {out_dir / rows_file}")
    if not args.no_plots:
        from jspec.bench.plots import plot_all  # here, not at the top: matplotlib is slow to import

        for path in plot_all(rows, out_dir / "plots"):
            print(f"plot: {path}")
        cost_plot = out_dir / "plots" / f"{Path(rows_file).stem}_round_cost.png"
        if args.round_cost and plot_round_cost(rows, cost_plot):
            print(f"plot: {cost_plot}")
    if args.commit_rows:
        print(f"table: {write_benchmarks_md(args.models_dir, args.benchmarks_md)}")
    else:
        (out_dir / "table.md").write_text(group_tables(rows))
        print(f"table: {out_dir / 'table.md'}")
    return rows


def run_group(args, ctx, factory, specs, dtype, sampling, task, task_prompts, batch, barrier, progress) -> list[dict[str, Any]]:
    """The rows of one group: every method at one dtype, sampling, task and batch size, in one process."""
    skipped = [s.name for s in specs if not factory.supports(s, batch, sampling)]
    if skipped:
        why = "transformers' peers run greedy" if not sampling.greedy else "transformers runs it at batch 1 only"
        progress.write(f"skipping {', '.join(skipped)} at batch {batch}: {why}")
    context = mean_context([len(p) for p in task_prompts], args.max_new_tokens)
    methods = [factory.build(s, dtype, batch, context, task_prompts, sampling) for s in specs
               if factory.supports(s, batch, sampling)]
    group = benchmark_group(ctx, methods, task_prompts, task=task, progress=progress, min_timed_s=args.min_timed_s,
                            barrier=barrier, compile_workers=getattr(args, "compile_workers", 1))
    for row in group:
        if row["method"] in ("ar", "spec"):
            row["unroll"] = getattr(args, "unroll", "auto")
            if getattr(args, "invariant", False):
                row["fixed_block"] = INVARIANT_BLOCK
            row["split_attention"] = split_attention()  # $JSPEC_SPLIT_ATTENTION: long caches' keys split
    if batch in _int_list(args.round_cost):
        add_round_costs(group, methods, batch, progress)
    return group


def law_rows(args, ctx, factory, specs, dtype, sampling, task, task_prompts, progress) -> list[dict[str, Any]]:
    """--law-check: each jspec method's first new tokens against AR's law (jspec.bench.law), one row per method."""
    chosen = task_prompts[: args.law_prompts]
    jspec_specs = [s for s in specs if s.method in ("ar", "spec") + PARALLEL_METHODS]
    ar = next((s for s in jspec_specs if s.method == "ar"), None) or MethodSpec("ar")
    out = []
    reference = None
    for spec in [ar] + [s for s in jspec_specs if s.method != "ar"]:
        progress.write(f"law check {spec.name} ({sampling}): {args.law_check} samples of {len(chosen)} prompts")
        samples = law_samples(factory.law_method(spec, dtype, sampling, args.law_tokens), chosen, args.law_check,
                              args.law_tokens, seed=getattr(args, "seed", 0) + (0 if spec is ar else 1))
        if reference is None:
            reference = samples
            continue
        out.append(law_row(ctx, spec, dtype, sampling, task, samples, reference, args.law_tokens))
    return out


def add_round_costs(rows: list[dict[str, Any]], methods: list, batch: int, progress) -> None:
    """Profile each speculative method's round at this batch (verify grid once per batch)."""
    verify_ts = VERIFY_TS
    for m in methods:
        if getattr(m, "method", None) != "spec":
            continue
        kw = m._kwargs
        drafter, policy, k_max = kw["drafter"], kw.get("policy"), kw.get("k_max") or 8
        if isinstance(drafter, HybridDrafter):
            progress.write(f"round cost {m.name} b{batch}: hybrid trees are not profiled (their head's are)")
            continue
        tree = TreeConfig() if m.tree else None
        if isinstance(policy, AutoPlan):
            if policy.mode == "ar":
                attach_profile(rows, m, batch, {"batch": batch, "plan": "ar"})
                continue
            k_max = policy.k_max
            tree = TreeConfig(depth=policy.k_max, num_nodes=policy.num_nodes, ngram=policy.ngram) if policy.mode == "tree" else None
            policy = policy.policy
        prof = profile_method(m.params, m.cfg, drafter, kw.get("drafter_params"), batch=batch, policy=policy,
                              k_max=k_max, tree=tree, verify_ts=verify_ts, policy_params=kw.get("policy_params"))
        verify_ts = (1,)
        attach_profile(rows, m, batch, prof)
        progress.write(f"round cost {m.name} b{batch}: draft {prof.get('draft_step_us', 0):.0f} µs/step, "
                       f"round {prof['round_us']:.0f} µs")


def main(argv: list[str] | None = None, **defaults: Any) -> list[dict[str, Any]]:
    parser = add_bench_args(argparse.ArgumentParser(description=__doc__))
    parser.set_defaults(**defaults)
    return run_bench(parser.parse_args(argv))
