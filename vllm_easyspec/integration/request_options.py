"""``min_p`` and ``logit_bias`` with token trees: accepted by the front end, held by the worker's input batch.

vLLM 0.32 refuses both whenever a speculative config exists and builds no processor for them; a tree engine's
sampler applies both per node (:mod:`~vllm_easyspec.integration.node_logits`), so for such an engine the front
end's check (``SamplingParams._validate_spec_decode``) passes them, told by the engine's input processor
(``InputProcessor._validate_params``, which holds the whole ``VllmConfig``) for the duration of its check, and the
runner's input batch gets vLLM's built-in processors as without speculation (``build_logitsprocs``).

Invariant: an engine without ``easyspec.tree`` refuses and builds exactly what vLLM does; custom logits processors
are refused with speculation as vLLM refuses them.
"""

from __future__ import annotations

import contextvars
import functools

_VERIFIES_TREES: contextvars.ContextVar[bool] = contextvars.ContextVar("easyspec_verifies_trees", default=False)


def install() -> None:
    import vllm.v1.worker.gpu_model_runner as gpu_model_runner
    from vllm.sampling_params import SamplingParams
    from vllm.v1.engine.input_processor import InputProcessor

    if getattr(SamplingParams._validate_spec_decode, "_easyspec_patched", False):
        return
    # Replaces the module global vllm.v1.worker.gpu_model_runner.build_logitsprocs (imported there from
    # vllm.v1.sample.logits_processor; GPUModelRunner.__init__, which CPUModelRunner runs, builds the input batch's
    # processors with it): a tree engine gets vLLM's built-in processors.
    gpu_model_runner.build_logitsprocs = _build_logitsprocs(gpu_model_runner.build_logitsprocs)
    # Replaces vllm.sampling_params.SamplingParams._validate_spec_decode: vLLM's check, unless a tree engine's
    # input processor is checking the request.
    SamplingParams._validate_spec_decode = _validate_spec_decode(SamplingParams._validate_spec_decode)
    # Replaces vllm.v1.engine.input_processor.InputProcessor._validate_params: vLLM's, told whether the engine
    # verifies trees.
    InputProcessor._validate_params = _validate_params(InputProcessor._validate_params)


def _build_logitsprocs(original):
    @functools.wraps(original)
    def build_logitsprocs(vllm_config, device, is_pin_memory, is_pooling_model, custom_logitsprocs=()):
        from vllm.v1.sample.logits_processor import BUILTIN_LOGITS_PROCESSORS, LogitsProcessors

        from vllm_easyspec.integration.options import tree_options

        if is_pooling_model or custom_logitsprocs or tree_options(vllm_config) is None:
            return original(vllm_config, device, is_pin_memory, is_pooling_model, custom_logitsprocs)
        return LogitsProcessors(ctor(vllm_config, device, is_pin_memory) for ctor in BUILTIN_LOGITS_PROCESSORS)

    return build_logitsprocs


def _validate_spec_decode(original):
    @functools.wraps(original)
    def validate_spec_decode(self, speculative_config) -> None:
        if _VERIFIES_TREES.get():
            return  # min_p and logit_bias, the only options vLLM refuses here, are applied per node
        original(self, speculative_config)

    validate_spec_decode._easyspec_patched = True
    return validate_spec_decode


def _validate_params(original):
    @functools.wraps(original)
    def validate_params(self, params, *args, **kwargs):
        from vllm_easyspec.integration.options import tree_options

        token = _VERIFIES_TREES.set(tree_options(self.vllm_config) is not None)
        try:
            return original(self, params, *args, **kwargs)
        finally:
            _VERIFIES_TREES.reset(token)

    return validate_params
