"""A worker extension (``worker_extension_cls``) that lets the front end read the plugin's per-worker
counters through ``LLM.collective_rpc("easyspec_drafting_stats")`` without sending code to workers, and
time the drafting stage of any speculative method (``LLM.collective_rpc("easyspec_time_drafter")``) and whole
engine steps of any setup (``easyspec_time_steps`` / ``easyspec_step_stats``)."""

from __future__ import annotations

WORKER_EXTENSION_CLS = "vllm_easyspec.integration.worker_extension.EasySpecWorkerExtension"


class EasySpecWorkerExtension:
    def easyspec_drafting_stats(self) -> dict[str, float] | None:
        """This rank's drafting counters: the plugin drafter's own, else those of ``easyspec_time_drafter``."""
        from vllm_easyspec.integration.draft_proposer import read_drafting_stats
        from vllm_easyspec.integration.drafting_timer import read_timed_drafting_stats

        return read_drafting_stats(self) or read_timed_drafting_stats(self)

    def easyspec_time_drafter(self) -> bool:
        """Time every ``drafter.propose`` call of this rank, whatever the speculative method."""
        from vllm_easyspec.integration.drafting_timer import time_drafter

        return time_drafter(self)

    def easyspec_time_steps(self) -> bool:
        """Time every engine step (``execute_model`` + ``sample_tokens``) of this rank; idempotent."""
        from vllm_easyspec.integration.drafting_timer import time_steps

        return time_steps(self)

    def easyspec_step_stats(self) -> dict[str, float] | None:
        """This rank's cumulative step counters from ``easyspec_time_steps``, or None when not timed."""
        from vllm_easyspec.integration.drafting_timer import read_step_stats

        return read_step_stats(self)

    def easyspec_tree_stats(self) -> dict[str, int] | None:
        """This rank's token-tree counters (steps, tree requests, nodes verified, accepted, fallbacks)."""
        from vllm_easyspec.integration.tree_runner import read_tree_stats

        return read_tree_stats(self)
