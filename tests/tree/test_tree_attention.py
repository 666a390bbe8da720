"""Tree attention over a paged KV cache: the Triton kernel (interpreter on CPU) against a plain float64
per-node reference, with random non-contiguous block tables, several trees per batch,
ragged prefixes (including 0 and block-crossing ones), GQA, and block sizes 16 and 32."""

from __future__ import annotations

import pytest
import torch

import tests.tree.kernel_cases as kernel_cases
from tests.tree.attention_reference import gather_positions, tree_attention_reference
from tests.tree.tree_testlib import make_paged_batch, random_parents
from tests.tree.tree_views import ancestor_mask_from_parents, verify_layout
from vllm_easyspec.tree.attention import attention_over_prefix_and_tree
from vllm_easyspec.tree.building import TokenTreeBatch

# error bounds against the float64 reference, on |out - ref| / max(1, |ref|) (absolute error for outputs
# up to 1, relative above); vLLM's removed tree-attention test used 8e-3 for bf16
TOLERANCE = {torch.float32: 1e-4, torch.float16: 2e-3, torch.bfloat16: 8e-3}


def test_ancestor_mask_from_parents_by_hand():
    # request 0: root 0 -> 1 -> 3, root 0 -> 2 ; request 1: a forest 0, 1 -> 2
    parents = torch.tensor([-1, 0, 0, 1, -1, -1, 1])
    mask = ancestor_mask_from_parents(parents, torch.tensor([0, 4, 7]))
    assert mask.int().tolist() == [
        [1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 1, 0, 1],
        [1, 0, 0, 0], [0, 1, 0, 0], [0, 1, 1, 0],
    ]
    with pytest.raises(ValueError, match="parent must come before"):
        ancestor_mask_from_parents(torch.tensor([-1, 2, 0]), torch.tensor([0, 3]))


def test_verify_layout_mask_matches_parent_mask():
    tree = TokenTreeBatch(torch.tensor([[5, 6, 7, 8, 0], [1, 2, 3, 0, 0]]),
                          torch.tensor([[-1, -1, 0, 2, -1], [-1, 0, 0, -1, -1]]), torch.tensor([4, 3]),
                          "without_replacement")
    layout = verify_layout(tree, torch.tensor([30, 7]))
    expected = ancestor_mask_from_parents(layout.parents, layout.cu_query_lens, width=tree.width + 1)
    assert torch.equal(layout.ancestor_mask, expected)
    assert layout.positions.tolist() == [30, 31, 31, 32, 33, 7, 8, 9, 9]


def test_reference_is_causal_attention_over_each_branch():
    """Independent check of the reference: for every root-to-leaf branch, causal SDPA of the branch's
    queries over prefix + branch K/V gives each branch node's row."""
    gen = torch.Generator().manual_seed(0)
    parents = [random_parents(9, gen)]
    args = make_paged_batch(parents, [21], 16, 4, 2, 16, torch.float32, seed=1)
    scale = 0.3
    ref = tree_attention_reference(**args, softmax_scale=scale)
    par = parents[0]
    leaves = [j for j in range(9) if j not in par]
    for leaf in leaves:
        branch = [leaf]
        while par[branch[-1]] >= 0:
            branch.append(par[branch[-1]])
        branch = torch.tensor(branch[::-1])
        positions = torch.cat([torch.arange(21), 21 + branch])
        k = gather_positions(args["key_cache"], args["block_table"][0], positions).repeat_interleave(2, 1)
        v = gather_positions(args["value_cache"], args["block_table"][0], positions).repeat_interleave(2, 1)
        q = args["query"][branch]  # [n, H, D]
        n, total = len(branch), len(positions)
        causal = torch.ones(n, total, dtype=torch.bool).tril(diagonal=total - n)
        sdpa = torch.nn.functional.scaled_dot_product_attention(
            q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), attn_mask=causal, scale=scale)
        torch.testing.assert_close(ref[branch], sdpa.transpose(0, 1), atol=1e-5, rtol=1e-5)


