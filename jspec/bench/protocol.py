"""What a benchmarked method is: the interface every decoding method reports through."""

from __future__ import annotations

import dataclasses
from typing import Any, Protocol, Sequence, runtime_checkable

from jspec.errors import UsageError
from jspec.speculative.drafters.eagle import EagleDrafter
from jspec.speculative.drafters.hybrid import HybridDrafter
from jspec.speculative.drafters.early_exit import EarlyExitDrafter
from jspec.speculative.drafters.model import ModelDrafter
from jspec.speculative.engines.specbranch import CUTS, SpecBranchConfig
from jspec.speculative.config import VERIFY_NAMES
from jspec.speculative.engines.tree import TreeConfig
from jspec.speculative.factory import DRAFTER_NAMES, check_drafter_spec
from jspec.speculative.policies import POLICY_NAMES, make_policy
from jspec.speculative.policies.calibration import CALIBRATED_POLICIES
from jspec.speculative.verify.consultant import DEFAULT_EPS, ConsultantRule


@dataclasses.dataclass
class RowResult:
    """One prompt's generation.

    ``target_calls`` counts target-model forward passes that produced tokens for this row, prefill
    included, so plain autoregressive decoding has ``target_calls == len(new_tokens)``.
    ``accepted`` counts drafted tokens the target kept (the bonus/correction token is not in it).
    The optional traces are per target call: ``draft_lengths[i]`` tokens were drafted for call i
    and ``step_tokens[i]`` tokens were added by it (bonus included).
    """

    new_tokens: list[int]
    target_calls: int
    drafted: int = 0
    accepted: int = 0
    draft_lengths: list[int] | None = None
    step_tokens: list[int] | None = None
    rolled_back: int | None = None  # parallel engines: drafted tokens thrown away


@runtime_checkable
class Method(Protocol):
    name: str  # unique label in a run, e.g. "spec:ngram:static"
    method: str  # "ar" | "spec" | "hf"
    drafter: str | None
    policy: str | None
    tree: bool
    dtype: str
    batch: int

    def prepare(self, example_prompts: Sequence[Sequence[int]]) -> float:
        """Warm up / compile, untimed; returns the seconds it took. ``example_prompts`` are all the
        prompts the timed calls will see, in order, padded to a multiple of ``batch``."""

    def run(self, prompts: Sequence[Sequence[int]]) -> list[RowResult]:
        """Generate for exactly ``batch`` prompts (every prompt of the run, ``batch`` rows in flight,
        for a method whose ``queue`` attribute is true); must return only once results are on the host."""


class MethodSpecError(UsageError):
    """A --methods entry that cannot run: bad syntax, unknown name, or a combination that fails."""


METHOD_GRAMMAR = """\
Methods (--methods, comma-separated; all are checked before any runs):
  ar                         jspec autoregressive decoding
  hf                         transformers generate (greedy) on the same checkpoint
  hf_pld                     transformers prompt-lookup decoding (batch 1 only)
  spec:DRAFTER[:ARG]:POLICY[:OPTION]...
    DRAFTER[:ARG]            ngram[:N]  early-exit[:E|:PATH]  model[:PATH]  eagle[:PATH]  eagle3[:PATH]
                             eagle3+ngram (trees only: the head's tree plus a prompt-lookup branch)
                             dlm[:PATH] (DiffuSpec; chains only, with static, heuristic or adl)
    POLICY                   a draft-length policy: {policies}; svip, adaedl, confidence, tapout
                             and ldlp with an EAGLE head run the constants `jspec calibrate` fit
                             for it on this card when there are some; POLICY:paper the paper's
    OPTION   tree            EAGLE-2 dynamic tree (EAGLE heads; EAGLE-2's top_k 10, depth 6, 59 nodes)
             nodes=N|auto    tree: draft nodes kept, i.e. EAGLE's total_token - 1 (auto: timed on
                             this device over EAGLE's candidates, default tree shape); implies tree
             topk=N depth=N  tree shape; imply tree
             siblings=top_k|sampled|auto   tree children when sampling: the head's top-k (EAGLE-2's rule),
                             or drawn from its q (recursive rejection; default auto: sampled unless the
                             policy cuts trees)
             ngram=N         eagle3+ngram: nodes of the n-gram branch beside the head's tree, up to 8,
                             deeper than the tree if need be (default the depth; with auto, the plan picks it)
             k=N             chain: most draft tokens per round (k_max; default --k-max, else 8)
             verify=token    sampled chains verified token by token (same law; default: block verification)
             verify=consultant   Consultant Decoding's LOSSY rule; eps=X and smoothing=B set it
             vocab=N         a draft model's chains score only the target's N most frequent answer tokens
             FIELD=VALUE     any field of the policy, e.g. threshold=0.4, lambda_rule=B,
                             arms=svip+adaedl (tuple fields: values joined by +)
  The positional fields come first: two of them are DRAFTER:POLICY, three DRAFTER:ARG:POLICY.
  e.g. spec:ngram:heuristic  spec:early-exit:8:svip:k=7  spec:eagle3:static:nodes=60  spec:dlm:adl
       spec:eagle3:svip:tree:depth=8  spec:eagle3:static:nodes=auto  spec:eagle:static:verify=consultant:eps=3
       spec:eagle3:svip:paper  spec:eagle3+ngram:auto:tree
  pearl:DRAFTER[:ARG][:OPTION]...       PEARL: a draft model drafts while the target verifies
  specbranch:DRAFTER[:ARG][:OPTION]...  SpecBranch: PEARL plus branch heads and hybrid draft lengths
  ppsd:DRAFTER[:ARG][:OPTION]...        PPSD: two-stage early-exit pipeline
    DRAFTER[:ARG]            pearl, specbranch: model[:PATH]; ppsd: early-exit[:PATH] (an exit head) or early-exit:E
    OPTION   pairs=N         device pairs, drafter and target on two devices each (default 1; 0: one device)
             gamma=N         window (pearl: default measured, round(t_target / t_draft); specbranch: 4)
             branches=N cut=none|confidence|hrad threshold=X hrad=DIR   specbranch (hrad=DIR implies cut=hrad)
  e.g. pearl:model:DRAFT_DIR  specbranch:model:DRAFT_DIR:branches=3:hrad=HRAD_DIR  ppsd:early-exit:EXIT_DIR:pairs=0
  Without a PATH, a drafter is the one the preset ships (early-exit: the preset's exit head, else early-exit:L//4).
"""

