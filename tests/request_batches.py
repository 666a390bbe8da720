"""The greedy request batches the engine tests of trees (draft models and EAGLE heads) compare with vanilla."""

from __future__ import annotations

SINGLE = [([1, 5, 9, 13, 17], {"max_tokens": 40, "ignore_eos": True})]
# Eight requests of different prompt lengths and lengths of output, some ending on a stop string or EOS.
MIXED = [
    ([1, 7], {"max_tokens": 40, "ignore_eos": True}),
    ([1, 40, 41, 42, 43], {"max_tokens": 7, "ignore_eos": True}),
    ([1] + [3 + (j * 7) % 60 for j in range(16)], {"max_tokens": 25, "stop": ["w22"]}),
    ([1, 60, 3, 3, 3, 3, 3, 21], {"max_tokens": 33}),
    ([1, 9, 9], {"max_tokens": 1, "ignore_eos": True}),
    ([1] + [5 + (j * 13) % 55 for j in range(29)], {"max_tokens": 18, "ignore_eos": True}),
    ([1, 33, 17, 50, 12, 8, 44, 19, 23, 61, 4, 27], {"max_tokens": 40, "stop": ["w30 w55"]}),
    ([1, 14, 2, 14], {"max_tokens": 12, "ignore_eos": True}),
]


def generate(llm, requests, **common) -> list[tuple[list[int], str, str]]:
    """(token ids, text, finish reason) of each ``(prompt ids, SamplingParams options)`` request, greedy
    unless the options or ``common`` say otherwise."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = [SamplingParams(**({"temperature": 0.0} | options | common)) for _, options in requests]
    prompts = [TokensPrompt(prompt_token_ids=prompt) for prompt, _ in requests]
    outputs = llm.generate(prompts, params, use_tqdm=False)
    return [(list(o.outputs[0].token_ids), o.outputs[0].text, o.outputs[0].finish_reason) for o in outputs]
