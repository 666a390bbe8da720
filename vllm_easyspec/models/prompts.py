"""Prompt text to token ids, the way every benchmark and test of this project feeds a model."""

from __future__ import annotations

from typing import Any


def prompt_token_ids(tokenizer: Any, text: str) -> list[int]:
    """One user turn through the tokenizer's chat template (with the generation prompt), or the plain
    encoding when the tokenizer has no template. transformers 5 returns a BatchEncoding from
    ``apply_chat_template(tokenize=True)``; this always returns a plain list of ids."""
    if getattr(tokenizer, "chat_template", None):
        ids = tokenizer.apply_chat_template(
            [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True
        )
    else:
        ids = tokenizer(text)
    if hasattr(ids, "keys"):
        ids = ids["input_ids"]
    return [int(token) for token in ids]
