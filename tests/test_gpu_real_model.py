"""The real-model GPU window's pieces that need no engine: the target GGUF cut into part calls and checked back
together (benchmarks/gpu/target_parts.py), and the cells the run measures (benchmarks/gpu/real_model.py)."""

from __future__ import annotations

import hashlib
import random
import subprocess

from benchmarks.gpu.real_model_setups import RunSettings, make_cells
from benchmarks.gpu.target_parts import check_device_file, cut_into_parts


def test_a_gguf_cut_into_part_calls_is_checked_back_together_and_a_bad_part_is_named(tmp_path):
    data = random.Random(0).randbytes(10_240)  # parts of 4,096, 4,096 and 2,048 bytes
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(data)
    manifest = cut_into_parts(gguf, "toy", hashlib.sha256(data).hexdigest(), 4096, root=tmp_path)
    assert [(p.folder, p.size, p.file_size_after) for p in manifest.parts] == [
        (".gpu/target_00", 4096, 4096), (".gpu/target_01", 4096, 8192), (".gpu/target_02", 2048, 10240)]
    device = tmp_path / "device.gguf"
    for part in manifest.parts:  # the part calls' own commands, as the device runs them
        subprocess.run(part.command(str(device)), shell=True, cwd=tmp_path, check=True, capture_output=True)
    assert device.read_bytes() == data and check_device_file(device, manifest) is None

    device.write_bytes(data[:4096] + data[:4096])  # part 0 sent twice, part 2 not yet
    problem = check_device_file(device, manifest)
    assert "part 1 (.gpu/target_01) is different" in problem and f"truncate -s 4096 {device}" in problem
    device.write_bytes(data[:8192])
    assert "part 2 (.gpu/target_02) is missing" in check_device_file(device, manifest)
    device.write_bytes(data + data[-2048:])
    assert f"truncate -s 10240 {device}" in check_device_file(device, manifest)
    assert "does not exist" in check_device_file(tmp_path / "absent.gguf", manifest)


def test_every_cell_of_the_gpu_window_has_distinct_prompts_and_batch_32_is_full():
    cells = make_cells(RunSettings())
    assert [c["name"] for c in cells] == ["prompts-b1", "prompts-b32", "heldout-b1", "heldout-b32"]
    for cell in cells:
        assert len(set(cell["prompts"])) == len(cell["prompts"]) == (8 if cell["batch_size"] == 1 else 32)
        assert cell["max_tokens"] == 128


def test_each_window_runs_its_own_setups_after_the_reference():
    from benchmarks.gpu.real_model_setups import SETUPS, window_setups

    assert RunSettings().setups == window_setups(1) == ("vanilla", "eagle3_k3", "eagle_tree", "eagle_auto",
                                                        "vanilla_plugin")
    assert window_setups(2) == ("vanilla", "eagle_tree_uniform", "eagle3_k2", "eagle3_k4", "eagle3_adaptive",
                                "vanilla_triton")
    by_name = {s.name: s for s in SETUPS}
    assert by_name["eagle_tree_uniform"].additional_config["easyspec"]["tree"]["uniform"] is True
    assert by_name["vanilla_triton"].engine == {"attention_backend": "TRITON_ATTN"}
    assert not any(by_name[name].plugin for name in ("eagle3_k2", "eagle3_k4", "eagle3_adaptive", "vanilla_triton"))


def test_a_profiled_pass_is_folded_per_step_into_the_runners_scopes():
    """``step_profile`` on this CPU: vLLM's runner scopes (as ``VLLM_CUSTOM_SCOPES_FOR_PROFILING`` names them) per
    step, counted by ``forward``; no GPU, so no kernel time and every wall millisecond a host gap."""
    import torch
    from torch.profiler import record_function

    from benchmarks.gpu import step_profile

    profiler = step_profile.start()
    x = torch.randn(64, 64)
    for _ in range(3):
        with record_function("gpu_model_runner: forward"):
            x = torch.tanh(x @ x)
        with record_function("gpu_model_runner: sample"):
            x.argmax()
    with record_function("unrelated"):
        x.sum()
    result = step_profile.summary(profiler)
    assert result["steps"] == 3 and set(result["scopes_per_step"]) == {"forward", "sample"}
    assert result["scopes_per_step"]["forward"]["host_ms"] > 0 == result["scopes_per_step"]["forward"]["gpu_ms"]
    assert result["kernels_gpu_ms_per_step"] == {"attention": 0.0, "gemm": 0.0, "other": 0.0}
    assert result["host_gap_ms_per_step"] == result["wall_ms_per_step"]
