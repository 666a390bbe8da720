"""Triton kernels of vllm_easyspec (``vllm_easyspec.kernels``).

* :mod:`.tree_attention`: attention of tree query tokens over vLLM's paged KV cache.
* :mod:`.kv_compaction`: in-place move of accepted tree nodes' K/V to linear slots.

Both need a Triton-capable device, or CPU tensors with ``TRITON_INTERPRET=1`` set before these
modules are imported (the variable is read when ``@triton.jit`` decorates a kernel). Torch
equivalents with the same contracts live in :mod:`vllm_easyspec.tree`.
"""
