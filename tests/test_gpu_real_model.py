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
