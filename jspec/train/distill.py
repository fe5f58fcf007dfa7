"""Self-distillation at scale: the target answers the prompt corpus on every local device.

    jspec distill --target smollm2-135m-instruct --corpus runs/corpus/prompts.npz \
        --out runs/data --time-budget-s 540

How generation runs. The batch is a set of *slots*: `rows_per_device` rows on each device of a
`Mesh` data axis, each with its own KV-cache row, cursor, output buffer, temperature and length
limit. Every function below runs under `shard_map`, so each device decodes its own rows with no
collective at all. The host loop repeats: decode `chunk_steps` steps (one jitted while_loop, one
host sync), harvest the rows that finished (EOS or their limit), prefill new prompts into the free
slots (`refill_per_device` rows per device per prefill, padded to a prompt bucket) and insert
them. A row that finishes early is replaced within one chunk instead of riding along until the
longest row of a static batch ends, which is where most of a static batch's time goes when
answer lengths vary from 10 to 512 tokens.

Work, in order, each part resumable:
    1. eval references: greedy answers to the evaluation prompts stored in the corpus (MT-Bench,
       HumanEval, chitchat hold-out; prompts up to max_cont_prompt_tokens), written to eval-*.npz
       shards, never trained on (they give the draft vocabulary's coverage of the target's greedy
       tokens and LDLP's test set)
    2. self-instruct: the target writes prompts itself from `self_instruct_seeds` (code, math,
       reasoning, writing, ...) sampled at T=1; cleaned, deduplicated, checked against the
       evaluation hashes, saved to selfprompts.json (a resumed run reuses them)
    3. wave 0: every standalone prompt (corpus + self-written), in an order shuffled by `seed`
       (runs with other seeds reach other prompts first), then sorted by length within windows of
       8 batches (short prefill buckets, a representative mix at any stop)
    4. continuations: a later human turn asked after its parent's prompt and the target's own
       answer to it (built from the parent's stored row), for parents answered with EOS; their
       longer prompts get their own cache length
A share `sample_share` of the rows (chosen by prompt id) is sampled at `temperature`, the rest is
greedy. `--time-budget-s` bounds the whole process: refilling stops early enough for the rows in
flight to finish (measured chunk time x max_new / chunk_steps), then the partial shard is written;
wave 0 leaves `continuation_share` of the time to the continuations only where that share is at
least MIN_CONTINUATION_S.
A killed run loses at most the rows of the shard being filled; a resumed run skips every prompt
already in a shard. Progress: a tqdm bar over prompts and a throughput line per wave
(tokens/s in total and per device, slot occupancy).
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import json
import math
import os
import sys
import time
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from .. import model as M
from ..compile_cache import add_compile_cache_arg, use_compile_cache
from ..config import ModelConfig
from ..decode import bucket, emit, prefill
from ..presets import list_presets, load_preset, resolve_model
from . import corpus as C
from .config import recipe_json
from .shards import LoopCut, RowWriter, load_rows, read_meta, row_tokens, shard_files

SELF_SOURCE = "self_instruct"
DATA_SOURCES = tuple(C.SOURCES) + (SELF_SOURCE,) + tuple(f"eval_{t}" for t in C.EVAL_TASKS)
SELF_ITEM_BASE = 1 << 24  # item ids of self-written prompts start here (corpus ids are below)
# [I] The least time worth giving the continuations: their engine's compile (a cache of its own)
# and one drain. A shorter share of the budget goes to wave 0 instead of being left idle.
MIN_CONTINUATION_S = 60.0


@dataclasses.dataclass(frozen=True)
class DistillConfig:
    rows_per_device: int = 256
    refill_per_device: int = 64
    chunk_steps: int = 32
    max_new_tokens: int = 512
    max_prompt_tokens: int = 256  # standalone prompts (the corpus cap)
    max_cont_prompt_tokens: int = 1024  # continuation prompts (parent prompt + answer + turn)
    sample_share: float = 0.25
    temperature: float = 0.7
    continuation_share: float = 0.3  # of each call's generation time, once wave 0 has run
    self_prompts: int = 4000  # rows asked to write a prompt (0: none)
    self_prompt_max_new: int = 96
    self_prompt_temperature: float = 1.0
    eval_refs: bool = True
    rows_per_shard: int = 2048
    holdout_every: int = 25
    seed: int = 0
    attention: str = "auto"  # decode kernels (model.KERNEL_IMPLS): auto = pallas on GPU, else xla
    # "source=N,...": answer at most N standalone prompts of a corpus source (a seeded random
    # subset), e.g. "chitchat=16000": chit-chat is 70% of the corpus, and the target answers most
    # chit-chat with a loop, so uncapped it crowds out the instructions a head is used on
    source_caps: str = ""
    # stop a row once it has written this many tokens past the start of a loop (LoopCut's rule: a
    # run of 32 positions whose 8-gram occurred earlier); 0 = write every row to EOS or its limit.
    # Training cuts loops loop_cut_keep tokens after their start anyway, so generating on past that
    # only burns time: a Gemma-3-270M distillation spent about 60% of its tokens inside loops it
    # then dropped. Must be >= the training recipe's loop_cut_keep (checked at train-head).
    stop_loops_after: int = 0

    def __post_init__(self):
        if self.rows_per_device < 1 or not 1 <= self.refill_per_device <= self.rows_per_device:
            raise ValueError("need 1 <= refill_per_device <= rows_per_device")
        if self.max_new_tokens < 1 or self.chunk_steps < 1:
            raise ValueError("max_new_tokens and chunk_steps must be >= 1")
        if not 0.0 <= self.sample_share <= 1.0 or not 0.0 <= self.continuation_share < 1.0:
            raise ValueError("sample_share must be in [0, 1] and continuation_share in [0, 1)")
        if self.stop_loops_after < 0:
            raise ValueError(f"stop_loops_after must be >= 0 (0 = off), got {self.stop_loops_after}")
        self.caps()  # validated here, before any model loads

    def caps(self) -> dict[str, int]:
        """source_caps parsed: {corpus source name: max standalone prompts}."""
        caps = {}
        for part in filter(None, (p.strip() for p in self.source_caps.split(","))):
            name, _, n = part.partition("=")
            if name not in C.SOURCES or not n.isdigit():
                raise ValueError(f"source_caps entry {part!r}: expected SOURCE=N with SOURCE one of {', '.join(C.SOURCES)}")
            caps[name] = int(n)
        return caps

    def loop_stop(self) -> LoopCut | None:
        """When a training row stops at a loop (None: never)."""
        return LoopCut(keep=self.stop_loops_after) if self.stop_loops_after else None


# ---------------------------------------------------------------------------------------------
# Self-instruct seeds
# ---------------------------------------------------------------------------------------------

_CODE_TOPICS = (
    "strings", "lists", "dictionaries", "sorting", "binary search", "recursion", "prime numbers",
    "dates and times", "matrices", "parsing CSV text", "word counts", "binary trees", "linked lists",
    "stacks", "queues", "dynamic programming", "graphs", "regular expressions", "JSON data",
    "classes", "generators", "sets", "bit manipulation", "2D geometry", "money and rounding",
    "palindromes", "anagrams", "Fibonacci numbers", "greatest common divisors", "roman numerals",
    "intervals", "run-length encoding", "temperature conversion", "tic-tac-toe boards",
    "string formatting", "list flattening", "vowels and consonants", "digit sums", "leap years",
    "shopping carts", "inventory records", "student grades", "bank accounts", "caching",
    "file paths", "sliding windows", "two pointers", "heaps", "counting characters", "SQL queries",
)
_MATH_TOPICS = (
    "percentages", "fractions", "ratios", "speed and distance", "ages", "money and change",
    "areas of shapes", "volumes", "probability with dice", "probability with coins", "averages",
    "simple interest", "compound interest", "linear equations", "systems of two equations",
    "arithmetic sequences", "work rates", "unit conversion", "discounts and taxes", "time zones",
    "angles of triangles", "perimeters", "prime factorization", "least common multiples",
    "quadratic equations", "exponents", "counting arrangements", "mixtures", "budgets", "recipes",
)
_GENERAL_TOPICS = (
    "history", "physics", "biology", "chemistry", "astronomy", "economics", "psychology",
    "philosophy", "geography", "music", "literature", "health", "nutrition", "climate",
    "technology", "business", "education", "travel", "sports", "art",
)
# (category, topics, instruction, primes): the job's prompt is the instruction in the chat template
# followed by one of the primes as the start of the assistant's answer. A 135M target asked to
# "write a task" mostly answers one instead; starting its reply with "Task:" or "Problem:" makes it
# write the prompt itself, and the label is stripped afterwards.
_SEED_TEMPLATES = (
    ("code", _CODE_TOPICS, "Write a short programming task that asks for a Python function about {t}. "
     "Reply with the task only.", ("Task: Write a Python function that", "Task: Write a Python function called",
                                    "Task:", "Task: Implement")),
    ("code", _CODE_TOPICS, "Write a question a beginner programmer might ask about {t} in Python. "
     "Reply with the question only.", ("Question: How do I", "Question:", "Question: Why")),
    ("math", _MATH_TOPICS, "Write a math word problem about {t}. Reply with the problem only.", ("Problem:",)),
    ("math", _MATH_TOPICS, "Write a short math question about {t} that needs a step-by-step answer. "
     "Reply with the question only.", ("Question:", "Question: What is", "Question: How many")),
    ("reasoning", _GENERAL_TOPICS, "Write a logic or reasoning puzzle about {t}. Reply with the puzzle only.",
     ("Puzzle:",)),
    ("writing", _GENERAL_TOPICS, "Write a request asking an AI assistant to write a short essay, email or "
     "story about {t}. Reply with the request only.", ("Request: Write", "Request: Please write")),
    ("extraction", _GENERAL_TOPICS, "Write a request that gives a short paragraph about {t} and asks an AI "
     "assistant to extract or summarize information from it. Reply with the request only.", ("Request:",)),
    ("knowledge", _GENERAL_TOPICS, "Write a question about {t} that asks for a detailed explanation. "
     "Reply with the question only.", ("Question:", "Question: Why", "Question: How does")),
)
_LABELS = ("User:", "user:", "Question:", "Task:", "Problem:", "Prompt:", "Request:", "Puzzle:")
_STOP_LINES = ("```", "Answer", "Solution", "Response", "Step 1", "Explanation", "Output", "Example")
_NOT_A_PROMPT = ("Here is", "Here's", "Sure", "Certainly", "I ", "As an AI", "def ", "import ", "class ")


def self_instruct_seeds() -> list[tuple[str, str, str]]:
    """(category, instruction, prime) triples asking the target to write one user prompt each; the
    primes of a template take turns, so seeds[k] for k in range(n) cycles topics first."""
    out = []
    for cat, topics, tmpl, primes in _SEED_TEMPLATES:
        for i, t in enumerate(topics):
            out.append((cat, tmpl.format(t=t), primes[i % len(primes)]))
    return out


def clean_written_prompt(text: str) -> str:
    """The prompt the target wrote: its first paragraph, cut before an answer, a solution or code,
    without the label; "" when it is an answer rather than a prompt."""
    lines = []
    for line in text.strip().splitlines():
        stripped = line.strip()
        if not stripped or stripped.startswith(_STOP_LINES):
            if lines:
                break
            continue
        lines.append(stripped)
    para = " ".join(lines)
    for label in _LABELS:
        if para.startswith(label):
            para = para[len(label):].strip()
    para = para.strip('"').strip()
    return "" if para.startswith(_NOT_A_PROMPT) else para


# ---------------------------------------------------------------------------------------------
# Slots: the device-side state and its jitted, shard_mapped functions
# ---------------------------------------------------------------------------------------------


@struct.dataclass
class Slots:
    cache: M.KVCache  # k, v [L, B, S, Hkv, hd]; lengths [B]
    out: jax.Array  # [B, max_new] int32
    n_out: jax.Array  # [B] int32
    last: jax.Array  # [B] last emitted token (not yet in the cache)
    done: jax.Array  # [B] bool
    limit: jax.Array  # [B] int32 per-row max new tokens (<= max_new)
    temp: jax.Array  # [B] float32, 0 = greedy
    item: jax.Array  # [B] int32 prompt id: the row's random stream is fold_in(key, item)


def _slot_specs() -> Slots:
    rows = P("data")
    cache = M.KVCache(k=P(None, "data"), v=P(None, "data"), lengths=rows)
    return Slots(cache=cache, out=rows, n_out=rows, last=rows, done=rows, limit=rows, temp=rows, item=rows)


def _pick_tokens(key, items, n_out, logits, temp):
    """Per row: argmax when temp == 0, else a sample at temp from fold_in(fold_in(key, item), n_out)
    (a row's tokens do not depend on which slot or batch it ran in). All-greedy batches skip the
    sampling work."""
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)

    def with_samples(_):
        keys = jax.vmap(lambda i, n: jax.random.fold_in(jax.random.fold_in(key, i), n))(items, n_out)
        scaled = logits / jnp.maximum(temp, 1e-6)[:, None]
        sampled = jax.vmap(jax.random.categorical)(keys, scaled).astype(jnp.int32)
        return jnp.where(temp > 0, sampled, greedy)

    return jax.lax.cond(jnp.any(temp > 0), with_samples, lambda _: greedy, None)


def _finish(cfg, out, n_out, done, tok, limit, max_new):
    out, n_out, done = emit(cfg, out, n_out, done, tok[:, None], jnp.ones_like(n_out), max_new)
    return out, n_out, done | (n_out >= limit)


def _prefill_local(params, key, tokens, lens, items, temps, limits, *, cfg, cache_len, max_new):
    R = tokens.shape[0]
    cache = M.init_cache(cfg, R, cache_len, params["embed"].dtype)
    logits, cache, _ = prefill(params, cfg, tokens, lens, cache)
    first = _pick_tokens(key, items, jnp.zeros_like(lens), logits, temps)
    out = jnp.full((R, max_new), -1, jnp.int32)
    zeros = jnp.zeros((R,), jnp.int32)
    out, n_out, done = _finish(cfg, out, zeros, items < 0, first, limits, max_new)
    return Slots(cache=cache, out=out, n_out=n_out, last=first, done=done, limit=limits, temp=temps, item=items)


def _insert_local(slots: Slots, new: Slots, idx):
    """Rows of `new` into slots `idx` (local indices; out-of-range = dummy rows, dropped)."""

    def put(axis):
        def f(a, b):
            index = (slice(None),) * axis + (idx,)
            return a.at[index].set(b, mode="drop")
        return f

    cache = slots.cache.replace(k=put(1)(slots.cache.k, new.cache.k), v=put(1)(slots.cache.v, new.cache.v),
                                lengths=put(0)(slots.cache.lengths, new.cache.lengths))
    rest = {f: put(0)(getattr(slots, f), getattr(new, f)) for f in ("out", "n_out", "last", "done", "limit", "temp", "item")}
    return Slots(cache=cache, **rest)


def _decode_local(params, key, slots: Slots, *, cfg, max_new, n_steps, attention):
    def step(s: Slots) -> Slots:
        fwd = M.forward(params, cfg, s.last[:, None], s.cache, **_kernel_kwargs(attention))
        logits = M.lm_head(params, cfg, fwd.hidden[:, 0])
        tok = _pick_tokens(key, s.item, s.n_out, logits, s.temp)
        active = ~s.done
        out, n_out, done = _finish(cfg, s.out, s.n_out, s.done, tok, s.limit, max_new)
        return Slots(cache=M.advance(fwd.cache, active.astype(jnp.int32)), out=out, n_out=n_out,
                     last=jnp.where(active, tok, s.last), done=done, limit=s.limit, temp=s.temp, item=s.item)

    def cond(c):
        return (c[0] < n_steps) & ~jnp.all(c[1].done)

    return jax.lax.while_loop(cond, lambda c: (c[0] + 1, step(c[1])), (jnp.int32(0), slots))[1]


@functools.lru_cache(maxsize=None)
def _compiled(kind: str, mesh: Mesh, cfg: ModelConfig, cache_len: int, max_new: int, n_steps: int, attention: str):
    """The jitted shard_map of one slot function (cached per static configuration)."""
    rows, rep = P("data"), P()
    if kind == "prefill":
        fn = functools.partial(_prefill_local, cfg=cfg, cache_len=cache_len, max_new=max_new)
        sm = jax.shard_map(fn, mesh=mesh, in_specs=(rep, rep, rows, rows, rows, rows, rows),
                           out_specs=_slot_specs(), check_vma=False)
        return jax.jit(sm)
    if kind == "insert":
        sm = jax.shard_map(_insert_local, mesh=mesh, in_specs=(_slot_specs(), _slot_specs(), rows),
                           out_specs=_slot_specs(), check_vma=False)
        return jax.jit(sm, donate_argnums=(0,))
    fn = functools.partial(_decode_local, cfg=cfg, max_new=max_new, n_steps=n_steps, attention=attention)
    sm = jax.shard_map(fn, mesh=mesh, in_specs=(rep, rep, _slot_specs()), out_specs=_slot_specs(), check_vma=False)
    return jax.jit(sm, donate_argnums=(2,))


def data_mesh(devices=None) -> Mesh:
    """Every local device on one "data" axis."""
    devices = list(jax.local_devices() if devices is None else devices)
    return Mesh(np.asarray(devices), ("data",))


def resolve_attention(name: str) -> str:
    """auto: $JSPEC_KERNELS, else the fused Pallas kernels on GPU (each device runs its own rows
    under shard_map, so the one-device kernels apply), else the portable XLA path."""
    if name != "auto":
        return name
    with M.per_device_program():
        return M.default_kernels()


def _kernel_kwargs(impl: str) -> dict:
    """model.forward's keyword for the kernel choice (named `kernels`; `attention` in older trees)."""
    params = inspect.signature(M.forward).parameters
    if "kernels" in params:
        return {"kernels": impl}
    return {"attention": impl} if "attention" in params else {}


# ---------------------------------------------------------------------------------------------
# The host loop
# ---------------------------------------------------------------------------------------------


@dataclasses.dataclass
class Job:
    item: int
    prompt: list[int]
    temp: float
    limit: int
    payload: object = None  # anything the caller wants back with the answer


@dataclasses.dataclass
class EngineStats:
    rows: int = 0
    tokens: int = 0
    seconds: float = 0.0
    chunks: int = 0
    loop_stopped: int = 0  # rows stopped inside a loop (DistillConfig.stop_loops_after)
    occupancy_sum: float = 0.0
    chunk_seconds: float = 0.0  # EMA of one decode chunk's wall time
    decode_seconds: float = 0.0  # where the wall time went: decode chunks, refills (prefill + insert), the host
    refill_seconds: float = 0.0

    def line(self, n_devices: int) -> str:
        tps = self.tokens / max(self.seconds, 1e-9)
        occ = self.occupancy_sum / max(self.chunks, 1)
        looped = f", {self.loop_stopped:,} rows stopped in a loop" if self.loop_stopped else ""
        host = max(self.seconds - self.decode_seconds - self.refill_seconds, 0.0)
        return (f"{self.rows:,} rows, {self.tokens:,} tokens in {self.seconds:.1f}s: {tps:,.0f} tokens/s, "
                f"{tps / n_devices:,.0f} tokens/s per device ({n_devices} devices), slot occupancy {occ:.0%}{looped}; "
                f"decode {self.decode_seconds:.1f}s, refill {self.refill_seconds:.1f}s, host {host:.1f}s")


class SlotEngine:
    """Continuous batching over the slots of every device (see module doc)."""

    def __init__(self, params, cfg: ModelConfig, mesh: Mesh, dc: DistillConfig, *, cache_len: int, max_new: int):
        self.cfg, self.mesh, self.dc = cfg, mesh, dc
        self.n_dev = mesh.shape["data"]
        self.B, self.R = dc.rows_per_device, dc.refill_per_device
        self.cache_len, self.max_new = cache_len, max_new
        self.attention = resolve_attention(dc.attention)
        self.params = params
        self.key = jax.device_put(jax.random.PRNGKey(dc.seed), NamedSharding(mesh, P()))
        self.rows_sharding = NamedSharding(mesh, P("data"))
        self.chunk_seconds = 0.0  # EMA of one decode chunk's wall time, kept across runs

    def _fn(self, kind: str):
        return _compiled(kind, self.mesh, self.cfg, self.cache_len, self.max_new, self.dc.chunk_steps, self.attention)

    def _empty(self) -> Slots:
        """Every slot free (done, item -1), created directly on the devices."""
        n, cfg = self.n_dev * self.B, self.cfg
        dtype = self.params["embed"].dtype

        def make():
            cache = M.init_cache(cfg, n, self.cache_len, dtype)
            rows = lambda v, dt: jnp.full((n,), v, dt)  # noqa: E731
            return Slots(cache=cache, out=jnp.full((n, self.max_new), -1, jnp.int32), n_out=rows(0, jnp.int32),
                         last=rows(0, jnp.int32), done=rows(True, bool), limit=rows(1, jnp.int32),
                         temp=rows(0, jnp.float32), item=rows(-1, jnp.int32))

        shardings = jax.tree.map(lambda spec: NamedSharding(self.mesh, spec), _slot_specs())
        return jax.jit(make, out_shardings=shardings)()

    def _put(self, *arrays):
        return [jax.device_put(a, self.rows_sharding) for a in arrays]

    def run(self, jobs: list[Job], on_done: Callable[[Job, list[int]], None], *, stop_refill_at: float,
            deadline: float = math.inf, progress: bool = True, desc: str = "distill",
            stop_loops: LoopCut | None = None) -> EngineStats:
        """Answer `jobs` in order. Refilling stops when they run out, when the clock passes
        stop_refill_at, or when the rows in flight would no longer finish before `deadline`
        (measured chunk time); rows in flight then finish. Calls on_done(job, response tokens).
        stop_loops: a row whose response LoopCut would cut is finished at the chunk's end (its
        slot refilled), so loops cost at most `keep` + chunk_steps tokens instead of max_new."""
        from tqdm import tqdm

        stats = EngineStats()
        if not jobs:
            return stats
        t0 = time.perf_counter()
        n_dev, B, R = self.n_dev, self.B, self.R
        held: list[Job | None] = [None] * (n_dev * B)
        queue = iter(jobs)
        pending: Job | None = next(queue)
        slots = self._empty()
        bar = tqdm(total=len(jobs), desc=desc, disable=not progress, file=sys.stdout, mininterval=2.0)
        last_total = 0
        try:
            while True:
                # 1. refill free slots, R per device per prefill
                now = tr = time.perf_counter()
                refilling = pending is not None and now < stop_refill_at and now < deadline - self.drain_seconds()
                while refilling:
                    free = [[b for b in range(B) if held[d * B + b] is None][:R] for d in range(n_dev)]
                    if not any(free):
                        break
                    group: list[list[tuple[int, Job]]] = [[] for _ in range(n_dev)]
                    d = 0
                    while pending is not None and any(len(group[k]) < len(free[k]) for k in range(n_dev)):
                        if len(group[d]) < len(free[d]):
                            group[d].append((free[d][len(group[d])], pending))
                            pending = next(queue, None)
                        d = (d + 1) % n_dev
                    slots = self._refill(slots, group, held)
                    refilling = pending is not None
                if all(h is None for h in held):
                    break
                # one sync per chunk more, so that the chunk time (drain_seconds) and the split of the
                # wall time below do not count the prefills queued ahead of the decode
                slots = jax.block_until_ready(slots)
                # 2. decode a chunk, 3. harvest
                tc = time.perf_counter()
                stats.refill_seconds += tc - tr
                slots = self._fn("decode")(self.params, self.key, slots)
                done, n_out = (np.asarray(x) for x in jax.device_get((slots.done, slots.n_out)))
                stats.decode_seconds += time.perf_counter() - tc
                finished = [b for b, h in enumerate(held) if h is not None and done[b]]
                out = None
                if stop_loops is not None:
                    out = np.asarray(jax.device_get(slots.out))
                    looped = self._looping_rows(stop_loops, out, n_out, done, held)
                    if looped:
                        mask = np.zeros(len(held), bool)
                        mask[looped] = True
                        slots = slots.replace(done=slots.done | self._put(mask)[0])
                        finished += looped
                        stats.loop_stopped += len(looped)
                if finished:
                    out = np.asarray(jax.device_get(slots.out)) if out is None else out
                    for b in finished:
                        job = held[b]
                        response = out[b, : n_out[b]].tolist()
                        held[b] = None
                        on_done(job, response)
                        stats.rows += 1
                        stats.tokens += len(response)
                    bar.update(len(finished))
                dt = time.perf_counter() - tc
                if stats.chunks:  # the first chunk includes compilation
                    self.chunk_seconds = dt if not self.chunk_seconds else 0.8 * self.chunk_seconds + 0.2 * dt
                stats.chunk_seconds = self.chunk_seconds
                stats.chunks += 1
                in_flight = int(sum(n_out[b] for b, h in enumerate(held) if h is not None))
                total = stats.tokens + in_flight
                stats.occupancy_sum += min((total - last_total) / max(n_dev * B * self.dc.chunk_steps, 1), 1.0)
                last_total = total
                stats.seconds = time.perf_counter() - t0
                if progress and stats.chunks % 8 == 0:
                    tps = total / max(stats.seconds, 1e-9)
                    bar.set_postfix_str(f"{tps:,.0f} tok/s, {tps / n_dev:,.0f}/device")
        finally:
            bar.close()
        stats.seconds = time.perf_counter() - t0
        return stats

    @staticmethod
    def _looping_rows(stop_loops: LoopCut, out: np.ndarray, n_out: np.ndarray, done: np.ndarray, held) -> list[int]:
        """Rows in flight that have written more than stop_loops.keep tokens of a loop."""
        # a loop starts at index >= ngram (its first repeated n-gram ends there at the earliest) and
        # is seen after `run` repeated positions: no response this short can be cut
        shortest = stop_loops.ngram + max(stop_loops.run - 1, stop_loops.keep)
        return [b for b, h in enumerate(held)
                if h is not None and not done[b] and n_out[b] > shortest
                and stop_loops.cut(out[b, : n_out[b]]) < n_out[b]]

    def _refill(self, slots: Slots, group, held) -> Slots:
        n_dev, B, R = self.n_dev, self.B, self.R
        longest = max(len(job.prompt) for g in group for _, job in g)
        pb = max(bucket(longest), 64)  # few prefill shapes to compile: 64, 128, 256 (+ longer continuations)
        n = n_dev * R
        tokens = np.full((n, pb), self.cfg.pad_token_id, np.int32)
        lens, items = np.ones(n, np.int32), np.full(n, -1, np.int32)
        temps, limits, idx = np.zeros(n, np.float32), np.ones(n, np.int32), np.full(n, B, np.int32)
        for d, g in enumerate(group):
            for r, (b, job) in enumerate(g):
                k = d * R + r
                tokens[k, : len(job.prompt)] = job.prompt
                lens[k], items[k], temps[k] = len(job.prompt), job.item, job.temp
                limits[k], idx[k] = min(job.limit, self.max_new), b
                held[d * B + b] = job
        new = self._fn("prefill")(self.params, self.key, *self._put(tokens, lens, items, temps, limits))
        return self._fn("insert")(slots, new, *self._put(idx))

    def drain_seconds(self) -> float:
        """How long the rows in flight need to finish once refilling stops (at most max_new steps;
        before any measurement, assume 10 ms a step)."""
        per_step = self.chunk_seconds / self.dc.chunk_steps if self.chunk_seconds else 0.01
        return per_step * self.max_new * 1.15 + 2.0


def cache_len_for(max_prompt: int, max_new: int) -> int:
    return -(-(bucket(max_prompt) + max_new + 1) // 128) * 128


# ---------------------------------------------------------------------------------------------
# The distillation run
# ---------------------------------------------------------------------------------------------


def wave_zero_end(now: float, deadline: float, continuation_share: float, has_continuations: bool) -> float:
    """When wave 0 stops refilling: `continuation_share` of the time left goes to the continuations,
    unless that share is under MIN_CONTINUATION_S (too short to compile their engine and drain it,
    so they would not run): then wave 0 keeps the whole budget. A v3 Qwen run with 190 s left
    reserved 38 s this way, then skipped the continuations, and left a quarter of its budget idle."""
    if not has_continuations or not math.isfinite(deadline):
        return deadline
    reserve = (deadline - now) * continuation_share
    return deadline if reserve < MIN_CONTINUATION_S else deadline - reserve


def _temperatures(n: int, dc: DistillConfig, stream: int) -> np.ndarray:
    u = np.random.default_rng([dc.seed, stream]).random(n)
    return np.where(u < dc.sample_share, dc.temperature, 0.0).astype(np.float32)


def _window_sort(jobs: list[Job], window: int) -> list[Job]:
    out = []
    for start in range(0, len(jobs), window):
        out += sorted(jobs[start : start + window], key=lambda j: len(j.prompt))
    return out


def write_self_prompts(engine_factory, tokenizer, corpus: C.Corpus, dc: DistillConfig, path: str, *,
                       chat: bool, deadline: float, progress: bool, log) -> list[dict]:
    """Ask the target to write prompts (sampled), clean and deduplicate them, save to `path`."""
    seeds = self_instruct_seeds()
    if not seeds or dc.self_prompts <= 0:
        return []
    enc = C.PromptEncoder(tokenizer, chat)
    seed_ids = enc.standalone([instruction for _, instruction, _ in seeds])
    prime_ids = {p: [int(t) for t in tokenizer(p, add_special_tokens=False)["input_ids"]] for _, _, p in seeds}
    jobs = []
    for k in range(dc.self_prompts):
        cat, _, prime = seeds[k % len(seeds)]
        jobs.append(Job(item=2 * SELF_ITEM_BASE + k, prompt=seed_ids[k % len(seeds)] + prime_ids[prime],
                        temp=dc.self_prompt_temperature, limit=dc.self_prompt_max_new, payload=(cat, prime)))
    written: list[tuple[str, list[int]]] = []
    engine = engine_factory(dc.max_prompt_tokens, dc.max_new_tokens)
    stats = engine.run(jobs, lambda job, resp: written.append((job.payload, resp)),
                       stop_refill_at=deadline, deadline=deadline, progress=progress, desc="self-instruct")
    log(f"self-instruct: {stats.line(engine.n_dev)}")
    eval_hashes = set(int(h) for h in corpus.meta.get("eval_normalized_hashes", []))
    seen: set[str] = set()
    out, counts = [], {"written": len(written), "cut": 0, "not_a_prompt": 0, "short": 0, "eval": 0, "duplicate": 0, "too_long": 0}
    texts = []
    eos = set(corpus.meta["target"]["eos_token_ids"])
    for (cat, prime), resp in written:
        answer = tokenizer.decode([t for t in resp if t not in eos], skip_special_tokens=True)
        whole = prime + ("" if answer[:1].isspace() else " ") + answer
        text = clean_written_prompt(whole)
        words = len(text.split())
        norm = C.normalize(text)
        ended = (resp and resp[-1] in eos) or len(text) < len(" ".join(whole.split())) - 1
        if not ended:  # cut at the length limit in the middle of the prompt
            counts["cut"] += 1
        elif not text:
            counts["not_a_prompt"] += 1
        elif words < 4:
            counts["short"] += 1
        elif C.text_hash(norm) in eval_hashes:
            counts["eval"] += 1
        elif norm in seen:
            counts["duplicate"] += 1
        else:
            seen.add(norm)
            texts.append((cat, text))
    ids = enc.standalone([t for _, t in texts])
    for (cat, text), p in zip(texts, ids):
        if len(p) > dc.max_prompt_tokens:
            counts["too_long"] += 1
            continue
        out.append({"category": cat, "text": text, "ids": p})
    counts["kept"] = len(out)
    with open(path + ".tmp", "w") as fh:
        json.dump({"counts": counts, "prompts": out}, fh)
    os.replace(path + ".tmp", path)
    log(f"self-instruct prompts: {json.dumps(counts)}")
    return out


def _eos_ids(cfg: ModelConfig) -> set[int]:
    return set(int(t) for t in cfg.eos_token_ids)


def corpus_roots(corpus: C.Corpus) -> np.ndarray:
    """Index of each item's standalone ancestor (itself for standalone prompts)."""
    root = np.arange(len(corpus))
    for _ in range(int(corpus.depth.max(initial=0))):
        has = corpus.parent[root] >= 0
        root = np.where(has, corpus.parent[root], root)
    return root


def distill(params, cfg: ModelConfig, tokenizer, corpus: C.Corpus, out_dir: str, dc: DistillConfig, *,
            chat: bool, time_budget_s: float | None = None, max_prompts: int | None = None,
            part: tuple[int, int] = (0, 1), mesh: Mesh | None = None, progress: bool = True, log=print) -> dict:
    """Answer the corpus (resumably) into a jspec-distill-v2 directory. Returns the run's summary.

    part=(i, n): only conversations whose standalone prompt index is i mod n (and self-written
    prompts k with k mod n == i): n hosts distil disjoint parts into n directories."""
    t_start = time.perf_counter()
    deadline = t_start + time_budget_s if time_budget_s else math.inf
    corpus.check_target(cfg, chat)
    mesh = mesh or data_mesh()
    n_dev = mesh.shape["data"]
    params = jax.device_put(params, NamedSharding(mesh, P()))
    writer = RowWriter(out_dir, vocab_size=cfg.vocab_size, pad_id=cfg.pad_token_id, eos_token_ids=cfg.eos_token_ids,
                       sources=list(DATA_SOURCES), rows_per_shard=dc.rows_per_shard, holdout_every=dc.holdout_every,
                       provenance={"corpus": {k: corpus.meta[k] for k in ("n_items", "n_tokens", "settings")},
                                   "distill": dataclasses.asdict(dc)})
    eos = _eos_ids(cfg)
    engines: dict[tuple[int, int], SlotEngine] = {}

    def engine_for(max_prompt: int, max_new: int) -> SlotEngine:
        key = (cache_len_for(max_prompt, max_new), max_new)
        if key not in engines:
            engines[key] = SlotEngine(params, cfg, mesh, dc, cache_len=key[0], max_new=max_new)
        return engines[key]

    summary: dict = {"devices": n_dev, "waves": {}}

    def record(split: str, source_of: Callable[[Job], int]):
        def on_done(job: Job, response: list[int]) -> None:
            ended = bool(response) and response[-1] in eos
            writer.add(job.prompt, response, item=job.item, source=source_of(job), temperature=job.temp,
                       ended=ended, split=split)
        return on_done

    def run_wave(name: str, jobs: list[Job], engine: SlotEngine, until: float, split="train", source_of=None):
        if not jobs:
            return
        source_of = source_of or (lambda job: int(job.payload))
        # evaluation references are written whole: they are the target's answers as they are
        stats = engine.run(jobs, record(split, source_of), stop_refill_at=until, deadline=deadline - 5.0,
                           progress=progress, desc=name, stop_loops=dc.loop_stop() if split == "train" else None)
        writer.flush()
        summary["waves"][name] = {"jobs": len(jobs), "rows": stats.rows, "tokens": stats.tokens,
                                  "loop_stopped": stats.loop_stopped, "seconds": round(stats.seconds, 1),
                                  "decode_s": round(stats.decode_seconds, 1), "refill_s": round(stats.refill_seconds, 1),
                                  "tokens_per_s_per_device": round(stats.tokens / max(stats.seconds, 1e-9) / n_dev)}
        log(f"{name}: {stats.line(n_dev)}")

    main_engine = engine_for(dc.max_prompt_tokens, dc.max_new_tokens)
    cont_engine = engine_for(dc.max_cont_prompt_tokens, dc.max_new_tokens)

    # 1. evaluation references (greedy, never trained on), with the continuations' longer cache:
    #    a few MT-Bench and HumanEval prompts are longer than the corpus cap
    if dc.eval_refs:
        done_eval = writer.done_items("eval_shards")
        jobs = []
        for k, (task, ids) in enumerate(corpus.eval_prompts()):
            if k not in done_eval and len(ids) <= dc.max_cont_prompt_tokens:
                jobs.append(Job(k, ids, 0.0, dc.max_new_tokens, DATA_SOURCES.index(f"eval_{task}")))
        run_wave("eval-refs", jobs, cont_engine, deadline - 30.0, split="eval")

    # 2. self-written prompts
    self_path = os.path.join(out_dir, "selfprompts.json")
    if os.path.isfile(self_path):
        with open(self_path) as fh:
            self_prompts = json.load(fh)["prompts"]
    elif dc.self_prompts > 0:
        self_prompts = write_self_prompts(engine_for, tokenizer, corpus, dc, self_path, chat=chat,
                                          deadline=deadline - 60.0, progress=progress, log=log)
    else:
        self_prompts = []

    # 3. wave 0: standalone prompts
    done = writer.done_items()
    lengths = corpus.lengths()
    temps = _temperatures(len(corpus), dc, 0)
    in_part = corpus_roots(corpus) % part[1] == part[0]
    allowed = (corpus.parent < 0) & in_part
    for name, cap in dc.caps().items():  # the same seeded subset on every resumed run and host
        ids = np.flatnonzero((corpus.parent < 0) & (corpus.source == C.SOURCES.index(name)))
        allowed[np.random.default_rng([dc.seed, 7]).permutation(ids)[cap:]] = False
    # in a seeded order: runs with other seeds (other machines, other days) answer mostly other
    # prompts instead of the corpus's first ones again; a resumed run keeps its seed's order
    order = np.random.default_rng([dc.seed, 11]).permutation(np.flatnonzero(allowed))
    standalone = [i for i in order if int(i) not in done]
    if max_prompts is not None:
        standalone = standalone[:max_prompts]
    jobs = [Job(int(i), corpus.ids(int(i)), float(temps[i]), dc.max_new_tokens, int(corpus.source[i]))
            for i in standalone if lengths[i] <= dc.max_prompt_tokens]
    self_temps = _temperatures(len(self_prompts), dc, 1)
    self_jobs = [Job(SELF_ITEM_BASE + k, p["ids"], float(self_temps[k]), dc.max_new_tokens, DATA_SOURCES.index(SELF_SOURCE))
                 for k, p in enumerate(self_prompts) if SELF_ITEM_BASE + k not in done and k % part[1] == part[0]]
    if self_jobs:  # spread the self-written prompts evenly through the corpus prompts
        step = max(len(jobs) // len(self_jobs), 1)
        merged = []
        for k, job in enumerate(jobs):
            merged.append(job)
            if k % step == step - 1 and self_jobs:
                merged.append(self_jobs.pop(0))
        jobs = merged + self_jobs
    jobs = _window_sort(jobs, 8 * n_dev * dc.rows_per_device)
    has_conts = bool((corpus.parent >= 0).any()) and dc.continuation_share > 0
    run_wave("wave-0", jobs, main_engine, wave_zero_end(time.perf_counter(), deadline, dc.continuation_share, has_conts))

    # 4. continuations, depth by depth, while parents are answered
    skipped = {"parent_unanswered": 0, "parent_cut": 0, "too_long": 0}
    for depth in range(1, int(corpus.depth.max(initial=0)) + 1):
        if not has_conts or time.perf_counter() > deadline - MIN_CONTINUATION_S:
            break
        done = writer.done_items()
        candidates = [int(i) for i in np.flatnonzero((corpus.depth == depth) & in_part) if int(i) not in done]
        parents = _parent_rows(out_dir, {int(corpus.parent[i]) for i in candidates})
        jobs = []
        for i in candidates:
            row = parents.get(int(corpus.parent[i]))
            if row is None:
                skipped["parent_unanswered"] += 1
                continue
            seq, ended = row
            if not ended:
                skipped["parent_cut"] += 1
                continue
            suffix = corpus.ids(i)
            if suffix and seq and seq[-1] == suffix[0]:
                suffix = suffix[1:]  # the EOS that closed the parent's answer
            prompt = seq + suffix
            if len(prompt) > dc.max_cont_prompt_tokens:
                skipped["too_long"] += 1
                continue
            jobs.append(Job(i, prompt, float(temps[i]), dc.max_new_tokens, int(corpus.source[i])))
        jobs = _window_sort(jobs, 8 * n_dev * dc.rows_per_device)
        run_wave(f"continuations-{depth}", jobs, cont_engine, deadline)
    summary["continuations_skipped"] = skipped
    summary["seconds"] = round(time.perf_counter() - t_start, 1)
    writer.write_meta(last_run=summary)
    return summary


def _parent_rows(data_dir: str, wanted: set[int]) -> dict[int, tuple[list[int], bool]]:
    """item -> (prompt + response ids, ended) of the wanted items already answered."""
    found: dict[int, tuple[list[int], bool]] = {}
    if not wanted:
        return found
    meta = read_meta(data_dir)
    for s in shard_files(meta, "all"):
        rows = load_rows(data_dir, s["file"])
        for r, item in enumerate(rows["items"]):
            if int(item) in wanted:
                found[int(item)] = (row_tokens(rows, r).astype(np.int64).tolist(), bool(rows["ended"][r]))
    return found


# ---------------------------------------------------------------------------------------------
# Command line
# ---------------------------------------------------------------------------------------------


def add_distill_args(p):
    p.add_argument("--target", required=True, help="target preset or path")
    p.add_argument("--corpus", default="runs/corpus/prompts.npz", help="prompt corpus (jspec build-corpus)")
    p.add_argument("--recipe", default=None, help="recipe JSON whose \"distill\" section gives the defaults")
    p.add_argument("--out", required=True, help="dataset directory (jspec-distill-v2; resumed when it exists)")
    p.add_argument("--time-budget-s", type=float, default=None, help="stop cleanly within this many seconds")
    p.add_argument("--max-prompts", type=int, default=None, help="answer at most this many standalone prompts")
    p.add_argument("--part", default="0/1", help="I/N: this host's share of the corpus (conversations i mod N)")
    p.add_argument("--dtype", default="auto", help="target dtype: auto (bf16 on GPU, f32 on CPU), bfloat16, float32")
    p.add_argument("--no-progress", action="store_true")
    add_compile_cache_arg(p)
    for f in dataclasses.fields(DistillConfig):
        flag = "--" + f.name.replace("_", "-")
        if f.type in ("bool", bool):
            p.add_argument(flag, type=lambda s: s.lower() in ("1", "true", "yes"), default=None, metavar="BOOL")
        else:
            kind = {"int": int, "float": float, "str": str}.get(f.type if isinstance(f.type, str) else f.type.__name__, str)
            p.add_argument(flag, type=kind, default=None)
    return p


def config_from_args(args) -> DistillConfig:
    """The recipe's "distill" section (if any), then the command line's flags."""
    base = {}
    if getattr(args, "recipe", None):
        base = recipe_json(args.recipe).get("distill", {})
        names = {f.name for f in dataclasses.fields(DistillConfig)}
        unknown = sorted(set(base) - names)
        if unknown:
            raise ValueError(f"{args.recipe}: unknown distill fields {', '.join(unknown)}")
    over = {f.name: getattr(args, f.name) for f in dataclasses.fields(DistillConfig) if getattr(args, f.name, None) is not None}
    return DistillConfig(**{**base, **over})


def run_distill(args) -> int:
    use_compile_cache(getattr(args, "compile_cache", None))
    dc = config_from_args(args)
    try:
        part = tuple(int(x) for x in args.part.split("/"))
        assert len(part) == 2 and 0 <= part[0] < part[1]
    except (ValueError, AssertionError):
        raise ValueError(f"--part {args.part!r}: expected I/N with 0 <= I < N") from None
    if args.time_budget_s is not None and args.time_budget_s < 60:
        raise ValueError(f"--time-budget-s {args.time_budget_s} is below the minimum of 60")
    corpus = C.load_corpus(args.corpus)
    dtype = None if args.dtype == "auto" else jnp.dtype(args.dtype)
    if dtype is None:
        dtype = jnp.float32 if jax.default_backend() == "cpu" else jnp.bfloat16
    cfg, params, tok = resolve_model(args.target, dtype=dtype)
    chat = load_preset(args.target).chat if args.target in list_presets() else bool(getattr(tok, "chat_template", None))
    budget = None if args.time_budget_s is None else args.time_budget_s - (time.perf_counter() - _T0)
    summary = distill(params, cfg, tok, corpus, args.out, dc, chat=chat, time_budget_s=budget,
                      max_prompts=args.max_prompts, part=part, progress=not args.no_progress)
    meta = read_meta(args.out)
    train = shard_files(meta, "all")
    print(json.dumps(summary))
    print(f"dataset {args.out}: {sum(s['rows'] for s in train):,} rows, "
          f"{sum(s['response_tokens'] for s in train):,} response tokens in {len(train)} shards")
    return 0


_T0 = time.perf_counter()


def main(argv=None) -> int:
    import argparse

    parser = add_distill_args(argparse.ArgumentParser(prog="jspec distill", description=__doc__,
                                                      formatter_class=argparse.RawDescriptionHelpFormatter))
    return run_distill(parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
