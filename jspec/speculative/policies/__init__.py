"""Dynamic draft-length policies, one file per method (protocol in `base`), and their registry.

    static.py   static K, max-confidence stop, transformers' heuristic +2/-1 schedule
    svip.py     SVIP entropy stop
    adaedl.py   AdaEDL entropy lower bound with an adaptive threshold
    tapout.py   TapOut bandit over parameter-free stop rules
    ldlp.py     AdaEAGLE's learnable draft-length predictor (LDLP) and its policy (+ DDD)
    adl.py      DiffuSpec's adaptive draft length
    auto.py     batch-aware budgets from a measured round-cost model (never planned slower than AR)

`make_policy(name, **fields)` builds one by name; `resolve_policy` turns what a caller passed
(None, a name or a Policy) into a Policy; `is_auto` says whether a call plans its budget first.
"""

from __future__ import annotations

import dataclasses

from .adaedl import AdaEDLPolicy
from .adl import ADLPolicy
from .auto import AutoPlan, AutoPolicy
from .base import Policy
from .ldlp import LDLPPolicy
from .static import ConfidencePolicy, HeuristicPolicy, StaticPolicy
from .svip import SVIPPolicy
from .tapout import TapOutPolicy


POLICY_NAMES = ("static", "confidence", "heuristic", "svip", "adaedl", "tapout", "ldlp", "adl", "auto")


_POLICY_CLASSES: dict[str, type[Policy]] = {
    cls.name: cls
    for cls in (
        StaticPolicy, ConfidencePolicy, HeuristicPolicy, SVIPPolicy, AdaEDLPolicy, TapOutPolicy,
        LDLPPolicy, ADLPolicy, AutoPolicy,
    )
}


assert tuple(_POLICY_CLASSES) == POLICY_NAMES


def make_policy(name: str, **overrides) -> Policy:
    """Build the policy called ``name`` (one of POLICY_NAMES) with field overrides, e.g.
    ``make_policy("adaedl", k_max=8, lambda_rule="B")``."""
    if name not in _POLICY_CLASSES:
        raise ValueError(f"unknown policy {name!r}; valid names: {', '.join(POLICY_NAMES)}")
    cls = _POLICY_CLASSES[name]
    fields = [f.name for f in dataclasses.fields(cls)]
    unknown = sorted(set(overrides) - set(fields))
    if unknown:
        hint = ""
        if name == "ldlp" and "params" in unknown:
            hint = " (predictor weights are state: pass them to init(batch, key, params=...))"
        raise ValueError(
            f"policy {name!r} has no field(s) {', '.join(unknown)}; valid fields: "
            f"{', '.join(fields)}{hint}"
        )
    return cls(**overrides)


def resolve_policy(policy, k_max: int):
    """A Policy object from None (static K), a policy name, or a Policy (returned as is)."""
    return make_policy(policy or "static", k_max=k_max) if policy is None or isinstance(policy, str) else policy


def is_auto(policy) -> bool:
    """Whether a call's policy is `auto`, whose budget is planned for the call before it runs: the
    name, the policy `make_policy("auto")` builds, or a plan already made (an AutoPlan). The one
    test `generate`, `jspec generate` and `jspec bench` use to plan."""
    return isinstance(policy, (AutoPolicy, AutoPlan)) or (isinstance(policy, str) and policy == "auto")
