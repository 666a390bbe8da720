"""The ``vllm.general_plugins`` entry point: vLLM calls :func:`register` in every process it starts
(front end, engine core, workers)."""

from __future__ import annotations

import os

_registered = False


def register() -> None:
    """Install the plugin into this process. Idempotent; refuses any vLLM but 0.32.0 and 0.33.0."""
    global _registered
    if _registered:
        return
    # Only engines with easyspec options are moved to vLLM's V1 model runner (integration/model_runner_choice.py);
    # the process environment is left as it is, so every other engine keeps vLLM's own choice (V2 on a GPU).
    from vllm_easyspec import integration

    integration.install()
    _registered = True


def plugin_state() -> dict[str, object]:
    """What this process knows about the plugin; the tests read it from workers via collective_rpc."""
    from vllm_easyspec import integration

    return {"pid": os.getpid(), "registered": _registered, "patched": integration.is_installed()}
