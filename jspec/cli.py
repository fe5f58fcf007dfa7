"""`jspec` command line: generate, convert, info, bench, calibrate, train-head, build-corpus, distill,
merge-data, train-ldlp, export-head."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from pathlib import Path

import jax
import numpy as np
from jax._src import xla_bridge  # backends_are_initialized: no public API says whether they started

from . import __version__
from .checkpoint.convert import add_convert_args, run_convert
from .checkpoint.eagle_format import CONFIG_FILE, ENGINES, load_eagle_head, mib_limit, save_eagle_head
from .checkpoint.errors import CheckpointError, CheckpointNotFoundError
from .compile_cache import add_compile_cache_arg, use_compile_cache
from .config import UnsupportedModelError, config_from_hf
from .decode import PromptError, pack_prompts
from .errors import UsageError
from .generate import (INVARIANT_BLOCK, SpeculativeConfig, check_fixed_block, default_tail_runs, generate, generate_stream,
                       pack_stream_prompt)
from .presets import (TOKENIZER_FILES, list_presets, load_preset, models_dir, resolve_checkpoint, resolve_config,
                      resolve_model, resolve_tokenizer)
from .sampling import Sampling
from .sharding import axis_size, check_tensor_parallel, parse_mesh
from .speculative.drafters.base import DrafterError
from .speculative.drafters.hybrid import HybridDrafter
from .heads.hrad import load_hrad
from .speculative.engines.chain import speculative_stream
from .speculative.engines.pearl import parse_role_mesh
from .speculative.engines.specbranch import SpecBranchConfig
from .speculative.engines.tree import TreeConfig, tree_config
from .speculative.factory import (auto_plan, build_drafter, check_drafter_spec, check_shipped_drafter, find_ldlp_weights,
                                  resolve_policy_spec, shipped_head_path)
from .speculative.policies import POLICY_NAMES, is_auto, make_policy
from .speculative.policies.auto import AutoPlan, auto_budget, load_costs, mean_context, tail_rows
from .speculative.policies.ldlp import load_ldlp
from .speculative.verify.consultant import DEFAULT_EPS, ConsultantRule
from .tasks import TaskDataError
from .tokenizer import has_chat_template, prompt_ids

# `bench` and `train-head` are imported where they run: they pull heavy optional stacks
# (transformers/torch peers, matplotlib; optax/orbax training extras, which may be absent).

DEFAULT_MODEL = "smollm2-135m-instruct"
DEFAULT_K_MAX = 8
DTYPES = ("auto", "float32", "bfloat16", "float16")

# What a user can get wrong: reported as one line `jspec: error: ...` with exit code 2.
USER_ERRORS = (UsageError, PromptError, DrafterError, CheckpointError, CheckpointNotFoundError, UnsupportedModelError,
               TaskDataError)


def _dtype_arg(name: str | None):
    import jax.numpy as jnp

    return None if name in (None, "auto") else jnp.dtype(name)


def add_generate_args(p: argparse.ArgumentParser):
    p.add_argument("prompt", nargs="*", help="prompt text; several prompts stream one after another (--no-stream: "
                                             "one batch)")
    p.add_argument("--prompt-file", metavar="PATH",
                   help="read prompts from PATH ('-': standard input): one per line, or JSON lines "
                        '{"prompt": TEXT} when the first line starts with "{" (for prompts with newlines)')
    p.add_argument("--model", default=DEFAULT_MODEL, help="preset name, HF dir, .gguf file or Orbax dir")
    p.add_argument("--chat", action=argparse.BooleanOptionalAction, default=None,
                   help="wrap the prompt in the model's chat template (default: on for a preset that says so, "
                        "preset.json \"chat\", such as the instruct models; off for a checkpoint path)")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--stop", action="append", default=None, metavar="STR",
                   help="stop a prompt's generation at STR (repeatable); its output ends with STR. Streamed "
                        "prompts stop there; a --no-stream batch runs to its end and each row is cut")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", default="auto", help=f"{' | '.join(DTYPES)} (auto: float32 on CPU, bfloat16 elsewhere)")
    p.add_argument("--drafter", default=None,
                   help="speculative drafter: ngram[:N], early-exit[:E|:PATH], model[:PATH], eagle[:PATH], eagle3[:PATH], "
                        "dlm[:PATH] (DiffuSpec, a diffusion LM drafting a block per forward; use --policy adl), "
                        "eagle3+ngram (the head's tree plus prompt lookup; with --tree --policy auto it looks up first "
                        "at batch 1, the fastest choice measured); no PATH: the one shipped with the preset")
    p.add_argument("--policy", default=None,
                   help=f"draft-length policy (needs --drafter; default static): {', '.join(POLICY_NAMES)}; with an EAGLE "
                        "head, svip/adaedl/confidence/tapout/ldlp take the constants `jspec calibrate` fit for it on this "
                        "card when there are some (NAME:paper: the paper's; NAME:calibrated: the fit or an error)")
    p.add_argument("--ldlp-weights", default=None, metavar="DIR",
                   help="--policy ldlp: directory with ldlp.safetensors (default: the jspec/ folder of the EAGLE head)")
    p.add_argument("--k-max", type=int, default=None,
                   help=f"maximum draft tokens per round (needs --drafter; default {DEFAULT_K_MAX}); at most what "
                        "the model's context leaves after the prompt and --max-new-tokens")
    p.add_argument("--draft-vocab", type=int, default=None, metavar="N",
                   help="--drafter model: its LM head scores only the target's N most frequent answer tokens "
                        "(FR-Spec; the preset's token_counts.npz), a cheaper draft step; lossless; chains only")
    p.add_argument("--tree", action="store_true",
                   help="EAGLE-2 dynamic trees instead of chains (--drafter eagle / eagle3; top_k 10, depth 6, "
                        "59 nodes); implies --no-stream")
    p.add_argument("--tree-nodes", default=None, metavar="N|auto",
                   help="--tree: draft nodes kept (EAGLE's total_token - 1); auto: timed on this device")
    p.add_argument("--verify", default=None, choices=["lossless", "token", "consultant"],
                   help="needs --drafter; 'lossless' (default): sampled chains verified as one block (block "
                        "verification), trees by recursive rejection; 'token': sampled chains verified token by "
                        "token (the same law, fewer tokens accepted; chains only); 'consultant' is Consultant "
                        "Decoding's LOSSY rule (output differs from the target's; chains only)")
    p.add_argument("--consultant-eps", type=float, default=None,
                   help=f"--verify consultant: accept a draft while the target's NLL of it is <= EPS nats (default {DEFAULT_EPS})")
    p.add_argument("--consultant-smoothing", type=float, default=None, metavar="BETA",
                   help="--verify consultant: compare the running mean r = BETA*r + (1-BETA)*NLL instead (0 = off; 0.2 in the paper)")
    p.add_argument("--no-stream", action="store_true", help="run all prompts as one batch; print when it finishes")
    p.add_argument("--invariant", action="store_true",
                   help=f"every decode step and chain verify block runs as a block of {INVARIANT_BLOCK} tokens on the "
                        "portable kernels: greedy output equals AR's bit for bit in bf16 too (AR and chains with "
                        f"--k-max <= {INVARIANT_BLOCK - 1}, one device; slower); implies --no-stream")
    p.add_argument("--batch-size", type=int, default=None, metavar="N",
                   help="at most N rows in flight: a finished row takes the next prompt (continuous batching; "
                        "with --mesh, N over the data shards); implies --no-stream")
    p.add_argument("--tail-rows", type=int, default=None, metavar="R",
                   help="--batch-size: once no prompt waits and at most R rows run, finish them in a batch of R rows "
                        "(re-prefilled; 0: never; default: --policy auto's choice, else never)")
    p.add_argument("--mesh", default=None,
                   help="run on several devices: data=N (rows split, each device loops on its own), "
                        "model=N (tensor-parallel target) or both; with --engine: role=2 or data=N,role=2 (device pairs); "
                        "implies --no-stream. On a CPU host jspec asks XLA for the N CPU devices itself "
                        "(--xla_force_host_platform_device_count)")
    p.add_argument("--engine", default=None, choices=["pearl", "specbranch", "ppsd"],
                   help="draft while verifying: pearl / specbranch (--drafter model[:PATH]) or ppsd "
                        "(--drafter early-exit:PATH); one device unless --mesh role=2")
    p.add_argument("--gamma", type=int, default=None, help="--engine pearl / specbranch: window (pearl default: measured)")
    p.add_argument("--branches", type=int, default=None, help="--engine specbranch: heads a window (default 3)")
    p.add_argument("--hrad", default=None, metavar="DIR",
                   help="--engine specbranch: H-RAD weights (scripts/train_hrad.py; a preset's ship in "
                        "models/<preset>/drafters/hrad); without it branches are cut by draft confidence")
    add_compile_cache_arg(p)


def check_generate_args(a) -> None:
    """`_check_generate_args`, then what --invariant covers (generate.check_fixed_block)."""
    _check_generate_args(a)
    if getattr(a, "invariant", False):
        a.no_stream = True  # generate() runs it; the streaming loops keep their own shapes
        check_fixed_block(INVARIANT_BLOCK, a.speculative, a.mesh, a.tail_rows)  # an --engine is in a.speculative


def _check_generate_args(a) -> None:
    """Every check that needs no model, run before anything loads (a bad flag costs no loading
    time). Fills in the defaults of the speculative options and builds `a.speculative` (a
    SpeculativeConfig with the drafter still a spec string, or None) and `a.policy_params` (the
    LDLP weights' directory, loaded after the checks). Raises UsageError / DrafterError."""
    if a.max_new_tokens < 1:
        raise UsageError(f"--max-new-tokens must be >= 1, got {a.max_new_tokens}")
    if a.temperature < 0 or a.top_k < 0 or not 0 < a.top_p <= 1:
        raise UsageError("--temperature and --top-k must be >= 0 and --top-p in (0, 1]")
    if a.dtype not in DTYPES:
        raise UsageError(f"--dtype {a.dtype!r}: choose from {', '.join(DTYPES)}")
    if a.stop is not None and not all(a.stop):
        raise UsageError("--stop needs a non-empty string")
    a.speculative, a.policy_params, a.policy_constants = None, None, None
    if getattr(a, "batch_size", None) is not None:
        if a.batch_size < 1:
            raise UsageError(f"--batch-size must be >= 1, got {a.batch_size}")
        if getattr(a, "engine", None):
            raise UsageError("--batch-size (continuous batching) runs AR, chains or trees: drop --engine")
        a.no_stream = True
    if getattr(a, "tail_rows", None) is not None:
        if a.batch_size is None:
            raise UsageError("--tail-rows applies to continuous batching: give --batch-size too")
        if not 0 <= a.tail_rows < a.batch_size:
            raise UsageError(f"--tail-rows {a.tail_rows}: 0 (never) up to fewer than --batch-size {a.batch_size}")
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
                   "--consultant-eps": a.consultant_eps, "--consultant-smoothing": a.consultant_smoothing,
                   "--tree": a.tree or None, "--tree-nodes": a.tree_nodes, "--draft-vocab": a.draft_vocab}
    if a.drafter is None:
        given = [flag for flag, value in speculative.items() if value is not None]
        if given:
            raise UsageError(f"{', '.join(given)} {'applies' if len(given) == 1 else 'apply'} only to speculative decoding: add --drafter "
                             "(ngram, early-exit, model, eagle, eagle3, dlm)")
        return
    if a.tree and a.k_max is not None:
        raise UsageError("--k-max sets a chain's draft length; a tree drafts to its depth (EAGLE-2's 6)")
    a.policy = a.policy or "static"
    a.k_max = DEFAULT_K_MAX if a.k_max is None else a.k_max
    a.verify = a.verify or "lossless"
    if a.k_max < 1:
        raise UsageError(f"--k-max must be >= 1, got {a.k_max}")
    drafter_cls = check_drafter_spec(a.drafter, model_name=a.model, k_max=a.k_max, draft_vocab=a.draft_vocab or 0)
    if issubclass(drafter_cls, HybridDrafter) and not a.tree:
        raise UsageError(f"--drafter {a.drafter} drafts trees (the head's tree plus an n-gram branch): add --tree")
    tree = _tree_arg(a)
    depth = tree_config(tree).depth if tree is not None else a.k_max
    try:  # "svip" takes the head's calibrated constants when `jspec calibrate` wrote them; "svip:paper" the paper's
        policy, a.policy_constants = resolve_policy_spec(a.policy, a.drafter, a.model, depth)
        policy_obj = make_policy(policy, k_max=depth) if isinstance(policy, str) else policy
    except ValueError as e:
        raise UsageError(str(e)) from None
    if drafter_cls.parallel and policy_obj.needs_draft_logits:
        raise UsageError(f"policy {a.policy!r} reads draft distributions, which the {a.drafter!r} drafter does not "
                         "have; use static, heuristic or adl")
    consultant = {"--consultant-eps": a.consultant_eps, "--consultant-smoothing": a.consultant_smoothing}
    verify = "lossless"
    if a.verify == "token":
        if tree is not None:
            raise UsageError("--verify token verifies chains token by token; sampled trees use recursive rejection: drop --tree")
        verify = "token"
    if a.verify == "consultant":
        if tree is not None:
            raise UsageError("--verify consultant: Consultant Decoding verifies chains, not trees; drop --tree")
        try:
            verify = ConsultantRule(eps=DEFAULT_EPS if a.consultant_eps is None else a.consultant_eps,
                                    smoothing=a.consultant_smoothing or 0.0)
        except ValueError as e:
            raise UsageError(str(e)) from None
    elif any(v is not None for v in consultant.values()):
        given = [f for f, v in consultant.items() if v is not None]
        raise UsageError(f"{', '.join(given)} {'needs' if len(given) == 1 else 'need'} --verify consultant")
    a.policy_params = None
    if policy_obj.name == "ldlp":
        a.policy_params = find_ldlp_weights(a.drafter, a.model, a.ldlp_weights)  # loaded after the checks
    elif a.ldlp_weights:
        raise UsageError("--ldlp-weights needs --policy ldlp")
    if tree is not None:
        a.no_stream = True  # trees run through generate(); streaming drafts chains
    try:
        a.speculative = SpeculativeConfig(drafter=a.drafter, policy=policy_obj, k_max=a.k_max, tree=tree, verify=verify,
                                          draft_vocab=a.draft_vocab or 0)
    except ValueError as e:
        raise UsageError(f"--drafter {a.drafter}: {e}") from None


