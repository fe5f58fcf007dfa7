"""Stand-ins for the head-training pipeline tests: a character tokenizer with a chat template, a
tiny corpus built from it, and a tiny random target."""

from __future__ import annotations

from jspec.tasks import Question
from jspec.train.corpus import RawItem
from jspec.train.testing import tiny_target_config

TARGET = tiny_target_config()  # vocab 128, EOS 1, pad 0
_USER, _ASSISTANT, _EOS = "\x02", "\x03", "\x01"


class CharChatTokenizer:
    """One id per character: EOS 1, user marker 2, assistant marker 3, other characters 4 + ord % 124.
    Chat template: per message, the role marker, the content and EOS; the generation prompt is the
    assistant marker."""

    chat_template = "char-chat-v1"
    eos_token_id = 1

    def _ids(self, text: str) -> list[int]:
        special = {_EOS: 1, _USER: 2, _ASSISTANT: 3}
        return [special.get(c, 4 + ord(c) % 124) for c in text]

    def __call__(self, texts, add_special_tokens=True):
        if isinstance(texts, str):
            return {"input_ids": self._ids(texts)}
        return {"input_ids": [self._ids(t) for t in texts]}

    def apply_chat_template(self, messages, add_generation_prompt=False, tokenize=True, return_dict=False):
        text = "".join((_USER if m["role"] == "user" else _ASSISTANT) + m["content"] + _EOS for m in messages)
        text += _ASSISTANT if add_generation_prompt else ""
        return self._ids(text) if tokenize else text

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(97 + (i - 4) % 26) if i >= 4 else ("" if skip_special_tokens else "?") for i in ids)


def tiny_sources(n_conv: int = 24):
    """(sharegpt stand-in, chitchat stand-in, eval questions): short multi-turn conversations, one
    training prompt equal to an evaluation prompt (must be dropped)."""
    items, words = [], ["alpha", "beta", "gamma", "delta", "omega", "kappa", "sigma"]
    for c in range(n_conv):
        first = len(items)
        items.append(RawItem(f"tell me about {words[c % 7]} number {c}", "sharegpt_first", -1, f"c{c}"))
        items.append(RawItem(f"and {words[(c + 1) % 7]}?", "sharegpt_cont", first, f"c{c}"))
    items.append(RawItem("what is the capital of france", "sharegpt_first", -1, "leak"))
    chitchat = [RawItem(f"hi there how are you doing {w} today", "chitchat", -1, f"h{i}") for i, w in enumerate(words)]
    evals = {"mt_bench": [Question(1, "writing", ["What is the capital of France?"])],
             "humaneval": [Question("h/0", "coding", ["def add(a, b):"])],
             "chitchat": [Question("x", "chitchat", ["hello friend"])]}
    return (items, {"conversations": n_conv, "broken_tail_chars": 0}), chitchat, evals
