"""`jspec` command line: generate, convert, info, bench, calibrate, train-head, build-corpus, distill,
merge-data, train-ldlp."""

from __future__ import annotations

import argparse
import os
import sys
import time

from .checkpoint.convert import add_convert_args, run_convert
from .checkpoint.errors import CheckpointError, CheckpointNotFoundError
from .config import UnsupportedModelError
from .decode import PromptError, pack_prompts
from .errors import UsageError
from .generate import generate, generate_stream
from .presets import list_presets, resolve_model
from .sampling import Sampling
from .sharding import parse_mesh
from .speculative.drafters.base import DrafterError
from .heads.hrad import load_hrad
from .speculative.engines.chain import speculative_stream
from .speculative.engines.pearl import parse_role_mesh
from .speculative.engines.specbranch import SpecBranchConfig
from .speculative.factory import build_drafter, check_drafter_spec, find_ldlp_weights, resolve_policy_spec
from .speculative.policies import POLICY_NAMES, make_policy
from .speculative.policies.ldlp import load_ldlp
from .speculative.verify.consultant import DEFAULT_EPS, ConsultantRule
from .tokenizer import prompt_ids

# `bench` and `train-head` are imported where they run: they pull heavy optional stacks
# (transformers/torch peers, matplotlib; optax/orbax training extras, which may be absent).

DEFAULT_MODEL = "smollm2-135m-instruct"
DEFAULT_K_MAX = 8

# What a user can get wrong: reported as one line `jspec: error: ...` with exit code 2.
USER_ERRORS = (UsageError, PromptError, DrafterError, CheckpointError, CheckpointNotFoundError, UnsupportedModelError)


def _dtype_arg(name: str | None):
    import jax.numpy as jnp

    return None if name in (None, "auto") else jnp.dtype(name)


def add_generate_args(p: argparse.ArgumentParser):
    p.add_argument("prompt", nargs="+", help="prompt text (several prompts run as one batch)")
    p.add_argument("--model", default=DEFAULT_MODEL, help="preset name, HF dir, .gguf file or Orbax dir")
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", default="auto", help="float32 | bfloat16 | auto (float32 on CPU, bfloat16 elsewhere)")
    p.add_argument("--drafter", default=None,
                   help="speculative drafter: ngram[:N], early-exit[:E|:PATH], model[:PATH], eagle[:PATH], eagle3[:PATH], "
                        "dlm[:PATH] (DiffuSpec, a diffusion LM drafting a block per forward; use --policy adl); "
                        "no PATH: the one shipped with the preset")
    p.add_argument("--policy", default=None,
                   help=f"draft-length policy (needs --drafter; default static): {', '.join(POLICY_NAMES)}; with an EAGLE "
                        "head, svip/adaedl/confidence/tapout/ldlp take the constants `jspec calibrate` fit for it on this "
                        "card when there are some (NAME:paper: the paper's; NAME:calibrated: the fit or an error)")
    p.add_argument("--ldlp-weights", default=None, metavar="DIR",
                   help="--policy ldlp: directory with ldlp.safetensors (default: the one shipped beside the EAGLE head)")
    p.add_argument("--k-max", type=int, default=None,
                   help=f"maximum draft tokens per round (needs --drafter; default {DEFAULT_K_MAX}); at most what "
                        "the model's context leaves after the prompt and --max-new-tokens")
    p.add_argument("--verify", default=None, choices=["lossless", "consultant"],
                   help="needs --drafter; 'consultant' is Consultant Decoding's LOSSY rule (output differs from the target's)")
    p.add_argument("--consultant-eps", type=float, default=None,
                   help=f"--verify consultant: accept a draft while the target's NLL of it is <= EPS nats (default {DEFAULT_EPS})")
    p.add_argument("--consultant-smoothing", type=float, default=None, metavar="BETA",
                   help="--verify consultant: compare the running mean r = BETA*r + (1-BETA)*NLL instead (0 = off; 0.2 in the paper)")
    p.add_argument("--no-stream", action="store_true", help="print only when generation finishes")
    p.add_argument("--mesh", default=None,
                   help="run on several devices: data=N (rows split, each device loops on its own) or "
                        "model=N (tensor-parallel target); with --engine: role=2 or data=N,role=2 (device pairs); "
                        "implies --no-stream")
    p.add_argument("--engine", default=None, choices=["pearl", "specbranch", "ppsd"],
                   help="draft while verifying: pearl / specbranch (--drafter model[:PATH]) or ppsd "
                        "(--drafter early-exit:PATH); one device unless --mesh role=2")
    p.add_argument("--gamma", type=int, default=None, help="--engine pearl / specbranch: window (pearl default: measured)")
    p.add_argument("--branches", type=int, default=None, help="--engine specbranch: heads a window (default 3)")
    p.add_argument("--hrad", default=None, metavar="DIR",
                   help="--engine specbranch: H-RAD weights (scripts/train_hrad.py; a preset's ship in "
                        "models/<preset>/drafters/hrad); without it branches are cut by draft confidence")


