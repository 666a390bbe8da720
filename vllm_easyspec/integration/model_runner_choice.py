"""The seam ``VllmConfig.use_v2_model_runner``: an engine whose ``additional_config`` has ``easyspec`` runs vLLM's V1
model runner, which the plugin is written against; every other engine keeps vLLM's own choice. Replaces the
property ``vllm.config.vllm.VllmConfig.use_v2_model_runner`` (behind ``compat.check_vllm_version``).

Invariant: an engine with ``easyspec`` options never runs Model Runner V2. Where the user forces V2
(``VLLM_USE_V2_MODEL_RUNNER=1``) or asks for a feature that only V2 has, the engine is refused with one line
that names the variable or the feature and the fix.
"""

from __future__ import annotations

from typing import Any

from vllm_easyspec.easyspec.config import ADDITIONAL_CONFIG_KEY

_VLLM_CHOICE_ATTRIBUTE = "_easyspec_vllm_choice"  # vLLM's own property, kept on the class


class ModelRunnerConflictError(RuntimeError):
    """An engine with ``easyspec`` options would need Model Runner V2. Not a ``ValueError``: vLLM first reads
    the property while pydantic validates ``VllmConfig``, which would bury a ``ValueError`` in a
    multi-line ``ValidationError``; this one reaches the user as the one line it is."""


def install() -> None:
    from vllm.config.vllm import VllmConfig

    if getattr(VllmConfig, _VLLM_CHOICE_ATTRIBUTE, None) is not None:
        return
    setattr(VllmConfig, _VLLM_CHOICE_ATTRIBUTE, VllmConfig.use_v2_model_runner)
    VllmConfig.use_v2_model_runner = property(_use_v2_model_runner, doc=_use_v2_model_runner.__doc__)


def asks_for_easyspec(vllm_config: Any) -> bool:
    """Whether the engine's ``additional_config`` has the ``easyspec`` key (whatever its value)."""
    additional = getattr(vllm_config, "additional_config", None)
    try:
        return bool(additional) and ADDITIONAL_CONFIG_KEY in additional
    except TypeError:  # an additional_config object that is not a mapping
        return False


def vllm_choice(vllm_config: Any) -> bool:
    """vLLM's own answer to ``use_v2_model_runner`` for this config, as if the plugin were not installed."""
    from vllm.config.vllm import VllmConfig

    original = getattr(VllmConfig, _VLLM_CHOICE_ATTRIBUTE, None) or VllmConfig.use_v2_model_runner
    return original.fget(vllm_config)


def _use_v2_model_runner(self: Any) -> bool:
    """False for an engine with ``easyspec`` options (or one line of error where it would need V2); vLLM's own
    choice for every other engine."""
    if not asks_for_easyspec(self):
        return vllm_choice(self)
    import vllm.envs as envs

    if envs.VLLM_USE_V2_MODEL_RUNNER:
        raise ModelRunnerConflictError(
            "additional_config.easyspec runs on vLLM's V1 model runner, but VLLM_USE_V2_MODEL_RUNNER=1 forces "
            "Model Runner V2; unset VLLM_USE_V2_MODEL_RUNNER (or set it to 0), or remove additional_config.easyspec"
        )
    attention = getattr(self, "attention_config", None)
    needs_v2 = [
        name
        for name, present in (
            ("HiSparse attention (attention_config.hisparse_config)",
             getattr(attention, "hisparse_config", None) is not None),
            ("watermarking (watermark_config)", getattr(self, "watermark_config", None) is not None),
            ("draft lm-head quantization (speculative_config.draft_lm_head_quantization, vLLM 0.33)",  # else ignored
             getattr(getattr(self, "speculative_config", None), "draft_lm_head_quantization", None) is not None),
        )
        if present
    ]  # fmt: skip
    if needs_v2:
        raise ModelRunnerConflictError("additional_config.easyspec runs on vLLM's V1 model runner, but "
                                       f"{needs_v2[0]} needs Model Runner V2; remove one of the two")
    return False
