"""Calibration: fit a policy's constants to one drafter on one card, from recorded rounds.

The seed policies' constants were set for 7B-class drafters; a small EAGLE head is sure of itself
in other places, and SVIP with its paper constants drafts 1.35 tokens a round with jspec's head.
`jspec calibrate` (jspec.bench.calibrate) fits them instead, cheaply:

1. Record (`RecordingPolicy`): generate from training-side prompts with a static chain of k_max
   drafts every round, recording per row, round and draft step the draft distribution's
   `DraftStats` (entropy, top two probabilities, the drafted token's log q), per round the drafted
   and accepted counts, and LDLP's predicted length when predictor weights are given.
2. Replay (`replay`): run a policy's own rules (start_round, stop_from_stats, stop_skips_token,
   update) over the recorded rounds. A round the policy ends after L drafts accepts min(n, L) of
   them, n the recorded accepted count (greedy drafts do not depend on where the round stops), and
   costs fixed + S * step + verify(k_max + 1) µs (the chain engine verifies its padded block whatever
   L is), S the draft forwards run: L, or L + 1 where the stop dropped the token it checked (AdaEDL:
   its forward ran all the same). `jspec calibrate` times fixed and step on this card, from static
   chains drafting 2 and k_max of the same block (`RoundCost.timed`); the cost table gives the
   verify sizes (and everything with `--round-cost table`). Stateful rules (AdaEDL's lambda,
   TapOut's bandit) follow each row's rounds in order.
3. Fit (`fit_policy`): grid search over CALIBRATION_GRIDS for the most tokens per µs, every grid
   point replayed at once (`jax.vmap` over the constants). TapOut's arms take the SVIP, max-
   confidence and AdaEDL fits of the same run; LDLP fits an offset added to its prediction.

The result is written to the user cache (`user_calibration_path`: $JSPEC_CACHE/calibration/<head
fingerprint>.json, one entry per card; `save_calibration`), never into the repository: the fits
shipped beside a head (<head>/jspec/calibration.json) are only read. `calibrated_constants` reads
this card's fit back, the user's first; `policy_from_constants` builds the policy. The paper's
constants stay the dataclass defaults (`svip:paper` in a policy spec).
Each fit records the fingerprint of the head weights it was recorded with (`head_fingerprint`):
a head retrained in place accepts differently, so a fit of its predecessor is not used for it.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import itertools
import json
import re
import warnings
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from ...user_cache import user_cache_dir
from . import make_policy
from .auto import CostModel
from .base import DraftStats, Policy, draft_stats, full_limit
from .ldlp import ldlp_apply, length_from_prediction

CALIBRATION_DIR = "jspec"  # a jspec-only folder beside the head's own files (other loaders never read it)
CALIBRATION_FILE = "calibration.json"
CALIBRATION_FORMAT = "jspec-calibration-1"
USER_CALIBRATION_DIR = "calibration"  # under the user cache: `jspec calibrate`'s fits, a file per head's weights

# The constants each calibrated policy fits, with the grid searched. The other fields keep the
# paper's values. TapOut's svip / adaedl arms and its max-confidence arm's start come from the fits
# of svip, adaedl and confidence (`fit_all` fits those first).
CALIBRATION_GRIDS: dict[str, dict[str, tuple]] = {
    "confidence": {"threshold": tuple(np.round(np.arange(0.05, 0.951, 0.05), 2).tolist())},
    "svip": {"threshold": tuple(np.round(np.arange(0.05, 1.251, 0.05), 2).tolist())},
    "adaedl": {"gamma": (0.05, 0.1, 0.2, 0.4), "target_rate": (0.5, 0.6, 0.7, 0.8, 0.9), "lambda_init": (0.2, 0.5),
               "keep_checked_token": (False, True)},
    "tapout": {"max_conf_threshold": (0.2, 0.3, 0.4, 0.5, 0.6, 0.7), "exploration": (0.1, 0.3, 1.0)},
    "ldlp": {"length_offset": tuple(np.arange(-2.0, 3.01, 0.5).tolist())},
}
CALIBRATED_POLICIES = tuple(CALIBRATION_GRIDS)


# ---- 1. recording ---------------------------------------------------------------------------------


@struct.dataclass
class RecordState:
    stats: jax.Array  # [B, R, K, 4] float32: DraftStats fields per round and draft step
    drafted: jax.Array  # [B, R] int32
    accepted: jax.Array  # [B, R] int32
    predicted: jax.Array  # [B, R] float32: LDLP's predicted length (nan without predictor weights)
    ldlp: Any  # LDLP predictor weights (shared by the rows) or None
    rounds: jax.Array  # [B] int32


@dataclasses.dataclass(frozen=True)
class RecordingPolicy(Policy):
    """Static K = k_max that records what calibration replays (module doc). max_rounds: rounds
    kept per row (a row's later rounds are dropped; generate's max_new_tokens is enough)."""

    name = "record"
    needs_draft_logits = True

    max_rounds: int = 256

    @property
    def stops_in_round(self) -> bool:  # type: ignore[override]
        return False  # it only records: every round drafts k_max

    def init(self, batch, key, params=None):
        del key
        k = self._required_k_max()
        return RecordState(
            stats=jnp.zeros((batch, self.max_rounds, k, 4), jnp.float32),
            drafted=jnp.zeros((batch, self.max_rounds), jnp.int32),
            accepted=jnp.zeros((batch, self.max_rounds), jnp.int32),
            predicted=jnp.full((batch, self.max_rounds), jnp.nan, jnp.float32),
            ldlp=None if params is None else jax.tree_util.tree_map(jnp.asarray, params),
            rounds=jnp.zeros((batch,), jnp.int32),
        )

    def round_limit(self, state, k_max, features=None):
        self._check_k_max(k_max)
        return full_limit(state.rounds.shape[0], k_max)

    def start_round(self, state, k_max, features=None):
        limit = self.round_limit(state, k_max, features)
        if state.ldlp is None or not features:
            return state, limit
        pred = ldlp_apply(state.ldlp, features["token_embedding"], features["target_feature"])
        rows = jnp.arange(limit.shape[0])
        return state.replace(predicted=state.predicted.at[rows, state.rounds].set(pred, mode="drop")), limit

    def observe(self, state, step, draft_logits, draft_token=None):
        st = draft_stats(draft_logits, draft_token)
        values = jnp.stack([st.entropy, st.top1, st.top2, st.token_logprob], -1)  # [B, 4]
        rows = jnp.arange(values.shape[0])
        stats = state.stats.at[rows, state.rounds, step].set(values, mode="drop")
        return state.replace(stats=stats), jnp.zeros(values.shape[:1], bool)

    def update(self, state, n_drafted, n_accepted, active):
        rows = jnp.arange(n_drafted.shape[0])
        at = jnp.where(active, state.rounds, self.max_rounds)  # finished rows: dropped
        return state.replace(drafted=state.drafted.at[rows, at].set(n_drafted, mode="drop"),
                             accepted=state.accepted.at[rows, at].set(n_accepted, mode="drop"),
                             rounds=state.rounds + active.astype(jnp.int32))


@dataclasses.dataclass
class Records:
    """Recorded rounds on the host, one row per prompt: stats [N, R, K, 4], drafted / accepted /
    predicted [N, R], rounds [N] (valid rounds per row)."""

    stats: np.ndarray
    drafted: np.ndarray
    accepted: np.ndarray
    predicted: np.ndarray
    rounds: np.ndarray

    @classmethod
    def from_state(cls, state: RecordState) -> "Records":
        st = jax.device_get(state)
        rounds = np.minimum(np.asarray(st.rounds), st.drafted.shape[1])
        return cls(np.asarray(st.stats), np.asarray(st.drafted), np.asarray(st.accepted), np.asarray(st.predicted), rounds)

    @classmethod
    def concat(cls, parts: list["Records"]) -> "Records":
        return cls(*(np.concatenate([getattr(p, f.name) for p in parts]) for f in dataclasses.fields(cls)))

    @property
    def k_max(self) -> int:
        return self.stats.shape[2]

    @property
    def n_rounds(self) -> int:
        return int(self.rounds.sum())

    @property
    def has_predictions(self) -> bool:
        live = np.arange(self.drafted.shape[1])[None] < self.rounds[:, None]
        return bool(np.isfinite(self.predicted[live]).all()) and bool(live.any())


# ---- 2. replay ------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class RoundCost:
    """µs of a chain round's parts at one batch size (a card's cost table, or timed: `timed`)."""

    fixed_us: float  # a round but its draft steps and verify: draft start less one step (its first token) + overhead
    step_us: float  # one draft step
    verify_us: tuple[float, ...]  # verify_us[k] = the target's forward over k + 1 tokens

    @classmethod
    def from_table(cls, costs: dict, batch: int, k_max: int, drafter_key: str | None = None,
                   step_fraction: float | None = None) -> "RoundCost":
        """The table's parts; a draft model's step (`drafter_key`) its own, or `step_fraction` of the
        AR step where the table has not measured it (CostModel)."""
        cm = CostModel(costs, batch, drafter_key=drafter_key, step_fraction=step_fraction)
        # the table's draft loop of L tokens is first + (L - 1) steps, the replay's fixed + L steps
        fixed = cm.draft_first() - cm.draft_step() + cm.overhead(False)
        return cls(fixed, cm.draft_step(), tuple(cm.verify(k + 1) for k in range(k_max + 1)))

    @classmethod
    def timed(cls, table: "RoundCost", k_max: int, round_us: dict[int, float], ar_us: float) -> "RoundCost":
        """The table's verify shape with the round's other parts from timed chain programs:
        round_us {L: µs} of static chains drafting L of a k_max block (two lengths or more) and ar_us
        (µs a token of plain decoding). A part timed alone in a loop can cost far more than it adds
        inside the compiled round (H200, head v8: the table's 62 µs draft step against 27-29 µs in
        the timed chains), and the fit then stops too early; the slope between the lengths is the
        draft step as the engine runs it. Raises ValueError on a slope that is not positive."""
        (lo, r_lo), (hi, r_hi) = min(round_us.items()), max(round_us.items())
        step = (r_hi - r_lo) / max(hi - lo, 1)
        if not step > 0:
            timed = ", ".join(f"K = {k}: {v:.0f} µs" for k, v in sorted(round_us.items()))
            raise ValueError(f"timed rounds ({timed}) give a draft step of {step:.0f} µs")
        return cls(r_hi - hi * step - table.verify_us[k_max], step, (ar_us, *table.verify_us[1:]))

    @property
    def ar_us(self) -> float:
        return self.verify_us[0]

    def scaled(self, factor: float) -> "RoundCost":
        """Every part `factor` times as long (another card's table at this card's speed)."""
        return RoundCost(self.fixed_us * factor, self.step_us * factor, tuple(v * factor for v in self.verify_us))


def replay(policy: Policy, rec: Records, k_max: int, cost: RoundCost, limits: jax.Array | None = None) -> dict[str, jax.Array]:
    """Run `policy` over the recorded rounds (module doc): totals of tokens, drafted tokens, rounds
    and µs. `limits` [N, R]: per-round limits to use instead of the policy's round_limit (LDLP's
    recorded prediction). Jittable and vmappable over the policy's constants."""
    if k_max > rec.k_max:
        raise ValueError(f"replay at k_max={k_max} needs rounds recorded with k_max >= {k_max}, got {rec.k_max}")
    stats, drafted, accepted = jnp.asarray(rec.stats), jnp.asarray(rec.drafted), jnp.asarray(rec.accepted)
    N, R = drafted.shape
    rounds = jnp.asarray(rec.rounds)

    def one_round(state, r):
        if limits is None:
            state, limit = policy.start_round(state, k_max, None)
        else:
            limit = limits[:, r]
        s = stats[:, r]
        stat = [DraftStats(s[:, i, 0], s[:, i, 1], s[:, i, 2], s[:, i, 3]) for i in range(k_max)]
        # the chain engine's draft loop (engines.chain.draft_autoregressive), on recorded statistics
        n_drafted = jnp.ones((N,), jnp.int32)
        n_steps = jnp.ones((N,), jnp.int32)  # draft forwards run: a token a stop drops was computed too
        active = (limit > 1) & ~policy.stop_from_stats(state, 0, stat[0])
        for i in range(1, k_max):
            stop = policy.stop_from_stats(state, i, stat[i])
            now = active & ~(stop & policy.stop_skips_token(state))
            n_steps = n_steps + active.astype(jnp.int32)
            n_drafted = n_drafted + now.astype(jnp.int32)
            active = now & (i + 1 < limit) & ~stop
        cap = jnp.maximum(drafted[:, r], 1)  # a recorded EOS ended the draft
        n_drafted, n_steps = jnp.minimum(n_drafted, cap), jnp.minimum(n_steps, cap)
        n_acc = jnp.minimum(accepted[:, r], n_drafted)
        live = r < rounds
        state = policy.update(state, n_drafted, n_acc, live)
        us = cost.fixed_us + n_steps * cost.step_us + cost.verify_us[k_max]
        return state, (jnp.where(live, n_acc + 1, 0), jnp.where(live, n_drafted, 0), jnp.where(live, us, 0.0))

    state = policy.init(N, jax.random.PRNGKey(0))
    _, (tokens, n_drafted, us) = jax.lax.scan(one_round, state, jnp.arange(R))
    return {"tokens": tokens.sum(), "drafted": n_drafted.sum(), "rounds": rounds.sum(), "us": us.sum()}


