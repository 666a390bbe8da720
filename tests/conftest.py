"""Shared fixtures: tiny random models built once per test session, and a pool of vLLM engines shared by
every test (``engine_pool``: engines run in the test process unless a test asks for ``LLM()``'s own processes,
which take 25-40 s to start on these 2-core machines).

Every test that starts a vLLM engine is marked ``engine``: those that use the engine pool or the real models
here (:data:`ENGINE_FIXTURES`), the others with ``@pytest.mark.engine``. ``pytest -m "not engine and not
slow"`` runs the engine-free tests.
"""

from __future__ import annotations

import os
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]  # the repository: ``tests`` is a package under it

# Engine settings this 2-core CPU machine needs; set before vLLM is imported anywhere. Worker processes
# inherit the environment, including PYTHONPATH so that functions from the tests package can run inside
# workers through LLM.collective_rpc.
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "0-1")
os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Lets tests send functions to workers with LLM.collective_rpc (test processes only).
os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))

import pytest  # noqa: E402

from tests.engine_pool import EnginePool  # noqa: E402
from tests.tiny_models import build_tiny_model, build_tiny_tokenizer  # noqa: E402

ENGINE_FIXTURES = frozenset({"llm_pool", "real_pair"})


def pytest_collection_modifyitems(config, items) -> None:
    for item in items:
        if ENGINE_FIXTURES & set(item.fixturenames):
            item.add_marker(pytest.mark.engine)


@pytest.fixture(scope="session")
def tiny_root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("tiny_models")


@pytest.fixture(scope="session")
def tiny_tokenizer_dir(tiny_root: Path) -> Path:
    return build_tiny_tokenizer(tiny_root / "tokenizer")


@pytest.fixture(scope="session")
def tiny_llama_dir(tiny_root: Path, tiny_tokenizer_dir: Path) -> Path:
    """Target: 4-layer Llama."""
    return build_tiny_model(tiny_root / "llama", tiny_tokenizer_dir, "llama", num_layers=4, seed=1)


@pytest.fixture(scope="session")
def tiny_llama_draft_dir(tiny_root: Path, tiny_tokenizer_dir: Path) -> Path:
    """Draft for the tiny targets: an 8-layer Llama of the same family (so layer groups of 2-3 fit)."""
    return build_tiny_model(
        tiny_root / "llama_draft", tiny_tokenizer_dir, "llama", num_layers=8, seed=2, layer_scale=0.3
    )


@pytest.fixture(scope="session")
def tiny_qwen2_dir(tiny_root: Path, tiny_tokenizer_dir: Path) -> Path:
    """A 6-layer Qwen2 (target or draft)."""
    return build_tiny_model(tiny_root / "qwen2", tiny_tokenizer_dir, "qwen2", num_layers=6, seed=3)


@pytest.fixture(scope="session")
def tiny_moe_dir(tiny_root: Path, tiny_tokenizer_dir: Path) -> Path:
    """A 2-layer Mixtral (4 experts, top-2) target."""
    return build_tiny_model(tiny_root / "mixtral", tiny_tokenizer_dir, "mixtral", num_layers=2, seed=4)


@pytest.fixture(scope="session")
def llm_pool():
    pool = EnginePool()
    yield pool
    pool.close()


@pytest.fixture(scope="module")
def real_pair():
    """The default real pair (target, draft): Qwen2.5-Coder-0.5B-Instruct and SmolLM2-135M-Instruct."""
    from vllm_easyspec.models import fetch_model

    return fetch_model("qwen2.5-coder-0.5b-instruct"), fetch_model("smollm2-135m-instruct")
