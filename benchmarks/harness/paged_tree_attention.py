"""Tree attention over vLLM's paged KV cache in torch, for ``python -m benchmarks kernels`` (the engine runs neither:
its CPU tree path is ``vllm_easyspec.tree.attention.attention_over_prefix_and_tree``, its GPU one the Triton kernel).

Both take the arguments of ``vllm_easyspec.kernels.tree_attention.tree_attention_triton`` under its contract: request
``b``'s query ``j`` has its K/V at logical position ``prefix_lens[b] + j``, and row ``t`` attends to its request's
whole prefix and to the tree columns ``tree_mask[t]`` allows (its ancestors and itself).
"""

from __future__ import annotations

import torch

_flash_for_cpu = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)


def _leading_rows(cache: torch.Tensor, block_table_row: torch.Tensor, length: int) -> torch.Tensor:
    """The first ``length`` logical positions ``[length, Hkv, D]`` of one request, gathered block-wise."""
    block_size = cache.shape[1]
    num_blocks = -(-length // block_size)
    blocks = cache.index_select(0, block_table_row[:num_blocks].long())
    return blocks.reshape(num_blocks * block_size, *cache.shape[2:])[:length]


def tree_attention_naive(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                         block_table: torch.Tensor, prefix_lens: torch.Tensor, cu_query_lens: torch.Tensor,
                         tree_mask: torch.Tensor, softmax_scale: float) -> torch.Tensor:
    """The baseline: per node, gather prefix + branch K/V and call SDPA."""
    group = query.shape[1] // key_cache.shape[2]
    out = torch.empty_like(query)
    cu = cu_query_lens.tolist()
    for b in range(len(cu) - 1):
        prefix, n = int(prefix_lens[b]), cu[b + 1] - cu[b]
        keys = _leading_rows(key_cache, block_table[b], prefix + n)
        values = _leading_rows(value_cache, block_table[b], prefix + n)
        for t in range(cu[b], cu[b + 1]):
            positions = torch.cat([torch.arange(prefix), prefix + tree_mask[t, :n].nonzero()[:, 0]])
            k, v = keys[positions].transpose(0, 1), values[positions].transpose(0, 1)  # [Hkv, L, D]
            q = query[t].reshape(k.shape[0], group, -1)  # [Hkv, G, D]
            out[t] = torch.nn.functional.scaled_dot_product_attention(
                q[None], k[None], v[None], scale=softmax_scale)[0].reshape(query.shape[1:])
    return out


def _attention_with_lse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                        mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``q`` ``[H, M, D]``, ``k``/``v`` ``[H, L, D]`` -> (fp32 output ``[H, M, D]``, fp32 log-sum-exp ``[H, M]``).
    ``mask`` ``[M, L]`` bool (True = attend), shared by all heads."""
    if mask is None and _flash_for_cpu is not None and q.device.type == "cpu":
        out, lse = _flash_for_cpu(q[None], k[None], v[None], scale=scale)
        return out[0].float(), lse[0].float()
    scores = torch.matmul(q.float(), k.float().transpose(1, 2)) * scale
    if mask is not None:
        scores = scores.masked_fill(~mask[None], float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    return torch.matmul(torch.exp(scores - lse[..., None]), v.float()), lse


def tree_attention_cpu(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                       block_table: torch.Tensor, prefix_lens: torch.Tensor, cu_query_lens: torch.Tensor,
                       tree_mask: torch.Tensor, softmax_scale: float) -> torch.Tensor:
    """Tree attention without a per-node copy of the prefix. Per request, the ``n`` tree queries (times the ``G``
    query heads of each KV head) attend (1) to the prefix in one flash-attention call that also returns the
    log-sum-exp, (2) to the ``n`` tree K/V under the ancestor mask; (3) the two partial softmaxes are merged
    exactly: ``out = (e^{l1} o1 + e^{l2} o2) / (e^{l1} + e^{l2})``."""
    num_kv_heads, head_dim = key_cache.shape[2], key_cache.shape[3]
    group = query.shape[1] // num_kv_heads
    out = torch.empty_like(query)
    cu = cu_query_lens.tolist()
    for b in range(len(cu) - 1):
        start, end = cu[b], cu[b + 1]
        n, prefix = end - start, int(prefix_lens[b])
        if n == 0:
            continue
        # [n, Hq, D] -> [Hkv, G * n, D]: the group's heads become extra query rows of their KV head
        q = query[start:end].reshape(n, num_kv_heads, group, head_dim).permute(1, 2, 0, 3)
        q = q.reshape(num_kv_heads, group * n, head_dim)
        keys = _leading_rows(key_cache, block_table[b], prefix + n).transpose(0, 1)
        values = _leading_rows(value_cache, block_table[b], prefix + n).transpose(0, 1)
        mask = tree_mask[start:end, :n].repeat(group, 1)  # rows ordered (g, node)
        merged, lse_tree = _attention_with_lse(q, keys[:, prefix:], values[:, prefix:], softmax_scale, mask)
        if prefix > 0:
            o_pre, lse_pre = _attention_with_lse(q, keys[:, :prefix], values[:, :prefix], softmax_scale)
            top = torch.maximum(lse_pre, lse_tree)
            w_pre, w_tree = torch.exp(lse_pre - top)[..., None], torch.exp(lse_tree - top)[..., None]
            merged = (w_pre * o_pre + w_tree * merged) / (w_pre + w_tree)
        merged = merged.reshape(num_kv_heads, group, n, head_dim).permute(2, 0, 1, 3)
        out[start:end] = merged.reshape(n, num_kv_heads * group, head_dim).to(out.dtype)
    return out