def summary(totals: dict, cost: RoundCost) -> dict[str, float]:
    """Per-round numbers and the speed-up over plain decoding (AR: one token per verify(1))."""
    t = {k: float(v) for k, v in totals.items()}
    rounds = max(t["rounds"], 1.0)
    return {"tokens_per_round": t["tokens"] / rounds, "drafted_per_round": t["drafted"] / rounds,
            "round_us": t["us"] / rounds, "speedup_vs_ar": t["tokens"] * cost.ar_us / max(t["us"], 1e-9)}


def static_summary(rec: Records, k: int, cost: RoundCost) -> dict[str, float]:
    """Static K = k replayed on the same rounds (the baseline calibrated policies must beat)."""
    return summary(replay(make_policy("static", k_max=k), rec, k, cost), cost)


def oracle_summary(rec: Records, k: int, cost: RoundCost) -> dict[str, float]:
    """A stop rule that knew each round's accepted count and drafted exactly that many (at least
    one, at most k), replayed on the same rounds: the most tokens per µs any draft-length policy
    can reach with this head on this card, so how far a calibrated policy is from what stopping
    can give at all. A round that accepted every recorded draft counts as reaching k."""
    limits = jnp.clip(jnp.asarray(rec.accepted), 1, k)
    return summary(replay(make_policy("static", k_max=k), rec, k, cost, limits=limits), cost)


