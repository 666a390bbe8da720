"""Attention features in the CPU tree path (issue 68): sliding windows, chunked local attention, soft caps, ALiBi
and sinks, each computed for every tree row as for a causal row at the row's logical position.

- against a float64 reference on trees whose rows cross a window or chunk boundary, each failing when the
  feature is ignored;
- against vLLM's own CPU attention kernel (``cpu_attention_with_kv_cache``) on a path, read back from a paged
  cache through the engine's reader (from the first block the window lets a row see);
- the features read from vLLM's CPU impl (window as an int, -1 for none) and GPU impls (``(left, right)``).
"""

from __future__ import annotations

import pytest
import torch

from tests.tree.tree_testlib import random_parents
from vllm_easyspec.tree.attention import (
    PLAIN,
    AttentionFeatures,
    TreePositions,
    attention_over_prefix_and_tree,
)

HEADS, KV_HEADS, DIM = 4, 2, 32
SCALE = DIM ** -0.5
SLOPES = torch.tensor([0.5, 0.25, 0.125, 0.0625])
SINKS = torch.tensor([0.3, -1.0, 2.0, 0.5])
FEATURES = {
    "window": AttentionFeatures(window=16),
    "chunk": AttentionFeatures(chunk=32),
    "soft_cap": AttentionFeatures(soft_cap=2.0),
    "alibi": AttentionFeatures(alibi_slopes=SLOPES),
    "sinks": AttentionFeatures(sinks=SINKS),
    "window_sinks": AttentionFeatures(window=16, sinks=SINKS),
    "window_soft_cap": AttentionFeatures(window=16, soft_cap=2.0),
}


def _depths(parents: list[int]) -> list[int]:
    """Depth of each query column: the root (parent -1 of node 0's list) is column 0 at depth 0."""
    depths = [0]
    for parent in parents:
        depths.append(depths[parent + 1] + 1)
    return depths


def _case(seed: int = 0):
    """Three requests whose trees cross position 64 (a window of 16 and a chunk of 32 from their roots)."""
    generator = torch.Generator().manual_seed(seed)
    prefix_lens = torch.tensor([62, 17, 40])
    trees = [[parent - 1 for parent in random_parents(n, generator)[1:]] for n in (7, 5, 9)]  # root: -1
    trees[0] = [-1, 0, 1, 2, 0, 4]  # a depth-4 branch from 62 to 66 and a second one
    width = 1 + max(len(t) for t in trees)
    depths = torch.zeros(3, width, dtype=torch.long)
    mask = torch.zeros(3, width, width, dtype=torch.bool)
    for r, parents in enumerate(trees):
        d = _depths(parents)
        depths[r, : len(d)] = torch.tensor(d)
        for column in range(len(d)):
            node = column
            mask[r, column, 0] = True
            while node > 0:
                mask[r, column, node] = True
                node = parents[node - 1] + 1
        mask[r, len(d):, 0] = True  # padding rows see the root
    length = int(prefix_lens.max())
    tensors = {name: torch.randn(3, shape, length if "prefix" in name else width, DIM, generator=generator)
               for name, shape in (("prefix_key", KV_HEADS), ("prefix_value", KV_HEADS), ("tree_key", KV_HEADS),
                                   ("tree_value", KV_HEADS))}
    query = torch.randn(3, width, HEADS, DIM, generator=generator)
    positions = prefix_lens[:, None] + depths
    return dict(query=query, prefix_lens=prefix_lens, tree_mask=mask, **tensors), positions, trees


