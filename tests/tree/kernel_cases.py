"""Kernel checks executed by ``conftest.kernel_runner``: in-process on a GPU, or in a worker process
running Triton's interpreter on CPU. Each function builds its inputs from plain arguments (so it can be
sent to the worker) and returns plain results for the test to assert on."""

from __future__ import annotations

import torch
from tree_testlib import make_paged_batch, random_parents

from vllm_easyspec.tree.attention import tree_attention, tree_attention_reference

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def _device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def triton_attention_error(dtype: str, block_size: int, num_q_heads: int, num_kv_heads: int, head_dim: int,
                           sizes: list[int], prefix_lens: list[int], seed: int, scale: float,
                           forest_request: int | None = None) -> float:
    """Max error of the Triton kernel against the float64 reference (unrounded), measured as
    ``|out - ref| / max(1, |ref|)``: absolute for outputs up to 1, relative above (storing the output
    in bf16 alone costs up to 2^-9 * |ref|)."""
    from vllm_easyspec.kernels.tree_attention import tree_attention_triton

    gen = torch.Generator().manual_seed(seed)
    parents = [random_parents(n, gen, forest=(i == forest_request)) for i, n in enumerate(sizes)]
    args = make_paged_batch(parents, prefix_lens, block_size, num_q_heads, num_kv_heads, head_dim,
                            DTYPES[dtype], seed=seed + 1, device=_device())
    out = tree_attention_triton(**args, softmax_scale=scale)
    assert out.dtype == DTYPES[dtype] and out.shape == args["query"].shape
    ref = tree_attention_reference(**{k: v.cpu() for k, v in args.items()}, softmax_scale=scale,
                                   out_dtype=torch.float32)
    return ((out.cpu().float() - ref).abs() / ref.abs().clamp_min(1.0)).max().item()


def dispatcher_uses_triton(seed: int) -> float:
    """``tree_attention(backend="triton")`` against the CPU path on the same inputs."""
    gen = torch.Generator().manual_seed(seed)
    args = make_paged_batch([random_parents(4, gen), random_parents(3, gen)], [5, 40], 16, 2, 1, 16,
                            torch.float32, seed=seed, device=_device())
    out = tree_attention(**args, backend="triton")
    cpu = tree_attention(**{k: v.cpu() for k, v in args.items()}, backend="cpu")
    return (out.cpu() - cpu).abs().max().item()


def triton_compaction(caches: list[torch.Tensor], src_slots: torch.Tensor, dst_slots: torch.Tensor
                      ) -> list[torch.Tensor]:
    """Run the Triton compaction on copies of ``caches``; return them (on CPU)."""
    from vllm_easyspec.kernels.kv_compaction import compact_kv_triton

    moved = [c.clone().to(_device()) for c in caches]
    compact_kv_triton(moved, src_slots.to(_device()), dst_slots.to(_device()))
    return [c.cpu() for c in moved]
