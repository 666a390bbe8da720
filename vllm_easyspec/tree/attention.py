"""Tree attention over vLLM's paged KV cache: torch reference, CPU path, and dispatcher.

All implementations share one contract (documented in full in ``vllm_easyspec/kernels/tree_attention.py``):

* ``query`` ``[T, Hq, D]``, request ``b`` owns rows ``cu_query_lens[b]:cu_query_lens[b + 1]``;
* ``key_cache`` / ``value_cache`` ``[num_blocks, block_size, Hkv, D]`` (vLLM's FlashAttention layout),
  ``block_table`` ``[B, max_blocks]``;
* the K/V of request-local query ``j`` is **already written** at logical position
  ``prefix_lens[b] + j`` (vLLM's linear slot accounting puts it there); positions
  ``< prefix_lens[b]`` are the prefix;
* ``tree_mask`` ``[T, W]`` bool: ``tree_mask[t, j]`` iff query ``j`` is an ancestor of row ``t`` or
  row ``t`` itself (diagonal included). :func:`ancestor_mask_from_parents` and
  :meth:`TokenTreeBatch.verify_layout` build it.

Every row attends to its request's whole prefix and to its tree ancestors and itself.
"""

from __future__ import annotations

import math

import torch

__all__ = [
    "ancestor_mask_from_parents",
    "attention_over_prefix_and_tree",
    "prefix_and_tree_bias",
    "gather_positions",
    "tree_attention",
    "tree_attention_cpu",
    "tree_attention_naive",
    "tree_attention_reference",
]


def ancestor_mask_from_parents(parents: torch.Tensor, cu_query_lens: torch.Tensor, width: int | None = None
                               ) -> torch.Tensor:
    """``[T, W]`` ancestor-or-self mask from request-local parent indices ``[T]`` (-1 = no parent;
    parents precede children within a request)."""
    cu = cu_query_lens.tolist()
    lens = [cu[i + 1] - cu[i] for i in range(len(cu) - 1)]
    width = max(lens, default=0) if width is None else width
    mask = torch.zeros(parents.shape[0], width, dtype=torch.bool, device=parents.device)
    for b, n in enumerate(lens):
        par = parents[cu[b]: cu[b] + n].tolist()
        rows = mask[cu[b]: cu[b] + n]
        for j, p in enumerate(par):
            if not -1 <= p < j:
                raise ValueError(f"parents[{cu[b] + j}] = {p}: the parent must come before its child.")
            if p >= 0:
                rows[j] = rows[p]
            rows[j, j] = True
    return mask