PARALLEL_METHODS = ("pearl", "specbranch", "ppsd")
PARALLEL_KEYS = {"pearl": ("pairs", "gamma"), "specbranch": ("pairs", "gamma", "branches", "cut", "threshold", "hrad"),
                 "ppsd": ("pairs",)}

TREE_KEYS = ("nodes", "topk", "depth", "ngram", "siblings")
# constants=paper|calibrated: which constants a calibrated policy runs with (written POLICY:paper)
ENGINE_KEYS = ("k", "verify", "eps", "smoothing", "constants", "vocab") + TREE_KEYS
POLICY_CONSTANTS = ("paper", "calibrated")


@dataclasses.dataclass(frozen=True)
class MethodSpec:
    """A method named on the command line: ``ar``, ``hf``, ``hf_pld`` or
    ``spec:<drafter>[:<arg>]:<policy>[:tree][:key=value]...`` (``METHOD_GRAMMAR``).

    ``options`` keeps the key=value options in the order given; ``name`` (a row's label) is the
    canonical spec text, so two specs that differ in any option are different rows."""

    method: str
    drafter: str | None = None
    policy: str | None = None
    tree: bool = False
    options: tuple[tuple[str, str], ...] = ()

    @property
    def name(self) -> str:
        if self.method == "spec":
            constants = [v for k, v in self.options if k == "constants"]
            parts = ["spec", self.drafter or "", self.policy or ""] + constants + (["tree"] if self.tree else [])
            return ":".join(parts + [f"{k}={v}" for k, v in self.options if k != "constants"])
        if self.method == "hf" and self.drafter == "prompt_lookup":
            return "hf_pld"
        if self.method in PARALLEL_METHODS:
            return ":".join([self.method, self.drafter or ""] + [f"{k}={v}" for k, v in self.options])
        return self.method

    @property
    def option_dict(self) -> dict[str, str]:
        return dict(self.options)

    @property
    def draft_vocab(self) -> int:
        """A draft model's draft vocabulary (vocab=N; 0: the whole vocabulary)."""
        return int(self.option_dict.get("vocab", 0))

    def generate_kwargs(self, default_k_max: int = 8) -> dict[str, Any]:
        """Keyword arguments of jspec.generate.generate for this method (checked by
        `check_method_spec`): drafter (spec string), policy (a name, or a Policy when fields are
        set), k_max, tree (True, "auto" or a TreeConfig) and verify; for the parallel engines:
        engine ("pearl", "ppsd" or a SpecBranchConfig), drafter, gamma and mesh (device pairs)."""
        if self.method in PARALLEL_METHODS:
            return self.parallel_kwargs()
        if self.method != "spec":
            return {}
        opts = self.option_dict
        k_max = int(opts.get("k", default_k_max))
        kwargs: dict[str, Any] = {"drafter": self.drafter, "k_max": k_max}
        tree = None
        if self.tree:
            if opts.get("nodes") == "auto":
                tree = "auto"
            else:
                base = TreeConfig()
                tree = TreeConfig(top_k=int(opts.get("topk", base.top_k)), depth=int(opts.get("depth", base.depth)),
                                  num_nodes=int(opts.get("nodes", base.num_nodes)), ngram=int(opts.get("ngram", 0)),
                                  siblings=opts.get("siblings", base.siblings))
                tree = True if tree == base else tree
            kwargs["tree"] = tree
        fields = {k: v for k, v in self.options if k not in ENGINE_KEYS}
        if fields:
            engine_k = (TreeConfig().depth if tree in (True, "auto") else tree.depth) if self.tree else k_max
            kwargs["policy"] = make_policy(self.policy, k_max=engine_k, **policy_fields(self.policy, fields))
        else:
            kwargs["policy"] = self.policy
        if opts.get("verify", "lossless") == "consultant":
            kwargs["verify"] = ConsultantRule(eps=float(opts.get("eps", DEFAULT_EPS)), smoothing=float(opts.get("smoothing", 0.0)))
        elif opts.get("verify") == "token":
            kwargs["verify"] = "token"
        return kwargs


    def parallel_kwargs(self) -> dict[str, Any]:
        opts = self.option_dict
        pairs = int(opts.get("pairs", 1))
        kwargs: dict[str, Any] = {"engine": self.method, "drafter": self.drafter,
                                  "mesh": f"data={pairs},role=2" if pairs else None}
        if self.method == "specbranch":
            cut = opts.get("cut", "hrad" if "hrad" in opts else "confidence")
            kwargs["engine"] = SpecBranchConfig(
                branches=int(opts.get("branches", 3)), gamma=int(opts.get("gamma", 4)), cut=cut,
                threshold=float(opts.get("threshold", SpecBranchConfig.threshold)))
        elif "gamma" in opts:
            kwargs["gamma"] = int(opts["gamma"])
        return kwargs


