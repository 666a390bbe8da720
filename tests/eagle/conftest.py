"""Fixtures for the EAGLE trainer tests: local text in the tiny tokenizer's words, and a
helper that runs the trainer in-process with small settings."""

from __future__ import annotations

import random
from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def tiny_text_dir(tmp_path_factory) -> Path:
    """Files of space-separated tiny-tokenizer words; short repeated phrases make the
    continuation partly predictable, like code."""
    d = tmp_path_factory.mktemp("eagle_text")
    rng = random.Random(0)
    phrases = [[f"w{rng.randrange(3, 64)}" for _ in range(rng.randrange(3, 7))] for _ in range(12)]
    for i in range(24):
        words = []
        while len(words) < 200:
            words += phrases[rng.randrange(len(phrases))] if rng.random() < 0.7 else [f"w{rng.randrange(3, 64)}"]
        (d / f"f{i}.py").write_text(" ".join(words))
    return d




# The tiny Llama is close to a bigram model, so a head learns it within a few dozen steps and
# accepts often enough for the replay comparison and the distribution tests to mean something.
@pytest.fixture(scope="session")
def trained_tiny_heads(tmp_path_factory, tiny_llama_dir, tiny_text_dir):
    """``heads(fmt)``: the directory of a head trained on the tiny Llama (``eagle`` or ``eagle3``), trained
    once per session."""
    from tests.eagle.eagle_helpers import train_args
    from vllm_easyspec_train.trainer import train

    trained: dict[str, Path] = {}

    def heads(fmt: str) -> Path:
        if fmt not in trained:
            tmp = tmp_path_factory.mktemp(f"trained_{fmt}")
            extra = ["--max-steps", "40", "--eval-every", "40", "--save-every", "40", "--lr", "3e-3"]
            if fmt == "eagle3":
                extra += ["--draft-vocab-size", "48"]
            train(train_args(tiny_llama_dir, tmp / "head", tmp / "w", tiny_text_dir, fmt, extra))
            trained[fmt] = tmp / "head"
        return trained[fmt]

    return heads