def _tree_arg(a):
    """--tree / --tree-nodes as SpeculativeConfig's tree: None, True, "auto" or a TreeConfig."""
    if a.tree_nodes is not None and not a.tree:
        raise UsageError("--tree-nodes needs --tree")
    if not a.tree:
        return None
    if a.tree_nodes is None:
        return TreeConfig()
    if a.tree_nodes == "auto":
        return "auto"
    if not (a.tree_nodes.isdigit() and int(a.tree_nodes) >= 1):
        raise UsageError(f"--tree-nodes {a.tree_nodes!r}: a positive number of nodes or auto")
    default = TreeConfig()
    if int(a.tree_nodes) > default.max_nodes:
        raise UsageError(f"--tree-nodes {a.tree_nodes}: EAGLE-2's tree (top_k {default.top_k}, depth {default.depth}) "
                         f"has at most {default.max_nodes} candidate nodes")
    return dataclasses.replace(default, num_nodes=int(a.tree_nodes))


def _check_engine_args(a) -> None:
    """--engine: its drafter, its mesh (device pairs) and its own options; chain options don't apply."""
    given = [f for f, v in (("--policy", a.policy), ("--k-max", a.k_max), ("--verify", a.verify),
                            ("--ldlp-weights", a.ldlp_weights), ("--consultant-eps", a.consultant_eps),
                            ("--tree", a.tree or None), ("--tree-nodes", a.tree_nodes),
                            ("--draft-vocab", a.draft_vocab)) if v is not None]
    if given:
        raise UsageError(f"--engine {a.engine} has its own schedule: drop {', '.join(given)}")
    if a.engine != "specbranch" and (a.branches is not None or a.hrad is not None):
        raise UsageError("--branches and --hrad apply only to --engine specbranch")
    if a.engine == "ppsd" and a.gamma is not None:
        raise UsageError("--gamma is PEARL's / SpecBranch's window; ppsd drafts one token a tick")
    need = "early-exit:PATH (a trained exit head), early-exit (the preset's) or early-exit:E" if a.engine == "ppsd" else "model[:PATH] (a draft model)"
    if a.drafter is None or a.drafter.split(":")[0] != ("early-exit" if a.engine == "ppsd" else "model"):
        raise UsageError(f"--engine {a.engine} needs --drafter {need}")
    try:
        a.mesh = parse_role_mesh(a.mesh)
    except ValueError as e:
        raise UsageError(str(e)) from None
    check_drafter_spec(a.drafter)
    if a.hrad is not None and not os.path.isdir(a.hrad):
        raise UsageError(f"--hrad {a.hrad}: not a directory")
    try:
        engine = a.engine if a.engine != "specbranch" else SpecBranchConfig(
            branches=3 if a.branches is None else a.branches, gamma=4 if a.gamma is None else a.gamma,
            cut="hrad" if a.hrad else "confidence")
        a.speculative = SpeculativeConfig(drafter=a.drafter, engine=engine, gamma=a.gamma if a.engine == "pearl" else None)
    except ValueError as e:
        raise UsageError(str(e)) from None
    a.no_stream, a.policy_params = True, None


