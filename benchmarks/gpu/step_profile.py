"""Where a decode step's time goes, from torch's profiler (``real_model.py run --profile``, issue 59 item 3).

Inside an engine's worker, :func:`start` profiles the host and the GPU; :func:`summary` folds what one untimed pass
recorded into per-step figures: vLLM's runner scopes (``gpu_model_runner: forward``, ``sample``, ``draft``,
``bookkeep``, ...; they exist only with ``VLLM_CUSTOM_SCOPES_FOR_PROFILING=1`` in the engine's environment), each
with its host time and the GPU time of the kernels it launched; the kernels by kind (attention, GEMM, the rest);
and the host gap, the profile's wall time in which no kernel ran (kernels of different streams counted apart, so
overlap makes the gap an upper bound). Steps are counted by the ``forward`` scope.
"""

from __future__ import annotations

import re
import time
from typing import Any

SCOPE_PREFIX = "gpu_model_runner: "
KERNEL_KINDS = (("attention", re.compile(r"attn|attention|flash|fmha|paged", re.IGNORECASE)),
                ("gemm", re.compile(r"gemm|matmul|cutlass|nvjet|xmma|cublas|splitk", re.IGNORECASE)))


def start() -> Any:
    """A running profile of this process (the GPU too where there is one)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    profiler = profile(activities=activities)
    profiler.start()
    profiler.started_at = time.perf_counter()
    return profiler


def summary(profiler: Any) -> dict[str, Any]:
    """Stop ``profiler`` (from :func:`start`) and summarise it per decode step (module docstring)."""
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()
    profiler.stop()
    wall_ms = 1e3 * (time.perf_counter() - profiler.started_at)
    return summarise(profiler.events(), wall_ms)


def summarise(events: Any, wall_ms: float) -> dict[str, Any]:
    """Per-step figures from profiler ``events`` over ``wall_ms`` of wall time (see the module docstring)."""
    from torch.autograd import DeviceType

    scopes: dict[str, dict[str, float]] = {}
    kernels = {kind: 0.0 for kind, _ in KERNEL_KINDS} | {"other": 0.0}
    for event in events:
        if event.device_type == DeviceType.CUDA:
            kind = next((kind for kind, pattern in KERNEL_KINDS if pattern.search(event.name)), "other")
            kernels[kind] += event.time_range.elapsed_us() / 1e3
        elif event.name.startswith(SCOPE_PREFIX):
            scope = scopes.setdefault(event.name[len(SCOPE_PREFIX):], {"calls": 0, "host_ms": 0.0, "gpu_ms": 0.0})
            scope["calls"] += 1
            scope["host_ms"] += event.cpu_time_total / 1e3
            scope["gpu_ms"] += event.device_time_total / 1e3
    steps = int(scopes.get("forward", {}).get("calls", 0))
    per_step = max(steps, 1)
    gpu_ms = sum(kernels.values())
    return {
        "steps": steps,
        "wall_ms_per_step": wall_ms / per_step,
        "scopes_per_step": {name: {"host_ms": s["host_ms"] / per_step, "gpu_ms": s["gpu_ms"] / per_step}
                            for name, s in sorted(scopes.items())},
        "kernels_gpu_ms_per_step": {kind: ms / per_step for kind, ms in kernels.items()},
        "host_gap_ms_per_step": max(0.0, wall_ms - gpu_ms) / per_step,
    }
