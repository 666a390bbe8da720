"""A Triton kernel applying the tree kernel's ``_fp8_grid`` to a vector (``kernel_cases.fp8_grid_mismatches``), in its
own module so that it is built where it runs (imported in the interpreter worker, after ``TRITON_INTERPRET`` is set)."""

from __future__ import annotations

import triton
import triton.language as tl

from vllm_easyspec.kernels.tree_attention import _fp8_grid


@triton.jit
def fp8_grid_kernel(x_ptr, y_ptr, n, MANTISSA: tl.constexpr, MIN_EXP: tl.constexpr, BLOCK: tl.constexpr):
    offsets = tl.arange(0, BLOCK)
    tl.store(y_ptr + offsets, _fp8_grid(tl.load(x_ptr + offsets, mask=offsets < n), MANTISSA, MIN_EXP),
             mask=offsets < n)
