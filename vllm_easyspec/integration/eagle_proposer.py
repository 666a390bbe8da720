"""The plugin's EAGLE proposer: vLLM's ``EagleProposer`` drafting token trees (EAGLE-2 dynamic or static).

Invariants:
- the runner builds it only with ``additional_config["easyspec"]["tree"]``
  (:class:`~vllm_easyspec.integration.tree_runner.TreeRunnerMixin`); without a tree vLLM's own
  ``EagleProposer`` runs, untouched;
- everything but ``propose`` is vLLM's: loading the head (EAGLE-1/2 and EAGLE-3 checkpoints in the formats
  vLLM reads), sharing the target's embeddings and LM head, the first pass's inputs and KV slots;
- ``propose`` drafts a tree with :class:`~vllm_easyspec.integration.tree_proposer.TreeDrafting`: the first
  pass over the accepted branch with the target's hidden states of that branch, then one head forward per
  tree level, each node fed its parent's hidden state, with tree attention over the head's KV; where
  ``budget_by_batch`` asks for a chain, vLLM's own ``EagleProposer.propose`` drafts it.
"""

from __future__ import annotations

import time
from typing import Any

import torch
from vllm.config import VllmConfig
from vllm.v1.spec_decode.eagle import EagleProposer

from vllm_easyspec.easyspec.config import EasySpecConfigError, parse_easyspec_config
from vllm_easyspec.integration import plugin_logger
from vllm_easyspec.integration.draft_proposer import PROPOSE_SIGNATURE, DraftingStats
from vllm_easyspec.integration.tree_proposer import TreeDrafting

logger = plugin_logger(__name__)

TREE_EAGLE_METHODS = ("eagle", "eagle3")


class EasySpecEagleProposer(EagleProposer):
    def __init__(self, vllm_config: VllmConfig, device: torch.device, runner=None) -> None:
        super().__init__(vllm_config=vllm_config, device=device, runner=runner)
        self.easyspec_runner = runner
        self.easyspec_config = parse_easyspec_config(vllm_config.additional_config)
        if self.easyspec_config is None or self.easyspec_config.tree is None:
            raise EasySpecConfigError("EasySpecEagleProposer drafts trees only; vLLM's EagleProposer drafts chains")
        if self.method not in TREE_EAGLE_METHODS:
            raise EasySpecConfigError(
                f"easyspec.tree drafts with EAGLE heads of method {' or '.join(TREE_EAGLE_METHODS)}, not "
                f"{self.method!r}; remove easyspec.tree for this method"
            )
        self.drafting_stats = DraftingStats()
        self.tree_drafting = TreeDrafting(self, self.easyspec_config.tree, draft_chain=super().propose)
        logger.info("EasySpec %s head drafts trees: %s", self.method, self.easyspec_config.tree.describe())

    def propose(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        start = time.perf_counter()
        bound = PROPOSE_SIGNATURE.bind(self, *args, **kwargs)
        arguments = {name: value for name, value in bound.arguments.items() if name != "self"}
        draft_token_ids = self.tree_drafting.propose(**arguments)
        self.drafting_stats.count_step(start, draft_token_ids)
        return draft_token_ids