def speculative_slots(spec: SpeculativeConfig | None) -> int:
    """Cache slots a round needs beyond the prompt and the new tokens (pack_prompts' `extra`), to
    check a prompt's length against the model's context before the weights load."""
    if spec is None:
        return 0
    if spec.engine is not None:
        gamma = spec.engine.gamma if isinstance(spec.engine, SpecBranchConfig) else spec.gamma
        return 1 if spec.engine == "ppsd" else 2 * (gamma or 1)
    if spec.tree is not None:
        return tree_config(spec.tree).cache_slots
    return spec.k_max + 1


def read_prompt_texts(a) -> list[str]:
    """The prompts: the arguments, then --prompt-file's (one per line, or JSON lines). Each must
    have text; there must be at least one."""
    texts = list(a.prompt)
    if a.prompt_file:
        texts += prompts_from_file(a.prompt_file)
    if not texts:
        raise UsageError("no prompt: give PROMPT arguments or --prompt-file PATH ('-' reads standard input)")
    for i, text in enumerate(texts):
        if not text.strip():
            raise UsageError(f"prompt {i} is empty")
    return texts


def prompts_from_file(path: str) -> list[str]:
    """Prompts from a file or, for '-', standard input: one per non-blank line, or JSON lines
    ({"prompt": TEXT}, or a JSON string) when the first non-blank line starts with '{'."""
    if path == "-":
        text = sys.stdin.read()
    else:
        try:
            text = Path(path).read_text()
        except OSError as e:
            raise UsageError(f"--prompt-file {path}: {e.strerror}") from None
    lines = [(n, line) for n, line in enumerate(text.splitlines(), 1) if line.strip()]
    if not lines or not lines[0][1].lstrip().startswith("{"):
        return [line for _, line in lines]
    prompts = []
    for n, line in lines:
        try:
            item = json.loads(line)
            prompts.append(item if isinstance(item, str) else item["prompt"])
        except (ValueError, KeyError, TypeError):
            raise UsageError(f"--prompt-file {path} line {n}: expected a JSON object with a \"prompt\" string "
                             "(the file's first line starts with '{', so every line is read as JSON)") from None
        if not isinstance(prompts[-1], str):
            raise UsageError(f"--prompt-file {path} line {n}: \"prompt\" must be a string")
    return prompts


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


