"""Read the draft model's paged KV cache back as plain ``[positions, kv_heads, head_size]`` tensors.

A debugging and testing aid for bonus calibration: after a step, the draft KV of every position below
the new bonus token must equal what an exact draft holds. The CPU attention backend stores K/V in an
ISA-specific packed layout, so this module never assumes one: it *probes* the layout by writing known
values through the backend's own ``do_kv_cache_update`` into a scratch block and reading where each
value landed, then inverts that permutation for the real blocks.

All functions here take a vLLM worker and are meant for ``LLM.collective_rpc``. Invariant: reading is
side-effect free on the engine's caches (only a scratch tensor is written).
"""

from __future__ import annotations

from typing import Any

import torch


def start_recording_block_tables(worker: Any) -> bool:
    """Make the EasySpec drafter remember each request's block ids from now on (clears old records)."""
    drafter = _drafter(worker)
    drafter.record_block_tables = True
    drafter.last_block_tables = {}
    return True


def _drafter(worker: Any):
    from vllm_easyspec.integration.draft_proposer import EasySpecDraftProposer

    drafter = getattr(worker.model_runner, "drafter", None)
    if not isinstance(drafter, EasySpecDraftProposer) or drafter.easyspec_config is None:
        raise RuntimeError("KV inspection needs the EasySpec drafter with additional_config['easyspec'] set")
    return drafter


def _layout_probe(attn_layer: Any, kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """For one block: flat indices into the packed block where key/value element ``j`` of the unpacked
    ``[block_size, kv_heads, head_size]`` block is stored."""
    _, num_kv_heads, block_size, fused = kv_cache.shape
    head_size = fused // 2
    count = block_size * num_kv_heads * head_size
    if kv_cache.dtype != torch.float32 or count >= 2**24:
        raise RuntimeError("KV inspection needs a float32 KV cache (probe values must be exact)")
    scratch = torch.zeros((1, num_kv_heads, block_size, fused), dtype=kv_cache.dtype)
    codes = torch.arange(1, count + 1, dtype=torch.float32).view(block_size, num_kv_heads, head_size)
    slots = torch.arange(block_size, dtype=torch.int64)
    attn_layer.impl.do_kv_cache_update(attn_layer, codes, -codes, scratch, slots)
    flat = scratch.flatten()
    key_where = torch.full((count,), -1, dtype=torch.int64)
    value_where = torch.full((count,), -1, dtype=torch.int64)
    positive = (flat > 0).nonzero().flatten()
    negative = (flat < 0).nonzero().flatten()
    key_where[flat[positive].long() - 1] = positive
    value_where[(-flat[negative]).long() - 1] = negative
    if (key_where < 0).any() or (value_where < 0).any():
        raise RuntimeError("the KV layout probe did not find every element; unknown cache layout")
    return key_where, value_where


def read_draft_kv(worker: Any, num_positions: int) -> dict[str, dict[str, torch.Tensor]]:
    """K and V of every draft attention layer at positions ``0..num_positions-1`` of the one request
    recorded since :func:`start_recording_block_tables` (exactly one must have been recorded)."""
    drafter = _drafter(worker)
    tables = drafter.last_block_tables
    if len(tables) != 1:
        raise RuntimeError(f"expected exactly one recorded request, found {sorted(tables)}")
    (block_ids,) = tables.values()
    context = worker.model_runner.vllm_config.compilation_config.static_forward_context
    result: dict[str, dict[str, torch.Tensor]] = {}
    for name in sorted(drafter._draft_attn_layer_names):
        layer = context[name]
        kv_cache = layer.kv_cache
        if isinstance(kv_cache, (list, tuple)):
            kv_cache = kv_cache[0]
        _, num_kv_heads, block_size, fused = kv_cache.shape
        head_size = fused // 2
        key_where, value_where = _layout_probe(layer, kv_cache)
        needed = -(-num_positions // block_size)
        keys, values = [], []
        for block in block_ids[:needed]:
            flat = kv_cache[block].flatten()
            keys.append(flat[key_where].view(block_size, num_kv_heads, head_size))
            values.append(flat[value_where].view(block_size, num_kv_heads, head_size))
        result[name] = {
            "key": torch.cat(keys)[:num_positions].clone(),
            "value": torch.cat(values)[:num_positions].clone(),
        }
    return result
