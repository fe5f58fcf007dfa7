"""scripts/bench_rollout.py on a tiny random model: rows for every method and row count, ratios
against AR in the same process, the sampled tokens scored by the target."""

import importlib.util
import json
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "bench_rollout.py"


def _module():
    spec = importlib.util.spec_from_file_location("bench_rollout", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_rollout_rows_on_a_tiny_model(tmp_path):
    out = tmp_path / "rollout.json"
    rows = _module().main(["--tiny", "--prompts", "10", "--rows", "4", "--max-new-tokens", "16",
                           "--methods", "ar,spec:ngram:static:k=3,spec:ngram:auto", "--ar-tail", "--out", str(out)])
    assert json.loads(out.read_text()) == rows
    assert [r["name"] for r in rows] == ["ar", "ar+tail", "spec:ngram:static:k=3", "spec:ngram:auto"]
    assert rows[1]["auto_plan"] == "plain decoding; the last 1 rows in a 1-row tail"
    assert rows[1]["tokens_per_call"] == 1.0  # the tail's prefill is the call that emits a row's next token
    assert rows[0]["speedup_vs_ar"] == 1.0 and all(r["speedup_vs_ar"] > 0 for r in rows)
    assert all(r["n_prompts"] == 10 and r["rows_in_flight"] == 4 and 0 < r["tokens"] <= 160 for r in rows)
    assert rows[3]["auto_plan"]  # auto says what it ran


def test_rollout_needs_ar_and_sane_arguments():
    from jspec.errors import UsageError

    main = _module().main
    with pytest.raises(UsageError, match="must include ar"):
        main(["--tiny", "--methods", "spec:ngram:static"])
    with pytest.raises(UsageError, match="--rows"):
        main(["--tiny", "--rows", "0"])
    with pytest.raises(UsageError, match="--tail-rows 4: 0 .none. up to fewer than the smallest --rows .4."):
        main(["--tiny", "--rows", "4,8", "--tail-rows", "4"])
