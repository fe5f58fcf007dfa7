"""Qwen2.5-Coder 1.5B and 0.5B Instruct (Q4_K_M GGUFs from the package index, `make models-qwen`):
jspec's greedy continuations against transformers' on the same GGUF, fp32, CPU.

8 HumanEval and 8 MT-Bench first turns, chat-formatted, 64 new tokens each. jspec decodes them as
one batch; transformers checks each by teacher forcing (one forward over prompt + jspec's tokens
must put its argmax on every one of jspec's tokens: by induction that is transformers' greedy
output) and decodes the first prompt of each task with `generate` as well. jspec's weights are
freed before transformers loads its own (a 1.5B model is 6 GB in fp32). Measured on a shared
2-core CPU: 9.7 minutes for the 1.5B, 2.3 for the 0.5B; 16 of 16 identical for both.
"""

from __future__ import annotations

import gc

import pytest
import torch
from gguf_reference import jspec_greedy, preset_gguf, transformers_from_gguf, until_eos

from jspec.checkpoint.gguf_io import open_gguf
from jspec.generate import generate
from jspec.presets import resolve_model, resolve_tokenizer
from jspec.speculative.config import SpeculativeConfig
from jspec.tasks import TaskDataError, load_task
from jspec.tokenizer import apply_chat

pytestmark = [pytest.mark.slow, pytest.mark.alone]  # Makefile: after the parallel suite, by itself

NEW_TOKENS = 64
PROMPTS_PER_TASK = 8
TASKS = ("humaneval", "mt_bench")
# The tensor types of both files; tests/test_checkpoint.py checks each one's dequantization.
TENSOR_TYPES = {"F32", "Q4_K", "Q5_0", "Q6_K", "Q8_0"}
PRESETS = {  # preset: (layers, hidden, heads, kv heads)
    "qwen2.5-coder-1.5b-instruct": (28, 1536, 12, 2),
    "qwen2.5-coder-0.5b-instruct": (24, 896, 14, 2),
}


def task_prompts(tok) -> list[tuple[str, list[int]]]:
    """(question id, chat-formatted ids of its first turn) for the first prompts of each task."""
    try:
        questions = [q for task in TASKS for q in load_task(task, PROMPTS_PER_TASK)]
    except TaskDataError as e:
        pytest.skip(str(e))
    return [(str(q.question_id), apply_chat(tok, q.turns[0])) for q in questions]


def jspec_continuations(preset: str, prompts: list[list[int]]):
    """(cfg, greedy continuations up to EOS); the weights go out of scope on return."""
    cfg, params, _ = resolve_model(preset, dtype="float32", tokenizer=False)
    out = jspec_greedy(cfg, params, prompts, NEW_TOKENS)
    return cfg, [until_eos(row, cfg.eos_token_ids) for row in out]


def first_difference(got: list[int], ref: list[int]) -> int:
    return next(i for i, (a, b) in enumerate(zip(got, ref)) if a != b)


@pytest.mark.parametrize("preset", list(PRESETS))
def test_qwen_greedy_matches_transformers(preset):
    path = preset_gguf(preset)
    assert {t.tensor_type.name for t in open_gguf(path).tensors} <= TENSOR_TYPES
    tok = resolve_tokenizer(preset)
    prompts = task_prompts(tok)
    cfg, ours = jspec_continuations(preset, [ids for _, ids in prompts])
    gc.collect()
    assert (cfg.arch, cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads) == ("qwen2", *PRESETS[preset])
    assert cfg.attention_bias and not cfg.tie_word_embeddings and cfg.vocab_size == len(tok) == 151936
    assert cfg.eos_token_ids == (tok.convert_tokens_to_ids("<|im_end|>"),)

    hf = transformers_from_gguf(path)
    c = hf.config
    assert (c.num_hidden_layers, c.hidden_size, c.num_attention_heads, c.num_key_value_heads) == PRESETS[preset]
    assert cfg.rope_theta == c.rope_parameters["rope_theta"] == 1e6 and not c.tie_word_embeddings
    differing = []
    for (qid, prompt), got in zip(prompts, ours):
        with torch.no_grad():
            logits = hf(torch.tensor([prompt + got])).logits[0]
        ref = logits[len(prompt) - 1 : len(prompt) + len(got) - 1].argmax(-1).tolist()
        if got != ref:
            i = first_difference(got, ref)
            differing.append(f"{qid}: token {i}: jspec {tok.decode(got[: i + 1])!r}, transformers ...{tok.decode(ref[i])!r}")
    assert not differing, f"{len(differing)} of {len(prompts)} continuations differ:\n" + "\n".join(differing)
    for b in (0, PROMPTS_PER_TASK):  # the first prompt of each task through transformers' generate
        prompt = prompts[b][1]
        with torch.no_grad():
            out = hf.generate(torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, do_sample=False)
        assert out[0, len(prompt):].tolist() == ours[b], prompts[b][0]


def test_qwen_half_billion_drafts_for_the_1_5b_losslessly():
    """The 0.5B as an independent draft model of the 1.5B (one tokenizer, one 151,936-row vocabulary):
    greedy speculative output equals AR, with several tokens per target call."""
    preset_gguf("qwen2.5-coder-1.5b-instruct"), preset_gguf("qwen2.5-coder-0.5b-instruct")
    cfg, params, tok = resolve_model("qwen2.5-coder-1.5b-instruct", dtype="float32")
    prompts = [ids for _, ids in task_prompts(tok)[:1]]
    spec = SpeculativeConfig(drafter="model:qwen2.5-coder-0.5b-instruct", k_max=4)
    ar = generate(params, cfg, prompts, max_new_tokens=32)
    sd = generate(params, cfg, prompts, max_new_tokens=32, speculative=spec)
    assert sd.row(0) == ar.row(0)
    assert sd.mean_accepted_tokens[0] > 2.0  # at 64 tokens, measured: 3.37 (HumanEval/0), 2.67 (MT-Bench 81)
