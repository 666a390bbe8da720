"""The float64 per-node tree-attention reference the kernel tests check against (arguments and contract of
``vllm_easyspec.kernels.tree_attention.tree_attention_triton``)."""

from __future__ import annotations

import torch

from vllm_easyspec.tree.attention import PLAIN, AttentionFeatures


def gather_positions(cache: torch.Tensor, block_table_row: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Rows ``[len(positions), Hkv, D]`` of one request's paged cache at logical ``positions``."""
    block_size = cache.shape[1]
    blocks = block_table_row.long()[positions // block_size]
    return cache[blocks, positions % block_size]


def depth_offsets(tree_mask: torch.Tensor, cu_query_lens: torch.Tensor) -> torch.Tensor:
    """``[B, W]`` int32 column offsets of verify trees (each column's depth: its ancestors-or-self minus one)."""
    cu = cu_query_lens.tolist()
    offsets = torch.zeros(len(cu) - 1, tree_mask.shape[1], dtype=torch.int32)
    for b in range(len(cu) - 1):
        size = cu[b + 1] - cu[b]
        offsets[b, :size] = tree_mask[cu[b]: cu[b + 1], :size].sum(1) - 1
    return offsets


def featured_row(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, key_pos: torch.Tensor,
                  query_pos: torch.Tensor, scale: float, features: AttentionFeatures) -> torch.Tensor:
    """One row ``[H, D]`` in float64 over the keys it may see, as vLLM computes a causal row under ``features``:
    the scaled score soft-capped, then masked to the row's window and chunk, ALiBi added, each head's sink one more
    logit. Keys it does not see are never read (they may hold NaN)."""
    seen = features.visible(query_pos, key_pos)
    keys, values, key_pos = keys[seen].double(), values[seen].double(), key_pos[seen]
    scores = torch.einsum("hd,lhd->hl", query.double(), keys) * scale
    if features.soft_cap:
        scores = features.soft_cap * torch.tanh(scores / features.soft_cap)
    if features.alibi_slopes is not None:
        scores = scores + features.alibi_slopes.double().cpu()[:, None] * (key_pos - query_pos).double()[None]
    if features.sinks is not None:
        scores = torch.cat([scores, features.sinks.double().cpu()[:, None]], 1)
    return torch.einsum("hl,lhd->hd", scores.softmax(-1)[:, : keys.shape[0]], values)


def tree_attention_reference(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                             block_table: torch.Tensor, prefix_lens: torch.Tensor, cu_query_lens: torch.Tensor,
                             tree_mask: torch.Tensor, softmax_scale: float, out_dtype: torch.dtype | None = None,
                             features: AttentionFeatures = PLAIN, column_offsets: torch.Tensor | None = None
                             ) -> torch.Tensor:
    """Node ``t`` is the last token of the sequence ``prefix + (root-to-t branch)`` and attends causally, i.e. to
    all of it, in float64. ``out_dtype`` (default: the query dtype) lets tests keep the unrounded result.
    ``features`` apply at logical positions: prefix key ``p`` at ``p``, tree column ``c`` of request ``b`` at
    ``prefix_lens[b] + column_offsets[b, c]`` (default: ``c``, each column at its cache position)."""
    group = query.shape[1] // key_cache.shape[2]
    out = torch.empty(query.shape, dtype=out_dtype or query.dtype, device=query.device)
    cu = cu_query_lens.tolist()
    for b in range(len(cu) - 1):
        prefix = int(prefix_lens[b])
        offsets = torch.arange(tree_mask.shape[1]) if column_offsets is None else column_offsets[b].long().cpu()
        for t in range(cu[b], cu[b + 1]):
            branch = tree_mask[t, : cu[b + 1] - cu[b]].nonzero()[:, 0].cpu()  # ascending = root to node
            positions = torch.cat([torch.arange(prefix), prefix + branch])
            key_pos = torch.cat([torch.arange(prefix), prefix + offsets[branch]])
            k = gather_positions(key_cache.cpu(), block_table[b].cpu(), positions).repeat_interleave(group, dim=1)
            v = gather_positions(value_cache.cpu(), block_table[b].cpu(), positions).repeat_interleave(group, dim=1)
            row = featured_row(query[t].cpu(), k, v, key_pos, prefix + offsets[t - cu[b]], softmax_scale, features)
            out[t] = row.to(out.dtype)
    return out


def reference_error(args: dict[str, torch.Tensor], result: torch.Tensor, scale: float,
                    features: AttentionFeatures = PLAIN, column_offsets: torch.Tensor | None = None) -> float:
    """``max |result - ref| / max(1, |ref|)`` against the unrounded reference on ``args``: absolute for outputs up
    to 1, relative above (storing the output in bf16 alone costs up to 2^-9 * |ref|); NaN counts as inf."""
    ref = tree_attention_reference(**{k: v.cpu() for k, v in args.items()}, softmax_scale=scale,
                                   out_dtype=torch.float32, features=features, column_offsets=column_offsets)
    error = (result.cpu().float() - ref).abs() / ref.abs().clamp_min(1.0)
    return error.nan_to_num(nan=float("inf")).max().item()
