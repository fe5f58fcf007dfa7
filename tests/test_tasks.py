"""Task loaders read the installed packages' data files."""

import json

import pytest

from jspec.tasks import (
    Question,
    TaskDataError,
    load_questions_file,
    load_task,
    training_prompts,
)


def test_mt_bench_has_80_questions_with_two_turns():
    qs = load_task("mt_bench")
    assert len(qs) == 80
    assert all(len(q.turns) == 2 for q in qs)
    assert {q.category for q in qs} >= {"writing", "coding", "math"}


def test_humaneval_has_164_code_prompts():
    qs = load_task("humaneval")
    assert len(qs) == 164
    assert qs[0].question_id == "HumanEval/0"
    assert qs[0].turns[0].startswith("from typing import List")


def test_n_takes_the_first_questions():
    assert [q.question_id for q in load_task("mt_bench", 3)] == [81, 82, 83]


def test_chitchat_first_turns_are_deterministic_and_not_in_training():
    a, b = load_task("chitchat", 20), load_task("chitchat", 20)
    assert a == b and len(a) == 20
    assert all(len(q.turns) == 1 and len(q.turns[0].split()) >= 6 for q in a)
    train = training_prompts(300, seed=1)
    assert len(set(train)) == 300
    assert training_prompts(300, seed=1) == train != training_prompts(300, seed=2)
    assert not {q.turns[0] for q in load_task("chitchat")} & set(train)


def test_unknown_task_names_the_known_ones():
    with pytest.raises(ValueError, match="mt_bench"):
        load_task("gsm9k")


def test_spec_bench_questions_file(tmp_path):
    path = tmp_path / "question.jsonl"
    records = [
        {"question_id": 1, "category": "summarization", "turns": ["Summarize this.", "Shorter."]},
        {"question_id": "x2", "category": "rag", "turns": ["Answer from the passage."]},
    ]
    path.write_text("\n".join(json.dumps(r) for r in records) + "\n\n")
    assert load_questions_file(path) == [
        Question(1, "summarization", ["Summarize this.", "Shorter."]),
        Question("x2", "rag", ["Answer from the passage."]),
    ]


def test_questions_file_errors(tmp_path):
    with pytest.raises(TaskDataError, match="does not exist"):
        load_questions_file(tmp_path / "missing.jsonl")
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"question_id": 1}\n')
    with pytest.raises(TaskDataError, match="turns"):
        load_questions_file(bad)


def test_longdoc_is_long_deterministic_and_from_the_standard_library():
    from jspec.tasks import LONGDOC_MODULES

    a, b = load_task("longdoc"), load_task("longdoc")
    assert a == b and len(a) >= 40 and len(a) % 2 == 0
    assert {q.category for q in a} == {"summarization", "qa"}
    assert all(len(q.turns) == 1 and len(q.turns[0].split()) >= 500 for q in a)
    assert {str(q.question_id).split("/")[0] for q in a} <= set(LONGDOC_MODULES)
    assert "Documentation of the Python module `json`" in a[2].turns[0]
