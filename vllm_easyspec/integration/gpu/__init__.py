"""Seams that exist for vLLM's GPU build (CUDA / ROCm) only: its Triton attention backend."""