def cut_at_stop(text: str, stops: list[str] | None) -> tuple[str, str | None]:
    """`text` up to and including the earliest stop string in it, and that string (None: none)."""
    hits = [(text.find(stop) + len(stop), stop) for stop in stops or () if stop in text]
    if not hits:
        return text, None
    end, stop = min(hits)
    return text[:end], stop


def stop_reason(ids: list[int], stop: str | None, cfg, max_new_tokens: int) -> str:
    """Why a row's generation ended: a stop string, the model's EOS, or the token budget."""
    if stop is not None:
        return f"stop string {stop!r}"
    if ids and ids[-1] in cfg.eos_token_ids:
        return "EOS (the model ended its answer)"
    if len(ids) >= max_new_tokens:
        return f"--max-new-tokens {max_new_tokens} reached"
    return "the end of the cache"


def preset_chat(model: str) -> bool:
    """Whether prompts to `model` go through its chat template when --chat is not given: the
    preset's "chat" setting (an instruct model answers a bare prompt with EOS at once); a checkpoint
    path, which may be a base model, takes the text as it is."""
    return model in list_presets() and load_preset(model).chat


def load_checked(a):
    """Everything a generation needs, each check before the step that costs time: the flags
    (check_generate_args), the prompts, then the model's config from its header (drafter checks
    against it), the tokenizer (prompt lengths against the context and --k-max), and only then
    the weights. Returns (cfg, params, tokenizer, prompt ids, prompt texts)."""
    check_generate_args(a)
    texts = read_prompt_texts(a)
    cfg = resolve_config(a.model)
    check_mesh_fits(a.mesh, cfg)
    if a.drafter is not None:
        check_drafter_spec(a.drafter, model_name=a.model, k_max=a.k_max, cfg=cfg, draft_vocab=a.draft_vocab or 0)
        check_shipped_drafter(a.drafter, a.model)
    tok = resolve_tokenizer(a.model)
    if tok is None:
        raise UsageError(no_tokenizer_message(a.model))
    if a.chat and not has_chat_template(tok):
        raise UsageError(f"--chat: {a.model} has no chat template (a base model?): drop --chat")
    chat = a.chat if a.chat is not None else preset_chat(a.model) and has_chat_template(tok)
    prompts = [prompt_ids(tok, text, chat) for text in texts]
    pack_prompts(cfg, prompts, a.max_new_tokens, speculative_slots(a.speculative))  # lengths vs the context
    if a.policy_constants:  # which constants a calibrated policy runs: never a silent choice
        print(f"[jspec] policy {a.policy}: {a.policy_constants}", file=sys.stderr)
    if a.policy_params is not None:  # LDLP's predictor, found by check_generate_args
        a.speculative = a.speculative.replace(policy_params=load_ldlp(str(a.policy_params))[0])
    t0 = time.perf_counter()
    cfg, params, _ = resolve_model(a.model, dtype=_dtype_arg(a.dtype), tokenizer=False)
    print(f"[jspec] {a.model}: loaded in {time.perf_counter() - t0:.1f}s, dtype {params['embed'].dtype}", file=sys.stderr)
    return cfg, params, tok, prompts, texts


