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


