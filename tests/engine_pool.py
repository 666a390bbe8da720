"""A session-wide pool of ``vllm.LLM`` engines keyed by their arguments.

Invariant: two requests for the same arguments get the same engine while it is alive. An engine runs in this
process unless asked for ``multiprocess``: vLLM's engine core and its worker then run here
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``, as in vLLM's own tests), with the same scheduler, runner and plugin
code, and start in 1-5 s where two spawned processes that each import vLLM take 25-40 s on these machines.
Such engines share this process's torch.distributed groups, which each one sets up for its own model and
tears down as it stops, so at most one is alive: asking for another shuts it down, and using it afterwards
raises :class:`EngineShutDown` (take its outputs first). ``LLM()``'s default, the core and the worker in
processes of their own, is what ``multiprocess=True`` and the server tests run; such engines stay alive
beside it, at most ``max_alive`` engines in all, each started only with ``min_free_gib`` of memory available
(the least recently used is shut down until it is, or none is left).

Between engines the process's heap is frozen (``gc.freeze``): an in-process engine's start and stop run
vLLM's full collections, and each walks every object of vLLM, torch and transformers (about 0.5 s each here,
eight of them per engine); with the heap frozen they walk only what is new. An engine still frees all it
holds: vLLM unfreezes the heap as an engine stops, :func:`shutdown_engine` collects once and freezes again.
"""

from __future__ import annotations

import gc
import json
import os
from collections import OrderedDict
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any
from unittest import mock

ENGINE_DEFAULTS: dict[str, Any] = {
    "dtype": "float32",
    "enforce_eager": True,
    "max_model_len": 512,
    "max_num_seqs": 64,
    "seed": 0,
    "disable_log_stats": False,
}


class EngineShutDown(RuntimeError):
    """An engine of the pool was used after the pool shut it down."""


class _ShutDownEngine:
    def __init__(self, key: str) -> None:
        self._key = key

    def __getattr__(self, name: str) -> Any:
        raise EngineShutDown(f"the engine pool shut this engine down to start another in this process ({self._key});"
                             " read what a test needs from an engine before asking the pool for the next one")


class EnginePool:
    def __init__(self, max_alive: int = 3, min_free_gib: float = 10.0) -> None:
        self.max_alive = max_alive
        self.min_free_gib = min_free_gib
        self._engines: OrderedDict[str, Any] = OrderedDict()
        self._in_process: str | None = None  # the key of the engine running in this process
        gc.collect()
        gc.freeze()

    def get(self, model: str | Any, *, multiprocess: bool = False, **kwargs: Any):
        """Return an ``LLM(model, **ENGINE_DEFAULTS | kwargs)``, built on first use; ``multiprocess``: its
        engine core and worker in processes of their own (module docstring)."""
        arguments = ENGINE_DEFAULTS | {"model": str(model)} | kwargs
        key = json.dumps([arguments, multiprocess], sort_keys=True, default=str)
        if key in self._engines:
            self._engines.move_to_end(key)
            return self._engines[key]
        if not multiprocess and self._in_process is not None:
            self._shut_down(self._in_process)
        while len(self._engines) >= self.max_alive or (self._engines and _available_gib() < self.min_free_gib):
            self._shut_down(next(iter(self._engines)))
        from vllm import LLM

        with engine_processes(multiprocess):
            engine = LLM(**arguments)
        self._engines[key] = engine
        if not multiprocess:
            self._in_process = key
        return engine

    def _shut_down(self, key: str) -> None:
        engine = self._engines.pop(key)
        if key == self._in_process:
            self._in_process = None
        shutdown_engine(engine)
        engine.llm_engine = _ShutDownEngine(key)

    def close(self) -> None:
        """Shut every engine down and unfreeze the heap, so that the process exits as one that never froze it."""
        while self._engines:
            self._shut_down(next(reversed(self._engines)))
        gc.unfreeze()


def _available_gib() -> float:
    import psutil

    return psutil.virtual_memory().available / 2**30


@contextmanager
def engine_processes(multiprocess: bool) -> Iterator[None]:
    """Within: ``LLM()`` runs its engine core and worker in processes of their own or in this one. vLLM
    caches its environment once an engine core has started in this process; the cache is dropped on both
    sides so that the next engine reads the variable again. Only this variable is restored (not the whole
    environment, as ``mock.patch.dict`` would): vLLM sets others while an engine starts, and the engine outlives
    this block."""
    import vllm.envs as envs

    name = "VLLM_ENABLE_V1_MULTIPROCESSING"
    before = os.environ.get(name)
    os.environ[name] = "1" if multiprocess else "0"
    envs.disable_envs_cache()
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = before
        envs.disable_envs_cache()


def shutdown_engine(engine: Any) -> None:
    """Stop ``engine`` and free what it held. An engine core that ran in this process froze the heap as it
    started (vLLM's ``freeze_gc_heap``) and unfreezes it as it stops, then collects twice; here its reference
    cycles are collected once, after it has stopped, and the heap is frozen again (module docstring)."""
    with mock.patch.object(gc, "collect", return_value=0):
        engine.llm_engine.engine_core.shutdown()
    gc.collect()
    gc.freeze()


def greedy_tokens(llm: Any, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    """Greedy output token ids of ``prompts`` (token-id lists), EOS ignored."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    outputs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outputs]
