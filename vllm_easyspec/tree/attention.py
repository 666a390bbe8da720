"""The engine's CPU tree attention (:func:`attention_over_prefix_and_tree`): each row attends to the keys of its
request's prefix and to the tree columns its mask allows (its ancestors and itself), as a causal row at the row's
logical position attends under its layer's :class:`AttentionFeatures`."""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["FP8_KV_CACHE_DTYPES", "PLAIN", "AttentionFeatures", "TreePositions", "attention_over_prefix_and_tree",
           "prefix_and_tree_bias"]

# the per-tensor fp8 KV caches (vLLM's --kv-cache-dtype) both tree attention paths read as vLLM's kernels do
FP8_KV_CACHE_DTYPES = ("fp8", "fp8_e4m3", "fp8_e5m2")


@dataclass(frozen=True, eq=False)
class AttentionFeatures:
    """What one attention layer computes beyond ``softmax(q.k * scale) v`` over its causal keys, in vLLM's conventions
    (read once per layer at start-up, ``integration/tree_attention.py::layer_features``).

    A query at logical position ``q`` sees key position ``k`` iff ``k <= q``, ``q - k < window`` (if set) and
    ``k // chunk == q // chunk`` (if set). Its score ``s = q.k * scale`` becomes ``soft_cap * tanh(s / soft_cap)``
    (if set), plus ``alibi_slopes[h] * (k - q)`` (if set); ``sinks[h]`` (if set) is one more logit in head ``h``'s
    softmax, whose value is zero."""

    window: int | None = None
    chunk: int | None = None
    soft_cap: float | None = None
    alibi_slopes: torch.Tensor | None = None  # [Hq]
    sinks: torch.Tensor | None = None  # [Hq]

    @property
    def reach(self) -> tuple[int | None, int | None]:
        """What bounds the keys a row sees (the prefix a forward must read)."""
        return self.window, self.chunk

    @property
    def bias_key(self) -> tuple:
        """Everything that shapes the additive mask of :func:`prefix_and_tree_bias` besides the step."""
        return self.window, self.chunk, None if self.alibi_slopes is None else id(self.alibi_slopes)

    @property
    def uses_positions(self) -> bool:
        return self.window is not None or self.chunk is not None or self.alibi_slopes is not None

    def first_visible(self, positions: torch.Tensor) -> torch.Tensor:
        """The earliest key position a query at each of ``positions`` sees."""
        first = torch.zeros_like(positions)
        if self.window is not None:
            first = torch.maximum(first, positions - self.window + 1)
        if self.chunk is not None:
            first = torch.maximum(first, positions // self.chunk * self.chunk)
        return first

    def visible(self, query_positions: torch.Tensor, key_positions: torch.Tensor) -> torch.Tensor:
        """Whether each query sees each key (broadcast), causality included."""
        seen = key_positions <= query_positions
        if self.window is not None:
            seen = seen & (query_positions - key_positions < self.window)
        if self.chunk is not None:
            seen = seen & (key_positions // self.chunk == query_positions // self.chunk)
        return seen


PLAIN = AttentionFeatures()


@dataclass(frozen=True)
class TreePositions:
    """Logical positions in one tree forward, request by request: ``queries`` ``[R, W]`` of the query rows,
    ``columns`` ``[R, S]`` of the tree columns, ``prefix_starts`` ``[R]`` of the first prefix key read."""

    queries: torch.Tensor
    columns: torch.Tensor
    prefix_starts: torch.Tensor


def prefix_and_tree_bias(prefix_lens: torch.Tensor, length: int, tree_mask: torch.Tensor, group: int,
                         dtype: torch.dtype, features: AttentionFeatures = PLAIN,
                         positions: TreePositions | None = None) -> torch.Tensor:
    """Additive mask ``[R, 1 or Hkv, G * W, L + S]`` of :func:`attention_over_prefix_and_tree` for queries folded
    ``G`` query heads per KV head: 0 (or the ALiBi term) where a row attends (the prefix keys ``< prefix_lens`` that its
    features let it see, its ancestors and itself), ``-inf`` elsewhere. It depends only on the step and the
    features' :attr:`~AttentionFeatures.bias_key`, so a forward builds it once for the layers that share it.
    ``positions`` is needed when the features use them (prefix key ``c`` at ``positions.prefix_starts + c``)."""
    batch, width = tree_mask.shape[:2]
    device = tree_mask.device
    starts = torch.zeros(batch, dtype=torch.long, device=device) if positions is None else positions.prefix_starts
    prefix_positions = starts.to(device)[:, None] + torch.arange(length, device=device)[None, :]  # [R, L]
    prefix_valid = prefix_positions < prefix_lens.to(device)[:, None]
    allowed = torch.cat([prefix_valid[:, None, :].expand(batch, width, length), tree_mask.bool()], dim=2)
    if not features.uses_positions:
        bias = torch.zeros(allowed.shape, dtype=dtype, device=device).masked_fill_(~allowed, float("-inf"))
        return bias.repeat(1, group, 1)[:, None]  # rows ordered (g, w), as the folded queries
    keys = torch.cat([prefix_positions, positions.columns.to(device)], dim=1)[:, None, :]  # [R, 1, L + S]
    queries = positions.queries.to(device)[:, :, None]  # [R, W, 1]
    allowed = allowed & features.visible(queries, keys)
    if features.alibi_slopes is None:
        bias = torch.zeros(allowed.shape, dtype=dtype, device=device).masked_fill_(~allowed, float("-inf"))
        return bias.repeat(1, group, 1)[:, None]
    slopes = features.alibi_slopes.to(device, torch.float32).view(-1, group)  # [Hkv, G]
    distance = (keys - queries).float()  # [R, W, L + S]
    bias = slopes[None, :, :, None, None] * distance[:, None, None]  # [R, Hkv, G, W, L + S]
    bias = bias.masked_fill(~allowed[:, None, None], float("-inf")).to(dtype)
    return bias.flatten(2, 3)


def attention_over_prefix_and_tree(query: torch.Tensor, prefix_key: torch.Tensor, prefix_value: torch.Tensor,
                                   prefix_lens: torch.Tensor, tree_key: torch.Tensor, tree_value: torch.Tensor,
                                   tree_mask: torch.Tensor, softmax_scale: float, bias: torch.Tensor | None = None,
                                   features: AttentionFeatures = PLAIN, positions: TreePositions | None = None
                                   ) -> torch.Tensor:
    """Tree attention of ``R`` requests whose tree K/V is at hand (not in a paged cache).

    * ``query`` ``[R, W, Hq, D]``: ``W`` query rows per request (padding rows allowed);
    * ``prefix_key`` / ``prefix_value`` ``[R, Hkv, L, D]`` (values may be ``Dv`` wide): request ``r``'s context
      from position ``positions.prefix_starts[r]`` (0 without ``positions``), valid below ``prefix_lens[r]``;
    * ``tree_key`` / ``tree_value`` ``[R, Hkv, S, D]`` and ``tree_mask`` ``[R, W, S]`` bool: row ``w`` also
      attends to tree column ``s`` iff ``tree_mask[r, w, s]`` (its ancestors and itself);
    * ``features`` of the layer, ``positions`` of the rows and keys (needed when the features use them);
    * ``bias``: :func:`prefix_and_tree_bias` of these arguments, if the caller keeps it across layers.

    Returns ``[R, W, Hq, Dv]`` in the query dtype. Every row must attend to at least one column. This is the
    engine's CPU tree path (target verify and the drafter's levels): one SDPA call per layer (explicit scores
    for soft caps and sinks), the ``G`` query heads of each KV head folded into its query rows (no K/V repeat
    for grouped-query attention).
    """
    batch, width, heads, dim = query.shape
    kv_heads = prefix_key.shape[1]
    group = heads // kv_heads
    if bias is None:
        bias = prefix_and_tree_bias(prefix_lens, prefix_key.shape[2], tree_mask, group, query.dtype, features,
                                    positions)
    folded = query.reshape(batch, width, kv_heads, group, dim).permute(0, 2, 3, 1, 4)
    folded = folded.reshape(batch, kv_heads, group * width, dim)
    key = torch.cat([prefix_key, tree_key.to(prefix_key.dtype)], dim=2)
    value = torch.cat([prefix_value, tree_value.to(prefix_value.dtype)], dim=2)
    if features.soft_cap is None and features.sinks is None:
        out = torch.nn.functional.scaled_dot_product_attention(folded, key, value, attn_mask=bias,
                                                               scale=softmax_scale)
    else:
        out = _attention_with_scores(folded, key, value, bias, softmax_scale, features, group, width)
    value_dim = out.shape[-1]  # the values' width may differ from the keys' (MLA's latent form)
    return out.view(batch, kv_heads, group, width, value_dim).permute(0, 3, 1, 2, 4).reshape(batch, width, heads,
                                                                                          value_dim)


def _attention_with_scores(folded: torch.Tensor, key: torch.Tensor, value: torch.Tensor, bias: torch.Tensor,
                           scale: float, features: AttentionFeatures, group: int, width: int) -> torch.Tensor:
    """Attention with the scores at hand (float32): soft-capped before the mask, and each head's sink logit in
    the softmax's denominator."""
    scores = torch.matmul(folded.float(), key.float().transpose(-1, -2)) * scale
    if features.soft_cap is not None:
        scores = features.soft_cap * torch.tanh(scores / features.soft_cap)
    scores = scores + bias
    top = scores.amax(-1, keepdim=True)
    if features.sinks is not None:
        sink = features.sinks.to(scores.device, torch.float32).view(-1, group, 1).expand(-1, group, width)
        sink = sink.reshape(1, -1, group * width, 1)
        top = torch.maximum(top, sink)
    weights = torch.exp(scores - top)
    denominator = weights.sum(-1, keepdim=True)
    if features.sinks is not None:
        denominator = denominator + torch.exp(sink - top)
    return torch.matmul(weights / denominator, value.float()).to(folded.dtype)