def recorded_acceptance(rec: Records) -> float:
    """The per-token acceptance of the recorded chains as `auto` models it (a draft is accepted with
    probability a given its predecessor was): the geometric model's maximum-likelihood fit, accepted
    drafts over accepted drafts plus first rejections (a round that accepted all it drafted, or
    whose draft an EOS ended, shows no rejection)."""
    live = np.arange(rec.drafted.shape[1])[None] < rec.rounds[:, None]
    accepted, drafted = rec.accepted[live], rec.drafted[live]
    total = float(accepted.sum())
    return total / max(total + float((accepted < drafted).sum()), 1.0)


# ---- 3. fitting -----------------------------------------------------------------------------------


def policy_from_constants(name: str, constants: dict, k_max: int) -> Policy:
    """The policy `name` with calibrated constants; a dict value for a field whose default is a
    policy (TapOut's svip / adaedl arms) sets that policy's fields."""
    base = make_policy(name, k_max=k_max)
    fields = {}
    for key, value in constants.items():
        default = getattr(base, key)
        fields[key] = dataclasses.replace(default, **value) if isinstance(value, dict) and isinstance(default, Policy) else value
    return dataclasses.replace(base, **fields)


def _grid(name: str, base_constants: dict) -> list[dict]:
    keys, values = zip(*CALIBRATION_GRIDS[name].items())
    return [{**base_constants, **dict(zip(keys, combo))} for combo in itertools.product(*values)]