BATCH_TREES = dict(sizes=[1, 6, 9, 5], prefix_lens=[0, 19, 45, 33])


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("block_size", [16, 32])
def test_triton_kernel_matches_reference(kernel_runner, dtype, block_size):
    err = kernel_runner(kernel_cases.triton_attention_error, dtype, block_size, 4, 2, 32,
                        BATCH_TREES["sizes"], BATCH_TREES["prefix_lens"], seed=block_size, scale=0.17,
                        forest_request=3)
    print(f"triton tree attention {dtype} block_size={block_size}: max error {err:.2e}")
    assert err < TOLERANCE[kernel_cases.DTYPES[dtype]]


def test_triton_kernel_without_gqa_and_single_node(kernel_runner):
    err = kernel_runner(kernel_cases.triton_attention_error, "float32", 16, 3, 3, 16, [1, 2], [16, 31],
                        seed=9, scale=0.25)
    assert err < TOLERANCE[torch.float32]


# Launches that force the split path: KV ranges of 16 or 32 positions (several per request), row tiles
# of 16 that do not divide the rows (e.g. 9 tokens x group 4 = 36 rows = 16 + 16 + 4).
SPLIT_LAUNCH = dict(block_m=16, block_n=16, num_splits=5, min_split_len=16, num_warps=4, num_stages=2)
WIDE_SPLIT_LAUNCH = dict(block_m=32, block_n=16, num_splits=3, min_split_len=32, num_warps=4, num_stages=2)
# a request without prefix, one whose prefix is shorter than one split, one far longer than the rest
SPLIT_TREES = dict(sizes=[5, 1, 9, 3], prefix_lens=[0, 7, 150, 33])


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("block_size", [16, 32])
def test_triton_kernel_with_kv_splits(kernel_runner, dtype, block_size):
    err = kernel_runner(kernel_cases.triton_attention_error, dtype, block_size, 8, 2, 32, SPLIT_TREES["sizes"],
                        SPLIT_TREES["prefix_lens"], seed=3 + block_size, scale=0.2, forest_request=3,
                        launch=SPLIT_LAUNCH)
    print(f"triton tree attention, 5 KV splits, {dtype} block_size={block_size}: max error {err:.2e}")
    assert err < TOLERANCE[kernel_cases.DTYPES[dtype]]


@pytest.mark.parametrize("heads", [(3, 3), (6, 2), (8, 2), (8, 1), (32, 1)],
                         ids=["group1", "group3", "group4", "group8", "group32"])  # 32: a token spans row tiles
@pytest.mark.parametrize("launch", [SPLIT_LAUNCH, WIDE_SPLIT_LAUNCH], ids=["m16", "m32"])
def test_triton_kernel_splits_across_groups(kernel_runner, heads, launch):
    err = kernel_runner(kernel_cases.triton_attention_error, "float32", 16, *heads, 16, [7, 2, 4], [40, 0, 3],
                        seed=sum(heads), scale=0.25, launch=launch)
    assert err < TOLERANCE[torch.float32]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("launch", [None, SPLIT_LAUNCH], ids=["default", "splits"])
def test_triton_kernel_serves_a_draft_level(kernel_runner, dtype, launch):
    """Rows that are the last columns of their trees (``first_column``, a drafter level): each row sees the
    prefix and its ancestors among all earlier columns, nothing past its request's last column."""
    err = kernel_runner(kernel_cases.triton_level_error, dtype, 16, 8, 2, 32, 9, 3, [40, 0, 150], seed=5, scale=0.2,
                        launch=launch)
    assert err < TOLERANCE[kernel_cases.DTYPES[dtype]]


def test_triton_kernel_stops_at_the_block_tables_end(kernel_runner):
    """A level whose last rows sit past the block table (the model's length): every row sees only the positions
    before the table's end; reading past it reads another request's blocks."""
    err = kernel_runner(kernel_cases.triton_level_error, "float32", 16, 8, 2, 32, 9, 3, [137, 40, 0], seed=6,
                        scale=0.2, table_blocks=9)
    assert err < TOLERANCE[torch.float32]


