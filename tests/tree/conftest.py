"""Fixtures for the token-tree tests.

``kernel_runner`` runs a function from ``kernel_cases`` where the Triton kernels can execute: in this
process when a GPU is present, otherwise in one spawned worker process started with
``TRITON_INTERPRET=1``. The interpreter must be enabled before ``triton`` is first imported (its own
``@jit`` library functions are built at import time), and other tests in the session may already have
imported triton through vLLM, so the variable is set only for the worker's start-up and restored at
once: no other test ever sees it.
"""

from __future__ import annotations

import multiprocessing
import os
from collections.abc import Callable, Iterator
from concurrent.futures import ProcessPoolExecutor

import pytest
import torch


@pytest.fixture(scope="session")
def kernel_runner() -> Iterator[Callable]:
    pytest.importorskip("triton")
    if torch.cuda.is_available():
        yield lambda fn, *args, **kwargs: fn(*args, **kwargs)
        return
    previous = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        pool = ProcessPoolExecutor(max_workers=1, mp_context=multiprocessing.get_context("spawn"))
        pool.submit(int, 0).result(timeout=300)  # the worker exists (with the variable) from here on
    finally:
        if previous is None:
            del os.environ["TRITON_INTERPRET"]
        else:
            os.environ["TRITON_INTERPRET"] = previous

    def run(fn: Callable, *args, **kwargs):
        return pool.submit(fn, *args, **kwargs).result(timeout=900)

    yield run
    pool.shutdown(cancel_futures=True)


# ---- tiny targets for token-tree engine tests ------------------------------------------------------------
# The session's tiny targets (tests/conftest.py) follow their family's shared bigram map so closely that
# greedy output cycles and a tree accepts almost every draft. These targets scale each layer's output by 4,
# so the next token depends on the context and trees see rejections, non-first branches and compaction.


@pytest.fixture(scope="session")
def tree_llama_dir(tiny_root, tiny_tokenizer_dir):
    from tests.tiny_models import build_tiny_model

    return build_tiny_model(tiny_root / "tree_llama", tiny_tokenizer_dir, "llama", num_layers=4, seed=11,
                            layer_scale=4.0)


@pytest.fixture(scope="session")
def tree_qwen2_dir(tiny_root, tiny_tokenizer_dir):
    from tests.tiny_models import build_tiny_model

    return build_tiny_model(tiny_root / "tree_qwen2", tiny_tokenizer_dir, "qwen2", num_layers=4, seed=12,
                            layer_scale=4.0)


@pytest.fixture(scope="session")
def tree_moe_dir(tiny_root, tiny_tokenizer_dir):
    from tests.tiny_models import build_tiny_model

    return build_tiny_model(tiny_root / "tree_mixtral", tiny_tokenizer_dir, "mixtral", num_layers=2, seed=13,
                            layer_scale=4.0)


@pytest.fixture(scope="session")
def byte_level_pair(tiny_root):
    """(target, draft) across vocabularies: byte-level BPE, the draft lacking the target's last 30 tokens."""
    from tests.tiny_models import build_byte_level_pair

    return build_byte_level_pair(tiny_root / "byte_level")
