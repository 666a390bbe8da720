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


def read_draft_kv(worker: Any, num_positions: int) -> dict[str, dict[str, torch.Tensor]]:
    """K and V of every draft attention layer at positions ``0..num_positions-1`` of the one request
    recorded since :func:`start_recording_block_tables` (exactly one must have been recorded)."""
    drafter = _drafter(worker)
    return _read_layers(worker, sorted(drafter._draft_attn_layer_names), num_positions)


def read_target_kv(worker: Any, num_positions: int) -> dict[str, dict[str, torch.Tensor]]:
    """The same for the target's attention layers (the draft shares the target's block table)."""
    from vllm.model_executor.layers.attention import Attention

    drafter = _drafter(worker)
    context = worker.model_runner.vllm_config.compilation_config.static_forward_context
    names = [name for name, layer in context.items()
             if isinstance(layer, Attention) and name not in drafter._draft_attn_layer_names]
    return _read_layers(worker, sorted(names), num_positions)


def _read_layers(worker: Any, names: list[str], num_positions: int) -> dict[str, dict[str, torch.Tensor]]:
    from vllm_easyspec.integration.cpu.kv_layout import PagedKVReader, probe_cpu_kv_layout

    tables = getattr(_drafter(worker), _RECORDED)
    if len(tables) != 1:
        raise RuntimeError(f"expected exactly one recorded request, found {sorted(tables)}")
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