def fit_policy(name: str, rec: Records, k_max: int, cost: RoundCost, base_constants: dict | None = None) -> dict[str, Any]:
    """Grid-search `name`'s constants on the recorded rounds for the most tokens per µs. Returns
    {"constants", "calibrated": summary, "paper": summary of the paper's constants}."""
    if name not in CALIBRATION_GRIDS:
        raise ValueError(f"policy {name!r} has no calibration; calibrated policies: {', '.join(CALIBRATED_POLICIES)}")
    base_constants = dict(base_constants or {})
    grid = _grid(name, base_constants)
    keys = list(CALIBRATION_GRIDS[name])
    values = {k: jnp.asarray([g[k] for g in grid], jnp.float32) for k in keys}

    if name == "ldlp":
        if not rec.has_predictions:
            raise ValueError("ldlp calibration needs LDLP predictions in the records: record with the predictor's weights")
        static = make_policy("static", k_max=k_max)
        pred = jnp.asarray(np.nan_to_num(rec.predicted, nan=float(k_max)))

        def run(v):
            return replay(static, rec, k_max, cost, limits=length_from_prediction(pred + v["length_offset"], k_max))

        paper = summary(run({"length_offset": jnp.float32(0.0)}), cost)
    else:

        def run(v):
            return replay(policy_from_constants(name, {**base_constants, **v}, k_max), rec, k_max, cost)

        paper = summary(replay(make_policy(name, k_max=k_max), rec, k_max, cost), cost)
    totals = jax.jit(jax.vmap(run))(values)
    rate = np.asarray(totals["tokens"], np.float64) / np.maximum(np.asarray(totals["us"], np.float64), 1e-9)
    best = int(np.argmax(rate))  # ties: the first in grid order
    constants = {k: grid[best][k] if isinstance(grid[best][k], bool) else float(grid[best][k]) for k in keys}
    calibrated = summary({k: v[best] for k, v in totals.items()}, cost)
    return {"constants": {**base_constants, **constants}, "calibrated": calibrated, "paper": paper}