def check_generate_args(a) -> None:
    """Every check that needs no model, run before the model loads (a bad flag costs no loading
    time). Fills in the defaults of the speculative options and builds `a.policy_obj`,
    `a.verify_rule` and `a.policy_params`. Raises UsageError / DrafterError."""
    if a.max_new_tokens < 1:
        raise UsageError(f"--max-new-tokens must be >= 1, got {a.max_new_tokens}")
    if a.temperature < 0 or a.top_k < 0 or not 0 < a.top_p <= 1:
        raise UsageError("--temperature and --top-k must be >= 0 and --top-p in (0, 1]")
    if getattr(a, "engine", None):
        _check_engine_args(a)
        return
    for flag, value in (("--gamma", a.gamma), ("--branches", a.branches), ("--hrad", a.hrad)):
        if value is not None:
            raise UsageError(f"{flag} applies only to --engine (pearl, specbranch)")
    if a.mesh:
        try:
            a.mesh, a.no_stream = parse_mesh(a.mesh), True
        except ValueError as e:
            raise UsageError(str(e)) from None
    speculative = {"--policy": a.policy, "--k-max": a.k_max, "--verify": a.verify, "--ldlp-weights": a.ldlp_weights,
                   "--consultant-eps": a.consultant_eps, "--consultant-smoothing": a.consultant_smoothing}
    if a.drafter is None:
        given = [flag for flag, value in speculative.items() if value is not None]
        if given:
            raise UsageError(f"{', '.join(given)} {'applies' if len(given) == 1 else 'apply'} only to speculative decoding: add --drafter "
                             "(ngram, early-exit, model, eagle, eagle3, dlm)")
        return
    a.policy = a.policy or "static"
    a.k_max = DEFAULT_K_MAX if a.k_max is None else a.k_max
    a.verify = a.verify or "lossless"
    if a.k_max < 1:
        raise UsageError(f"--k-max must be >= 1, got {a.k_max}")
    drafter_cls = check_drafter_spec(a.drafter, model_name=a.model, k_max=a.k_max)
    try:  # "svip" takes the head's calibrated constants when `jspec calibrate` wrote them; "svip:paper" the paper's
        policy = resolve_policy_spec(a.policy, a.drafter, a.model, a.k_max)
        a.policy_obj = make_policy(policy, k_max=a.k_max) if isinstance(policy, str) else policy
    except ValueError as e:
        raise UsageError(str(e)) from None
    if drafter_cls.parallel and a.policy_obj.needs_draft_logits:
        raise UsageError(f"policy {a.policy!r} reads draft distributions, which the {a.drafter!r} drafter does not "
                         "have; use static, heuristic or adl")
    consultant = {"--consultant-eps": a.consultant_eps, "--consultant-smoothing": a.consultant_smoothing}
    if a.verify == "consultant":
        try:
            a.verify_rule = ConsultantRule(eps=DEFAULT_EPS if a.consultant_eps is None else a.consultant_eps,
                                           smoothing=a.consultant_smoothing or 0.0)
        except ValueError as e:
            raise UsageError(str(e)) from None
    elif any(v is not None for v in consultant.values()):
        raise UsageError(f"{', '.join(f for f, v in consultant.items() if v is not None)} need --verify consultant")
    else:
        a.verify_rule = "lossless"
    a.policy_params = None
    if a.policy_obj.name == "ldlp":
        a.policy_params = find_ldlp_weights(a.drafter, a.model, a.ldlp_weights)  # loaded after the checks
    elif a.ldlp_weights:
        raise UsageError("--ldlp-weights needs --policy ldlp")


