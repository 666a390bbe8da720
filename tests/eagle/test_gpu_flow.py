"""The pieces of the GPU head-training flow that run without a GPU: the trainer on a second device (the
stand-in of ``fake_device``, which refuses every host/device mix CUDA refuses), features kept in memory,
both generation rounds with one engine, deadlines."""

from __future__ import annotations

import json

import torch
from eagle_helpers import train_args
from fake_device import on_host, second_device
from safetensors.torch import load_file

from vllm_easyspec_train.trainer import fit_steps, train


def _weights(d):
    return load_file(str(d / "model.safetensors"))


def test_training_on_a_second_device_gives_the_host_run_s_head(tmp_path, tiny_llama_dir, tiny_text_dir):
    common = ["--draft-vocab-size", "40", "--feature-store", "memory", "--max-steps", "4", "--eval-every", "2"]
    host = train(train_args(tiny_llama_dir, tmp_path / "h", tmp_path / "w", tiny_text_dir, "eagle3", common))
    with second_device() as device:
        dev = train(train_args(tiny_llama_dir, tmp_path / "d", tmp_path / "w2", tiny_text_dir, "eagle3",
                               [*common, "--device", str(device)]))
    a, b = _weights(tmp_path / "h"), _weights(tmp_path / "d")
    assert set(a) == set(b) and all(on_host(b[k]).dtype == a[k].dtype for k in a)
    # the same values up to rounding: ops that run fused on the host (the target's attention) run
    # decomposed on the stand-in device, so the features differ in their last bits
    assert torch.equal(a["d2t"], on_host(b["d2t"])) and torch.equal(a["t2d"], on_host(b["t2d"]))
    for k in set(a) - {"d2t", "t2d"}:
        scale = a[k].float().abs().max()
        assert (a[k].float() - on_host(b[k]).float()).abs().max() <= 2 * 2**-7 * scale, k  # 2 bf16 steps
    assert json.loads((tmp_path / "d" / "config.json").read_text()) == json.loads(
        (tmp_path / "h" / "config.json").read_text())
    assert abs(dev["heldout"]["agreement"][0] - host["heldout"]["agreement"][0]) <= 0.05
    assert dev["manifest"]["training"]["device"] == "meta"
    assert dev["manifest"]["data"]["feature_cache"] == "memory:meta"
    assert not list((tmp_path / "w2").glob("features-*"))  # the memory store writes nothing


def test_fit_steps_keeps_a_run_inside_its_time():
    assert fit_steps(10, 1000, seconds_left=50.0, step_seconds=0.5) == 10 + 90
    assert fit_steps(10, 50, seconds_left=50.0, step_seconds=0.5) == 50  # the plan fits: unchanged
    assert fit_steps(10, 1000, seconds_left=-3.0, step_seconds=0.5) == 11  # at least one more step