def test_triton_kernel_with_the_most_splits(kernel_runner):
    """64 splits of 16 positions (most of them empty for the short request) at head size 128: the merge
    runs one query head per program over all 64 partial results."""
    launch = dict(block_m=16, block_n=16, num_splits=64, min_split_len=16, num_warps=4, num_stages=2)
    err = kernel_runner(kernel_cases.triton_attention_error, "bfloat16", 16, 2, 1, 128, [3, 2], [70, 1000],
                        seed=1, scale=0.1, launch=launch)
    assert err < TOLERANCE[torch.bfloat16]


def test_triton_default_launch_splits_a_long_prefix(kernel_runner):
    """Batch 1 with a long prefix: the kernel's own launch splits the KV length (and stays exact)."""
    from vllm_easyspec.kernels.tree_attention import NOMINAL_SHARED_MEMORY, NOMINAL_SM_COUNT, choose_launch

    launch = choose_launch(batch=1, num_kv_heads=2, group=2, max_query_len=6, kv_len_bound=(600 + 6 + 20) // 16 * 16,
                           head_dim=16, element_size=2, sm_count=NOMINAL_SM_COUNT,
                           shared_memory=NOMINAL_SHARED_MEMORY)
    assert launch.num_splits > 1
    err = kernel_runner(kernel_cases.triton_attention_error, "float16", 16, 4, 2, 16, [6], [600], seed=5, scale=0.3)
    assert err < TOLERANCE[torch.float16]


def test_triton_kernel_repeat_is_bitwise_identical(kernel_runner):
    assert kernel_runner(kernel_cases.triton_attention_repeat_is_bitwise, "bfloat16", 16, 8, 2, 32,
                         SPLIT_TREES["sizes"], SPLIT_TREES["prefix_lens"], seed=21, launch=SPLIT_LAUNCH)


# Features (issue 68) at logical positions P + depth. Request 0: root at 62, a branch 62 -> 66 across the chunk
# boundary 64 and a second one; request 1: root at 40, branches to depth 4. Window 16 / chunk 32 hide prefix blocks
# (poisoned with NaN); a window of 4 and the chunk boundary at 64 also hide tree columns from deeper rows.
FEATURE_TREES = dict(parents=[[-1, 0, 1, 2, 0, 4, 3], [-1, 0, 0, 1, 2, 3, 4, 5, 5]], prefix_lens=[62, 40])
FEATURES = ["window", "chunk", "soft_cap", "alibi", "sinks", "window+sinks", "window=4+alibi", "chunk+soft_cap+sinks"]


def _check_features(result: dict, features: str, dtype: str) -> None:
    reaches = "window" in features or "chunk" in features
    assert result["error"] < TOLERANCE[kernel_cases.DTYPES[dtype]], result
    assert (result["poisoned"] > 0) == reaches  # and never read: NaN would make the error inf
    if "ignored_error" in result:  # the plain kernel on the same rows is far off: the test sees the feature
        assert result["ignored_error"] > 0.1, result


@pytest.mark.parametrize("features", FEATURES)
def test_triton_kernel_computes_each_feature_as_vllm_and_not_without_it(kernel_runner, features):
    """Every tree row under the layer's features equals the float64 causal row at its logical position, where the
    plain kernel is off by more than 0.1; blocks wholly behind the rows' windows or before their chunks hold NaN."""
    result = kernel_runner(kernel_cases.triton_feature_errors, "float32", 16, (4, 2), 32, **FEATURE_TREES, seed=3,
                           scale=0.17, features=features, ignored=True)
    print(f"triton tree attention with {features}: max error {result['error']:.2e}, "
          f"features ignored {result['ignored_error']:.2e}")
    _check_features(result, features, "float32")