def fit_all(names, rec: Records, k_max: int, cost: RoundCost) -> dict[str, Any]:
    """Fit each named policy (TapOut after the rules its arms use), replay static K = 1..k_max and
    the oracle stop rule at k_max: {"policies": {name: fit_policy(...)}, "static": {k: summary},
    "oracle": summary}."""
    order = sorted(names, key=lambda n: n == "tapout")
    fits: dict[str, Any] = {}
    for name in order:
        base = {}
        if name == "tapout":
            base = {arm: fits[arm]["constants"] if arm in fits else fit_policy(arm, rec, k_max, cost)["constants"]
                    for arm in ("svip", "adaedl")}
        fits[name] = fit_policy(name, rec, k_max, cost, base)
    static = {str(k): static_summary(rec, k, cost) for k in range(1, k_max + 1)}
    return {"policies": {n: fits[n] for n in names}, "static": static, "oracle": oracle_summary(rec, k_max, cost)}


# ---- the files: the user's fits and those shipped beside a head ----------------------------------


def target_tag(target: str) -> str:
    """A file-name tag for the target a draft model's fits hold for: a preset's name as it is, a
    path's last part and a hash of the whole path (two checkpoints may share a folder name)."""
    name = re.sub(r"[^A-Za-z0-9._-]+", "_", Path(target).name)[:64] or "target"
    if name == target:
        return name
    return f"{name}-{hashlib.sha256(str(Path(target).expanduser().resolve()).encode()).hexdigest()[:8]}"


