"""Measuring speculative decoding with the plugin, for users, benchmarks and tests (no engine path):
:mod:`.metrics` (acceptance as vLLM defines it, from ``LLM.get_metrics()``), :mod:`.worker_extension` (the
plugin's per-worker counters through ``LLM.collective_rpc``), :mod:`.device_clock` (drafting times without a host
sync), :mod:`.step_trace` (``VLLM_EASYSPEC_STEP_TRACE``: every tree verify step, and a checker) and
:mod:`.plan_log` (``VLLM_EASYSPEC_PLAN_LOG``: the ``tree.auto`` controller's depth plans, and a summary).
"""
