"""Prompt sources beyond chat (jspec.train.prompt_sources): math, translation, passages, code.

Seeded and counted, standalone prompts that go through the corpus's decontamination like the
others. The math sources need their data packages (the Makefile's DATA_PKGS); without them those
tests skip.
"""

import importlib.util

import pytest

from jspec.tasks import Question
from jspec.train import corpus as C
from jspec.train import prompt_sources as PS

from pipeline_tiny import TARGET, CharChatTokenizer

DOC_COUNTS = {"translation": 12, "doc_summary": 4, "doc_questions": 4, "code_docs": 12}


def test_documentation_sources_are_seeded_counted_and_plain_text():
    items, report = PS.prompt_items(DOC_COUNTS, seed=3)
    again, _ = PS.prompt_items(DOC_COUNTS, seed=3)
    other, _ = PS.prompt_items(DOC_COUNTS, seed=4)
    assert items == again and items != other
    by_source = {s: [t for t, src in items if src == s] for s in DOC_COUNTS}
    assert {s: len(v) for s, v in by_source.items()} == DOC_COUNTS
    assert all(report[s]["pool"] > 500 and report[s]["drawn"] == n for s, n in DOC_COUNTS.items())
    assert all(any(lang in t for lang in PS.LANGUAGES) for t in by_source["translation"])
    assert any("```python\n" in t for t in by_source["code_docs"]) or all("`" in t for t in by_source["code_docs"])
    assert all(C.ascii_share(t) > 0.9 for t, _ in items)
    with pytest.raises(ValueError, match="expected SOURCE=N with SOURCE one of math_generated"):
        PS.parse_counts("poems=3")
    assert PS.parse_counts("code_docs=0,translation=5") == {**PS.DEFAULT_COUNTS, "code_docs": 0, "translation": 5}


def test_generated_prompts_are_decontaminated_and_counted_in_the_corpus():
    items, _ = PS.prompt_items(DOC_COUNTS, seed=0)
    leak = next(t for t, s in items if s == "doc_summary")  # an "evaluation prompt" equal to one of them
    evals = {"mt_bench": [Question(1, "writing", [leak])], "humaneval": [], "chitchat": []}
    extra = [C.RawItem(t, s) for t, s in items]
    settings = C.CorpusSettings(max_prompt_tokens=4096)
    arrays = C.build_corpus(CharChatTokenizer(), TARGET, chat=True, sharegpt=([], {}), chitchat=[], extra=extra,
                            evals=evals, settings=settings, progress=False)
    stats = __import__("json").loads(arrays["meta"].tobytes().decode())["stats"]
    assert stats["doc_summary"]["eval_exact"] == 1 and stats["doc_summary"]["kept"] == DOC_COUNTS["doc_summary"] - 1
    assert stats["code_docs"]["kept"] == DOC_COUNTS["code_docs"]
    names = [C.SOURCES[i] for i in arrays["source"]]
    assert names.count("translation") == stats["translation"]["kept"] > 0


@pytest.mark.skipif(importlib.util.find_spec("mathematics_dataset") is None, reason="needs mathematics-dataset")
def test_math_generated_questions_are_seeded_and_leave_global_rngs_alone():
    import random

    import numpy as np

    random.seed(7)
    before = random.random()
    random.seed(7)
    a, report = PS.prompt_items({"math_generated": 30}, seed=1)
    assert random.random() == before  # the generator's global RNG draws are undone
    b, _ = PS.prompt_items({"math_generated": 30}, seed=1)
    words = lambda items: [sorted(t.replace(".", " ").split()) for t, _ in items]  # noqa: E731
    # the same questions, up to the order of their "Let ..." / "Suppose ..." clauses (the generator
    # orders them by object identity)
    assert words(a) == words(b) and len(a) == 30 == report["math_generated"]["drawn"]
    assert report["math_generated"]["pool"] == 33
    assert len({t for t, _ in a}) > 25 and all(len(t.split()) >= 3 for t, _ in a)
    assert np.mean([any(c.isdigit() for c in t) for t, _ in a]) > 0.8


@pytest.mark.skipif(importlib.util.find_spec("champ_dataset") is None, reason="needs champ-dataset")
def test_champ_gives_every_problem_and_fact():
    items, report = PS.prompt_items({"math_champ": 1000}, seed=0)
    assert report["math_champ"] == {"pool": 359, "drawn": 359}
    assert sum("Prove the following" in t or "Explain why this" in t or "plain words" in t for t, _ in items) == 89
