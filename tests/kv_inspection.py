"""Read a request's paged KV cache (draft or target layers) back as ``[positions, kv_heads, head_size]``.

A debugging and testing aid: after a step, the draft KV of every position below the new bonus token must
equal what an exact draft holds (bonus calibration), and the target KV must be that of the verified
chain (tree KV compaction). The CPU attention backend stores K/V in an ISA-specific packed layout, read
back through the layout probed by :mod:`vllm_easyspec.integration.cpu.kv_layout`.

All functions here take a vLLM worker and are meant for ``LLM.collective_rpc``. Invariant: reading is
side-effect free on the engine's caches (only a scratch tensor is written).
"""

from __future__ import annotations

from typing import Any

import torch

_RECORDED = "_easyspec_recorded_block_tables"


def start_recording_block_tables(worker: Any) -> bool:
    """From now on, remember each request's block ids as the plugin's drafter sees them in ``propose`` (clears
    old records). Wraps, on this worker's drafter instance only, its ``propose``."""
    from vllm_easyspec.integration.proposers import PROPOSE_SIGNATURE

    drafter = _drafter(worker)
    if not hasattr(drafter, _RECORDED):
        unrecorded_propose = drafter.propose
        runner = worker.model_runner

        def recording_propose(*args: Any, **kwargs: Any) -> torch.Tensor:
            cad = PROPOSE_SIGNATURE.bind(drafter, *args, **kwargs).arguments["common_attn_metadata"]
            table = cad.block_table_tensor.cpu()
            for row, req_id in enumerate(list(runner.input_batch.req_ids)[: cad.batch_size()]):
                getattr(drafter, _RECORDED)[req_id] = [int(b) for b in table[row].tolist()]
            return unrecorded_propose(*args, **kwargs)

        drafter.propose = recording_propose
    setattr(drafter, _RECORDED, {})
    return True


def _drafter(worker: Any):
    drafter = getattr(worker.model_runner, "drafter", None)
    if getattr(drafter, "options", None) is None:
        raise RuntimeError("KV inspection needs the plugin's drafter (additional_config['easyspec'] set)")
    return drafter


def read_draft_kv(worker: Any, num_positions: int, request: str | None = None) -> dict[str, dict[str, torch.Tensor]]:
    """K and V of every draft attention layer at positions ``0..num_positions-1`` of the request recorded since
    :func:`start_recording_block_tables` whose id starts with ``request`` (None: the only one recorded)."""
    drafter = _drafter(worker)
    return _read_layers(worker, sorted(drafter._draft_attn_layer_names), num_positions, request)


def read_target_kv(worker: Any, num_positions: int) -> dict[str, dict[str, torch.Tensor]]:
    """The same for the target's attention layers (the draft shares the target's block table)."""
    from vllm.model_executor.layers.attention import Attention

    drafter = _drafter(worker)
    context = worker.model_runner.vllm_config.compilation_config.static_forward_context
    names = [name for name, layer in context.items()
             if isinstance(layer, Attention) and name not in drafter._draft_attn_layer_names]
    return _read_layers(worker, sorted(names), num_positions)


def _read_layers(worker: Any, names: list[str], num_positions: int,
                 request: str | None = None) -> dict[str, dict[str, torch.Tensor]]:
    from vllm_easyspec.integration.cpu.kv_layout import PagedKVReader, probe_cpu_kv_layout

    tables = {req_id: blocks for req_id, blocks in getattr(_drafter(worker), _RECORDED).items()
              if request is None or req_id.startswith(request)}
    if len(tables) != 1:
        raise RuntimeError(f"expected exactly one recorded request (id starting with {request!r}), "
                           f"found {sorted(tables)}")
    (block_ids,) = tables.values()
    block_table = torch.tensor([block_ids], dtype=torch.int64)
    lengths = torch.tensor([num_positions])
    context = worker.model_runner.vllm_config.compilation_config.static_forward_context
    result: dict[str, dict[str, torch.Tensor]] = {}
    for name in names:
        layer = context[name]
        kv_cache = layer.kv_cache
        if isinstance(kv_cache, (list, tuple)):
            kv_cache = kv_cache[0]
        _, num_kv_heads, block_size, fused = kv_cache.shape
        reader = PagedKVReader(probe_cpu_kv_layout(layer.isa, kv_cache.dtype, num_kv_heads, block_size, fused // 2))
        keys, values = reader.gather(kv_cache, reader.index(block_table, lengths))
        result[name] = {
            "key": keys[0, :, :num_positions].transpose(0, 1).clone(),
            "value": values[0, :, :num_positions].transpose(0, 1).clone(),
        }
    return result


def generate_and_read_draft_kv(llm: Any, requests: dict[str, tuple[list[int], int]], tag: str,
                               read: str) -> tuple[dict[str, list[int]], dict[str, dict[str, torch.Tensor]]]:
    """Run ``requests`` (name -> (prompt ids, greedy tokens), ids ``{tag}-{name}``) together on ``llm`` step by
    step; returns each one's output tokens and the draft KV of request ``read`` at every position below its
    last token."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    llm.collective_rpc(start_recording_block_tables)
    engine = llm.llm_engine
    for name, (prompt, max_tokens) in requests.items():
        engine.add_request(f"{tag}-{name}", TokensPrompt(prompt_token_ids=prompt),
                           SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True))
    outputs: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                outputs[output.request_id.removeprefix(f"{tag}-")] = list(output.outputs[0].token_ids)
    positions = len(requests[read][0]) + len(outputs[read]) - 1
    return outputs, llm.collective_rpc(read_draft_kv, args=(positions, f"{tag}-{read}"))[0]


# A long request beside a short one: with budget_by_batch {"2": 0} nothing is drafted while both run.
DEFERRAL_REQUESTS = {"long": ([1] + [3 + (j * 11) % 60 for j in range(20)], 30), "short": ([1, 7, 8], 10)}


def deferral_expected(vanilla: Any) -> dict[str, list[int]]:
    """Each of :data:`DEFERRAL_REQUESTS`' greedy outputs on ``vanilla`` (an engine without speculation)."""
    from tests.request_batches import generate

    outputs = generate(vanilla, [(prompt, {"max_tokens": n, "ignore_eos": True})
                                 for prompt, n in DEFERRAL_REQUESTS.values()])
    return {name: tokens for name, (tokens, _, _) in zip(DEFERRAL_REQUESTS, outputs, strict=True)}


def deferral_run(llm: Any, expected: dict[str, list[int]], tag: str) -> tuple[dict[str, dict[str, torch.Tensor]], int]:
    """:data:`DEFERRAL_REQUESTS` on ``llm`` (outputs checked against ``expected``, name -> tokens): the long
    request's draft KV and the number of drafting steps that gave no request any node."""
    from vllm_easyspec.instruments.worker_extension import read_tree_stats

    before = llm.collective_rpc(read_tree_stats)[0]["steps_without_speculation"]
    outputs, kv = generate_and_read_draft_kv(llm, DEFERRAL_REQUESTS, tag, "long")
    assert outputs == expected, tag
    return kv, llm.collective_rpc(read_tree_stats)[0]["steps_without_speculation"] - before


def assert_same_kv(actual: dict[str, dict[str, torch.Tensor]], expected: dict[str, dict[str, torch.Tensor]]) -> None:
    """Every layer's K and V equal (float32 tolerance)."""
    assert actual.keys() == expected.keys() and expected
    for name in expected:
        for part in ("key", "value"):
            torch.testing.assert_close(actual[name][part], expected[name][part], atol=1e-5, rtol=1e-5)