def _reference(case: dict, positions: torch.Tensor, trees, features: AttentionFeatures) -> torch.Tensor:
    """Each real row in float64 as the last token of ``prefix + its branch``, attending causally under
    ``features`` at its logical position."""
    out = torch.zeros(case["query"].shape, dtype=torch.float64)
    group = HEADS // KV_HEADS
    for r, parents in enumerate(trees):
        prefix = int(case["prefix_lens"][r])
        for w in range(1 + len(parents)):
            columns = case["tree_mask"][r, w].nonzero()[:, 0]
            key_pos = torch.cat([torch.arange(prefix), positions[r, columns]])
            keys = torch.cat([case["prefix_key"][r, :, :prefix], case["tree_key"][r, :, columns]], 1).double()
            values = torch.cat([case["prefix_value"][r, :, :prefix], case["tree_value"][r, :, columns]], 1).double()
            keys, values = keys.repeat_interleave(group, 0), values.repeat_interleave(group, 0)
            scores = torch.einsum("hd,hld->hl", case["query"][r, w].double(), keys) * SCALE
            if features.soft_cap:
                scores = features.soft_cap * torch.tanh(scores / features.soft_cap)
            query_pos = positions[r, w]
            if features.alibi_slopes is not None:
                scores = scores + features.alibi_slopes.double()[:, None] * (key_pos - query_pos)[None].double()
            seen = features.visible(query_pos, key_pos)
            scores = scores.masked_fill(~seen[None], float("-inf"))
            if features.sinks is not None:
                scores = torch.cat([scores, features.sinks.double()[:, None]], 1)
            out[r, w] = torch.einsum("hl,hld->hd", scores.softmax(-1)[:, : keys.shape[1]], values)
    return out


def _rows_error(out: torch.Tensor, expected: torch.Tensor, trees) -> float:
    real = torch.zeros(out.shape[:2], dtype=torch.bool)
    for r, parents in enumerate(trees):
        real[r, : 1 + len(parents)] = True
    return (out.double() - expected)[real].abs().max().item()