def calibration_path(head_dir, target: str | None = None) -> Path:
    """The fits shipped beside a drafter (<dir>/jspec/calibration.json for an EAGLE head; a draft
    model, which may serve several targets, keeps one file per target: calibration-<target>.json):
    only read, unless `jspec calibrate --out-dir DIR` is asked to write them."""
    name = CALIBRATION_FILE if target is None else f"calibration-{target_tag(target)}.json"
    return Path(head_dir) / CALIBRATION_DIR / name


def user_calibration_path(head_dir, target: str | None = None) -> Path | None:
    """Where `jspec calibrate` writes a user's fits for a drafter by default: the user cache, one file
    per drafter weights (head_fingerprint; for a draft model, per target too), wherever the drafter
    lives. None for a drafter whose weights cannot be fingerprinted."""
    fingerprint = head_fingerprint(head_dir)
    if fingerprint is None:
        return None
    name = fingerprint if target is None else f"{fingerprint}-{target_tag(target)}"
    return user_cache_dir() / USER_CALIBRATION_DIR / f"{name}.json"


def calibration_files(head_dir, target: str | None = None) -> list[Path]:
    """The files a drafter's fits are read from, first hit wins: the user's, then the shipped ones.
    (The weights are hashed only when the user has fits at all.)"""
    user = user_calibration_path(head_dir, target) if (user_cache_dir() / USER_CALIBRATION_DIR).is_dir() else None
    return [p for p in (user, calibration_path(head_dir, target)) if p is not None]


def save_calibration(path, card: str, entry: dict) -> Path:
    """Merge one card's calibration (entry["policies"] per policy) into the calibration file `path`."""
    path = Path(path)
    data = load_calibration_file(path) or {"format": CALIBRATION_FORMAT, "cards": {}}
    old = data["cards"].get(card, {})
    data["cards"][card] = {**old, **entry, "policies": {**old.get("policies", {}), **entry.get("policies", {})}}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")
    return path


def head_fingerprint(head_dir) -> str | None:
    """The first 16 hex digits of the SHA-256 of a drafter's weights: a head's (or a draft model
    checkpoint's) top-level *.safetensors and *.bin, by name; a single weights file (a GGUF) itself;
    a preset folder without weight files (a GGUF assembled from packages) its pinned SHA-256. None
    when there is none of these. Cached per file size and modification time."""
    path = Path(head_dir)
    if path.is_file():
        return _fingerprint(((str(path), path.stat().st_size, path.stat().st_mtime_ns),))
    files = sorted(f for f in path.glob("*") if f.suffix in (".safetensors", ".bin") and f.is_file())
    if files:
        return _fingerprint(tuple((str(f), f.stat().st_size, f.stat().st_mtime_ns) for f in files))
    try:
        pinned = json.loads((path / "preset.json").read_text())["source"]["sha256"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return str(pinned)[:16] if pinned else None


@functools.lru_cache(maxsize=16)
def _fingerprint(files: tuple) -> str:
    digest = hashlib.sha256()
    for path, _, _ in files:
        with open(path, "rb") as fh:
            for block in iter(lambda: fh.read(1 << 24), b""):
                digest.update(block)
    return digest.hexdigest()[:16]


def load_calibration_file(path) -> dict | None:
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) and data.get("format") == CALIBRATION_FORMAT else None


@dataclasses.dataclass(frozen=True)
class CalibrationFit:
    """A policy's calibrated constants and where they come from."""

    constants: dict
    card: str
    path: Path
    rounds: int | None  # the recorded rounds the fit replayed

    def describe(self) -> str:
        rounds = f" from {self.rounds} recorded rounds" if self.rounds else ""
        return f"calibrated on {self.card}{rounds} ({self.path})"


