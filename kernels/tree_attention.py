"""Triton tree attention over vLLM's paged KV cache (FlashAttention layout).

Contract (shared with ``vllm_easyspec.tree.attention``):

* ``query`` ``[T, Hq, D]``: the tree query tokens of the batch; request ``b`` owns rows
  ``cu_query_lens[b]:cu_query_lens[b + 1]`` (request-local query index ``j = 0, 1, ...``).
* ``key_cache`` / ``value_cache`` ``[num_blocks, block_size, Hkv, D]``; ``block_table`` ``[B, max_blocks]``
  int32 maps logical block ``i`` of request ``b`` to a physical block.
* The K/V of *every* query token is already in the cache: query ``j`` of request ``b`` sits at logical
  position ``prefix_lens[b] + j`` (vLLM's linear slot accounting writes it there before attention).
  Positions ``< prefix_lens[b]`` are the request's prefix.
* ``tree_mask`` ``[T, W]`` (bool / uint8): ``tree_mask[t, j]`` is true iff request-local query ``j``
  is an ancestor of row ``t`` or ``t`` itself. It must include the diagonal.
* Row ``t`` attends to the whole prefix plus the tree positions its mask allows. Softmax in fp32,
  output in the query dtype. GQA: ``Hq`` must be a multiple of ``Hkv``.

The kernel runs one program per (request, tile of ``BLOCK_Q`` query tokens, KV head); the ``GROUP``
query heads that share the KV head are stacked with the tile's tokens into ``BLOCK_Q * BLOCK_H`` rows
so one K/V tile load serves all of them. It walks the positions ``[0, prefix + last query of the tile]``
in tiles of ``BLOCK_N`` (block-table lookup per position, so any vLLM block size works) with online
softmax; ancestors always precede their descendants, so later tree positions are never needed.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _tree_attention_kernel(
    out_ptr,
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    block_table_ptr,
    prefix_lens_ptr,
    cu_q_ptr,
    mask_ptr,
    scale,
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_kb,
    stride_ks,
    stride_kh,
    stride_vb,
    stride_vs,
    stride_vh,
    stride_bt,
    stride_mt,
    KV_BLOCK_SIZE: tl.constexpr,
    GROUP: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    UPCAST: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    req = tl.program_id(0)
    q_tile = tl.program_id(1)
    kv_head = tl.program_id(2)
    q_start = tl.load(cu_q_ptr + req)
    n_q = tl.load(cu_q_ptr + req + 1) - q_start
    if q_tile * BLOCK_Q < n_q:
        prefix = tl.load(prefix_lens_ptr + req)
        rows = tl.arange(0, BLOCK_Q * BLOCK_H)
        local_q = q_tile * BLOCK_Q + rows // BLOCK_H
        head_in_group = rows % BLOCK_H
        row_ok = (local_q < n_q) & (head_in_group < GROUP)
        q_head = kv_head * GROUP + head_in_group
        token = (q_start + local_q).to(tl.int64)
        d = tl.arange(0, BLOCK_D)
        d_ok = d < HEAD_DIM
        q = tl.load(q_ptr + token[:, None] * stride_qt + q_head[:, None] * stride_qh + d[None, :],
                    mask=row_ok[:, None] & d_ok[None, :], other=0.0)
        if UPCAST:
            q = q.to(tl.float32)

        m_i = tl.full([BLOCK_Q * BLOCK_H], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_Q * BLOCK_H], tl.float32)
        acc = tl.zeros([BLOCK_Q * BLOCK_H, BLOCK_D], tl.float32)
        kv_end = prefix + tl.minimum(n_q, (q_tile + 1) * BLOCK_Q)
        for start in range(0, kv_end, BLOCK_N):
            pos = start + tl.arange(0, BLOCK_N)
            pos_ok = pos < kv_end
            block = tl.load(block_table_ptr + req * stride_bt + pos // KV_BLOCK_SIZE, mask=pos_ok, other=0)
            block = block.to(tl.int64)
            slot = pos % KV_BLOCK_SIZE
            k = tl.load(k_cache_ptr + block[None, :] * stride_kb + slot[None, :] * stride_ks
                        + kv_head * stride_kh + d[:, None],
                        mask=pos_ok[None, :] & d_ok[:, None], other=0.0)
            if UPCAST:
                k = k.to(tl.float32)
            scores = tl.dot(q, k, input_precision=DOT_PRECISION) * scale
            tree_j = pos - prefix
            in_tree = (tree_j >= 0) & pos_ok
            tree_allowed = tl.load(mask_ptr + token[:, None] * stride_mt + tree_j[None, :],
                                   mask=row_ok[:, None] & in_tree[None, :], other=0)
            allowed = ((pos < prefix) & pos_ok)[None, :] | (tree_allowed != 0)
            scores = tl.where(allowed, scores, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(scores, 1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = tl.exp(m_i - m_safe)
            p = tl.exp(scores - m_safe[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            v = tl.load(v_cache_ptr + block[:, None] * stride_vb + slot[:, None] * stride_vs
                        + kv_head * stride_vh + d[None, :],
                        mask=pos_ok[:, None] & d_ok[None, :], other=0.0)
            if UPCAST:
                acc = acc * alpha[:, None] + tl.dot(p, v.to(tl.float32), input_precision=DOT_PRECISION)
            else:
                acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
            m_i = m_new
        acc = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
        tl.store(out_ptr + token[:, None] * stride_ot + q_head[:, None] * stride_oh + d[None, :],
                 acc.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])


def _is_interpreted(kernel) -> bool:
    return type(kernel).__name__ == "InterpretedFunction"


def tree_attention_triton(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_table: torch.Tensor,
    prefix_lens: torch.Tensor,
    cu_query_lens: torch.Tensor,
    tree_mask: torch.Tensor,
    softmax_scale: float,
    out: torch.Tensor | None = None,
    max_query_len: int | None = None,
) -> torch.Tensor:
    """Launch the tree-attention kernel (see the module docstring for the contract).

    ``max_query_len`` (the largest number of query rows of one request) sizes the grid; pass it to
    avoid a device-to-host sync.
    """
    num_tokens, num_q_heads, head_dim = query.shape
    num_kv_heads = key_cache.shape[2]
    if num_q_heads % num_kv_heads:
        raise ValueError(f"query heads ({num_q_heads}) must be a multiple of KV heads ({num_kv_heads}).")
    if query.stride(-1) != 1 or key_cache.stride(-1) != 1 or value_cache.stride(-1) != 1:
        raise ValueError("query, key_cache and value_cache need a contiguous last (head_size) dimension.")
    if tree_mask.shape[0] != num_tokens:
        raise ValueError(f"tree_mask must have one row per query token ({num_tokens}); got {tree_mask.shape[0]}.")
    batch = block_table.shape[0]
    if max_query_len is None:
        max_query_len = int((cu_query_lens[1:] - cu_query_lens[:-1]).max()) if batch else 0
    if out is None:
        out = torch.empty_like(query)
    if num_tokens == 0 or batch == 0:
        return out
    mask = tree_mask.view(torch.uint8) if tree_mask.dtype == torch.bool else tree_mask
    if mask.stride(-1) != 1:
        mask = mask.contiguous()
    group = num_q_heads // num_kv_heads
    block_h = triton.next_power_of_2(group)
    block_q = max(1, 16 // block_h)
    block_d = max(16, triton.next_power_of_2(head_dim))
    interpreted = _is_interpreted(_tree_attention_kernel)
    upcast = query.dtype == torch.float32 or interpreted
    # Triton's interpreter converts fp32 -> bf16 by truncation (GPUs round to nearest), which would
    # double the output error; under the interpreter, write fp32 and round with torch instead.
    kernel_out = torch.empty(out.shape, dtype=torch.float32) if interpreted and out.dtype == torch.bfloat16 else out
    grid = (batch, triton.cdiv(max_query_len, block_q), num_kv_heads)
    _tree_attention_kernel[grid](
        kernel_out, query, key_cache, value_cache, block_table, prefix_lens, cu_query_lens, mask,
        float(softmax_scale),
        query.stride(0), query.stride(1), kernel_out.stride(0), kernel_out.stride(1),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        value_cache.stride(0), value_cache.stride(1), value_cache.stride(2),
        block_table.stride(0), mask.stride(0),
        KV_BLOCK_SIZE=key_cache.shape[1], GROUP=group, BLOCK_H=block_h, BLOCK_Q=block_q, BLOCK_N=32,
        HEAD_DIM=head_dim, BLOCK_D=block_d, UPCAST=upcast,
        # fp32 inputs (and the upcast interpreter path) use exact fp32 products, not TF32
        DOT_PRECISION="ieee" if upcast else "tf32",
    )
    if kernel_out is not out:
        out.copy_(kernel_out)
    return out
