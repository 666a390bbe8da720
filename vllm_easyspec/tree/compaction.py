"""KV compaction after tree verification: query ``j`` of a request (``j = 0`` root, ``j = i + 1`` node ``i``) wrote
its K/V to ``prefix_len + j``; the node accepted at depth ``k`` moves from ``prefix_len + 1 + node`` to
``prefix_len + k``. Nodes are topologically ordered, so every move goes to a lower (or the same) slot, possibly
an earlier accepted node's old slot: both implementations read all sources of a request before writing.
:func:`tree_compaction_slots` computes the slot pairs once; :func:`compact_kv` applies them to a layer's cache.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = ["compact_kv", "compact_kv_torch", "paged_slots", "tree_compaction_slots"]


def paged_slots(block_table: torch.Tensor, positions: torch.Tensor, block_size: int) -> torch.Tensor:
    """Cache slots ``[B, N]`` int64 of ``positions`` ``[B, N]`` of each request of ``block_table`` ``[B, blocks]``;
    a position past the table's width reads its last block (callers mask such positions)."""
    table = block_table.long()
    blocks = table.gather(1, (positions // block_size).clamp(max=table.shape[1] - 1))
    return blocks * block_size + positions % block_size


def tree_compaction_slots(block_table: torch.Tensor, block_size: int, prefix_lens: torch.Tensor,
                          accepted_nodes: torch.Tensor, query_offset: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """Physical slot moves ``(src_slots, dst_slots)`` ``[B, M]`` int64 for the accepted paths ``accepted_nodes``
    ``[B, M]`` (node indices, root side first, -1 padded), -1 where there is nothing to move (padding, or a node
    already in place). ``prefix_lens`` ``[B]``: each request's root position; ``query_offset``: the query index of
    node 0 in the verify forward (1: the root comes first; 0 for a forward without a root query)."""
    nodes = accepted_nodes.long()
    prefix = prefix_lens.to(nodes.device).long()[:, None]
    depth = torch.arange(1, nodes.shape[1] + 1, device=nodes.device)[None, :]
    src_pos = prefix + query_offset + nodes
    dst_pos = prefix + query_offset - 1 + depth
    move = (nodes >= 0) & (src_pos != dst_pos)
    table = block_table.to(nodes.device)

    def to_slot(pos: torch.Tensor) -> torch.Tensor:
        safe = torch.where(move, pos, torch.zeros_like(pos))
        return torch.where(move, paged_slots(table, safe, block_size), torch.full_like(pos, -1))

    return to_slot(src_pos), to_slot(dst_pos)


def compact_kv_torch(caches: Sequence[torch.Tensor], src_slots: torch.Tensor, dst_slots: torch.Tensor) -> None:
    """In-place torch version: gather every source row (a copy), then scatter to the destinations."""
    valid = (src_slots >= 0) & (dst_slots >= 0)
    src = src_slots[valid].long()
    dst = dst_slots[valid].long()
    if src.numel() == 0:
        return
    for cache in caches:
        block_size = cache.shape[1]
        rows = cache[src // block_size, src % block_size]  # advanced indexing copies: sources read first
        cache[dst // block_size, dst % block_size] = rows


def compact_kv(caches: Sequence[torch.Tensor], src_slots: torch.Tensor, dst_slots: torch.Tensor,
               backend: str = "auto") -> None:
    """Move cache rows ``src_slots -> dst_slots`` (``[B, M]``, -1 padded) in every cache, in place.

    ``backend``: ``"triton"``, ``"torch"`` or ``"auto"`` (Triton for GPU caches, torch on CPU). Caches
    are ``[num_blocks, block_size, Hkv, D]`` (vLLM's FlashAttention layout; pass ``kv_cache[0]`` and
    ``kv_cache[1]`` of a ``[2, ...]`` layer cache). Not for vLLM-CPU's prepacked caches, whose rows
    are ISA-specific: there, re-issue the official reshape-and-cache op with the linear slots.
    """
    if backend == "auto":
        backend = "triton" if caches and caches[0].device.type != "cpu" else "torch"
    if backend == "torch":
        compact_kv_torch(caches, src_slots, dst_slots)
    elif backend == "triton":
        from vllm_easyspec.kernels.kv_compaction import compact_kv_triton

        compact_kv_triton(list(caches), src_slots, dst_slots)
    else:
        raise ValueError(f"backend must be 'auto', 'triton' or 'torch'; got {backend!r}.")