def check_mesh_fits(mesh, cfg) -> None:
    """A tensor-parallel --mesh (model=N) splits this model's heads and MLP evenly (read from its
    header, before the weights load)."""
    try:
        check_tensor_parallel(cfg, axis_size(mesh, "model"))
    except ValueError as e:
        raise UsageError(f"--mesh: {e}") from None


def no_tokenizer_message(model: str) -> str:
    """Why a model has no tokenizer, in the words of its checkpoint kind."""
    path, kind, _ = resolve_checkpoint(model)
    if kind == "orbax":
        return (f"{model} has no tokenizer (an Orbax checkpoint written without one): convert it again from a source "
                "that has one")
    return f"{model} has no tokenizer: {path} holds none of {', '.join(TOKENIZER_FILES)}"


def cmd_generate(a) -> int:
    use_compile_cache(a.compile_cache)  # before the weights load: loading compiles programs too
    cfg, params, tok, prompts, _ = load_checked(a)
    sampling = Sampling(temperature=a.temperature, top_k=a.top_k, top_p=a.top_p)
    spec = a.speculative
    if spec is not None:
        drafter_spec = spec.drafter
        drafter, dparams = build_drafter(drafter_spec, cfg, params, model_name=a.model, k_max=spec.k_max,
                                         draft_vocab=spec.draft_vocab)
        spec = spec.replace(drafter=drafter, drafter_params=dparams)
        if is_auto(spec.policy):  # planned on the preset's committed cost table for this card, as `jspec bench` plans
            costs = load_costs(a.model if a.model in list_presets() else None, models_dir=str(models_dir()))
            rows = min(a.batch_size or len(prompts), len(prompts)) if a.no_stream else 1  # rows in flight
            plan = auto_plan(drafter, drafter_spec, a.model, costs, batch=rows, k_cap=spec.k_max, tree=spec.tree,
                             context=mean_context([len(p) for p in prompts], a.max_new_tokens), prompts=prompts,
                             sampling=sampling)
            tail = a.tail_rows
            if tail is None and default_tail_runs(cfg, prompts, a.batch_size, a.mesh, a.max_new_tokens, drafter,
                                                  spec.tree, spec.k_max):
                tail = tail_rows(drafter, costs, rows=rows, k_cap=spec.k_max, tree=spec.tree,
                                 context=mean_context([len(p) for p in prompts], a.max_new_tokens), prompts=prompts,
                                 sampling=sampling)
            print(f"[jspec] auto plan ({costs.get('card', '?')} costs, {rows} row(s)): {plan.describe()}, "
                  f"expected {plan.gain:.2f}x plain decoding"
                  f"{f'; the last {tail} rows in a {tail}-row tail, planned afresh' if tail else ''}", file=sys.stderr)
            spec = spec.replace(policy=plan)
    if not a.no_stream:  # each prompt streamed in turn
        for i, prompt in enumerate(prompts):
            if len(prompts) > 1:
                print(f"--- [{i}]", flush=True)
            _stream(a, cfg, params, tok, prompt, sampling, spec)
        return 0
    kw = dict(max_new_tokens=a.max_new_tokens, sampling=sampling, seed=a.seed, mesh=a.mesh, speculative=spec,
              invariant=a.invariant)
    if spec is not None and spec.engine is not None:
        if a.hrad:
            kw["speculative"] = spec.replace(policy_params=load_hrad(a.hrad, cfg))
        with CompileClock() as clock:
            res = generate(params, cfg, prompts, **kw)
        _print_rows(a, cfg, tok, res, len(prompts))
        print(f"[jspec] {clock.rates(int(res.lengths.sum()))}; engine {a.engine} on {res.devices} device(s), "
              f"gamma {res.gamma}: steps {res.target_calls.tolist()}, drafted {res.drafted.tolist()}, accepted "
              f"{res.accepted.tolist()}, rollback rate {res.rollback_rate:.3f}", file=sys.stderr)
        return 0
    if getattr(a, "batch_size", None) is not None:
        kw["batch_size"] = a.batch_size
        kw["tail_rows"] = a.tail_rows
    with CompileClock() as clock:
        res = generate(params, cfg, prompts, **kw)
    _print_rows(a, cfg, tok, res, len(prompts))
    n = int(res.lengths.sum())
    print(f"[jspec] {clock.rates(n)}; target calls {per_row(res.target_calls)}", file=sys.stderr)
    if spec is not None:
        mat = per_row((res.lengths / res.target_calls).round(2))
        rate = per_row((res.accepted / res.drafted.clip(1)).round(3))
        print(f"[jspec] drafter {a.drafter} policy {a.policy} verify {a.verify}{' tree' if spec.tree else ''}: "
              f"rounds {per_row(res.rounds)}, drafted {per_row(res.drafted)}, accepted {per_row(res.accepted)}, "
              f"acceptance {rate}, mean accepted tokens per target call {mat}", file=sys.stderr)
    return 0


