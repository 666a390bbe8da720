"""Make vLLM's V1 model runner construct the plugin's draft-model proposer.

The runner picks its proposer with a hard-coded if/elif over module globals, so the seam is the global
name: the subclass behaves exactly like vLLM's own class unless ``additional_config["easyspec"]`` is set,
and the runner's ``isinstance(self.drafter, DraftModelProposer | ...)`` checks accept it.
"""

from __future__ import annotations


def install() -> None:
    import vllm.v1.worker.gpu_model_runner as gpu_model_runner

    from vllm_easyspec.integration.draft_proposer import EasySpecDraftProposer

    # Replaces the module global vllm.v1.worker.gpu_model_runner.DraftModelProposer
    # (vllm.v1.spec_decode.draft_model.DraftModelProposer), which GPUModelRunner.__init__ instantiates.
    gpu_model_runner.DraftModelProposer = EasySpecDraftProposer