def policy_fields(policy: str, text_fields: dict[str, str]) -> dict[str, Any]:
    """Policy field values from option text, typed by each field's default (bool, int, float,
    str; tuples joined by '+'; None-default fields: int, else float, else str)."""
    if policy not in POLICY_NAMES:
        raise MethodSpecError(f"unknown policy {policy!r}; valid names: {', '.join(POLICY_NAMES)}")
    cls = type(make_policy(policy))
    defaults = {f.name: f.default for f in dataclasses.fields(cls)}
    out: dict[str, Any] = {}
    for key, text in text_fields.items():
        if key not in defaults:
            valid = ", ".join(sorted(set(defaults) - {"k_max"} - set(ENGINE_KEYS)) + list(ENGINE_KEYS))  # each once
            raise MethodSpecError(f"option {key}={text}: policy {policy!r} has no field {key!r}; valid options: {valid}")
        default = defaults[key]
        try:
            if isinstance(default, bool):
                if text.lower() not in ("true", "false", "1", "0"):
                    raise ValueError
                out[key] = text.lower() in ("true", "1")
            elif isinstance(default, int):
                out[key] = int(text)
            elif isinstance(default, float):
                out[key] = float(text)
            elif isinstance(default, tuple):
                out[key] = tuple(t for t in text.split("+") if t)
            elif default is None:
                out[key] = _number_or_text(text)
            elif isinstance(default, str):
                out[key] = text
            else:
                raise MethodSpecError(f"option {key}: policy field of type {type(default).__name__} cannot be set here")
        except ValueError:
            raise MethodSpecError(f"option {key}={text}: expected a {type(default).__name__}") from None
    return out


def _number_or_text(text: str):
    for cast in (int, float):
        try:
            return cast(text)
        except ValueError:
            pass
    return text


def _positive_int(key: str, text: str, spec: str) -> None:
    if not (text.isdigit() and int(text) >= 1):
        raise MethodSpecError(f"method {spec!r}: {key}={text} must be a positive integer")


