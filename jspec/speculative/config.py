"""SpeculativeConfig: every setting of speculative decoding in one frozen object, checked when built.

    from jspec.generate import SpeculativeConfig, generate
    spec = SpeculativeConfig(drafter="eagle3", policy="svip", tree=True)
    generate(params, cfg, prompts, speculative=spec)

It groups what belongs together, as vLLM's SpeculativeConfig does: the drafter (and its weights),
the draft-length policy (and its weights), the chain length k_max or an EAGLE-2 tree, the verify
rule, and the parallel engines' schedule (engine, gamma). A combination that cannot run fails
here, with a one-line ValueError, instead of at run time or, worse, by being ignored: a tree with
Consultant Decoding, gamma without PEARL or SpecBranch, a policy with a parallel engine. The
command line's flags (`jspec generate --drafter/--policy/--k-max/--verify/--engine/--gamma`) and
the bench's method grammar (`spec:DRAFTER:POLICY:OPTION...`, `pearl:...`) map onto its fields one
to one.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from .drafters.eagle import EagleDrafter
from .drafters.hybrid import HybridDrafter
from .engines.specbranch import SpecBranchConfig
from .engines.tree import TreeConfig
from .factory import check_drafter_name
from .policies import POLICY_NAMES, AutoPlan, Policy
from .verify.consultant import DEFAULT_EPS, LOSSLESS_RULES, ConsultantRule

ENGINES = ("pearl", "ppsd", "specbranch")
VERIFY_NAMES = LOSSLESS_RULES + ("consultant",)
TREE_DRAFTERS = ("eagle", "eagle1", "eagle3")


@dataclasses.dataclass(frozen=True, eq=False)
class SpeculativeConfig:
    """Speculative decoding's settings (see the module docstring).

    drafter         a spec string for jspec.speculative.factory.build_drafter ("ngram:3",
                    "eagle3", "model:PATH", ...) or a drafter object with `drafter_params`
    drafter_params  the drafter object's weights (None for a spec string: built from it)
    policy          draft-length policy: a name (jspec.speculative.policies), a Policy, or `auto`
                    ("auto" or make_policy("auto"): planned for each call; an AutoPlan: that plan);
                    None = static K = k_max
    policy_params   the policy's weights (LDLP's predictor; SpecBranch's H-RAD weights)
    k_max           most draft tokens per round of a chain (a tree's is its depth)
    tree            None (chains), True (EAGLE-2's default tree), "auto" (num_nodes timed on this
                    device) or a TreeConfig: EAGLE-2 dynamic trees, EAGLE heads only (eagle3+ngram
                    drafts trees only)
    verify          "lossless" (greedy identity; sampled chains: block verification, trees: recursive
                    rejection), "token" (sampled chains verified token by token: the same law, fewer
                    tokens accepted; chains only), or Consultant Decoding's LOSSY rule: "consultant"
                    (eps DEFAULT_EPS) or a ConsultantRule; chains only
    engine          None (chains / trees), "pearl", "ppsd", "specbranch" or a SpecBranchConfig:
                    draft while the target verifies; policies, trees and verify rules do not apply
    gamma           PEARL's window (None: measured once per process); SpecBranch's is its config's
    draft_vocab     a draft model ("model:...") scores only the target's N most frequent answer
                    tokens (FR-Spec; the preset's token_counts.npz); 0: the whole vocabulary. Chains only
    """

    drafter: Any
    drafter_params: Any = None
    policy: Any = None
    policy_params: Any = None
    k_max: int = 8
    tree: Any = None
    verify: Any = "lossless"
    engine: Any = None
    gamma: int | None = None
    draft_vocab: int = 0

    def __post_init__(self):
        if self.drafter is None:
            raise ValueError("SpeculativeConfig needs a drafter (e.g. 'ngram', 'eagle3', 'model:PATH'); "
                             "for autoregressive decoding pass speculative=None")
        if isinstance(self.drafter, str):
            check_drafter_name(self.drafter)  # what a path holds is checked where the drafter is built
        self._check_draft_vocab()
        self._check_policy()
        if isinstance(self.verify, str) and self.verify not in VERIFY_NAMES or not isinstance(self.verify, (str, ConsultantRule)):
            raise ValueError(f"verify={self.verify!r}: choose {', '.join(map(repr, VERIFY_NAMES))} or a ConsultantRule")
        if self.engine is not None:
            self._check_engine()
            return
        if self.gamma is not None:
            raise ValueError("gamma sets PEARL's window: add engine='pearl' (chains take k_max)")
        if isinstance(self.k_max, bool) or not isinstance(self.k_max, int) or self.k_max < 1:
            raise ValueError(f"k_max must be an integer >= 1, got {self.k_max!r}")
        if self.tree is not None:
            self._check_tree()
        elif self._is_hybrid():
            raise ValueError(f"drafter {getattr(self.drafter, 'name', self.drafter)!r} drafts trees (the head's tree "
                             "plus an n-gram branch): add tree=True or a TreeConfig")

    def _check_draft_vocab(self) -> None:
        if not self.draft_vocab:
            return
        if isinstance(self.draft_vocab, bool) or not isinstance(self.draft_vocab, int) or self.draft_vocab < 1:
            raise ValueError(f"draft_vocab must be an integer >= 1 (0: the whole vocabulary), got {self.draft_vocab!r}")
        if not isinstance(self.drafter, str):  # a drafter object carries its own draft vocabulary
            if getattr(self.drafter, "draft_vocab", None) != self.draft_vocab:
                raise ValueError("draft_vocab is built into a drafter object (ModelDrafter.draft_vocab with "
                                 "jspec.speculative.drafters.model.restrict_vocab): pass 0 here, or a spec string")
        elif self.drafter.partition(":")[0] != "model":
            raise ValueError(f"draft_vocab restricts a draft model's LM head: use drafter='model[:PATH]', not {self.drafter!r}")
        if self.engine is not None or self.tree is not None:
            raise ValueError("draft_vocab restricts a draft model's chains: drop tree / engine")

    def _check_policy(self) -> None:
        if self.policy is None or isinstance(self.policy, (Policy, AutoPlan)):
            return
        if isinstance(self.policy, str) and self.policy in POLICY_NAMES:
            return
        raise ValueError(f"policy={self.policy!r}: choose a name ({', '.join(POLICY_NAMES)}), a Policy "
                         "(jspec.speculative.policies.make_policy) or an AutoPlan")

    def _is_hybrid(self) -> bool:
        return isinstance(self.drafter, HybridDrafter) or (isinstance(self.drafter, str) and "+" in self.drafter)

    def _check_tree(self) -> None:
        if not (self.tree is True or self.tree == "auto" or isinstance(self.tree, TreeConfig)):
            raise ValueError(f"tree={self.tree!r}: expected None, True, 'auto' or a TreeConfig")
        if self.verify != "lossless":
            rule = "token-by-token verification" if self.verify == "token" else "Consultant Decoding"
            raise ValueError(f"{rule} verifies chains, not trees (sampled trees use recursive rejection): drop tree "
                             "or use verify='lossless'")
        if isinstance(self.drafter, str):  # a hybrid "eagle3+ngram" draws its tree from the head
            ok = all(part.partition(":")[0] in TREE_DRAFTERS or part.partition(":")[0] == "ngram"
                     for part in self.drafter.split("+")) and any(
                part.partition(":")[0] in TREE_DRAFTERS for part in self.drafter.split("+"))
        else:
            ok = isinstance(self.drafter, (EagleDrafter, HybridDrafter))
        if not ok:
            raise ValueError(f"trees need an EAGLE head drafter (eagle, eagle3, or eagle3+ngram), got "
                             f"{getattr(self.drafter, 'name', self.drafter)!r}")

    def _check_engine(self) -> None:
        name = "specbranch" if isinstance(self.engine, SpecBranchConfig) else self.engine
        if name not in ENGINES:
            raise ValueError(f"unknown engine {self.engine!r}; choose from {', '.join(ENGINES)} or a SpecBranchConfig")
        given = [f for f, v in (("policy", self.policy), ("tree", self.tree)) if v is not None]
        given += ["verify"] if self.verify != "lossless" else []
        given += ["k_max"] if self.k_max != 8 else []
        if given:
            raise ValueError(f"engine={name!r} has its own schedule: {', '.join(given)} do not apply")
        if self.gamma is not None and name != "pearl":
            raise ValueError(f"gamma is PEARL's window; {'PPSD drafts one token a tick' if name == 'ppsd' else 'SpecBranch takes SpecBranchConfig(gamma=...)'}")
        if self.gamma is not None and (not isinstance(self.gamma, int) or self.gamma < 1):
            raise ValueError(f"gamma must be an integer >= 1, got {self.gamma!r}")
        if self.policy_params is not None and name != "specbranch":
            raise ValueError(f"engine={name!r} takes no policy_params (H-RAD weights are SpecBranch's)")

    @property
    def verify_rule(self):
        """"lossless", "token" or a ConsultantRule ("consultant" is one with the default eps)."""
        return ConsultantRule(eps=DEFAULT_EPS) if self.verify == "consultant" else self.verify

    def replace(self, **changes) -> "SpeculativeConfig":
        return dataclasses.replace(self, **changes)