def _check_engine_args(a) -> None:
    """--engine: its drafter, its mesh (device pairs) and its own options; chain options don't apply."""
    given = [f for f, v in (("--policy", a.policy), ("--k-max", a.k_max), ("--verify", a.verify),
                            ("--ldlp-weights", a.ldlp_weights), ("--consultant-eps", a.consultant_eps)) if v is not None]
    if given:
        raise UsageError(f"--engine {a.engine} has its own schedule: drop {', '.join(given)}")
    if a.engine != "specbranch" and (a.branches is not None or a.hrad is not None):
        raise UsageError("--branches and --hrad apply only to --engine specbranch")
    if a.engine == "ppsd" and a.gamma is not None:
        raise UsageError("--gamma is PEARL's / SpecBranch's window; ppsd drafts one token a tick")
    need = "early-exit:PATH (a trained exit head), early-exit (the preset's) or early-exit:E" if a.engine == "ppsd" else "model[:PATH] (a draft model)"
    if a.drafter is None or a.drafter.split(":")[0] != ("early-exit" if a.engine == "ppsd" else "model"):
        raise UsageError(f"--engine {a.engine} needs --drafter {need}")
    check_drafter_spec(a.drafter)
    if a.hrad is not None and not os.path.isdir(a.hrad):
        raise UsageError(f"--hrad {a.hrad}: not a directory")
    try:
        a.mesh = parse_role_mesh(a.mesh)
        a.engine_arg = a.engine if a.engine != "specbranch" else SpecBranchConfig(
            branches=3 if a.branches is None else a.branches, gamma=4 if a.gamma is None else a.gamma,
            cut="hrad" if a.hrad else "confidence")
    except ValueError as e:
        raise UsageError(str(e)) from None
    a.no_stream, a.policy_params = True, None


class CompileClock:
    """Seconds JAX spends compiling (tracing, lowering, XLA) while active: the part of a first call
    that later calls skip, so `tokens / (wall - compile)` approximates the steady-state rate."""

    _registered = False
    _seconds = 0.0

    def __enter__(self):
        if not CompileClock._registered:
            from jax import monitoring

            def on_event(name, seconds, **_):
                if name.startswith("/jax/core/compile/"):
                    CompileClock._seconds += seconds

            monitoring.register_event_duration_secs_listener(on_event)
            CompileClock._registered = True
        self._start, self.t0 = CompileClock._seconds, time.perf_counter()
        return self

    def __exit__(self, *exc):
        self.wall = time.perf_counter() - self.t0
        self.compile = min(CompileClock._seconds - self._start, self.wall)

    def rates(self, n_tokens: int) -> str:
        steady = self.wall - self.compile
        steady_text = f"{n_tokens / steady:.1f} tok/s steady state" if steady > 1e-3 else "steady state n/a"
        return (f"{n_tokens} tokens in {self.wall:.2f}s: {n_tokens / self.wall:.1f} tok/s incl. compile, "
                f"{steady_text} ({self.compile:.1f}s compiling)")


def _print_rows(tok, res, n_prompts: int) -> None:
    """The decoded rows of a batched result, headed by their index when there are several."""
    for b in range(n_prompts):
        if n_prompts > 1:
            print(f"--- [{b}]")
        print(tok.decode(res.row(b), skip_special_tokens=True))


