"""Triton kernels: :mod:`.tree_attention` (tree query tokens over vLLM's paged KV cache) and :mod:`.kv_compaction`
(accepted nodes' K/V moved to linear slots). Both need a Triton-capable device, or CPU tensors with
``TRITON_INTERPRET=1`` set before these modules are imported. Contracts and design: ``kernels/README.md``."""