def calibrated_acceptance(head_dir, card: str, target: str | None = None) -> dict | None:
    """The per-token acceptance `jspec calibrate` recorded for a drafter (a draft model: for
    `target`), which `auto` plans with: {"alpha": greedy, "by_temperature": {"T": a, ...}} (the
    latter when sampled chains were recorded too). This card's entry's, else another card's
    (acceptance does not depend on the card), else a file's top-level record; the user's files
    first. None: none recorded."""
    for path in calibration_files(head_dir, target):
        data = load_calibration_file(path) or {}
        cards = data.get("cards", {})
        for entry in [cards.get(card, {}), *(cards[c] for c in sorted(cards) if c != card), data]:
            record = entry.get("acceptance") or {}
            if record.get("alpha") is not None:
                return record
    return None


# [I] `auto` runs a drafter's calibrated stop rule in its batch-1 chains when `jspec calibrate`'s
# replay on this card puts the rule at least this much above the best static K. In four of four
# same-process comparisons at batch 1 (greedy, MT-Bench 80 / HumanEval 164) the best replayed rule
# ran faster than `auto`'s own per-round lengths: SmolLM2 + EAGLE-3 on an H200, confidence 2.09x
# and 2.16x AR against 2.05x and 1.98x; Qwen2.5-Coder 1.5B + 0.5B on an H100, confidence 1.53x and
# 1.33x against 1.44x and 1.27x. Replayed gains have run 5-15% above timed ones; the margin keeps a
# rule whose replay barely beats static K out.
STOP_RULE_MARGIN = 1.03
AUTO_STOP_RULES = ("confidence", "svip", "adaedl", "tapout")  # ldlp also needs its predictor's weights


def best_stop_rule(head_dir, card: str, target: str | None = None,
                   margin: float = STOP_RULE_MARGIN) -> tuple[str, CalibrationFit, float] | None:
    """(name, fit, replayed speed-up over the best static K) of the stop rule `auto` runs for this
    drafter's batch-1 chains on this card: the fastest calibrated rule of AUTO_STOP_RULES in the
    first calibration file with an entry for this card (the user's before the shipped one), when
    that entry was fit at batch 1 and the rule replays at least `margin` times the best static K.
    None otherwise."""
    for path in calibration_files(head_dir, target):
        entry = (load_calibration_file(path) or {}).get("cards", {}).get(card)
        if not entry:
            continue
        static = [s.get("speedup_vs_ar") for s in entry.get("static", {}).values()]
        rules = {name: fit["calibrated"]["speedup_vs_ar"] for name, fit in entry.get("policies", {}).items()
                 if name in AUTO_STOP_RULES and "speedup_vs_ar" in fit.get("calibrated", {})}
        if entry.get("batch", 1) != 1 or not rules or not static or None in static:
            return None
        name = max(rules, key=rules.get)
        gain = rules[name] / max(static)
        fit = calibrated_constants(head_dir, name, card, target) if gain >= margin else None
        return None if fit is None else (name, fit, gain)
    return None


def calibrated_constants(head_dir, name: str, card: str, target: str | None = None) -> CalibrationFit | None:
    """The fit of policy `name` for a drafter on this card: the user's (`jspec calibrate`), else the
    one shipped beside the drafter; None when neither has one. Only this card's: another card's
    constants were fit to another card's round costs. `target`: the target a draft model drafts
    for (its fits are per target; None for an EAGLE head). A fit recorded with other weights than
    the drafter's own (its `head` fingerprint differs) is skipped, with a warning."""
    current = None
    for path in calibration_files(head_dir, target):
        data = load_calibration_file(path)
        entry = (data or {}).get("cards", {}).get(card, {})
        fit = entry.get("policies", {}).get(name)
        if fit is None:
            continue
        if fit.get("head") is not None:  # fits written before fingerprints were kept carry none
            current = current or head_fingerprint(head_dir)
            if current is not None and fit["head"] != current:
                warnings.warn(f"{path}: the {name} fit for {card} was recorded with other head weights ({fit['head']}, "
                              f"this head {current}); not used: rerun `jspec calibrate`", stacklevel=2)
                continue
        return CalibrationFit(fit["constants"], card, path, entry.get("rounds"))
    return None
