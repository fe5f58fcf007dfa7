"""Questions to token ids: the first turn of each question (MT-Bench "first turns")."""

from __future__ import annotations

from typing import Any, Sequence

from jspec.tasks import Question


def has_chat_template(tokenizer: Any) -> bool:
    return bool(getattr(tokenizer, "chat_template", None))


def encode_first_turn(tokenizer: Any, text: str, *, chat: bool) -> list[int]:
    """Chat models get the tokenizer's chat template with the generation prompt; base models the
    plain text with the tokenizer's own special tokens (BOS)."""
    if chat:
        # Render to text, then tokenize without adding specials: the template already wrote BOS.
        rendered = tokenizer.apply_chat_template(
            [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=False
        )
        return list(tokenizer(rendered, add_special_tokens=False)["input_ids"])
    return list(tokenizer(text)["input_ids"])


def encode_questions(tokenizer: Any, questions: Sequence[Question], *, chat: bool | None = None) -> list[list[int]]:
    """Token ids per question; ``chat=None`` uses the chat template whenever the tokenizer has one."""
    use_chat = has_chat_template(tokenizer) if chat is None else chat
    return [encode_first_turn(tokenizer, q.turns[0], chat=use_chat) for q in questions]
