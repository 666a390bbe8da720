"""The float64 per-node tree-attention reference the kernel tests check against (arguments and contract of
``vllm_easyspec.kernels.tree_attention.tree_attention_triton``)."""

from __future__ import annotations

import torch


def gather_positions(cache: torch.Tensor, block_table_row: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Rows ``[len(positions), Hkv, D]`` of one request's paged cache at logical ``positions``."""
    block_size = cache.shape[1]
    blocks = block_table_row.long()[positions // block_size]
    return cache[blocks, positions % block_size]


def tree_attention_reference(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                             block_table: torch.Tensor, prefix_lens: torch.Tensor, cu_query_lens: torch.Tensor,
                             tree_mask: torch.Tensor, softmax_scale: float, out_dtype: torch.dtype | None = None
                             ) -> torch.Tensor:
    """Node ``t`` is the last token of the sequence ``prefix + (root-to-t branch)`` and attends causally, i.e. to
    all of it, in float64. ``out_dtype`` (default: the query dtype) lets tests keep the unrounded result."""
    group = query.shape[1] // key_cache.shape[2]
    out = torch.empty(query.shape, dtype=out_dtype or query.dtype, device=query.device)
    cu = cu_query_lens.tolist()
    for b in range(len(cu) - 1):
        prefix = int(prefix_lens[b])
        for t in range(cu[b], cu[b + 1]):
            branch = tree_mask[t, : cu[b + 1] - cu[b]].nonzero()[:, 0]  # ascending = root to node
            positions = torch.cat([torch.arange(prefix, device=query.device), prefix + branch])
            k = gather_positions(key_cache, block_table[b], positions).double().repeat_interleave(group, dim=1)
            v = gather_positions(value_cache, block_table[b], positions).double().repeat_interleave(group, dim=1)
            scores = torch.einsum("hd,lhd->hl", query[t].double(), k) * softmax_scale
            out[t] = torch.einsum("hl,lhd->hd", scores.softmax(-1), v).to(out.dtype)
    return out


def reference_error(args: dict[str, torch.Tensor], result: torch.Tensor, scale: float) -> float:
    """``max |result - ref| / max(1, |ref|)`` against the unrounded reference on ``args``: absolute for outputs up
    to 1, relative above (storing the output in bf16 alone costs up to 2^-9 * |ref|); NaN counts as inf."""
    ref = tree_attention_reference(**{k: v.cpu() for k, v in args.items()}, softmax_scale=scale,
                                   out_dtype=torch.float32)
    error = (result.cpu().float() - ref).abs() / ref.abs().clamp_min(1.0)
    return error.nan_to_num(nan=float("inf")).max().item()
