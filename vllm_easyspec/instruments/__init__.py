"""Measuring speculative decoding with the plugin, for users, benchmarks and tests (no engine path).

* :mod:`.metrics`: mean acceptance length and per-position acceptance as vLLM defines them, from
  ``LLM.get_metrics()``.
* :mod:`.worker_extension`: pass ``worker_extension_cls=WORKER_EXTENSION_CLS`` to ``LLM`` to read the plugin's
  per-worker counters (drafting time, tree steps) with ``LLM.collective_rpc``.
* :mod:`.device_clock`: the plugin drafter's own drafting-time counters, read without a host sync on the step.
* :mod:`.step_trace`: ``VLLM_EASYSPEC_STEP_TRACE`` traces every tree verify step; its command checks a trace.
* :mod:`.plan_log`: ``VLLM_EASYSPEC_PLAN_LOG`` logs the ``tree.auto`` controller's depth plan every step (each
  option's predicted gain and rate); its command summarises a log by batch size.
"""