@pytest.mark.parametrize("name", list(FEATURES))
@pytest.mark.parametrize("start", [0, 32])
def test_tree_rows_attend_as_causal_rows_under_each_feature(name, start):
    """Every row equals the float64 reference of its branch; a prefix read from position ``start`` (a block
    boundary inside every window) gives the same; and ignoring the feature does not."""
    features = FEATURES[name]
    case, positions, trees = _case()
    if start and features.reach == (None, None):
        pytest.skip("the whole prefix is read without a window or chunk")
    expected = _reference(case, positions, trees, features)
    read = dict(case)
    starts = torch.minimum(torch.full((3,), start), features.first_visible(case["prefix_lens"]) // 32 * 32)
    if start:  # each request's prefix from its own first block (request 1's from 0)
        length = int((case["prefix_lens"] - starts).max())
        for key in ("prefix_key", "prefix_value"):
            rows = [case[key][r, :, int(first): int(first) + length] for r, first in enumerate(starts)]
            read[key] = torch.stack([torch.nn.functional.pad(x, (0, 0, 0, length - x.shape[1])) for x in rows])
    tree_positions = TreePositions(positions, positions, starts if start else torch.zeros(3, dtype=torch.long))
    out = attention_over_prefix_and_tree(**read, softmax_scale=SCALE, features=features, positions=tree_positions)
    assert _rows_error(out, expected, trees) < 1e-5
    ignored = attention_over_prefix_and_tree(**case, softmax_scale=SCALE, features=PLAIN)
    assert _rows_error(ignored, expected, trees) > 1e-2


def test_chunked_rows_past_a_chunk_boundary_see_only_their_chunk():
    """Request 0's root sits at 62 and its nodes of depth 2 to 4 at 64 to 66, in the next chunk: they see their
    own ancestors from 64 on and no prefix key, so their output is a mix of those ancestors' values only."""
    case, positions, trees = _case()
    features = FEATURES["chunk"]
    out = attention_over_prefix_and_tree(**case, softmax_scale=SCALE, features=features,
                                         positions=TreePositions(positions, positions, torch.zeros(3, dtype=torch.long)))
    row = 4  # node 3: the branch 62 -> 63 -> 64 -> 65 -> 66 (columns 0 to 4)
    assert positions[0, :5].tolist() == [62, 63, 64, 65, 66]
    values = case["tree_value"][0][:, [2, 3, 4]].repeat_interleave(HEADS // KV_HEADS, 0)  # the columns from 64 on
    low, high = values.min(1).values, values.max(1).values
    assert bool(((out[0, row] >= low - 1e-5) & (out[0, row] <= high + 1e-5)).all())


@pytest.mark.parametrize("name", ["window", "soft_cap", "alibi", "sinks", "window_sinks"])
def test_a_path_through_the_paged_cache_equals_vllms_cpu_kernel(name):
    """A path's rows (root at 70, nodes at 71..75) read back from vLLM's paged cache by the engine's reader and
    attended by the tree path equal vLLM's own kernel on the same causal rows, under each feature vLLM's CPU kernel
    implements; blocks wholly behind the window (which vLLM frees) hold NaN and are never read."""
    from vllm import _custom_ops as ops
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    from vllm_easyspec.integration.cpu.attention_backend import gather_cpu_prefix

    features, dtype, block_size, prefix, nodes = FEATURES[name], torch.float32, 32, 70, 5
    isa = _get_attn_isa(dtype, block_size, DIM, "auto")
    generator = torch.Generator().manual_seed(4)
    length = prefix + 1 + nodes
    keys, values = (torch.randn(length, KV_HEADS, DIM, generator=generator) for _ in range(2))
    query = torch.randn(1 + nodes, HEADS, DIM, generator=generator)
    cache = torch.zeros(6, KV_HEADS, block_size, 2 * DIM, dtype=dtype)
    key_cache, value_cache = cache.view(6, KV_HEADS, 2 * block_size, DIM).chunk(2, dim=2)
    table = torch.tensor([[4, 1, 3]], dtype=torch.int32)
    slots = torch.tensor([int(table[0, p // block_size]) * block_size + p % block_size for p in range(length)])
    ops.cpu_attn_reshape_and_cache(keys, values, key_cache, value_cache, slots, isa)
    expected = torch.empty_like(query)
    query_start, seq_lens = torch.tensor([0, 1 + nodes], dtype=torch.int32), torch.tensor([length], dtype=torch.int32)
    window = features.window or -1
    metadata = ops.cpu_attn_get_scheduler_metadata(
        num_reqs=1, num_heads=HEADS, num_kv_heads=KV_HEADS, head_dim=DIM, seq_lens=seq_lens, dtype=dtype,
        query_start_loc=query_start, causal=True, sliding_window_size=window, isa=isa, enable_kv_split=False)
    ops.cpu_attention_with_kv_cache(
        query=query, key_cache=key_cache, value_cache=value_cache, output=expected, query_start_loc=query_start,
        seq_lens=seq_lens, scale=SCALE, causal=True, alibi_slopes=features.alibi_slopes, sliding_window=window,
        block_table=table, softcap=features.soft_cap or 0.0, scheduler_metadata=metadata, s_aux=features.sinks)
    cache.view(6, -1)[0] = float("nan")  # block 0: where vLLM's freed blocks point
    freed = table.clone()
    freed[0, : features.first_visible(torch.tensor(prefix)) // block_size] = 0
    layer = type("Layer", (), {"isa": isa, "kv_cache_dtype": "auto", "_k_scale_float": 1.0, "_v_scale_float": 1.0})()
    prefix_key, prefix_value, starts = gather_cpu_prefix(layer, cache, freed, torch.tensor([prefix]), {}, features,
                                                         torch.tensor([prefix]), dtype)
    positions = (prefix + torch.arange(1 + nodes))[None]
    out = attention_over_prefix_and_tree(
        query[None], prefix_key, prefix_value, torch.tensor([prefix]), keys[prefix:].transpose(0, 1)[None],
        values[prefix:].transpose(0, 1)[None], torch.ones(1 + nodes, 1 + nodes, dtype=torch.bool).tril()[None],
        SCALE, features=features, positions=TreePositions(positions, positions, starts))
    assert (features.window is None) == (int(starts[0]) == 0)
    torch.testing.assert_close(out[0], expected, atol=2e-5, rtol=1e-5)
