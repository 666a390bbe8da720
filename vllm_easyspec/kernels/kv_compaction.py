"""Triton KV compaction: copy paged-cache rows from source slots to destination slots, in place.

Contract (shared with ``vllm_easyspec.tree.compaction``):

* ``cache`` ``[num_blocks, block_size, Hkv, D]`` (any strides); a *slot* is
  ``block_id * block_size + offset`` (vLLM's ``slot_mapping`` convention).
* ``src_slots`` / ``dst_slots`` ``[B, M]`` int64, ``-1`` = no move. Row ``b`` holds the moves of one
  request. Moves of different rows must touch disjoint slots (requests own their tree blocks).
* Within a row, a destination may be another move's source, so a program **loads every source of its row
  before it stores anything** (a CTA barrier between the phases). Programs of the same row (grid: request row,
  tile of ``BLOCK_E`` elements of the ``Hkv * D`` slot row) touch disjoint element ranges and never race.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _kv_compaction_kernel(cache_ptr, src_ptr, dst_ptr, num_moves, stride_move_row, stride_block, stride_slot,
                          stride_head, stride_dim, KV_BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr,
                          ROW_ELEMS: tl.constexpr, MOVES_PAD: tl.constexpr, BLOCK_E: tl.constexpr):
    row = tl.program_id(0)
    e_tile = tl.program_id(1)
    m = tl.arange(0, MOVES_PAD)
    m_ok = m < num_moves
    src = tl.load(src_ptr + row * stride_move_row + m, mask=m_ok, other=-1)
    dst = tl.load(dst_ptr + row * stride_move_row + m, mask=m_ok, other=-1)
    e = e_tile * BLOCK_E + tl.arange(0, BLOCK_E)
    e_off = (e // HEAD_DIM) * stride_head + (e % HEAD_DIM) * stride_dim
    ok = ((src >= 0) & (dst >= 0))[:, None] & (e < ROW_ELEMS)[None, :]
    src_c = tl.maximum(src, 0)
    dst_c = tl.maximum(dst, 0)
    src_base = (src_c // KV_BLOCK_SIZE) * stride_block + (src_c % KV_BLOCK_SIZE) * stride_slot
    dst_base = (dst_c // KV_BLOCK_SIZE) * stride_block + (dst_c % KV_BLOCK_SIZE) * stride_slot
    values = tl.load(cache_ptr + src_base[:, None] + e_off[None, :], mask=ok, other=0)
    tl.debug_barrier()  # every source of this row is read before any destination is written
    tl.store(cache_ptr + dst_base[:, None] + e_off[None, :], values, mask=ok)


def compact_kv_triton(caches: list[torch.Tensor] | tuple[torch.Tensor, ...], src_slots: torch.Tensor,
                      dst_slots: torch.Tensor) -> None:
    """Apply the moves ``src_slots -> dst_slots`` (``[B, M]``, -1 padded) to every cache, in place."""
    if src_slots.shape != dst_slots.shape or src_slots.ndim != 2:
        raise ValueError(f"src_slots and dst_slots must both be [B, M]; got {tuple(src_slots.shape)} and "
                         f"{tuple(dst_slots.shape)}.")
    rows, num_moves = src_slots.shape
    if rows == 0 or num_moves == 0:
        return
    src = src_slots.to(torch.int64).contiguous()
    dst = dst_slots.to(torch.int64).contiguous()
    moves_pad = triton.next_power_of_2(num_moves)
    for cache in caches:
        if cache.ndim != 4:
            raise ValueError(f"cache must be [num_blocks, block_size, Hkv, D]; got {tuple(cache.shape)}.")
        row_elems = cache.shape[2] * cache.shape[3]
        block_e = max(16, min(triton.next_power_of_2(row_elems), 8192 // moves_pad))
        grid = (rows, triton.cdiv(row_elems, block_e))
        _kv_compaction_kernel[grid](
            cache, src, dst, num_moves, src.stride(0),
            cache.stride(0), cache.stride(1), cache.stride(2), cache.stride(3),
            KV_BLOCK_SIZE=cache.shape[1], HEAD_DIM=cache.shape[3], ROW_ELEMS=row_elems,
            MOVES_PAD=moves_pad, BLOCK_E=block_e,
        )
