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
