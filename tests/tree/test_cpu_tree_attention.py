"""The torch tree attention of ``python -m benchmarks kernels`` (``benchmarks.harness.paged_tree_attention``)
against the float64 per-node reference: ragged prefixes (including 0), GQA, forests, block sizes 16 and 32."""

from __future__ import annotations

import pytest
import torch

from benchmarks.harness.paged_tree_attention import tree_attention_cpu, tree_attention_naive
from tests.tree.attention_reference import reference_error
from tests.tree.tree_testlib import make_paged_batch, random_parents

TOLERANCE = {torch.float32: 1e-4, torch.float16: 2e-3, torch.bfloat16: 8e-3}  # as test_tree_attention.py


@pytest.mark.parametrize("implementation", [tree_attention_cpu, tree_attention_naive], ids=["cpu", "naive"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("heads", [(4, 2), (2, 2)])
def test_benchmarked_paths_match_reference(implementation, dtype, block_size, heads):
    gen = torch.Generator().manual_seed(block_size + heads[0])
    parents = [random_parents(n, gen, forest=(i == 3)) for i, n in enumerate([1, 6, 9, 5])]
    args = make_paged_batch(parents, [0, 19, 45, 33], block_size, *heads, 32, dtype, seed=7)
    out = implementation(**args, softmax_scale=32 ** -0.5)
    assert out.dtype == dtype and out.shape == args["query"].shape
    assert reference_error(args, out, 32 ** -0.5) < TOLERANCE[dtype]


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_cpu_path_matches_reference_large(dtype):
    gen = torch.Generator().manual_seed(11)
    parents = [random_parents(n, gen) for n in [64, 17, 33]]
    args = make_paged_batch(parents, [300, 0, 129], 16, 8, 2, 128, dtype, seed=5)
    assert reference_error(args, tree_attention_cpu(**args, softmax_scale=128 ** -0.5), 128 ** -0.5) < TOLERANCE[dtype]
