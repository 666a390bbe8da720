"""The engine's CPU tree attention (:func:`attention_over_prefix_and_tree`): each row attends to its request's
valid prefix and to the tree columns its mask allows (its ancestors and itself)."""

from __future__ import annotations

import torch

__all__ = ["attention_over_prefix_and_tree", "prefix_and_tree_bias"]


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


def attention_over_prefix_and_tree(query: torch.Tensor, prefix_key: torch.Tensor, prefix_value: torch.Tensor,
                                   prefix_lens: torch.Tensor, tree_key: torch.Tensor, tree_value: torch.Tensor,
                                   tree_mask: torch.Tensor, softmax_scale: float, bias: torch.Tensor | None = None
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
