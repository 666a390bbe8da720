"""A session-wide pool of ``vllm.LLM`` engines keyed by their arguments.

Invariant: two requests for the same arguments get the same engine; at most ``max_alive`` engines run at
once (the least recently used one is shut down first), so the suite fits in this machine's memory.
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
    def __init__(self, max_alive: int = 2) -> None:
        self.max_alive = max_alive
        self._engines: OrderedDict[str, Any] = OrderedDict()

    def get(self, model: str | Any, **kwargs: Any):
        """Return an ``LLM(model, **ENGINE_DEFAULTS | kwargs)``, built on first use."""
        arguments = ENGINE_DEFAULTS | {"model": str(model)} | kwargs
        key = json.dumps(arguments, sort_keys=True, default=str)
        if key in self._engines:
            self._engines.move_to_end(key)
            return self._engines[key]
        while len(self._engines) >= self.max_alive:
            _, oldest = self._engines.popitem(last=False)
            shutdown_engine(oldest)
        from vllm import LLM

        engine = LLM(**arguments)
        self._engines[key] = engine
        return engine

    def close(self) -> None:
        while self._engines:
            _, engine = self._engines.popitem()
            shutdown_engine(engine)


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