def cmd_generate(a) -> int:
    check_generate_args(a)
    if a.drafter is not None and a.policy_params is not None:
        a.policy_params = load_ldlp(str(a.policy_params))[0]
    t0 = time.perf_counter()
    cfg, params, tok = resolve_model(a.model, dtype=_dtype_arg(a.dtype))
    prompts = [prompt_ids(tok, text, a.chat) for text in a.prompt]
    sampling = Sampling(temperature=a.temperature, top_k=a.top_k, top_p=a.top_p)
    print(f"[jspec] {a.model}: loaded in {time.perf_counter() - t0:.1f}s, dtype {params['embed'].dtype}", file=sys.stderr)

    if a.drafter is not None and len(prompts) == 1 and not a.no_stream:
        return _stream_speculative(a, cfg, params, tok, prompts[0], sampling)
    if a.drafter is None and len(prompts) == 1 and not a.no_stream:
        ids: list[int] = []
        printed = ""
        with CompileClock() as clock:
            for chunk in generate_stream(params, cfg, prompts[0], max_new_tokens=a.max_new_tokens, sampling=sampling, seed=a.seed):
                ids += chunk
                text = tok.decode(ids, skip_special_tokens=True)
                print(text[len(printed):], end="", flush=True)
                printed = text
        print(f"\n[jspec] {clock.rates(len(ids))}", file=sys.stderr)
        return 0

    drafter = None
    if a.drafter:
        drafter, dparams = build_drafter(a.drafter, cfg, params, model_name=a.model, k_max=a.k_max)
    kw = dict(max_new_tokens=a.max_new_tokens, sampling=sampling, seed=a.seed, mesh=a.mesh)
    if getattr(a, "engine", None):
        kw.update(engine=a.engine_arg, drafter=drafter, drafter_params=dparams,
                  gamma=a.gamma if a.engine == "pearl" else None,
                  policy_params=load_hrad(a.hrad, cfg) if a.hrad else None)
        with CompileClock() as clock:
            res = generate(params, cfg, prompts, **kw)
        _print_rows(tok, res, len(prompts))
        print(f"[jspec] {clock.rates(int(res.lengths.sum()))}; engine {a.engine} on {res.devices} device(s), "
              f"gamma {res.gamma}: steps {res.target_calls.tolist()}, drafted {res.drafted.tolist()}, accepted "
              f"{res.accepted.tolist()}, rollback rate {res.rollback_rate:.3f}", file=sys.stderr)
        return 0
    if drafter is not None:
        kw.update(drafter=drafter, drafter_params=dparams, policy=a.policy_obj, policy_params=a.policy_params,
                  k_max=a.k_max, verify=a.verify_rule)
    with CompileClock() as clock:
        res = generate(params, cfg, prompts, **kw)
    _print_rows(tok, res, len(prompts))
    n = int(res.lengths.sum())
    print(f"[jspec] {clock.rates(n)}; target calls {res.target_calls.tolist()}", file=sys.stderr)
    if drafter is not None:
        mat = (res.lengths / res.target_calls).round(2).tolist()
        rate = (res.accepted / res.drafted.clip(1)).round(3).tolist()
        print(f"[jspec] drafter {a.drafter} policy {a.policy} verify {a.verify}: rounds {res.rounds.tolist()}, "
              f"drafted {res.drafted.tolist()}, accepted {res.accepted.tolist()}, acceptance {rate}, "
              f"mean accepted tokens per target call {mat}", file=sys.stderr)
    return 0


def _stream_speculative(a, cfg, params, tok, prompt, sampling) -> int:
    import jax

    drafter, dparams = build_drafter(a.drafter, cfg, params, model_name=a.model, k_max=a.k_max)
    tokens, lens, cache_len = pack_prompts(cfg, [prompt], a.max_new_tokens, a.k_max + 1)
    ids: list[int] = []
    printed, state = "", None
    with CompileClock() as clock:
        for chunk, state in speculative_stream(
            params, cfg, tokens, lens, jax.random.PRNGKey(a.seed), drafter=drafter, drafter_params=dparams,
            policy=a.policy_obj, policy_params=a.policy_params, k_max=a.k_max, max_new=a.max_new_tokens,
            cache_len=cache_len, sampling=sampling, verify=a.verify_rule,
        ):
            ids += chunk
            text = tok.decode(ids, skip_special_tokens=True)
            print(text[len(printed):], end="", flush=True)
            printed = text
    calls, drafted, accepted = (int(x) for x in jax.device_get((state.target_calls[0], state.drafted[0], state.accepted[0])))
    print(f"\n[jspec] {clock.rates(len(ids))}", file=sys.stderr)
    print(f"[jspec] drafter {a.drafter} policy {a.policy} verify {a.verify}: target calls {calls}, drafted {drafted}, "
          f"accepted {accepted} (acceptance {accepted / max(drafted, 1):.3f}), "
          f"mean accepted tokens per target call {len(ids) / max(calls, 1):.2f}", file=sys.stderr)
    return 0


