"""KV compaction: slot arithmetic by hand, torch and Triton moves in place (including aliasing where a
destination is another accepted node's source, paths crossing block boundaries, several requests,
strided cache views), and the sampler -> compaction hand-off."""

from __future__ import annotations

import pytest
import torch

import tests.tree.kernel_cases as kernel_cases
from vllm_easyspec.tree.building import TokenTreeBatch
from vllm_easyspec.tree.compaction import compact_kv, compact_kv_torch, tree_compaction_slots
from vllm_easyspec.tree.sampling import tree_rejection_sample


def test_slots_by_hand_cross_blocks_and_alias():
    # block_size 4, logical blocks -> physical [7, 2, 5]; root at position 5; accepted nodes 0, 2, 3
    # at depths 1..3: node 0 (query 1, position 6) is in place; node 2: position 8 -> 7;
    # node 3: position 9 -> 8. Position 8 is both node 2's source and node 3's destination.
    src, dst = tree_compaction_slots(torch.tensor([[7, 2, 5]]), 4, torch.tensor([5]), torch.tensor([[0, 2, 3]]))
    # position p -> physical block [7, 2, 5][p // 4] * 4 + p % 4
    assert src.tolist() == [[-1, 20, 21]]
    assert dst.tolist() == [[-1, 11, 20]]
    # a drafter pass without the root query (query_offset=0): node k sits at prefix + node
    src, dst = tree_compaction_slots(torch.tensor([[7, 2, 5]]), 4, torch.tensor([5]), torch.tensor([[1, 4, -1]]),
                                     query_offset=0)
    assert src.tolist() == [[10, 21, -1]] and dst.tolist() == [[9, 10, -1]]


def _expected(cache: torch.Tensor, src: torch.Tensor, dst: torch.Tensor) -> torch.Tensor:
    """Apply moves with an explicit snapshot of the original cache."""
    flat_src, flat_dst = src[src >= 0], dst[dst >= 0]
    bs = cache.shape[1]
    out = cache.clone()
    out[flat_dst // bs, flat_dst % bs] = cache[flat_src // bs, flat_src % bs]
    return out


def _batch_moves():
    """Three requests with paths that cross block boundaries and alias, block_size 4."""
    block_table = torch.tensor([[3, 9, 4, 0], [1, 8, 6, 2], [5, 7, 10, 11]])
    prefix_lens = torch.tensor([2, 5, 0])
    accepted = torch.tensor([[1, 2, 4, 7], [0, 3, 5, -1], [2, -1, -1, -1]])
    return tree_compaction_slots(block_table, 4, prefix_lens, accepted)


def test_torch_compaction_moves_and_reads_sources_first():
    gen = torch.Generator().manual_seed(0)
    key = torch.randn(12, 4, 2, 8, generator=gen)
    value = torch.randn(12, 4, 2, 8, generator=gen)
    src, dst = _batch_moves()
    assert bool(((dst[:, :, None] == src[:, None, :]) & (dst[:, :, None] >= 0)).any())  # aliasing present
    expected_k, expected_v = _expected(key, src, dst), _expected(value, src, dst)
    # reversed move order would corrupt a sequential in-place copy; results must not change
    compact_kv_torch([key, value], src.flip(1), dst.flip(1))
    assert torch.equal(key, expected_k) and torch.equal(value, expected_v)


def test_torch_compaction_on_strided_layer_cache_view():
    gen = torch.Generator().manual_seed(1)
    layer = torch.randn(12, 2, 4, 2, 8, generator=gen)  # [num_blocks, K/V, block_size, heads, dim]
    src, dst = _batch_moves()
    expected = _expected(layer[:, 0], src, dst)
    compact_kv([layer[:, 0], layer[:, 1]], src, dst, backend="torch")
    assert torch.equal(layer[:, 0], expected)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_triton_compaction_matches_torch(kernel_runner, dtype):
    gen = torch.Generator().manual_seed(2)
    key = torch.randn(12, 4, 3, 16, generator=gen).to(dtype)
    layer = torch.randn(12, 2, 4, 3, 16, generator=gen).to(dtype)
    src, dst = _batch_moves()
    moved = kernel_runner(kernel_cases.triton_compaction, [key, layer[:, 1]], src.flip(1), dst.flip(1))
    assert torch.equal(moved[0], _expected(key, src, dst))
    assert torch.equal(moved[1], _expected(layer[:, 1], src, dst))


def test_sampler_output_drives_compaction_to_linear_slots():
    """End to end: the verify forward wrote query j's K at position prefix + j; after sampling and
    compaction, positions prefix + 1 .. prefix + a hold the accepted nodes' K in path order."""
    block_size, prefix = 4, 6
    # root -> n0:5 -> n2:1 ; root -> n1:3 -> n3:2 -> n4:0 ; n3 -> n5:4
    tree = TokenTreeBatch(torch.tensor([[5, 3, 1, 2, 0, 4]]), torch.tensor([[-1, -1, 0, 1, 3, 3]]),
                          torch.tensor([6]), "without_replacement")
    logits = torch.zeros(1, 7, 6)
    for row, token in {0: 3, 2: 2, 4: 4, 6: 1}.items():  # greedy path n1 -> n3 -> n5, bonus 1
        logits[0, row, token] = 9.0
    out = tree_rejection_sample(tree, logits)
    assert out.output_token_ids.tolist() == [[3, 2, 4, 1]]
    block_table = torch.tensor([[4, 0, 2, 1]])
    key = torch.zeros(5, block_size, 1, 1)
    for j in range(7):  # K row of query j stores the value 100 + j
        pos = prefix + j
        key[block_table[0, pos // block_size], pos % block_size] = 100 + j
    src, dst = tree_compaction_slots(block_table, block_size, torch.tensor([prefix]), out.accepted_nodes)
    compact_kv([key], src, dst)
    linear = [float(key[block_table[0, p // block_size], p % block_size]) for p in range(prefix, prefix + 4)]
    assert linear == [100.0, 102.0, 104.0, 106.0]  # root, then queries of nodes 1, 3, 5