def per_row(values) -> str:
    """A statistic of each prompt: one prompt's as a number (as a streamed prompt's is printed),
    several as a list in prompt order."""
    values = np.asarray(values).tolist()
    return str(values[0] if len(values) == 1 else values)


def _print_rows(a, cfg, tok, res, n_prompts: int) -> None:
    """The decoded rows of a batched result (each cut after a stop string), headed by their index
    when there are several, and why each row stopped."""
    for b in range(n_prompts):
        if n_prompts > 1:
            print(f"--- [{b}]")
        ids = res.row(b)
        text, stop = cut_at_stop(tok.decode(ids, skip_special_tokens=True), a.stop)
        print(text)
        label = f"row {b} " if n_prompts > 1 else ""
        print(f"[jspec] {label}stopped: {stop_reason(ids, stop, cfg, a.max_new_tokens)}", file=sys.stderr)


def _stream(a, cfg, params, tok, prompt, sampling, spec) -> None:
    """One prompt, printed as it is generated; stops at a stop string (the text up to and
    including it is printed); then why it stopped and the rates."""
    spec = planned_chain(spec)
    if spec is None:
        chunks = ((chunk, None) for chunk in generate_stream(params, cfg, prompt, max_new_tokens=a.max_new_tokens,
                                                              sampling=sampling, seed=a.seed))
    else:
        tokens, lens, cache_len = pack_stream_prompt(cfg, prompt, a.max_new_tokens, spec.k_max + 1, spec.drafter)
        chunks = speculative_stream(
            params, cfg, tokens, lens, jax.random.PRNGKey(a.seed), drafter=spec.drafter,
            drafter_params=spec.drafter_params, policy=spec.policy, policy_params=spec.policy_params,
            k_max=spec.k_max, max_new=a.max_new_tokens, cache_len=cache_len, sampling=sampling, verify=spec.verify_rule)
    ids: list[int] = []
    printed, stop, state = "", None, None
    with CompileClock() as clock:
        for chunk, state in chunks:
            ids += chunk
            text, stop = cut_at_stop(tok.decode(ids, skip_special_tokens=True), a.stop)
            print(text[len(printed):], end="", flush=True)
            printed = text
            if stop is not None:
                chunks.close()  # the rest of this prompt's generation is not run
                break
    print(flush=True)  # the prompt's text ends its line: the next prompt's header, or the shell's prompt, starts a new one
    print(f"[jspec] stopped: {stop_reason(ids, stop, cfg, a.max_new_tokens)}", file=sys.stderr)
    print(f"[jspec] {clock.rates(len(ids))}", file=sys.stderr)
    if spec is not None and state is not None:
        calls, drafted, accepted = (int(x) for x in jax.device_get((state.target_calls[0], state.drafted[0], state.accepted[0])))
        print(f"[jspec] drafter {a.drafter} policy {a.policy} verify {a.verify}: target calls {calls}, drafted {drafted}, "
              f"accepted {accepted} (acceptance {accepted / max(drafted, 1):.3f}), "
              f"mean accepted tokens per target call {len(ids) / max(calls, 1):.2f}", file=sys.stderr)


