"""What a benchmarked method is: the interface every decoding method reports through."""

from __future__ import annotations

import dataclasses
from typing import Protocol, Sequence, runtime_checkable


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
        """Generate for exactly ``batch`` prompts; must return only once results are on the host."""


@dataclasses.dataclass(frozen=True)
class MethodSpec:
    """A method named on the command line: ``ar``, ``hf``, ``hf_pld`` or
    ``spec:<drafter>:<policy>[:tree]``."""

    method: str
    drafter: str | None = None
    policy: str | None = None
    tree: bool = False

    @property
    def name(self) -> str:
        if self.method == "spec":
            return ":".join(["spec", self.drafter or "", self.policy or ""] + (["tree"] if self.tree else []))
        if self.method == "hf" and self.drafter == "prompt_lookup":
            return "hf_pld"
        return self.method


def parse_method_spec(text: str) -> MethodSpec:
    text = text.strip()
    if text == "ar":
        return MethodSpec("ar")
    if text == "hf":
        return MethodSpec("hf")
    if text == "hf_pld":
        return MethodSpec("hf", drafter="prompt_lookup")
    parts = text.split(":")
    if parts[0] == "spec" and len(parts) in (3, 4) and parts[1] and parts[2]:
        if len(parts) == 4 and parts[3] != "tree":
            raise ValueError(f"method {text!r}: the optional 4th field must be 'tree'")
        return MethodSpec("spec", drafter=parts[1], policy=parts[2], tree=len(parts) == 4)
    raise ValueError(
        f"unknown method {text!r}; expected ar, hf, hf_pld or spec:<drafter>:<policy>[:tree]"
    )


def parse_method_specs(text: str) -> list[MethodSpec]:
    specs = [parse_method_spec(t) for t in text.split(",") if t.strip()]
    names = [s.name for s in specs]
    if len(set(names)) != len(names):
        raise ValueError(f"methods listed twice in {text!r}")
    return specs