def parse_method_spec(text: str) -> MethodSpec:
    """Parse one method (syntax and names); `check_method_spec` checks that it can run."""
    text = text.strip()
    if text == "ar":
        return MethodSpec("ar")
    if text == "hf":
        return MethodSpec("hf")
    if text == "hf_pld":
        return MethodSpec("hf", drafter="prompt_lookup")
    fields = text.split(":")
    if fields[0] in PARALLEL_METHODS:
        return _parse_parallel(text, fields)
    if fields[0] != "spec":
        raise MethodSpecError(f"unknown method {text!r}; expected ar, hf, hf_pld, spec:DRAFTER[:ARG]:POLICY[:OPTION]..., "
                              "pearl:..., specbranch:... or ppsd:... (see `jspec bench --help`)")
    is_option = [f == "tree" or "=" in f for f in fields[1:]]
    n_pos = is_option.index(True) if True in is_option else len(is_option)
    if any(not o for o in is_option[n_pos:]):
        raise MethodSpecError(f"method {text!r}: positional fields (drafter, policy) must come before the options")
    positional, raw_options = fields[1 : 1 + n_pos], fields[1 + n_pos :]
    if len(positional) >= 3 and positional[-1] in POLICY_CONSTANTS and positional[-2] in POLICY_NAMES:
        raw_options = [f"constants={positional[-1]}"] + raw_options  # spec:eagle3:svip:paper  spec:eagle3+ngram:auto:tree
        positional = positional[:-1]
    if len(positional) not in (2, 3) or not all(positional):
        raise MethodSpecError(f"method {text!r}: expected spec:DRAFTER:POLICY or spec:DRAFTER:ARG:POLICY, then options")
    drafter, policy = ":".join(positional[:-1]), positional[-1]
    if any(part.split(":")[0] not in DRAFTER_NAMES + ("eagle1",) for part in drafter.split("+")):
        raise MethodSpecError(f"method {text!r}: unknown drafter {drafter.split(':')[0]!r}; choose from {', '.join(DRAFTER_NAMES)}")
    if policy not in POLICY_NAMES:
        raise MethodSpecError(f"method {text!r}: unknown policy {policy!r}; valid names: {', '.join(POLICY_NAMES)}")
    options = _key_values(text, [raw for raw in raw_options if raw != "tree"])
    tree = "tree" in raw_options or any(k in TREE_KEYS for k, _ in options)
    return MethodSpec("spec", drafter=drafter, policy=policy, tree=tree, options=tuple(options))


def _parse_parallel(text: str, fields: list[str]) -> MethodSpec:
    method, rest = fields[0], fields[1:]
    n_pos = next((i for i, f in enumerate(rest) if "=" in f), len(rest))
    if any("=" not in f for f in rest[n_pos:]):
        raise MethodSpecError(f"method {text!r}: the drafter comes before the key=value options")
    if not 1 <= n_pos <= 2 or not all(rest[:n_pos]):
        raise MethodSpecError(f"method {text!r}: expected {method}:DRAFTER[:ARG] then key=value options")
    options = _key_values(text, rest[n_pos:])
    return MethodSpec(method, drafter=":".join(rest[:n_pos]), options=tuple(options))


def _key_values(text: str, raws: list[str]) -> list[tuple[str, str]]:
    """A method spec's key=value options, in order; each key once."""
    options, seen = [], set()
    for raw in raws:
        key, _, value = raw.partition("=")
        key, value = key.strip(), value.strip()
        if not key or not value or key in seen:
            raise MethodSpecError(f"method {text!r}: option {raw!r} must be key=value, each key once")
        seen.add(key)
        options.append((key, value))
    return options


def _check_parallel(spec: MethodSpec) -> None:
    text, opts = spec.name, spec.option_dict
    bad = [k for k in opts if k not in PARALLEL_KEYS[spec.method]]
    if bad:
        raise MethodSpecError(f"method {text!r}: unknown option {bad[0]!r}; {spec.method} takes "
                              f"{', '.join(PARALLEL_KEYS[spec.method])}")
    cls = check_drafter_spec(spec.drafter)
    want = EarlyExitDrafter if spec.method == "ppsd" else ModelDrafter
    if not issubclass(cls, want):
        need = "early-exit:PATH (an exit head) or early-exit:E" if spec.method == "ppsd" else "model[:PATH] (a draft model)"
        raise MethodSpecError(f"method {text!r}: {spec.method} drafts with {need}, not {spec.drafter!r}")
    for key in ("gamma", "branches"):
        if key in opts:
            _positive_int(key, opts[key], text)
    if "pairs" in opts and not opts["pairs"].isdigit():
        raise MethodSpecError(f"method {text!r}: pairs={opts['pairs']} must be an integer >= 0 (0: one device)")
    if "cut" in opts and opts["cut"] not in CUTS:
        raise MethodSpecError(f"method {text!r}: cut={opts['cut']}: choose from {', '.join(CUTS)}")
    if (opts.get("cut") == "hrad") != ("hrad" in opts) and not ("hrad" in opts and "cut" not in opts):
        raise MethodSpecError(f"method {text!r}: cut=hrad reads H-RAD weights: add hrad=DIR (and hrad=DIR only serves cut=hrad)")
    try:
        spec.parallel_kwargs()
    except ValueError as e:
        raise MethodSpecError(f"method {text!r}: {e}") from None