def planned_chain(spec: SpeculativeConfig | None) -> SpeculativeConfig | None:
    """A streamed prompt's settings: under an `auto` plan, the chain it planned (its drafter, policy
    and K; None when plain decoding is faster), as generate() runs a plan; else `spec` itself."""
    if spec is None or not isinstance(spec.policy, AutoPlan):
        return spec
    drafter, policy, k_max, _ = auto_budget(spec.policy, spec.drafter, spec.k_max, None)
    if drafter is None:
        return None
    if getattr(drafter, "block", False) and drafter.k_max != k_max:  # a block drafter drafts the planned k
        drafter = dataclasses.replace(drafter, k_max=k_max)
    return spec.replace(drafter=drafter, policy=policy, k_max=k_max)


def cmd_info(a) -> int:
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


def add_export_head_args(p) -> None:
    p.add_argument("--for", dest="engine", required=True, choices=ENGINES,
                   help="the serving engine whose loader the directory is written for")
    p.add_argument("--target", required=True,
                   help="the head's target: a preset, a checkpoint, or the target's Hugging Face config.json")
    p.add_argument("--head", default=None,
                   help="EAGLE head directory (default: the preset's shipped head of --kind)")
    p.add_argument("--kind", default="eagle3", choices=("eagle3", "eagle"), help="which shipped head, without --head")
    p.add_argument("--dtype", default=None, choices=("bfloat16", "float16", "float32"),
                   help="stored dtype (default: the head's own torch_dtype)")
    p.add_argument("--max-file-mb", type=float, default=0.0,
                   help="write the weights as Hugging Face shards of at most this many MiB each (0: one file)")
    p.add_argument("out", help="new directory to write (config.json + model.safetensors)")