@pytest.mark.parametrize("features", FEATURES)
@pytest.mark.parametrize(("dtype", "launch"), [("float32", SPLIT_LAUNCH), ("bfloat16", None),
                                               ("bfloat16", SPLIT_LAUNCH)], ids=["float32-splits", "bf16", "bf16-splits"])
def test_triton_kernel_features_in_bf16_and_across_kv_splits(kernel_runner, features, dtype, launch):
    """The features with 5 KV splits of 16 positions (the splits start at the tile's first visible position; the
    sinks enter the merge) and in bf16."""
    result = kernel_runner(kernel_cases.triton_feature_errors, dtype, 16, (4, 2), 32, **FEATURE_TREES, seed=4,
                           scale=0.17, features=features, launch=launch)
    _check_features(result, features, dtype)


@pytest.mark.parametrize("features", ["window+sinks", "window=4+alibi", "chunk+soft_cap+sinks"])
@pytest.mark.parametrize(("dtype", "launch"), [("float32", None), ("bfloat16", SPLIT_LAUNCH)], ids=["float32", "bf16-splits"])
def test_triton_kernel_features_in_a_draft_level(kernel_runner, features, dtype, launch):
    """A draft level (``first_column`` 6 of 9, depths 3 and 4) under features: its rows' positions come from the
    column offsets of their own columns, not of the first ones."""
    result = kernel_runner(kernel_cases.triton_feature_errors, dtype, 16, (8, 2), 32,
                           parents=[FEATURE_TREES["parents"][1]] * 2, prefix_lens=[62, 40], seed=5, scale=0.17,
                           features=features, launch=launch, level_width=3, ignored=dtype == "float32")
    _check_features(result, features, dtype)


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_triton_kernel_features_large(kernel_runner, dtype):
    """Llama-3-8B heads over 6 KV splits, a 65-row random tree and small ones, under a window of 64 with sinks and
    a soft cap, and chunks of 256 with ALiBi."""
    generator = torch.Generator().manual_seed(19)
    parents = [random_parents(n, generator) for n in (65, 4, 1)]
    launch = dict(block_m=128, block_n=64, num_splits=6, min_split_len=128, num_warps=8, num_stages=3)
    for features in ("window=64+sinks+soft_cap", "chunk=256+alibi"):
        result = kernel_runner(kernel_cases.triton_feature_errors, dtype, 16, (32, 8), 128, parents,
                               [700, 0, 250], seed=20, scale=128 ** -0.5, features=features, launch=launch)
        _check_features(result, features, dtype)


# fp8 caches (issue 70, item 2). fp8 queries: tl.dot on fp8 needs 32 along the reduced axis, so the forced splits
# take 32 positions each (5 splits, row tiles of 16)
FP8_SPLIT_LAUNCH = dict(block_m=16, block_n=32, num_splits=5, min_split_len=32, num_warps=4, num_stages=2)
# |out - ref| / max(1, |ref|) with fp8 queries: vLLM's kernel rounds each softmax weight p * 256 to e4m3 (3 mantissa
# bits, up to 2^-4 relative) for its fp8 p @ V, which the float64 reference does not; the tree kernel does the same
FP8_QUERY_TOLERANCE = 2 ** -4


@pytest.mark.parametrize(("cache", "dtype", "quantized_query", "launch", "features"), [
    ("e4m3", "float32", False, None, "plain"), ("e4m3", "float32", False, SPLIT_LAUNCH, "plain"),
    ("e4m3", "bfloat16", False, None, "plain"), ("e4m3", "bfloat16", False, SPLIT_LAUNCH, "plain"),
    ("e5m2", "float16", False, None, "plain"), ("e5m2", "float16", False, SPLIT_LAUNCH, "plain"),
    ("e4m3", "bfloat16", True, None, "plain"), ("e4m3", "float16", True, FP8_SPLIT_LAUNCH, "plain"),
    ("e4m3", "bfloat16", True, FP8_SPLIT_LAUNCH, "sinks"),
], ids=["e4m3-f32", "e4m3-f32-splits", "e4m3-bf16", "e4m3-bf16-splits", "e5m2-f16", "e5m2-f16-splits",
        "fp8q-bf16", "fp8q-f16-splits", "fp8q-bf16-splits-sinks"])