def check_method_spec(spec: MethodSpec) -> None:
    """Everything about a spec method that can be checked without a model: option values, policy
    fields, drafter/policy/tree/verify compatibility. Raises MethodSpecError (or DrafterError)."""
    if spec.method in PARALLEL_METHODS:
        _check_parallel(spec)
        return
    if spec.method != "spec":
        return
    text, opts = spec.name, spec.option_dict
    drafter_cls = check_drafter_spec(spec.drafter)
    for key in ("k", "topk", "depth", "ngram"):
        if key in opts:
            _positive_int(key, opts[key], text)
    if issubclass(drafter_cls, HybridDrafter) and not spec.tree:
        raise MethodSpecError(f"method {text!r}: {spec.drafter} drafts trees (a head tree plus an n-gram branch): add :tree")
    if "ngram" in opts and not issubclass(drafter_cls, HybridDrafter):
        raise MethodSpecError(f"method {text!r}: ngram=N sets a hybrid tree's n-gram branch: use eagle3+ngram")
    if "vocab" in opts:
        _positive_int("vocab", opts["vocab"], text)
        if not issubclass(drafter_cls, ModelDrafter) or spec.tree:
            raise MethodSpecError(f"method {text!r}: vocab=N gives a draft model's chains a draft vocabulary: use "
                                  f"spec:model[:PATH]:POLICY without tree")
    if "siblings" in opts and opts["siblings"] not in ("auto", "top_k", "sampled"):
        raise MethodSpecError(f"method {text!r}: siblings={opts['siblings']}: choose auto, top_k or sampled")
    if "nodes" in opts and opts["nodes"] != "auto":
        _positive_int("nodes", opts["nodes"], text)
    if opts.get("nodes") == "auto" and ({"topk", "depth"} & set(opts)):
        raise MethodSpecError(f"method {text!r}: nodes=auto times EAGLE-2's default tree (top_k 10, depth 6); drop topk/depth")
    if "constants" in opts and (opts["constants"] not in POLICY_CONSTANTS or spec.policy not in CALIBRATED_POLICIES):
        raise MethodSpecError(f"method {text!r}: :paper / :calibrated choose the constants of {', '.join(CALIBRATED_POLICIES)}")
    if "verify" in opts and opts["verify"] not in VERIFY_NAMES:
        raise MethodSpecError(f"method {text!r}: verify={opts['verify']}: choose {', '.join(VERIFY_NAMES)}")
    if ({"eps", "smoothing"} & set(opts)) and opts.get("verify") != "consultant":
        raise MethodSpecError(f"method {text!r}: eps / smoothing set Consultant Decoding: add verify=consultant")
    if spec.tree:
        if not issubclass(drafter_cls, (EagleDrafter, HybridDrafter)):
            raise MethodSpecError(f"method {text!r}: trees need an EAGLE head drafter (eagle, eagle3, eagle3+ngram), "
                                  f"not {spec.drafter!r}")
        if "k" in opts:
            raise MethodSpecError(f"method {text!r}: k sets a chain's draft length; a tree's is depth=N")
        if opts.get("verify") in ("consultant", "token"):
            raise MethodSpecError(f"method {text!r}: verify={opts['verify']} verifies chains, not trees")
    try:
        kwargs = spec.generate_kwargs()  # builds the TreeConfig, the policy with its fields, the rule
        policy = kwargs["policy"]
        if isinstance(policy, str):
            policy = make_policy(policy)
    except ValueError as e:  # MethodSpecError included: name the method
        raise MethodSpecError(f"method {text!r}: {e}" if not str(e).startswith("method ") else str(e)) from None
    if drafter_cls.parallel and policy.needs_draft_logits:
        raise MethodSpecError(f"method {text!r}: policy {spec.policy!r} reads draft distributions, which the "
                              f"{spec.drafter!r} drafter does not have; use static, heuristic or adl")


def parse_method_specs(text: str) -> list[MethodSpec]:
    """Parse and check every method of a --methods list, before any runs."""
    specs = [parse_method_spec(t) for t in text.split(",") if t.strip()]
    names = [s.name for s in specs]
    if len(set(names)) != len(names):
        raise MethodSpecError(f"methods listed twice in {text!r}")
    for spec in specs:
        check_method_spec(spec)
    return specs
