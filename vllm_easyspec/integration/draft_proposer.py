"""The EasySpec draft-model proposer: vLLM's ``DraftModelProposer`` plus the plugin's options.

Invariant: without ``additional_config["easyspec"]`` every method behaves exactly as vLLM's.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass

import torch
from vllm.config import VllmConfig
from vllm.logger import init_logger
from vllm.v1.spec_decode.draft_model import DraftModelProposer

from vllm_easyspec.config import EasySpecConfig, parse_easyspec_config

logger = init_logger(__name__)

LOG_EVERY_STEPS = 200


@dataclass
class DraftingStats:
    """Cumulative drafting-stage counters of one worker (one per TP rank)."""

    steps: int = 0
    drafted_requests: int = 0
    drafting_seconds: float = 0.0

    @property
    def seconds_per_step(self) -> float:
        return self.drafting_seconds / self.steps if self.steps else 0.0


class EasySpecDraftProposer(DraftModelProposer):
    def __init__(self, vllm_config: VllmConfig, device: torch.device, runner=None):
        super().__init__(vllm_config=vllm_config, device=device, runner=runner)
        self.easyspec_config: EasySpecConfig | None = parse_easyspec_config(vllm_config.additional_config)
        self.drafting_stats = DraftingStats()

    def propose(self, *args, **kwargs) -> torch.Tensor:
        if self.easyspec_config is None:
            return super().propose(*args, **kwargs)
        start = time.perf_counter()
        draft_token_ids = super().propose(*args, **kwargs)
        if draft_token_ids.is_cuda:
            torch.cuda.synchronize(draft_token_ids.device)
        stats = self.drafting_stats
        stats.drafting_seconds += time.perf_counter() - start
        stats.steps += 1
        stats.drafted_requests += int(draft_token_ids.shape[0])
        if stats.steps % LOG_EVERY_STEPS == 0:
            logger.info(
                "EasySpec drafting: %d steps, %.2f ms per step", stats.steps, 1e3 * stats.seconds_per_step
            )
        return draft_token_ids


def read_drafting_stats(worker) -> dict[str, float] | None:
    """Worker-side reader for ``LLM.collective_rpc``: this rank's drafting counters, or None."""
    drafter = getattr(worker.model_runner, "drafter", None)
    if not isinstance(drafter, EasySpecDraftProposer) or drafter.easyspec_config is None:
        return None
    stats = drafter.drafting_stats
    return asdict(stats) | {"seconds_per_step": stats.seconds_per_step}