def _target_config(target: str):
    """The target's ModelConfig, read from its header or config.json (no weights)."""
    if target.endswith(".json") and os.path.isfile(target):
        with open(target) as fh:
            return config_from_hf(json.load(fh))
    return resolve_config(target)


def cmd_export_head(a) -> int:
    if os.path.exists(a.out) and os.listdir(a.out):
        raise UsageError(f"{a.out} exists and is not empty: give export-head a new directory")
    if a.max_file_mb < 0:
        raise UsageError(f"--max-file-mb {a.max_file_mb:g}: must be 0 (one file) or a positive size")
    cfg = _target_config(a.target)  # a target that is not there fails first
    head = a.head or shipped_head_path(a.target, a.kind)
    if head is None:
        where = f"preset {a.target!r}" if a.target in list_presets() else f"{a.target} (not a preset)"
        raise UsageError(f"no {a.kind} head ships with {where}: pass --head DIR")
    hcfg, params = load_eagle_head(str(head), cfg)
    with open(os.path.join(head, CONFIG_FILE)) as fh:
        stored = json.load(fh).get("torch_dtype")
    dtype = a.dtype or (stored if stored in ("bfloat16", "float16", "float32") else "bfloat16")
    try:
        save_eagle_head(a.out, hcfg, params, dtype=dtype, engine=a.engine, max_file_bytes=mib_limit(a.max_file_mb))
    except ValueError as e:  # the engine cannot hold this head, or a tensor outgrows a file: nothing was written
        raise UsageError(str(e)) from None
    with open(os.path.join(a.out, CONFIG_FILE)) as fh:
        written = json.load(fh)
    note = ""
    if hcfg.kind == "eagle3":
        layers = written.get("eagle_aux_hidden_state_layer_ids") or (written.get("eagle_config") or {}).get(
            "eagle_aux_hidden_state_layer_ids") or "absent (the engine's default)"
        note = f", captured target layer inputs {list(hcfg.capture_layers)} written as {layers}"
    elif written.get("attention_bias"):
        note = ", fc bias folded into the attention biases"
    print(f"wrote {a.out} for {a.engine}: {hcfg.kind} as {written['architectures'][0]}, {dtype}{note}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    """The `jspec` command line's parser, every subcommand included (the training ones when their
    extras are installed)."""
    parser = argparse.ArgumentParser(prog="jspec", description="Dynamic speculative decoding in JAX")
    parser.add_argument("--version", action="version", version=f"jspec {__version__}")
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
    add_export_head_args(sub.add_parser("export-head", help="write an EAGLE head as SGLang or vLLM loads it"))
    calibrate = sub.add_parser("calibrate", help="fit draft-length policies' constants to an EAGLE head or a draft model on this card")
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
    return parser


def report_user_errors(run, prog: str = "jspec") -> int:
    """The exit code of run() (0 when it returns anything but an int: some mains return their rows),
    with what a user can get wrong printed as one line, `PROG: error: ...`, and exit code 2 (no
    traceback); `jspec` and the scripts under scripts/ both end here."""
    try:
        code = run()
        return code if isinstance(code, int) else 0
    except USER_ERRORS as e:
        print(f"{prog}: error: {' '.join(str(e).split())}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # `jspec ... | head` closed the pipe: stop quietly, as Unix tools do
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0


def main(argv=None) -> int:
    a = build_parser().parse_args(argv)

    def run():
        ensure_cpu_devices(getattr(a, "mesh", None))
        return run_command(a)

    return report_user_errors(run)


def mesh_device_count(spec: str) -> int:
    """Devices a --mesh spec asks for (the product of its sizes); 1 for a spec it cannot read
    (parse_mesh reports those)."""
    n = 1
    for part in spec.replace(" ", "").split(","):
        value = part.partition("=")[2]
        n *= int(value) if value.isdigit() and int(value) >= 1 else 1
    return n


def ensure_cpu_devices(mesh: str | None) -> None:
    """A --mesh of N devices on a CPU host: XLA's CPU backend shows one device unless
    --xla_force_host_platform_device_count says more. Add that flag (it affects only the CPU
    platform) before jax starts its backends; if they already run, parse_mesh names the shortfall."""
    if not mesh:
        return
    n = mesh_device_count(mesh)
    flags = os.environ.get("XLA_FLAGS", "")
    if n > 1 and "xla_force_host_platform_device_count" not in flags and not xla_bridge.backends_are_initialized():
        os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={n}".strip()


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
    if a.cmd == "export-head":
        return cmd_export_head(a)
    if a.cmd == "calibrate":
        from .bench.calibrate import run_calibrate

        return run_calibrate(a)
    if a.cmd == "train-ldlp":
        from .train.ldlp import run_train_ldlp

        return run_train_ldlp(a)
    return 1


if __name__ == "__main__":
    sys.exit(main())