def gather_positions(cache: torch.Tensor, block_table_row: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Rows ``[len(positions), Hkv, D]`` of one request's paged cache at logical ``positions``."""
    block_size = cache.shape[1]
    blocks = block_table_row.long()[positions // block_size]
    return cache[blocks, positions % block_size]


def _prefix_rows(cache: torch.Tensor, block_table_row: torch.Tensor, length: int) -> torch.Tensor:
    """The first ``length`` logical positions of a request, gathered block-wise (one copy)."""
    block_size = cache.shape[1]
    num_blocks = -(-length // block_size)
    blocks = cache.index_select(0, block_table_row[:num_blocks].long())
    return blocks.reshape(num_blocks * block_size, *cache.shape[2:])[:length]


def _check_shapes(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor) -> int:
    if query.ndim != 3 or key_cache.ndim != 4 or value_cache.shape != key_cache.shape:
        raise ValueError(
            f"expected query [T, Hq, D] and caches [num_blocks, block_size, Hkv, D]; got "
            f"{tuple(query.shape)}, {tuple(key_cache.shape)}, {tuple(value_cache.shape)}."
        )
    if query.shape[2] != key_cache.shape[3]:
        raise ValueError(f"head size mismatch: query {query.shape[2]} vs cache {key_cache.shape[3]}.")
    if query.shape[1] % key_cache.shape[2]:
        raise ValueError(f"query heads ({query.shape[1]}) must be a multiple of KV heads ({key_cache.shape[2]}).")
    return query.shape[1] // key_cache.shape[2]


def tree_attention_reference(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_table: torch.Tensor,
    prefix_lens: torch.Tensor,
    cu_query_lens: torch.Tensor,
    tree_mask: torch.Tensor,
    softmax_scale: float,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """Plain per-node reference in float64: node ``t`` is the last token of the sequence
    ``prefix + (root-to-t branch)`` and attends causally, i.e. to all of it. Slow; tests only.
    ``out_dtype`` (default: the query dtype) lets tests keep the unrounded result."""
    group = _check_shapes(query, key_cache, value_cache)
    out = torch.empty(query.shape, dtype=out_dtype or query.dtype, device=query.device)
    cu = cu_query_lens.tolist()
    for b in range(len(cu) - 1):
        prefix = int(prefix_lens[b])
        for t in range(cu[b], cu[b + 1]):
            branch = tree_mask[t, : cu[b + 1] - cu[b]].nonzero()[:, 0]  # ascending = root to node
            positions = torch.cat([torch.arange(prefix, device=query.device), prefix + branch])
            k = gather_positions(key_cache, block_table[b], positions).double()  # [L, Hkv, D]
            v = gather_positions(value_cache, block_table[b], positions).double()
            k = k.repeat_interleave(group, dim=1)
            v = v.repeat_interleave(group, dim=1)
            scores = torch.einsum("hd,lhd->hl", query[t].double(), k) * softmax_scale
            out[t] = torch.einsum("hl,lhd->hd", scores.softmax(-1), v).to(out.dtype)
    return out


def tree_attention_naive(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_table: torch.Tensor,
    prefix_lens: torch.Tensor,
    cu_query_lens: torch.Tensor,
    tree_mask: torch.Tensor,
    softmax_scale: float,
) -> torch.Tensor:
    """Baseline for the benchmark: per node, gather prefix + branch K/V and call SDPA."""
    group = _check_shapes(query, key_cache, value_cache)
    out = torch.empty_like(query)
    cu = cu_query_lens.tolist()
    for b in range(len(cu) - 1):
        prefix = int(prefix_lens[b])
        for t in range(cu[b], cu[b + 1]):
            branch = tree_mask[t, : cu[b + 1] - cu[b]].nonzero()[:, 0]
            positions = torch.cat([torch.arange(prefix, device=query.device), prefix + branch])
            k = gather_positions(key_cache, block_table[b], positions).transpose(0, 1)  # [Hkv, L, D]
            v = gather_positions(value_cache, block_table[b], positions).transpose(0, 1)
            q = query[t].reshape(k.shape[0], group, -1)  # [Hkv, G, D]
            out[t] = torch.nn.functional.scaled_dot_product_attention(
                q[None], k[None], v[None], scale=softmax_scale)[0].reshape(query.shape[1:])
    return out


_flash_for_cpu = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)


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
    weights = torch.exp(scores - lse[..., None])
    return torch.matmul(weights, v.float()), lse


def tree_attention_cpu(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_table: torch.Tensor,
    prefix_lens: torch.Tensor,
    cu_query_lens: torch.Tensor,
    tree_mask: torch.Tensor,
    softmax_scale: float,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """CPU tree attention without a per-node copy of the prefix.

    Per request: (1) all ``n`` tree queries (times the ``G`` query heads of each KV head) attend to the
    prefix in **one** flash-attention call that also returns the log-sum-exp; the prefix K/V is read
    once; (2) the same queries attend to the ``n`` tree K/V under the ancestor mask; (3) the two
    partial softmaxes are merged exactly with their log-sum-exps:
    ``out = (e^{l1} o1 + e^{l2} o2) / (e^{l1} + e^{l2})``.
    """
    group = _check_shapes(query, key_cache, value_cache)
    num_kv_heads, head_dim = key_cache.shape[2], key_cache.shape[3]
    out = torch.empty_like(query) if out is None else out
    cu = cu_query_lens.tolist()
    for b in range(len(cu) - 1):
        start, end = cu[b], cu[b + 1]
        n = end - start
        if n == 0:
            continue
        prefix = int(prefix_lens[b])
        # [n, Hq, D] -> [Hkv, G * n, D]: the group's heads become extra query rows of their KV head
        q = query[start:end].reshape(n, num_kv_heads, group, head_dim).permute(1, 2, 0, 3)
        q = q.reshape(num_kv_heads, group * n, head_dim)
        tree_pos = torch.arange(prefix, prefix + n, device=query.device)
        k_tree = gather_positions(key_cache, block_table[b], tree_pos).transpose(0, 1)
        v_tree = gather_positions(value_cache, block_table[b], tree_pos).transpose(0, 1)
        mask = tree_mask[start:end, :n].repeat(group, 1)  # rows ordered (g, node)
        o_tree, lse_tree = _attention_with_lse(q, k_tree, v_tree, softmax_scale, mask)
        if prefix > 0:
            k_pre = _prefix_rows(key_cache, block_table[b], prefix).transpose(0, 1)
            v_pre = _prefix_rows(value_cache, block_table[b], prefix).transpose(0, 1)
            o_pre, lse_pre = _attention_with_lse(q, k_pre, v_pre,
                                                 softmax_scale)
            top = torch.maximum(lse_pre, lse_tree)
            w_pre = torch.exp(lse_pre - top)[..., None]
            w_tree = torch.exp(lse_tree - top)[..., None]
            merged = (w_pre * o_pre + w_tree * o_tree) / (w_pre + w_tree)
        else:
            merged = o_tree
        merged = merged.reshape(num_kv_heads, group, n, head_dim).permute(2, 0, 1, 3)
        out[start:end] = merged.reshape(n, num_kv_heads * group, head_dim).to(out.dtype)
    return out


def prefix_and_tree_bias(prefix_lens: torch.Tensor, length: int, tree_mask: torch.Tensor, group: int,
                         dtype: torch.dtype) -> torch.Tensor:
    """Additive mask ``[R, 1, G * W, L + S]`` of :func:`attention_over_prefix_and_tree` for queries folded
    ``G`` query heads per KV head: 0 where a row attends (its valid prefix, its ancestors and itself),
    ``-inf`` elsewhere. It depends only on the step, so a forward builds it once for all its layers."""
    batch, width = tree_mask.shape[:2]
    prefix_valid = torch.arange(length, device=tree_mask.device)[None, :] < prefix_lens.to(tree_mask.device)[:, None]
    allowed = torch.cat([prefix_valid[:, None, :].expand(batch, width, length), tree_mask.bool()], dim=2)
    bias = torch.zeros(allowed.shape, dtype=dtype, device=tree_mask.device).masked_fill_(~allowed, float("-inf"))
    return bias.repeat(1, group, 1)[:, None]  # rows ordered (g, w), as the folded queries


def attention_over_prefix_and_tree(
    query: torch.Tensor,
    prefix_key: torch.Tensor,
    prefix_value: torch.Tensor,
    prefix_lens: torch.Tensor,
    tree_key: torch.Tensor,
    tree_value: torch.Tensor,
    tree_mask: torch.Tensor,
    softmax_scale: float,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """Tree attention of ``R`` requests whose tree K/V is at hand (not in a paged cache).

    * ``query`` ``[R, W, Hq, D]``: ``W`` query rows per request (padding rows allowed);
    * ``prefix_key`` / ``prefix_value`` ``[R, Hkv, L, D]``: request ``r``'s context, valid for positions
      ``< prefix_lens[r]`` (the rest is ignored);
    * ``tree_key`` / ``tree_value`` ``[R, Hkv, S, D]`` and ``tree_mask`` ``[R, W, S]`` bool: row ``w`` also
      attends to tree column ``s`` iff ``tree_mask[r, w, s]`` (its ancestors and itself);
    * ``bias``: :func:`prefix_and_tree_bias` of these arguments, if the caller keeps it across layers.

    Returns ``[R, W, Hq, D]`` in the query dtype. Every row must attend to at least one column. This is the
    engine's CPU tree path (target verify and the drafter's levels): one SDPA call per layer, the ``G``
    query heads of each KV head folded into its query rows (no K/V repeat for grouped-query attention).
    """
    batch, width, heads, dim = query.shape
    kv_heads = prefix_key.shape[1]
    group = heads // kv_heads
    if bias is None:
        bias = prefix_and_tree_bias(prefix_lens, prefix_key.shape[2], tree_mask, group, query.dtype)
    folded = query.reshape(batch, width, kv_heads, group, dim).permute(0, 2, 3, 1, 4)
    key = torch.cat([prefix_key, tree_key.to(prefix_key.dtype)], dim=2)
    value = torch.cat([prefix_value, tree_value.to(prefix_value.dtype)], dim=2)
    out = torch.nn.functional.scaled_dot_product_attention(
        folded.reshape(batch, kv_heads, group * width, dim), key, value, attn_mask=bias, scale=softmax_scale,
    )
    return out.view(batch, kv_heads, group, width, dim).permute(0, 3, 1, 2, 4).reshape(batch, width, heads, dim)


def _triton_usable(query: torch.Tensor) -> bool:
    if query.device.type != "cpu":
        return True
    try:  # CPU tensors only work with Triton's interpreter (TRITON_INTERPRET=1 at kernel import time)
        from vllm_easyspec.kernels.tree_attention import _is_interpreted, _tree_attention_kernel
    except ImportError:
        return False
    return _is_interpreted(_tree_attention_kernel)


def tree_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_table: torch.Tensor,
    prefix_lens: torch.Tensor,
    cu_query_lens: torch.Tensor,
    tree_mask: torch.Tensor,
    softmax_scale: float | None = None,
    *,
    out: torch.Tensor | None = None,
    max_query_len: int | None = None,
    backend: str = "auto",
) -> torch.Tensor:
    """Tree attention with one interface for every backend.

    ``backend``: ``"triton"`` (GPU, or CPU tensors under ``TRITON_INTERPRET=1``), ``"cpu"`` (torch,
    prefix once + tree part + log-sum-exp merge), ``"reference"`` (float64 per node, slow), or
    ``"auto"``: Triton for GPU tensors, the CPU path for CPU tensors.
    ``softmax_scale`` defaults to ``1 / sqrt(head_size)``.
    """
    scale = 1.0 / math.sqrt(query.shape[-1]) if softmax_scale is None else softmax_scale
    if backend == "auto":
        backend = "triton" if query.device.type != "cpu" else "cpu"
    if backend == "triton":
        if not _triton_usable(query):
            raise RuntimeError("the Triton tree-attention kernel needs a GPU (or TRITON_INTERPRET=1 set before "
                               "vllm_easyspec.kernels is imported); use backend='cpu'.")
        from vllm_easyspec.kernels.tree_attention import tree_attention_triton

        return tree_attention_triton(query, key_cache, value_cache, block_table, prefix_lens, cu_query_lens,
                                     tree_mask, scale, out=out, max_query_len=max_query_len)
    if backend == "cpu":
        return tree_attention_cpu(query, key_cache, value_cache, block_table, prefix_lens, cu_query_lens,
                                  tree_mask, scale, out=out)
    if backend == "reference":
        result = tree_attention_reference(query, key_cache, value_cache, block_table, prefix_lens,
                                          cu_query_lens, tree_mask, scale)
        if out is not None:
            out.copy_(result)
            return out
        return result
    raise ValueError(f"backend must be 'auto', 'triton', 'cpu' or 'reference'; got {backend!r}.")