def test_triton_kernel_reads_fp8_caches_as_vllms_triton_attention(kernel_runner, cache, dtype, quantized_query,
                                                                   launch, features):
    """fp8 caches hold K / k_scale and V / v_scale (vLLM's per-tensor scales, device tensors). A query in the model's
    dtype attends to the tiles dequantized into its dtype (vLLM's ``_cast_kv_tile``); an fp8 query (vLLM's layer
    quantizes it on CUDA) to the fp8 tiles with the scales on the score and the output, its softmax weights rounded
    to fp8 for ``p @ V``. Every row equals the float64 reference over the dequantized bytes, and is far from both the
    reference over K/V and the query before quantization and the one over the bytes without their scales."""
    result = kernel_runner(kernel_cases.triton_fp8_errors, cache, dtype, quantized_query, 16, (8, 2), 32,
                           SPLIT_TREES["sizes"], SPLIT_TREES["prefix_lens"], seed=4, scale=0.5, launch=launch,
                           features=features)
    print(f"fp8 {cache} cache, {dtype}{' fp8 query' if quantized_query else ''}: {result}")
    assert result["error"] < (FP8_QUERY_TOLERANCE if quantized_query else TOLERANCE[kernel_cases.DTYPES[dtype]])
    assert result["unquantized_error"] > 0.15 and result["unscaled_error"] > 0.5


def test_triton_kernel_rounds_an_fp8_querys_softmax_weights_as_vllm(kernel_runner):
    """With an fp8 query, vLLM's kernel rounds each softmax weight ``p * 256`` to e4m3 for its fp8 ``p @ V`` and divides
    by the unrounded sum. Rows whose keys fit one K/V tile (no prefix, the running max is the row's): the tree kernel's
    fp32 rows equal a float64 reference doing the same to 1e-3 (1.5e-7 under the interpreter), while the plain float64
    reference is 0.03 off."""
    result = kernel_runner(kernel_cases.triton_fp8_weight_rounding_errors, [9, 14, 1], seed=1, scale=0.5)
    print(f"fp8 softmax weights: {result}")
    assert result["rounded_error"] < 1e-3 and result["error"] > 1e-2


def test_the_interpreters_fp8_rounding_of_softmax_weights_is_a_gpus(kernel_runner):
    """Under the interpreter (whose own fp32 -> fp8 conversion misrounds: 1.97 -> 1.0) the kernel rounds ``p * 256``
    to the fp8 grid in fp32 (``_fp8_grid``): equal to torch's round-to-nearest-even conversion, as a GPU converts, on
    every value of [0, 256] that is an fp8 value, a midpoint between two (ties to even) or next to one, and on
    random ones."""
    for cache in ("e4m3", "e5m2"):
        grid = torch.arange(256, dtype=torch.uint8).view(kernel_cases.FP8[cache]).float()
        grid = grid[(grid >= 0) & (grid <= 256)].unique()
        midpoints = (grid[1:] + grid[:-1]) / 2
        values = torch.cat([grid, midpoints, midpoints.nextafter(grid[1:]), midpoints.nextafter(grid[:-1]),
                            torch.rand(500, generator=torch.Generator().manual_seed(0)) * 256])
        assert kernel_runner(kernel_cases.fp8_grid_mismatches, cache, values.tolist()) == []