def cmd_info(a) -> int:
    import jax

    print(f"jax {jax.__version__} backend {jax.default_backend()} devices {jax.devices()}")
    print("presets:", ", ".join(list_presets()))
    if a.model:
        cfg, params, _ = resolve_model(a.model, tokenizer=False)
        n = sum(x.size for x in jax.tree.leaves(params))
        print(f"{a.model}: {n / 1e6:.1f}M parameters, dtype {params['embed'].dtype}")
        for k, v in cfg.to_dict().items():
            print(f"  {k}: {v}")
    return 0


def cmd_merge_data(a) -> int:
    from .train.shards import merge_datasets

    try:
        meta = merge_datasets(a.out, a.inputs)
    except (ValueError, FileNotFoundError) as e:
        raise UsageError(str(e)) from None
    rows = sum(s["rows"] for s in meta["shards"])
    tokens = sum(s["response_tokens"] for s in meta["shards"])
    print(f"merged {len(a.inputs)} datasets into {a.out}: {len(meta['shards'])} shards, {rows} rows, "
          f"{tokens / 1e6:.2f}M response tokens, {len(meta['eval_shards'])} evaluation shards")
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="jspec", description="Dynamic speculative decoding in JAX")
    sub = parser.add_subparsers(dest="cmd", required=True)
    add_generate_args(sub.add_parser("generate", help="generate text (AR or speculative)"))
    info = sub.add_parser("info", help="devices, presets, a model's config")
    info.add_argument("--model", default=None)

    add_convert_args(sub.add_parser("convert", help="convert checkpoints (HF / GGUF -> Orbax, Orbax -> HF)"))
    bench = sub.add_parser("bench", help="benchmark methods side by side (Spec-Bench metrics)")
    train = sub.add_parser("train-head", help="train an EAGLE-1/EAGLE-3 draft head")
    from .bench.cli import add_bench_args

    add_bench_args(bench)
    corpus = sub.add_parser("build-corpus", help="prompt corpus for self-distillation (ShareGPT + chitchat, decontaminated)")
    distill = sub.add_parser("distill", help="the target answers the prompt corpus on every local device")
    merge = sub.add_parser("merge-data", help="one training dataset from several distilled directories")
    merge.add_argument("--out", required=True, help="new dataset directory")
    merge.add_argument("inputs", nargs="+", help="distilled dataset directories (jspec distill)")
    ldlp = sub.add_parser("train-ldlp", help="train AdaEAGLE's draft-length predictor for an EAGLE head")
    calibrate = sub.add_parser("calibrate", help="fit draft-length policies' constants to an EAGLE head on this card")
    from .bench.calibrate import add_calibrate_args

    add_calibrate_args(calibrate)
    try:
        from .train.cli import add_train_args
        from .train.corpus import add_corpus_args
        from .train.distill import add_distill_args
        from .train.ldlp import add_ldlp_args

        add_train_args(train)
        add_corpus_args(corpus)
        add_distill_args(distill)
        add_ldlp_args(ldlp)
    except ImportError:  # training extras absent
        pass

    a = parser.parse_args(argv)
    try:
        return run_command(a)
    except USER_ERRORS as e:
        print(f"jspec: error: {' '.join(str(e).split())}", file=sys.stderr)  # one line, no traceback
        return 2


def run_command(a) -> int:
    if a.cmd == "generate":
        return cmd_generate(a)
    if a.cmd == "info":
        return cmd_info(a)
    if a.cmd == "convert":
        return run_convert(a) or 0
    if a.cmd == "bench":
        os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # share the GPU with torch peers
        from .bench.cli import run_bench

        run_bench(a)
        return 0
    if a.cmd == "train-head":
        from .train.cli import run_train

        return run_train(a) or 0
    if a.cmd == "build-corpus":
        from .train.corpus import run_corpus

        return run_corpus(a)
    if a.cmd == "distill":
        from .train.distill import run_distill

        return run_distill(a)
    if a.cmd == "merge-data":
        return cmd_merge_data(a)
    if a.cmd == "calibrate":
        from .bench.calibrate import run_calibrate

        return run_calibrate(a)
    if a.cmd == "train-ldlp":
        from .train.ldlp import run_train_ldlp

        return run_train_ldlp(a)
    return 1


if __name__ == "__main__":
    sys.exit(main())
