"""A worker extension (``worker_extension_cls``) that lets the front end read the plugin's per-worker
counters through ``LLM.collective_rpc("easyspec_drafting_stats")`` without sending code to workers."""

from __future__ import annotations

WORKER_EXTENSION_CLS = "vllm_easyspec.integration.worker_extension.EasySpecWorkerExtension"


class EasySpecWorkerExtension:
    def easyspec_drafting_stats(self) -> dict[str, float] | None:
        from vllm_easyspec.integration.draft_proposer import read_drafting_stats

        return read_drafting_stats(self)