def test_fp8_arguments_are_checked():
    from vllm_easyspec.kernels.tree_attention import tree_attention_triton

    args = make_paged_batch([[-1, 0, 0]], [5], 16, 4, 2, 32, torch.float32, seed=0)
    fp8 = dict(args, key_cache=args["key_cache"].to(torch.float8_e4m3fn),
               value_cache=args["value_cache"].to(torch.float8_e4m3fn))
    one = torch.tensor(1.0)
    with pytest.raises(ValueError, match="k_scale and v_scale are given exactly for fp8 caches"):
        tree_attention_triton(**fp8, softmax_scale=0.1, k_scale=one)
    with pytest.raises(ValueError, match="k_scale and v_scale are given exactly for fp8 caches"):
        tree_attention_triton(**args, softmax_scale=0.1, k_scale=one, v_scale=one)
    query = args["query"].to(torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="a float8 query needs q_scale"):
        tree_attention_triton(**dict(fp8, query=query), softmax_scale=0.1, out=args["query"], k_scale=one, v_scale=one)
    with pytest.raises(ValueError, match="a float8 query needs out"):
        tree_attention_triton(**dict(fp8, query=query), softmax_scale=0.1, k_scale=one, v_scale=one, q_scale=one)


LLAMA3_8B = dict(num_kv_heads=8, group=4, head_dim=128, element_size=2, sm_count=132, shared_memory=227 * 1024)


