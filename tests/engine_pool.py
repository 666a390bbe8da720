"""A session-wide pool of ``vllm.LLM`` engines keyed by their arguments.

Invariant: two requests for the same arguments get the same engine; at most ``max_alive`` engines run at
once, and an engine starts only with ``min_free_gib`` of memory available (others are shut down until it is,
or none is left), so the suite fits in this machine's memory: three tiny engines, two of the real models.
When one must go, the least recently used speculative engine is shut down first and an engine without
speculation only when no speculative one is left: nearly every test compares against a plain engine of the
same tiny target, and each start costs about half a minute here.
"""

from __future__ import annotations

import gc
import json
from collections import OrderedDict
from typing import Any

ENGINE_DEFAULTS: dict[str, Any] = {
    "dtype": "float32",
    "enforce_eager": True,
    "max_model_len": 512,
    "max_num_seqs": 64,
    "seed": 0,
    "disable_log_stats": False,
}


class EnginePool:
    def __init__(self, max_alive: int = 3, min_free_gib: float = 10.0) -> None:
        self.max_alive = max_alive
        self.min_free_gib = min_free_gib
        self._engines: OrderedDict[str, Any] = OrderedDict()
        self._speculative: set[str] = set()

    def get(self, model: str | Any, **kwargs: Any):
        """Return an ``LLM(model, **ENGINE_DEFAULTS | kwargs)``, built on first use."""
        arguments = ENGINE_DEFAULTS | {"model": str(model)} | kwargs
        key = json.dumps(arguments, sort_keys=True, default=str)
        if key in self._engines:
            self._engines.move_to_end(key)
            return self._engines[key]
        while len(self._engines) >= self.max_alive or (self._engines and _available_gib() < self.min_free_gib):
            self._shut_down(self._next_to_shut_down())
        from vllm import LLM

        engine = LLM(**arguments)
        self._engines[key] = engine
        if arguments.get("speculative_config"):
            self._speculative.add(key)
        return engine

    def _next_to_shut_down(self) -> str:
        """The least recently used speculative engine's key, else the least recently used engine's."""
        return next((key for key in self._engines if key in self._speculative), next(iter(self._engines)))

    def _shut_down(self, key: str) -> None:
        engine = self._engines.pop(key)
        self._speculative.discard(key)
        shutdown_engine(engine)

    def close(self) -> None:
        while self._engines:
            self._shut_down(next(reversed(self._engines)))


def _available_gib() -> float:
    import psutil

    return psutil.virtual_memory().available / 2**30


def shutdown_engine(engine: Any) -> None:
    engine.llm_engine.engine_core.shutdown()
    del engine
    gc.collect()


def greedy_tokens(llm: Any, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    """Greedy output token ids of ``prompts`` (token-id lists), EOS ignored."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    outputs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outputs]