@pytest.mark.parametrize("prefix", [2048, 8192])
@pytest.mark.parametrize("tree", [8, 16, 32, 64, 65])
def test_choose_launch_fills_an_h100_at_batch_1(prefix, tree):
    from vllm_easyspec.kernels.tree_attention import choose_launch

    launch = choose_launch(batch=1, max_query_len=tree, kv_len_bound=prefix + 128, **LLAMA3_8B)
    row_tiles = -(-tree * 4 // launch.block_m)
    assert launch.num_splits > 1
    assert 0.8 * 132 <= 8 * row_tiles * launch.num_splits <= 2 * 132
    assert row_tiles <= (1 if tree <= 32 else 3)  # the read count of kernels/README.md
    assert launch.min_split_len >= launch.block_m


@pytest.mark.parametrize("batch", [16, 64])
def test_choose_launch_does_not_split_full_batches(batch):
    from vllm_easyspec.kernels.tree_attention import choose_launch

    assert choose_launch(batch=batch, max_query_len=9, kv_len_bound=8192, **LLAMA3_8B).num_splits == 1


@pytest.mark.parametrize("element_size", [2, 4])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("shared_memory", [99 * 1024, 163 * 1024, 227 * 1024])
def test_choose_launch_fits_shared_memory_and_registers(element_size, head_dim, shared_memory):
    from vllm_easyspec.kernels.tree_attention import SHARED_MEMORY_MARGIN, _shared_memory_bytes, choose_launch

    for tree, kv_len_bound in [(1, 64), (16, 8192), (65, 32768)]:
        launch = choose_launch(batch=1, num_kv_heads=8, group=4, max_query_len=tree, kv_len_bound=kv_len_bound,
                               head_dim=head_dim, element_size=element_size, sm_count=132,
                               shared_memory=shared_memory)
        assert _shared_memory_bytes(launch.block_m, launch.block_n, head_dim, launch.num_stages,
                                    element_size) <= SHARED_MEMORY_MARGIN * shared_memory
        assert launch.block_m * head_dim <= 64 * 32 * launch.num_warps  # fp32 accumulator registers
        assert element_size == 2 or launch.block_m <= 64


def test_launch_rejects_bad_parameters():
    from vllm_easyspec.kernels.tree_attention import TreeAttentionLaunch

    with pytest.raises(ValueError, match="power of two"):
        TreeAttentionLaunch(block_m=24, block_n=16, num_splits=1, min_split_len=16, num_warps=4, num_stages=2)
    with pytest.raises(ValueError, match="multiple of block_n"):
        TreeAttentionLaunch(block_m=16, block_n=32, num_splits=2, min_split_len=48, num_warps=4, num_stages=2)
    with pytest.raises(ValueError, match="num_splits"):
        TreeAttentionLaunch(block_m=16, block_n=16, num_splits=0, min_split_len=16, num_warps=4, num_stages=2)


def test_features_need_their_column_offsets_and_one_value_per_head():
    from vllm_easyspec.kernels.tree_attention import tree_attention_triton
    from vllm_easyspec.tree.attention import AttentionFeatures

    args = make_paged_batch([[-1, 0, 0]], [5], 16, 4, 2, 16, torch.float32, seed=0)
    for offsets in (None, torch.zeros(1, 2, dtype=torch.int32), torch.zeros(2, 3, dtype=torch.int32)):
        with pytest.raises(ValueError, match="need column_offsets"):
            tree_attention_triton(**args, softmax_scale=0.1, features=AttentionFeatures(chunk=4),
                                  column_offsets=offsets)
    with pytest.raises(ValueError, match=r"sinks must be a contiguous \[Hq\] = \[4\]"):
        tree_attention_triton(**args, softmax_scale=0.1, features=AttentionFeatures(sinks=torch.zeros(2)))


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("block_size", [16, 32])
def test_triton_kernel_matches_reference_large(kernel_runner, dtype, block_size):
    err = kernel_runner(kernel_cases.triton_attention_error, dtype, block_size, 8, 2, 128, [64, 17, 33],
                        [300, 0, 129], seed=11, scale=128 ** -0.5)
    assert err < TOLERANCE[kernel_cases.DTYPES[dtype]]


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_triton_kernel_splits_large(kernel_runner, dtype):
    """Llama-3-8B heads (32 / 8, head size 128): a 65-row tree (3 row tiles of 128 rows) over 6 KV splits next
    to small trees, and batch 1 with the kernel's own launch over a 1000-token prefix."""
    err = kernel_runner(kernel_cases.triton_attention_error, dtype, 16, 32, 8, 128, [65, 4, 1], [700, 0, 13],
                        seed=17, scale=128 ** -0.5,
                        launch=dict(block_m=128, block_n=64, num_splits=6, min_split_len=128, num_warps=8,
                                    num_stages=3))
    assert err < TOLERANCE[kernel_cases.DTYPES[dtype]]
    err = kernel_runner(kernel_cases.triton_attention_error, dtype, 16, 32, 8, 128, [16], [1000], seed=18,
                        scale=128 ** -0.5)
    assert err < TOLERANCE[kernel_cases.DTYPES[dtype]]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_attention_over_prefix_and_tree_matches_per_row_softmax(dtype):
    generator = torch.Generator().manual_seed(3)
    batch, width, heads, kv_heads, dim, length, tree = 3, 5, 4, 2, 32, 9, 6
    query = torch.randn(batch, width, heads, dim, generator=generator).to(dtype)
    prefix_key = torch.randn(batch, kv_heads, length, dim, generator=generator).to(dtype)
    prefix_value = torch.randn(batch, kv_heads, length, dim, generator=generator).to(dtype)
    tree_key = torch.randn(batch, kv_heads, tree, dim, generator=generator).to(dtype)
    tree_value = torch.randn(batch, kv_heads, tree, dim, generator=generator).to(dtype)
    prefix_lens = torch.tensor([9, 1, 4])
    tree_mask = torch.rand(batch, width, tree, generator=generator) > 0.5
    tree_mask[:, :, 0] = True
    out = attention_over_prefix_and_tree(query, prefix_key, prefix_value, prefix_lens, tree_key, tree_value,
                                         tree_mask, 0.3)
    for r in range(batch):
        for w in range(width):
            cols = tree_mask[r, w].nonzero()[:, 0]
            k = torch.cat([prefix_key[r, :, : prefix_lens[r]], tree_key[r, :, cols]], dim=1).double()
            v = torch.cat([prefix_value[r, :, : prefix_lens[r]], tree_value[r, :, cols]], dim=1).double()
            k = k.repeat_interleave(heads // kv_heads, 0)
            v = v.repeat_interleave(heads // kv_heads, 0)
            scores = torch.einsum("hd,hld->hl", query[r, w].double(), k) * 0.3
            expected = torch.einsum("hl,hld->hd", scores.softmax(-1), v)
            tolerance = 1e-5 if dtype == torch.float32 else 3e-2
            torch.testing.assert_close(out[r, w].double(), expected, atol=tolerance, rtol=tolerance)
